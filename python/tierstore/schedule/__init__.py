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

from tierstore.schedule.curves import (
    FAMILIES,
    CurveFit,
    ScheduleWarning,
    fit_best,
    fit_curve,
    fit_curves,
    plausible,
)
from tierstore.schedule.driver import Schedule
from tierstore.schedule.plan import (
    Costs,
    best_interval,
    greedy_plan,
    greedy_threshold,
    paced_steps,
    predicted_cil,
)

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
