"""When a cached copy is checked against the store, and what that costs the store, on the stand-in parallel
file system (whose own counters are the ground truth): one open per cold file in every `revalidate` mode
and whatever the number of processes reading it at once; `"always"` one `stat` per open of a warm file;
`"<duration>"` one directory read and a `stat` per file per directory and duration, with a change on the
store served by the opens after its directory's confirmation: in the background from half the duration
on (the reader does not wait), on the reader's path past the duration."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import tierstore
from tests.helpers.data import content
from tests.helpers.stores import mounted_store, store_stats
from tests.helpers.wait import wait_for


def counted(cache: tierstore.Cache, counter: str, n: int) -> Callable[[], bool]:
    """Whether the cache's source counter `counter` has reached `n` (for `wait_for`)."""
    return lambda: cache.stats()["source"][counter] >= n


def reads(cache: tierstore.Cache, path: Path, expected: bytes) -> Callable[[], bool]:
    """Whether an open of `path` through the cache reads `expected` now (for `wait_for`)."""
    return lambda: cache.open(path).read() == expected


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
    """`revalidate = "2s"`: a copy confirmed within 1 s costs the store nothing; one older than 2 s is
    confirmed with the rest of its directory before it is served (one directory read and a `stat` per
    file, not per open), and a file changed on the store is served new."""
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
@pytest.mark.slow  # it waits out half of a 10 s duration: about 9 s
def test_a_copy_past_its_duration_is_served_while_its_directory_is_confirmed_in_the_background(
    tmp_path: Path, tier: str
) -> None:
    """Between half the duration and the duration after the last confirmation, a warm epoch is served
    from the copies at once while their directory is confirmed in the background (stale-while-revalidate):
    on a store whose every metadata operation takes 50 ms, the epoch is over before the confirmation's
    `stat`s are; the confirmation then shows the change, and the next open of the changed file serves it."""
    with mounted_store(tmp_path, meta_latency="50ms") as (backing, mount):
        (backing / "d").mkdir()
        files = {backing / "d" / f"{i:02d}.bin": content(i, 3000 + i) for i in range(8)}
        for p, b in files.items():
            p.write_bytes(b)
        cache = tierstore.Cache(mount, [f"{tier}:1G"], revalidate="10s")
        for p in files:
            assert cache.open(mount / "d" / p.name).read() == files[p]
        cache.wait()
        changed = backing / "d" / "05.bin"
        changed.write_bytes(b"version two of five")
        time.sleep(5.2)  # past half the duration for every copy, within it for the last one made
        before = store_stats(mount)
        for p in files:
            got = cache.open(mount / "d" / p.name).read()
            assert got in (files[p], b"version two of five") if p == changed else got == files[p], p
        during = store_stats(mount)
        stats_done = during.get("getattr", 0) - before.get("getattr", 0)
        assert stats_done < len(files), ("the reader waited for the confirmation", before, during)
        assert during.get("open", 0) == before.get("open", 0), "no copy was fetched again on the way"

        # The opens after the confirmation serve the new version; the directory was listed once.
        wait_for("the change", reads(cache, mount / "d" / "05.bin", b"version two of five"), 30)
        assert cache.open(mount / "d" / "06.bin").read() == files[backing / "d" / "06.bin"]
        assert cache.stats()["source"]["lists"] == 1
        del cache


@pytest.mark.fuse
def test_one_expired_directory_sends_every_expired_directory_to_be_confirmed_at_once(
    tmp_path: Path, tier: str
) -> None:
    """Past the duration, the first open waits for its own directory's confirmation, and every other
    directory with expired copies is confirmed in the background meanwhile: the rest of the epoch then
    costs the store nothing, each directory read once."""
    with mounted_store(tmp_path) as (backing, mount):
        files = {}
        for d in range(6):
            (backing / f"d{d}").mkdir()
            for i in range(5):
                files[f"d{d}/{i}.bin"] = content(10 * d + i, 2000 + i)
                (backing / f"d{d}/{i}.bin").write_bytes(files[f"d{d}/{i}.bin"])
        cache = tierstore.Cache(mount, [f"{tier}:1G"], revalidate="1s")
        for rel, data in files.items():
            assert cache.open(mount / rel).read() == data
        cache.wait()
        # Confirmed once by directory first (a fetch alone confirms the copy, not its directory).
        time.sleep(2.1)
        for rel in files:
            cache.open(mount / rel).read()
        wait_for("every directory confirmed", counted(cache, "lists", 6), 30)
        time.sleep(2.1)
        cache.reset_counters()
        assert cache.open(mount / "d0/0.bin").read() == files["d0/0.bin"]
        wait_for("the sweep of the others", counted(cache, "lists", 6), 30)
        wait_for("their stats", counted(cache, "stats", len(files)), 30)
        before = cache.stats()["source"]
        for rel, data in files.items():
            assert cache.open(mount / rel).read() == data
        after = cache.stats()["source"]
        assert after == before, (before, after)
        assert after["lists"] == 6 and after["opens"] == 0, after
        del cache


