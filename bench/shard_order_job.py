"""The training job of bench/bench_shard_order.py: an ordinary webdataset script that knows nothing of
tierstore.

    python bench/shard_order_job.py ROOT --epochs N

A `webdataset.WebDataset` over ROOT's `shard-*.tar` in list order (`shardshuffle=False`, its default
`split_by_worker`), samples shuffled within a buffer, a DataLoader of batch 16 with 2 fork workers,
persistent, and a fixed 10 ms step per batch standing in for the model.

Prints one JSON line: per epoch, the seconds from `iter(loader)` to the last batch and the CPU seconds of
the job's processes; and a digest of every batch, so that setups can be checked to see the same samples.
"""

from __future__ import annotations

import argparse
import glob
import os

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import DataLoader

from cpu import timed_epochs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--step-ms", type=float, default=10.0)
    args = ap.parse_args()
    urls = sorted(glob.glob(os.path.join(args.root, "shard-*.tar")))
    dataset = (
        wds.WebDataset(urls, shardshuffle=False, empty_check=False)
        .shuffle(64, rng=__import__("random").Random(2026))
        .to_tuple("npy", "cls")
        .map_tuple(
            lambda b: torch.from_numpy(np.frombuffer(b, dtype=np.uint8)[128:].copy()).float().mean(), int
        )
    )
    loader = DataLoader(
        dataset, batch_size=16, num_workers=2, multiprocessing_context="fork", persistent_workers=True
    )
    timed_epochs(loader, args.epochs, lambda b: (round(b[0].sum().item(), 3), b[1].tolist()), args.step_ms)


if __name__ == "__main__":
    main()
