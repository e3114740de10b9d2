"""Learning-curve fits, the CIL predictor and the schedules, on synthetic curves with known parameters.

How long a fit takes is measured by bench/bench_schedule.py, not asserted here (a loaded test machine
would make such a test flaky).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from tierstore import schedule
from tierstore.schedule import Costs, CurveFit, Schedule, ScheduleWarning

STEPS = np.arange(1000, dtype=np.float64)

# Per family: the true curve's parameters and the function they give.
TRUE = {
    "exp2": ({"a": 2.0, "b": 0.004}, lambda x: 2.0 * np.exp(-0.004 * x)),
    "exp3": ({"a": 1.5, "b": 0.01, "c": 0.3}, lambda x: 1.5 * np.exp(-0.01 * x) + 0.3),
    "lin2": ({"a": -0.001, "b": 2.0}, lambda x: -0.001 * x + 2.0),
    # Expd3 written from its start a and limit c: here a curve rising to a plateau (an accuracy).
    "expd3": ({"a": 0.2, "b": 0.006, "c": 0.9}, lambda x: 0.9 - (0.9 - 0.2) * np.exp(-0.006 * x)),
}


@pytest.mark.parametrize("family", schedule.FAMILIES)
def test_each_family_recovers_its_parameters_from_a_noisy_curve(family: str) -> None:
    params, f = TRUE[family]
    rng = np.random.default_rng(7)
    y = f(STEPS) + rng.normal(0.0, 0.02, STEPS.size)
    fit = schedule.fit_curve(family, STEPS, y)
    for k, want in params.items():
        assert fit.params[k] == pytest.approx(want, rel=0.05, abs=0.01), (k, fit.params)
    # The noise is the only error left: the MSE is the noise's variance.
    assert fit.mse == pytest.approx(0.02**2, rel=0.15)
    # Whichever family wins on MSE predicts the true curve.
    best = schedule.fit_best(STEPS, y)
    assert np.max(np.abs(best.predict(STEPS) - f(STEPS))) < 0.03, best


def test_the_lowest_mse_wins_and_a_falling_curve_prefers_exp3_to_its_twin_expd3() -> None:
    _, f = TRUE["exp3"]
    y = f(STEPS) + np.random.default_rng(1).normal(0.0, 0.01, STEPS.size)
    fits = schedule.fit_curves(STEPS, y)
    assert [x.mse for x in fits] == sorted(x.mse for x in fits)
    assert {x.family for x in fits} == set(schedule.FAMILIES)
    assert fits[0].family == "exp3"
    twin = next(x for x in fits if x.family == "expd3")
    assert twin.mse == pytest.approx(fits[0].mse)
    assert twin.params["a"] == pytest.approx(fits[0].params["a"] + fits[0].params["c"])


def test_non_finite_points_are_dropped_and_too_few_points_is_an_error() -> None:
    _, f = TRUE["exp3"]
    y = f(STEPS).copy()
    y[::10] = np.nan
    y[5] = np.inf
    assert schedule.fit_curve("exp3", STEPS, y).params["b"] == pytest.approx(0.01, rel=5e-3)
    with pytest.raises(ValueError, match="at least 3"):
        schedule.fit_curves([0, 1, 2], [1.0, math.nan, 0.5])


def test_predicted_cil_counts_stalls_and_loads_and_ignores_publishes_past_the_horizon() -> None:
    flat = CurveFit("lin2", {"a": -0.01, "b": 1.0}, 0.0)  # loss 1.0 at step 0, 0.0 at step 100
    costs = Costs(train_s=0.1, publish_s=0.0, load_s=0.0, infer_s=1.0)
    # One publish: step 0's loss for 10 s of requests, one a second.
    assert schedule.predicted_cil(flat, [0], costs, 10.0) == pytest.approx(10.0)
    # A second at step 50 is served from 5 s on, at loss 0.5.
    assert schedule.predicted_cil(flat, [0, 50], costs, 10.0) == pytest.approx(5.0 + 2.5)
    # A 1 s stall and a 2 s load push it to 8 s.
    costs = Costs(train_s=0.1, publish_s=1.0, load_s=2.0, infer_s=1.0)
    assert schedule.predicted_cil(flat, [0, 50], costs, 10.0) == pytest.approx(8.0 + 1.0)
    # Past the horizon it serves nothing.
    assert schedule.predicted_cil(flat, [0, 90], costs, 10.0) == pytest.approx(10.0)


def test_the_fixed_interval_trades_stalls_against_staleness() -> None:
    curve = CurveFit("exp3", {"a": 2.0, "b": 0.01, "c": 0.2}, 0.0)
    cheap = Costs(train_s=0.01, publish_s=0.0001, load_s=0.001)
    dear = Costs(train_s=0.01, publish_s=0.2, load_s=0.001)
    i_cheap, _ = schedule.best_interval(curve, 0, 1000, cheap, 10.0)
    i_dear, _ = schedule.best_interval(curve, 0, 1000, dear, 10.0)
    assert i_cheap < i_dear
    # A budget of 10 publishes over 1,000 steps allows no interval under 100.
    i_budget, _ = schedule.best_interval(curve, 0, 1000, cheap, 10.0, max_publishes=10)
    assert i_budget == 100


def test_the_greedy_plan_publishes_often_early_and_keeps_to_its_budget() -> None:
    curve = CurveFit("exp3", {"a": 2.0, "b": 0.01, "c": 0.2}, 0.0)
    th = schedule.greedy_threshold(curve, np.arange(100))
    d = np.abs(np.diff(curve.predict(np.arange(100))))
    assert th == pytest.approx(d.mean() + d.std())
    plan, used = schedule.greedy_plan(curve, 100, 1000, th)
    gaps = np.diff(plan)
    assert gaps[0] < gaps[-1], plan
    drops = -np.diff(curve.predict(plan))
    assert np.all(drops > th) and used == th
    plan10, used10 = schedule.greedy_plan(curve, 100, 1000, th, max_publishes=10)
    assert len(plan10) == 10 and used10 > th and plan10[0] == 100
    assert np.all(np.diff(plan10)[:-1] <= np.diff(plan10)[1:]), plan10


def test_with_a_budget_the_greedy_threshold_is_lowered_as_well_as_raised_to_spend_it() -> None:
    # A warm-up that falls steeply, then a run that has little left to lose: Viper's threshold, taken from
    # the warm-up's differences, is larger than the whole drop that remains.
    curve = CurveFit("exp3", {"a": 2.0, "b": 0.05, "c": 0.1}, 0.0)
    th = schedule.greedy_threshold(curve, np.arange(100))
    assert float(curve.predict(100) - curve.predict(999)) < th
    assert schedule.greedy_plan(curve, 100, 1000, th)[0] == [100]
    plan, used = schedule.greedy_plan(curve, 100, 1000, th, max_publishes=10)
    assert len(plan) == 10 and used < th, (plan, used)
    assert np.all(-np.diff(curve.predict(plan)) > used)


def test_paced_steps_release_the_budget_as_the_square_root_of_the_run() -> None:
    waits = schedule.paced_steps(100, 1100, 11)
    assert len(waits) == 10 and waits == sorted(waits) and waits[0] > 100 and waits[-1] < 1100
    for f in np.linspace(0.0, 1.0, 101):
        spent = 1 + sum(w <= 100 + f * 1000 for w in waits)  # the warm-up's publish counts
        assert spent <= math.ceil(11 * math.sqrt(f)) + 1, (f, spent)
    # A quarter of the way in, up to half the budget; pace 1 is an even spacing.
    assert sum(w <= 350 for w in waits) + 1 == 6
    even = np.diff([100, *schedule.paced_steps(100, 1100, 11, pace=1.0)])
    assert even.max() - even.min() <= 1
    with pytest.raises(ValueError, match=r"pace 0: use a number in \(0, 1\]"):
        schedule.paced_steps(100, 1100, 11, pace=0)


def test_a_paced_greedy_plan_defers_publishes_to_their_earliest_steps_and_keeps_its_threshold() -> None:
    curve = CurveFit("exp3", {"a": 2.0, "b": 0.01, "c": 0.2}, 0.0)
    th = schedule.greedy_threshold(curve, np.arange(100))
    waits = schedule.paced_steps(100, 1000, 10)
    free, used_free = schedule.greedy_plan(curve, 100, 1000, th, max_publishes=10)
    paced, used = schedule.greedy_plan(curve, 100, 1000, th, max_publishes=10, not_before=waits)
    assert used == used_free
    assert len(paced) <= 10 and all(p >= w for p, w in zip(paced[1:], waits, strict=False)), paced
    assert any(p == w for p, w in zip(paced[1:], waits, strict=False)), "this curve front-loads: pacing binds"
    assert paced[-1] > free[-1]


def two_speeds(x: np.ndarray | float) -> np.ndarray:
    """A loss with a fast and a slow phase: a warm-up of 100 steps sees mostly the fast one."""
    x = np.asarray(x, dtype=np.float64)
    return np.asarray(2.0 * np.exp(-x / 40) + 0.5 * np.exp(-x / 400))


class TwoSpeeds:
    def predict(self, steps: np.ndarray | float) -> np.ndarray:
        return two_speeds(steps)


def test_pacing_keeps_budget_for_a_tail_the_warmup_under_predicts() -> None:
    ys = two_speeds(np.arange(1000)) + np.random.default_rng(6).normal(0.0, 0.03, 1000)
    # The warm-up's best fit flattens out near 0.35; the loss goes on falling to 0.04.
    warm = schedule.fit_best(np.arange(100), ys[:100])
    assert warm.predict(999) > 5 * two_speeds(999), warm
    costs = Costs(train_s=0.01, infer_s=0.01)
    runs = {}
    for pace in (None, 0.5):
        s = Schedule("greedy", total_steps=1000, warmup_steps=100, max_publishes=11, pace=pace, costs=costs)
        runs[pace] = ([step for step in range(1000) if s.should_publish(step, ys[step])], s)
    unpaced, (paced, s) = runs[None][0], runs[0.5]
    # Unpaced, the plan trusts the predicted tail: the budget is gone within a quarter of the run, and
    # refits, which see the loss still falling, have nothing left to publish.
    assert len(unpaced) == 11 and unpaced[-1] < 325, unpaced
    # Paced, no publish comes before its earliest step, and the budget lasts into the last fifth.
    assert len(paced) == 11 and all(p >= w for p, w in zip(paced[1:], s.not_before, strict=True)), paced
    assert paced[-1] > 820, paced
    # On the true curve, the paced publishes leave the consumer less loss than the unpaced ones and than
    # an even spacing of the same budget.
    even = list(range(100, 1000, 82))
    assert len(even) == 11

    def cil(steps: list[int]) -> float:
        return schedule.predicted_cil(TwoSpeeds(), steps, costs, 9.0)

    assert cil(paced) < cil(even) < cil(unpaced), (cil(paced), cil(even), cil(unpaced))


def noisy(step: int, rng: np.random.Generator) -> float:
    return float(2.0 * math.exp(-step / 150) + 0.2 + rng.normal(0.0, 0.05))


@pytest.mark.parametrize("policy", ["greedy", "fixed"])
def test_a_schedule_publishes_at_the_end_of_warmup_then_on_plan_within_budget(policy: str) -> None:
    rng = np.random.default_rng(3)
    costs = Costs(train_s=0.01, publish_s=0.002, load_s=0.005)
    s = Schedule(policy, total_steps=1000, warmup_steps=100, max_publishes=10, costs=costs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScheduleWarning)
        published = [step for step in range(1000) if s.should_publish(step, noisy(step, rng))]
    assert published == s.published
    assert published[0] == 100 and len(published) == 10
    assert s.fallback is None and s.fit is not None and s.fit.family in ("exp3", "expd3")
    assert s.fit.params["b"] == pytest.approx(1 / 150, rel=0.1)
    gaps = np.diff(published)
    if policy == "fixed":
        assert set(gaps) == {s.interval} == {90}
    else:
        assert gaps[0] < gaps[-1], published


def test_greedy_refits_and_replans_after_each_publish_with_the_budget_left() -> None:
    rng = np.random.default_rng(8)
    s = Schedule("greedy", total_steps=1000, warmup_steps=100, max_publishes=10, refit_every=10**6)
    published = [step for step in range(1000) if s.should_publish(step, noisy(step, rng))]
    assert len(published) == 10
    # One fit ends the warm-up; one follows each later publish but the last, which leaves no budget.
    assert len(s.fit_seconds) == 1 + 8
    # The last re-plan (after the 9th publish) planned the one publish the budget had left.
    assert s.plan == [] and s.published == published


def test_refits_use_the_losses_since_the_warmup() -> None:
    rng = np.random.default_rng(4)
    s = Schedule("greedy", total_steps=1000, warmup_steps=50, refit_every=100, costs=Costs(train_s=0.01))
    for step in range(60):
        s.should_publish(step, noisy(step, rng))
    early = s.fit
    for step in range(60, 700):
        s.should_publish(step, noisy(step, rng))
    assert s.fit is not early and s.fit is not None and early is not None
    # 50 steps of a 150-step decay pin its rate down far less well than 700.
    assert abs(s.fit.params["b"] * 150 - 1) < 0.05
    assert len(s.fit_seconds) >= 6


def test_nan_losses_are_never_published_and_warned_about_once() -> None:
    s = Schedule("fixed", total_steps=100, warmup_steps=10, costs=Costs(train_s=0.01))
    with pytest.warns(ScheduleWarning, match=r"loss at step 3 is nan.*never published") as rec:
        out = [
            s.should_publish(step, math.nan if step in (3, 10, 40) else 2.0 * math.exp(-step / 30))
            for step in range(100)
        ]
    assert len(rec) == 1
    assert not out[10] and out[11], "the warm-up's publish waits for a finite loss"
    assert 40 not in s.published


def test_too_few_points_fall_back_to_a_fixed_interval_with_a_warning() -> None:
    s = Schedule("greedy", total_steps=100, warmup_steps=10, fallback_interval=7)
    with pytest.warns(ScheduleWarning) as rec:
        published = [step for step in range(100) if s.should_publish(step, math.nan if step < 8 else 1.0)]
    messages = [str(r.message) for r in rec]
    assert any("too few to fit" in m and "every 7 steps" in m for m in messages), messages
    assert published == list(range(10, 100, 7))
    assert s.fallback is not None and "too few" in s.fallback


def test_a_diverging_run_falls_back_to_a_fixed_interval_with_a_warning() -> None:
    s = Schedule("greedy", total_steps=200, warmup_steps=40, max_publishes=5)
    # The default interval spreads the budget over the rest of the run: 160 steps / 5.
    with pytest.warns(ScheduleWarning, match="not falling.*diverging.*every 32 steps"):
        published = [step for step in range(200) if s.should_publish(step, 0.5 + 0.01 * step)]
    assert published == [40, 72, 104, 136, 168]


def test_bad_arguments_say_what_to_use() -> None:
    with pytest.raises(ValueError, match='use "greedy" or "fixed"'):
        Schedule("every", total_steps=10, warmup_steps=2)
    with pytest.raises(ValueError, match="must end before training does"):
        Schedule("fixed", total_steps=10, warmup_steps=10)
    with pytest.raises(ValueError, match=r"pace 1.5: use a number in \(0, 1\]"):
        Schedule("greedy", total_steps=10, warmup_steps=2, pace=1.5)
    with pytest.raises(ValueError, match="use one of exp2, exp3, lin2, expd3"):
        schedule.fit_curve("exp4", STEPS, STEPS)


def test_costs_are_running_means_of_what_was_measured() -> None:
    s = Schedule("fixed", total_steps=100, warmup_steps=10)
    s.observe(publish_s=0.1)
    s.observe(publish_s=0.2, load_s=0.05, infer_s=0.003)
    assert s.costs.publish_s == pytest.approx(0.8 * 0.1 + 0.2 * 0.2)
    assert (s.costs.load_s, s.costs.infer_s) == (0.05, 0.003)
    s.observe(load_s=math.nan)
    assert s.costs.load_s == 0.05
    # The time per step is measured from the calls themselves.
    for step in range(5):
        s.should_publish(step, 1.0)
    assert 0 < s.costs.train_s < 1.0


def test_a_line_heading_below_zero_is_passed_over_for_the_next_best_curve() -> None:
    # A warm-up that falls in a straight line: the line fits it best but reaches zero by step 115.
    rng = np.random.default_rng(5)
    warm = [2.3 - 0.02 * k + float(rng.normal(0.0, 0.03)) for k in range(89)]
    assert schedule.fit_curves(np.arange(89), warm)[0].family == "lin2"
    s = Schedule("greedy", total_steps=500, warmup_steps=88, max_publishes=5, costs=Costs(train_s=0.01))
    for step, loss in enumerate(warm):
        s.should_publish(step, loss)
    assert s.published == [88] and s.fallback is None
    assert s.fit is not None and s.fit.family != "lin2" and schedule.plausible(s.fit, 500)
