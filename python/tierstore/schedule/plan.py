"""Planning the publish steps on a predicted curve: the cumulative inference loss a plan leads to, the best
fixed interval, and Viper's greedy plan with its threshold and pacing."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tierstore.schedule.curves import CurveFit


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
