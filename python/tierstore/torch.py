"""PyTorch integration: a map-style Dataset that reads its files through the cache, and a wrapper that
routes an existing Dataset's file reads through it.

Both work with any `num_workers` under fork, spawn and forkserver: the cache pickles as its configuration
and every worker process opens the same node-wide cache, so each file is still fetched once per node.
"""

from __future__ import annotations

import builtins
import fnmatch
import glob
import io
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch.utils.data

from tierstore.cache import Cache, PathLike, default_cache


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
