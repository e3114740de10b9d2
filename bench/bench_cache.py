"""Benchmark of tierstore against plain `open()` on a generated dataset, with PASS/FAIL per target.

A dataset of many small files and a few large ones (4000 x 128 KiB + 32 x 32 MiB, 1.5 GiB; `--small` for a
quick 800 x 128 KiB + 8 x 8 MiB) is read for 3 epochs, each in its own shuffled order, in these setups:

  plain        `open(path, "rb").read()` on the source: what a job does without the cache.
  fit          `Cache.open` with a RAM tier (/dev/shm) large enough for the dataset.
  half         `Cache.open` with a tier quota of half the dataset, policy "fill".
  concurrent   4 processes read the whole dataset at once, each in its own order, through one cold cache.

Before the first epoch of each setup the page cache is dropped so the source is read cold, as from a
shared store. Every tierstore setup gets a fresh tier directory, which is a fresh cache. The targets:

  * source-read amplification 1.0 under concurrency (every source byte read once per node);
  * epochs 2 and 3 of `fit` read nothing from the source, at >= 90% of the throughput of reading the cached
    copies directly (this machine's limit, measured in the same run: 7 interleaved pairs of passes, by
    time and by CPU time, met when every pair meets it);
  * `half`: source bytes per later epoch <= (dataset - quota) + 1% of the dataset;
  * `Cache.lookup(p, validate=False)` of a cached entry under 5 us from Python.

Usage: .venv/bin/python bench/bench_cache.py [--small] [--out docs/benchmarks/cache.md]
The exit status is 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import shutil
import statistics
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import page
import tierstore
from units import human

KiB = 1024
MiB = 1024 * KiB

EPOCHS = 3
PROCS = 4
# Passes over the epoch-2 order for the throughput ratio: tierstore and the raw copies alternate, and each
# tierstore pass is compared with the raw pass beside it, by time and by CPU time; every pair is reported.
RATIO_PASSES = 7
LOOKUP_CALLS = 100_000
LOOKUP_ROUNDS = 3


@dataclass(frozen=True)
class Spec:
    """Shape of the generated dataset."""

    n_small: int
    small_size: int
    n_large: int
    large_size: int

    @property
    def total(self) -> int:
        return self.n_small * self.small_size + self.n_large * self.large_size

    def describe(self) -> str:
        return (
            f"{self.n_small} x {human(self.small_size)} + {self.n_large} x {human(self.large_size)} "
            f"= {self.n_small + self.n_large} files, {human(self.total)}"
        )


FULL = Spec(n_small=4000, small_size=128 * KiB, n_large=32, large_size=32 * MiB)
SMALL = Spec(n_small=800, small_size=128 * KiB, n_large=8, large_size=8 * MiB)


@dataclass
class Dataset:
    """The generated files: absolute paths in a fixed order, and the crc32 of each for checking reads."""

    source: Path
    paths: list[str]
    size: dict[str, int]
    crc: dict[str, int]
    total: int


@dataclass
class Epoch:
    """One pass over the dataset and what it cost the source."""

    label: str
    seconds: float
    nbytes: int
    opens: int | None
    stats: int | None
    reads: int | None
    bytes_read: int | None
    hits: int | None = None
    #: CPU seconds of this process over the epoch (time.process_time: the reading thread and the cache's
    #: copy threads), which the load of this shared machine does not stretch as it stretches `seconds`.
    cpu: float = 0.0

    @property
    def mib_s(self) -> float:
        return self.nbytes / MiB / self.seconds if self.seconds > 0 else float("inf")


@dataclass
class Setup:
    """The epochs of one configuration, with notes that explain how they were measured."""

    name: str
    title: str
    epochs: list[Epoch] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class Target:
    """A target of the issue, the measured value, and whether it is met."""

    name: str
    goal: str
    measured: str
    ok: bool | None  # None: undecided, the passes fall on both sides of the goal


RESULT = {True: "PASS", False: "FAIL", None: "UNDECIDED"}


# ---------------------------------------------------------------------------------------------- dataset


def generate(root: Path, spec: Spec) -> Dataset:
    """Writes the dataset under root/source, or reuses it when the manifest and every size match.

    The manifest lives beside the source, not in it, so it is not part of what is cached.
    """
    source = root / "source"
    manifest_path = root / "manifest.json"
    rels = [f"small/{i // 500:03d}/{i:05d}.bin" for i in range(spec.n_small)]
    rels += [f"large/{i:03d}.bin" for i in range(spec.n_large)]
    sizes = {r: spec.small_size if r.startswith("small/") else spec.large_size for r in rels}
    try:
        manifest = json.loads(manifest_path.read_text())
        reusable = manifest["spec"] == spec.__dict__ and set(manifest["crc"]) == set(rels)
        reusable = reusable and all((source / r).stat().st_size == sizes[r] for r in rels)
    except (OSError, ValueError, KeyError):
        reusable = False
    if reusable:
        print(f"reusing the dataset in {source} ({spec.describe()})")
        crc = manifest["crc"]
    else:
        print(f"generating the dataset in {source} ({spec.describe()}) ...", flush=True)
        t0 = time.perf_counter()
        shutil.rmtree(source, ignore_errors=True)
        manifest_path.unlink(missing_ok=True)
        rng = np.random.default_rng(20240601)
        crc = {}
        for r in rels:
            data = rng.bytes(sizes[r])  # incompressible, so no layer below can shortcut the reads
            path = source / r
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            crc[r] = zlib.crc32(data)
        # Written last: a run interrupted while generating leaves no manifest and is redone.
        manifest_path.write_text(json.dumps({"spec": spec.__dict__, "crc": crc}))
        print(f"  generated in {time.perf_counter() - t0:.1f} s")
    paths = [str(source / r) for r in rels]
    return Dataset(
        source,
        paths,
        {str(source / r): sizes[r] for r in rels},
        {str(source / r): crc[r] for r in rels},
        spec.total,
    )


def drop_page_cache() -> bool:
    """Drops the page cache so that the next source reads come from the disk, as from a shared store."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError:
        return False
    return True


