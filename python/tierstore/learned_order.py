"""The learned order: the files each index of a dataset opened in the loader's first epoch, so that the
epochs after it are prefetched in the sampler's order for a dataset that does not say where its samples
are (a custom `Dataset` that builds a path from the index, opens an index file first, and so on).

- **Recording.** While a loader's first epoch runs, each DataLoader worker reads each sample inside a
  record of the files its thread opens through tierstore: the shim's under `tierstore run`
  (`tierstore_preload_record_start` and `_take`, one thread-local buffer) and the Python API's
  (`Cache.open`). A batch is read one sample at a time, as torch's own fetcher does, so that each index
  gets its own files; a dataset with `__getitems__` reads a batch in one call, and teaches nothing.
- **The log.** Every worker appends `[index, [path, ...]]` as one JSON line, in one `write` to the
  loader's log opened with `O_APPEND` (a file the loader's process made, 0600, beside its read-marks file;
  a worker writes only to a file of its own user that no one else can write).
- **Learning.** As each later epoch starts, the loader's process reads the lines added since, keeps the
  files under the cache's source, and prefetches the epoch's indices whose files it knows.

What an index opened in the first epoch is what it is taken to open in every epoch: a sample that picks
its file at random is prefetched wrong (its reads go on as they would have), never read wrong.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

# The attribute on a dataset that names the loader's learned-order log to its workers.
LOG_ATTRIBUTE = "_tierstore_learned_order"


class _Opened(threading.local):
    """The Python API's record: `Cache.open` adds each path it opens to this thread's list while one runs.
    None outside a record, as a class attribute: `opened.paths` is then a plain lookup, where `getattr` of
    a thread-local's missing attribute raises and catches an AttributeError (0.55 µs of every warm open)."""

    paths: list[str] | None = None


opened = _Opened()


# Recording, in a worker ----------------------------------------------------------------------------


class _Shim:
    """The record functions of `tierstore run`'s shim, when it is loaded in this process."""

    def __init__(self) -> None:
        import ctypes

        lib = ctypes.CDLL(None)
        self.start: Callable[[], None] | None = getattr(lib, "tierstore_preload_record_start", None)
        self.take: Any = getattr(lib, "tierstore_preload_record_take", None)
        if self.take is not None:
            self.take.restype = ctypes.c_size_t
            self.take.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        self.buffer = ctypes.create_string_buffer(1 << 16)

    def taken(self) -> list[str]:
        """The record's paths, and the record ended."""
        import ctypes

        if self.take is None:
            return []
        n = self.take(self.buffer, len(self.buffer))
        if n == 0:
            return []  # most samples open nothing new: no copy of the buffer for them
        if n > len(self.buffer):
            self.buffer = ctypes.create_string_buffer(n)
            n = self.take(self.buffer, n)
        # The first n bytes only: `.raw` would copy the whole 64 KiB buffer on every record.
        return [os.fsdecode(p) for p in ctypes.string_at(self.buffer, n).split(b"\0") if p]


_shims: dict[int, _Shim] = {}  # by process: a forked worker loads nothing anew, but keeps its own buffer


def _shim() -> _Shim:
    s = _shims.get(os.getpid())
    if s is None:
        s = _shims[os.getpid()] = _Shim()
    return s


@contextlib.contextmanager
def recording() -> Iterator[list[str]]:
    """The files this thread opens through tierstore within the block (shim and Python API), in the list
    given, filled as the block ends."""
    shim = _shim()
    if shim.start is not None:
        shim.start()
    outer = opened.paths
    record: list[str] = []
    opened.paths = record
    files: list[str] = []
    try:
        yield files
    finally:
        files.extend(shim.taken())
        files.extend(record)
        opened.paths = outer


def fetch_learning(fetcher: Any, index: Any, fetch: Callable[[Any, Any], Any], log: LearnedLog) -> Any:
    """What torch's `_MapDatasetFetcher.fetch(index)` returns, each sample read inside a record whose
    files go to `log`."""
    if not fetcher.auto_collation:
        key = _key(index)
        if key is None:
            return fetch(fetcher, index)
        with recording() as files:
            data = fetch(fetcher, index)
        log.append(key, files)
        return data
    if getattr(fetcher.dataset, "__getitems__", None):
        return fetch(fetcher, index)  # a batch read in one call: no file is any one sample's
    samples = []
    for i in index:
        with recording() as files:
            samples.append(fetcher.dataset[i])
        key = _key(i)
        if key is not None:
            log.append(key, files)
    return fetcher.collate_fn(samples)


