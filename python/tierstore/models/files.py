"""The repository's files on disk: the locks that let many processes save and load at once, and the fsync of
a directory that makes a rename in it durable."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Makes the names in directory `path` durable (a rename into it survives a crash)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def flock(path: Path, exclusive: bool) -> Iterator[None]:
    """Holds the lock file `path` (shared, or `exclusive`) for the block; the kernel releases it if the
    process dies."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock, also when the process dies
