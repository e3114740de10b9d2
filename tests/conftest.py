"""Shared fixtures: a real source directory on disk and fresh tier directories (RAM-backed and local)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import tierstore
from tierstore import agent


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
    from tierstore.testing.slowfs import read_stats

    return read_stats(str(mount))


@pytest.fixture
def sock(tmp_path: Path) -> Iterator[Path]:
    """A private node agent (it keeps 2 versions per stream); its socket is every client's default (the agent's
    socket is $XDG_RUNTIME_DIR/tierstore/agent.sock). The variable is set through a MonkeyPatch of the
    fixture's own, so that a test undoing its `monkeypatch` does not fall back to the default agent."""
    path = tmp_path / "run" / "tierstore" / "agent.sock"
    path.parent.mkdir(parents=True)
    proc = start_agent(path)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("XDG_RUNTIME_DIR", str(path.parent.parent))
        yield path
    stop_agent(proc)


def start_agent(
    path: Path, *extra: str, node: str = "n1", inside: Callable[..., list[str]] | None = None
) -> subprocess.Popen[bytes]:
    """A node agent on socket `path` (inside a network namespace: `inside=Node.cmd`), once it is ready."""
    argv = [*agent.run_args(path, node=node), *extra]
    proc = subprocess.Popen(
        inside(*argv) if inside is not None else argv,
        stdout=subprocess.PIPE,
        stderr=open(path.parent / "agent.log", "ab"),  # noqa: SIM115
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith(b"ready"), (path.parent / "agent.log").read_text()
    return proc


def stop_agent(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(timeout=20)


def child(code: str, sock: Path) -> subprocess.Popen[str]:
    """A Python process running `code`, talking to the agent on `sock` (…/tierstore/agent.sock)."""
    env = {**os.environ, "XDG_RUNTIME_DIR": str(sock.parent.parent)}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
