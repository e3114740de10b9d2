"""The repository's files on disk: its manifests (read and written through the one Rust schema,
`tierstore_core::models::manifest::RepositoryManifest`), the locks that let many processes save and load at
once, and the fsync of a directory that makes a rename in it durable."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

from tierstore import _core
from tierstore.types import RepositoryManifest


def read_manifest(path: Path) -> RepositoryManifest:
    """The manifest at `path`, checked against its schema: a hash that is not a blake3 or a pack that is not
    a file of `packs/` raises ValueError naming the file; a file deleted meanwhile, FileNotFoundError."""
    manifest: RepositoryManifest = json.loads(_core.model_manifest_read(path))
    return manifest


def write_manifest(path: Path, manifest: RepositoryManifest) -> None:
    """Writes `manifest` at `path` whole and durably, after checking it against its schema."""
    _core.model_manifest_write(path, json.dumps(manifest, separators=(",", ":")))


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
