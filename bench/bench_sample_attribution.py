"""Where the user-space instructions that `tierstore run` adds to a warm epoch go, process by process and
object by object: the npy job of bench_per_sample_count.py (bench/per_sample_job.py, a shuffled DataLoader
with one forked, persistent worker), counted with callgrind under `tierstore run --revalidate never` and
reading a local copy, 4 epochs less 2, halved, per sample, for:

- each process of the job: the loader's (the main process, which `tierstore run` exec's into) and its
  worker's (forked; its counts start from the loader's at the fork, which the difference cancels);
- each ELF object (the shim, the Python binding, libc, the interpreter...), by the instructions executed in
  its own functions;
- the functions whose count differs most.

    .venv/bin/python bench/bench_sample_attribution.py --out docs/benchmarks/sample-attribution.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from bench_per_sample_count import job_command
from bench_run import PerSampleSpec, generate_per_sample
from bench_shim_open import run_env
from counted import Profile, profiles

READER = "npy"
# How many functions of each process the page lists, those whose count differs most.
FUNCTIONS = 12


def job_profiles(data: Path, env: dict[str, str], epochs: int) -> dict[str, Profile]:
    """The job's profiles by role: `loader` (the first process running the job) and `worker` (the next);
    a helper the job runs (torch's `ldconfig -p`) is left out."""
    found = [p for p in profiles(job_command(data, READER, epochs), env) if "per_sample_job.py" in p.command]
    if len(found) != 2:
        raise SystemExit(
            f"bench_sample_attribution: expected a loader and a worker, found {len(found)} processes"
        )
    return {"loader": found[0], "worker": found[1]}


def per_sample(two: Counter[object], four: Counter[object], samples: int) -> dict[object, float]:
    """A warm epoch's count of each key per sample: 4 epochs less 2, halved."""
    return {k: (four[k] - two[k]) / 2 / samples for k in four | two}


def short(obj: str) -> str:
    return os.path.basename(obj) or "(unknown)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=Path("/tmp/tierstore-bench-attribution"))
    ap.add_argument("--out", type=Path, help="write the Markdown section here")
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        sys.exit("bench_sample_attribution: no valgrind (make bench-setup installs it)")
    started = time.time()
    spec = PerSampleSpec()
    data = generate_per_sample(args.root, spec)[READER]
    tier = Path("/dev/shm") / f"tierstore-bench-attribution-{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERSTORE_")}
    front = [sys.executable, "-m", "tierstore.cli", "--source", str(data), "--tier", f"{tier}:1G"]
    objects: dict[tuple[str, str], dict[object, float]] = {}
    functions: dict[tuple[str, str], dict[object, float]] = {}
    try:
        subprocess.run([*front, "prefetch", str(data)], env=env, check=True, capture_output=True)
        envs = {"local": env, "run": run_env([*front, "run", "--revalidate", "never", "--"], env)}
        for setup, setup_env in envs.items():
            two, four = (job_profiles(data, setup_env, epochs) for epochs in (2, 4))
            for role in ("loader", "worker"):
                objects[setup, role] = per_sample(two[role].objects, four[role].objects, spec.samples)
                functions[setup, role] = per_sample(two[role].functions, four[role].functions, spec.samples)
                print(f"{setup} {role}: {sum(objects[setup, role].values()):,.0f} a sample", flush=True)
    finally:
        shutil.rmtree(tier, ignore_errors=True)

    lines = [
        "# Where the instructions `tierstore run` adds to a warm epoch go",
        "",
        f"Command: `.venv/bin/python bench/bench_sample_attribution.py --out docs/benchmarks/sample-attribution.md` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, {time.time() - started:.0f} s)",
        "",
        f"The {READER} job of [the per-sample count](per-sample-count.md) ({spec.samples:,} files of "
        f"{spec.records} x {spec.row} float32, a shuffled DataLoader with one forked, persistent worker; the "
        "tier on /dev/shm filled beforehand), counted the same way (valgrind's callgrind, 4 epochs less 2, "
        "halved, per sample) and split by process and by the ELF object whose own functions executed the "
        "instructions (objects that differ by fewer than 50 a sample are left out of the table, not the "
        "totals).",
        "",
        "| process | object | `local` | `run` | `run` less `local` |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for role in ("loader", "worker"):
        local, under = objects["local", role], objects["run", role]
        total = sum(under.values()) - sum(local.values())
        for obj in sorted(local.keys() | under.keys(), key=lambda o: -abs(under.get(o, 0) - local.get(o, 0))):
            a, b = local.get(obj, 0.0), under.get(obj, 0.0)
            if abs(b - a) >= 50:
                lines.append(f"| {role} | `{short(str(obj))}` | {a:,.0f} | {b:,.0f} | {b - a:+,.0f} |")
        lines.append(
            f"| {role} | all | {sum(local.values()):,.0f} | {sum(under.values()):,.0f} | {total:+,.0f} |"
        )
    for role in ("loader", "worker"):
        local, under = functions["local", role], functions["run", role]
        lines += [
            "",
            f"The {role}'s {FUNCTIONS} functions whose count a sample differs most:",
            "",
            "| function | object | `run` less `local` |",
            "| --- | --- | ---: |",
        ]
        ranked = sorted(local.keys() | under.keys(), key=lambda k: -abs(under.get(k, 0) - local.get(k, 0)))
        for key in ranked[:FUNCTIONS]:
            obj, fn = key  # type: ignore[misc]
            lines.append(
                f"| `{str(fn)[:80]}` | `{short(str(obj))}` | {under.get(key, 0) - local.get(key, 0):+,.0f} |"
            )
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
