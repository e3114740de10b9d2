"""Sampler-aware (ordered) prefetch on the stand-in store: files fetched in order and ahead of the reads,
bytes fetched but not yet read within the budget (measured from the tier and the reads, not from the
prefetch's own counters), every file read from the store once while reads race the prefetch, a
DataLoader that yields exactly the same samples with and without it (fork and spawn workers),
DistributedSampler ranks that prefetch only their shard, and clear errors."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

import tierstore
from tests.helpers.marks import needs
from tests.helpers.stores import mounted_store, store_stats
from tierstore.order import ReadMarker
from tierstore.torch import CachedDataset, prefetching

SIZE = 32 << 10


def write_files(backing: Path, n: int, size: int = SIZE) -> list[str]:
    """`n` files of exactly `size` bytes under `backing/data`; their names relative to `backing`."""
    names = []
    for i in range(n):
        p = backing / "data" / f"d{i // 100}" / f"{i:05d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(i.to_bytes(4, "little") * (size // 4))
        names.append(str(p.relative_to(backing)))
    return names


def opened(log: Path, mount: Path) -> list[str]:
    """The files the store opened, in order, relative to the mount."""
    out = []
    for line in log.read_text().splitlines():
        _, _, path = line.split(" ", 2)
        out.append(path.lstrip("/"))
    return out


def assert_in_order(seen: list[int], window: int, n: int) -> None:
    """Each of `n` positions opened on the store once, each at most `window` positions before the furthest
    one opened so far. Files are admitted in order, but up to `jobs` are in flight at once, so their opens
    interleave; and a job the machine holds up between its file's admission and its open lets the others
    go on admitting as far as the budget allows (the reader waits for that file, so the budget does not
    move), which CI's busiest runs saw: `window` is the larger of the jobs and the budget's files."""
    assert sorted(seen) == list(range(n))
    furthest = -1
    for pos in seen:
        assert pos > furthest - window - 1, (pos, furthest)
        furthest = max(furthest, pos)


def tier_used(cache: tierstore.Cache) -> int:
    return int(cache.stats()["tiers"][0]["bytes_used"])


@pytest.fixture
@needs("fuse")
def logged_store(tmp_path: Path) -> Any:
    """The stand-in store with 1 ms per metadata operation and an access log: (backing, mount, log)."""
    log = tmp_path / "access.log"
    with mounted_store(tmp_path, meta_latency="1ms", access_log=log) as (backing, mount):
        yield backing, mount, log


def test_order_is_followed_within_the_budget_and_ahead_of_the_reader(logged_store: Any, tier: str) -> None:
    backing, mount, log = logged_store
    names = write_files(backing, 200)
    order = names[:]
    random.Random(7).shuffle(order)
    cache = tierstore.Cache(mount, [f"{tier}:1G"])
    budget = 10 * SIZE
    log.write_text("")
    jobs = 8
    handle = cache.prefetch_order([mount / n for n in order], budget=budget, jobs=jobs)
    worst = 0
    for i, name in enumerate(order):
        time.sleep(0.002)  # a little work per sample: the prefetch gets ahead
        # Fetched but not read, measured: what the tier holds minus what was read (read first, then the
        # tier, so the measure can only err high).
        worst = max(worst, tier_used(cache) - i * SIZE)
        with cache.open(mount / name) as f:
            assert f.read(4) == int(name[-9:-4]).to_bytes(4, "little")
        handle.mark_read(i)
    assert handle.wait(30)
    p = handle.progress()
    assert p["files_total"] == p["files_done"] == len(order)
    assert p["files_failed"] == 0, p["errors"]
    assert worst <= budget, f"{worst} bytes fetched ahead of the reader, budget {budget}"
    assert p["max_bytes_ahead"] <= budget
    # Ahead of the reader: the prefetch fetched nearly everything, the reader little by itself.
    assert p["files_fetched"] >= 0.9 * len(order), p
    # In order: each file opened on the store comes at most `jobs` positions before the furthest opened.
    positions = {n: i for i, n in enumerate(order)}
    window = max(jobs, budget // SIZE)
    assert_in_order([positions[n] for n in opened(log, mount) if n in positions], window, len(order))


def test_every_file_is_read_from_the_store_once_when_reads_race_the_prefetch(
    logged_store: Any, tier: str
) -> None:
    backing, mount, _ = logged_store
    names = write_files(backing, 300)
    cache = tierstore.Cache(mount, [f"{tier}:1G"])
    before = store_stats(mount)
    handle = cache.prefetch_order([mount / n for n in names], budget="64M", jobs=16)
    # Eight readers start at once with the prefetch, each taking the next file: they race it for every file.
    nxt = iter(range(len(names)))
    lock = threading.Lock()

    def reader() -> None:
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            with cache.open(mount / names[i]) as f:
                assert len(f.read()) == SIZE
            handle.mark_read(i)

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert handle.wait(30)
    cache.wait()
    after = store_stats(mount)
    assert after.get("bytes_read", 0) - before.get("bytes_read", 0) == len(names) * SIZE
    assert after.get("open", 0) - before.get("open", 0) == len(names)
    p = handle.progress()
    assert p["files_fetched"] + p["files_cached"] + p["files_read_first"] == len(names), p
    # Once every file is read, the progress says so, although the readers overtook the prefetch.
    assert p["files_done"] == p["files_total"] == p["position"] == len(names), p
    assert p["bytes_ahead"] == 0, p


def test_a_warm_epoch_with_revalidate_always_asks_the_store_once_per_file_not_twice(
    slow_store: tuple[Path, Path], tier: str
) -> None:
    """With revalidate "always" the reader's open confirms each cached copy with the store; the ordered
    prefetch leaves cached files to it instead of confirming them too (it used to: two store operations
    per file and epoch). A file replaced on the store is still read new."""
    backing, mount = slow_store
    names = write_files(backing, 60)
    cache = tierstore.Cache(mount, [f"{tier}:1G"], revalidate="always")

    def epoch(prefetch: bool = True) -> dict[str, int]:
        before = store_stats(mount)
        if prefetch:
            handle = cache.prefetch_order([mount / n for n in names], budget="64M", jobs=4)
        got = []
        for i, n in enumerate(names):
            with cache.open(mount / n) as f:
                got.append(f.read())
            if prefetch:
                handle.mark_read(i)
        if prefetch:
            assert handle.wait(30)
        cache.wait()
        after = store_stats(mount)
        assert got[7] == (backing / names[7]).read_bytes()
        return {k: after.get(k, 0) - before.get(k, 0) for k in ("open", "getattr", "bytes_read")}

    epoch()  # cold: every file fetched once
    alone = epoch(prefetch=False)  # what the readers' own opens ask of the store
    warm = epoch()
    assert warm["open"] == 0 and warm["bytes_read"] == 0, warm
    assert alone["getattr"] > 0
    assert warm["getattr"] == alone["getattr"], f"with the prefetch {warm}, the readers alone {alone}"
    time.sleep(0.01)
    (backing / names[7]).write_bytes(b"new!" * (SIZE // 4))  # replaced on the store: seen at the next open
    changed = epoch()
    assert changed["bytes_read"] == SIZE, changed


class Indexed(CachedDataset):
    """Samples as (index, first word of the file), so a test sees which file each sample came from."""

    def __getitem__(self, index: int) -> Any:
        data = super().__getitem__(index)
        return index, int.from_bytes(data[:4], "little")


def slow_collate(batch: list[Any]) -> Any:
    time.sleep(0.002)  # a little work per batch
    return torch.utils.data.default_collate(batch)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_yields_the_same_samples_and_prefetches_within_the_budget(
    logged_store: Any, tier: str, context: str
) -> None:
    backing, mount, _ = logged_store
    names = write_files(backing, 240)
    cache = tierstore.Cache(mount, [f"{tier}:1G"])
    ds = Indexed([str(mount / n) for n in names], cache=cache)

    def loader(wrapped: bool, context: str = context) -> Any:
        g = torch.Generator().manual_seed(1234)
        dl = DataLoader(
            ds,
            batch_size=8,
            sampler=RandomSampler(ds, generator=g),
            num_workers=2,
            multiprocessing_context=context,
            collate_fn=slow_collate,
        )
        return prefetching(dl, budget=16 * SIZE, jobs=8) if wrapped else dl

    budget = 16 * SIZE
    wrapped = loader(True)
    sampler = wrapped.ordered_sampler
    marker = ReadMarker(sampler.marks_path)
    before = store_stats(mount)
    worst = 0
    seen = []
    for idx, first in wrapped:
        assert idx.tolist() == first.tolist()  # each sample is its own file
        seen.extend(idx.tolist())
        read = marker.count(sampler.epoch_tag, 1)
        worst = max(worst, tier_used(cache) - read * SIZE)
    sampler.prefetch.wait(30)
    cache.wait()
    after = store_stats(mount)
    p = sampler.progress()
    # Fetched but not yet read, measured in the tier: within the budget, plus the files the two workers
    # and the batches the loader keeps in flight are reading at the moment of the measure.
    in_flight = 2 * 2 * 8 + 2
    assert worst <= budget + in_flight * SIZE, (worst, budget)
    assert p["max_bytes_ahead"] <= budget
    assert p["files_failed"] == 0, p["errors"]
    # Each file opened and read from the store once, by the prefetch or by a worker that got there first,
    # although the budget (16 files) is smaller than what the loader keeps in flight (2 workers x 2
    # batches x 8): the prefetch waits for room before it opens a file, never after.
    assert after.get("bytes_read", 0) - before.get("bytes_read", 0) == len(names) * SIZE
    assert after.get("open", 0) - before.get("open", 0) == len(names)
    assert p["files_fetched"] >= 0.5 * len(names), p
    assert p["files_done"] == p["files_total"] == p["position"] == len(names), p
    assert p["bytes_ahead"] == 0, p
    # The same samples in the same order as without the wrapper: the sampler's RNG is consumed alike. The
    # sampler runs in this process whatever starts the workers, so the plain loader's are forked (spawned
    # workers would cost seconds more and change no index).
    plain = [i for idx, _ in loader(False, "fork") for i in idx.tolist()]
    assert seen == plain
    assert sorted(seen) == list(range(len(names)))


def test_persistent_workers_get_each_epoch_in_its_own_order(logged_store: Any, tier: str) -> None:
    backing, mount, _ = logged_store
    names = write_files(backing, 120)
    cache = tierstore.Cache(mount, [f"{tier}:1G"])
    ds = Indexed([str(mount / n) for n in names], cache=cache)
    wrapped = prefetching(
        DataLoader(
            ds,
            batch_size=8,
            sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(9)),
            num_workers=2,
            persistent_workers=True,
            multiprocessing_context="fork",
        ),
        budget=16 * SIZE,
        jobs=8,
    )
    plain = DataLoader(
        ds, batch_size=8, sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(9))
    )
    before = store_stats(mount)
    orders = []
    for epoch in range(2):
        got = [i for idx, _ in wrapped for i in idx.tolist()]
        assert got == [i for idx, _ in plain for i in idx.tolist()]
        orders.append(got)
        sampler = wrapped.ordered_sampler
        assert sampler.prefetch.wait(30)
        p = sampler.progress()
        assert p["files_failed"] == 0, p["errors"]
        if epoch == 0:
            assert p["files_fetched"] >= 0.5 * len(names), p
        else:  # every file cached in epoch 1: the prefetch fetches nothing and the reads free the budget
            assert p["files_fetched"] == 0 and p["files_cached"] + p["files_read_first"] == len(names), p
    assert orders[0] != orders[1]  # reshuffled, as without the wrapper
    after = store_stats(mount)
    # Every file opened and every byte read once, over both epochs.
    assert after.get("bytes_read", 0) - before.get("bytes_read", 0) == len(names) * SIZE
    assert after.get("open", 0) - before.get("open", 0) == len(names)


def test_distributed_ranks_prefetch_only_their_shard(logged_store: Any, tier: str) -> None:
    backing, mount, log = logged_store
    names = write_files(backing, 100)
    cache = tierstore.Cache(mount, [f"{tier}:1G"])
    ds = CachedDataset([str(mount / n) for n in names], cache=cache)
    shards = []
    for rank in (0, 1):
        cache.clear()
        log.write_text("")
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=5)
        sampler.set_epoch(3)
        expected = list(sampler)
        dl = prefetching(DataLoader(ds, batch_size=10, sampler=sampler), budget="1G")
        dl.sampler.set_epoch(3)
        got = [len(b) for b in dl]
        assert sum(got) == len(expected)
        dl.ordered_sampler.prefetch.wait(30)
        files = set(opened(log, mount))
        assert files == {names[i] for i in expected}
        shards.append(files)
    assert not shards[0] & shards[1]


def test_bad_input_says_what_and_how_to_fix(slow_store: tuple[Path, Path], tier: str, tmp_path: Path) -> None:
    backing, mount = slow_store
    names = write_files(backing, 3)
    cache = tierstore.Cache(mount, [f"{tier}:1G"])
    paths = [mount / n for n in names]
    with pytest.raises(ValueError, match=r"budget='2X'.*like \"2G\""):
        cache.prefetch_order(paths, budget="2X")
    with pytest.raises(ValueError, match=r"budget=0"):
        cache.prefetch_order(paths, budget=0)
    with pytest.raises(ValueError, match=r"jobs=0"):
        cache.prefetch_order(paths, jobs=0)
    outside = tmp_path / "elsewhere.bin"
    with pytest.raises(tierstore.OutsideSourceError, match=str(outside)):
        cache.prefetch_order([*paths, outside])
    ds = CachedDataset([str(p) for p in paths], cache=cache)
    with pytest.raises(ValueError, match=r"budget='4Q'"):
        prefetching(DataLoader(ds), budget="4Q")

    class NoPaths(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 3

        def __getitem__(self, i: int) -> int:
            return i

    with pytest.raises(TypeError, match="give paths="):
        prefetching(DataLoader(NoPaths()))
    # A file missing from the store is reported by name, and the rest still lands.
    handle = cache.prefetch_order([*paths[:1], mount / "data" / "missing.bin", *paths[1:]], budget="1M")
    assert handle.wait(30)
    p = handle.progress()
    assert p["files_failed"] == 1 and "missing.bin" in p["errors"][0] and "not found" in p["errors"][0]
    assert p["files_fetched"] == 3


def test_tierstore_run_prefetches_the_order_file_and_learns_reads_from_the_shim(
    logged_store: Any, tier: str, tmp_path: Path
) -> None:
    import os
    import re
    import subprocess
    import sys

    backing, mount, log = logged_store
    names = write_files(backing, 60)
    order = names[:]
    random.Random(3).shuffle(order)
    order_file = tmp_path / "order.txt"
    order_file.write_text("".join(f"{mount / n}\n" for n in order))
    # The job reads the files in order, a little work each, through the shim (plain open()).
    job = "import sys, time\nfor p in open(sys.argv[1]).read().split():\n    open(p, 'rb').read(); time.sleep(0.01)\n"
    budget = 5 * SIZE
    log.write_text("")
    before = store_stats(mount)
    r = subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "--source", str(mount), "--tier", f"{tier}:1G", "run",
         "--order", str(order_file), "--budget", str(budget), "--", sys.executable, "-c", job, str(order_file)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TIERSTORE_LOG": "off"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    m = re.search(
        r"prefetched (\d+) of (\d+) files .* (\d+) read before .* at most (.+) ahead, budget (.+)\)", r.stderr
    )
    assert m, r.stderr
    fetched, total, _ = (int(g) for g in m.groups()[:3])
    ahead, said_budget = (tierstore.parse_size(g) for g in m.groups()[3:])  # sizes for people: "160.0 KiB"
    assert total == len(order)
    # Only reads marked by the shim free the budget: without them the prefetch would stop after 5 files.
    assert fetched >= 0.8 * len(order), r.stderr
    assert ahead is not None and said_budget is not None and ahead <= said_budget, r.stderr
    after = store_stats(mount)
    assert after.get("open", 0) - before.get("open", 0) == len(order)
    assert after.get("bytes_read", 0) - before.get("bytes_read", 0) == len(order) * SIZE
    positions = {n: i for i, n in enumerate(order)}
    assert_in_order([positions[n] for n in opened(log, mount) if n in positions], 32, len(order))
    # Exit status passes through, and a bad budget is refused before the job starts.
    bad = subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "--source", str(mount), "--tier", f"{tier}:1G", "run",
         "--order", str(order_file), "--budget", "2X", "--", "true"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "budget='2X'" in bad.stderr and '"2G"' in bad.stderr, bad.stderr
    status = subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "--source", str(mount), "--tier", f"{tier}:1G", "run",
         "--order", str(order_file), "--", sys.executable, "-c", "raise SystemExit(3)"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert status.returncode == 3, status.stderr


def test_a_batchs_marks_are_those_of_the_per_sample_calls(tmp_path: Path, tier: str) -> None:
    """`ReadMarker`'s batch calls (a DataLoader worker's marks, made once per batch) leave every slot as
    `mark_started` and `mark_read` of each sample would, for plain, NumPy and tensor indices, and pass over
    indices that have no slot; a sample whose read raises stays begun."""
    import numpy as np

    from tierstore.order import STARTED

    source = tmp_path / "source"
    source.mkdir()
    cache = tierstore.Cache(str(source), [f"{tier}:1G"])
    n = 8
    batched, single = (ReadMarker(cache._core.create_read_marks(n + 1)) for _ in range(2))
    for m in (batched, single):
        m.mark(0, 5)  # the epoch's tag
    batch = [3, np.int64(1), torch.tensor(6), -1, n, "x", True]
    slots = [4, 2, 7, 1 + 1]  # the indices with a slot: 3, 1, 6 and True (1)

    def values(m: ReadMarker) -> list[int]:
        return [m.get(s) for s in range(n + 1)]

    seen = []
    for i in batched.begin_each(batch):
        seen.append(i)
        # Each sample is begun when the fetch reaches it, and the next one is not yet.
        k = len(seen) - 1
        if k < 2:
            assert batched.get(slots[k]) == 5 | STARTED and batched.get(slots[k + 1]) == 0
    assert seen == batch
    for s in slots:
        single.mark_started(s)
    assert values(batched) == values(single)
    batched.read_each(batch)
    for s in slots:
        single.mark_read(s)
    assert values(batched) == values(single) and all(batched.get(s) == 5 for s in slots)

    # Begun before each read, read after it; a read that raises leaves its sample begun.
    batched.mark(0, 6)

    def read(i: Any) -> Any:
        if i == 6:
            raise OSError("unreadable")
        if not isinstance(i, str) and 0 <= int(i) < n:
            assert batched.get(int(i) + 1) == 6 | STARTED
        return i

    with pytest.raises(OSError, match="unreadable"):
        [read(i) for i in batched.begin_then_read_each([3, np.int64(1), torch.tensor(6), 2])]
    assert [batched.get(s) for s in (4, 2, 7, 3)] == [6, 6, 6 | STARTED, 0]
    assert [read(i) for i in batched.begin_then_read_each([2, -1, "x"])] == [2, -1, "x"]
    assert batched.get(3) == 6


def test_a_marker_ignores_slots_out_of_range_and_counts_a_tag(tmp_path: Path, tier: str) -> None:
    """A reader's single marks never fail: a negative slot, one past the end and slot 0 (the epoch's tag,
    for `mark_read` and `mark_started`) are passed over, and `get` reads 0 there."""
    source = tmp_path / "source"
    source.mkdir()
    cache = tierstore.Cache(str(source), [f"{tier}:1G"])
    m = ReadMarker(cache._core.create_read_marks(5))
    m.mark(0, 9)
    for bad in (-1, 5, 1 << 40):
        m.mark(bad, 3)
        m.mark_read(bad)
        m.mark_started(bad)
        assert m.get(bad) == 0
    m.mark_read(0)
    m.mark_started(0)
    m.mark_read(2)
    m.mark_read(4)
    assert [m.get(s) for s in range(5)] == [9, 0, 9, 0, 9]
    assert (m.count(9), m.count(9, 1), m.count(9, 5), m.count(0, 1)) == (3, 2, 0, 2)


def test_a_marks_file_planted_as_a_link_or_left_writable_is_not_written(tmp_path: Path, tier: str) -> None:
    """A marks path comes from a dataset's attribute or the environment: a symbolic link there (to make
    the reader write into another file) or a file other users can write is refused, and the reader goes on
    without marks rather than fail."""
    source = tmp_path / "source"
    source.mkdir()
    cache = tierstore.Cache(str(source), [f"{tier}:1G"])
    real = cache._core.create_read_marks(4)
    victim = tmp_path / "victim"
    victim.write_bytes(bytes(16))
    link = tmp_path / "planted.marks"
    link.symlink_to(victim)
    with pytest.raises(OSError, match="symbolic link"):
        tierstore._core.Marks(str(link))
    through_link = ReadMarker(str(link))
    through_link.mark(1, 7)
    through_link.read_each([0, 1, 2])
    assert victim.read_bytes() == bytes(16) and through_link.get(1) == 0

    os.chmod(real, 0o666)
    with pytest.raises(OSError, match="writable by other users"):
        tierstore._core.Marks(real)
    open_to_all = ReadMarker(real)
    open_to_all.mark(1, 7)
    assert open_to_all.get(1) == 0
    os.chmod(real, 0o600)
    assert ReadMarker(real).get(1) == 0, "nothing was written through the refused marker"
    mine = ReadMarker(real)
    mine.mark(1, 7)
    assert mine.get(1) == 7


def test_files_any_tier_holds_are_not_fetched_again(logged_store: Any, tier: str, tmp_path: Path) -> None:
    """An order's look at what the tiers hold as it starts (each tier's index read in one transaction for
    many files) finds the copies of both tiers, in order: the first tier full, the rest in the second.
    Files no tier holds yet are fetched, once each."""
    backing, mount, _ = logged_store
    names = write_files(backing, 40)
    held, fresh = names[:30], names[30:]
    cache = tierstore.Cache(mount, [f"{tier}:{12 * SIZE}B", f"{tmp_path / 'second'}:1G"])
    for n in held:
        with cache.open(mount / n) as f:
            assert len(f.read()) == SIZE
    cache.wait()
    used = [int(t["bytes_used"]) for t in cache.stats()["tiers"]]
    assert used[0] > 0 and used[1] > 0 and sum(used) == len(held) * SIZE, used  # both tiers hold some
    before = store_stats(mount)
    order = fresh[:5] + held + fresh[5:]
    handle = cache.prefetch_order([mount / n for n in order], budget="64M", jobs=4)
    assert handle.progress()["files_cached"] == len(held)
    for i, n in enumerate(order):
        with cache.open(mount / n) as f:
            assert f.read()[:4] == int(n[-9:-4]).to_bytes(4, "little")
        handle.mark_read(i)
    assert handle.wait(30)
    cache.wait()
    after = store_stats(mount)
    assert after.get("bytes_read", 0) - before.get("bytes_read", 0) == len(fresh) * SIZE
    p = handle.progress()
    # A fresh file the reader got to while the prefetch was fetching it counts as cached too.
    assert p["files_fetched"] + p["files_cached"] + p["files_read_first"] == len(order), p


def test_a_loaders_files_found_cached_are_looked_at_again_once_an_index_changes(
    logged_store: Any, tier: str
) -> None:
    """A loader's files are made ready once (`order_files`) and each epoch names them by number; an epoch
    takes a file a last look found cached as cached without looking again only while no tier's index has
    changed since. A copy another process let go of is fetched again by the next epoch, and an epoch that
    names a file past those made ready is refused with what to do."""
    backing, mount, _ = logged_store
    names = write_files(backing, 20)
    cache = tierstore.Cache(mount, [f"{tier}:1G"], revalidate="never")
    core = cache._core
    files = core.order_files([mount / n for n in names])
    assert len(files) == len(names)
    marks = core.create_read_marks(len(names) + 1)

    def epoch(tag: int) -> dict[str, Any]:
        order = list(range(len(names)))
        random.Random(tag).shuffle(order)
        handle = core.prefetch_in_order(files, order, 64 << 20, (marks, tag), 4)
        deadline = time.monotonic() + 30
        while not handle.done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert handle.done
        cache.wait()
        return dict(handle.progress())

    assert epoch(1)["files_fetched"] == len(names)
    for tag in (2, 3):  # warm: the second epoch looks, the third takes what it found
        p = epoch(tag)
        assert (p["files_cached"], p["files_fetched"]) == (len(names), 0), p
    let_go = "import sys, tierstore\nprint(tierstore.Cache(sys.argv[1], [sys.argv[2]])._core.let_go(sys.argv[3]))\n"
    freed = subprocess.run(
        [sys.executable, "-c", let_go, str(mount), f"{tier}:1G", str(mount / names[3])],
        check=True, capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip
    assert int(freed) == SIZE
    before = store_stats(mount)
    p = epoch(4)
    assert (p["files_cached"], p["files_fetched"]) == (len(names) - 1, 1), p
    assert store_stats(mount).get("bytes_read", 0) - before.get("bytes_read", 0) == SIZE
    with pytest.raises(Exception, match=r"names file 20 of only 20 .*make the files again"):
        core.prefetch_in_order(files, [20], 64 << 20, (marks, 5))
