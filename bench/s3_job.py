"""The training job of bench/bench_s3.py: epochs of a PyTorch DataLoader over objects of an S3 bucket.

The same program in every mode; only how a sample's object is opened differs:

- s3fs: `s3fs.S3FileSystem.open` (every epoch reads the store);
- simplecache: fsspec's `simplecache::s3://` over s3fs, its cache directory shared by every process;
- tierstore: `tierstore.Cache(source="s3://bucket").open(key)`, or with `--source` any source (a
  directory of the stand-in shared store: bench/bench_peers.py); with `--names`, the datasets hold the
  cache and each object's full name, as a dataset that lists its files does;
- local: plain `open()` of a local copy of every object (the baseline: what reading cached copies costs),
  or of the files of another tool's mount (bench/bench_peers.py).

Samples are `small/NNNNN.bin` objects read whole (shuffled, one per sample) and, with `--large`, the
`large/NN.bin` objects read in 1 MiB records by the worker that owns them. Between epochs it prints a JSON
line (its seconds, and the CPU seconds of the job's processes: bench/cpu.py) and waits for a line on stdin,
so the benchmark can read the server's counters at epoch boundaries.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from cpu import tree_seconds

RECORD = 1 << 20


def source(args: argparse.Namespace) -> str:
    return args.source or f"s3://{args.bucket}"


def tierstore_cache(args: argparse.Namespace) -> Any:
    import tierstore

    s3 = json.loads(os.environ["BENCH_S3"])["tierstore"] if source(args).startswith("s3://") else None
    return tierstore.Cache(source=source(args), tiers=[args.tier], revalidate=args.revalidate or None, s3=s3)


def opener(args: argparse.Namespace) -> Any:
    if args.mode == "local":
        return lambda key: open(os.path.join(args.local, key), "rb")
    if args.mode == "tierstore":
        cache = tierstore_cache(args)
        return lambda key: cache.open(f"{source(args)}/{key}")
    settings = json.loads(os.environ["BENCH_S3"])
    import fsspec

    options = settings["s3fs"]
    if args.mode == "s3fs":
        fs = fsspec.filesystem("s3", **options)
    else:
        fs = fsspec.filesystem(
            "simplecache", target_protocol="s3", target_options=options, cache_storage=args.tier
        )
    return lambda key: fs.open(f"{args.bucket}/{key}", "rb")


class Objects(Dataset):
    """One sample per small object, read whole. With `--names` (tierstore mode), a dataset as many are
    written: it holds its cache and the full name of every object (`files`), and opens by that name."""

    def __init__(self, keys: list[str], args: argparse.Namespace) -> None:
        self.keys, self.args, self._open = keys, args, None
        if args.names:
            self.cache = tierstore_cache(args)
            self.files = [f"{source(args)}/{k}" for k in keys]

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.args.names:
            with self.cache.open(self.files[i]) as f:
                return torch.tensor([len(f.read())], dtype=torch.int64)
        if self._open is None:
            self._open = opener(self.args)
        with self._open(self.keys[i]) as f:
            data = f.read()
        return torch.tensor([len(data)], dtype=torch.int64)


class Large(IterableDataset):
    """Large objects read record by record, each worker through its own objects."""

    def __init__(self, keys: list[str], args: argparse.Namespace) -> None:
        self.keys, self.args, self._open = keys, args, None
        if args.names:
            self.cache = tierstore_cache(args)
            self.files = [f"{source(args)}/{k}" for k in keys]

    def __iter__(self):
        info = get_worker_info()
        names = self.files if self.args.names else self.keys
        mine = names[info.id :: info.num_workers] if info else names
        # Made once per worker, as for the small objects: persistent workers keep it between epochs.
        if self._open is None:
            self._open = self.cache.open if self.args.names else opener(self.args)
        for k in mine:
            with self._open(k) as f:
                total = 0
                while chunk := f.read(RECORD):
                    total += len(chunk)
                yield torch.tensor([total], dtype=torch.int64)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["s3fs", "simplecache", "tierstore", "local"], required=True)
    p.add_argument("--bucket", required=True)
    p.add_argument("--source", default="", help="tierstore mode: the cache's source (default s3://BUCKET)")
    p.add_argument("--tier", default="")
    p.add_argument("--local", default="")
    p.add_argument("--small", type=int, required=True)
    p.add_argument("--large", type=int, default=0)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--handshake", action="store_true")
    p.add_argument(
        "--revalidate",
        default="never",
        help="tierstore mode: the cache's revalidate setting ('': the default)",
    )
    p.add_argument(
        "--prefetch", default="", help="tierstore mode: wrap the loader in tierstore.torch.prefetching"
    )
    p.add_argument(
        "--names",
        action="store_true",
        help="tierstore mode: the datasets hold their cache and every object's full name (`files`), so "
        "that the DataLoader hook (tierstore.auto_order) can map each sample, as for a job nobody changed",
    )
    args = p.parse_args()
    keys = [f"small/{i:05d}.bin" for i in range(args.small)]
    small = Objects(keys, args)
    g = torch.Generator().manual_seed(0)
    loaders = [DataLoader(small, batch_size=32, shuffle=True, generator=g, num_workers=args.workers,
                          persistent_workers=True)]  # fmt: skip
    if args.prefetch:
        import tierstore.torch

        loaders[0] = tierstore.torch.prefetching(
            loaders[0],
            budget=args.prefetch,
            cache=tierstore_cache(args),
            paths=lambda i: f"{source(args)}/{keys[i]}",
        )
    if args.large:
        large = Large([f"large/{i:02d}.bin" for i in range(args.large)], args)
        loaders.append(DataLoader(large, batch_size=1, num_workers=args.workers, persistent_workers=True))
    for epoch in range(args.epochs):
        t0, cpu0 = time.perf_counter(), tree_seconds()
        total = 0
        for loader in loaders:
            for batch in loader:
                total += int(batch.sum())
        # CPU: this process and its loader workers (bench/cpu.py), not a FUSE tool's daemon.
        seconds, cpu = time.perf_counter() - t0, tree_seconds() - cpu0
        print(json.dumps({"epoch": epoch + 1, "seconds": seconds, "cpu": cpu, "bytes": total}), flush=True)
        if args.handshake:
            sys.stdin.readline()


if __name__ == "__main__":
    main()
