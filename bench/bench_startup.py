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

A third setup in each round runs the job with the environment `tierstore run` gives it (the shim
preloaded, the DataLoader hook's sitecustomize on the path) but not under the command: what the shim
and the hook cost the job itself, apart from the command's own start.

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

from bench_shim_open import run_env
from counted import instructions
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


def instructions_section(
    commands: dict[str, list[str]], envs: dict[str, dict[str, str]]
) -> tuple[list[str], float]:
    """The page's section of instruction counts: the command's own start, the job with and without the
    environment it is given, and what the two add to the job under `tierstore run`; and that ratio."""
    plain = instructions(commands["plain"], envs["plain"])
    shim = instructions(commands["shim"], envs["shim"])
    alone = instructions(commands["alone"], envs["alone"], before_exec=True)
    under = alone + shim
    print(
        f"instructions: plain {plain:,}, shim {shim:,}, run's own {alone:,}: {under / plain:.4f}x", flush=True
    )
    return [
        "",
        "## Instructions (valgrind's callgrind, user space)",
        "",
        "What each side executes, counted: the count does not move with the machine's load. The kernel's "
        "part is not in it.",
        "",
        "| what | instructions | over the plain import |",
        "| --- | ---: | ---: |",
        f"| `python -c 'import torch'` | {plain:,} | |",
        f"| the same job with `tierstore run`'s environment (the shim, the DataLoader hook) | {shim:,} "
        f"| {shim - plain:+,} |",
        f"| `tierstore run`'s own start, to its `exec` of the job | {alone:,} | {alone:+,} |",
        f"| under `tierstore run` (the two above) | {under:,} | {under - plain:+,} ({under / plain:.4f}x) |",
    ], under / plain


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write the page (Markdown) here")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument(
        "--instructions",
        action="store_true",
        help="also count each side's instructions with valgrind (5 min)",
    )
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
    # The job with the environment the command hands it (`env -0` run by the command), without the command.
    shim_env = run_env(tierstore, env)
    commands["shim"] = job
    envs = {"plain": env, "run": env, "shim": shim_env, "alone": env}
    results: dict[str, list[tuple[float, float]]] = {"plain": [], "run": [], "shim": [], "alone": []}
    setups = ["plain", "run", "shim"]
    try:
        for name in setups:  # the first import fills the page cache for all
            timed(commands[name], envs[name])
        for r in range(args.rounds):
            for name in setups[r % 3 :] + setups[: r % 3]:  # each setup first in turn
                results[name].append(timed(commands[name], envs[name]))
            results["alone"].append(timed(commands["alone"], env))
            print(f"round {r + 1}: " + ", ".join(f"{n} {results[n][-1][0]:.2f} s ({results[n][-1][1]:.2f} CPU)" for n in setups),
                  flush=True)  # fmt: skip
        counted, counted_ratio = instructions_section(commands, envs) if args.instructions else ([], None)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(tier, ignore_errors=True)
    wall = [r[0] / p[0] for p, r in zip(results["plain"], results["run"], strict=True)]
    cpu = [r[1] / p[1] for p, r in zip(results["plain"], results["run"], strict=True)]
    shim_wall = [s[0] / p[0] for p, s in zip(results["plain"], results["shim"], strict=True)]
    shim_cpu = [s[1] / p[1] for p, s in zip(results["plain"], results["shim"], strict=True)]
    checks: list[Check] = [
        (f"`import torch` under `tierstore run` at most {TARGET}x without (wall)", met([TARGET / w for w in wall], 1.0), rounds(wall)),
        (f"`import torch` under `tierstore run` at most {TARGET}x without (CPU)", met([TARGET / c for c in cpu], 1.0), rounds(cpu)),
    ]  # fmt: skip
    if counted_ratio is not None:  # a count: one figure, no rounds to straddle the target
        checks.append((f"`import torch` under `tierstore run` at most {TARGET}x without (instructions)",
                       counted_ratio <= TARGET, f"{counted_ratio:.4f}x"))  # fmt: skip
    lines = [
        "# Start-up: `import torch` with and without `tierstore run`",
        "",
        f"Command: `.venv/bin/python bench/bench_startup.py --rounds {args.rounds}"
        f"{' --instructions' if args.instructions else ''} --out docs/benchmarks/startup.md` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, {time.time() - started:.0f} s)",
        "",
        "## Method",
        "",
        *[f"    {line}" if line.strip() else "" for line in __doc__.strip().splitlines()[2:]],
        "",
        "## Every round",
        "",
        "| round | plain, s | plain CPU s | under `tierstore run`, s | its CPU s | wall ratio | CPU ratio "
        "| shim alone, s | its CPU s | CPU ratio |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    rows = zip(results["plain"], results["run"], results["shim"], strict=True)
    for i, ((pw, pc), (rw, rc), (sw, sc)) in enumerate(rows):
        lines.append(
            f"| {i + 1} | {pw:.3f} | {pc:.3f} | {rw:.3f} | {rc:.3f} | {rw / pw:.3f} | {rc / pc:.3f} "
            f"| {sw:.3f} | {sc:.3f} | {sc / pc:.3f} |"
        )
    lines += [
        "",
        f"- wall: {rounds(wall)}; medians {statistics.median(r[0] for r in results['plain']):.3f} s and "
        f"{statistics.median(r[0] for r in results['run']):.3f} s",
        f"- CPU: {rounds(cpu)}",
        f"- the shim and the hook alone (the job with the environment `tierstore run` gives it, not under the "
        f"command): wall {rounds(shim_wall)}; CPU {rounds(shim_cpu)}",
        f"- `tierstore run -- true` alone: {statistics.median(a[1] for a in results['alone']) * 1000:.0f} ms of CPU "
        f"(median; rounds {', '.join(f'{a[1] * 1000:.0f}' for a in results['alone'])}), "
        f"{statistics.median(a[1] / p[1] for a, p in zip(results['alone'], results['plain'], strict=True)):.3f}x "
        "the plain import's CPU (median of the rounds' ratios): the part of the ratio that is the command's own start",
        *counted,
        "",
        "## Targets",
        *targets(checks),
    ]
    return finish(lines, checks, args.out)


if __name__ == "__main__":
    sys.exit(main())
