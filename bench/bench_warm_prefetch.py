"""Benchmark of what sampler-aware prefetch costs when there is nothing left to fetch: warm epochs of an
unchanged DataLoader job under `tierstore run`, with the prefetch off, on by itself, and through the
explicit wrapper.

The data: 2,000 arrays of 16 KiB (`.npy`) in a local directory, the source; the tier is /dev/shm, filled
by `tierstore prefetch` before the first round, and `revalidate = "never"`: no epoch asks the store
anything, so whatever one setup costs more than another is tierstore's own CPU. The job
(bench/auto_order_job.py, `--dataset npy`) is an ordinary script: a custom Dataset holding its list of
files, a shuffled DataLoader (batch 16, 2 fork workers, persistent), no step between batches (the
loading is all there is to measure), 16 epochs per job.

Setups, alternated within each round (the order rotates from round to round):

  off        `tierstore run` with TIERSTORE_SAMPLER_PREFETCH=off
  auto       `tierstore run`, no options: each epoch's order found by itself and handed to a prefetch
             that finds every file cached
  wrapper    `tierstore run` and one line changed: `tierstore.torch.prefetching(loader, budget="64M")`

Epochs 2 to 16 of each job are summed (epoch 1 also starts the workers): their seconds, and the CPU
seconds of the job's processes (the loader's and its workers'), which the machine's load does not stretch.

    .venv/bin/python bench/bench_warm_prefetch.py --out docs/benchmarks/warm-prefetch.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_auto_order import _run, job_env
from page import Check, finish, met, rounds, targets

HERE = Path(__file__).resolve().parent
JOB = HERE / "auto_order_job.py"
FILES, SIZE, EPOCHS = 2000, 16 << 10, 16
SETUPS = ("off", "auto", "wrapper")
TARGET = 1.03


def generate(root: Path) -> Path:
    import numpy as np

    arrays = root / "arrays"
    if arrays.exists() and len(list(arrays.iterdir())) == FILES:
        return arrays
    shutil.rmtree(arrays, ignore_errors=True)
    arrays.mkdir(parents=True)
    rng = np.random.default_rng(3)
    for i in range(FILES):
        np.save(arrays / f"a{i:04d}.npy", rng.standard_normal(SIZE // 8 - 16).astype(np.float64))
    return arrays


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write the page (Markdown) here")
    ap.add_argument("--root", type=Path, default=Path("/tmp/tierstore-bench-warm-prefetch"))
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    started = time.time()
    args.root.mkdir(parents=True, exist_ok=True)
    arrays = generate(args.root)
    tier = Path("/dev/shm") / f"tierstore-bench-warm-prefetch-{os.getpid()}"
    front = [sys.executable, "-m", "tierstore.cli", "--source", str(arrays), "--tier", f"{tier}:1G"]
    env = job_env()
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        subprocess.run(
            [*front, "prefetch", str(arrays)], env=env, check=True, capture_output=True, timeout=600
        )
        for r in range(args.rounds):
            for setup in SETUPS[r % len(SETUPS) :] + SETUPS[: r % len(SETUPS)]:
                cmd = [*front, "run", "--revalidate", "never", "--", sys.executable, str(JOB), str(arrays),
                       "--dataset", "npy", "--epochs", str(EPOCHS), "--step-ms", "0"]  # fmt: skip
                if setup == "wrapper":
                    cmd += ["--wrap", "64M"]
                setup_env = {**env, "TIERSTORE_SAMPLER_PREFETCH": "auto" if setup == "auto" else "off"}
                out = _run(cmd, setup_env, None)
                out["warm_seconds"] = sum(out["seconds"][1:])
                out["warm_cpu"] = sum(out["cpu"][1:])
                runs.setdefault(setup, []).append(out)
                print(f"round {r + 1} {setup:8} epochs 2-{EPOCHS}: {out['warm_seconds']:.2f} s, "
                      f"CPU {out['warm_cpu']:.2f} s", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(tier, ignore_errors=True)
    checks: list[Check] = []
    lines = [
        "# Sampler-aware prefetch on a warm cache: what it costs when nothing is left to fetch",
        "",
        f"Command: `python bench/bench_warm_prefetch.py --rounds {args.rounds} --out docs/benchmarks/warm-prefetch.md` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, {time.time() - started:.0f} s)",
        "",
        "## Method",
        "",
        *[f"    {line}" if line.strip() else "" for line in __doc__.strip().splitlines()[4:21]],
        "",
        "## Every round",
        "",
        f"| setup | round | epochs 2-{EPOCHS}, s | CPU s of the job, epochs 2-{EPOCHS} | same batches as `off` |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for setup in SETUPS:
        for i, o in enumerate(runs[setup]):
            same = o["digest"] == runs["off"][i]["digest"]
            lines.append(
                f"| {setup} | {i + 1} | {o['warm_seconds']:.3f} | {o['warm_cpu']:.3f} | {'yes' if same else 'NO'} |"
            )
        if setup != "off":
            same = all(o["digest"] == b["digest"] for o, b in zip(runs[setup], runs["off"], strict=True))
            checks.append((f"{setup}: the same batches as `off`", same, "digest of every batch"))
    lines += ["", "## Ratios over `off` (per round; at most 1.03x is the target)", ""]
    for setup in ("auto", "wrapper"):
        for what, key in (("time", "warm_seconds"), ("CPU", "warm_cpu")):
            rs = [a[key] / b[key] for a, b in zip(runs[setup], runs["off"], strict=True)]
            lines.append(f"- `{setup}` over `off`, {what}: {rounds(rs)}")
            checks.append(
                (
                    f"warm epochs, `{setup}` at most {TARGET}x `off` ({what})",
                    met([TARGET / r for r in rs], 1.0),
                    rounds(rs),
                )
            )
    lines += ["", "## Targets", *targets(checks)]
    return finish(lines, checks, args.out)


if __name__ == "__main__":
    sys.exit(main())
