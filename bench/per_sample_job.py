"""The per-sample job of bench/bench_run.py: a PyTorch DataLoader whose Dataset opens one file per sample,
as common data-loading benchmarks do, with a reader that takes a path (so `tierstore run` serves it
unchanged):

- h5py: `h5py.File(path)["records"][k]` (one HDF5 file per sample, each holding a small "records" dataset);
- npy: `numpy.load(path)` (one .npy file per sample).

    per_sample_job.py ROOT READER WORKERS PERSISTENT CONTEXT EPOCHS

Between epochs it prints a JSON line and waits for a line on stdin, so that the benchmark can read the
stand-in store's counters at epoch boundaries.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from cpu import tree_seconds


class PerSample(Dataset):
    """Sample i is file i, opened by path in the worker that loads it."""

    def __init__(self, paths: list[str], reader: str) -> None:
        self.paths, self.reader = paths, reader

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.reader == "h5py":
            import h5py

            with h5py.File(self.paths[i], "r") as f:
                records = f["records"]
                sample = records[i % records.shape[0]]
        else:
            sample = np.load(self.paths[i])[0]
        return torch.from_numpy(np.ascontiguousarray(sample))


def main() -> None:
    root, reader = sys.argv[1], sys.argv[2]
    workers, persistent, context, epochs = int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5], int(sys.argv[6])
    suffix = ".h5" if reader == "h5py" else ".npy"
    paths = sorted(os.path.join(d, n) for d, _, ns in os.walk(root) for n in ns if n.endswith(suffix))
    loader = DataLoader(
        PerSample(paths, reader),
        batch_size=32,
        shuffle=True,
        num_workers=workers,
        persistent_workers=persistent,
        multiprocessing_context=context,
    )
    for epoch in range(1, epochs + 1):
        t0, c0 = time.perf_counter(), tree_seconds()
        samples = 0
        for batch in loader:
            samples += len(batch)
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
