"""Sampler-aware prefetch for a DataLoader nobody changed.

`tierstore.torch.prefetching(loader)` gives each epoch's order to an ordered prefetch, but only to a job
whose script wraps its loader. This module does the same for every PyTorch `DataLoader` of a process
that imported tierstore, and of every Python process under `tierstore run` (its `sitecustomize` installs
the hook when torch's DataLoader is imported), with no line of the job changed:

- **The order.** As an epoch's first index is drawn, the loader's sampler is iterated once, whole, at the
  moment the loader would have drawn its first index, and its indices are handed out one by one as
  before: the same samples in the same order, the same random draws. Only samplers known to draw
  nothing lazily from the global generator are drawn ahead (torch's Sequential, Random, SubsetRandom,
  WeightedRandom and Distributed samplers, alone or in a BatchSampler); any other leaves the loader as
  it was.
- **The files.** Each index is mapped to its file by what the dataset says of its samples: a list of
  `len(dataset)` paths (or of tuples whose first element is a path) under the cache's source, such as
  torchvision's `DatasetFolder.samples`, `CachedDataset.paths` or a custom dataset's list of `.npy`
  files; `Subset` is followed. A dataset that says nothing has them learned from what each sample
  opened in the loader's first epoch (`tierstore.learned_order`), under `tierstore run` or through the
  dataset's own Cache, and its later epochs are prefetched. An iterable dataset is read ahead by shard
  instead (`tierstore.shard_order`).
- **The reads.** Each loader gets a read-marks file (slot 0: the epoch's tag; slot i + 1: the tag of the
  epoch in which index i was last fetched), named to the workers by an attribute set on the dataset
  before they start; the index fetcher marks each index it has fetched, in every worker, so every read
  frees its file's bytes from the budget.
- **The budget.** `$TIERSTORE_SAMPLER_PREFETCH`: `auto` (the default: a quarter of the tiers' free room
  as the epoch starts, and at least a sixteenth of their room, so a dataset larger than the tiers is
  still prefetched every epoch), a size (`4G`), or `off`.

Nothing here may change what the job computes or stop it: any failure to map or to prefetch is one line
at `-v` (`TIERSTORE_LOG=info`) and a loader that runs as it would have.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from tierstore import prefetch_report
from tierstore._after_import import AfterImport, wait_for_import
from tierstore._log import info as _say
from tierstore.learned_order import LOG_ATTRIBUTE

if TYPE_CHECKING:
    from tierstore import _core
    from tierstore.cache import Cache
    from tierstore.learned_order import LearnedOrder
    from tierstore.shard_order import ShardReadAhead
    from tierstore.types import OrderProgress

# The setting: auto, off, or a budget.
VARIABLE = "TIERSTORE_SAMPLER_PREFETCH"
OFF = ("off", "0", "false", "no")
# An automatic budget: a quarter of the tiers' free room, and never less than a sixteenth of their room.
FREE_SHARE = 4
FULL_SHARE = 16
# The attribute on a dataset that names its read-marks file to the loader's workers.
MARKS_ATTRIBUTE = "_tierstore_read_marks"

# The module whose loader classes the hook patches.
DATALOADER = "torch.utils.data.dataloader"


def budget_setting() -> int | None:
    """The budget `$TIERSTORE_SAMPLER_PREFETCH` asks for: 0 when off, None for auto, else bytes.

    A value that is none of these turns the prefetch off and says so: the job runs as before."""
    value = os.environ.get(VARIABLE, "auto").strip()
    if value.lower() in ("", "auto", "on", "1", "true", "yes"):
        return None
    if value.lower() in OFF:
        return 0
    from tierstore import _core

    n = _core.parse_size(value)
    if n is None or n <= 0:
        _say(f"${VARIABLE}={value!r} is not auto, off or a size such as 4G; sampler-aware prefetch is off")
        return 0
    return int(n)


# Which samplers are drawn ahead ---------------------------------------------------------------------


def _drawn_whole_at_start(sampler: Any) -> bool:
    """Whether iterating `sampler` makes all its random draws at its first index (or none), so drawing it
    whole at that moment changes nothing the job sees."""
    import torch.utils.data as tud

    known: list[Any] = [
        tud.SequentialSampler,
        tud.RandomSampler,
        tud.SubsetRandomSampler,
        tud.WeightedRandomSampler,
    ]
    with contextlib.suppress(ImportError):
        from torch.utils.data.distributed import DistributedSampler

        known.append(DistributedSampler)
    if type(sampler).__iter__ is tud.BatchSampler.__iter__:
        return _drawn_whole_at_start(sampler.sampler)
    return any(type(sampler).__iter__ is k.__iter__ for k in known)


def flat(order: list[Any]) -> list[int]:
    """The indices of an epoch, from a sampler's indices or a batch sampler's batches."""
    out: list[int] = []
    for item in order:
        if isinstance(item, (list, tuple)) or (hasattr(item, "dim") and item.dim() > 0):
            out.extend(map(int, item))
        else:
            out.append(int(item))
    return out


# Which file each index reads ------------------------------------------------------------------------

# Attributes that hold a dataset's samples, looked at first, in this order; then any other of the right
# length.
SAMPLE_ATTRIBUTES = ("samples", "imgs", "paths", "files", "image_paths", "file_paths", "filenames")


def _as_path(item: Any) -> str | None:
    if isinstance(item, tuple) and item:
        item = item[0]
    if isinstance(item, (str, os.PathLike)):
        return os.fsdecode(item)
    return None


def find_paths(dataset: Any, under: Callable[[str], bool]) -> tuple[Callable[[int], str], str] | None:
    """The file of each index of `dataset` and where that was found (`"samples"`, `"Subset of samples"`),
    or None when the dataset does not say. `under(path)` tells whether a path is in the cache's source."""
    import torch.utils.data as tud

    if isinstance(dataset, tud.Subset):
        inner = find_paths(dataset.dataset, under)
        if inner is None:
            return None
        path_of, found = inner
        return _SubsetPaths(path_of, dataset.indices), f"Subset of {found}"
    try:
        n = len(dataset)
        attributes = vars(dataset)
    except TypeError:
        return None
    if n == 0:
        return None
    names = [a for a in SAMPLE_ATTRIBUTES if a in attributes] + sorted(
        a for a in attributes if a not in SAMPLE_ATTRIBUTES
    )
    for name in names:
        value = attributes[name]
        if not isinstance(value, (list, tuple)) or len(value) != n:
            continue
        ends = [_as_path(value[0]), _as_path(value[-1])]
        if all(p is not None and under(p) for p in ends):
            return _SamplePaths(value), f"dataset.{name}"
    inner = getattr(dataset, "dataset", None)  # a wrapper that reads another dataset (tierstore's Routed)
    if inner is not None and inner is not dataset and _length(inner) == n:
        return find_paths(inner, under)
    return None


