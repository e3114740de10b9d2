"""Benchmark of `tierstore prefetch` on the stand-in parallel file system, against `xargs -P8 cat`.

A tree of 2000 files of 128 KiB (40 directories of 50) is served by the FUSE stand-in store
(`tierstore.slowfs`, default latencies: 1 ms per metadata operation, 0.5 ms per read request, 500 MiB/s).
In one run, each measured `--repeats` times on a freshly mounted store:

  xargs cold       `find MNT -type f | xargs -P8 -n 50 cat > /dev/null`: every byte read once, 8 at a time.
  prefetch cold    `tierstore prefetch MNT` into a fresh RAM tier (the command line, Python start included).
  prefetch warm    the same command again on the filled tier, with revalidate = "never" (a read-only dataset:
                   confirmed from the index) and with revalidate = "always" (one stat per file).

Before each cold run the backing files are dropped from the page cache where the kernel allows it
(`posix_fadvise(DONTNEED)`); the stand-in store itself keeps no cache (its mount has zero attribute and
entry timeouts, and FUSE drops a file's pages when it is opened again). The store's own counters give the
operations each run sent it.

    .venv/bin/python bench/bench_prefetch.py --out docs/benchmarks/prefetch.md

The exit status is 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tierstore.testing.slowfs import mounted, read_stats

PY = sys.executable
OPS = ("getattr", "open", "read", "readdir", "release", "access", "readlink", "statfs")


@dataclass
class Spec:
    files: int = 2000
    size: int = 128 << 10
    per_dir: int = 50


@dataclass
class Runs:
    """Repeated measurements of one setup: seconds and the store's operation counts per run."""

    name: str
    seconds: list[float] = field(default_factory=list)
    ops: list[dict[str, int]] = field(default_factory=list)

    def median(self) -> float:
        return statistics.median(self.seconds)

    def median_ops(self) -> dict[str, int]:
        keys = {k for o in self.ops for k in o}
        return {k: int(statistics.median(o.get(k, 0) for o in self.ops)) for k in keys}


def generate(root: Path, spec: Spec) -> Path:
    """The backing directory of the store; the tree is its `tree/` (the store's root also lists its
    counters file, which is not data)."""
    d = root / "data" / "tree"
    marker = root / "data" / f".complete-{spec.files}-{spec.size}-{spec.per_dir}"
    if not marker.exists():
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        for i in range(spec.files):
            sub = d / f"dir{i // spec.per_dir:03d}"
            sub.mkdir(exist_ok=True)
            (sub / f"{i:06d}.bin").write_bytes(os.urandom(spec.size))
        marker.touch()
    return d.parent


def drop_cache(tree: Path) -> bool:
    """Evicts the backing files from the page cache (a no-op on tmpfs). True if the kernel accepted it."""
    ok = True
    for p in tree.rglob("*.bin"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            ok = False
        finally:
            os.close(fd)
    return ok


def timed(cmd: list[str], mnt: Path, env: dict[str, str] | None = None) -> tuple[float, dict[str, int], str]:
    """Runs `cmd`; returns its wall time, the store operations it caused and its output."""
    before = read_stats(mnt)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t0
    after = read_stats(mnt)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stdout}{r.stderr}")
    ops = {k: after.get(k, 0) - before.get(k, 0) for k in OPS}
    return seconds, ops, r.stdout + r.stderr


def prefetch_cmd(mnt: Path, tier: Path, jobs: int | None) -> list[str]:
    cmd = [
        PY,
        "-m",
        "tierstore.cli",
        "--source",
        str(mnt),
        "--tier",
        f"{tier}:4G",
        "prefetch",
        "--no-progress",
    ]
    if jobs is not None:
        cmd += ["--jobs", str(jobs)]
    return [*cmd, str(mnt / "tree")]


