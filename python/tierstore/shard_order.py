"""Read-ahead by shard for an iterable dataset nobody changed.

An `IterableDataset` (webdataset tars, TFRecord files, a reader of shard files of its own) has no sampler,
so its DataLoader cannot say the epoch's order ahead. But such a dataset reads whole shards one after
another, in the order of its shard list split between the workers (webdataset's `split_by_worker` gives
worker w of W the shards w, w + W, w + 2W, ...), or in the order it read them last epoch. So as each
worker opens a shard, the loader's process fetches the shards that worker will open next:

- **What the workers open.** Each worker draws each sample inside a record of the files its thread opens
  through tierstore (the shim's under `tierstore run`, `Cache.open`'s through the Python API) and appends
  `[worker, [path, ...]]` to the loader's log (`tierstore.learned_order.LearnedLog`) as soon as the
  sample is drawn; the loader's process appends `[-1, []]` as each epoch begins, before any worker is
  given the epoch's first batch.
- **The shard list.** A list of two or more paths under the cache's source held by the dataset
  (webdataset's `SimpleShardList.urls`, a custom dataset's `self.files`), looked for a few attributes
  deep; else the files of the first shard's directory that end as it does, in name order.
- **The next shards.** For a worker whose last two shards sit at positions a and b of the list, those at
  b + (b - a), b + 2(b - a), ...; after its first shard, the step `split_by_worker` takes (the workers times
  the ranks). A worker whose steps disagree (a shuffled shard list) gets nothing read ahead. A worker that
  has so far opened, in order, the first shards it opened last epoch is taken to go on as it did then,
  so a fixed order that no list describes is read ahead from the second epoch on.
- **A head start.** As an epoch begins, the `GUESSED` shards each worker opens after its first (in its
  last epoch's order, else its split's) are fetched before it opens any: a worker consumes its first
  shard in about the time the next takes to fetch, so a fetch that waits for the first open is late.
  The first is the worker's own to fetch, as it opens it at once.
- **The budget.** `$TIERSTORE_SAMPLER_PREFETCH`, as for map-style datasets (`auto`: a quarter of the
  tiers' free room, at least a sixteenth of their room): at most `AHEAD` shards per worker (`GUESSED`
  while its step is a guess), and the bytes fetched ahead and not yet opened within the budget. When the
  tiers are full (a data set larger than they are), the shards the workers have moved on from this epoch
  are let go of, earliest first, to make room for the next; a shard there is still no room for is left
  to its reader. Room for a shard (the mean size of those fetched so far) is held in the tiers before it
  is opened, so a worker's own fetch that takes the room meanwhile leaves the shard unopened, never
  opened twice. Before any has landed, the room held is the first shard's size (one `stat`); on an
  object store, where that would be a request of its own, one shard is fetched at a time until then.
  A shard a worker reads from the store itself, finding no room, is marked so while the worker has it
  open, and no fetch ahead reads it again meanwhile (room let go of after the worker's fetch would
  otherwise send one).

A prediction never changes what the job reads: a wrong one is a shard fetched early (it is read later in
the epoch, or not at all), never a byte served wrong. Any failure is one line at `-v` and a loader that
runs as it would have.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tierstore import prefetch_report
from tierstore._log import info as _say

if TYPE_CHECKING:
    from tierstore import _core
    from tierstore.cache import Cache
    from tierstore.learned_order import LearnedLog
    from tierstore.types import PrefetchProgress

# The attribute on a dataset that names its loader's log of opened shards to the workers.
LOG_ATTRIBUTE = "_tierstore_shard_log"
# Shards fetched ahead of each worker at most: once its order is known (two steps of the list that agree,
# or the last epoch's order repeated), and while it is only guessed (after its first shard). A shard is
# large and read whole, so a few fetches in flight per worker hide a store's latency: with 8, a shard
# that takes 8 times as long to fetch as to consume still arrives in time.
AHEAD = 8
GUESSED = 2
# How often the loader's process reads what the workers added to the log, seconds.
POLL = 0.01
# How deep into the dataset's attributes the shard list is looked for, and how many objects at most.
DEPTH = 3
VISITS = 256


# The shard list ------------------------------------------------------------------------------------


def find_shards(dataset: Any, under: Callable[[str], bool]) -> tuple[list[str], str] | None:
    """A list of two or more paths under the source that `dataset` holds, and where it was found
    (`"dataset.pipeline[0].urls"`); None when it holds none. Attributes are searched breadth first,
    `DEPTH` deep, through objects and lists of objects (webdataset's pipeline of stages)."""
    level: list[tuple[Any, str]] = [(dataset, "dataset")]
    seen: set[int] = set()
    for _ in range(DEPTH + 1):
        deeper: list[tuple[Any, str]] = []
        for obj, where in level:
            if id(obj) in seen or len(seen) >= VISITS:
                continue
            seen.add(id(obj))
            for name, value in _attributes(obj):
                found = _paths(value, under)
                if found is not None:
                    return found, f"{where}.{name}"
                if isinstance(value, (list, tuple)):
                    deeper.extend((v, f"{where}.{name}[{i}]") for i, v in enumerate(value[:64]) if _object(v))
                elif _object(value):
                    deeper.append((value, f"{where}.{name}"))
        level = deeper
    return None


def _attributes(obj: Any) -> list[tuple[str, Any]]:
    try:
        return sorted(vars(obj).items())
    except TypeError:
        return []


def _object(value: Any) -> bool:
    """Whether `value` is an instance worth looking into: not a plain value, class, module or function."""
    import types

    plain = (str, bytes, int, float, bool, type(None), dict, set, frozenset, type, types.ModuleType)
    return not isinstance(value, plain) and not callable(value) and hasattr(value, "__dict__")


def _paths(value: Any, under: Callable[[str], bool]) -> list[str] | None:
    """`value` as a list of paths if it is a list of two or more paths under the source."""
    if not isinstance(value, (list, tuple)) or len(value) < 2:
        return None
    if not all(isinstance(v, (str, os.PathLike)) for v in value):
        return None
    paths = [os.fsdecode(v) for v in value]
    return paths if under(paths[0]) and under(paths[-1]) else None


def directory_shards(path: str) -> list[str] | None:
    """The files of `path`'s directory that end as it does (`.tar`, `.tfrecord`), in name order; None if
    the directory cannot be listed or holds no other."""
    directory, name = os.path.split(path)
    ending = name[name.find(".") :] if "." in name else ""
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(ending) and not n.startswith("."))
    except OSError:
        return None
    return [os.path.join(directory, n) for n in names] if len(names) >= 2 else None


