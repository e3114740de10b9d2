"""tierstore's fsspec filesystem (`tierstore://`) under a `[[writeback]]` destination: files written there,
staged and not yet on the store, behave as fsspec's `file` filesystem shows files on disk; a file removed
does not come back once the stage has drained. fsspec's own abstract suite runs against a destination.
(Files read through the cache: tests/cache/test_fsspec.py.)"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

fsspec = pytest.importorskip("fsspec")

from fsspec.implementations.local import LocalFileSystem  # noqa: E402
from fsspec.tests.abstract import (  # noqa: E402
    AbstractCopyTests,
    AbstractFixtures,
    AbstractGetTests,
    AbstractOpenTests,
    AbstractPipeTests,
    AbstractPutTests,
)

import tierstore  # noqa: E402
from tests.helpers.listing import described, tree  # noqa: E402
from tests.helpers.marks import needs  # noqa: E402
from tests.helpers.stores import mounted_store  # noqa: E402
from tests.helpers.wait import wait_for  # noqa: E402
from tests.helpers.writeback import staged_copies_go, user_stage  # noqa: E402
from tierstore import agent, writeback  # noqa: E402
from tierstore.fs import TierstoreFileSystem  # noqa: E402


@dataclass
class Destination:
    """A `[[writeback]]` destination on the stand-in store (FUSE), with this test's own agent socket."""

    dest: Path  # where programs write: the store's mount
    backing: Path  # the same directory as the store holds it: what a reader of the store gets
    stage: Path  # this user's stage directory (`<configured stage>/<uid>`)
    outage: Path  # while this file exists, the store refuses every change (files stay staged)

    def pending(self) -> int:
        return sum(p["files"] for p in writeback.pending(self.dest))


@contextlib.contextmanager
def destination(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **store: str) -> Iterator[Destination]:
    outage = tmp_path / "store-outage"
    with mounted_store(tmp_path, fail_file=outage, **store) as (backing, mount):  # type: ignore[arg-type]
        dest = mount / "ckpt"
        dest.mkdir()
        run = tmp_path / "run"
        run.mkdir()
        stage = tmp_path / "stage"
        # The agent that migrates is started on demand by the first write, on this test's socket.
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
        monkeypatch.setenv("TIERSTORE_WRITEBACK", f"{dest}:{stage}:1G:local")
        writeback.reload()
        try:
            yield Destination(dest, backing / "ckpt", user_stage(dest), outage)
        finally:
            outage.unlink(missing_ok=True)
            with contextlib.suppress(Exception):
                agent.stop(run / "tierstore" / "agent.sock")
            writeback.reload()


@pytest.fixture
@needs("fuse")
def wb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Destination]:
    with destination(tmp_path, monkeypatch) as d:
        yield d


@pytest.fixture
@needs("fuse")
def slow_wb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Destination]:
    """A store that takes writes at 1 MiB/s: a file of a few hundred KiB stays staged for a while."""
    with destination(tmp_path, monkeypatch, write_bandwidth="1MiB/s") as d:
        yield d


def test_a_removed_staged_file_does_not_come_back(wb: Destination) -> None:
    fs = TierstoreFileSystem(skip_instance_cache=True)
    f = str(wb.dest / "a.bin")
    wb.outage.touch()  # the store takes nothing: the file stays staged
    fs.pipe_file(f, b"staged bytes")
    assert wb.pending() == 1 and not (wb.backing / "a.bin").exists()
    fs.rm(f)
    assert not fs.exists(f) and wb.pending() == 0
    with pytest.raises(FileNotFoundError, match=r"a\.bin"):
        fs.rm(f)
    wb.outage.unlink()
    tierstore.sync(timeout=30)
    assert not (wb.backing / "a.bin").exists()
    staged_copies_go(wb.stage)