def orders(paths: Sequence[str], seed: int) -> list[list[str]]:
    """A shuffled order per epoch; every setup gets the same orders, so they read the same sequence."""
    return [random.Random(seed + e).sample(list(paths), len(paths)) for e in range(EPOCHS)]


# ------------------------------------------------------------------------------------------- measuring


def proc_io() -> dict[str, int]:
    """Read syscalls and bytes of this process (/proc/self/io), to count what plain open() sends."""
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def read_plain(order: Sequence[str]) -> int:
    nbytes = 0
    for p in order:
        with open(p, "rb") as f:
            nbytes += len(f.read())
    return nbytes


def read_cached(cache: tierstore.Cache, order: Sequence[str]) -> int:
    nbytes = 0
    for p in order:
        with cache.open(p) as f:
            nbytes += len(f.read())
    return nbytes


def plain_epoch(label: str, order: Sequence[str]) -> Epoch:
    """One epoch of plain open(); its operations are the read syscalls and bytes of this process."""
    before = proc_io()
    t0, cpu0 = time.perf_counter(), time.process_time()
    nbytes = read_plain(order)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    after = proc_io()
    return Epoch(
        label,
        seconds,
        nbytes,
        opens=len(order),
        stats=None,
        reads=after["syscr"] - before["syscr"],
        bytes_read=after["rchar"] - before["rchar"],
        cpu=cpu,
    )


def cached_epoch(cache: tierstore.Cache, label: str, order: Sequence[str], wait: bool = False) -> Epoch:
    """One epoch through the cache; the source operations are deltas of the node-wide counters."""
    before = cache.stats()
    t0, cpu0 = time.perf_counter(), time.process_time()
    nbytes = read_cached(cache, order)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if wait:
        # Outside the timing: the copy pool writes small files into the tier after the job has their
        # bytes. Waiting for it makes the epoch's counters complete and the next epoch start from a
        # settled tier.
        cache.wait()
    after = cache.stats()
    return delta_epoch(label, seconds, nbytes, before, after, cpu)