# What each worker opens next -----------------------------------------------------------------------


def next_shards(
    opened: Sequence[str],
    shards: Sequence[str] | None,
    position: dict[str, int],
    last_epoch: Sequence[str] | None,
    step: int,
    ahead: int = AHEAD,
) -> list[str]:
    """The shards a worker that opened `opened` this epoch (in order) will open next: at most `ahead`, or
    `GUESSED` when the step is only guessed.

    Args:
        opened: The worker's shards so far this epoch, in the order it opened them (not empty).
        shards: The shard list, if one is known; `position` maps each of its paths to its place.
        last_epoch: The worker's shards of the last epoch, in order.
        step: The step after a worker's first shard: how many readers split the list.
    """
    n = len(opened)
    if last_epoch and n < len(last_epoch) and list(last_epoch[:n]) == list(opened):
        return list(last_epoch[n : n + ahead])
    if not shards:
        return []
    here = position.get(opened[-1])
    if here is None:
        return []
    if n == 1:
        stride, ahead = step, min(ahead, GUESSED)
    else:
        before = position.get(opened[-2])
        if before is None or before == here:
            return []
        stride = here - before
        if n >= 3 and (position.get(opened[-3]) is None or before - position[opened[-3]] != stride):
            return []  # steps that disagree: a shuffled list, nothing to read ahead
    places = (here + k * stride for k in range(1, ahead + 1))
    return [shards[p] for p in places if 0 <= p < len(shards)]


@dataclasses.dataclass(frozen=True)
class Split:
    """How the shard list is split between the job's readers, as webdataset's `split_by_node` then
    `split_by_worker` split it: worker w of rank r reads the shards at r + ranks * w, stepping by
    `step`."""

    workers: int
    rank: int = 0
    ranks: int = 1

    @classmethod
    def of(cls, num_workers: int) -> Split:
        """This process's split: its loader's workers, and its rank among the job's ranks."""
        rank, ranks = 0, 1
        with contextlib.suppress(Exception):
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                rank, ranks = dist.get_rank(), dist.get_world_size()
        return cls(max(1, num_workers), rank, ranks)

    @property
    def step(self) -> int:
        return self.workers * self.ranks

    def first(self, worker: int) -> int:
        """Where `worker`'s first shard sits in the list."""
        return self.rank + self.ranks * worker


# One loader's read-ahead, in the loader's process ---------------------------------------------------