def test_rm_recursive_removes_staged_and_stored_files_for_good(slow_wb: Destination) -> None:
    wb = slow_wb
    fs = TierstoreFileSystem(skip_instance_cache=True)
    d = wb.dest / "step"
    (wb.backing / "step" / "sub").mkdir(parents=True)
    (wb.backing / "step" / "old.bin").write_bytes(b"on the store")
    (wb.backing / "step" / "sub" / "stored.bin").write_bytes(b"on the store too")
    (wb.backing / "keep.bin").write_bytes(b"beside it")
    for rel in ("new.bin", "old.bin", "sub/new.bin"):  # old.bin: a newer copy staged over the store's
        fs.pipe_file(str(d / rel), b"x" * (512 << 10))  # half a second each at the store's 1 MiB/s
    assert wb.pending() >= 2, "the files reached the store before the test could remove them staged"
    with pytest.raises(ValueError, match=f"{d}.*recursive=True"):
        fs.rm(str(d))
    fs.rm(f"tierstore://{d}", recursive=True)
    assert not fs.exists(str(d)) and wb.pending() == 0
    tierstore.sync(timeout=60)
    assert tree(wb.backing) == ["keep.bin"], "a removed file came back"
    # A write into the removed directory fails as it does on disk: the stage does not bring it back.
    with pytest.raises(FileNotFoundError, match="step"):
        fs.pipe_file(str(d / "late.bin"), b"late")


def test_rm_recursive_during_a_migration_leaves_nothing_and_fails_nothing(
    slow_wb: Destination, tmp_path: Path
) -> None:
    """A step's directory removed while the agent copies one of its files to the store (under its
    temporary name, inside that directory): the tree goes whole, nothing comes back, and the agent counts
    no failed attempt, so the next file migrates without a back-off."""
    wb = slow_wb
    fs = TierstoreFileSystem(skip_instance_cache=True)
    d = wb.dest / "step"
    fs.makedirs(str(d))
    fs.pipe_file(str(d / "big.bin"), b"x" * (3 << 20))  # three seconds at the store's 1 MiB/s
    wait_for("the migration to start", (wb.backing / "step" / ".big.bin.tierstore-part").exists, timeout=30)
    fs.rm(str(d), recursive=True)
    assert not fs.exists(str(d)) and not (wb.backing / "step").exists()
    fs.pipe_file(str(wb.dest / "after.bin"), b"after")
    tierstore.sync(timeout=60)
    assert tree(wb.backing) == ["after.bin"], "a removed file, or its temporary copy, came back"
    said = agent.status(tmp_path / "run" / "tierstore" / "agent.sock")
    assert said is not None, "the agent that migrated the files no longer answers"
    assert json.loads(said)["writeback"]["failures"] == 0, said
    staged_copies_go(wb.stage)


def test_the_destination_itself_lists_its_staged_files_and_once_removed_stays_removed(
    slow_wb: Destination,
) -> None:
    """Files staged directly in the destination are in its listing; `rm(DEST, recursive=True)` removes
    them with it, `exists` says so, `tierstore.sync` has nothing left, and the agent does not bring the
    destination back."""
    wb = slow_wb
    fs = TierstoreFileSystem(skip_instance_cache=True)
    (wb.backing / "old.bin").write_bytes(b"on the store")
    fs.makedirs(str(wb.dest / "sub"))
    wb.outage.touch()  # the store takes nothing for now: the files stay staged
    fs.pipe_file(str(wb.dest / "sub" / "b.bin"), b"x" * (512 << 10))
    fs.pipe_file(str(wb.dest / "a.bin"), b"y" * (512 << 10))
    names = sorted(n.rsplit("/", 1)[-1] for n in fs.ls(str(wb.dest), detail=False))
    assert names == ["a.bin", "old.bin", "sub"], names
    wb.outage.unlink()  # the store takes 1 MiB/s: both are still staged when they are removed
    fs.rm(str(wb.dest), recursive=True)
    assert not fs.exists(str(wb.dest)) and wb.pending() == 0
    tierstore.sync(timeout=10)
    time.sleep(1.5)  # the agent's next migration pass, were anything left for it
    assert not wb.backing.exists(), f"the destination came back: {tree(wb.backing.parent)}"


def test_rmdir_refuses_a_directory_with_staged_files(wb: Destination) -> None:
    fs = TierstoreFileSystem(skip_instance_cache=True)
    fs.mkdir(str(wb.dest / "d"))
    wb.outage.touch()
    fs.pipe_file(str(wb.dest / "d" / "a.bin"), b"staged")
    with pytest.raises(OSError, match=r"a\.bin"):
        fs.rmdir(str(wb.dest / "d"))
    wb.outage.unlink()
    with pytest.raises(OSError, match="not empty"):
        fs.rmdir(str(wb.dest / "d"))  # staged or, once listed, on the store: the directory is not empty
    assert fs.cat_file(str(wb.dest / "d" / "a.bin")) == b"staged"


