"""The training job of bench/bench_run.py: 3 epochs of a PyTorch DataLoader with 4 workers and a fixed
simulated compute per batch. It is the same program in every mode; only how it opens files differs:

- plain: `open()` (run as is: direct, or under `tierstore run`, which changes nothing in it);
- cache: `tierstore.default_cache().open()` (tierstore.torch style, configured by TIERSTORE_* variables).

Between epochs it prints a JSON line and waits for a line on stdin, so that the benchmark can read the
stand-in store's counters at epoch boundaries.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from cpu import tree_seconds


def opener(mode: str):
    if mode == "cache":
        import tierstore

        cache = tierstore.default_cache()
        return cache.open
    return lambda p: open(p, "rb")


class SmallFiles(Dataset):
    """One sample per file, read whole."""

    def __init__(self, paths: list[str], mode: str) -> None:
        self.paths, self.mode = paths, mode
        self._open = None

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        if self._open is None:
            self._open = opener(self.mode)
        with self._open(self.paths[i]) as f:
            data = f.read()
        return torch.frombuffer(bytearray(data[:64]), dtype=torch.uint8)


class Shards(IterableDataset):
    """TFRecord-like: large shard files read record by record, each worker through its own shards."""

    def __init__(self, paths: list[str], record: int, mode: str) -> None:
        self.paths, self.record, self.mode = paths, record, mode

    def __iter__(self):
        info = get_worker_info()
        mine = self.paths[info.id :: info.num_workers] if info else self.paths
        open_ = opener(self.mode)
        for p in mine:
            with open_(p) as f:
                while chunk := f.read(self.record):
                    yield torch.frombuffer(bytearray(chunk[:64]), dtype=torch.uint8)


def main() -> None:
    root, kind, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    compute_ms, epochs, workers = float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    paths = sorted(os.path.join(d, n) for d, _, ns in os.walk(root) for n in ns if n.endswith(".bin"))
    if kind == "small":
        ds: Dataset = SmallFiles(paths, mode)
        loader = DataLoader(ds, batch_size=32, shuffle=True, num_workers=workers, persistent_workers=False)
    else:
        ds = Shards(paths, 256 << 10, mode)
        loader = DataLoader(ds, batch_size=8, num_workers=workers)
    for epoch in range(1, epochs + 1):
        t0, c0 = time.perf_counter(), tree_seconds()
        samples = 0
        for batch in loader:
            samples += len(batch)
            time.sleep(compute_ms / 1000)  # the model's step
        print(
            json.dumps(
                {
                    "epoch": epoch,
                    "seconds": time.perf_counter() - t0,
                    "cpu": tree_seconds() - c0,
                    "samples": samples,
                }
            ),
            flush=True,
        )
        sys.stdin.readline()


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