class ShardReadAhead:
    """Reads one iterable loader's log as its workers write it, and fetches each worker's next shards.

    Args:
        cache: The cache the shards are read through.
        log: The loader's log of opened shards.
        within: Whether a path is under the cache's source.
        shards: The shard list and where it was found, if the dataset holds one.
        name: The loader, for the log and `tierstore status`.
        split: How the list is split between the readers: each worker's first shard, and the step
            after it.
        report: The read-marks file whose name `tierstore status` finds this loader's report by.
        budget: The budget as an epoch starts (`tierstore.auto_order.budget_of`).
    """

    def __init__(
        self,
        cache: Cache,
        log: LearnedLog,
        within: Callable[[str], bool],
        shards: tuple[list[str], str] | None,
        name: str,
        split: Split,
        report: str,
        budget: Callable[[], int],
    ) -> None:
        self.cache = cache
        self.budget_now = budget
        self.log = log
        self.within = within
        self.shards: list[str] | None = shards[0] if shards is not None else None
        self.found = shards[1] if shards is not None else ""
        self.position = {p: i for i, p in enumerate(self.shards or ())}
        self.name = name
        self.split = split
        self.report_path = report
        self.epoch = 0
        self.budget = 0
        self.now: dict[int, list[str]] = {}  # this epoch's shards, per worker
        self.last: dict[int, list[str]] = {}  # the last epoch's
        self.opened: set[str] = set()  # this epoch's, every worker's
        # Fetched ahead, not yet opened. Each is named as the file it is (`prefetch_files`): starting one
        # asks the store nothing, and on an object store the fetch is the shard's `GET` alone, no `LIST`.
        self.ahead: dict[str, _core.Prefetch] = {}
        self.sizes: dict[str, int] = {}  # of the shards fetched ahead, for the budget
        # Fetched ahead and opened by their worker before the read-ahead took in the fetch's end: its size
        # and outcome still count.
        self.opened_early: dict[str, _core.Prefetch] = {}
        # Until a shard fetched ahead lands, the size of the first one (`_size_of`), asked once (None until
        # then); 0 where it cannot be asked without a request of its own.
        self.guessed: int | None = None
        # Shards the head start waits to fetch until one has landed, when no size is known: there is no
        # room to hold for them, and the workers' own first fetches take room too.
        self.deferred: list[str] = []
        self.counts = {
            "opened": 0,
            "fetched_ahead": 0,
            "opened_ahead": 0,
            "no_room": 0,
            "let_go": 0,
            "failed": 0,
        }
        # Shards a worker opened this epoch and then moved on from, earliest first: the copies a full tier
        # may let go of for the next (`_tier_room`).
        self.passed: collections.deque[str] = collections.deque()
        self.last_counts: dict[str, int] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def begin_epoch(self) -> None:
        """Marks the epoch's start in the log; starts reading the log on the first epoch."""
        self.log.mark_epoch()
        self.budget = self.budget_now()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tierstore-shard-read-ahead", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(POLL):
            try:
                self.update()
            except Exception as e:  # a read-ahead that fails leaves the loader as it was
                _say(f"{self.name}: shard read-ahead stopped: {e}")
                return

    def update(self) -> None:
        """Takes in what the workers added to the log, and fetches what they will open next.

        Every open the log holds is taken in before any fetch is chosen: a log read after a pause (a busy
        machine) may hold a worker's open of the very shard its previous open would have it fetch ahead,
        and a shard a worker already reads from the store (the tiers full) must not be fetched again."""
        with self._lock:
            began, moved = False, dict[int, None]()  # the workers that moved on, in order
            for worker, files in self.log.added():
                if worker < 0:
                    self._new_epoch()
                    began, moved = True, {}
                    continue
                for path in dict.fromkeys(files):
                    if self.within(path) and self._opened(worker, path):
                        moved[worker] = None
            if began:
                self._fetch_ahead(self._head_start())
            elif self.deferred:
                deferred, self.deferred = self.deferred, []
                self._fetch_ahead(deferred)
            for worker in moved:
                mine = self.now[worker]
                self._fetch_ahead(
                    next_shards(mine, self.shards, self.position, self.last.get(worker), self.split.step)
                )
            if began or moved:
                self._report()

    def _new_epoch(self) -> None:
        if self.epoch:
            self._say_epoch()
        self.last_counts, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        self.last.update(self.now)
        self.now, self.opened, self.passed, self.deferred = {}, set(), collections.deque(), []
        self.ahead = {p: f for p, f in self.ahead.items() if _landed(f) is None}
        self.epoch += 1

    def _head_start(self) -> list[str]:
        """The shards each worker will open next after its first this epoch, fetched before it opens any:
        those after the first it opened last epoch, else those its split gives it, `GUESSED` each.

        A worker consumes its first shard in about the time the next takes to fetch, so a fetch that
        waits for the first open is late for the second. The first itself is left to the worker, which
        opens it at once: fetched here, the worker would wait on the fetch lock for the whole shard,
        where its own fetch lets it read a large one as it lands."""
        seconds: list[str] = []
        for worker in range(self.split.workers):
            last = self.last.get(worker)
            if last:
                seconds += last[1 : 1 + GUESSED]
            elif self.shards:
                step = self.split.step
                at = self.split.first(worker) + step
                seconds += self.shards[at : at + GUESSED * step : step]
        return seconds

    def _fetch_ahead(self, shards: list[str]) -> None:
        """Fetches each of `shards` not opened or fetched ahead yet this epoch, while the budget has room."""
        for at, shard in enumerate(shards):
            if shard in self.opened or shard in self.ahead:
                continue
            if self.cache._core.lookup(shard, False) is not None:
                continue  # cached already (from the index alone): a warm epoch starts no fetch
            if self.guessed is None:
                self.guessed = _size_of(shard)
            if not self._room() or not self._tier_room():
                self.counts["no_room"] += 1
                return
            if not self._mean() and self.ahead:  # no size to hold room for: one at a time
                self.deferred = shards[at:]
                return
            try:
                self.ahead[shard] = self.cache._core.prefetch_files([shard], 1, self._mean() or None)
            except Exception as e:  # outside the source, or no thread to fetch with: left to its reader
                self.counts["failed"] += 1
                _say(f"{self.name}: {shard}: not read ahead: {e}")
                continue
            self.counts["fetched_ahead"] += 1

    def _opened(self, worker: int, path: str) -> bool:
        """Takes in `worker`'s open of `path`; whether it is a shard the worker had not just opened."""
        mine = self.now.setdefault(worker, [])
        if mine and mine[-1] == path:
            return False
        if mine:
            self.passed.append(mine[-1])  # the worker has moved on from it
        mine.append(path)
        self.opened.add(path)
        self.counts["opened"] += 1
        started = self.ahead.pop(path, None)
        if started is not None:
            self.counts["opened_ahead"] += 1
            self.opened_early[path] = started
        if not self.found:  # no list held by the dataset: the first shard's directory, listed once
            listed = directory_shards(path)
            self.found = "the order the workers open them"
            if listed is not None:
                self.shards, self.found = listed, "the files of the first shard's directory, in name order"
                self.position = {p: i for i, p in enumerate(listed)}
        return True

    def _tier_room(self) -> bool:
        """Whether the tiers have room for one more shard (at the mean size so far). When they are full,
        lets go of shards the workers have moved on from this epoch, earliest first, until they have: a
        placement that keeps what it placed (the default) would otherwise fill up in the first epoch and
        leave every later one to the store, where a data set larger than the tiers needs reading ahead
        most. The same exception to keeping what was placed as the ordered prefetch's (MONARCH's); a
        worker that holds a shard open keeps reading it."""
        core = self.cache._core
        landing = sum(1 for started in self.ahead.values() if not started.done)  # their room is taken
        need = self._mean() * (1 + landing)
        while not core.has_room(need):
            if not self.passed:
                return False
            passed = self.passed.popleft()
            if core.let_go(passed):
                self.counts["let_go"] += 1
        return True

    def _mean(self) -> int:
        """The mean size of the shards fetched ahead so far (0 before the first lands). A fetch that found
        its shard fetched by a worker already records 0 bytes: not a size."""
        sizes = [size for size in self.sizes.values() if size]
        return sum(sizes) // len(sizes) if sizes else self.guessed or 0

    def _room(self) -> bool:
        """Whether one more shard fits the budget, counting each shard ahead at the mean size so far."""
        for path, started in list(self.opened_early.items()):
            landed = _landed(started)
            if landed is not None:
                del self.opened_early[path]
                self._took_in(path, landed)
        for path, started in list(self.ahead.items()):
            landed = None if path in self.sizes else _landed(started)
            if landed is not None and not self._took_in(path, landed):
                del self.ahead[path]
        if not self.ahead:
            return True
        return (len(self.ahead) + 1) * self._mean() <= self.budget

    def _took_in(self, path: str, landed: PrefetchProgress) -> bool:
        """Counts a fetch ahead that has ended: its size, for the mean; whether it placed the shard."""
        if landed["files_failed"] or landed["files_no_room"]:
            self.counts["no_room" if landed["files_no_room"] else "failed"] += 1
            return False
        self.sizes[path] = landed["bytes_total"]
        return True

    def _say_epoch(self) -> None:
        c = self.counts
        _say(
            f"{self.name}, epoch {self.epoch}: {c['opened']} shards opened, {c['opened_ahead']} of them read "
            f"ahead; {c['fetched_ahead']} fetched ahead, {c['no_room']} times no room, {c['let_go']} passed "
            f"shards let go of for room, {c['failed']} failed"
        )

    def _report(self) -> None:
        last = self.last_counts
        prefetch_report.write(
            self.report_path,
            {
                "pid": os.getpid(),
                "loader": self.name,
                "found": f"shard order ({self.found or 'the order the workers open them'})",
                "epoch": self.epoch,
                "shards_opened": self.counts["opened"],
                "files": self.counts["fetched_ahead"],
                "budget": self.budget,
                "last_epoch": None
                if last is None or self.epoch <= 1
                else {
                    "files_total": last["opened"],
                    "files_fetched": last["fetched_ahead"],
                    "files_read_first": last["opened"] - last["opened_ahead"],
                    "files_no_room": last["no_room"],
                    "files_failed": last["failed"],
                },
            },
        )


