"""PyTorch integration: a map-style Dataset that reads its files through the cache, and a wrapper that
routes an existing Dataset's file reads through it.

Both work with any `num_workers` under fork, spawn and forkserver: the cache pickles as its configuration
and every worker process opens the same node-wide cache, so each file is still fetched once per node.
"""

from __future__ import annotations

import builtins
import contextlib
import fnmatch
import glob
import io
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch.utils.data

from tierstore import _core
from tierstore.auto_order import LoaderPrefetch, flat, prefetched_explicitly
from tierstore.cache import Cache, PathLike, default_cache
from tierstore.types import OrderProgress


def _read_all(f: Any) -> bytes:
    return f.read()


class CachedDataset(torch.utils.data.Dataset):
    """Files of a directory (or a list of files), each read through the cache and decoded.

    Args:
        files: A directory (walked recursively, or matched with `pattern`), an object store prefix
            ("s3://bucket/prefix", every object under it), or a sequence of file paths or keys.
        decode: Called with the open binary file of a sample; returns the sample. Defaults to the bytes.
            `numpy.load`, `PIL.Image.open` (then `.convert(...)`), `torch.load` all fit.
        cache: The cache to read through; the default cache when None.
        pattern: With a directory, a glob relative to it (`"train/**/*.jpg"`).
        transform: Applied to the decoded sample.
    """

    def __init__(
        self,
        files: PathLike | Sequence[PathLike],
        decode: Callable[[Any], Any] | None = None,
        *,
        cache: Cache | None = None,
        pattern: str = "**/*",
        transform: Callable[[Any], Any] | None = None,
    ) -> None:
        self.cache = cache if cache is not None else default_cache()
        if isinstance(files, str) and "://" in files:
            # An object store prefix: its objects, listed by the store (the pattern matches keys below it).
            prefix = files.rstrip("/")
            keys = self.cache._core.list_files(prefix)
            everything = pattern in ("**/*", "**", "*")
            paths = [p for p in keys if everything or fnmatch.fnmatch(p[len(prefix) + 1 :], pattern)]
            if not paths:
                raise FileNotFoundError(f"no object under {prefix} matches {pattern!r}")
            self.paths = paths
        elif isinstance(files, (str, bytes, os.PathLike)):
            root = os.fsdecode(files)
            if not os.path.isdir(root):
                raise NotADirectoryError(f"{root} is not a directory; give a directory or a list of files")
            paths = [p for p in glob.glob(os.path.join(root, pattern), recursive=True) if os.path.isfile(p)]
            if not paths:
                raise FileNotFoundError(f"no file under {root} matches {pattern!r}")
            self.paths = sorted(paths)
        else:
            self.paths = [os.fsdecode(p) for p in files]
        self.decode = decode or _read_all
        self.transform = transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Any:
        with self.cache.open(self.paths[index]) as f:
            sample = self.decode(f)
        return self.transform(sample) if self.transform is not None else sample


class _RoutedOpen:
    """`builtins.open` that serves read-only opens of files under the source from the cache."""

    def __init__(self, cache: Cache, original: Callable[..., Any]) -> None:
        self.cache = cache
        self.original = original
        self.prefixes = tuple(
            {cache.source.rstrip("/") + "/", os.path.realpath(cache.source).rstrip("/") + "/"}
        )

    def __call__(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, (str, os.PathLike)) and mode in ("r", "rb", "rt", "br") and not args:
            path = os.path.abspath(os.fsdecode(file))
            if path.startswith(self.prefixes) and not set(kwargs) - {"encoding", "errors", "newline"}:
                raw = self.cache.open(path)
                if "b" in mode:
                    return raw
                return io.TextIOWrapper(io.BufferedReader(raw), **kwargs)  # type: ignore[arg-type]
        return self.original(file, mode, *args, **kwargs)


class Routed(torch.utils.data.Dataset):
    """Wraps a Dataset so that the files its `__getitem__` opens with `open()` under the cache's source
    are read through the cache (PIL.Image.open, numpy.load, pickle and plain `open` all use it).

    Readers that open files from C (h5py, some decoders) bypass `open()`; run the job under
    `tierstore run` for those.
    """

    def __init__(self, dataset: Any, cache: Cache | None = None) -> None:
        self.dataset = dataset
        self.cache = cache if cache is not None else default_cache()

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        original = builtins.open
        builtins.open = _RoutedOpen(self.cache, original)
        try:
            return self.dataset[index]
        finally:
            builtins.open = original


