"""The stand-in parallel file system (FUSE, `tierstore.testing.slowfs`): a real directory served through a
mount that counts every operation it is asked, as a shared store would be asked them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def mounted_store(
    tmp_path: Path,
    *,
    data_latency: str = "0",
    bandwidth: str = "0",
    meta_latency: str = "0",
    access_log: Path | None = None,
    write_bandwidth: str = "0",
    fail_file: Path | None = None,
) -> Iterator[tuple[Path, Path]]:
    """A real directory and the stand-in parallel file system (FUSE) serving it: (backing dir, mount).
    No latency and no bandwidth cap unless asked: the tests count operations, they do not time them."""
    from tierstore.testing.slowfs import mounted

    backing = tmp_path / "pfs-backing"
    backing.mkdir()
    with mounted(
        backing,
        tmp_path / "pfs",
        meta_latency=meta_latency,
        data_latency=data_latency,
        bandwidth=bandwidth,
        write_bandwidth=write_bandwidth,
        fail_file=fail_file,
        access_log=access_log,
    ) as mount:
        yield backing, mount


def store_stats(mount: Path) -> dict[str, int]:
    """The store's counters now: operations by name, and bytes read and written."""
    from tierstore.testing.slowfs import read_stats

    return read_stats(str(mount))