def delta_epoch(
    label: str, seconds: float, nbytes: int, before: dict, after: dict, cpu: float = 0.0
) -> Epoch:
    """An epoch's row from the cache counters before and after it."""
    src0, src1 = before["source"], after["source"]
    return Epoch(
        label,
        seconds,
        nbytes,
        opens=src1["opens"] - src0["opens"],
        stats=src1["stats"] - src0["stats"],
        reads=src1["reads"] - src0["reads"],
        bytes_read=src1["bytes_read"] - src0["bytes_read"],
        hits=sum(t["hits"] for t in after["tiers"]) - sum(t["hits"] for t in before["tiers"]),
        cpu=cpu,
    )


def new_cache(ds: Dataset, tier_dir: Path, quota: int) -> tuple[tierstore.Cache, str]:
    """A cache on a fresh tier directory (a fresh tier is an empty, independent cache)."""
    shutil.rmtree(tier_dir, ignore_errors=True)
    spec = f"{tier_dir}:{quota}"
    cache = tierstore.Cache(source=str(ds.source), tiers=[spec], policy="fill")
    cache.reset_counters()
    return cache, spec


def cold(setup: Setup, dropped: list[bool]) -> None:
    if drop_page_cache():
        return
    if not dropped:
        print("note: cannot drop the page cache (needs root); first epochs may read the source warm")
    dropped.append(False)
    setup.notes.append("The page cache could not be dropped: epoch 1 may have read the source from RAM.")


# -------------------------------------------------------------------------------------------- setups


def run_plain(ds: Dataset, epoch_orders: list[list[str]], dropped: list[bool]) -> Setup:
    s = Setup("plain", "plain `open(path, 'rb').read()` on the source")
    cold(s, dropped)
    for e, order in enumerate(epoch_orders, 1):
        s.epochs.append(plain_epoch(str(e), order))
    s.notes.append(
        "Opens are counted by the loop; reads and bytes are the read syscalls and bytes of the process "
        "(/proc/self/io). Stats are not counted: CPython's open() + read() also fstat every file twice. "
        "Epochs 2-3 come from the page cache of this machine; every one of their operations still goes to "
        "the source file system."
    )
    return s


def interleaved(
    cache: tierstore.Cache, order: Sequence[str], copies: dict[str, str], passes: int, label: str
) -> tuple[list[Epoch], list[Epoch]]:
    """Passes of tierstore and of plain `open(copy, 'rb').read()` over the cached copies, alternating
    (raw first, then tierstore first, ...), so that both see the same state of the machine."""
    raw_order = [copies[p] for p in order]
    ts: list[Epoch] = []
    raw: list[Epoch] = []
    for i in range(passes):
        if i % 2 == 0:
            raw.append(plain_epoch("raw copies", raw_order))
        ts.append(cached_epoch(cache, label if i == 0 else f"{label} (repeat {i + 1})", order))
        if i % 2 == 1:
            raw.append(plain_epoch("raw copies", raw_order))
    return ts, raw


def pairs(ts: Sequence[Epoch], raw: Sequence[Epoch]) -> tuple[list[float], list[float]]:
    """Each pass pair's (tierstore's speed / the raw copies'), and (the raw copies' CPU time /
    tierstore's): 1.0 is as fast, and as cheap, as reading the copies directly."""
    speed = [t.mib_s / r.mib_s for t, r in zip(ts, raw, strict=True)]
    cpu = [r.cpu / t.cpu for t, r in zip(ts, raw, strict=True)]
    return speed, cpu


def each(ratios: Sequence[float]) -> str:
    """The median of `ratios` as a percentage, with every pass's."""
    return f"{100 * statistics.median(ratios):.1f}% (passes {', '.join(f'{100 * r:.0f}' for r in ratios)})"