def test_a_staged_file_moved_out_of_the_destination_moves_whole(wb: Destination, tmp_path: Path) -> None:
    """`mv` to a path outside every destination moves the staged bytes (not the store's older copy) and
    leaves nothing to land at the old name."""
    fs = TierstoreFileSystem(skip_instance_cache=True)
    (wb.backing / "a.bin").write_bytes(b"older")
    fs.pipe_file(str(wb.dest / "a.bin"), b"the staged copy")
    fs.pipe_file(str(wb.dest / "b.bin"), b"staged only")
    for name in ("a.bin", "b.bin"):
        fs.mv(str(wb.dest / name), str(tmp_path / name))
        assert not fs.exists(str(wb.dest / name))
    assert (tmp_path / "a.bin").read_bytes() == b"the staged copy"
    assert (tmp_path / "b.bin").read_bytes() == b"staged only"
    tierstore.sync(timeout=30)
    assert tree(wb.backing) == []


def test_staged_files_look_like_files_on_disk(wb: Destination, tmp_path: Path) -> None:
    """A staged file's metadata, listing and bytes through `tierstore://` are those the `file` filesystem
    gives for the same files on disk."""
    fs = TierstoreFileSystem(skip_instance_cache=True)
    local = LocalFileSystem()
    d = wb.dest / "d"
    (wb.backing / "d" / "sub").mkdir(parents=True)
    (wb.backing / "d" / "stored.bin").write_bytes(b"on the store")
    (wb.backing / "d" / "both.bin").write_bytes(b"an older copy")
    ref = tmp_path / "ref"  # the same files, on disk
    (ref / "sub").mkdir(parents=True)
    (ref / "stored.bin").write_bytes(b"on the store")
    wb.outage.touch()
    for name, data in [("staged.bin", b"staged bytes"), ("both.bin", b"a newer, longer copy")]:
        fs.pipe_file(str(d / name), data)
        (ref / name).write_bytes(data)
    assert wb.pending() == 2

    staged, on_disk = str(d / "staged.bin"), str(ref / "staged.bin")
    for path, same in [
        (staged, on_disk),
        (f"tierstore://{staged}", on_disk),
        (str(d / "both.bin"), str(ref / "both.bin")),
    ]:
        assert fs.exists(path) and fs.lexists(path)
        assert fs.isfile(path) and not fs.isdir(path)
        info, want = fs.info(path), local.info(same)
        assert (info["name"], info["type"], info["size"]) == (fs._strip_protocol(path), "file", want["size"])
        assert abs(info["mtime"] - want["mtime"]) < 60
        assert fs.size(path) == want["size"]
        assert fs.cat_file(path) == local.cat_file(same)
        assert fs.cat_file(path, start=2, end=-3) == local.cat_file(same, start=2, end=-3)
        out = tmp_path / "got.bin"
        fs.get_file(path, str(out))
        assert out.read_bytes() == local.cat_file(same)
        sink = io.BytesIO()
        fs.get_file(path, sink)
        assert sink.getvalue() == local.cat_file(same)
    assert not fs.exists(str(d / "missing.bin")) and not fs.isfile(str(d / "missing.bin"))
    with pytest.raises(FileNotFoundError):
        fs.info(str(d / "missing.bin"))
    # The listing does not wait for the store: staged files are listed besides the store's, once each.
    assert described(fs.ls(str(d)), str(d)) == described(local.ls(str(ref), detail=True), str(ref))
    assert sorted(fs.ls(str(d), detail=False)) == sorted(str(d / n) for n in os.listdir(ref))
    assert fs.find(str(d)) == sorted(str(d / r) for r in ("both.bin", "staged.bin", "stored.bin"))
    assert wb.pending() == 2
    # Copies read the staged copy and are staged in turn.
    fs.cp(staged, str(d / "copy.bin"))
    assert fs.cat_file(str(d / "copy.bin")) == b"staged bytes"
    fs.touch(str(d / "empty.bin"))
    assert fs.info(str(d / "empty.bin"))["size"] == 0
    wb.outage.unlink()
    (ref / "copy.bin").write_bytes(b"staged bytes")
    (ref / "empty.bin").touch()
    assert described(fs.ls(str(d)), str(d)) == described(local.ls(str(ref), detail=True), str(ref))
    tierstore.sync(timeout=30)
    assert (wb.backing / "d" / "both.bin").read_bytes() == b"a newer, longer copy"
    assert described(fs.ls(str(d)), str(d)) == described(local.ls(str(ref), detail=True), str(ref))


