"""Ordered prefetch: fetch an epoch's files in the order they will be read, a byte budget ahead of the readers.

`Cache.prefetch_order` returns an `OrderPrefetch`; readers record what they have read (through the handle
in this process, or in its read-marks file from any process, with `ReadMarker`), and each read frees
its file's bytes from the budget. `tierstore.torch.prefetching` does all of this for a DataLoader.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

from tierstore import _core
from tierstore.types import OrderProgress


def parse_budget(budget: int | str) -> int:
    """The budget in bytes.

    Args:
        budget: A number of bytes, or a size such as "2G", "512MiB".

    Raises:
        ValueError: It is not a positive size; the message names the value and the fix.
    """
    n: int | None
    if isinstance(budget, bool):
        n = None
    elif isinstance(budget, int):
        n = budget
    elif isinstance(budget, str):
        n = _core.parse_size(budget)
    else:
        n = None
    if n is None or n <= 0:
        raise ValueError(
            f"prefetch budget={budget!r}: not a size; give the bytes to fetch ahead of the readers as a size "
            'like "2G", "512MiB" or a positive number of bytes'
        )
    return n


class OrderPrefetch:
    """A running ordered prefetch (see `Cache.prefetch_order`). A context manager: leaving it stops the
    prefetch; so does dropping the last reference.

    Readers record their reads with `mark_read` (any order) or `advance` (strictly in order) in this
    process, or with `ReadMarker(handle.marks_path)` in other processes.
    """

    def __init__(self, core: _core.OrderPrefetch) -> None:
        self._core = core

    @property
    def marks_path(self) -> str:
        """The read-marks file: slot `i` of a path is the number of distinct paths before its first position."""
        return self._core.marks_path

    @property
    def done(self) -> bool:
        """True when every file of the order is handled (or the prefetch was stopped)."""
        return self._core.done

    def mark_read(self, position: int) -> None:
        """Records that the file at `position` of the order has been read."""
        self._core.mark_read(position)

    def advance(self, position: int) -> None:
        """Records that every file before `position` has been read."""
        self._core.advance(position)

    def progress(self) -> OrderProgress:
        """Counts so far.

        Returns:
            `tierstore.types.OrderProgress`: files_total, files_done, files_fetched (copied from the store
            by this prefetch), bytes_fetched, files_cached (found cached or being fetched by another process),
            files_read_first (read before the prefetch reached them), files_failed, files_no_room (left to
            their readers: the tiers had no room, even after letting go of copies the epoch had read; not an
            error, expected of a data set larger than the tiers), bytes_ahead (fetched,
            not read yet), max_bytes_ahead, position (every file before it is read) and errors.
        """
        return self._core.progress()

    def stop(self) -> None:
        """Stops taking new files; files under way finish."""
        self._core.stop()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until every file is handled, at most `timeout` seconds; returns whether it is.

        The prefetch waits for reads to free its budget, so only wait once the readers are done or
        reading.
        """
        return self._core.wait(timeout)

    def __enter__(self) -> OrderPrefetch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# The high bit of a slot: its sample begun, not yet read, in the epoch of the tag in the other bits (the
# core's `marks::STARTED`). Tags are below it.
STARTED = 1 << 31

# How many times this process was forked into (counted in the child): a marker maps its file again in a
# forked child, which must not write through its parent's mapping, without asking getpid per read.
_forks = 0


def _count_fork() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_count_fork)


class ReadMarker:
    """Records reads into a read-marks file from any process of the node (a DataLoader worker, say).

    One store into a shared mapping per read, no system call. The mapping is made on first use in each
    process, so the marker can be pickled into spawned workers and inherited by forked ones.

    Args:
        path: The read-marks file.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._mapped_after = -1  # the fork count when this process mapped the file (-1: not yet)
        self._marks: _core.Marks | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])  # type: ignore[misc]

    def _slots(self) -> _core.Marks | None:
        """The file mapped in this process by the engine (which opens it only if it is this user's own and
        no link): None where it cannot be, for a reader never fails because of the prefetch."""
        if self._mapped_after != _forks:
            self._mapped_after = _forks
            try:
                self._marks = _core.Marks(self.path)
            except (OSError, ValueError):
                self._marks = None
        return self._marks

    def mark(self, slot: int, tag: int) -> None:
        """Stores `tag` into `slot` (out of range: ignored)."""
        marks = self._slots()
        if marks is not None:
            marks.mark(slot, tag)

    def mark_read(self, slot: int) -> None:
        """Stores the current epoch's tag (slot 0) into `slot`: what a read of its sample records."""
        marks = self._slots()
        if marks is not None:
            marks.mark_read(slot)

    def mark_started(self, slot: int) -> None:
        """Stores the current epoch's tag with `STARTED` into `slot`, as its sample begins: the prefetch
        leaves the sample's files to this reader from then on, rather than fetch a file the reader may
        already be reading from the store. `mark_read` follows once the sample is read."""
        marks = self._slots()
        if marks is not None:
            marks.mark_started(slot)

    # A DataLoader's worker marks every sample it reads twice, begun and read: the calls below do a batch's
    # in one call each, in the engine (`_core.Marks`), with the epoch's tag read once, rather than a Python
    # call or a Python loop's turn per sample (those cost the worker about 10M and then 3.5M instructions a
    # warm epoch of 2,000 samples: bench_warm_prefetch.py, bench_sample_attribution.py).

    def begin_each(self, indices: Iterable[Any]) -> Iterator[Any]:
        """Yields each dataset index of `indices` once `mark_started` of its slot (the index + 1) would have
        marked it begun; an index that is not an integer (nor converts to one) is yielded unmarked."""
        return self._each(indices, then_read=False)

    def begin_then_read_each(self, indices: Iterable[Any]) -> Iterator[Any]:
        """`begin_each`, and each index marked read (`mark_read`) once the consumer asks for the next:
        `[dataset[i] for i in marker.begin_then_read_each(batch)]` marks each sample begun before its read
        and read after it. A read that raises leaves its sample begun, as the two calls would."""
        return self._each(indices, then_read=True)

    def _each(self, indices: Iterable[Any], then_read: bool) -> Iterator[Any]:
        marks = self._slots()
        return iter(indices) if marks is None else marks.begin_each(indices, then_read)

    def read_each(self, indices: Iterable[Any]) -> None:
        """`mark_read` of each dataset index's slot (the index + 1); indices that are not integers are
        passed over."""
        marks = self._slots()
        if marks is not None:
            marks.read_each(indices)

    def get(self, slot: int) -> int:
        """The value in `slot` (0 when unreadable)."""
        marks = self._slots()
        return 0 if marks is None else marks.get(slot)

    def count(self, tag: int, start: int = 0) -> int:
        """How many slots from `start` on hold `tag`."""
        marks = self._slots()
        return 0 if marks is None else marks.count(tag, start)