def run_fit(
    ds: Dataset, epoch_orders: list[list[str]], tier_dir: Path, dropped: list[bool]
) -> tuple[Setup, dict[str, Any]]:
    """The dataset fits the tier: epoch 1 fills it, epochs 2-3 must be served from it alone."""
    cache, spec = new_cache(ds, tier_dir, 2 * ds.total)
    s = Setup("fit", f"tierstore, dataset fits the tier (`{spec}`, policy fill)")
    cold(s, dropped)
    s.epochs.append(cached_epoch(cache, "1", epoch_orders[0], wait=True))

    # The copies the cache serves, read directly: the fastest this machine can read these bytes.
    found = {p: cache.lookup(p, validate=False) for p in ds.paths}
    missing = [p for p, c in found.items() if c is None]
    # A file without a copy is read from the source by both sides; the zero-read target then fails.
    copies = {p: c or p for p, c in found.items()}
    order2 = epoch_orders[1]
    ts, raw = interleaved(cache, order2, copies, RATIO_PASSES, "2")
    s.epochs.append(ts[0])
    s.epochs.append(cached_epoch(cache, "3", epoch_orders[2]))
    s.notes.append(
        f"Throughput ratio: {RATIO_PASSES} tierstore passes (the first is epoch 2) and {RATIO_PASSES} "
        "passes of plain `open(copy, 'rb').read()` over the cached copies (paths from "
        "`lookup(p, validate=False)`), alternating, all in the epoch-2 order; each tierstore pass against "
        "the raw pass beside it. Tierstore: "
        + ", ".join(f"{e.mib_s:,.0f} MiB/s ({e.cpu:.2f} CPU s)" for e in ts)
        + "; raw copies: "
        + ", ".join(f"{e.mib_s:,.0f} MiB/s ({e.cpu:.2f} CPU s)" for e in raw)
        + "."
    )

    # The same comparison per file size, to show where the difference comes from: a per-open cost
    # weighs on small files, a per-byte cost on large ones.
    later = [*ts, s.epochs[2]]
    parts = []
    for size in sorted({ds.size[p] for p in ds.paths}):
        sub = [p for p in order2 if ds.size[p] == size]
        sub_ts, sub_raw = interleaved(cache, sub, copies, RATIO_PASSES, "")
        later += sub_ts
        speed, cpu = pairs(sub_ts, sub_raw)
        per_file = (
            statistics.median(t.cpu - r.cpu for t, r in zip(sub_ts, sub_raw, strict=True)) / len(sub) * 1e6
        )
        parts.append(
            f"{len(sub)} files of {human(size)}: speed {each(speed)}, CPU {each(cpu)}, "
            f"{per_file:+.1f} CPU us per file (median)"
        )
    s.notes.append(
        "By file size (paired passes, epoch-2 order), tierstore vs raw copies: " + "; ".join(parts) + "."
    )
    if missing:
        s.notes.append(f"{len(missing)} files had no cached copy after epoch 1 (e.g. {missing[0]}).")

    speed, cpu = pairs(ts, raw)
    result = {
        "later_reads": sum(e.reads or 0 for e in later),
        "later_bytes": sum(e.bytes_read or 0 for e in later),
        "speed": speed,
        "cpu": cpu,
        "lookup_us": lookup_latency(cache, ds.paths),
    }
    del cache
    shutil.rmtree(tier_dir, ignore_errors=True)
    return s, result


def lookup_latency(cache: tierstore.Cache, paths: Sequence[str]) -> float:
    """Mean time of `lookup(p, validate=False)` over cached paths, best of a few rounds, in microseconds.

    It includes the Python call, the path conversion and the loop, which a job pays too.
    """
    calls = [paths[i % len(paths)] for i in range(LOOKUP_CALLS)]
    lookup = cache.lookup
    fastest = float("inf")
    for _ in range(LOOKUP_ROUNDS):
        t0 = time.perf_counter()
        for p in calls:
            lookup(p, validate=False)
        fastest = min(fastest, time.perf_counter() - t0)
    return fastest / LOOKUP_CALLS * 1e6


