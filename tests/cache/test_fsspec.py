"""tierstore's fsspec filesystem (`tierstore://`) over a cached source: files read through the cache, listed
as fsspec's `file` filesystem lists them, and refused writes as a read-only file refuses them. (Files
written under a `[[writeback]]` destination: tests/writeback/test_fsspec.py.)"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

fsspec = pytest.importorskip("fsspec")

from fsspec.implementations.local import LocalFileSystem  # noqa: E402

import tierstore  # noqa: E402
from tests.helpers.listing import described  # noqa: E402
from tierstore.fs import TierstoreFileSystem  # noqa: E402


def test_ls_of_a_tierstore_url_is_ls_of_the_path(source: Path, tier: str) -> None:
    """`ls("tierstore:///dir")` of a directory source lists the direct children, files and directories,
    as `ls("/dir")` and the `file` filesystem do."""
    (source / "d" / "sub" / "deeper").mkdir(parents=True)
    (source / "d" / "a.bin").write_bytes(b"a" * 10)
    (source / "d" / "sub" / "b.bin").write_bytes(b"b" * 20)
    (source / "d" / "sub" / "deeper" / "c.bin").write_bytes(b"c")
    fs = TierstoreFileSystem(cache=tierstore.Cache(source, [f"{tier}:1M"]), skip_instance_cache=True)
    local = LocalFileSystem()
    d = str(source / "d")
    want = described(local.ls(d, detail=True), d)
    assert want == [("a.bin", "file", 10), ("sub", "directory", None)]
    assert described(fs.ls(f"tierstore://{d}"), d) == want
    assert described(fs.ls(d), d) == want
    assert sorted(fs.ls(f"tierstore://{d}", detail=False)) == sorted(local.ls(d, detail=False))
    assert fs.find(f"tierstore://{d}") == local.find(d)
    assert fs.info(f"tierstore://{d}/sub")["type"] == "directory"


def test_source_files_are_read_through_the_cache(source: Path, tier: str, tmp_path: Path) -> None:
    """`cat_file` and `get_file` of a source file read it through the cache: the store is read once."""
    (source / "d").mkdir()
    (source / "d" / "a.bin").write_bytes(b"through the cache")
    cache = tierstore.Cache(source, [f"{tier}:1M"])
    fs = TierstoreFileSystem(cache=cache, skip_instance_cache=True)
    path = f"tierstore://{source}/d/a.bin"
    assert fs.isfile(path) and not fs.isdir(path) and fs.info(path)["size"] == 17
    for i in range(3):
        fs.get_file(path, str(tmp_path / f"got{i}"))
        assert (tmp_path / f"got{i}").read_bytes() == b"through the cache"
        cache.wait()
    sink = io.BytesIO()
    fs.get_file(path, sink)
    assert sink.getvalue() == b"through the cache"
    assert fs.cat_file(path, start=8) == b"the cache"
    s = cache.stats()
    assert s["source"]["opens"] == 1 and s["tiers"][0]["hits"] == 4, s


def test_fsspec_filesystem(source: Path, tier: str) -> None:
    (source / "d").mkdir()
    (source / "d" / "a.bin").write_bytes(b"through fsspec")
    cache = tierstore.Cache(source, [f"{tier}:1M"])
    fs = TierstoreFileSystem(cache=cache)
    assert fs.ls(str(source / "d"), detail=False) == [str(source / "d" / "a.bin")]
    for _ in range(2):
        with fs.open(f"tierstore://{source}/d/a.bin") as f:
            assert f.read() == b"through fsspec"
        cache.wait()
    assert cache.stats()["tiers"][0]["hits"] == 1
    with pytest.raises(ValueError, match="reads only"):
        fs.open(str(source / "d" / "a.bin"), "wb")
    # Registered as a protocol: fsspec finds it by URL.
    fs2 = fsspec.filesystem("tierstore", cache=cache)
    with fsspec.open(f"tierstore://{source}/d/a.bin", cache=cache) as f:
        assert f.read() == b"through fsspec"
    assert isinstance(fs2, TierstoreFileSystem)


def test_a_cached_file_refuses_writes_as_a_read_only_file_does(source: Path, tier: str) -> None:
    (source / "a.bin").write_bytes(b"read only")
    cache = tierstore.Cache(source, [f"{tier}:1M"])
    with cache.open(source / "a.bin") as cached, open(source / "a.bin", "rb") as plain:
        for f in (cached, plain):
            assert not f.writable()
            with pytest.raises(io.UnsupportedOperation):
                f.write(b"x")
            with pytest.raises(io.UnsupportedOperation):
                f.writelines([b"x"])
            with pytest.raises(io.UnsupportedOperation):
                f.truncate(0)
        with pytest.raises(io.UnsupportedOperation, match=r"a\.bin.*reading only"):
            cached.write(b"x")
    assert (source / "a.bin").read_bytes() == b"read only"
    for f in (cached, plain):
        with pytest.raises(ValueError):  # io.UnsupportedOperation is one too
            f.write(b"x")


def test_paths_are_stripped_as_the_local_file_system_strips_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An absolute path takes a short way (it is on every open); every path ends as LocalFileSystem has it.
    monkeypatch.chdir(tmp_path)
    for path in ("/a/b.bin", "/a/b/", "/", "//a", "/a/./b", "/a//b", "/a/../b", "a/b", "./a", "~/a",
                 "local:/a/b", "/a b/ç.bin", Path("/a/b"), "tierstore:///a/b"):  # fmt: skip
        expected = LocalFileSystem._strip_protocol(str(path).removeprefix("tierstore://"))
        assert TierstoreFileSystem._strip_protocol(path) == expected, path