class _SamplePaths:
    """The file of each sample of a dataset's list of paths, or of tuples whose first item is one."""

    def __init__(self, samples: list[Any] | tuple[Any, ...]) -> None:
        self.samples = samples
        self.in_tuples = isinstance(samples[0], tuple)

    def __call__(self, i: int) -> str:
        p = self.samples[i][0] if self.in_tuples else self.samples[i]
        return p if type(p) is str else os.fsdecode(p)

    def each(self, indices: list[int]) -> list[Any]:
        """The files of `indices` as the dataset holds them (`str`, `bytes` or `os.PathLike`, which
        `order_files` takes as they are): every index's, once, without a call per sample."""
        s = self.samples
        return [s[i][0] for i in indices] if self.in_tuples else [s[i] for i in indices]


class _SubsetPaths:
    """The file of each sample of a `Subset`, from those of the dataset it selects from."""

    def __init__(self, paths: Callable[[int], str], indices: Sequence[Any]) -> None:
        self.paths = paths
        self.indices = indices

    def __call__(self, i: int) -> str:
        return self.paths(int(self.indices[i]))

    def each(self, indices: list[int]) -> list[Any]:
        inner = [int(self.indices[i]) for i in indices]
        each = getattr(self.paths, "each", None)
        return each(inner) if each is not None else list(map(self.paths, inner))


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None


