"""When a cached copy is checked against the store, and what that costs the store, on the stand-in parallel
file system (whose own counters are the ground truth): one open per cold file in every `revalidate` mode
and whatever the number of processes reading it at once; `"always"` one `stat` per open of a warm file;
`"<duration>"` one directory read and a `stat` per file per directory and duration, with a change on the
store seen within the duration."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import time
from pathlib import Path

import pytest

import tierstore
from tests.helpers.data import content
from tests.helpers.stores import mounted_store, store_stats


def _read_at_once(args: tuple[str, str, list[str], str, object]) -> str:
    mount, tier, paths, revalidate, start = args
    cache = tierstore.Cache(mount, [tier], revalidate=revalidate)
    start.wait()  # type: ignore[attr-defined]
    digest = hashlib.sha256()
    for p in paths:
        with cache.open(p) as f:
            digest.update(f.read())
    cache.wait()
    return digest.hexdigest()


@pytest.mark.fuse
@pytest.mark.parametrize("revalidate", ["always", "never", "30s"])
def test_processes_reading_the_same_cold_files_at_once_open_each_once(
    tmp_path: Path, tier: str, revalidate: str
) -> None:
    """Two processes read the same 30 cold files at the same moment, in the same order (the worst case
    for a race between them): the store sees one open per file, in every mode."""
    # 2 ms per metadata operation: the window in which two processes could both open a file is as wide
    # as an open on a loaded store.
    with mounted_store(tmp_path, meta_latency="2ms") as (backing, mount):
        names = []
        for i in range(30):
            (backing / f"{i:02d}.bin").write_bytes(content(i, 40_000 + i))
            names.append(f"{i:02d}.bin")
        # One large file too: its copy is followed by the process that fetches it, waited for by the other.
        (backing / "large.bin").write_bytes(content(99, 12 << 20))
        names.append("large.bin")
        before = store_stats(mount)
        spec = f"{tier}:1G"
        ctx = mp.get_context("spawn")
        with ctx.Manager() as manager:
            start = manager.Event()
            with ctx.Pool(2) as pool:
                pending = pool.map_async(
                    _read_at_once,
                    [(str(mount), spec, [str(mount / n) for n in names], revalidate, start)] * 2,
                )
                time.sleep(1.0)  # both processes are up and waiting
                start.set()
                digests = pending.get(timeout=120)
        expected = hashlib.sha256()
        for n in names:
            expected.update((backing / n).read_bytes())
        assert digests == [expected.hexdigest()] * 2
        after = store_stats(mount)
        assert after["open"] - before.get("open", 0) == len(names), (before, after)
        total = sum((backing / n).stat().st_size for n in names)
        assert after["bytes_read"] - before.get("bytes_read", 0) == total


@pytest.mark.fuse
def test_revalidate_within_a_duration_confirms_a_directory_at_once(tmp_path: Path, tier: str) -> None:
    """`revalidate = "2s"`: a copy confirmed within 2 s costs the store nothing; an older one is
    confirmed with the rest of its directory (one directory read and a `stat` per file, not per open),
    and a file changed on the store is served new once the duration has passed."""
    with mounted_store(tmp_path) as (backing, mount):
        (backing / "d").mkdir()
        files = {backing / "d" / f"{i:02d}.bin": content(i, 5000 + i) for i in range(40)}
        for p, b in files.items():
            p.write_bytes(b)
        cache = tierstore.Cache(mount, [f"{tier}:1G"], revalidate="2s")

        def epoch(cache: tierstore.Cache) -> dict[str, int]:
            before = store_stats(mount)
            for p in files:
                with cache.open(mount / "d" / p.name) as f:
                    assert f.read() == files[p], p
            after = store_stats(mount)
            return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}

        cold = epoch(cache)
        assert cold["open"] == len(files)
        cache.wait()
        assert epoch(cache) == {}, "copies confirmed within the duration cost the store nothing"
        changed = backing / "d" / "05.bin"
        changed.write_bytes(b"version two of five")
        files[changed] = b"version two of five"
        # What a `stat` of every file costs this store (the kernel looks each name up, then asks for its
        # attributes): the most a confirmation of the directory may cost besides reading it.
        before = store_stats(mount)
        for p in files:
            (mount / "d" / p.name).stat()
        stat_all = store_stats(mount)["getattr"] - before["getattr"]
        time.sleep(2.1)
        cache.reset_counters()
        warm = epoch(cache)
        # The directory read once, every file stat'ed once (in parallel), and the changed file opened.
        assert warm.get("readdir", 0) == 1, warm
        assert warm["open"] == 1, warm
        assert warm["getattr"] <= stat_all + 5, (warm, stat_all)
        s = cache.stats()["source"]
        assert (s["lists"], s["opens"]) == (1, 1), s
        assert len(files) <= s["stats"] <= len(files) + 2, s
        del cache  # its descriptor of the source's root would keep the store busy at unmount


@pytest.mark.fuse
def test_revalidate_always_costs_one_stat_per_warm_open_and_none_per_cold_one(
    tmp_path: Path, tier: str
) -> None:
    with mounted_store(tmp_path) as (backing, mount):
        for i in range(10):
            (backing / f"{i}.bin").write_bytes(content(i, 3000))
        cache = tierstore.Cache(mount, [f"{tier}:1G"], revalidate="always")
        for i in range(10):
            cache.open(mount / f"{i}.bin").read()
        cache.wait()
        s = cache.stats()["source"]
        assert s["opens"] == 10 and s["stats"] == 10, s  # the stat of the open descriptor, no stat before
        cache.reset_counters()
        for i in range(10):
            cache.open(mount / f"{i}.bin").read()
        s = cache.stats()["source"]
        assert (s["opens"], s["stats"]) == (0, 10), s
        del cache  # its descriptor of the source's root would keep the store busy at unmount


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("30", "a duration such as"),
        ("soon", "unknown revalidation mode"),
        ("0s", "unknown revalidation mode"),
    ],
)
def test_a_bad_revalidate_value_names_the_fix(source: Path, tier: str, value: str, message: str) -> None:
    with pytest.raises(tierstore.ConfigError, match=message):
        tierstore.Cache(source, [tier], revalidate=value)


def test_the_configured_mode_is_shown(source: Path, tier: str) -> None:
    cache = tierstore.Cache(source, [tier], revalidate="90s")
    assert cache.config()["revalidate"][0] == "90s"