def test_listing_shows_files_still_migrating_once(slow_wb: Destination, tmp_path: Path) -> None:
    """A listing taken while files migrate shows each once, under its own name (not the store's partial
    copy), with its full size."""
    wb = slow_wb
    fs = TierstoreFileSystem(skip_instance_cache=True)
    d = wb.dest / "m"
    fs.mkdir(str(d))
    sizes = {f"{i}.bin": (256 << 10) + i for i in range(4)}  # a quarter of a second each on this store
    for name, size in sizes.items():
        fs.pipe_file(str(d / name), b"m" * size)
    assert wb.pending() >= 2, "the files reached the store before the test could list them staged"
    listed = fs.ls(str(d))
    assert sorted((os.path.basename(i["name"]), i["size"]) for i in listed) == sorted(sizes.items())
    tierstore.sync(timeout=60)
    assert {p.name: p.stat().st_size for p in (wb.backing / "m").iterdir()} == sizes


def _slow(test: Callable[..., None]) -> Callable[..., None]:
    """One of fsspec's tests as it is (its parameters too), marked `slow` in this suite only."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        test(*args, **kwargs)

    return pytest.mark.slow(run)


@pytest.fixture(scope="class")
@needs("fuse")
def suite_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, Path, Path]]:
    """One store and one agent for the whole of fsspec's suite below, as a test's own would cost more than
    the test: (the destination, its backing directory, the agent's runtime directory, the stage)."""
    tmp = tmp_path_factory.mktemp("fsspec-suite")
    with mounted_store(tmp, fail_file=tmp / "store-outage") as (backing, mount):
        (mount / "ckpt").mkdir()
        run = tmp / "run"
        run.mkdir()
        try:
            yield mount / "ckpt", backing / "ckpt", run, tmp / "stage"
        finally:
            with contextlib.suppress(Exception):
                agent.stop(run / "tierstore" / "agent.sock")


class TestAbstractSuite(
    AbstractFixtures,
    AbstractCopyTests,
    AbstractGetTests,
    AbstractPutTests,
    AbstractOpenTests,
    AbstractPipeTests,
):
    """fsspec's own suite, on a destination of the stand-in store: every file it writes is staged, and
    whatever it removed in its teardown is still gone once the stage has drained."""

    _tests = itertools.count()  # names each test's own directory on the suite's destination

    # fsspec's glob matrix (32 patterns, depths and recursions for each of copy, get and put, about 35 s):
    # `slow`. The suite's other tests, globs among them, stay in `make test-fast`.
    test_copy_glob_edge_cases = _slow(AbstractCopyTests.test_copy_glob_edge_cases)
    test_get_glob_edge_cases = _slow(AbstractGetTests.test_get_glob_edge_cases)
    test_put_glob_edge_cases = _slow(AbstractPutTests.test_put_glob_edge_cases)

    @pytest.fixture
    def fs(self, suite_dest: Destination) -> TierstoreFileSystem:
        # auto_mkdir as fsspec runs the suite for its `file` filesystem.
        return TierstoreFileSystem(auto_mkdir=True, skip_instance_cache=True)

    @pytest.fixture
    def fs_path(self, suite_dest: Destination) -> str:
        return str(suite_dest.dest)

    @pytest.fixture
    def suite_dest(
        self, suite_store: tuple[Path, Path, Path, Path], monkeypatch: pytest.MonkeyPatch
    ) -> Iterator[Destination]:
        """A directory of this test's own on the suite's destination, as `destination` configures one."""
        dest, backing, run, stage = suite_store
        sub = dest / f"test{next(self._tests)}"
        sub.mkdir()
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
        monkeypatch.setenv("TIERSTORE_WRITEBACK", f"{dest}:{stage}:1G:local")
        writeback.reload()
        d = Destination(sub, backing / sub.name, user_stage(dest), stage.parent / "store-outage")
        try:
            yield d
            # The suite's fixtures are torn down before this one: what they removed stays removed, what
            # a test left (some leave their files) is on the store, as the filesystem showed it.
            fs = TierstoreFileSystem(skip_instance_cache=True)
            found = fs.find(str(d.dest), withdirs=True, detail=True)
            shown = sorted(
                os.path.relpath(name, d.dest) + ("/" if i["type"] == "directory" else "")
                for name, i in found.items()
                if name != str(d.dest)
            )
            tierstore.sync(timeout=60)
            assert tree(d.backing) == shown, "the store holds other files than tierstore:// showed"
            staged_copies_go(d.stage)
        finally:
            writeback.reload()
