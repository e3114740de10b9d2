"""Benchmark of the publish schedules (`tierstore.schedule`): Viper's CIL experiment on a real training run.

A small CNN learns scikit-learn's digits (8x8 images; 1,437 for training, 360 held out) on the CPU, with
SGD, the same seed and the same batch order in every run. After a warm-up of two epochs the trainer
publishes the model through a private agent (`tierstore.stream`, `sync=False`), and an inference consumer
in another process (`HotModel`, torch with 1 thread) answers requests throughout: one request every
`--period-ms`, each a batch of 32 held-out images, scored by its cross-entropy on the model serving it.

Three runs, one per schedule:
  every-epoch   publish at each epoch's end from the warm-up's end on (what Keras, Lightning and the HF
                Trainer do): the baseline;
  fixed         `Schedule("fixed")`: the interval with the lowest predicted CIL;
  greedy        `Schedule("greedy")`: Viper's irregular schedule, its budget paced (the default `pace`);
both schedules with `max_publishes` = the baseline's number of publishes, and their costs (time per step,
the trainer's stall per publish, publish-to-servable time) measured during the run by `ScheduledPublisher`.

Measured:
  CIL           the sum of the consumer's request losses over a fixed number of requests, the number the
                baseline's consumer answered between its first version and the end of its training (Viper's
                fixed t_max); with the publishes, the trainer's stall in publish calls and its wall time.
  predictor     the four curves fitted on the warm-up's per-batch losses, against the rest of the run's losses
                smoothed over one epoch (the per-batch noise is reported beside it).
  fit time      `fit_curves` on 1,000 points (the run's first 1,000 per-batch losses), median of 50.

Usage: .venv/bin/python bench/bench_schedule.py [--quick] [--out docs/benchmarks/schedule.md] [--plot docs/benchmarks/schedule.png]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench_stream import private_agent

PY = sys.executable
BATCH = 32
WARMUP_EPOCHS = 2


def make_model() -> Any:
    import torch

    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.BatchNorm2d(32),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 4 * 4, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )


def digits() -> tuple[Any, Any, Any, Any]:
    import torch
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x = torch.tensor(x[order] / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.tensor(y[order])
    cut = len(y) - 360
    return x[:cut], y[:cut], x[cut:], y[cut:]


# The consumer ------------------------------------------------------------------------------------------
def consumer_main(args: argparse.Namespace) -> None:
    """Answers requests paced every `period` s from its first version: `requests` of them, or until the
    file `stop` appears. Prints one JSON line: per request (seconds since the first version, loss,
    version)."""
    import torch

    from tierstore import stream

    torch.set_num_threads(1)
    _, _, xt, yt = digits()
    model = make_model().eval()
    hot = stream.HotModel(model, args.name)
    print("ready", flush=True)
    while hot.version is None:
        time.sleep(0.001)
    t0 = time.perf_counter()
    out: list[tuple[float, float, int]] = []
    period = args.period_ms / 1e3
    stop = Path(args.stop) if args.stop else None
    k = 0
    while (args.requests and k < args.requests) or (not args.requests and not (stop and stop.exists())):
        due = t0 + k * period
        now = time.perf_counter()
        if due > now:
            time.sleep(due - now)
        i = (k * BATCH) % (len(yt) - BATCH)
        with hot.serving() as m, torch.no_grad():
            loss = float(torch.nn.functional.cross_entropy(m(xt[i : i + BATCH]), yt[i : i + BATCH]))
            version = hot.version or 0
        out.append((time.perf_counter() - t0, loss, version))
        k += 1
    print(json.dumps(out), flush=True)
    hot.close()


# The trainer -------------------------------------------------------------------------------------------
def train_run(
    policy: str, name: str, epochs: int, env: dict[str, str], tmp: Path, requests: int, pace: float
) -> dict[str, Any]:
    import torch

    from tierstore import stream
    from tierstore.integrations import ScheduledPublisher
    from tierstore.schedule import Schedule

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y, _, _ = digits()
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    per_epoch = len(y) // BATCH
    total = epochs * per_epoch
    warmup = WARMUP_EPOCHS * per_epoch
    budget = epochs - WARMUP_EPOCHS + 1
    stop = tmp / f"stop-{name}"
    consumer = subprocess.Popen(
        [PY, __file__, "--consumer", "--name", name, "--period-ms", str(ARGS.period_ms),
         "--requests", str(requests), "--stop", str(stop)],
        env=env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert consumer.stdout is not None and consumer.stdout.readline().strip() == "ready"
    sched = None
    pub: Any
    if policy == "every-epoch":
        pub = stream.Publisher(name)
    else:
        # warmup - 1: the step the baseline publishes first at (the end of the warm-up's last epoch).
        sched = Schedule(policy, total_steps=total, warmup_steps=warmup - 1, max_publishes=budget)
        pub = ScheduledPublisher(model, name, sched)
    losses: list[float] = []
    published: list[int] = []
    stalls: list[float] = []
    gen = torch.Generator().manual_seed(1)
    t_start = time.perf_counter()
    t_first: float | None = None
    step = 0
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=gen)
        for b in range(per_epoch):
            due = time.perf_counter() + pace
            idx = order[b * BATCH : (b + 1) * BATCH]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            value = float(loss.detach())
            losses.append(value)
            # The step padded to `pace`: the timeline no longer moves with the shared machine's load (a
            # publish's stall, below, is not padded: it is the cost being weighed).
            while time.perf_counter() < due:
                time.sleep(max(0.0, due - time.perf_counter()))
            t0 = time.perf_counter()
            if policy == "every-epoch":
                if b == per_epoch - 1 and step + 1 >= warmup:
                    pub.publish(model, step=step, sync=False)
                    published.append(step)
            elif pub.step(step, value) is not None:
                published.append(step)
            if published and published[-1] == step:
                stalls.append(time.perf_counter() - t0)
                if t_first is None:
                    t_first = time.perf_counter()
            step += 1
    t_end = time.perf_counter()
    pub.close()
    stop.touch()
    out, _ = consumer.communicate(timeout=600)
    reqs = json.loads(out.strip().splitlines()[-1])
    return {
        "policy": policy,
        "losses": losses,
        "published": published,
        "stall_s": sum(stalls),
        "train_s": t_end - t_start,
        "after_first_s": t_end - (t_first or t_end),
        "requests": reqs,
        "per_epoch": per_epoch,
        "warmup": warmup,
        "total": total,
        "budget": budget,
        "schedule": None if sched is None else sched.summary(),
    }


def smooth(x: np.ndarray, w: int) -> np.ndarray:
    """Centred moving average over `w` points (shorter windows at the ends)."""
    c = np.cumsum(np.insert(x, 0, 0.0))
    lo = np.clip(np.arange(x.size) - w // 2, 0, x.size)
    hi = np.clip(np.arange(x.size) + w - w // 2, 0, x.size)
    return (c[hi] - c[lo]) / (hi - lo)


def predictor_error(losses: list[float], warmup: int, per_epoch: int) -> dict[str, Any]:
    from tierstore.schedule import fit_curves, plausible

    y = np.asarray(losses)
    steps = np.arange(y.size, dtype=np.float64)
    fits = fit_curves(steps[:warmup], y[:warmup])
    rest = steps[warmup:]
    truth = smooth(y, per_epoch)[warmup:]
    noise = float(np.std(y[warmup:] - smooth(y, per_epoch)[warmup:]))
    rows = []
    for f in fits:
        pred = f.predict(rest)
        rows.append(
            {
                "family": f.family,
                "params": f.params,
                "mse": f.mse,
                "mae": float(np.mean(np.abs(pred - truth))),
                "rel": float(np.mean(np.abs(pred - truth) / truth)),
                "end_pred": float(pred[-1]),
            }
        )
    used = next((f.family for f in fits if plausible(f, y.size)), None)
    return {
        "used": used,
        "rows": rows,
        "noise": noise,
        "end_true": float(truth[-1]),
        "start_true": float(truth[0]),
    }


class Observed:
    """The observed training loss (smoothed over an epoch) in the place of a fitted curve: what the CIL
    model and the greedy plan give with a perfect predictor."""

    def __init__(self, losses: list[float], per_epoch: int) -> None:
        self.y = smooth(np.asarray(losses), per_epoch)

    def predict(self, steps: Any) -> np.ndarray:
        return np.interp(np.asarray(steps, dtype=np.float64), np.arange(self.y.size), self.y)


def oracle(runs: dict[str, list[dict[str, Any]]], train_s: float) -> dict[str, Any]:
    """The CIL model (`predicted_cil`) evaluated on the observed curve for each schedule's publish steps
    (first runs), and the greedy plan made on the observed curve with the same budget: separates what the
    greedy rule does from what the predictor's error does."""
    from tierstore.schedule import Costs, greedy_plan, greedy_threshold, paced_steps, predicted_cil

    base = runs["every-epoch"][0]
    obs = Observed(base["losses"], base["per_epoch"])
    sm = runs["fixed"][0]["schedule"]["costs"]
    costs = Costs(train_s=train_s, publish_s=sm["publish_s"], load_s=sm["load_s"], infer_s=1.0)
    start, end = base["warmup"] - 1, base["total"]
    horizon = (end - start) * train_s
    out = {name: predicted_cil(obs, rs[0]["published"], costs, horizon) for name, rs in runs.items()}  # type: ignore[arg-type]
    th = greedy_threshold(obs, np.arange(start + 1))  # type: ignore[arg-type]
    plan, _ = greedy_plan(obs, start, end, th, max_publishes=base["budget"])  # type: ignore[arg-type]
    out["greedy on the observed curve, unpaced"] = predicted_cil(obs, plan, costs, horizon)  # type: ignore[arg-type]
    # Paced, re-planned from each publish with the budget left, as `Schedule` does.
    waits = paced_steps(start, end, base["budget"])
    paced = [start]
    while len(paced) < base["budget"]:
        left = base["budget"] - len(paced) + 1
        nxt, _ = greedy_plan(obs, paced[-1], end, th, max_publishes=left, not_before=waits[len(paced) - 1 :])  # type: ignore[arg-type]
        if len(nxt) < 2:
            break
        paced.append(nxt[1])
    out["greedy on the observed curve, paced"] = predicted_cil(obs, paced, costs, horizon)  # type: ignore[arg-type]
    return {"cil": out, "plan": plan, "paced": paced, "costs": costs}