def run_half(
    ds: Dataset, epoch_orders: list[list[str]], tier_dir: Path, dropped: list[bool]
) -> tuple[Setup, dict[str, Any]]:
    """Half the dataset fits: what does not fit is read from the source every epoch, and no more."""
    quota = ds.total // 2
    cache, spec = new_cache(ds, tier_dir, quota)
    s = Setup("half", f"tierstore, tier quota half the dataset (`{spec}`, policy fill)")
    cold(s, dropped)
    for e, order in enumerate(epoch_orders, 1):
        s.epochs.append(cached_epoch(cache, str(e), order, wait=True))
    tier = cache.stats()["tiers"][0]
    s.notes.append(
        f"The tier holds {tier['entries']} files, {human(tier['bytes_used'])} of the {human(quota)} quota; "
        "files that do not fit are read from the source every epoch (policy fill never evicts)."
    )
    del cache
    shutil.rmtree(tier_dir, ignore_errors=True)
    return s, {"quota": quota, "later_bytes": [e.bytes_read or 0 for e in s.epochs[1:]]}


def concurrent_reader(
    rank: int,
    source: str,
    tier_spec: str,
    paths: list[str],
    crc: dict[str, int],
    start: Any,
    results: Any,
) -> None:
    """One of the processes of the concurrency test: reads every file in its own order and checks it."""
    try:
        cache = tierstore.Cache(source=source, tiers=[tier_spec], policy="fill")
        order = random.Random(1000 + rank).sample(paths, len(paths))
        start.wait()  # all processes start reading together, so that they race for the same files
        t0 = time.perf_counter()
        bad = []
        nbytes = 0
        for p in order:
            with cache.open(p) as f:
                data = f.read()
            nbytes += len(data)
            if zlib.crc32(data) != crc[p]:
                bad.append(p)
        seconds = time.perf_counter() - t0
        cache.wait()  # publish this process's copies before it exits
        results.put({"rank": rank, "seconds": seconds, "nbytes": nbytes, "bad": bad})
    except BaseException as e:
        results.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})
        raise


def run_concurrent(ds: Dataset, tier_dir: Path, dropped: list[bool]) -> tuple[Setup, dict[str, Any]]:
    """PROCS processes read the whole dataset at once through a cold cache; each byte must leave the
    source once. The processes are spawned, not forked, so each opens the cache as a separate job would."""
    cache, spec = new_cache(ds, tier_dir, 2 * ds.total)
    s = Setup("concurrent", f"tierstore, {PROCS} processes at once through one cold cache (`{spec}`)")
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(PROCS + 1)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=concurrent_reader, args=(r, str(ds.source), spec, ds.paths, ds.crc, start, results)
        )
        for r in range(PROCS)
    ]
    for p in procs:
        p.start()
    cold(s, dropped)  # after the processes have imported everything, right before they read
    before = cache.stats()
    t0 = time.perf_counter()
    start.wait(timeout=300)
    got = [results.get(timeout=600) for _ in procs]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join(timeout=60)
    cache.wait()
    after = cache.stats()
    errors = [g["error"] for g in got if "error" in g]
    bad = sorted({b for g in got for b in g.get("bad", [])})
    nbytes = sum(g.get("nbytes", 0) for g in got)
    s.epochs.append(delta_epoch(f"{PROCS} x 1", wall, nbytes, before, after))
    per_proc = ", ".join(
        f"{g['seconds']:.1f}" for g in sorted(got, key=lambda g: g["rank"]) if "seconds" in g
    )
    s.notes.append(
        f"Time is the wall time until all {PROCS} processes had read every file; each took {per_proc} s "
        f"(including a crc32 of every file read, checked against the generator's). Throughput counts the "
        f"bytes delivered to all processes."
    )
    del cache
    shutil.rmtree(tier_dir, ignore_errors=True)
    amplification = s.epochs[-1].bytes_read / ds.total
    return s, {"amplification": amplification, "errors": errors, "bad": bad, "nbytes": nbytes}


# --------------------------------------------------------------------------------------------- report


def fmt(v: int | None) -> str:
    return "-" if v is None else f"{v:,}"