def _within(source: str) -> Callable[[str], bool]:
    """Whether a path is under `source` (a directory, either spelling of it, or an object store prefix)."""
    if "://" in source:
        prefix = source.rstrip("/") + "/"
        return lambda p: p.startswith(prefix)
    prefixes = tuple({source.rstrip("/") + "/", os.path.realpath(source).rstrip("/") + "/"})
    return lambda p: os.path.abspath(p).startswith(prefixes)


def budget_of(cache: Cache, fixed: int | None = None) -> int:
    """`fixed`, else `$TIERSTORE_SAMPLER_PREFETCH`'s budget: a size, or auto (from the tiers' room now)."""
    fixed = fixed or budget_setting()
    if fixed:
        return fixed
    tiers = cache.stats()["tiers"]
    quota = sum(t.get("quota") or 0 for t in tiers)
    free = sum(max(0, (t.get("quota") or 0) - t.get("bytes_used", 0)) for t in tiers)
    # Full tiers (a dataset larger than they are) still get a share of their room: eviction makes it.
    return max(free // FREE_SHARE, quota // FULL_SHARE, 1)


# One loader's prefetch ------------------------------------------------------------------------------


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class LoaderPrefetch:
    """The ordered prefetch of one DataLoader, started again as each
    epoch draws its order (here, and in `tierstore.torch.OrderedSampler`).

    Args:
        cache: The cache the samples are read through.
        files_of: The files of each dataset index (none where they are not known); or None, and
            `path_of` gives each index's one file.
        found: Where the files came from, for the log ("dataset.samples").
        name: The loader, for the log.
        budget: Bytes fetched ahead of the reads at most; None: `$TIERSTORE_SAMPLER_PREFETCH`'s.
        jobs: Files fetched at once; None: the default.
        marks: The read-marks file (slot 0: the epoch's tag; slot i + 1: index i's), or the dataset's
            length, to make one that lives as long as this prefetch.
        learned: The order `files_of` reads, brought up to date as each epoch starts; None if it is fixed.
        path_of: The one file of each dataset index, when `files_of` is None.
    """

    def __init__(
        self,
        cache: Cache,
        files_of: Callable[[int], Sequence[str]] | None,
        found: str,
        name: str,
        budget: int | None,
        jobs: int | None,
        marks: str | int,
        learned: LearnedOrder | None = None,
        path_of: Callable[[int], str] | None = None,
    ) -> None:
        from tierstore.order import ReadMarker

        if (files_of is None) == (path_of is None):
            raise TypeError("LoaderPrefetch: give either files_of or path_of")
        self.cache = cache
        self.files_of = files_of
        self.path_of = path_of
        self.learned = learned
        self.found = found
        self.name = name
        self.fixed_budget = budget
        self.jobs = jobs
        if isinstance(marks, int):
            self.marks_path: str = cache._core.create_read_marks(marks + 1)
            weakref.finalize(self, _unlink, self.marks_path)
        else:
            self.marks_path = marks
        self.marker = ReadMarker(self.marks_path)
        weakref.finalize(self, prefetch_report.remove, self.marks_path)
        self.epoch = 0
        self.tag = 0
        self.prefetch: _core.OrderPrefetch | None = None
        self.files: _core.OrderFiles | None = None

    def budget(self) -> int:
        """The fixed budget, or `$TIERSTORE_SAMPLER_PREFETCH`'s: a size, or auto."""
        return budget_of(self.cache, self.fixed_budget)

    def start(self, indices: list[int]) -> None:
        """Stops the last epoch's prefetch and starts this one's, in the order of `indices`."""
        last = None
        if self.prefetch is not None:
            self.prefetch.stop()
            p = self.prefetch.progress()
            last = {
                k: p[k]
                for k in (
                    "files_total",
                    "files_fetched",
                    "files_cached",
                    "files_read_first",
                    "files_no_room",
                    "files_failed",
                )
            }
            _say(
                f"{self.name}, epoch {self.epoch}: prefetched {p['files_fetched']} of {p['files_total']} files "
                f"({p['files_cached']} already cached, {p['files_read_first']} read first, "
                f"{p['files_no_room']} left to the readers for want of room, {p['files_failed']} failed)"
                + (f"; the first failure: {p['errors'][0]}" if p["errors"] else "")
            )
        self.epoch += 1
        # A new tag per epoch: slots of the last epoch no longer count as read. Never 0, which is "unread",
        # and below `STARTED`, the bit a sample begun sets beside it.
        from tierstore.order import STARTED

        self.tag = self.tag % (STARTED - 1) + 1
        self.marker.mark(0, self.tag)
        self.prefetch = None
        if self.learned is not None:
            self.learned.update()
        paths: list[str] = []
        slots: list[int] = []
        if self.path_of is not None:
            # One file per sample, the common case: the files of the dataset's indices, made ready once
            # (relative to the source, keyed) for every epoch, which then names them by index.
            files = self._files_up_to(max(indices, default=-1) + 1)
        elif self.files_of is not None:
            for i in indices:
                for path in self.files_of(i):
                    paths.append(path)
                    slots.append(i + 1)
        report = {
            "pid": os.getpid(),
            "loader": self.name,
            "found": self.found,
            "epoch": self.epoch,
            "tag": self.tag,
            "samples": len(indices),
            "files": len(indices) if self.path_of is not None else len(paths),
            "budget": None,
            "last_epoch": last,
        }
        if not report["files"]:
            prefetch_report.write(self.marks_path, report)
            _say(
                f"{self.name}, epoch {self.epoch}: "
                + (
                    "no file of its samples known yet; learning them"
                    if self.epoch == 1
                    else "no prefetch: epoch 1 taught no file of its samples (they are not read through tierstore)"
                )
            )
            return
        budget = self.budget()
        if self.path_of is not None:
            self.prefetch = self.cache._core.prefetch_in_order(
                files, indices, budget, (self.marks_path, self.tag), self.jobs
            )
        else:
            self.prefetch = self.cache._core.prefetch_order(
                paths, budget, self.jobs, (self.marks_path, slots, self.tag)
            )
        prefetch_report.write(self.marks_path, {**report, "budget": budget})
        _say(
            f"{self.name}, epoch {self.epoch}: prefetching {report['files']} files of {len(indices)} samples in the "
            f"sampler's order (files from {self.found}), {budget >> 20} MiB ahead of the reads at most"
        )

    def _files_up_to(self, n: int) -> _core.OrderFiles:
        """The files of the dataset's indices below `n` (at least), made ready once: an epoch that names an
        index past them makes them again. A dataset whose paths change between epochs is not one this
        prefetch follows: it prefetches the paths its files were made from."""
        if self.files is None or len(self.files) < n:
            assert self.path_of is not None
            each = getattr(self.path_of, "each", None)
            every = list(range(n))
            self.files = self.cache._core.order_files(
                each(every) if each is not None else list(map(self.path_of, every))
            )
        return self.files

    def progress(self) -> OrderProgress | None:
        """The current epoch's prefetch progress (see `OrderPrefetch.progress`), None before the first."""
        return None if self.prefetch is None else self.prefetch.progress()

    def stop(self) -> None:
        """Stops the current epoch's prefetch."""
        if self.prefetch is not None:
            self.prefetch.stop()


# The datasets that `tierstore.torch.prefetching` wrapped: their loaders' epochs are prefetched already.
_explicit: weakref.WeakSet[Any] = weakref.WeakSet()


def prefetched_explicitly(dataset: Any) -> None:
    """Leaves the loaders over `dataset` to the explicit prefetch that wrapped it."""
    _explicit.add(dataset)


def _wrapped_explicitly(dataset: Any) -> bool:
    try:
        return dataset in _explicit
    except TypeError:
        return False  # not hashable or not weakly referable: never a dataset tierstore wrapped


# The loaders' prefetches, by loader; None where a loader has none (and why was said once).
_prefetches: weakref.WeakKeyDictionary[Any, LoaderPrefetch | ShardReadAhead | None] = (
    weakref.WeakKeyDictionary()
)


def prefetch_of(loader: Any) -> LoaderPrefetch | ShardReadAhead | None:
    """The prefetch of `loader`, made on its first iterator: the sampler's order of a map-style dataset,
    the shard order of an iterable one; None when it gets none."""
    try:
        return _prefetches[loader]
    except (KeyError, TypeError):
        pass
    made: LoaderPrefetch | ShardReadAhead | None = None
    try:
        made = _make(loader)
    except Exception as e:
        _say(f"{_name(loader)}: no sampler-aware prefetch: {e}")
    with contextlib.suppress(TypeError):
        _prefetches[loader] = made
    return made


def _shim_loaded() -> bool:
    """Whether `tierstore run`'s shim is loaded in this process."""
    import ctypes

    return hasattr(ctypes.CDLL(None), "tierstore_preload_exempt")


def _name(loader: Any) -> str:
    return f"DataLoader over {type(getattr(loader, 'dataset', None)).__name__}"


def _make(loader: Any) -> LoaderPrefetch | ShardReadAhead | None:
    from torch.utils.data.dataloader import _DatasetKind

    name = _name(loader)
    if budget_setting() == 0:
        return None
    dataset = loader.dataset
    if _wrapped_explicitly(dataset):
        return None  # tierstore.torch.prefetching already prefetches this loader's epochs
    if loader.num_workers == 0 and _shim_loaded():
        # The reads would go through the shim's engine in this very process, whose POSIX fetch locks this
        # process's prefetch shares and cannot tell from its own: a file could be fetched twice.
        _say(f"{name}: no sampler-aware prefetch: with no workers under tierstore run; give num_workers >= 1")
        return None
    if loader._dataset_kind != _DatasetKind.Map:
        return _shard_read_ahead(loader, name)
    sampler = loader._index_sampler
    if not _drawn_whole_at_start(sampler):
        _say(
            f"{name}: no sampler-aware prefetch: {type(sampler).__name__} may draw lazily, so it is not drawn ahead"
        )
        return None
    source = _Source(dataset)
    found = find_paths(dataset, source)
    if found is not None and source.cache is not None:
        made = LoaderPrefetch(source.cache, None, found[1], name, None, None, len(dataset), path_of=found[0])
        return made if _name_to_workers(dataset, name, {MARKS_ATTRIBUTE: made.marks_path}) else None
    if not (_shim_loaded() or source.own_cache() is not None):
        # Learned only where tierstore sees the reads: under `tierstore run`, or through the dataset's
        # own Cache.
        where = f" under {source.cache.source}" if source.cache is not None else ""
        _say(f"{name}: no sampler-aware prefetch: the dataset names no file per sample{where}")
        return None
    from tierstore.learned_order import LearnedLog, LearnedOrder

    cache = source.made()
    marks = cache._core.create_read_marks(len(dataset) + 1)
    log = LearnedLog.create(marks + ".learned")
    learned = LearnedOrder(log, _within(cache.source))
    found_where = "the files each sample opened in the first epoch"
    made = LoaderPrefetch(cache, learned.files_of, found_where, name, None, None, marks, learned)
    weakref.finalize(made, _unlink, marks)
    weakref.finalize(made, _unlink, log.path)
    attributes = {MARKS_ATTRIBUTE: marks, LOG_ATTRIBUTE: log.path}
    return made if _name_to_workers(dataset, name, attributes) else None


def _shard_read_ahead(loader: Any, name: str) -> ShardReadAhead | None:
    """An iterable dataset's read-ahead by shard, where tierstore sees its opens."""
    from tierstore import shard_order

    source = _Source(loader.dataset)
    if not (_shim_loaded() or source.own_cache() is not None):
        _say(f"{name}: no shard read-ahead: its opens are not seen (run it under tierstore run)")
        return None
    cache = source.made()
    return shard_order.make(loader, cache, _within(cache.source), name, lambda: budget_of(cache))


def _name_to_workers(dataset: Any, name: str, attributes: dict[str, str]) -> bool:
    """Sets `attributes` on `dataset`, which the loader's workers get a copy of; False (and said) when the
    dataset takes no attribute."""
    try:
        for key, value in attributes.items():
            setattr(dataset, key, value)
    except (AttributeError, TypeError) as e:
        _say(f"{name}: no sampler-aware prefetch: the workers' reads cannot be recorded ({e})")
        return False
    return True


class _Source:
    """Whether a path is under the source of the cache `dataset` reads through. The cache (the dataset's
    own, else the default one) is made on the first path asked about: a loader whose dataset holds no list
    of paths makes none, and starts no agent."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.cache: Any = None
        self._within: Callable[[str], bool] | None = None

    def __call__(self, path: str) -> bool:
        if self._within is None:
            self._within = _within(self.made().source)
        return self._within(path)

    def own_cache(self) -> Any:
        """The dataset's own cache, or that of the dataset it wraps (a Subset of a CachedDataset); None."""
        from tierstore.cache import Cache

        own, depth = self.dataset, 0
        while own is not None and not isinstance(getattr(own, "cache", None), Cache) and depth < 8:
            own, depth = getattr(own, "dataset", None), depth + 1
        found = getattr(own, "cache", None)
        return found if isinstance(found, Cache) else None

    def made(self) -> Any:
        """The dataset's own cache, else the default one: made now if it was not."""
        if self.cache is None:
            from tierstore.cache import default_cache

            self.cache = self.own_cache() or default_cache()
        return self.cache


# The hooks into torch -------------------------------------------------------------------------------


class _Drawn(Iterator[Any]):
    """An epoch's order, drawn whole, handed out as the sampler's iterator would have."""

    def __init__(self, order: list[Any]) -> None:
        self._it = iter(order)

    def __next__(self) -> Any:
        return next(self._it)


def _begin_epoch(loader_iter: Any, it: Any) -> Any:
    """The iterator of the epoch `it` begins: `it` itself, or its order drawn whole and prefetched."""
    prefetch = loader_iter.__dict__.get("_tierstore_prefetch")
    if prefetch is None:
        return it
    if not isinstance(prefetch, LoaderPrefetch):
        prefetch.begin_epoch()  # an iterable dataset's: its sampler draws nothing worth drawing ahead
        return it
    order = list(it)  # every draw of the epoch, at the moment of its first
    try:
        prefetch.start(flat(order))
    except Exception as e:
        _say(f"{prefetch.name}: the epoch's prefetch did not start: {e}")
    return _Drawn(order)


def _named_file(dataset: Any, attribute: str) -> str | None:
    """The file the dataset's `attribute` names to the loader's workers; None (never raising) otherwise."""
    try:
        path = getattr(dataset, attribute, None)
    except Exception:
        return None
    return path if isinstance(path, str) else None


def _marker_of(dataset: Any) -> Any:
    """The ReadMarker of the dataset's read-marks file, if its loader has one."""
    path = _named_file(dataset, MARKS_ATTRIBUTE)
    if path is None:
        return None
    marker = _markers.get(path)
    if marker is None:
        from tierstore.order import ReadMarker

        marker = _markers[path] = ReadMarker(path)
    return marker


def _learning(dataset: Any) -> Any:
    """The dataset's learned-order log while its loader's first epoch runs (tag 1 in its read marks); else
    None."""
    path = _named_file(dataset, LOG_ATTRIBUTE)
    if path is None:
        return None
    marker = _marker_of(dataset)
    if marker is None or marker.get(0) != 1:
        return None
    log = _logs.get(path)
    if log is None:
        from tierstore.learned_order import LearnedLog

        log = _logs[path] = LearnedLog(path)
    return log


def _marking_begun(dataset: Any, index: Any) -> Any:
    """`index` (a batch's list of indices, or one index), marked begun in the dataset's read-marks file as
    the fetch reaches each: from then on the prefetch leaves that sample's files to this worker, which may
    read them from the store itself (when the tiers have no room), rather than read them a second time."""
    marker = _marker_of(dataset)
    if marker is None:
        return index
    if type(index) is list:
        return _Begun(index, marker)
    for _ in marker.begin_each(_items(index)):
        pass
    return index


class _Begun(list):  # type: ignore[type-arg]
    """A batch's indices that marks each begun as the fetch's loop comes to it (`[dataset[i] for i in
    batch]`): the samples after it in the batch are not begun yet, and may still be fetched ahead."""

    def __init__(self, indices: list[Any], marker: Any) -> None:
        super().__init__(indices)
        self.marker = marker

    def __iter__(self) -> Iterator[Any]:
        return self.marker.begin_each(list.__iter__(self))  # type: ignore[no-any-return]


def _mark_fetched(dataset: Any, index: Any) -> None:
    """Records, in the dataset's read-marks file, that the indices of `index` are fetched."""
    marker = _marker_of(dataset)
    if marker is not None:
        marker.read_each(_items(index))


def _items(index: Any) -> Any:
    """The indices of `index`, a batch's list or tuple of indices or one index. A `_Begun` batch is walked
    as the plain list it is, so walking it marks nothing begun a second time."""
    return (
        list.__iter__(index) if isinstance(index, list) else index if isinstance(index, tuple) else (index,)
    )


_markers: dict[str, Any] = {}
_logs: dict[str, Any] = {}


def patch(dataloader: Any) -> None:
    """Hooks `torch.utils.data.dataloader` (the module): once per process."""
    base = dataloader._BaseDataLoaderIter
    if getattr(base, "_tierstore_hooked", False):
        return
    from torch.utils.data._utils import fetch

    init, next_index, fetch_map = base.__init__, base._next_index, fetch._MapDatasetFetcher.fetch
    fetch_iterable = fetch._IterableDatasetFetcher.fetch

    def __init__(self: Any, loader: Any, *args: Any, **kwargs: Any) -> None:
        # Before the workers start: they learn the dataset's read-marks file from the dataset.
        self._tierstore_prefetch = prefetch_of(loader)
        init(self, loader, *args, **kwargs)

    def _next_index(self: Any) -> Any:
        it = self._sampler_iter
        if it is not self.__dict__.get("_tierstore_epoch"):
            it = self._sampler_iter = self._tierstore_epoch = _begin_epoch(self, it)
        return next_index(self)

    def fetch_and_mark(self: Any, possibly_batched_index: Any) -> Any:
        possibly_batched_index = _marking_begun(self.dataset, possibly_batched_index)
        log = _learning(self.dataset)
        if log is None:
            data = fetch_map(self, possibly_batched_index)
        else:
            from tierstore.learned_order import fetch_learning

            data = fetch_learning(self, possibly_batched_index, fetch_map, log)
        _mark_fetched(self.dataset, possibly_batched_index)
        return data

    def fetch_and_record(self: Any, possibly_batched_index: Any) -> Any:
        from tierstore.shard_order import fetch_recording

        return fetch_recording(self, possibly_batched_index, fetch_iterable)

    base.__init__ = __init__  # type: ignore[method-assign]
    base._next_index = _next_index
    fetch._MapDatasetFetcher.fetch = fetch_and_mark  # type: ignore[method-assign]
    fetch._IterableDatasetFetcher.fetch = fetch_and_record  # type: ignore[method-assign]
    base._tierstore_hooked = True


def install() -> None:
    """Hooks torch's DataLoader now if it is imported, else as soon as it is; nothing when turned off."""
    if os.environ.get(VARIABLE, "").strip().lower() in OFF:
        return
    module = sys.modules.get(DATALOADER)
    if module is not None and hasattr(module, "_BaseDataLoaderIter"):
        patch(module)
        return
    wait_for_import(DATALOADER, _hook)


def after_import() -> AfterImport:
    """A meta path finder that lets torch's DataLoader module load as usual, then hooks it (the
    `sitecustomize` of `tierstore run` asks it for the module's spec)."""
    return AfterImport(DATALOADER, _hook)


def _hook(module: Any) -> None:
    try:
        patch(module)
    except Exception as e:
        _say(f"sampler-aware prefetch is off: torch's DataLoader could not be hooked ({e})")
