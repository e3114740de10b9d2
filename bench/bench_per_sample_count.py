"""What `tierstore run` adds to a warm epoch of a job that opens one file per sample, counted rather than
timed: the per-sample jobs of bench_run.py (bench/per_sample_job.py: h5py and numpy readers) in a
DataLoader with a forked, persistent worker, the loader of DLIO's hdf5 workload. Timed on this machine,
their rounds disagree from one run to the next (docs/benchmarks/run.md: 1.38x one day, 1.14x the day
before, for the same code); a count does not move with the machine's load.

For each reader, two setups, the same files and the same shuffled order (the job seeds torch):

  local   the job reading the generated files where they are (a local directory)
  run     the same job under `tierstore run --revalidate never` (its defaults otherwise: the shim and the
          DataLoader hook), with that directory as the source and the tier on /dev/shm filled beforehand
          by `tierstore prefetch`, so that no epoch reads the source

Counted for each, a job of 4 epochs less one of 2, halved (the start, the first epoch and the worker's fork
cancel out), per sample:
- the user-space instructions of every process of the job (valgrind's callgrind, bench/counted.py);
- the system calls of every process, by kind (strace -f -c), whose kernel time the instruction count
  leaves out;
- the page faults and context switches of every process (getrusage), the kernel's work that no system call
  shows.

    .venv/bin/python bench/bench_per_sample_count.py --out docs/benchmarks/per-sample-count.md
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench_run import PerSampleSpec, generate_per_sample
from bench_shim_open import run_env
from bench_warm_read import shm_huge_setting
from counted import instructions, per_warm_epoch
from page import Check, finish, targets

HERE = Path(__file__).resolve().parent
READERS = ("h5py", "npy")
SETUPS = ("local", "run")
# One worker: what a sample costs does not depend on how many workers share the samples, and each forked
# worker's count repeats the loader's up to its fork (about 6 billion instructions for torch's import),
# which the difference of two jobs cancels but callgrind still has to run through.
WORKERS = 1
# bench_run.py's target for these jobs' warm epochs against a local copy, and, for h5py, DLIO's hdf5 one
# (0.95x the accelerators a local copy keeps busy: at most 1/0.95 of its work).
TARGET = 1.10
DLIO_TARGET = 1 / 0.95


def mounted_as(path: Path) -> str:
    """The file system type of the mount holding `path` (the longest mount point above it)."""
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    above = [m for m in mounts if len(m) > 2 and (str(path) + "/").startswith(m[1].rstrip("/") + "/")]
    return max(above, key=lambda m: len(m[1]))[2] if above else "unknown"


def job_command(data: Path, reader: str, epochs: int) -> list[str]:
    return [sys.executable, str(HERE / "per_sample_job.py"), str(data), reader, str(WORKERS), "1", "fork",
            str(epochs)]  # fmt: skip


def counted_job(data: Path, reader: str, envs: dict[str, dict[str, str]], setup: str, epochs: int) -> int:
    """The instructions of one job of `epochs` epochs, every process counted."""
    n = instructions(job_command(data, reader, epochs), envs[setup], children=True)
    print(f"{reader} {setup}, {epochs} epochs: {n:,} instructions", flush=True)
    return n


# What getrusage counts of a job's processes, beside its instructions and system calls: the kernel's work
# that neither shows (a page touched the first time, a switch to another thread or process).
KERNEL_COUNTS = {
    "ru_minflt": "page faults (minor)",
    "ru_majflt": "page faults (major)",
    "ru_nvcsw": "context switches (voluntary)",
    "ru_nivcsw": "context switches (involuntary)",
}


def kernel_counts(cmd: list[str], env: dict[str, str]) -> Counter[str]:
    """getrusage's counts (`KERNEL_COUNTS`) of `cmd` and every process it waited for."""
    pid = os.posix_spawn(cmd[0], cmd, env, file_actions=[
        (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0), (os.POSIX_SPAWN_OPEN, 1, "/dev/null", os.O_WRONLY, 0),
    ])  # fmt: skip
    _, status, usage = os.wait4(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({status})")
    return Counter({name: getattr(usage, name) for name in KERNEL_COUNTS})


def system_calls(cmd: list[str], env: dict[str, str]) -> Counter[str]:
    """The system calls of every process `cmd` runs, by name (strace -f -c)."""
    with tempfile.NamedTemporaryFile(prefix="strace-", mode="r") as out:
        subprocess.run(
            ["strace", "-f", "-c", "-U", "calls,name", "-o", out.name, *cmd],
            env=env, stdin=subprocess.DEVNULL, capture_output=True, check=True, timeout=3600,
        )  # fmt: skip
        calls: Counter[str] = Counter()
        for line in out.read().splitlines():
            fields = line.split()
            if len(fields) == 2 and fields[0].isdigit() and fields[1] != "total":
                calls[fields[1]] += int(fields[0])
        return calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=Path("/tmp/tierstore-bench-count"))
    ap.add_argument("--out", type=Path, help="write the Markdown page here")
    args = ap.parse_args(argv)
    for tool in ("valgrind", "strace"):
        if shutil.which(tool) is None:
            sys.exit(f"bench_per_sample_count: no {tool} (make bench-setup installs it)")
    started = time.time()
    spec = PerSampleSpec()
    data = generate_per_sample(args.root, spec)
    tier = Path("/dev/shm") / f"tierstore-bench-count-{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERSTORE_")}
    per_sample: dict[tuple[str, str], float] = {}
    counts: dict[tuple[str, str], tuple[int, int, int]] = {}
    calls: dict[tuple[str, str], Counter[str]] = {}
    kernel: dict[tuple[str, str], Counter[str]] = {}
    try:
        for reader in READERS:
            front = [sys.executable, "-m", "tierstore.cli", "--source", str(data[reader]),
                     "--tier", f"{tier / reader}:1G"]  # fmt: skip
            subprocess.run([*front, "prefetch", str(data[reader])], env=env, check=True, capture_output=True)
            envs = {"local": env, "run": run_env([*front, "run", "--revalidate", "never", "--"], env)}
            for setup in SETUPS:
                counts[reader, setup] = per_warm_epoch(
                    functools.partial(counted_job, data[reader], reader, envs, setup)
                )
                per_sample[reader, setup] = counts[reader, setup][2] / spec.samples
                two, four = (system_calls(job_command(data[reader], reader, e), envs[setup]) for e in (2, 4))
                calls[reader, setup] = Counter({k: four[k] - two[k] for k in four | two})
                two, four = (kernel_counts(job_command(data[reader], reader, e), envs[setup]) for e in (2, 4))
                kernel[reader, setup] = Counter({k: four[k] - two[k] for k in KERNEL_COUNTS})
                print(f"{reader} {setup}: {per_sample[reader, setup]:,.0f} instructions a sample", flush=True)
    finally:
        shutil.rmtree(tier, ignore_errors=True)

    checks: list[Check] = []
    lines = [
        "# One file per sample, counted: what `tierstore run` adds to a warm epoch",
        "",
        f"Command: `.venv/bin/python bench/bench_per_sample_count.py --out docs/benchmarks/per-sample-count.md` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, {time.time() - started:.0f} s)",
        "",
        f"{spec.samples:,} files of {spec.records} x {spec.row} float32 (one a sample), a shuffled DataLoader "
        f"(batch 32) with {WORKERS} forked, persistent worker; `run` under `tierstore run --revalidate never` "
        "with the tier on /dev/shm filled beforehand. Each count is a job of 4 epochs less one of 2, halved, "
        "over every process of the job, divided by the samples of an epoch. A count does not move with the "
        "machine's load; the kernel's work is not in the instructions, and the system calls beside them say "
        "where it differs. The kernel's reads also come from different places: the local copy is on "
        f"{mounted_as(args.root)} ({args.root}), the tier on {mounted_as(Path('/dev/shm'))} (/dev/shm, "
        f"{shm_huge_setting()}).",
        "",
        "Where `run`'s extra instructions go, process by process and object by object: "
        "[sample-attribution](sample-attribution.md).",
        "",
        "## User-space instructions (valgrind's callgrind)",
        "",
        "| reader | setup | 2 epochs | 4 epochs | a warm epoch | a sample | over `local` |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for reader in READERS:
        for setup in SETUPS:
            two, four, epoch = counts[reader, setup]
            ratio = per_sample[reader, setup] / per_sample[reader, "local"]
            lines.append(
                f"| {reader} | {setup} | {two:,} | {four:,} | {epoch:,} | {per_sample[reader, setup]:,.0f} "
                f"| {ratio:.4f}x |"
            )
        ratio = per_sample[reader, "run"] / per_sample[reader, "local"]
        checks.append((f"{reader}, a warm epoch under `run` at most {TARGET}x a local copy's instructions",
                       ratio <= TARGET, f"{ratio:.4f}x"))  # fmt: skip
        if reader == "h5py":
            checks.append((f"{reader} (DLIO's hdf5 workload: 0.95x the accelerators of a local copy), at most "
                           f"1/0.95 = {DLIO_TARGET:.3f}x a local copy's instructions", ratio <= DLIO_TARGET,
                           f"{ratio:.4f}x"))  # fmt: skip
    lines += [
        "",
        "## System calls a sample (strace -f -c), where the setups differ",
        "",
        "| reader | system call | `local` | `run` | `run` less `local` |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for reader in READERS:
        local, under = calls[reader, "local"], calls[reader, "run"]
        for name in sorted(local | under, key=lambda n: (-abs(under[n] - local[n]), n)):
            a, b = local[name] / 2 / spec.samples, under[name] / 2 / spec.samples
            if abs(b - a) >= 0.01:
                lines.append(f"| {reader} | `{name}` | {a:.2f} | {b:.2f} | {b - a:+.2f} |")
    lines += [
        "",
        "## Page faults and context switches a sample (getrusage of the job's processes)",
        "",
        "| reader | setup | " + " | ".join(KERNEL_COUNTS.values()) + " |",
        "| --- | --- |" + " ---: |" * len(KERNEL_COUNTS),
    ]
    for reader in READERS:
        for setup in SETUPS:
            row = " | ".join(f"{kernel[reader, setup][k] / 2 / spec.samples:.3f}" for k in KERNEL_COUNTS)
            lines.append(f"| {reader} | {setup} | {row} |")
    lines += targets(checks)
    return finish(lines, checks, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
