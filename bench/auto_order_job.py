"""The training job of bench/bench_auto_order.py: an ordinary PyTorch script that knows nothing of tierstore.

    python bench/auto_order_job.py ROOT --dataset folder|npy|computed --epochs N [--wrap BUDGET]

`folder`: a torchvision-style `DatasetFolder` (its `samples`: (path, class) per image, decoded with PIL;
torchvision's own is not installed here, its layout and attributes are the same). `npy`: a custom Dataset
holding its list of `.npy` paths (`self.files`), read with `numpy.load`. `computed`: the same files, the
dataset building each name from its index and holding no list. A shuffled DataLoader (batch 16, 2
fork workers, a seeded generator) and a fixed 5 ms step per batch standing in for the model. `--wrap` is
the one line a user would add for the explicit wrapper, `tierstore.torch.prefetching`.

Prints one JSON line: per epoch, the seconds from `iter(loader)` to the last batch and the CPU seconds of
the job's processes; and a digest of every batch, so that setups can be checked to see the same samples.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from cpu import timed_epochs

SEED = 2026


class Folder(Dataset):
    """torchvision.datasets.DatasetFolder, as far as a job sees it: `classes`, `samples`, `targets`."""

    def __init__(self, root: str) -> None:
        self.classes = sorted(d for d in os.listdir(root) if not d.startswith("."))
        self.samples = [
            (os.path.join(root, c, f), k)
            for k, c in enumerate(self.classes)
            for f in sorted(os.listdir(os.path.join(root, c)))
        ]
        self.targets = [k for _, k in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, target = self.samples[i]
        with open(path, "rb") as f:
            image = Image.open(f).convert("RGB")
        return torch.from_numpy(np.asarray(image)).permute(2, 0, 1).float().mean((1, 2)), target


class Arrays(Dataset):
    """A custom dataset of `.npy` files, as many jobs write one."""

    def __init__(self, root: str) -> None:
        self.files = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".npy"))

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(np.load(self.files[i])).float().mean(0)


class Computed(Dataset):
    """A custom dataset that builds each file's name from its index and keeps no list of names: it says
    nothing of its files, so tierstore learns them from what each sample opens in the first epoch. The
    same files, in the same order, as `Arrays`."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.n = sum(1 for f in os.listdir(root) if f.endswith(".npy"))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(np.load(os.path.join(self.root, f"a{i:04d}.npy"))).float().mean(0)


DATASETS = {"folder": Folder, "npy": Arrays, "computed": Computed}


def loader_for(dataset: Dataset) -> DataLoader:
    g = torch.Generator().manual_seed(SEED)
    return DataLoader(dataset, batch_size=16, shuffle=True, num_workers=2, generator=g,
                      multiprocessing_context="fork", persistent_workers=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--dataset", choices=tuple(DATASETS), default="folder")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--step-ms", type=float, default=5.0)
    ap.add_argument("--wrap", metavar="BUDGET", help="the explicit wrapper, tierstore.torch.prefetching")
    args = ap.parse_args()
    dataset = DATASETS[args.dataset](args.root)
    loader = loader_for(dataset)
    if args.wrap:
        import tierstore.torch

        files = [p for p, _ in dataset.samples] if args.dataset == "folder" else dataset.files
        loader = tierstore.torch.prefetching(loader, budget=args.wrap, paths=files)

    def summary(batch: Any) -> object:
        return (batch[0].sum().item(), batch[1].tolist()) if args.dataset == "folder" else batch.sum().item()

    timed_epochs(loader, args.epochs, summary, args.step_ms)


if __name__ == "__main__":
    main()
