"""`tierstore.open` returns a file object that real readers (numpy, PIL, pickle, torch, h5py) take unchanged."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tierstore
from tests.helpers.data import content


@pytest.fixture
def cache(source: Path, tier: str) -> tierstore.Cache:
    return tierstore.Cache(source, [f"{tier}:64M"], inline_max="64KiB")


def both_backings(cache: tierstore.Cache, path: Path):
    """The first open is served from the source fetch, the second from the tier copy."""
    with cache.open(path) as f:
        yield f
    cache.wait()
    with cache.open(path) as f:
        assert f.backing == "tier"
        yield f


def test_read_seek_tell_readline_iteration(cache: tierstore.Cache, source: Path) -> None:
    text = b"".join(b"line %d\n" % i for i in range(5000)) + b"no newline at end"
    p = source / "lines.txt"
    p.write_bytes(text)
    for f in both_backings(cache, p):
        assert f.readline() == b"line 0\n"
        assert f.tell() == 7
        assert f.read(5) == b"line "
        f.seek(-17, io.SEEK_END)
        assert f.read() == b"no newline at end"
        assert f.read() == b""
        f.seek(0)
        lines = list(f)
        assert lines[1] == b"line 1\n" and lines[-1] == b"no newline at end" and len(lines) == 5001
        f.seek(3)
        assert f.readline(2) == b"e "
        assert f.seek(10**9) == 10**9 and f.read(10) == b""
        with pytest.raises(ValueError, match="negative seek"):
            f.seek(-1)
        f.seek(0)
        assert f.readlines()[4999] == b"line 4999\n"


def test_readinto_fills_the_callers_buffer(cache: tierstore.Cache, source: Path) -> None:
    data = content(1, 300_000)  # larger than inline_max: the first open follows a growing copy
    p = source / "big.bin"
    p.write_bytes(data)
    for f in both_backings(cache, p):
        arr = np.zeros(len(data) + 10, dtype=np.uint8)
        assert f.readinto(arr) == len(data)
        assert arr[: len(data)].tobytes() == data
        f.seek(100)
        buf = bytearray(1000)
        assert f.readinto(memoryview(buf)) == 1000 and bytes(buf) == data[100:1100]
        with pytest.raises(TypeError, match="writable"):
            f.readinto(b"readonly")


def test_fileno_is_a_real_descriptor_of_the_copy(cache: tierstore.Cache, source: Path) -> None:
    p = source / "x.bin"
    p.write_bytes(content(2, 5000))
    with cache.open(p) as f:
        assert f.backing == "memory"
        with pytest.raises(io.UnsupportedOperation, match="no file descriptor"):
            f.fileno()
    cache.wait()
    with cache.open(p) as f:
        assert os.pread(f.fileno(), 10, 0) == content(2, 5000)[:10]


def test_closed_file_refuses_io(cache: tierstore.Cache, source: Path) -> None:
    p = source / "c"
    p.write_bytes(b"abc")
    f = cache.open(p)
    assert not f.closed
    f.close()
    assert f.closed
    f.close()  # a second close does nothing, as for any file
    with pytest.raises(ValueError):
        f.read()
    with pytest.raises(ValueError, match="closed file"):
        f.__enter__()
    with pytest.raises(ValueError, match="closed file"):
        next(iter(f))


def test_a_file_dropped_unclosed_lets_go_of_its_copy(cache: tierstore.Cache, source: Path) -> None:
    import gc

    p = source / "d"
    p.write_bytes(b"abc")
    cache.open(p).read()
    cache.wait()
    f = cache.open(p)
    assert f.backing == "tier"
    held = f"/proc/self/fd/{f.fileno()}"
    copy = os.readlink(held)
    assert copy != str(p) and Path(copy).read_bytes() == b"abc"
    del f
    gc.collect()
    assert not os.path.exists(held) or os.readlink(held) != copy  # its descriptor of the copy is closed


def test_it_is_an_io_raw_file_with_a_files_answers(cache: tierstore.Cache, source: Path) -> None:
    p = source / "r"
    p.write_bytes(b"abc\ndef")
    with cache.open(p) as f:
        assert isinstance(f, io.RawIOBase) and isinstance(f, io.IOBase)
        assert f.name == str(p) and f.mode == "rb" and f.size == 7
        assert f.readable() and f.seekable() and not f.writable() and not f.isatty()
        assert f.flush() is None
        assert f.read(None) == b"abc\ndef" and f.read() == b""
        f.seek(0)
        assert f.readall() == b"abc\ndef"
        f.seek(0)
        assert f.readlines(2) == [b"abc\n"] and f.readline(None) == b"def"
        assert repr(f) == f"<tierstore.CachedFile name={str(p)!r} backing={f.backing}>"
        for write in (lambda: f.write(b"x"), lambda: f.writelines([b"x"]), f.truncate):
            with pytest.raises(io.UnsupportedOperation, match="open for reading only"):
                write()
    assert repr(f).endswith("backing=closed>")
    with pytest.raises(ValueError, match="closed file"):
        f.write(b"x")
    with pytest.raises(ValueError, match="closed file"):
        f.flush()
    with cache.open(os.fsencode(p)) as f:  # a bytes path is named as os.fsdecode spells it
        assert f.name == str(p)


def test_text_mode_and_refused_write_modes(cache: tierstore.Cache, source: Path) -> None:
    p = source / "t.txt"
    p.write_text("héllo\nwörld\n", encoding="utf-8")
    with cache.open(p, "r", encoding="utf-8") as f:
        assert f.read() == "héllo\nwörld\n"
    with pytest.raises(ValueError, match="reads only"):
        cache.open(p, "wb")


def test_errors_say_what_is_wrong(cache: tierstore.Cache, source: Path) -> None:
    with pytest.raises(tierstore.OutsideSourceError, match="outside the cached source"):
        cache.open("/etc/hostname")
    with pytest.raises(ValueError):  # OutsideSourceError is a ValueError too
        cache.open(source / ".." / "elsewhere")
    with pytest.raises(FileNotFoundError) as e:
        cache.open(source / "missing.bin")
    assert e.value.filename == str(source / "missing.bin")
    (source / "dir").mkdir()
    with pytest.raises(IsADirectoryError):
        cache.open(source / "dir")


def test_relative_paths_are_taken_from_the_current_directory(
    cache: tierstore.Cache, source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (source / "sub").mkdir()
    (source / "sub" / "r.bin").write_bytes(b"relative")
    monkeypatch.chdir(source / "sub")
    with cache.open("r.bin") as f:
        assert f.read() == b"relative"


def test_numpy_pickle_pil(cache: tierstore.Cache, source: Path) -> None:
    from PIL import Image

    arr = np.arange(10000, dtype=np.float32).reshape(100, 100)
    np.save(source / "a.npy", arr)
    (source / "o.pkl").write_bytes(pickle.dumps({"k": [1, 2, 3]}))
    rgb = (np.arange(64 * 48 * 3) % 256).astype(np.uint8).reshape(48, 64, 3)
    Image.fromarray(rgb).save(source / "i.png")
    for _ in range(2):
        with cache.open(source / "a.npy") as f:
            np.testing.assert_array_equal(np.load(f), arr)
        with cache.open(source / "o.pkl") as f:
            assert pickle.load(f) == {"k": [1, 2, 3]}
        with cache.open(source / "i.png") as f, Image.open(f) as im:
            np.testing.assert_array_equal(np.asarray(im), rgb)
        cache.wait()


def test_torch_load(cache: tierstore.Cache, source: Path) -> None:
    torch = pytest.importorskip("torch")
    state = {"w": torch.randn(64, 32), "b": torch.arange(10)}
    torch.save(state, source / "m.pt")
    for _ in range(2):
        with cache.open(source / "m.pt") as f:
            loaded = torch.load(f)
        assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"])
        cache.wait()


def test_h5py_file(cache: tierstore.Cache, source: Path) -> None:
    h5py = pytest.importorskip("h5py")
    data = np.random.default_rng(0).normal(size=(200, 50))
    with h5py.File(source / "d.h5", "w") as h:
        h["x"] = data
        h["g/y"] = np.arange(7)
    for _ in range(2):
        with cache.open(source / "d.h5") as f, h5py.File(f, "r") as h:
            np.testing.assert_array_equal(h["x"][...], data)
            np.testing.assert_array_equal(h["g/y"][...], np.arange(7))
        cache.wait()


def test_module_level_helpers_use_the_configured_default(source: Path, tier: str) -> None:
    (source / "m.bin").write_bytes(b"module level")
    tierstore.configure(source=source, tiers=[f"{tier}:1M"])
    with tierstore.open(source / "m.bin") as f:
        assert f.read() == b"module level"
    assert tierstore.stats()["source"]["opens"] == 1


def test_default_cache_reads_the_environment(
    source: Path, tier: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (source / "e.bin").write_bytes(b"from env")
    monkeypatch.setenv("TIERSTORE_SOURCE", str(source))
    monkeypatch.setenv("TIERSTORE_TIERS", f"{tier}:2M")
    with tierstore.open(source / "e.bin") as f:
        assert f.read() == b"from env"
    cfg = tierstore.default_cache().config()
    assert cfg["tiers"][1] == "$TIERSTORE_TIERS" and cfg["tiers"][0][0]["quota"] == 2 << 20


def test_a_close_from_another_thread_waits_for_a_read_in_progress(source: Path, shm_dir: Path) -> None:
    """A read holds the file's lock without the GIL; a close from another thread, which holds the GIL,
    must give it up while it waits, or the reader could never take it back (a deadlock before 2026-12-04)."""
    import threading
    import time

    data = content(3, 48 << 20)
    p = source / "large.bin"
    p.write_bytes(data)
    big = tierstore.Cache(source, [f"{shm_dir / 'big'}:256M"])
    with big.open(p) as f:
        f.read()
    big.wait()

    def read(f: Any, got: list[Any]) -> None:
        try:
            got.append(f.read())
        except ValueError as e:  # closed before the read took the lock
            got.append(e)

    for _ in range(5):
        f = big.open(p)
        got: list[Any] = []
        reader = threading.Thread(target=read, args=(f, got))
        reader.start()
        time.sleep(0.002)
        f.close()
        reader.join(20)
        assert not reader.is_alive(), "the read and the close deadlocked"
        assert f.closed
        assert got and (got[0] == data or isinstance(got[0], ValueError))
