"""The main job end to end: a PyTorch training loop reading its samples through tierstore.

`make demo` runs this. It generates a small image-like dataset (1500 arrays of about 100 KiB, saved with
numpy.save) under /tmp/tierstore-demo/source and serves it through the stand-in shared store
(`python -m tierstore.slowfs`: a FUSE mount that answers like a loaded parallel file system, 1 ms per
metadata operation, 0.5 ms per read request, 200 MiB/s), so that reading it costs what a shared store
costs. A fresh RAM tier under /dev/shm goes in front of it, and 3 epochs of a `torch.utils.data.DataLoader`
with 2 worker processes open every sample with `cache.open` and `numpy.load`. Per epoch it prints the time
and what the cache did (source opens, reads and bytes, tier hits), then the `tierstore status` table and what to
try next. Every sample is checked against a checksum written when the dataset was generated; a wrong or
missing sample makes the demo exit with status 1. Where FUSE is not available the source is the local
directory itself, whose page cache already serves epochs 1-3 alike (the demo says so).

Usage: .venv/bin/python examples/demo.py [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import tierstore

ROOT = Path("/tmp/tierstore-demo")
DATA = ROOT / "source"
STORE = ROOT / "store"  # the stand-in shared store's mount over DATA
MANIFEST = ROOT / "manifest.json"
TIER_DIR = Path("/dev/shm/tierstore-demo")
TIER_SPEC = f"{TIER_DIR}:1GiB"

N_SAMPLES = 1500
N_CLASSES = 10
SHAPE = (180, 190, 3)  # height, width, channels: 100 KiB of uint8 per sample
EPOCHS = 3
BATCH = 32
WORKERS = 2


def generate() -> dict[str, int]:
    """Writes the dataset (or reuses a complete one) and returns {relative path: crc32 of the array}.

    The manifest is written last and lives outside the source, so an interrupted run is regenerated and
    the manifest is never part of what the job reads.
    """
    try:
        manifest: dict[str, int] = json.loads(MANIFEST.read_text())
        if len(manifest) == N_SAMPLES and all((DATA / rel).is_file() for rel in manifest):
            print(f"dataset: reusing {N_SAMPLES} samples in {DATA}")
            return manifest
    except (OSError, ValueError):
        pass
    print(f"dataset: generating {N_SAMPLES} samples of shape {SHAPE} uint8 in {DATA} ...", flush=True)
    shutil.rmtree(DATA, ignore_errors=True)
    MANIFEST.unlink(missing_ok=True)
    rng = np.random.default_rng(0)
    manifest = {}
    for i in range(N_SAMPLES):
        rel = f"class_{i % N_CLASSES:02d}/img_{i:05d}.npy"
        arr = rng.integers(0, 256, size=SHAPE, dtype=np.uint8)
        (DATA / rel).parent.mkdir(parents=True, exist_ok=True)
        np.save(DATA / rel, arr)
        manifest[rel] = zlib.crc32(arr.tobytes())
    MANIFEST.parent.mkdir(parents=True, exist_ok=True)
    MANIFEST.write_text(json.dumps(manifest))
    return manifest


class Samples(Dataset):
    """Reads each sample through the cache, as a job's Dataset would read it from the shared store."""

    def __init__(self, cache: tierstore.Cache, paths: list[str]) -> None:
        self.cache = cache
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        # The cache object was created in the main process; each forked worker uses it as is (tierstore
        # reopens its state in a new process), and all of them count into the same node-wide counters.
        with self.cache.open(self.paths[i]) as f:
            arr = np.load(f)
        return torch.from_numpy(arr), i


def delta(before: dict, after: dict) -> dict[str, int]:
    src0, src1 = before["source"], after["source"]
    return {
        "opens": src1["opens"] - src0["opens"],
        "reads": src1["reads"] - src0["reads"],
        "bytes": src1["bytes_read"] - src0["bytes_read"],
        "hits": sum(t["hits"] for t in after["tiers"]) - sum(t["hits"] for t in before["tiers"]),
    }


@contextlib.contextmanager
def shared_store() -> Any:
    """The dataset as the job sees it: through the stand-in shared store, or (no FUSE here) the directory
    itself. Yields (the source path, whether it is the stand-in store)."""
    from tierstore.testing.slowfs import mounted

    try:
        with mounted(DATA, STORE, meta_latency="1ms", data_latency="0.5ms", bandwidth="200MiB/s") as mount:
            yield mount, True
            return
    except (RuntimeError, OSError, ImportError) as e:
        print(f"store:   the stand-in shared store cannot be mounted here ({str(e).splitlines()[0]})")
    yield DATA, False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--keep",
        action="store_true",
        help=f"leave the dataset in {ROOT} (the next run reuses it) and the tier in {TIER_DIR} (for `tierstore status`)",
    )
    args = ap.parse_args()

    manifest = generate()
    try:
        with shared_store() as (source, stand_in):
            return run(source, stand_in, manifest, args.keep)
    finally:
        # After the stand-in store is unmounted: the dataset (about 150 MiB) and the tier go, unless kept.
        if not args.keep:
            shutil.rmtree(ROOT, ignore_errors=True)
            shutil.rmtree(TIER_DIR, ignore_errors=True)


def status_command(source: Path) -> str:
    """The `tierstore status` of the demo's cache."""
    return f"tierstore --source {source} --tier {TIER_SPEC} status"