def _size_of(shard: str) -> int:
    """The size of a shard on a file system (one `stat`, once per loader: the room to hold for the first
    shards fetched ahead, before any has landed); 0 for an object store's URL."""
    if "://" in shard:
        return 0
    try:
        return os.stat(shard).st_size
    except OSError:
        return 0


def _landed(started: _core.Prefetch) -> PrefetchProgress | None:
    """The progress of a fetch ahead that has ended; None while it runs."""
    return started.progress() if started.done else None


def make(
    loader: Any, cache: Cache, within: Callable[[str], bool], name: str, budget: Callable[[], int]
) -> ShardReadAhead | None:
    """The shard read-ahead of an iterable `loader` (its dataset is told the log's name); None, and said,
    when the dataset takes no attribute."""
    from tierstore.learned_order import LearnedLog

    dataset = loader.dataset
    shards = find_shards(dataset, within)
    marks = cache._core.create_read_marks(1)  # a private name in the order directory, for the report
    log = LearnedLog.create(marks + ".shards")
    made = ShardReadAhead(cache, log, within, shards, name, Split.of(loader.num_workers), marks, budget)
    for path in (marks, log.path):
        weakref.finalize(made, _unlink, path)
    weakref.finalize(made, prefetch_report.remove, marks)
    weakref.finalize(loader, made.stop)
    try:
        setattr(dataset, LOG_ATTRIBUTE, log.path)
    except (AttributeError, TypeError) as e:
        _say(f"{name}: no shard read-ahead: the workers' opens cannot be recorded ({e})")
        return None
    _say(
        f"{name}: reading ahead by shard, "
        + (
            f"in the order of {shards[1]} ({len(shards[0])} shards)"
            if shards
            else "in the order the workers open them"
        )
    )
    return made


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