def route(dataset: Any, cache: Cache | None = None) -> Routed:
    """Routes an existing Dataset's file reads through the cache (see `Routed`)."""
    return Routed(dataset, cache)


# Sampler-aware prefetch -------------------------------------------------------------------------------
#
# The sampler knows the epoch's order before the first batch (NoPFS's "clairvoyance"). `OrderedSampler`
# wraps any sampler (or batch sampler): at the start of each epoch it materializes the wrapped sampler's
# order once, exactly as iterating it would (same RNG draws, same DistributedSampler shard), hands the
# files of that order to an ordered prefetch, and yields the same indices one by one. The DataLoader's main
# process runs `prefetch_factor * num_workers` batches ahead of the workers, so the sampler's position says
# little about what has been read: reads are recorded where they happen, by `_MarkReads` in the workers,
# into a shared read-marks file (slot 0: the epoch's tag; slot i + 1: the tag of the epoch in which
# dataset index i was last read), and the budget counts bytes fetched and not yet read there.


class _MarkReads(torch.utils.data.Dataset):
    """A map-style Dataset that records each index it has read in a read-marks file (see above)."""

    def __init__(self, dataset: Any, marks_path: str) -> None:
        from tierstore.order import ReadMarker

        self.dataset = dataset
        self.marker = ReadMarker(marks_path)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        # Begun before the read: the prefetch leaves this sample's files to this reader from now on.
        self.marker.mark_started(int(index) + 1)
        item = self.dataset[index]
        # After the read: bytes being read still count as ahead until the sample is in memory.
        self.marker.mark_read(int(index) + 1)
        return item

    def __getitems__(self, indices: list[int]) -> list[Any]:
        # The DataLoader calls this instead of __getitem__ when the dataset has it (Subset does): it must
        # not reach the wrapped dataset's own through __getattr__, or reads would go unrecorded. Each sample
        # is begun before its read and read after it, as in __getitem__, with the marks of a batch made in
        # one loop.
        batched = getattr(self.dataset, "__getitems__", None)
        if batched is None:
            dataset = self.dataset
            return [dataset[i] for i in self.marker.begin_then_read_each(indices)]
        for _ in self.marker.begin_each(indices):
            pass
        items = batched(indices)
        self.marker.read_each(indices)
        return list(items)

    def __getattr__(self, name: str) -> Any:
        if name in ("dataset", "marker"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


def _paths_of(
    dataset: Any, paths: Sequence[PathLike] | Callable[[int], PathLike] | None
) -> Callable[[int], str]:
    """The file of each dataset index: from `paths`, or the dataset's own `paths` (CachedDataset, Routed)."""
    if callable(paths):
        fn = paths
        return lambda i: os.fsdecode(fn(i))
    if paths is None:
        inner = dataset.dataset if isinstance(dataset, Routed) else dataset
        paths = getattr(inner, "paths", None)
        if paths is None:
            raise TypeError(
                f"cannot tell which file sample i of {type(dataset).__name__} reads: give paths= (a list of "
                "files indexed like the dataset, or a function of the index), or use CachedDataset"
            )
    listed = [os.fsdecode(p) for p in paths]  # type: ignore[union-attr]
    return listed.__getitem__


class OrderedSampler(torch.utils.data.Sampler):  # type: ignore[type-arg]
    """Wraps a sampler (or batch sampler) so that each epoch's files are prefetched in its order.

    It yields exactly what the wrapped sampler yields, in the same order, consuming its random generator
    as iterating it would: the model sees the same samples. Used by `prefetching`, which also records the
    workers' reads; build it by hand only together with a dataset wrapped the same way.

    Args:
        sampler: Any sampler: RandomSampler (with its generator), DistributedSampler (each rank
            prefetches its own shard), SequentialSampler, a BatchSampler, your own.
        paths: Maps a dataset index to its file: `paths[i]` or `paths(i)`.
        cache: The cache the dataset reads through.
        budget: Bytes fetched ahead of the readers at most (a size like "4G" or a number of bytes).
        marks_path: The read-marks file the dataset's reads are recorded in.
        jobs: Files fetched at once (default 32).
    """

    def __init__(
        self,
        sampler: Any,
        paths: Callable[[int], str],
        cache: Cache,
        budget: int,
        marks_path: str,
        jobs: int | None = None,
    ) -> None:
        self.sampler = sampler
        self.marks_path = marks_path
        self.epochs = LoaderPrefetch(
            cache, None, "paths=", "prefetching", budget, jobs, marks_path, path_of=paths
        )

    @property
    def epoch_tag(self) -> int:
        """The current epoch's tag in the read-marks file (slot 0)."""
        return self.epochs.tag

    @property
    def prefetch(self) -> _core.OrderPrefetch | None:
        """The current epoch's ordered prefetch (`tierstore.order.OrderPrefetch`'s core), None before."""
        return self.epochs.prefetch

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """Passed to the wrapped sampler (DistributedSampler reshuffles by epoch)."""
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Any:
        order = list(iter(self.sampler))  # every RNG draw the epoch makes, in the same order
        self.epochs.start(flat(order))
        yield from order

    def progress(self) -> OrderProgress | None:
        """The current epoch's prefetch progress (see `OrderPrefetch.progress`), None before the first."""
        return self.epochs.progress()

    def stop(self) -> None:
        """Stops the current epoch's prefetch."""
        self.epochs.stop()


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def prefetching(
    loader: torch.utils.data.DataLoader,  # type: ignore[type-arg]
    budget: int | str = "2G",
    *,
    paths: Sequence[PathLike] | Callable[[int], PathLike] | None = None,
    cache: Cache | None = None,
    jobs: int | None = None,
) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    """The same DataLoader, with each epoch's files prefetched in its sampler's order.

    One line: `loader = tierstore.torch.prefetching(DataLoader(ds, batch_size=64, shuffle=True,
    num_workers=8), budget="4G")`. The new loader yields exactly the same batches (the sampler's order
    and RNG draws are unchanged); at the start of each epoch the sampler's order is handed to an ordered
    prefetch (see `Cache.prefetch_order`) that keeps at most `budget` bytes fetched but not yet read by
    the workers. With a DistributedSampler each rank prefetches its own shard. Works with any
    `num_workers`, fork or spawn, persistent workers or not.

    Args:
        loader: A DataLoader over a map-style dataset whose samples are files under the cache's source.
        budget: Bytes fetched ahead of the readers at most: a size like "4G" or a number of bytes.
        paths: The file of each dataset index: a sequence or a function. Default: the dataset's `paths`
            (CachedDataset has them).
        cache: The cache the dataset reads through. Default: the dataset's `cache`, else the default cache.
        jobs: Files fetched at once, 1 to 1024 (default 32).

    Returns:
        A new DataLoader with the same settings.

    Raises:
        ValueError: `budget` is not a size or `jobs` is out of range.
        TypeError: An iterable-style dataset, or no way to tell each index's file.
        OutsideSourceError: A file is not under the cache's source (raised by the first epoch).
    """
    import inspect
    import weakref

    from tierstore.cache import check_jobs
    from tierstore.order import parse_budget

    n = parse_budget(budget)
    check_jobs(jobs)
    dataset = loader.dataset
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise TypeError(
            "prefetching needs a map-style dataset (its sampler gives the order); for an IterableDataset "
            "pass the order to cache.prefetch_order(paths, budget=...) yourself"
        )
    path_of = _paths_of(dataset, paths)
    if cache is None:
        cache = getattr(dataset, "cache", None) or default_cache()
    try:
        size = len(dataset)  # type: ignore[arg-type]
    except TypeError as e:
        raise TypeError(
            f"prefetching needs a dataset with a length; {type(dataset).__name__} has none"
        ) from e
    marks_path = cache._core.create_read_marks(size + 1)
    marked = _MarkReads(dataset, marks_path)
    prefetched_explicitly(marked)
    custom_batches = loader.batch_size is None and loader.batch_sampler is not None
    wrapped = OrderedSampler(
        loader.batch_sampler if custom_batches else loader.sampler, path_of, cache, n, marks_path, jobs
    )
    weakref.finalize(wrapped, _unlink, marks_path)
    kept = {
        name: getattr(loader, name)
        for name in inspect.signature(torch.utils.data.DataLoader.__init__).parameters
        if name not in ("self", "dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")
        and hasattr(loader, name)
    }
    if custom_batches:
        out = torch.utils.data.DataLoader(marked, batch_sampler=wrapped, **kept)
    else:
        out = torch.utils.data.DataLoader(
            marked, batch_size=loader.batch_size, sampler=wrapped, drop_last=loader.drop_last, **kept
        )
    out.ordered_sampler = wrapped  # type: ignore[attr-defined]
    return out
