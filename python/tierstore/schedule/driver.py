"""Schedule: the object a training loop asks, step by step, whether to publish now; it fits, plans and
re-plans as the loss comes in, and falls back to a fixed interval when the curve cannot be trusted."""

from __future__ import annotations

import math
import time
import warnings

import numpy as np

from tierstore.schedule.curves import CurveFit, ScheduleWarning, fit_curves, plausible
from tierstore.schedule.plan import (
    Costs,
    best_interval,
    greedy_plan,
    greedy_threshold,
    paced_steps,
)


class Schedule:
    """Decides, step by step, whether to publish the model now.

    Training reports every step's loss to `should_publish`. Before step `warmup_steps` the answer is no; at
    the first step from it on the four curves are fitted, the schedule is planned and the model is published (the
    consumer's first). From then on the answer follows the plan, and every `refit_every` steps the curves
    are refitted on all the losses so far and the rest of the run is re-planned.

    Args:
        policy: `"greedy"` (Viper's irregular schedule) or `"fixed"` (the CIL-minimising interval).
        total_steps: the step training ends at (the plan runs to it).
        warmup_steps: how many steps are observed before the first fit and publish.
        max_publishes: at most this many publishes, the one ending the warm-up included (None: no limit).
        costs: the measured costs (see `Costs`; `observe` updates them). The time per step is measured
            here, from the calls, unless `costs.train_s` is given.
        horizon_s: the seconds over which the consumer's CIL is minimised; default: the rest of training.
        refit_every: steps between refits; default: `warmup_steps`.
        fallback_interval: the interval used when no curve can be trusted; default: the rest of the run
            split evenly over `max_publishes`, else `warmup_steps`.
        min_interval: no two publishes closer than this many steps.
        min_points: fewer finite losses than this at the end of the warm-up is too few to fit.
        pace: for `"greedy"` with `max_publishes`: by the fraction `f` of the steps after the warm-up, at
            most the share `f ** pace` of the budget is spent (see `paced_steps`); None: Viper's unpaced
            rule, which trusts the predicted tail entirely.
    """

    def __init__(
        self,
        policy: str = "greedy",
        *,
        total_steps: int,
        warmup_steps: int,
        max_publishes: int | None = None,
        costs: Costs | None = None,
        horizon_s: float | None = None,
        refit_every: int | None = None,
        fallback_interval: int | None = None,
        min_interval: int = 1,
        min_points: int = 5,
        pace: float | None = 0.5,
    ) -> None:
        if policy not in ("greedy", "fixed"):
            raise ValueError(f'schedule policy {policy!r}: use "greedy" or "fixed"')
        if total_steps <= warmup_steps or warmup_steps < 1:
            raise ValueError(
                f"warmup_steps {warmup_steps} and total_steps {total_steps}: the warm-up needs at least "
                "one step and must end before training does"
            )
        if max_publishes is not None and max_publishes < 1:
            raise ValueError(f"max_publishes {max_publishes}: allow at least the warm-up's publish (1)")
        if pace is not None and not 0 < pace <= 1:
            raise ValueError(f"pace {pace}: use a number in (0, 1] (1 spends the budget evenly), or None")
        self.policy = policy
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps
        self.max_publishes = max_publishes
        self.costs = costs if costs is not None else Costs()
        self._measure_train = self.costs.train_s == 0.0
        self.horizon_s = horizon_s
        self.refit_every = refit_every or warmup_steps
        self.min_interval = max(1, min_interval)
        self.min_points = max(3, min_points)
        self.pace = pace
        if fallback_interval is None:
            rest = total_steps - warmup_steps
            fallback_interval = (
                max(1, math.ceil(rest / max_publishes)) if max_publishes is not None else warmup_steps
            )
        self.fallback_interval = max(1, fallback_interval)
        self._steps: list[int] = []
        self._losses: list[float] = []
        self._last_call: tuple[int, float] | None = None
        self._published_since_call = False
        self._bad_warned = False
        self.published: list[int] = []
        self.fit: CurveFit | None = None
        self.fits: list[CurveFit] = []
        self.fit_seconds: list[float] = []
        self.interval: int | None = None
        self.threshold: float | None = None
        self.plan: list[int] = []
        # The pacing's earliest step for each publish after the warm-up's (greedy with a budget only).
        self.not_before: list[int] = []
        self.fallback: str | None = None
        self._next_refit: int | None = None
        self._warmup_end = warmup_steps

    # Measurements ------------------------------------------------------------------------------------
    def observe(
        self,
        *,
        train_s: float | None = None,
        publish_s: float | None = None,
        load_s: float | None = None,
        infer_s: float | None = None,
    ) -> None:
        """Feeds measured costs (see `Costs`); the next re-plan uses them."""
        if train_s is not None:
            self._measure_train = False
            self.costs.observe_train(train_s)
        if publish_s is not None:
            self.costs.observe_publish(publish_s)
        if load_s is not None:
            self.costs.observe_load(load_s)
        if infer_s is not None:
            self.costs.observe_infer(infer_s)

    def _time_step(self, step: int) -> None:
        now = time.perf_counter()
        if self._measure_train and self._last_call is not None and not self._published_since_call:
            prev_step, prev_t = self._last_call
            if step > prev_step:
                self.costs.observe_train((now - prev_t) / (step - prev_step))
        self._last_call = (step, now)
        self._published_since_call = False

    # Planning ----------------------------------------------------------------------------------------
    def _fall_back(self, why: str) -> None:
        if self.fallback is None:
            warnings.warn(
                f"tierstore schedule: {why}; publishing every {self.fallback_interval} steps instead "
                "(pass fallback_interval= to choose the interval)",
                ScheduleWarning,
                stacklevel=4,
            )
        self.fallback = why
        self.interval = self.fallback_interval
        self.threshold = None
        self.plan = []

    def _replan(self, step: int) -> None:
        self._next_refit = step + self.refit_every
        if self.fallback is not None:
            return
        n = len(self._losses)
        if n < self.min_points:
            self._fall_back(
                f"{n} finite losses by step {step}, too few to fit a learning curve (need {self.min_points})"
            )
            return
        t0 = time.perf_counter()
        try:
            fits = fit_curves(self._steps, self._losses)
        except (ValueError, np.linalg.LinAlgError, FloatingPointError) as e:
            self._fall_back(f"the learning curve could not be fitted at step {step} ({e})")
            return
        self.fit_seconds.append(time.perf_counter() - t0)
        # Viper keeps the lowest MSE; a curve that goes below zero before training ends (a line fitted to a
        # warm-up that is still falling steadily) would plan for losses that cannot happen, so it is passed
        # over for the next best.
        usable = [f for f in fits if plausible(f, self.total_steps)]
        if not usable:
            self._fall_back(
                f"every learning curve fitted at step {step} predicts a negative loss by step "
                f"{self.total_steps} (best fit {fits[0].family} {_fmt(fits[0].params)})"
            )
            return
        fit = usable[0]
        first = float(np.mean(self._losses[: max(1, n // 5)]))
        recent = float(np.mean(self._losses[-max(1, n // 5) :]))
        if not fit.decreasing(self._steps[0], self.total_steps) or recent > first:
            self._fall_back(
                f"the loss is not falling by step {step} (best fit {fit.family} {_fmt(fit.params)}; "
                f"mean of the first fifth {first:.4g}, of the last fifth {recent:.4g}): the run may be diverging"
            )
            return
        self.fits, self.fit = fits, fit
        last = self.published[-1] if self.published else step
        left = None if self.max_publishes is None else self.max_publishes - len(self.published)
        # Planned from the last publish (it is the model the consumer serves now), with what is left of
        # the budget counting that publish again.
        budget = None if left is None else left + (1 if self.published else 0)
        horizon = (
            self.horizon_s
            if self.horizon_s is not None
            else max(self.total_steps - last, 1) * max(self.costs.train_s, 1e-9)
        )
        if self.policy == "fixed":
            if budget is not None and budget <= 1:
                self.interval, self.plan = None, []
                return
            self.interval, _ = best_interval(
                fit,
                last,
                self.total_steps,
                self.costs,
                horizon,
                max_publishes=budget,
                min_interval=self.min_interval,
            )
            self.plan = list(range(last + self.interval, self.total_steps, self.interval))
        else:
            warm = [s for s in self._steps if s <= self._warmup_end]
            base = greedy_threshold(fit, warm)
            if self.pace is not None and self.max_publishes is not None and not self.not_before:
                # Fixed for the run at the warm-up's publish: the budget's release does not move with refits.
                first = self.published[0] if self.published else step
                self.not_before = paced_steps(first, self.total_steps, self.max_publishes, self.pace)
            # The deadlines of the publishes still to come (the plan's first step is the last publish).
            self.plan, self.threshold = greedy_plan(
                fit,
                last,
                self.total_steps,
                base,
                max_publishes=budget,
                min_interval=self.min_interval,
                not_before=self.not_before[max(len(self.published), 1) - 1 :] or None,
            )
            self.plan = self.plan[1:]

    # The decision ------------------------------------------------------------------------------------
    def should_publish(self, step: int, loss: float) -> bool:
        """Records this step's training loss and says whether to publish the model now.

        Args:
            step: the training step (increasing; gaps are fine, e.g. one call every few batches).
            loss: the training loss at `step` (a float, or a 0-d tensor or array).

        Returns:
            True when the model should be published at this step; the step is then counted as published.
        """
        self._time_step(step)
        try:
            value = float(loss)
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value):
            if not self._bad_warned:
                warnings.warn(
                    f"tierstore schedule: the loss at step {step} is {loss!r}; a non-finite loss is left out "
                    "of the fit and its step is never published (its weights are suspect too)",
                    ScheduleWarning,
                    stacklevel=2,
                )
                self._bad_warned = True
            return False
        self._steps.append(int(step))
        self._losses.append(value)
        if self.max_publishes is not None and len(self.published) >= self.max_publishes:
            return False
        if not self.published:
            if step < self.warmup_steps:
                return False
            self._warmup_end = step
            self._replan(step)
            return self._take(step)
        if self._next_refit is not None and step >= self._next_refit:
            self._replan(step)
        last = self.published[-1]
        if step - last < self.min_interval:
            return False
        if self.fallback is not None or self.policy == "fixed":
            return (
                self.interval is not None
                and step - last >= self.interval
                and (self.fallback is not None or step < self.total_steps)
                and self._take(step)
            )
        if self.plan and step >= self.plan[0]:
            self.plan = [p for p in self.plan if p > step]
            # Re-planned from this publish at the next step: a plan that pacing deferred was made for more
            # publishes than it will make, and the budget it would leave goes to the rest of the run.
            self._next_refit = step + 1
            return self._take(step)
        return False

    def _take(self, step: int) -> bool:
        self.published.append(step)
        self._published_since_call = True
        return True

    def summary(self) -> dict[str, object]:
        """What the schedule decided and why, for logs."""
        return {
            "policy": self.policy,
            "fit": None
            if self.fit is None
            else {"family": self.fit.family, **self.fit.params, "mse": self.fit.mse},
            "interval": self.interval,
            "threshold": self.threshold,
            "not_before": list(self.not_before),
            "published": list(self.published),
            "fallback": self.fallback,
            "costs": {
                "train_s": self.costs.train_s,
                "publish_s": self.costs.publish_s,
                "load_s": self.costs.load_s,
                "infer_s": self.costs.infer_s,
            },
        }


def _fmt(params: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in params.items())
