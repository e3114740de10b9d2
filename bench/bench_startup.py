"""Benchmark of what `tierstore run` adds to a job's start: `python -c "import torch"` with and without it.

The job imports torch (thousands of files opened and stat'ed, none of them under the source), so every
call the shim intercepts is one it must pass on quickly. `tierstore run` itself is a Python command that
reads its settings, sets up the shim and `exec`s the job, so its own start is counted too. The source is
a small local directory and the tier /dev/shm; the job reads nothing from either.

tierstore's modules are compiled to bytecode first, as a wheel's install by pip compiles them: an
editable install under PYTHONDONTWRITEBYTECODE would compile them again at every start.

Each round runs both commands, in an order that alternates from round to round; each is timed from
start to exit (wall), with the CPU time of the process and its children (`wait4`'s rusage). The ratio
is per round: with `tierstore run` over without.

    .venv/bin/python bench/bench_startup.py --out docs/benchmarks/startup.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from page import Check, finish, met, rounds, targets

TARGET = 1.05


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process and its children) of `cmd`, which must succeed."""
    t0 = time.perf_counter()
    pid = os.posix_spawn(cmd[0], cmd, env)
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({status})")
    return wall, usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write the page (Markdown) here")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args(argv)
    started = time.time()
    root = Path(tempfile.mkdtemp(prefix="tierstore-bench-startup-"))
    source = root / "source"
    source.mkdir()
    (source / "a.bin").write_bytes(b"x" * 4096)
    tier = Path("/dev/shm") / f"tierstore-bench-startup-{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERSTORE_")}
    job = [sys.executable, "-c", "import torch"]
    tierstore = [
        sys.executable,
        "-m",
        "tierstore.cli",
        "--source",
        str(source),
        "--tier",
        f"{tier}:1G",
        "run",
        "--",
    ]
    commands = {"plain": job, "run": [*tierstore, *job]}
    # Installed from a wheel, tierstore's modules are compiled once (pip writes their bytecode). An
    # editable install under PYTHONDONTWRITEBYTECODE (set on the machines this runs on) never writes it,
    # and every start would compile them again, about 25 ms of CPU that no user's start pays. So the
    # bytecode is written here first, as pip would: torch's and the standard library's are there already.
    import compileall

    compileall.compile_dir(str(Path(__file__).resolve().parents[1] / "python" / "tierstore"), quiet=1)
    # The command's own start, beside: `tierstore run` of a job that does nothing (`true`), whose CPU time
    # is steadier than the import's.
    commands["alone"] = [*tierstore, "true"]
    results: dict[str, list[tuple[float, float]]] = {"plain": [], "run": [], "alone": []}
    try:
        timed(commands["plain"], env)  # the first import fills the page cache for both
        timed(commands["run"], env)
        for r in range(args.rounds):
            for name in ("plain", "run") if r % 2 == 0 else ("run", "plain"):
                results[name].append(timed(commands[name], env))
            results["alone"].append(timed(commands["alone"], env))
            (p_wall, p_cpu), (r_wall, r_cpu) = results["plain"][-1], results["run"][-1]
            print(f"round {r + 1}: plain {p_wall:.2f} s ({p_cpu:.2f} CPU), run {r_wall:.2f} s ({r_cpu:.2f} CPU)",
                  flush=True)  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(tier, ignore_errors=True)
    wall = [r[0] / p[0] for p, r in zip(results["plain"], results["run"], strict=True)]
    cpu = [r[1] / p[1] for p, r in zip(results["plain"], results["run"], strict=True)]
    checks: list[Check] = [
        (f"`import torch` under `tierstore run` at most {TARGET}x without (wall)", met([TARGET / w for w in wall], 1.0), rounds(wall)),
        (f"`import torch` under `tierstore run` at most {TARGET}x without (CPU)", met([TARGET / c for c in cpu], 1.0), rounds(cpu)),
    ]  # fmt: skip
    lines = [
        "# Start-up: `import torch` with and without `tierstore run`",
        "",
        f"Command: `python bench/bench_startup.py --rounds {args.rounds} --out docs/benchmarks/startup.md` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, {time.time() - started:.0f} s)",
        "",
        "## Method",
        "",
        *[f"    {line}" if line.strip() else "" for line in __doc__.strip().splitlines()[2:]],
        "",
        "## Every round",
        "",
        "| round | plain, s | plain CPU s | under `tierstore run`, s | its CPU s | wall ratio | CPU ratio |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for i, ((pw, pc), (rw, rc)) in enumerate(zip(results["plain"], results["run"], strict=True)):
        lines.append(
            f"| {i + 1} | {pw:.3f} | {pc:.3f} | {rw:.3f} | {rc:.3f} | {rw / pw:.3f} | {rc / pc:.3f} |"
        )
    lines += [
        "",
        f"- wall: {rounds(wall)}; medians {statistics.median(r[0] for r in results['plain']):.3f} s and "
        f"{statistics.median(r[0] for r in results['run']):.3f} s",
        f"- CPU: {rounds(cpu)}",
        f"- `tierstore run -- true` alone: {statistics.median(a[1] for a in results['alone']) * 1000:.0f} ms of CPU "
        f"(median; rounds {', '.join(f'{a[1] * 1000:.0f}' for a in results['alone'])}), "
        f"{statistics.median(a[1] / p[1] for a, p in zip(results['alone'], results['plain'], strict=True)):.3f}x "
        "the plain import's CPU (median of the rounds' ratios): the part of the ratio that is the command's own start",
        "",
        "## Targets",
        *targets(checks),
    ]
    return finish(lines, checks, args.out)


if __name__ == "__main__":
    sys.exit(main())