def _key(index: Any) -> int | None:
    """A sampler's index as an int (it may be a 0-d tensor); None for anything else."""
    try:
        return int(index)
    except (TypeError, ValueError, RuntimeError):
        return None


# The log -------------------------------------------------------------------------------------------


class LearnedLog:
    """One loader's learned-order log: appended to by its workers, read by its own process.

    Args:
        path: The log, made by `LearnedLog.create` in the loader's process.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._pid = 0
        self._read = 0  # how far `added` has read
        self._reader: int | None = None  # `added`'s descriptor, in the loader's process

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])  # type: ignore[misc]

    @classmethod
    def create(cls, path: str) -> LearnedLog:
        """A new, empty log at `path` (refused if anything is there), readable and writable by this user
        only."""
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.close(fd)
        return cls(path)

    def append(self, index: int, files: Sequence[str]) -> None:
        """Records that sample `index` opened `files`. Never raises: a record lost is a file not prefetched."""
        if files:
            self._write((json.dumps([index, list(files)]) + "\n").encode())

    def mark_epoch(self) -> None:
        """Records that the loader's next epoch begins (`[-1, []]`): its process writes it before the
        workers are given the epoch's first batch, so it comes before every record of that epoch."""
        self._write(b"[-1, []]\n")

    def _write(self, line: bytes) -> None:
        """Appends one line in one `write`. Never raises: a record lost is a file not prefetched."""
        with contextlib.suppress(OSError, ValueError):
            fd = self._writer()
            if fd is not None:
                os.write(fd, line)

    def added(self) -> list[tuple[int, list[str]]]:
        """The records appended since the last call (in this process), in the order they were written; a
        line a worker is still writing is read next time, a line that is not a record is skipped."""
        try:
            data = self._read_from(self._read)
        except OSError:
            return []
        whole = data.rfind(b"\n") + 1
        self._read += whole
        records = []
        for line in data[:whole].splitlines():
            with contextlib.suppress(ValueError, TypeError):
                index, files = json.loads(line)
                if isinstance(index, int) and isinstance(files, list):
                    records.append((index, [p for p in files if isinstance(p, str)]))
        return records

    def _read_from(self, offset: int) -> bytes:
        """What the log holds from `offset` on, read through a descriptor kept open in this process."""
        if self._reader is None:
            self._reader = _open_own(self.path, os.O_RDONLY)
            if self._reader is None:
                raise OSError(f"{self.path} is not this user's private log")
            weakref.finalize(self, os.close, self._reader)
        chunks = []
        while chunk := os.pread(self._reader, 1 << 20, offset):
            chunks.append(chunk)
            offset += len(chunk)
        return b"".join(chunks)

    def _writer(self) -> int | None:
        if self._pid != os.getpid():
            self._pid, self._fd = os.getpid(), _open_own(self.path, os.O_WRONLY | os.O_APPEND)
        return self._fd


def _open_own(path: str, flags: int) -> int | None:
    """`path` opened with `flags`, if it is a regular file of this user's that no one else can write; never
    through a link. The log sits in the cache's private directory, but a file another user could swap in
    must never be read as this loader's records, nor written to."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        os.close(fd)
        return None
    return fd


class LearnedOrder:
    """The files of each index, as the log has taught them so far (the loader's process).

    Args:
        log: The loader's log.
        within: Whether a path is under the cache's source: other files are not the cache's to prefetch.
    """

    def __init__(self, log: LearnedLog, within: Callable[[str], bool]) -> None:
        self.log = log
        self.within = within
        self.files: dict[int, tuple[str, ...]] = {}

    def update(self) -> int:
        """Reads the lines the workers added since the last update; returns how many indices are known."""
        for index, files in self.log.added():
            kept = tuple(p for p in files if self.within(p))
            if kept and index >= 0:
                self.files[index] = tuple(dict.fromkeys(kept))  # each file once, in the order opened
        return len(self.files)

    def files_of(self, index: int) -> tuple[str, ...]:
        """The files index `index` opened when it was learned; none if it was not."""
        return self.files.get(index, ())
