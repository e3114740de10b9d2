"""tierstore.torch with real DataLoader workers (fork and spawn)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

import tierstore

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

from tierstore.torch import CachedDataset, route  # noqa: E402


def make_images(root: Path, n: int = 96) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    images = []
    for i in range(n):
        img = rng.integers(0, 256, size=(16, 16, 3), dtype=np.uint8)
        (root / f"class{i % 4}").mkdir(exist_ok=True)
        np.save(root / f"class{i % 4}" / f"{i:04d}.npy", img)
        images.append(img)
    return images


def load_npy(f) -> torch.Tensor:
    return torch.from_numpy(np.load(f))


def epochs(loader: DataLoader, n: int) -> list[torch.Tensor]:
    return [torch.cat([b for b in loader]) for _ in range(n)]


# Spawned workers import torch afresh each time they start (seconds each): `make test-fast` spawns them
# once in this module, as persistent workers (started once for the three epochs); spawned and forkserver
# workers started anew each epoch are `slow`.
@pytest.mark.parametrize(
    ("workers", "context", "persistent"),
    [
        pytest.param(0, None, False, id="0-None"),
        pytest.param(2, "fork", False, id="2-fork"),
        pytest.param(4, "fork", False, id="4-fork"),
        pytest.param(2, "spawn", True, id="2-spawn-persistent"),
        pytest.param(2, "spawn", False, id="2-spawn", marks=pytest.mark.slow),
        pytest.param(2, "forkserver", False, id="2-forkserver", marks=pytest.mark.slow),
    ],
)
def test_cached_dataset_with_dataloader_workers(
    source: Path, tier: str, workers: int, context: str | None, persistent: bool
) -> None:
    make_images(source)
    cache = tierstore.Cache(source, [f"{tier}:64M"])
    plain = CachedDataset(source, load_npy, cache=cache, pattern="**/*.npy")
    expected = torch.stack([torch.from_numpy(np.load(p)) for p in plain.paths])
    loader = DataLoader(
        plain,
        batch_size=8,
        num_workers=workers,
        multiprocessing_context=context,
        persistent_workers=persistent,
    )
    first = epochs(loader, 1)[0]
    assert torch.equal(first, expected)
    cache.wait()
    read_after_epoch1 = cache.stats()["source"]["bytes_read"]
    assert cache.stats()["source"]["opens"] == len(plain)
    for later in epochs(loader, 2):
        assert torch.equal(later, expected)
    s = cache.stats()
    assert s["source"]["bytes_read"] == read_after_epoch1, "epochs 2-3 read the source"
    assert s["tiers"][0]["hits"] >= 2 * len(plain)


def test_cache_pickles_as_its_configuration(source: Path, tier: str) -> None:
    (source / "x").write_bytes(b"pickled")
    cache = tierstore.Cache(source, [f"{tier}:1M"], policy="lru")
    clone = pickle.loads(pickle.dumps(cache))
    assert clone.open(source / "x").read() == b"pickled"
    assert clone.config()["policy"] == ("lru", "argument")


class PathDataset(torch.utils.data.Dataset):
    """An existing, unmodified dataset that opens its files by path."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        with open(self.paths[i], "rb") as f:
            return torch.from_numpy(np.load(f))


@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_route_sends_an_existing_datasets_reads_through_the_cache(
    source: Path, tier: str, context: str
) -> None:
    make_images(source, 40)
    paths = sorted(str(p) for p in source.rglob("*.npy"))
    cache = tierstore.Cache(source, [f"{tier}:64M"])
    loader = DataLoader(
        route(PathDataset(paths), cache), batch_size=10, num_workers=2, multiprocessing_context=context
    )
    expected = torch.stack([torch.from_numpy(np.load(p)) for p in paths])
    for _ in range(2):
        assert torch.equal(torch.cat(list(loader)), expected)
        cache.wait()
    s = cache.stats()
    # Every read looked in the cache: the first epoch's files came from the store once (fetched by a read,
    # or ahead of it by the sampler-aware prefetch, which makes the read a hit), the second's were hits.
    t = s["tiers"][0]
    assert s["source"]["opens"] == len(paths)
    assert t["hits"] + t["misses"] == 2 * len(paths) and t["hits"] >= len(paths)
