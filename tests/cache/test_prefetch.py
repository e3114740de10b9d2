"""`tierstore prefetch` and `Cache.prefetch` on the stand-in store: whole and identical copies, right
counts, failures reported by name while the rest lands, warm runs that ask the store nothing per file,
and clear errors for `--jobs`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tierstore
from tests.helpers.cli import cli, tierstore_run
from tests.helpers.data import make_files
from tests.helpers.stores import store_stats

DIRS = 6
FILES = 240  # make_files puts 50 per directory: 5 directories, plus one nested below


def build_tree(backing: Path) -> dict[Path, bytes]:
    """A tree under `backing/tree`: 240 files in 5 directories, one nested directory, one file of 3 MiB
    (larger than a copy chunk), and an empty directory. Keys are paths relative to `backing`."""
    tree = backing / "tree"
    files = make_files(tree, FILES, size=20_000)
    nested = tree / "f1" / "deeper" / "big.bin"
    nested.parent.mkdir()
    nested.write_bytes(os.urandom(3 << 20))
    files[nested] = nested.read_bytes()
    (tree / "empty").mkdir()
    return {p.relative_to(backing): b for p, b in files.items()}


def delta(after: dict[str, object], before: dict[str, object]) -> dict[str, int]:
    """The counts that grew from `before` to `after` (counters only; other fields left out)."""
    keys = {k for k, v in after.items() if isinstance(v, int)}
    return {k: int(after[k]) - int(before.get(k, 0)) for k in keys}  # type: ignore[call-overload]


def test_prefetch_caches_every_file_whole_and_identical(slow_store: tuple[Path, Path], tier: str) -> None:
    backing, mount = slow_store
    files = build_tree(backing)
    cache = tierstore.Cache(mount, [f"{tier}:1G"])
    before = store_stats(mount)
    r = cache.prefetch(mount / "tree", progress=False, jobs=8)
    ops = delta(store_stats(mount), before)
    total = sum(len(b) for b in files.values())
    assert r["files_total"] == r["files_done"] == r["files_copied"] == len(files) == FILES + 1
    assert r["bytes_total"] == r["bytes_done"] == total
    assert r["files_failed"] == 0 and r["first_error"] is None and r["errors"] == []
    # Every byte came from the store exactly once, one open per file.
    assert ops["bytes_read"] == total
    assert ops["open"] == len(files)
    for rel, expected in files.items():
        copy = cache.lookup(mount / rel, validate=False)
        assert copy is not None, rel
        assert Path(copy).read_bytes() == expected, rel
        with cache.open(mount / rel) as f:
            assert f.backing == "tier" and f.read() == expected


@pytest.mark.parametrize("revalidate", ["never", "always"])
def test_warm_prefetch_asks_the_store_only_what_revalidate_needs(
    slow_store: tuple[Path, Path], tier: str, revalidate: str
) -> None:
    backing, mount = slow_store
    files = build_tree(backing)
    cold = tierstore.Cache(mount, [f"{tier}:1G"]).prefetch(mount / "tree", progress=False)
    assert cold["files_copied"] == len(files)
    cache = tierstore.Cache(mount, [f"{tier}:1G"], revalidate=revalidate)
    before, own_before = store_stats(mount), cache.stats()["source"]
    r = cache.prefetch(mount / "tree", progress=False)
    ops = delta(store_stats(mount), before)
    own = delta(cache.stats()["source"], own_before)
    assert r["files_done"] == r["files_total"] == len(files)
    assert r["files_copied"] == 0 and r["files_failed"] == 0
    assert r["bytes_done"] == sum(len(b) for b in files.values())
    assert ops.get("read", 0) == 0 and ops.get("bytes_read", 0) == 0
    directories = DIRS + 2  # tree itself, 5 of make_files, f1/deeper, empty
    assert ops["readdir"] >= directories
    if revalidate == "never":
        # Directory work only (a listing, and the lookups and attributes of opening each directory):
        # nothing per file.
        assert ops.get("open", 0) == 0
        assert ops.get("getattr", 0) <= 5 * directories, ops
        assert own["stats"] <= directories  # of directories, whose type a FUSE listing does not give
    else:
        # One stat per file, and no open. On this store (no attribute or entry caching) a stat costs a
        # lookup of the name and then its attributes.
        assert ops.get("open", 0) == 0
        assert len(files) <= own["stats"] <= len(files) + directories
        assert len(files) <= ops.get("getattr", 0) <= 3 * len(files) + 5 * directories, ops


def test_a_failed_file_is_named_and_the_others_land(slow_store: tuple[Path, Path], tier: str) -> None:
    backing, mount = slow_store
    files = build_tree(backing)
    tree = backing / "tree"
    # A name the listing shows whose file is gone (as one removed between the listing and the open).
    (tree / "f2" / "gone.bin").symlink_to(tree / "nowhere.bin")
    # A file larger than the tier's quota.
    (tree / "huge.bin").write_bytes(os.urandom(13 << 20))
    r = cli(
        "--source",
        str(mount),
        "--tier",
        f"{tier}:12M",
        "prefetch",
        "--no-progress",
        "--jobs",
        "4",
        str(mount / "tree"),
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    gone = mount / "tree" / "f2" / "gone.bin"
    assert f"error: {gone}: vanished during the prefetch" in r.stderr
    assert f"error: {mount / 'tree' / 'huge.bin'}: not cached, no tier has room" in r.stderr
    assert "raise a tier's quota" in r.stderr
    # The 3 MiB file and the small ones fit in 12 MiB together: every one of them landed.
    assert f"prefetched {len(files) + 2} files" in r.stdout
    assert f"{len(files)} copied, 0 already cached, 2 not cached" in r.stdout
    cache = tierstore.Cache(mount, [f"{tier}:12M"])
    for rel, expected in files.items():
        copy = cache.lookup(mount / rel, validate=False)
        assert copy is not None and Path(copy).read_bytes() == expected, rel


def test_an_unlistable_directory_is_named_and_the_rest_lands(source: Path, tier: str) -> None:
    files = make_files(source, 100, size=1000)
    closed = source / "closed"
    closed.mkdir()
    (closed / "x.bin").write_bytes(b"x")
    closed.chmod(0)
    try:
        if os.access(closed, os.R_OK):
            pytest.skip("running as root: a directory without permissions is still readable")
        r = tierstore.Cache(source, [f"{tier}:64M"]).prefetch(source, progress=False)
    finally:
        closed.chmod(0o755)
    assert r["files_copied"] == len(files) and r["files_failed"] == 1
    # The directory counts as one failed entry, so that done = copied + already cached + failed.
    assert r["files_done"] == r["files_total"] == len(files) + 1
    assert r["errors"][0].startswith(f"{closed}: ") and "were not prefetched" in r["errors"][0]


@pytest.mark.parametrize("jobs", [0, -1, 1025, True, 2.5, "8"])
def test_jobs_out_of_range_is_a_clear_error(source: Path, tier: str, jobs: object) -> None:
    cache = tierstore.Cache(source, [f"{tier}:1M"])
    with pytest.raises(ValueError, match="give the number of files to fetch at once, a whole number from 1"):
        cache.prefetch(source, jobs=jobs)  # type: ignore[arg-type]


def test_cli_jobs_errors_say_what_to_give(source: Path, tier: str) -> None:
    base = ["--source", str(source), "--tier", f"{tier}:1M", "prefetch", "--no-progress"]
    r = cli(*base, "--jobs", "0", str(source))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--jobs" in r.stderr and "whole number from 1 to 1024" in r.stderr
    r = cli(*base, "--jobs", "many", str(source))
    assert r.returncode == 2 and "'many' is not a valid integer" in r.stderr
    (source / "a.bin").write_bytes(b"abc")
    r = cli(*base, "-j", "1", str(source))
    assert r.returncode == 0 and "prefetched 1 files" in r.stdout


def landed(started: object, within: float = 60) -> dict[str, object]:
    """The progress of a `_core.Prefetch` once it has ended."""
    deadline = time.monotonic() + within
    while not started.done:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the prefetch did not end"
        time.sleep(0.01)
    return started.progress()  # type: ignore[attr-defined,no-any-return]


def test_a_file_of_an_expected_size_gets_room_held_before_it_is_opened(
    slow_store: tuple[Path, Path], tier: str
) -> None:
    # The shard read-ahead names each shard with the size it expects: room is held for it, then the
    # file opened, and the copy takes the held room. A tier without that room leaves it unopened.
    backing, mount = slow_store
    size = 100_000
    for name in ("a", "b", "c"):
        (backing / name).write_bytes(os.urandom(size))
    cache = tierstore.Cache(str(mount), [f"{tier}:{2 * size}B"])
    with cache.open(mount / "c") as f:  # half the tier: the hold fills it, and the copy must take its place
        f.read()
    p = landed(cache._core.prefetch_files([str(mount / "a")], 1, size))
    assert (p["files_copied"], p["files_failed"], p["files_no_room"]) == (1, 0, 0), p
    used = cache.stats()["tiers"][0]
    assert (used["bytes_used"], used["in_flight"]) == (2 * size, 0), used  # no hold left behind
    # Full: the next file is left to its reader, unopened, and not a failure.
    before = store_stats(mount)
    p = landed(cache._core.prefetch_files([str(mount / "b")], 1, size))
    assert (p["files_copied"], p["files_failed"], p["files_no_room"]) == (0, 0, 1), p
    assert delta(store_stats(mount), before).get("open", 0) == 0
    # Without an expected size it is opened, then found to have no room: a failure that names the fix.
    before = store_stats(mount)
    p = landed(cache._core.prefetch_files([str(mount / "b")], 1))
    assert (p["files_failed"], p["files_no_room"]) == (1, 0), p
    assert "no tier has room" in str(p["first_error"])
    assert delta(store_stats(mount), before).get("open", 0) == 1
    assert cache.stats()["tiers"][0]["in_flight"] == 0


# Holds a file open that no tier has room for, until told to close it, then lives on until told to end.
HOLD_THROUGH_CACHE = """
import sys, tierstore
f = tierstore.Cache(sys.argv[1], [sys.argv[2]]).open(sys.argv[3])
f.read(10)
print("open", flush=True)
sys.stdin.readline()
f.close()
print("closed", flush=True)
sys.stdin.readline()
"""
HOLD_NATIVE = """
import os, sys
fd = os.open(sys.argv[3], os.O_RDONLY)
os.read(fd, 10)
print("open", flush=True)
sys.stdin.readline()
os.close(fd)
print("closed", flush=True)
sys.stdin.readline()
"""

# The same, closing through stdio: a stream `fdopen` made of the descriptor, ended by `fclose` (which closes
# the descriptor inside glibc, by its own `close`).
HOLD_FCLOSE = HOLD_NATIVE.replace(
    "os.close(fd)",
    "import ctypes; libc = ctypes.CDLL(None); libc.fdopen.restype = ctypes.c_void_p; "
    "assert libc.fclose(ctypes.c_void_p(libc.fdopen(fd, b'rb'))) == 0",
)


def full_tier(backing: Path, mount: Path, tier: str, size: int) -> tuple[tierstore.Cache, str]:
    """A cache whose tier holds two files of `size`, a and c, and is full; files b and d are not in it."""
    for name in ("a", "b", "c", "d"):
        (backing / name).write_bytes(os.urandom(size))
    spec = f"{tier}:{2 * size}B"
    cache = tierstore.Cache(str(mount), [spec])
    for name in ("a", "c"):
        with cache.open(mount / name) as f:
            f.read()
    cache.wait()  # their copies are written
    return cache, spec


def holding_open(mount: Path, spec: str, name: str, holder: str = "Cache.open") -> subprocess.Popen[str]:
    """A process that has opened `name` through `holder` (`Cache.open`, or a program under `tierstore
    run`, which closes with `close` or, for "tierstore run, fclose", through stdio) and holds it: it closes
    the file at a line on its stdin, says "closed", and ends at the next."""
    args = [str(mount), spec, str(mount / name)]
    if holder == "Cache.open":
        reader = subprocess.Popen(
            [sys.executable, "-c", HOLD_THROUGH_CACHE, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
    else:
        script = HOLD_FCLOSE if holder.endswith("fclose") else HOLD_NATIVE
        reader = tierstore_run(mount, spec, sys.executable, "-c", script, *args)
    assert reader.stdout is not None
    if reader.stdout.readline().strip() != "open":
        reader.kill()
        raise AssertionError(f"{holder} did not open {name}")
    return reader


@pytest.mark.parametrize("holder", ["Cache.open", "tierstore run", "tierstore run, fclose"])
def test_a_file_a_reader_reads_from_the_store_is_not_prefetched_until_it_closes(
    slow_store: tuple[Path, Path], tier: str, holder: str
) -> None:
    # A reader whose fetch found no room reads the file from the store. Room let go of afterwards (the
    # shard read-ahead lets go of passed shards) must not send a prefetch to read the same bytes again
    # while that reader has them: the reader's mark keeps the prefetch off until it closes the file.
    backing, mount = slow_store
    size = 100_000
    cache, spec = full_tier(backing, mount, tier, size)
    reader = holding_open(mount, spec, "b", holder)
    try:
        assert reader.stdout is not None and reader.stdin is not None
        assert cache._core.let_go(str(mount / "a"))  # room for one now
        before = store_stats(mount)
        p = landed(cache._core.prefetch_files([str(mount / "b")], 1, size))
        assert (p["files_copied"], p["files_failed"]) == (0, 0), p
        assert delta(store_stats(mount), before).get("open", 0) == 0  # b was not opened a second time
        assert cache._core.lookup(str(mount / "b"), False) is None
        reader.stdin.write("\n")
        reader.stdin.flush()
        assert reader.stdout.readline().strip() == "closed"  # closed, and the process still lives
        p = landed(cache._core.prefetch_files([str(mount / "b")], 1, size))
        assert (p["files_copied"], p["files_failed"]) == (1, 0), p
    finally:
        reader.kill()
        reader.wait(timeout=30)


def test_readers_from_the_store_in_this_process_keep_its_own_prefetch_off_counted_per_open(
    slow_store: tuple[Path, Path], tier: str
) -> None:
    backing, mount = slow_store
    size = 100_000
    cache, _ = full_tier(backing, mount, tier, size)
    with cache.open(mount / "d") as first, cache.open(mount / "d") as second:
        assert first.read() == second.read() == (backing / "d").read_bytes()
        assert cache._core.let_go(str(mount / "a"))
        first.close()
        p = landed(cache._core.prefetch_files([str(mount / "d")], 1, size))
        assert (p["files_copied"], p["files_failed"]) == (0, 0), p  # the second reader's mark
    p = landed(cache._core.prefetch_files([str(mount / "d")], 1, size))
    assert (p["files_copied"], p["files_failed"]) == (1, 0), p


def test_a_reader_killed_while_it_reads_from_the_store_leaves_no_mark(
    slow_store: tuple[Path, Path], tier: str
) -> None:
    # The kernel ends a killed reader's record locks, its store-read mark among them: the next prefetch
    # copies the file.
    backing, mount = slow_store
    size = 100_000
    cache, spec = full_tier(backing, mount, tier, size)
    reader = holding_open(mount, spec, "b")
    try:
        assert cache._core.let_go(str(mount / "a"))
        p = landed(cache._core.prefetch_files([str(mount / "b")], 1, size))
        assert (p["files_copied"], p["files_failed"]) == (0, 0), p  # marked while the reader lives
        reader.kill()
        reader.wait(timeout=30)
        p = landed(cache._core.prefetch_files([str(mount / "b")], 1, size))
        assert (p["files_copied"], p["files_failed"]) == (1, 0), p
    finally:
        reader.kill()
        reader.wait(timeout=30)
