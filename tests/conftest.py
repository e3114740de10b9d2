"""Shared fixtures: a real source directory on disk and fresh tier directories (RAM-backed and local)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import tierstore


def content(i: int, size: int) -> bytes:
    """Deterministic, file-specific bytes."""
    seed = hashlib.blake2b(str(i).encode(), digest_size=32).digest()
    return (seed * (size // len(seed) + 1))[:size]


@pytest.fixture
def source(tmp_path: Path) -> Path:
    d = tmp_path / "source"
    d.mkdir()
    return d


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="tierstore-test-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def tier(shm_dir: Path) -> str:
    return str(shm_dir / "tier")


def make_files(root: Path, n: int, size: int = 4096, prefix: str = "f") -> dict[Path, bytes]:
    files = {}
    for i in range(n):
        p = root / f"{prefix}{i // 50}" / f"{i:05d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        b = content(i, size + i % 7)
        p.write_bytes(b)
        files[p] = b
    return files


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No test sees the developer's configuration, and the default cache is rebuilt per test."""
    for k in list(os.environ):
        if k.startswith("TIERSTORE_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setattr(tierstore.cache, "_default", None)


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
    """A real directory and the stand-in parallel file system (FUSE) serving it: (backing dir, mount)."""
    import subprocess
    import sys
    import time

    backing = tmp_path / "pfs-backing"
    mount = tmp_path / "pfs"
    backing.mkdir()
    mount.mkdir()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tierstore.slowfs",
            str(backing),
            str(mount),
            "--foreground",
            "--meta-latency",
            meta_latency,
            "--data-latency",
            data_latency,
            "--bandwidth",
            bandwidth,
            *(["--access-log", str(access_log)] if access_log is not None else []),
            "--write-bandwidth",
            write_bandwidth,
            *(["--fail-file", str(fail_file)] if fail_file is not None else []),
        ],
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    while not os.path.ismount(mount):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the stand-in store did not mount: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.05)
    try:
        yield backing, mount
    finally:
        # Processes of the job that just ended may still be closing their files: retry, then detach.
        for _ in range(50):
            if subprocess.run(["fusermount3", "-u", str(mount)], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        else:
            subprocess.run(["fusermount3", "-uz", str(mount)], check=False)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def slow_store(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """The stand-in store with no added latency: counts every operation."""
    with mounted_store(tmp_path) as store:
        yield store


@pytest.fixture
def throttled_store(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """The stand-in store at 8 MiB/s, so that copying a few MiB takes a visible while."""
    with mounted_store(tmp_path, bandwidth="8MiB/s") as store:
        yield store


def store_stats(mount: Path) -> dict[str, int]:
    from tierstore.slowfs import read_stats

    return read_stats(str(mount))
