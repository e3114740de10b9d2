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

`--instructions` also counts, with valgrind's callgrind, the user-space instructions each setup's job
executes per warm epoch: every process of it (callgrind follows the workers' fork), with the environment
`tierstore run` gives the job, a job of 4 epochs less one of 2, halved, so that the start and the
workers' fork cancel out; hash seed and BLAS/OpenMP threads pinned (bench/counted.py). `off`'s
2-epoch job is counted twice, and the difference is printed as the count's own noise.

    .venv/bin/python bench/bench_warm_prefetch.py --instructions --out docs/benchmarks/warm-prefetch.md
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
from bench_shim_open import run_env
from counted import instructions, per_warm_epoch
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


def job_command(arrays: Path, setup: str, epochs: int) -> list[str]:
    """The job's command line, for `setup`, over `epochs` epochs."""
    cmd = [sys.executable, str(JOB), str(arrays), "--dataset", "npy", "--epochs", str(epochs),
           "--step-ms", "0"]  # fmt: skip
    return [*cmd, "--wrap", "64M"] if setup == "wrapper" else cmd


def setup_env(env: dict[str, str], setup: str) -> dict[str, str]:
    return {**env, "TIERSTORE_SAMPLER_PREFETCH": "auto" if setup == "auto" else "off"}


def instructions_section(arrays: Path, env: dict[str, str]) -> tuple[list[str], list[Check]]:
    """Each setup's instructions per warm epoch, and the page's section and targets on them."""
    jobs: dict[str, dict[int, int]] = {}
    per_epoch: dict[str, int] = {}
    for setup in SETUPS:

        def job(epochs: int, setup: str = setup) -> int:
            n = instructions(job_command(arrays, setup, epochs), setup_env(env, setup), children=True)
            print(f"instructions: {setup}, {epochs} epochs: {n:,}", flush=True)
            return n

        two, four, per_epoch[setup] = per_warm_epoch(job)
        jobs[setup] = {2: two, 4: four}
    again = instructions(job_command(arrays, "off", 2), setup_env(env, "off"), children=True)
    noise = abs(again - jobs["off"][2])
    print(
        f"instructions per warm epoch: {per_epoch}; off's 2-epoch job counted again: {noise:,} apart",
        flush=True,
    )
    lines = [
        "",
        "## Instructions per warm epoch (valgrind's callgrind, user space)",
        "",
        "Every process of the job counted (the loader and its two workers), with the environment "
        "`tierstore run --revalidate never` gives it; a job of 4 epochs less one of 2, halved. A count, "
        "which the machine's load does not move; the kernel's part is not in it. "
        f"`off`'s 2-epoch job counted twice: {noise:,} instructions apart "
        f"({noise / per_epoch['off']:.3%} of an epoch).",
        "",
        "| setup | 2 epochs | 4 epochs | per warm epoch | over `off` |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    checks: list[Check] = []
    for setup in SETUPS:
        ratio = per_epoch[setup] / per_epoch["off"]
        lines.append(
            f"| {setup} | {jobs[setup][2]:,} | {jobs[setup][4]:,} | {per_epoch[setup]:,} | {ratio:.4f}x |"
        )
        if setup != "off":
            checks.append(
                (
                    f"warm epochs, `{setup}` at most {TARGET}x `off` (instructions)",
                    ratio <= TARGET,
                    f"{ratio:.4f}x",
                )
            )
    return lines, checks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write the page (Markdown) here")
    ap.add_argument("--root", type=Path, default=Path("/tmp/tierstore-bench-warm-prefetch"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--instructions",
        action="store_true",
        help="also count each setup's instructions per warm epoch (valgrind)",
    )
    args = ap.parse_args(argv)
    if args.instructions and not shutil.which("valgrind"):
        sys.exit("bench_warm_prefetch: no valgrind for --instructions (make bench-setup installs it)")
    started = time.time()
    args.root.mkdir(parents=True, exist_ok=True)
    arrays = generate(args.root)
    tier = Path("/dev/shm") / f"tierstore-bench-warm-prefetch-{os.getpid()}"
    front = [sys.executable, "-m", "tierstore.cli", "--source", str(arrays), "--tier", f"{tier}:1G"]
    env = job_env()
    runs: dict[str, list[dict[str, Any]]] = {}
    counted: tuple[list[str], list[Check]] = ([], [])
    try:
        subprocess.run(
            [*front, "prefetch", str(arrays)], env=env, check=True, capture_output=True, timeout=600
        )
        for r in range(args.rounds):
            for setup in SETUPS[r % len(SETUPS) :] + SETUPS[: r % len(SETUPS)]:
                cmd = [*front, "run", "--revalidate", "never", "--", *job_command(arrays, setup, EPOCHS)]
                out = _run(cmd, setup_env(env, setup), None)
                out["warm_seconds"] = sum(out["seconds"][1:])
                out["warm_cpu"] = sum(out["cpu"][1:])
                runs.setdefault(setup, []).append(out)
                print(f"round {r + 1} {setup:8} epochs 2-{EPOCHS}: {out['warm_seconds']:.2f} s, "
                      f"CPU {out['warm_cpu']:.2f} s", flush=True)  # fmt: skip
        if args.instructions:
            counted = instructions_section(
                arrays, run_env([*front, "run", "--revalidate", "never", "--"], env)
            )
    finally:
        shutil.rmtree(tier, ignore_errors=True)
    checks: list[Check] = []
    lines = [
        "# Sampler-aware prefetch on a warm cache: what it costs when nothing is left to fetch",
        "",
        f"Command: `python bench/bench_warm_prefetch.py --rounds {args.rounds}"
        f"{' --instructions' if args.instructions else ''} --out docs/benchmarks/warm-prefetch.md` "
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
    lines += counted[0]
    checks += counted[1]
    lines += ["", "## Targets", *targets(checks)]
    return finish(lines, checks, args.out)


if __name__ == "__main__":
    sys.exit(main())