# The job of the test below: reads every file of its directories, pauses as it is told, and prints a
# marker line on stderr before each part (TIERSTORE_LOG=debug says on stderr what each open did).
_PAUSING_JOB = """
import json, sys, time
import tierstore

mount, tier, bound = sys.argv[1], sys.argv[2], float(sys.argv[3])
names = json.loads(sys.argv[4])
cache = tierstore.Cache(mount, [tier], revalidate=f"{bound:g}s")
lists = lambda: cache.stats()["source"]["lists"]

def epoch(part):
    print(f"=== {part}", file=sys.stderr, flush=True)
    for name, data in names.items():
        assert cache.open(f"{mount}/{name}").read() == data.encode(), name

epoch("cold")
cache.wait()
time.sleep(1.1 * bound)  # expired: each directory is listed as the pass reaches it
epoch("expired")
deadline = time.monotonic() + 30
while lists() < 3:
    assert time.monotonic() < deadline, "the directories were not confirmed"
    time.sleep(0.01)
before_pause = lists()
time.sleep(1.2 * bound)  # a pause longer than the duration
during_pause = lists() - before_pause
epoch("after a pause of 1.2 durations")
time.sleep(1.75 * bound)  # past the last round of the keeper, which stops a duration after the last read
stopped = lists()
time.sleep(0.6 * bound)  # nothing read for 2.35 durations: the keeper has stopped, the copies expired
print(json.dumps({"during_pause": during_pause, "after_stop": lists() - stopped}), flush=True)
epoch("after the keeper stopped")
"""


@pytest.mark.fuse
@pytest.mark.slow  # it pauses for 4.65 durations of 1.5 s in all: about 8 s
def test_a_reader_that_pauses_for_longer_than_the_duration_finds_its_copies_confirmed(
    tmp_path: Path, tier: str
) -> None:
    """While a process reads, its keeper renews the confirmations that fall due, so a pass after a pause
    longer than the duration is served from the copies without waiting for the store; a duration after
    the process last read, the keeper stops, and a pass after that waits for its directory again."""
    with mounted_store(tmp_path, meta_latency="2ms") as (backing, mount):
        names = {}
        for d in range(3):
            (backing / f"d{d}").mkdir()
            for i in range(4):
                names[f"d{d}/{i}.bin"] = f"file {i} of directory {d}" * (d + 1)
                (backing / f"d{d}/{i}.bin").write_text(names[f"d{d}/{i}.bin"])
        p = subprocess.run(
            [sys.executable, "-c", _PAUSING_JOB, str(mount), f"{tier}:1G", "1.5", json.dumps(names)],
            capture_output=True, text=True, timeout=120, env={**os.environ, "TIERSTORE_LOG": "debug"},
        )  # fmt: skip
        assert p.returncode == 0, p.stderr
        counts = json.loads(p.stdout)
        assert counts["during_pause"] >= 3, ("no directory was confirmed during the pause", counts)
        assert counts["after_stop"] == 0, ("the keeper went on after the reads stopped", counts)
        parts = dict(part.split("\n", 1) for part in p.stderr.split("=== ")[1:])
        waited = "waits for its directory's confirmation"
        assert waited not in parts["after a pause of 1.2 durations"], parts["after a pause of 1.2 durations"]
        assert waited in parts["after the keeper stopped"], parts["after the keeper stopped"]


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


def test_a_bad_revalidate_option_of_run_is_blamed_on_the_option(source: Path, tier: str) -> None:
    """`tierstore run --revalidate 5` names the option the user gave, not the variable it travels in."""
    from tests.helpers.cli import cli

    p = cli("--source", str(source), "--tier", f"{tier}:1M", "run", "--revalidate", "5", "--", "true")
    assert p.returncode == 2, p.stderr
    assert "--revalidate" in p.stderr and "'5'" in p.stderr and "a duration such as" in p.stderr, p.stderr
    assert "TIERSTORE_REVALIDATE" not in p.stderr, p.stderr


def test_tiers_given_as_one_string_say_to_make_it_a_list(source: Path, tier: str) -> None:
    with pytest.raises(tierstore.ConfigError, match=r"is one tier, not a list of them; give tiers=\["):
        tierstore.Cache(source, tiers=f"{tier}:1M")  # type: ignore[arg-type]


def test_the_configured_mode_is_shown(source: Path, tier: str) -> None:
    cache = tierstore.Cache(source, [tier], revalidate="90s")
    assert cache.config()["revalidate"][0] == "90s"