def env_with(revalidate: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERSTORE_")}
    env["TIERSTORE_REVALIDATE"] = revalidate
    env["TIERSTORE_LOG"] = "off"
    return env


def per_file_ops(ops: dict[str, int], dirs: int) -> int:
    """Operations of a warm run that are not directory work, per file: opens, reads, and lookups or
    attribute requests beyond what opening and listing each directory costs on this store (a lookup of
    its name, its attributes, a few more from the kernel's revalidation: at most 5)."""
    extra = ops.get("open", 0) + ops.get("read", 0) + max(0, ops.get("getattr", 0) - 5 * dirs)
    return extra


def ops_text(ops: dict[str, int]) -> str:
    shown = [f"{k} {ops[k]}" for k in OPS if ops.get(k)]
    return ", ".join(shown) or "none"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write the results as Markdown here")
    ap.add_argument("--root", type=Path, default=Path("/tmp/tierstore-bench-prefetch"))
    ap.add_argument("--repeats", type=int, default=3, help="runs of every setup; tables give medians")
    ap.add_argument("--jobs", type=int, help="--jobs of the prefetch (default: the command's own default)")
    ap.add_argument("--small", action="store_true", help="a quick run on 400 files")
    args = ap.parse_args(argv)
    spec = Spec(files=400) if args.small else Spec()
    t_start = time.perf_counter()
    backing = generate(args.root, spec)
    mnt = args.root / "mnt"
    tier = Path("/dev/shm") / f"tierstore-bench-prefetch-{os.getpid()}"
    xargs, cold = Runs("xargs -P8 cat, cold"), Runs("tierstore prefetch, cold")
    never, always = (
        Runs("tierstore prefetch, warm, revalidate never"),
        Runs("tierstore prefetch, warm, always"),
    )
    dropped = True
    outputs: list[str] = []
    xargs_cmd = f"find {mnt / 'tree'} -type f | xargs -P8 -n 50 cat > /dev/null"
    try:
        for r in range(args.repeats):
            print(f"round {r + 1} of {args.repeats} ...", flush=True)
            # The two cold runs alternate which goes first, each on a store mounted for it.
            cold_runs = [("xargs", xargs), ("prefetch", cold)]
            for which, runs in cold_runs[r % 2 :] + cold_runs[: r % 2]:
                dropped &= drop_cache(backing / "tree")
                with mounted(backing, mnt):
                    if which == "xargs":
                        s, ops, _ = timed(["bash", "-c", xargs_cmd], mnt)
                        runs.seconds.append(s)
                        runs.ops.append(ops)
                        continue
                    shutil.rmtree(tier, ignore_errors=True)
                    s, ops, out = timed(prefetch_cmd(mnt, tier, args.jobs), mnt, env_with("always"))
                    if f"prefetched {spec.files} files" not in out or f"{spec.files} copied" not in out:
                        raise RuntimeError(f"the cold prefetch did not copy every file: {out}")
                    runs.seconds.append(s)
                    runs.ops.append(ops)
                    outputs.append(out.strip())
                    for revalidate, warm in (("never", never), ("always", always)):
                        s, ops, out = timed(prefetch_cmd(mnt, tier, args.jobs), mnt, env_with(revalidate))
                        if f"{spec.files} already cached" not in out:
                            raise RuntimeError(f"the warm prefetch found files missing: {out}")
                        warm.seconds.append(s)
                        warm.ops.append(ops)
    finally:
        shutil.rmtree(tier, ignore_errors=True)
    seconds = time.perf_counter() - t_start
    # Each round's cold prefetch over that round's cold xargs (they alternate which runs first).
    pairs = [c / x for c, x in zip(cold.seconds, xargs.seconds, strict=True)]
    ratio = statistics.median(pairs)
    each = ", ".join(f"{r:.2f}" for r in pairs)
    dirs = spec.files // spec.per_dir + 1  # and the tree itself
    targets = [
        (
            "prefetch cold vs xargs -P8 cat cold",
            "<= 1.20x in every round",
            f"{ratio:.2f}x (rounds {each})",
            all(r <= 1.20 for r in pairs),
        ),
        ("prefetch warm, revalidate never", "< 1 s", f"{never.median():.2f} s", never.median() < 1.0),
        (
            "store operations per file, warm, revalidate never (open, read; getattr beyond 5 per directory)",
            "0",
            f"{per_file_ops(never.median_ops(), dirs)} (open {never.median_ops().get('open', 0)}, "
            f"read {never.median_ops().get('read', 0)}, getattr {never.median_ops().get('getattr', 0)} "
            f"for {dirs} directories)",
            per_file_ops(never.median_ops(), dirs) == 0,
        ),
    ]
    mib = spec.files * spec.size / (1 << 20)
    lines = [
        "# tierstore prefetch on a stand-in parallel file system",
        "",
        f"Command: `.venv/bin/python bench/bench_prefetch.py {' '.join(argv if argv is not None else sys.argv[1:])}` "
        f"({time.strftime('%Y-%m-%d %H:%M %Z')}, {seconds:.0f} s)",
        "",
        "## Method",
        "",
        f"- The tree: {spec.files} files of {spec.size >> 10} KiB ({mib:.0f} MiB) in "
        f"{spec.files // spec.per_dir} directories, served by `tierstore.slowfs` (FUSE) with its defaults: 1 ms "
        "per metadata operation, 0.5 ms per read request, 500 MiB/s shared. Its own counters give the operations.",
        f"- `xargs`: `{xargs_cmd.replace(str(mnt), 'MNT')}`. `prefetch`: "
        f"`tierstore --source MNT --tier /dev/shm/...:4G prefetch --no-progress{f' --jobs {args.jobs}' if args.jobs else ''} MNT/tree` "
        '(the whole command: Python start, walk, copies), cold into a fresh tier with revalidate = "always" '
        '(set; the default is "60s"), then warm on the filled tier with revalidate = "never" and "always".',
        "- Each cold run gets a freshly mounted store; the two cold setups alternate which runs first. "
        + (
            "Before each, the backing files are evicted from the page cache (`posix_fadvise(DONTNEED)`)."
            if dropped
            else "The backing files could not be evicted from the page cache."
        ),
        f"- {args.repeats} rounds; the tables give medians. The machine: {os.cpu_count()} cores, shared.",
        "",
        "## Targets",
        "",
        "| target | goal | measured | result |",
        "|---|---|---|---|",
        *(f"| {n} | {g} | {m} | {'PASS' if ok else 'FAIL'} |" for n, g, m, ok in targets),
        "",
        "## Runs",
        "",
        "| setup | seconds (median) | all runs | MiB/s | store operations (median) |",
        "|---|---:|---|---:|---|",
    ]
    for runs in (xargs, cold, never, always):
        rate = f"{mib / runs.median():.0f}" if runs in (xargs, cold) else "-"
        lines.append(
            f"| {runs.name} | {runs.median():.2f} | {', '.join(f'{s:.2f}' for s in runs.seconds)} | {rate} "
            f"| {ops_text(runs.median_ops())} |"
        )
    lines += [
        "",
        f"Ratio prefetch cold / xargs cold, each round's: {each} (median {ratio:.2f}x). Warm, revalidate never: "
        f"{never.median():.2f} s; "
        f"always: {always.median():.2f} s.",
        "",
        "Output of the last cold prefetch:",
        "",
        "```",
        outputs[-1] if outputs else "",
        "```",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if all(ok for *_, ok in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