def table(s: Setup) -> str:
    head = (
        "| epoch | time s | MiB/s | source opens | source stats | source reads | source bytes | tier hits |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for e in s.epochs:
        lines.append(
            f"| {e.label} | {e.seconds:.2f} | {e.mib_s:,.0f} | {fmt(e.opens)} | {fmt(e.stats)} | "
            f"{fmt(e.reads)} | {fmt(e.bytes_read)} | {fmt(e.hits)} |"
        )
    return "\n".join(lines)


def machine(spec: Spec, shm_root: Path, data_root: Path) -> list[str]:
    with open("/proc/meminfo") as f:
        mem_kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break

    def fs_type(path: Path) -> str:
        best, kind = "", "?"
        with open("/proc/mounts") as f:
            for line in f:
                _, mnt, fstype = line.split()[:3]
                if str(path).startswith(mnt) and len(mnt) > len(best):
                    best, kind = mnt, fstype
        return f"{kind} ({best})"

    return [
        f"- CPU: {os.cpu_count()} cores (nproc), {cpu}",
        f"- RAM: {mem_kib / 1024 / 1024:.1f} GiB",
        f"- kernel: {platform.system()} {platform.release()}",
        f"- Python {platform.python_version()}, tierstore {tierstore.__version__}",
        f"- source: {data_root / 'source'} on {fs_type(data_root)}; dataset {spec.describe()}",
        f"- tiers: a fresh memory tier per setup under {shm_root} on {fs_type(shm_root)}, removed after it",
    ]


def report(
    command: str, facts: list[str], setups: list[Setup], targets: list[Target], ds: Dataset, seconds: float
) -> str:
    out = [
        "# Dataset cache",
        "",
        "Produced by `bench/bench_cache.py` (`make bench`); every number below is measured by that run.",
        "",
        f"Command: `{command}` ({time.strftime('%Y-%m-%d %H:%M %Z')}, {seconds:.0f} s)",
        "",
        "## Machine",
        "",
        *facts,
        "",
        "## Method",
        "",
        f"Each setup reads the whole dataset ({human(ds.total)}, {len(ds.paths)} files) for {EPOCHS} epochs, "
        "each epoch in its own shuffled order (the same orders in every setup), reading every file whole "
        "with `f.read()`. The page cache is dropped (`sync; echo 1 > /proc/sys/vm/drop_caches`) before the "
        "first epoch of each setup, so epoch 1 reads the source cold, as from a shared store. Each tierstore "
        "setup uses a fresh tier directory (an empty cache) and resets the node-wide counters; the source "
        "columns are deltas of `Cache.stats()['source']` over the epoch (opens, stats, read calls, bytes).",
        "",
        "## Targets",
        "",
        "| target | goal | measured | result |",
        "|---|---|---|---|",
        *(f"| {t.name} | {t.goal} | {t.measured} | {RESULT[t.ok]} |" for t in targets),
        "",
    ]
    for s in setups:
        out += [f"## {s.name}: {s.title}", "", table(s), ""]
        out += [f"- {n}" for n in s.notes]
        out.append("")
    out += [
        "## Other benchmarks",
        "",
        "- [Model repository](models.md): the model repository against torch.save, safetensors, "
        "h5py and the raw disk (`bench/bench_models.py`).",
        "- [tierstore run and tierstore.torch](run.md): `tierstore run` and `tierstore.torch` with DataLoader jobs on "
        "the stand-in parallel file system (`bench/bench_run.py`).",
        "",
        "## Reading these numbers",
        "",
        "- The source here is this machine's local disk, not a shared store. Its epochs 2-3 come from the "
        "page cache at memory speed, so plain `open()` looks as fast as the cache; on Lustre or GPFS every "
        "one of those operations would cross the network. What the cache saves shows in the source columns.",
        "- Epoch 1 of `fit` writes every byte into the RAM tier as well as reading it. With a local source "
        "as fast as memory and 2 cores, that copy (page allocation and memcpy into tmpfs) is the visible "
        "cost of epoch 1; against a shared store the source read dominates. The `half` setup copies half "
        "the data, and its epoch 1 is correspondingly closer to plain.",
        "",
    ]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help=f"quick run: {SMALL.describe()}")
    ap.add_argument(
        "--out", type=Path, help="write the results as Markdown to this file (e.g. docs/benchmarks/cache.md)"
    )
    ap.add_argument("--data", type=Path, default=Path("/tmp/tierstore-bench"), help="where the dataset lives")
    ap.add_argument("--shm", type=Path, default=Path("/dev/shm"), help="where the memory tiers are created")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    spec = SMALL if args.small else FULL
    data_root = args.data / ("small" if args.small else "full")
    ds = generate(data_root, spec)
    # Free room for the tiers: /dev/shm and the page cache share this machine's RAM.
    need = 2 * ds.total
    if shutil.disk_usage(args.shm).free < need:
        print(f"error: {args.shm} has less than {human(need)} free for the tiers", file=sys.stderr)
        return 2
    shm_root = args.shm / f"tierstore-bench-{os.getpid()}"
    epoch_orders = orders(ds.paths, seed=7)
    dropped: list[bool] = []
    setups: list[Setup] = []
    try:
        print("plain open() ...", flush=True)
        setups.append(run_plain(ds, epoch_orders, dropped))
        print("tierstore, dataset fits ...", flush=True)
        fit_setup, fit = run_fit(ds, epoch_orders, shm_root / "fit", dropped)
        setups.append(fit_setup)
        print("tierstore, quota half the dataset ...", flush=True)
        half_setup, half = run_half(ds, epoch_orders, shm_root / "half", dropped)
        setups.append(half_setup)
        print(f"tierstore, {PROCS} concurrent processes ...", flush=True)
        conc_setup, conc = run_concurrent(ds, shm_root / "concurrent", dropped)
        setups.append(conc_setup)
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)

    limit = (ds.total - half["quota"]) + ds.total // 100
    targets = [
        Target(
            f"source-read amplification, {PROCS} processes, cold cache",
            "1.0 (source bytes read / dataset bytes)",
            f"{conc['amplification']:.4f} ({conc_setup.epochs[0].bytes_read:,} / {ds.total:,} B)",
            abs(conc["amplification"] - 1.0) < 1e-9 and not conc["errors"],
        ),
        Target(
            "bytes delivered correct under concurrency",
            "crc32 of every file read equals the generator's",
            (
                f"{len(conc['bad'])} files wrong"
                + (f"; errors: {'; '.join(conc['errors'])}" if conc["errors"] else "")
                + f"; {conc['nbytes']:,} B read"
            ),
            not conc["bad"] and not conc["errors"] and conc["nbytes"] == PROCS * ds.total,
        ),
        Target(
            "fit: source data reads in epochs 2-3",
            "0 reads, 0 bytes",
            f"{fit['later_reads']} reads, {fit['later_bytes']:,} B (epochs 2, 3 and every repeat pass)",
            fit["later_reads"] == 0 and fit["later_bytes"] == 0,
        ),
        Target(
            "fit: throughput vs. reading the cached copies directly",
            ">= 90% in every pass",
            each(fit["speed"]),
            page.met(fit["speed"], 0.90),
        ),
        Target(
            "fit: CPU time of reading the cached copies directly vs. tierstore's",
            ">= 90% in every pass",
            each(fit["cpu"]),
            page.met(fit["cpu"], 0.90),
        ),
        *(
            Target(
                f"half quota: source bytes in epoch {e}",
                f"<= (dataset - quota) + 1% = {limit:,} B",
                f"{b:,} B ({b / ds.total:.1%} of the dataset)",
                b <= limit,
            )
            for e, b in enumerate(half["later_bytes"], 2)
        ),
        Target(
            "lookup of a cached entry, in process",
            "< 5 us",
            f"{fit['lookup_us']:.2f} us mean over {LOOKUP_CALLS:,} calls from Python (best of {LOOKUP_ROUNDS})",
            fit["lookup_us"] < 5.0,
        ),
    ]
    seconds = time.perf_counter() - t_start
    command = " ".join(
        [".venv/bin/python", "bench/bench_cache.py", *(argv if argv is not None else sys.argv[1:])]
    )
    text = report(command, machine(spec, shm_root, data_root), setups, targets, ds, seconds)
    print()
    print(text)
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    return 0 if all(t.ok is not False for t in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
