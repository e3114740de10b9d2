"""Shared fixtures: a real source directory on disk and fresh tier directories (RAM-backed and local), the
stand-in store, a private node agent; and the markers that say what each test needs (see tests/README.md).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import tierstore
from tests.helpers import soak
from tests.helpers.agents import start_agent, stop_agent
from tests.helpers.marks import BY_FIXTURE, needs
from tests.helpers.stores import mounted_store

ROOT_SKIP = "needs root (network namespaces, mounts): CI runs as root"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test takes the markers of the fixtures it uses (`helpers.marks.needs`), and a test that needs
    network namespaces needs root."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        for fixture, marks in BY_FIXTURE.items():
            if fixture in names:
                for mark in marks:
                    item.add_marker(mark)
        if item.get_closest_marker("netns") is not None and item.get_closest_marker("root") is None:
            item.add_marker("root")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("root") is not None and os.geteuid() != 0:
        pytest.skip(ROOT_SKIP)


@pytest.fixture(autouse=True, scope="session")
def _test_settings_stay_with_the_tests() -> Iterator[None]:
    """The TIERSTORE_TEST_* variables are the tests' own (`helpers.soak` read them at collection): no
    process a test starts sees them, as tierstore refuses a TIERSTORE_* variable it does not know."""
    with pytest.MonkeyPatch.context() as env:
        for k in list(os.environ):
            if k.startswith(soak.PREFIX):
                env.delenv(k)
        yield


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


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No test sees the developer's configuration, and the default cache is rebuilt per test."""
    for k in list(os.environ):
        if k.startswith("TIERSTORE_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setattr(tierstore.cache, "_default", None)


@pytest.fixture
@needs("fuse")
def slow_store(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """The stand-in store with no added latency: counts every operation."""
    with mounted_store(tmp_path) as store:
        yield store


@pytest.fixture
@needs("fuse")
def throttled_store(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """The stand-in store at 8 MiB/s, so that copying a few MiB takes a visible while."""
    with mounted_store(tmp_path, bandwidth="8MiB/s") as store:
        yield store


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