def fit_time(losses: list[float]) -> dict[str, float]:
    from tierstore.schedule import fit_curves

    y = np.asarray(losses[:1000])
    if y.size < 1000:  # a --quick run is shorter: its curve, continued by the same noise, to 1,000 points
        y = np.resize(y, 1000)
    x = np.arange(1000, dtype=np.float64)
    fit_curves(x, y)
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        fit_curves(x, y)
        times.append(time.perf_counter() - t0)
    return {
        "median": statistics.median(times),
        "p90": sorted(times)[44],
        "min": min(times),
        "points": float(y.size),
    }


ARGS: argparse.Namespace


def main() -> None:
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--consumer", action="store_true")
    ap.add_argument("--name", default="m")
    ap.add_argument("--requests", type=int, default=0)
    ap.add_argument("--stop", default="")
    ap.add_argument("--period-ms", type=float, default=10.0)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--reps", type=int, default=3, help="runs of each schedule (interleaved)")
    ap.add_argument("--step-ms", type=float, default=40.0, help="each training step padded to this")
    ap.add_argument("--quick", action="store_true", help="6 epochs, one run of each schedule")
    ap.add_argument("--out", default="docs/benchmarks/schedule.md")
    ap.add_argument("--plot", default="docs/benchmarks/schedule.png")
    ARGS = args = ap.parse_args()
    if args.consumer:
        consumer_main(args)
        return
    epochs = 6 if args.quick else args.epochs
    reps = 1 if args.quick else args.reps
    per_epoch = (1797 - 360) // BATCH
    # Every run's consumer answers the same number of requests: as many as fit in the nominal time of the
    # training after the warm-up (Viper's fixed t_max).
    requests = round((epochs - WARMUP_EPOCHS) * per_epoch * args.step_ms / args.period_ms)
    command = "python bench/bench_schedule.py " + " ".join(sys.argv[1:])
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-schedule-") as d:
        tmp = Path(d)
        with private_agent(tmp) as env:
            for rep in range(reps):
                for policy in ("every-epoch", "fixed", "greedy"):
                    r = train_run(policy, f"{policy}-{rep}", epochs, env, tmp, requests, args.step_ms / 1e3)
                    runs.setdefault(policy, []).append(r)
                    print(
                        f"{policy} #{rep}: {len(r['published'])} publishes, CIL {cil(r):.1f} over "
                        f"{len(r['requests'])} requests",
                        flush=True,
                    )
    base = runs["every-epoch"][0]
    pred = predictor_error(base["losses"], base["warmup"], base["per_epoch"])
    pred["oracle"] = oracle(runs, args.step_ms / 1e3)
    ft = fit_time(base["losses"])
    write_report(args, command, epochs, runs, pred, ft)


