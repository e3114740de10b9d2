"""Learning curves: the four families Viper fits to the training loss, fitted by least squares, and the
warning a schedule gives when it cannot trust them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

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