def rerun_hint(source: Path, keep: bool) -> str:
    """How to see the demo's cache again once it has ended: its `tierstore status` stands only while the
    tier and the source directory do, which the demo removes unless --keep."""
    if keep:
        return f"the dataset and the tier stay (--keep): `{status_command(source)}` shows this table again"
    return (
        "the demo removes its dataset and tier as it ends, so the command above has nothing to show "
        "afterwards: run `.venv/bin/python examples/demo.py --keep` to keep them, then that command"
    )


def run(source: Path, stand_in: bool, manifest: dict[str, int], keep: bool = False) -> int:
    if stand_in:
        print(f"store:   {DATA} served at {source} by the stand-in shared store (1 ms per metadata op, "
              "0.5 ms per read, 200 MiB/s)")  # fmt: skip
    rels = sorted(manifest)
    paths = [str(source / rel) for rel in rels]
    expected = [manifest[rel] for rel in rels]

    # A fresh tier every run, so that epoch 1 starts from an empty cache and the counters start at zero.
    shutil.rmtree(TIER_DIR, ignore_errors=True)
    cache = tierstore.Cache(source=str(source), tiers=[TIER_SPEC], policy="fill")
    cache.reset_counters()
    print(f"cache:   source {source}, tier {TIER_SPEC}, policy fill")

    loader = DataLoader(
        Samples(cache, paths),
        batch_size=BATCH,
        shuffle=True,
        num_workers=WORKERS,
        # Workers must be forked to inherit the cache; set it explicitly because the default start method
        # is not fork everywhere (macOS, and Linux from Python 3.14).
        multiprocessing_context="fork",
        generator=torch.Generator().manual_seed(0),
    )

    print(f"job:     {EPOCHS} epochs, DataLoader batch {BATCH}, {WORKERS} workers, numpy.load per sample\n")
    print(
        f"{'epoch':>5}  {'time s':>7}  {'samples':>7}  {'source opens':>12}  {'source reads':>12}  "
        f"{'source bytes':>14}  {'tier hits':>9}"
    )
    wrong: list[str] = []
    later_bytes = 0
    for epoch in range(1, EPOCHS + 1):
        before = cache.stats()
        t0 = time.perf_counter()
        seen = np.zeros(len(paths), dtype=np.int64)
        brightness = 0.0
        for batch, idx in loader:
            brightness += batch.float().mean().item() * len(idx)  # the "model": mean pixel value
            for sample, i in zip(batch, idx.tolist(), strict=True):
                seen[i] += 1
                if zlib.crc32(sample.numpy().tobytes()) != expected[i]:
                    wrong.append(f"epoch {epoch}: {rels[i]} has wrong bytes")
        seconds = time.perf_counter() - t0
        d = delta(before, cache.stats())
        if epoch > 1:
            later_bytes += d["bytes"]
        if not (seen == 1).all():
            wrong.append(f"epoch {epoch}: {int((seen != 1).sum())} samples missing or repeated")
        print(
            f"{epoch:>5}  {seconds:>7.2f}  {int(seen.sum()):>7}  {d['opens']:>12,}  {d['reads']:>12,}  "
            f"{d['bytes']:>14,}  "
            f"{d['hits']:>9,}   (mean pixel {brightness / max(int(seen.sum()), 1):.2f})"
        )

    print(f"\n$ {status_command(source)}")
    sys.stdout.flush()
    # rich draws tables 80 columns wide when the output is not a terminal (make piped to tee, CI logs),
    # which squeezes the tier table into truncated cells; give it room there. A terminal keeps its width.
    env = dict(os.environ)
    if not sys.stdout.isatty():
        env.setdefault("COLUMNS", "160")
    subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "--source", str(source), "--tier", TIER_SPEC, "status"],
        check=True,
        env=env,
    )
    print(rerun_hint(source, keep))

    if wrong:
        print(f"\nFAILED: {len(wrong)} problems with the samples:", *wrong[:10], sep="\n  ")
        return 1
    print(
        f"\nall {EPOCHS * len(paths)} samples matched their checksums; "
        f"epochs 2-{EPOCHS} read {later_bytes:,} bytes from the source"
    )
    print(
        "source opens are the files opened on the store; source reads are its read calls: a sample's bytes in "
        "one, and one more that finds the file's end (so that a file that grew while it was copied is caught)"
    )
    if stand_in:
        print(
            "epoch 1 paid the store for every sample, once; epochs 2-3 read the RAM tier. Each epoch's time is "
            "bounded by the 2 workers' numpy.load and the checksums, not by the store."
        )
    else:
        print(
            f"the source {source} is a local directory whose page cache serves epochs 1-3 alike: on a shared "
            "store epoch 1 pays a round trip per sample and epochs 2-3 do not (mount FUSE to see it here)."
        )
    print(
        "\nnext:\n"
        "  tierstore --source /your/dataset --tier /dev/shm/tierstore:50% run -- python train.py"
        "   # any job, unchanged\n"
        "  tierstore --source /your/dataset --tier /dev/shm/tierstore:50% prefetch /your/dataset"
        "   # warm the cache first\n"
        '  loader = tierstore.torch.prefetching(DataLoader(...), budget="4G")'
        "   # epoch 1 fetched ahead in the sampler's order\n"
        "  make test   # the test suite;  make bench   # the benchmarks (docs/benchmarks/)\n"
        "  docs/guide/: object stores (S3), several nodes, write-back checkpoints, the model repository, streaming"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