def last_share(run: dict[str, Any]) -> float:
    """The share of the run's requests that the last published version answered."""
    versions = [r[2] for r in run["requests"]]
    return versions.count(max(versions)) / len(versions)


def cil(run: dict[str, Any]) -> float:
    return float(sum(r[1] for r in run["requests"]))


def write_report(
    args: argparse.Namespace,
    command: str,
    epochs: int,
    runs: dict[str, list[dict[str, Any]]],
    pred: dict[str, Any],
    ft: dict[str, float],
) -> None:
    bases = runs["every-epoch"]
    base = bases[0]
    reps = len(bases)
    n_req = len(base["requests"])

    def med_cil(name: str) -> float:
        return statistics.median(cil(r) for r in runs[name])

    lines = [
        "# Publish schedules: Viper's CIL experiment on a CNN learning the digits",
        "",
        f"Command: `{command}` (run by `make bench`).",
        "",
        f"Machine: {os.cpu_count()} cores, {platform.machine()}, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}; load average at the end {os.getloadavg()[0]:.1f} (the machine is "
        "shared). Trainer (torch, 1 thread) in the benchmark's process, consumer (`HotModel`, torch with 1 "
        "thread) in another, one agent. Every figure below was measured in this one run.",
        "",
        f"Training: a CNN (2 conv layers with batch norm, 2 linear; {sum(t.numel() for t in make_model().parameters())} "
        f"parameters) on scikit-learn's digits, Adam (lr 3e-4), batch {BATCH}, {epochs} epochs of "
        f"{base['per_epoch']} steps ({base['total']} steps), the same seed and batch order in every run; each step "
        f"padded to {args.step_ms:g} ms so that the shared machine's load does not move the timeline (the "
        f"publish stalls are not padded). Warm-up: {WARMUP_EPOCHS} epochs; every schedule publishes at its end "
        f"(step {base['warmup'] - 1}, the consumer's first model). Consumer: a request every {args.period_ms:g} "
        f"ms, {n_req} requests per run (the nominal training time after the warm-up), each the cross-entropy of "
        "a batch of 32 held-out images on the version serving. The CIL is the sum of those losses.",
        "",
        f"## Cumulative inference loss ({reps} run{'s' if reps > 1 else ''} of each schedule, interleaved)",
        "",
        "| schedule | publishes | CIL, median | / every-epoch | CIL of each run | each run / the every-epoch run "
        "before it | mean loss per request | trainer stall in publish calls, median |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, rs in runs.items():
        c = med_cil(name)
        pubs = sorted({len(r["published"]) for r in rs})
        lines.append(
            f"| {name} | {', '.join(map(str, pubs))} | {c:.1f} | {c / med_cil('every-epoch'):.3f}x | "
            + ", ".join(f"{cil(r):.1f}" for r in rs)
            + " | "
            + ", ".join(f"{cil(r) / cil(b):.3f}x" for r, b in zip(rs, bases, strict=True))
            + f" | {c / n_req:.4f} | {statistics.median(r['stall_s'] for r in rs) * 1e3:.1f} ms |"
        )
    lines.append("")
    for name in ("fixed", "greedy"):
        r = runs[name][0]
        sm = r["schedule"]
        fit = sm["fit"]
        costs = sm["costs"]
        fit_s = (
            "no fit (fallback: " + str(sm["fallback"]) + ")"
            if fit is None
            else f"last fit {fit['family']} ("
            + ", ".join(f"{k}={v:.4g}" for k, v in fit.items() if k not in ("family", "mse"))
            + ")"
        )
        lines.append(
            f"- {name} (first run): published at steps {r['published']}; {fit_s}; "
            + (f"interval {sm['interval']}; " if sm["interval"] else "")
            + (f"threshold {sm['threshold']:.4g}; " if sm["threshold"] else "")
            + (
                f"pacing: the k-th publish after the first not before step {sm['not_before']}, "
                f"{sum(p in sm['not_before'] for p in r['published'])} of its "
                f"{len(r['published']) - 1} later publishes fell on one (deferred there); "
                if sm.get("not_before")
                else ""
            )
            + f"costs it measured: {costs['train_s'] * 1e3:.2f} ms per step, {costs['publish_s'] * 1e3:.2f} ms "
            f"stall per publish, {costs['load_s'] * 1e3:.2f} ms publish-to-servable."
        )
    lines.append(f"- every-epoch: published at steps {base['published']}.")
    met = {
        name: med_cil(name) < med_cil("every-epoch")
        and all(cil(r) < cil(b) for r, b in zip(runs[name], bases, strict=True))
        and max(len(r["published"]) for r in runs[name]) <= min(len(b["published"]) for b in bases)
        for name in ("fixed", "greedy")
    }
    lines += [
        "",
        "Target: both schedules reach a lower CIL than every-epoch (the median, and every run against the "
        "baseline run before it) with no more publishes: "
        + ", ".join(f"{n} {'met' if ok else 'NOT met'}" for n, ok in met.items())
        + ".",
        "",
        "How they differ: every-epoch spaces its publishes evenly, the last at the last step (it serves only "
        "the requests answered after training ends); the fixed schedule plans for a window that ends with "
        "training and spreads the same number over the steps before its end; the greedy one puts them where "
        "the predicted loss falls fastest, with its threshold set to spend the budget, and paced: by a fraction "
        "f of the run after the warm-up it has spent at most the share sqrt(f) of its budget, so a predictor "
        "that sees the loss flattening too soon cannot spend it all early. Share of the requests answered by each "
        "run's last version (median over runs): "
        + ", ".join(
            f"{name} {statistics.median(last_share(r) for r in rs) * 100:.0f}% (last publish at step "
            f"{rs[0]['published'][-1]} of {rs[0]['total']})"
            for name, rs in runs.items()
        )
        + ".",
        "",
        "## Predictor error on the rest of the curve",
        "",
        f"The four curves fitted on the warm-up's {base['warmup']} per-batch losses (of the first every-epoch "
        f"run), predicting steps {base['warmup']}..{base['total'] - 1}, against the observed loss smoothed over one "
        f"epoch (a centred moving average of {base['per_epoch']} batches; the per-batch noise around it has a "
        f"standard deviation of {pred['noise']:.3f}). Observed (smoothed) at the warm-up's end "
        f"{pred['start_true']:.3f}, at the last step {pred['end_true']:.3f}.",
        "",
        "| curve (lowest warm-up MSE first) | warm-up MSE | mean abs error | mean relative error | predicted at the "
        "last step |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in pred["rows"]:
        mark = " **(the schedules' choice)**" if row["family"] == pred["used"] else ""
        lines.append(
            f"| {row['family']}{mark} ({', '.join(f'{k}={v:.3g}' for k, v in row['params'].items())}) | {row['mse']:.4f} | "
            f"{row['mae']:.3f} | {row['rel'] * 100:.0f}% | {row['end_pred']:.3f} |"
        )
    o = pred["oracle"]
    lines += [
        "",
        "With a perfect predictor: the CIL model (`predicted_cil`: loss-seconds of requests over the window "
        "that ends with training, with the measured stall and publish-to-servable times) evaluated on the "
        "observed curve (smoothed) for each schedule's publish steps (first runs), and the greedy plan made "
        "on the observed curve with the same budget, without the pacing"
        f" (steps {o['plan']}) and with it, re-planned at each publish as the schedule does"
        f" (steps {o['paced']}):",
        "",
        "| publish steps | CIL model on the observed curve | / every-epoch |",
        "| --- | --- | --- |",
    ]
    for name, v in o["cil"].items():
        lines.append(f"| {name} | {v:.2f} | {v / o['cil']['every-epoch']:.3f}x |")
    lines += [
        "",
        "The schedules take the lowest-MSE curve that stays non-negative to the end of training (Viper takes "
        "the lowest MSE; a line through a steadily falling warm-up plans for negative losses). They do not "
        "rely on the warm-up fit alone: they refit on all losses so far every "
        f"{base['warmup'] - 1} steps (greedy also after each publish) and re-plan the rest of the run.",
        "",
        "## Fit time",
        "",
        f"`fit_curves` (all four curves) on 1,000 points (the run's first 1,000 per-batch losses"
        f"{'' if base['total'] >= 1000 else ', repeated to 1,000'}), 50 fits: median "
        f"**{ft['median'] * 1e3:.2f} ms**, p90 {ft['p90'] * 1e3:.2f} ms, min {ft['min'] * 1e3:.2f} ms. Target at "
        f"most 10 ms: {'met' if ft['median'] <= 0.010 else 'NOT met'} (the median; p90 "
        f"{'within' if ft['p90'] <= 0.010 else 'over'} it).",
        "",
        f"![schedules]({os.path.relpath(args.plot, Path(args.out).parent)})",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(args.plot, {k: v[0] for k, v in runs.items()}, pred)


def plot(path: str, runs: dict[str, dict[str, Any]], pred: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tierstore.schedule import CurveFit

    base = runs["every-epoch"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    y = np.asarray(base["losses"])
    ax1.plot(y, color="0.8", lw=0.6, label="per-batch loss")
    ax1.plot(smooth(y, base["per_epoch"]), color="k", lw=1.2, label="smoothed (1 epoch)")
    best = next(r for r in pred["rows"] if r["family"] == pred["used"]) if pred["used"] else pred["rows"][0]
    curve = CurveFit(best["family"], best["params"], best["mse"])
    xs = np.arange(y.size)
    ax1.plot(xs, curve.predict(xs), "--", color="tab:red", label=f"warm-up fit ({best['family']})")
    ax1.axvline(base["warmup"], color="0.5", ls=":")
    colors = {"every-epoch": "tab:gray", "fixed": "tab:blue", "greedy": "tab:green"}
    for i, (name, r) in enumerate(runs.items()):
        ax1.plot(r["published"], [y.max() * (1.02 + 0.05 * i)] * len(r["published"]), "|", color=colors[name],
                 ms=8, label=f"{name} publishes")  # fmt: skip
    ax1.set_xlabel("training step")
    ax1.set_ylabel("training loss")
    ax1.set_title("Training loss, warm-up fit and publish steps (first runs)")
    ax1.legend(fontsize=7)
    for name, r in runs.items():
        req = np.asarray(r["requests"])
        ax2.plot(
            req[:, 0], smooth(req[:, 1], 50), color=colors[name], lw=1, label=f"{name} (CIL {cil(r):.0f})"
        )
    ax2.set_xlabel("seconds since the consumer's first version")
    ax2.set_ylabel("request loss (moving average of 50)")
    ax2.set_yscale("log")
    ax2.set_title("Consumer's request loss (first runs)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