# Recording, in a worker -----------------------------------------------------------------------------

_logs: dict[str, LearnedLog] = {}


def fetch_recording(fetcher: Any, index: Any, fetch: Callable[[Any, Any], Any]) -> Any:
    """What torch's `_IterableDatasetFetcher.fetch(index)` returns; when the dataset names a log, each
    sample is drawn inside a record of the files it opened (`_Recorded`)."""
    it = getattr(fetcher, "dataset_iter", None)
    path = getattr(fetcher.dataset, LOG_ATTRIBUTE, None)
    if isinstance(path, str) and it is not None and not isinstance(it, _Recorded):
        log = _logs.get(path)
        if log is None:
            from tierstore.learned_order import LearnedLog

            log = _logs[path] = LearnedLog(path)
        fetcher.dataset_iter = _Recorded(it, log, _worker())
    return fetch(fetcher, index)


class _Recorded:
    """A worker's iterator of its dataset, each sample drawn inside a record of the files it opened,
    which go to the log as soon as the sample is drawn: a shard is known to the loader's process at its
    first sample, not at the end of the batch (which may be the shard's end)."""

    def __init__(self, it: Any, log: LearnedLog, worker: int) -> None:
        self.it, self.log, self.worker = it, log, worker

    def __iter__(self) -> _Recorded:
        return self

    def __next__(self) -> Any:
        from tierstore.learned_order import recording

        files: list[str] = []
        try:
            with recording() as files:
                return next(self.it)
        finally:
            self.log.append(self.worker, files)  # filled as the `with` ends, even by StopIteration


def _worker() -> int:
    import torch.utils.data as tud

    info = tud.get_worker_info()
    return 0 if info is None else int(info.id)
