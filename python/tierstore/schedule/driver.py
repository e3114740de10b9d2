"""When to publish a model: Viper's learning-curve predictor and cumulative-inference-loss schedules.

    from tierstore import schedule, stream

    sched = schedule.Schedule("greedy", total_steps=2000, warmup_steps=200, max_publishes=20)
    for step, batch in enumerate(loader):
        loss = train_step(batch)
        if sched.should_publish(step, loss):
            t0 = time.perf_counter()
            stream.publish("policy", model, step=step, sync=False)
            sched.observe(publish_s=time.perf_counter() - t0)

Publishing too often stalls the trainer and makes consumers load weights that are barely better;
publishing too rarely leaves inference on stale weights. Viper (Lee et al.) resolves the trade-off by
predicting the rest of the training-loss curve from the warm-up and choosing the publish steps that
minimise the cumulative inference loss (CIL): the sum, over every request a consumer answers, of the loss
of the model it answered with (the training loss standing in for the inference loss).

Two schedules, both planned on the predicted curve and re-planned as the curve is refitted:

- `"fixed"`: one interval, the one whose predicted CIL is lowest given the measured costs (the trainer's
  stall per publish, the consumer's load time, the time per training step).
- `"greedy"`: Viper's irregular schedule: publish when the predicted loss has fallen by more than a
  threshold since the last publish, the threshold being the mean plus one standard deviation of the
  consecutive differences over the warm-up. It publishes often while the loss falls fast and rarely later.

Two departures from Viper's greedy rule when a budget (`max_publishes`) is given, both because the rule
trusts the predicted tail entirely and a warm-up fit is most wrong there:

- The threshold is the one whose plan spends the budget: Viper's, raised when it would publish more and
  lowered when it would publish less. A threshold taken from a steep warm-up can exceed every drop the
  rest of the run makes: replayed on a digits CNN trained at a high learning rate, Viper's threshold
  used 2 of 11 publishes.
- The budget is paced (`pace`, default 0.5): by a fraction `f` of the steps after the warm-up, at most the
  share `f ** 0.5` of it is spent, and a publish the threshold calls for earlier is deferred. Learning
  curves flatten more slowly than the exponentials fitted to their warm-up predict (on the benchmark's
  run, the warm-up fit had a 56 % mean relative error on the rest of the curve); unpaced, greedy spent its
  11 publishes by step 246 of 528 and its last version answered 63 % of the requests. The square root is
  a hedge between an even pace (right for a loss that falls steadily) and no pacing (right only if the
  predicted tail is): it allows twice the even pace over the first quarter and always keeps `1 - sqrt(f)`
  of the budget for the rest. Replayed offline on recorded digits runs (three learning rates, two seeds,
  6 to 24 epochs), every exponent from 0.3 to 0.6 beat publishing every epoch on every run, and 0.5 did
  best on average. It is not only a guard against the predictor: planned on the benchmark's observed
  curve (a perfect predictor), Viper's rule rates 0.98x publish-every-epoch's CIL in the CIL model and
  the paced one 0.91x; publishing at equal drops in loss crowds the publishes into the start of the run
  more than the CIL rewards.

A power law (`a (x + x0)^-b + c`), the usual shape of a learning curve's tail, was tried as a fifth family
and not added: fitted to the benchmark's warm-ups (which start with a plateau) it never had the lowest
MSE, so Viper's choice by MSE would not take it, and where its tail was closer on one run it was further
on another.

Bad input never stops training: a NaN or infinite loss is not published (the weights that produced it are
suspect too), and too few points, a fit that fails or a diverging run fall back to a fixed interval, each
with a `ScheduleWarning` that says what happened; `Schedule.fallback` keeps the reason.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "FAMILIES",
    "Costs",
    "CurveFit",
    "Schedule",
    "ScheduleWarning",
    "best_interval",
    "fit_best",
    "fit_curve",
    "fit_curves",
    "greedy_plan",
    "greedy_threshold",
    "paced_steps",
    "plausible",
    "predicted_cil",
]

# Viper's four learning-curve families, in the order a tie in MSE is broken (the simpler or more specific
# shape first).
FAMILIES = ("exp2", "exp3", "lin2", "expd3")

# The decay rates tried before refining, per unit of the (scaled) step range [0, 1]: from a curve that is
# nearly a straight line over the range (1e-3) to one that has finished falling in its first 0.1 % (1e3).
_B_GRID = np.logspace(-3.0, 3.0, 31)
# A fit on more points than this is fitted on block means: the same curve, less per-batch noise, and a
# refit whose cost does not grow with the run.
_MAX_FIT_POINTS = 4096


class ScheduleWarning(UserWarning):
    """A schedule met input it cannot plan from and fell back to a fixed interval (the message says why)."""


@dataclass(frozen=True)
class CurveFit:
    """One fitted learning curve.

    Attributes:
        family: one of `FAMILIES`.
        params: `a`, `b` and, for the three-parameter families, `c`, in the units of the steps fitted (for
            lin2, `a` is the slope and `b` the intercept, as in Viper's `ax + b`).
        mse: the mean squared error over the points fitted.
    """

    family: str
    params: dict[str, float]
    mse: float

    def predict(self, steps: float | Sequence[float] | np.ndarray) -> np.ndarray:
        """The predicted loss at `steps`."""
        x = np.asarray(steps, dtype=np.float64)
        p = self.params
        if self.family == "lin2":
            return p["a"] * x + p["b"]
        e = np.exp(-p["b"] * x)
        if self.family == "exp2":
            return p["a"] * e
        if self.family == "exp3":
            return p["a"] * e + p["c"]
        return p["c"] - (p["c"] - p["a"]) * e

    def decreasing(self, start: float, end: float) -> bool:
        """Whether the curve predicts a lower loss at `end` than at `start` (a run that is learning)."""
        lo, hi = self.predict([start, end])
        return bool(hi < lo)


def plausible(fit: CurveFit, end: float) -> bool:
    """Whether `fit` predicts a non-negative loss up to step `end` (the four curves are monotonic, so the
    end decides)."""
    return bool(fit.predict(end) >= 0)


def _clean(
    steps: Sequence[float] | np.ndarray, losses: Sequence[float] | np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(steps, dtype=np.float64).ravel()
    y = np.asarray(losses, dtype=np.float64).ravel()
    if x.shape != y.shape:
        raise ValueError(f"{x.size} steps but {y.size} losses: give one loss per step")
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    if x.size > _MAX_FIT_POINTS:
        order = np.argsort(x, kind="stable")
        blocks = np.array_split(order, _MAX_FIT_POINTS)
        x = np.array([x[b].mean() for b in blocks])
        y = np.array([y[b].mean() for b in blocks])
    return x, y


_Sums = tuple[np.ndarray, np.ndarray, np.ndarray]


def _exp_sums(b: np.ndarray, xs: np.ndarray, y: np.ndarray) -> _Sums:
    """For each rate in `b`, the sums the closed-form least squares over `e^{-b x}` needs."""
    e = np.exp(-np.outer(b, xs))
    return e.sum(axis=1), np.einsum("ij,ij->i", e, e), e @ y


def _exp2_sse(
    s_e: np.ndarray, s_ee: np.ndarray, s_ey: np.ndarray, s_yy: float
) -> tuple[np.ndarray, np.ndarray]:
    a = s_ey / np.maximum(s_ee, 1e-300)
    return np.maximum(s_yy - a * s_ey, 0.0), a


def _exp3_sse(
    s_e: np.ndarray, s_ee: np.ndarray, s_ey: np.ndarray, n: int, s_y: float, s_yy: float, sign: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Least squares of `A e^{-bx} + C` for each rate, with the floor `C >= 0` (a loss does not fall below
    zero; a fit to a short warm-up would otherwise often aim for a negative floor) and, when `sign` is not
    0, `sign * A >= 0`. A convex problem in two variables: its optimum is the unconstrained one when that is
    feasible, else the best of the optima on the constraints' edges (`C = 0`, `A = 0`, both)."""
    det = n * s_ee - s_e * s_e
    ok = det > 1e-12 * np.maximum(n * s_ee, 1e-300)
    safe = np.where(ok, det, 1.0)
    a0 = np.where(ok, (n * s_ey - s_e * s_y) / safe, 0.0)
    c0 = (s_y - a0 * s_e) / n
    a1 = s_ey / np.maximum(s_ee, 1e-300)  # on C = 0
    if sign:
        a1 = np.where(sign * a1 >= 0, a1, 0.0)
    zero = np.zeros_like(a0)
    amps = np.stack([a0, a1, zero])
    offs = np.stack([c0, zero, np.full_like(a0, max(s_y / n, 0.0))])
    feasible = np.stack([ok & (c0 >= 0) & ((sign * a0 >= 0) if sign else True), ok | True, ok | True])
    sse = (
        s_yy - 2 * amps * s_ey - 2 * offs * s_y + amps * amps * s_ee + 2 * amps * offs * s_e + n * offs * offs
    )
    sse = np.where(feasible, np.maximum(sse, 0.0), np.inf)
    k = np.argmin(sse, axis=0)
    cols = np.arange(k.size)
    return sse[k, cols], amps[k, cols], offs[k, cols]


def _min_rate(
    sse_of: Callable[[_Sums], np.ndarray],
    xs: np.ndarray,
    y: np.ndarray,
    grid_sums: _Sums,
) -> tuple[float, _Sums]:
    """The rate with the least squared error: the coarse grid's best, then three finer grids, each across
    the two cells around the best point of the one before (to about 0.1 % of `b`). Each grid is one vectorised
    pass over the points, which is what keeps a fit of 1,000 points within a few milliseconds.

    Returns:
        (the rate, the sums at that rate).
    """
    b, sums = _B_GRID, grid_sums
    for _ in range(3):
        i = int(np.argmin(sse_of(sums)))
        b = np.geomspace(b[max(i - 1, 0)], b[min(i + 1, b.size - 1)], 13)
        sums = _exp_sums(b, xs, y)
    i = int(np.argmin(sse_of(sums)))
    e, ee, ey = (s[i : i + 1] for s in sums)
    return float(b[i]), (e, ee, ey)


def fit_curves(steps: Sequence[float] | np.ndarray, losses: Sequence[float] | np.ndarray) -> list[CurveFit]:
    """Fits Viper's four curves to `(steps, losses)`, lowest MSE first.

    Each exponential is fitted by a search over its rate `b` (a coarse grid, then finer ones), with the
    other parameters solved in closed form by linear least squares for each `b`: no iterative optimiser
    and no starting guess to get wrong, and 1,000 points take a few milliseconds. Non-finite points are
    dropped.

    Exp3 (`a e^{-bx} + c`) is kept to `a >= 0`, a loss falling to a floor; Expd3 (`c - (c-a) e^{-bx}`) is
    the same curve written from its start `a` and its limit `c`, free in direction so that it also fits a
    curve rising to a plateau (a diverging loss, or an accuracy). On a falling curve the two fit equally
    well and the tie goes to Exp3. Both keep their limit `c >= 0`: losses are not negative, and a warm-up
    that is still falling steeply would otherwise be extrapolated to a negative floor.

    Raises:
        ValueError: fewer than 3 finite points (no curve of three parameters is determined by fewer).
    """
    x, y = _clean(steps, losses)
    n = int(x.size)
    if n < 3 or float(np.ptp(x)) == 0.0:
        raise ValueError(f"{n} finite loss values at distinct steps: a curve needs at least 3")
    scale = float(np.max(np.abs(x)))
    xs = x / scale
    s_y, s_yy = float(y.sum()), float(y @ y)
    grid = _exp_sums(_B_GRID, xs, y)
    fits: list[CurveFit] = []

    b2, (e, ee, ey) = _min_rate(lambda s: _exp2_sse(s[0], s[1], s[2], s_yy)[0], xs, y, grid)
    sse, a = _exp2_sse(e, ee, ey, s_yy)
    fits.append(CurveFit("exp2", {"a": float(a[0]), "b": b2 / scale}, float(sse[0]) / n))

    def exp3(sign: float) -> tuple[float, float, float, float]:
        b3, (e, ee, ey) = _min_rate(lambda s: _exp3_sse(s[0], s[1], s[2], n, s_y, s_yy, sign)[0], xs, y, grid)
        sse, amp, off = _exp3_sse(e, ee, ey, n, s_y, s_yy, sign)
        return b3, float(sse[0]), float(amp[0]), float(off[0])

    bd, sse_d, amp_d, off_d = exp3(0.0)
    fits.append(CurveFit("expd3", {"a": amp_d + off_d, "b": bd / scale, "c": off_d}, sse_d / n))
    # Where the free fit already falls, it is the constrained optimum too: no second search.
    b3, sse_3, amp_3, off_3 = (bd, sse_d, amp_d, off_d) if amp_d >= 0 else exp3(1.0)
    fits.append(CurveFit("exp3", {"a": amp_3, "b": b3 / scale, "c": off_3}, sse_3 / n))

    xm, ym = float(x.mean()), s_y / n
    dx = x - xm
    slope = float(dx @ (y - ym)) / float(dx @ dx)
    intercept = ym - slope * xm
    resid = y - (slope * x + intercept)
    fits.append(CurveFit("lin2", {"a": float(slope), "b": float(intercept)}, float(resid @ resid) / n))

    rank = {f: i for i, f in enumerate(FAMILIES)}
    # A relative tolerance on the MSE so that a tie in exact arithmetic is a tie here too.
    return sorted(fits, key=lambda f: (round(f.mse / max(s_yy / n, 1e-300), 12), rank[f.family]))


def fit_curve(
    family: str, steps: Sequence[float] | np.ndarray, losses: Sequence[float] | np.ndarray
) -> CurveFit:
    """The fit of one family (see `fit_curves`)."""
    if family not in FAMILIES:
        raise ValueError(f"curve family {family!r}: use one of {', '.join(FAMILIES)}")
    return next(f for f in fit_curves(steps, losses) if f.family == family)


def fit_best(steps: Sequence[float] | np.ndarray, losses: Sequence[float] | np.ndarray) -> CurveFit:
    """The family with the lowest MSE, as Viper's training-loss predictor uses."""
    return fit_curves(steps, losses)[0]


@dataclass
class Costs:
    """What a publish costs and what inference earns, measured on the real system.

    The schedule weighs a publish's cost against the loss it takes off the consumer's requests; both are
    measured rather than guessed, because they differ by orders of magnitude between a 10 MB model on
    shared memory and a 10 GB one across nodes. Each `observe_*` keeps an exponentially weighted mean, so
    that a one-off stall (a page fault, a GC) does not decide the schedule.

    Attributes:
        train_s: seconds per training step.
        publish_s: seconds the trainer stalls per publish (an async publish: the snapshot).
        load_s: seconds from a version's publish to the consumer serving it.
        infer_s: seconds per inference request (it sets how many requests a second of staleness costs).
    """

    train_s: float = 0.0
    publish_s: float = 0.0
    load_s: float = 0.0
    infer_s: float = 0.01
    weight: float = 0.2
    counts: dict[str, int] = field(default_factory=dict)

    def _observe(self, name: str, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            return
        k = self.counts.get(name, 0)
        old = getattr(self, name)
        setattr(self, name, seconds if k == 0 else (1 - self.weight) * old + self.weight * seconds)
        self.counts[name] = k + 1

    def observe_train(self, seconds_per_step: float) -> None:
        self._observe("train_s", seconds_per_step)

    def observe_publish(self, seconds: float) -> None:
        self._observe("publish_s", seconds)

    def observe_load(self, seconds: float) -> None:
        self._observe("load_s", seconds)

    def observe_infer(self, seconds: float) -> None:
        self._observe("infer_s", seconds)


def predicted_cil(
    fit: CurveFit, publish_steps: Sequence[int] | np.ndarray, costs: Costs, horizon_s: float
) -> float:
    """The cumulative inference loss a consumer accrues over `horizon_s` seconds (Viper's CILP).

    Time 0 is the first publish (`publish_steps[0]`), whose model is served from then on. The k-th later
    publish, at step `p_k`, completes at `(p_k - p_0) * train_s + k * publish_s` (every publish stalls the
    trainer, so later ones slip) and is served `load_s` after that; a model serves until the next one does.
    Requests arrive every `infer_s` seconds and each costs the predicted training loss of the model that
    answers it. A publish that would complete after the horizon serves nothing.
    """
    p = np.asarray(publish_steps, dtype=np.float64)
    if p.size == 0 or horizon_s <= 0:
        return 0.0
    k = np.arange(p.size, dtype=np.float64)
    start = (p - p[0]) * costs.train_s + k * costs.publish_s + np.where(k > 0, costs.load_s, 0.0)
    start[0] = 0.0
    start = np.minimum(np.maximum.accumulate(start), horizon_s)
    dur = np.diff(np.append(start, horizon_s))
    return float(fit.predict(p) @ dur) / max(costs.infer_s, 1e-12)


def best_interval(
    fit: CurveFit,
    start: int,
    end: int,
    costs: Costs,
    horizon_s: float,
    *,
    max_publishes: int | None = None,
    min_interval: int = 1,
) -> tuple[int, float]:
    """Viper's fixed-interval schedule: the interval from `start` whose predicted CIL is lowest.

    Publishes fall at `start, start + i, start + 2i, …` before `end` (a publish at the last step would
    serve no request before training ends; publish the final model separately if consumers need it). With
    `max_publishes` (the publish at `start` included), only intervals that stay within it are tried. Up to 2,000 steps every interval is
    tried; beyond, 400 spread geometrically (the CIL changes slowly with a long interval).

    Returns:
        (interval, predicted CIL).
    """
    span = max(end - start, 1)
    lo = max(1, min_interval)
    if max_publishes is not None:
        lo = max(lo, math.ceil(span / max_publishes))
    hi = max(lo, span)
    cand = (
        np.arange(lo, hi + 1)
        if hi - lo <= 2000
        else np.unique(np.round(np.geomspace(lo, hi, 400)).astype(np.int64))
    )
    best = (int(cand[-1]), math.inf)
    for i in cand:
        steps = np.arange(start, max(end, start + 1), int(i))
        c = predicted_cil(fit, steps, costs, horizon_s)
        if c < best[1]:
            best = (int(i), c)
    return best


def greedy_threshold(fit: CurveFit, warmup_steps: Sequence[float] | np.ndarray) -> float:
    """Viper's greedy threshold: the mean plus one standard deviation of the consecutive loss differences
    over the warm-up.

    The differences are taken on the fitted curve at the warm-up's steps, not on the raw losses: per-batch
    losses jump by more than the model improves from one step to the next, and their differences would
    measure that noise rather than progress.
    """
    x = np.unique(np.asarray(warmup_steps, dtype=np.float64))
    if x.size < 2:
        return 0.0
    d = np.abs(np.diff(fit.predict(x)))
    return float(d.mean() + d.std())


def paced_steps(start: int, end: int, max_publishes: int, pace: float = 0.5) -> list[int]:
    """The earliest step of each publish after the one at `start` when the budget is paced: by the
    fraction `f` of the steps from `start` to `end`, at most the share `f ** pace` of `max_publishes`.

    `pace` 1 releases the budget evenly (what a fixed interval does); towards 0 it frees more of it for
    the start of the run. The default, 0.5, allows twice the even pace over the first quarter of the run
    and always keeps the share `1 - sqrt(f)` for the rest.

    Returns:
        `max_publishes - 1` steps, the k-th the earliest of the k-th publish after `start`.
    """
    if not 0 < pace <= 1:
        raise ValueError(f"pace {pace}: use a number in (0, 1] (1 spends the budget evenly over the run)")
    span = max(end - start, 1)
    return [start + math.ceil(span * (k / max_publishes) ** (1 / pace)) for k in range(1, max_publishes)]


def greedy_plan(
    fit: CurveFit,
    start: int,
    end: int,
    threshold: float,
    *,
    max_publishes: int | None = None,
    min_interval: int = 1,
    not_before: Sequence[int] | None = None,
) -> tuple[list[int], float]:
    """Viper's greedy irregular schedule, planned on the predicted curve: from `start`, publish at the first
    step whose predicted loss is more than `threshold` below that of the last publish (steps before `end`,
    as in `best_interval`).

    With `max_publishes` (the publish at `start` included) the threshold is moved by bisection to the one
    whose plan spends the budget: raised when Viper's threshold would publish more, lowered when it would
    publish less. The publishes stay where the curve falls fastest, there are just as many as allowed. (A
    threshold taken from a steep warm-up can be larger than any drop the rest of the run makes, and would
    leave most of the budget unspent.)

    With `not_before` (see `paced_steps`), the k-th publish after `start` waits at least until
    `not_before[k - 1]`: one the threshold calls for earlier is deferred to it. The threshold is chosen on
    the unpaced plan, so pacing moves publishes later but does not change how far apart in loss the rule
    wants them.

    Returns:
        (the planned publish steps, the threshold used).
    """
    steps = np.arange(start, max(end, start + 1), dtype=np.float64)
    pred = fit.predict(steps)
    # The running minimum makes the search a sorted one: a step publishes when the best loss so far has
    # fallen far enough below the last publish's.
    runmin = np.minimum.accumulate(pred)
    neg = -runmin
    limit = max_publishes if max_publishes is not None else steps.size
    waits = [int(s) - start for s in not_before] if not_before is not None else []

    def plan(th: float, paced: bool) -> list[int]:
        out = [0]
        while len(out) <= limit:
            last = out[-1]
            j = int(np.searchsorted(neg, -(pred[last] - th), side="right"))
            j = max(j, last + max(1, min_interval))
            if paced and len(out) - 1 < len(waits):
                j = max(j, waits[len(out) - 1])
            if j >= steps.size or not pred[last] - runmin[j] > th:
                break
            out.append(j)
        return [int(start + j) for j in out]

    th = max(threshold, 1e-15)
    if max_publishes is not None:
        # The plan's length falls as the threshold rises: the lowest threshold whose plan fits the budget
        # spends it.
        lo, hi = 0.0, max(th, float(pred.max() - pred.min())) * 2
        for _ in range(60):
            mid = (lo + hi) / 2
            if len(plan(mid, False)) > max_publishes:
                lo = mid
            else:
                hi = mid
        th = max(hi, 1e-15)
    return plan(th, True)[:limit], th


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
