"""One consistent view of a cached file under `tierstore run`: `stat`, `lstat`, `statx` and `fstat` of the
descriptor an open returns all describe the source's file, so programs that compare them (cp, tar,
rsync) work; and with `revalidate = "never"`, or within the default duration, a warm cache answers every
one of them, and `realpath` and `readlink`, without asking the store."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers.cli import tierstore_run
from tests.helpers.data import content
from tests.helpers.stores import store_stats

FIELDS = (
    "st_dev",
    "st_ino",
    "st_mode",
    "st_nlink",
    "st_uid",
    "st_gid",
    "st_size",
    "st_mtime_ns",
    "st_ctime_ns",
)

# Stats every way a program can, and reports each answer's fields (and the bytes' length).
VIEWS = textwrap.dedent(
    """
    import json, os, sys
    FIELDS = json.loads(os.environ["FIELDS"])
    out = {}
    for p in sys.argv[1:]:
        views = {"stat": os.stat(p), "lstat": os.lstat(p)}
        with open(p, "rb") as f:
            views["fstat"] = os.fstat(f.fileno())
            n = len(f.read())
            views["fstat after read"] = os.fstat(f.fileno())
        out[p] = {k: [getattr(v, a) for a in FIELDS] for k, v in views.items()}
        out[p]["read"] = n
        out[p]["realpath"] = os.path.realpath(p)
    print(json.dumps(out))
    """
)


def run_views(mount: Path, tier: str, tmp_path: Path, paths: list[Path], revalidate: str) -> dict:
    job = tmp_path / "views.py"
    job.write_text(VIEWS)
    env = {**os.environ, "FIELDS": json.dumps(FIELDS)}
    p = tierstore_run(mount, tier, sys.executable, str(job), *map(str, paths), revalidate=revalidate, env=env)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    return json.loads(out)


@pytest.mark.parametrize("revalidate", ["always", "never"])
def test_stat_lstat_and_fstat_of_a_cached_file_describe_the_source_file(
    slow_store: tuple[Path, Path], tier: str, tmp_path: Path, revalidate: str
) -> None:
    backing, mount = slow_store
    (backing / "d").mkdir()
    (backing / "d" / "small.bin").write_bytes(content(1, 10_000))
    (backing / "d" / "large.bin").write_bytes(content(2, 12 << 20))  # above inline_max: streamed
    paths = [mount / "d" / "small.bin", mount / "d" / "large.bin"]
    direct = {str(p): [getattr(os.stat(p), a) for a in FIELDS] for p in paths}
    for attempt in ("cold", "warm"):
        seen = run_views(mount, f"{tier}:256M", tmp_path, paths, revalidate)
        for p in paths:
            views = seen[str(p)]
            assert views["read"] == p.stat().st_size
            assert views["realpath"] == str(p)
            for kind in ("stat", "lstat", "fstat", "fstat after read"):
                assert views[kind] == direct[str(p)], f"{attempt} {kind} of {p.name} is not the source's"
    # And so the tools that compare them work: cp and tar exit 0 with the same bytes.
    copy = tmp_path / "copy.bin"
    p = tierstore_run(mount, f"{tier}:256M", "cp", str(paths[1]), str(copy), revalidate=revalidate)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert copy.read_bytes() == (backing / "d" / "large.bin").read_bytes()
    p = tierstore_run(
        mount,
        f"{tier}:256M",
        "tar",
        "cf",
        str(tmp_path / "d.tar"),
        "-C",
        str(mount),
        "d",
        revalidate=revalidate,
    )
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err


# Files on the tier's device that are no copy: a file beside the tier, and the same file once unlinked (what
# a DataLoader's batches arrive in: torch's shared memory, unlinked files of /dev/shm).
BESIDE = textwrap.dedent(
    """
    import json, os, sys
    with open(sys.argv[1], "rb") as f:
        f.read()  # the cache is open in this process from here on
    own = os.path.join(sys.argv[2], "beside.bin")
    with open(own, "wb") as f:
        f.write(b"x" * 1234)
    fd = os.open(own, os.O_RDONLY)
    named = os.fstat(fd)
    os.unlink(own)
    gone = os.fstat(fd)
    os.close(fd)
    print(json.dumps({"named": [named.st_ino, named.st_size, named.st_nlink],
                      "gone": [gone.st_ino, gone.st_size, gone.st_nlink]}))
    """
)


def test_fstat_of_other_files_on_the_tiers_device_is_their_own(
    slow_store: tuple[Path, Path], tier: str, tmp_path: Path
) -> None:
    backing, mount = slow_store
    (backing / "a.bin").write_bytes(content(3, 5_000))
    beside = Path(tier).parent / "beside"
    beside.mkdir()
    assert os.stat(beside).st_dev == os.stat(Path(tier).parent).st_dev
    job = tmp_path / "beside.py"
    job.write_text(BESIDE)
    p = tierstore_run(mount, f"{tier}:64M", sys.executable, str(job), str(mount / "a.bin"), str(beside))
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    seen = json.loads(out)
    ino = seen["named"][0]
    assert seen["named"] == [ino, 1234, 1]
    assert seen["gone"] == [ino, 1234, 0], "an unlinked file on the tier's device must report itself"


# A cached file's descriptor number ended every way a program ends one, then taken by another file: its
# `fstat` must describe the new file. (The shim answers the `fstat` of the copy a thread just opened
# without the kernel, only while no descriptor of the process was ended since: tierstore_core's
# cache/copy_stats.rs.) stdio's `fclose` and `close_range` end the descriptor inside glibc, where the
# shim's `close` does not see it.
REUSED = textwrap.dedent(
    """
    import ctypes, json, os, sys, threading
    cached, other = sys.argv[1], sys.argv[2]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fdopen.restype = ctypes.c_void_p
    for _ in range(2):  # the cache is open, and has been asked an `fstat`, from here on
        with open(cached, "rb") as f:
            os.fstat(f.fileno()); f.read()

    def by_close(fd): os.close(fd)
    def by_another_thread(fd):  # the slot is the opening thread's; the count is the process's
        t = threading.Thread(target=os.close, args=(fd,)); t.start(); t.join()
    def by_fclose(fd): assert libc.fclose(ctypes.c_void_p(libc.fdopen(fd, b"rb"))) == 0
    def by_close_range(fd): assert libc.close_range(fd, fd, 0) == 0, ctypes.get_errno()
    def onto(dup):
        def end(fd):
            o = os.open(other, os.O_RDONLY)
            dup(o, fd)
            os.close(o)
        return end
    ends = {"close": by_close, "close on another thread": by_another_thread, "fclose": by_fclose, "close_range": by_close_range,
            "dup2": onto(lambda o, fd: libc.dup2(o, fd)), "dup3": onto(lambda o, fd: libc.dup3(o, fd, 0))}
    out = {}
    for name, end in ends.items():
        fd = os.open(cached, os.O_RDONLY)
        before = os.fstat(fd)
        end(fd)
        again = fd if name.startswith("dup") else os.open(other, os.O_RDONLY)
        after = os.fstat(again)
        out[name] = [again == fd, before.st_size, after.st_size, after.st_ino, os.read(again, 10).decode()]
        os.close(again)
    print(json.dumps(out))
    """
)


def test_a_descriptor_number_of_a_cached_file_used_again_describes_its_new_file(
    slow_store: tuple[Path, Path], tier: str, tmp_path: Path
) -> None:
    backing, mount = slow_store
    (backing / "a.bin").write_bytes(content(4, 5_000))
    other = tmp_path / "other.txt"
    other.write_text("other file")
    job = tmp_path / "reused.py"
    job.write_text(REUSED)
    for attempt in ("cold", "warm"):
        p = tierstore_run(mount, f"{tier}:64M", sys.executable, str(job), str(mount / "a.bin"), str(other))
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        for end, (same_number, before, after, ino, head) in json.loads(out).items():
            assert same_number, f"{attempt}, {end}: the number was not used again, so nothing was tested"
            assert before == 5_000, f"{attempt}, {end}: the cached file's fstat is not the source's"
            assert (after, ino, head) == (10, other.stat().st_ino, "other file"), (
                f"{attempt}, after {end}: fstat of the descriptor described the cached file, not the new one"
            )


# A per-sample reader's metadata calls: what libhdf5, numpy and Python's path helpers ask of a file.
PER_SAMPLE = textwrap.dedent(
    """
    import ctypes, errno, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    libc.realpath.restype = ctypes.c_char_p
    for p in sys.argv[1:]:
        os.stat(p); os.lstat(p); os.path.exists(p); os.path.isfile(p); os.access(p, os.R_OK)
        assert os.path.realpath(p) == p, os.path.realpath(p)
        assert libc.realpath(p.encode(), None) == p.encode()
        buf = ctypes.create_string_buffer(256)
        assert libc.readlink(p.encode(), buf, 256) == -1 and ctypes.get_errno() == errno.EINVAL
        with open(p, "rb") as f:
            os.fstat(f.fileno()); f.read()
        os.stat(os.path.dirname(p)); os.lstat(os.path.dirname(p))
    print("ok")
    """
)


@pytest.mark.parametrize("revalidate", ["never", None], ids=["never", "default"])
def test_a_warm_trusted_cache_asks_the_store_nothing(
    slow_store: tuple[Path, Path], tier: str, tmp_path: Path, revalidate: str | None
) -> None:
    """A second run of a per-sample reader's metadata calls and reads sends the store nothing, with
    `revalidate = "never"` and with the default (`"60s"`: the first run's records are younger)."""
    backing, mount = slow_store
    paths = []
    for i in range(20):
        p = backing / f"c{i % 3}" / f"{i}.bin"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(content(i, 5000))
        paths.append(str(mount / p.relative_to(backing)))
    job = tmp_path / "per_sample.py"
    job.write_text(PER_SAMPLE)
    for _ in ("cold", "warm"):
        before = store_stats(mount)
        p = tierstore_run(mount, f"{tier}:64M", sys.executable, str(job), *paths, revalidate=revalidate)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and out.strip() == "ok", err
        sent = {op: n - before.get(op, 0) for op, n in store_stats(mount).items() if n != before.get(op, 0)}
    assert sent == {}, f"a warm pass sent operations to the store: {sent}"


def test_past_the_duration_a_warm_run_asks_the_store_again_and_sees_a_change(
    slow_store: tuple[Path, Path], tier: str, tmp_path: Path
) -> None:
    """With `revalidate = "2s"`, a run within 2 s of the last answers asks the store nothing; one after
    that `stat`s and lists the store again, and sees a file added meanwhile and a file's new size."""
    backing, mount = slow_store
    (backing / "d").mkdir()
    for i in range(5):
        (backing / "d" / f"{i}.bin").write_bytes(content(i, 1000))
    job = tmp_path / "look.py"
    job.write_text(
        "import json, os, sys\n"
        "d = sys.argv[1]\n"
        "names = sorted(os.listdir(d))\n"
        "sizes = {n: os.stat(os.path.join(d, n)).st_size for n in names}\n"
        "for n in names:\n"
        "    open(os.path.join(d, n), 'rb').read()\n"
        "print(json.dumps([os.stat(d).st_mode, sizes]))\n"
    )

    def run() -> tuple[list, dict[str, int]]:
        before = store_stats(mount)
        p = tierstore_run(mount, f"{tier}:64M", sys.executable, str(job), str(mount / "d"), revalidate="2s")
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        sent = {op: n - before.get(op, 0) for op, n in store_stats(mount).items() if n != before.get(op, 0)}
        return json.loads(out), sent

    first, _ = run()
    again, sent = run()
    assert again == first and sent == {}, f"within the duration the store was asked: {sent}"
    (backing / "d" / "new.bin").write_bytes(b"added")
    (backing / "d" / "0.bin").write_bytes(content(0, 1500))
    time.sleep(4.2)  # past twice the duration: the reader's open confirms too
    (_, sizes), sent = run()
    assert sizes["new.bin"] == 5 and sizes["0.bin"] == 1500, sizes
    assert sent.get("readdir", 0) >= 1 and sent.get("getattr", 0) >= 1, sent


@pytest.mark.parametrize("revalidate", ["never", None], ids=["never", "default"])
def test_symlinks_inside_the_source_are_still_reported_as_symlinks(
    slow_store: tuple[Path, Path], tier: str, tmp_path: Path, revalidate: str | None
) -> None:
    """A link and its target read the target's bytes, and the link is reported as a link. With
    `revalidate = "never"`, where an open of the link is served its target's copy, a warm run asks the
    store nothing."""
    backing, mount = slow_store
    (backing / "real.bin").write_bytes(b"x" * 100)
    (backing / "link.bin").symlink_to("real.bin")
    script = textwrap.dedent(
        """
        import json, os, stat, sys
        link, real = sys.argv[1], sys.argv[2]
        same = open(link, "rb").read() == open(real, "rb").read() == b"x" * 100
        print(json.dumps([stat.S_ISLNK(os.lstat(link).st_mode), os.readlink(link), os.path.realpath(link),
                          os.stat(link).st_ino == os.stat(real).st_ino, same]))
        """
    )
    for run in ("cold", "warm"):
        before = store_stats(mount)
        p = tierstore_run(
            mount,
            f"{tier}:64M",
            sys.executable,
            "-c",
            script,
            str(mount / "link.bin"),
            str(mount / "real.bin"),
            revalidate=revalidate,
        )
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert json.loads(out) == [True, "real.bin", str(mount / "real.bin"), True, True]
        sent = {op: n - before.get(op, 0) for op, n in store_stats(mount).items() if n != before.get(op, 0)}
        if run == "warm" and revalidate == "never":
            assert sent == {}, f"a warm run through the link sent operations to the store: {sent}"


def test_a_source_reached_through_a_symlinked_path_is_cached(
    slow_store: tuple[Path, Path], tier: str, tmp_path: Path
) -> None:
    """The source configured by a path through a symlink: programs using either spelling are served."""
    backing, mount = slow_store
    (backing / "a.bin").write_bytes(b"a" * 1000)
    alias = tmp_path / "dataset"
    alias.symlink_to(mount)
    for name in (alias, mount):
        p = tierstore_run(alias, f"{tier}:64M", "cat", str(name / "a.bin"))
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0 and out == "a" * 1000, err
    before = store_stats(mount)
    for name in (alias, mount):
        p = tierstore_run(alias, f"{tier}:64M", "cat", str(name / "a.bin"))
        assert p.communicate(timeout=60)[0] == "a" * 1000
    after = store_stats(mount)
    assert after.get("open", 0) == before.get("open", 0), "a warm read by either spelling opened the source"


READERS = textwrap.dedent(
    """
    import sys
    import h5py, numpy as np
    from PIL import Image
    for p in sys.argv[1:]:
        if p.endswith(".h5"):
            with h5py.File(p, "r") as f:
                assert f["records"][3].sum() > 0
        elif p.endswith(".npy"):
            assert np.load(p).shape == (64,)
        else:
            with Image.open(p) as im:
                assert im.load() is not None and im.size == (8, 8)
    print("ok")
    """
)


@pytest.mark.parametrize("revalidate", ["never", None], ids=["never", "default"])
def test_per_sample_h5py_numpy_and_pil_readers_ask_a_warm_cache_nothing(
    slow_store: tuple[Path, Path], tier: str, tmp_path: Path, revalidate: str | None
) -> None:
    import h5py
    import numpy as np
    from PIL import Image

    backing, mount = slow_store
    (backing / "s").mkdir()
    for i in range(8):
        with h5py.File(backing / "s" / f"{i}.h5", "w") as f:
            f["records"] = np.arange(1, 10 * 16 + 1, dtype=np.float32).reshape(10, 16) + i
        np.save(backing / "s" / f"{i}.npy", np.arange(64) + i)
        Image.new("RGB", (8, 8), (i, 2 * i, 3 * i)).save(backing / "s" / f"{i}.png")
    paths = sorted(str(mount / "s" / p.name) for p in (backing / "s").iterdir())
    job = tmp_path / "readers.py"
    job.write_text(READERS)
    for _ in ("cold", "warm"):
        before = store_stats(mount)
        p = tierstore_run(mount, f"{tier}:64M", sys.executable, str(job), *paths, revalidate=revalidate)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and out.strip() == "ok", err
        sent = {op: n - before.get(op, 0) for op, n in store_stats(mount).items() if n != before.get(op, 0)}
    assert sent == {}, f"a warm pass of h5py, numpy.load and PIL sent operations to the store: {sent}"
