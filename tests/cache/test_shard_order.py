"""Read-ahead by shard for an iterable dataset nobody changed (`tierstore.shard_order`): a real webdataset
pipeline under `tierstore run`, and an iterable dataset reading through its own Cache, get each worker's
next shards fetched as it opens one, see exactly the samples they would without it, and read each shard
from the store once."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tarfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import tierstore
from tests.helpers.marks import needs
from tests.helpers.stores import mounted_store, store_stats
from tierstore import auto_order
from tierstore.shard_order import ShardReadAhead, directory_shards, find_shards, next_shards

SHARDS = 8
SAMPLES = 12  # per shard
SAMPLE = 8 << 10


def write_shards(root: Path) -> list[Path]:
    """webdataset tars `shard-000N.tar`, each sample a `.bin` whose bytes say which it is, and a `.cls`."""
    paths = []
    for s in range(SHARDS):
        path = root / f"shard-{s:04d}.tar"
        with tarfile.open(path, "w") as tar:
            for k in range(SAMPLES):
                for ext, data in (
                    ("bin", (s * 100 + k).to_bytes(4, "little") * (SAMPLE // 4)),
                    ("cls", b"%d" % k),
                ):
                    info = tarfile.TarInfo(f"{s:04d}{k:04d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


@pytest.fixture
@needs("fuse")
def store(tmp_path: Path) -> Any:
    """The stand-in store, 2 ms per metadata operation and per read, holding the shards."""
    with mounted_store(tmp_path, meta_latency="2ms", data_latency="2ms") as (backing, mount):
        write_shards(backing)
        yield backing, mount


# What each worker opens next ------------------------------------------------------------------------

LIST = [f"/s/shard-{i}.tar" for i in range(12)]
POSITION = {p: i for i, p in enumerate(LIST)}


def test_a_worker_is_read_ahead_at_the_step_of_its_split_then_at_the_step_it_takes() -> None:
    # Worker 1 of 3: after its first shard, the split's step; after two, the step they took.
    assert next_shards([LIST[1]], LIST, POSITION, None, step=3) == [LIST[4], LIST[7]]
    assert next_shards([LIST[1], LIST[4]], LIST, POSITION, None, step=3) == [LIST[7], LIST[10]]
    assert next_shards([LIST[2], LIST[3], LIST[4]], LIST, POSITION, None, step=3) == LIST[5:]
    # A guessed step reads 2 ahead; a step the worker has taken, up to `ahead`.
    assert next_shards([LIST[0]], LIST, POSITION, None, step=1, ahead=8) == LIST[1:3]
    assert next_shards([LIST[0], LIST[1]], LIST, POSITION, None, step=1, ahead=3) == LIST[2:5]
    assert next_shards([LIST[10], LIST[11]], LIST, POSITION, None, step=1) == []  # the list's end
    # Steps that disagree (a shuffled list) read nothing ahead; nor does a shard not in the list.
    assert next_shards([LIST[5], LIST[2], LIST[9]], LIST, POSITION, None, step=3) == []
    assert next_shards([LIST[5], LIST[5]], LIST, POSITION, None, step=3) == []
    assert next_shards(["/s/other.tar"], LIST, POSITION, None, step=3) == []
    assert next_shards([LIST[0]], None, {}, None, step=3) == []


def test_a_worker_that_repeats_its_last_epoch_is_read_ahead_in_that_order() -> None:
    last = [LIST[7], LIST[2], LIST[9], LIST[0]]
    assert next_shards(last[:1], None, {}, last, step=1) == last[1:]
    assert next_shards(last[:1], None, {}, last, step=1, ahead=2) == last[1:3]
    assert next_shards(last[:3], LIST, POSITION, last, step=1) == last[3:]
    # Once it departs from last epoch's order, only the list can say.
    assert next_shards([LIST[7], LIST[3], LIST[5]], LIST, POSITION, last, step=1) == []  # steps disagree
    assert next_shards([LIST[1], LIST[3], LIST[5]], LIST, POSITION, last, step=1) == [
        LIST[7],
        LIST[9],
        LIST[11],
    ]
    assert next_shards([LIST[7], LIST[3]], None, {}, last, step=1) == []


def test_each_worker_gets_a_head_start_from_its_split_then_from_its_last_epoch(
    tmp_path: Path, tier: str
) -> None:
    from tierstore.learned_order import LearnedLog
    from tierstore.shard_order import Split

    cache = tierstore.Cache(str(tmp_path), [f"{tier}:1G"])
    log = LearnedLog.create(str(tmp_path / "log"))
    # Rank 1 of 2, 3 workers: worker w reads 1 + 2w, stepping by 6 (webdataset's split_by_node, then _worker).
    split = Split(workers=3, rank=1, ranks=2)
    assert (split.step, [split.first(w) for w in range(3)]) == (6, [1, 3, 5])
    made = ShardReadAhead(
        cache, log, lambda p: True, (LIST, "dataset.urls"), "loader", split, "", lambda: 1 << 30
    )
    # Each worker's shards after its first (which it fetches itself, opening it at once), 2 at most: the
    # list of 12 holds one more for each (worker 0 reads 1, 7; worker 1 reads 3, 9; worker 2 reads 5, 11).
    assert made._head_start() == [LIST[7], LIST[9], LIST[11]]
    made.last = {0: [LIST[4], LIST[2], LIST[0], LIST[6]], 2: [LIST[8]]}  # epoch 1's order, not the split's
    assert made._head_start() == [LIST[2], LIST[0], LIST[9]]
    made.stop()


def test_a_shard_the_log_says_a_worker_opened_is_not_fetched_ahead(tmp_path: Path, tier: str) -> None:
    """A log read after a pause holds a worker's open of the shard its previous open would have it fetch
    ahead. Every open is taken in before a fetch is chosen: that shard is the worker's (it may be reading
    it from the store, the tier full), and the read-ahead fetches the ones after it."""
    from tierstore.learned_order import LearnedLog
    from tierstore.shard_order import Split

    source = tmp_path / "source"
    source.mkdir()
    shards = []
    for i in range(6):
        (source / f"s{i}.tar").write_bytes(bytes([i]) * 4096)
        shards.append(str(source / f"s{i}.tar"))
    cache = tierstore.Cache(str(source), [f"{tier}:1G"])
    log = LearnedLog.create(str(tmp_path / "log"))
    report = str(tmp_path / "marks")  # its `status` report is written beside it, not in the working directory
    made = ShardReadAhead(
        cache, log, lambda p: True, (shards, "dataset.urls"), "loader", Split(1), report, lambda: 1 << 30
    )
    made.budget = made.budget_now()  # as `begin_epoch` sets it, without its thread (this test looks itself)
    log.mark_epoch()
    log.append(0, [shards[0]])
    log.append(0, [shards[1]])  # in the log before the read-ahead's next look
    made.update()
    deadline = time.monotonic() + 30
    while not all(started.done for started in made.ahead.values()) and time.monotonic() < deadline:
        time.sleep(0.01)  # the fetches ahead land on threads of their own
    assert made.counts["opened"] == 2 and made.counts["opened_ahead"] == 0, made.counts
    assert cache._core.lookup(shards[1], False) is None  # left to the worker that opened it
    assert all(cache._core.lookup(s, False) is not None for s in shards[2:4]), made.counts  # the next two
    made.stop()


def test_the_shard_list_is_found_in_a_webdataset_pipeline_and_a_custom_dataset(tmp_path: Path) -> None:
    import webdataset as wds

    shards = [str(p) for p in write_shards(tmp_path)]

    def under(p: str) -> bool:
        return p.startswith(str(tmp_path) + "/")

    found = find_shards(wds.WebDataset(shards, shardshuffle=False).to_tuple("bin", "cls"), under)
    assert found == (shards, "dataset.pipeline[0].urls")

    class Records(IterableDataset[bytes]):
        def __init__(self) -> None:
            self.options = {"compression": None}
            self.files = [Path(p) for p in shards]  # PathLike, as many readers keep them

        def __iter__(self) -> Iterator[bytes]:
            yield from ()

    assert find_shards(Records(), under) == (shards, "dataset.files")
    assert find_shards(Records(), lambda p: False) is None  # not under the source: not the cache's
    assert directory_shards(shards[3]) == shards
    (tmp_path / "index.json").write_text("{}")
    assert directory_shards(shards[0]) == shards  # only the files that end as the shard does


# Under `tierstore run`: a real webdataset pipeline --------------------------------------------------

JOB = textwrap.dedent(
    """
    import glob, hashlib, sys
    import webdataset as wds
    from torch.utils.data import DataLoader

    urls = sorted(glob.glob(sys.argv[1] + "/shard-*.tar"))
    dataset = wds.WebDataset(urls, shardshuffle=False).to_tuple("bin", "cls")
    loader = DataLoader(dataset, batch_size=6, num_workers=2)
    digest = hashlib.sha256()
    for epoch in range(int(sys.argv[2])):
        for samples, classes in loader:
            digest.update(repr([(s[:4], c) for s, c in zip(samples, classes)]).encode())
    print("digest", digest.hexdigest())
    """
)


def run_job(mount: Path, tier: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    job = tmp_path / "job.py"
    job.write_text(JOB)
    return subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "-v", "--source", str(mount), "--tier", f"{tier}:1G", "run",
         "--revalidate", "never", "--", sys.executable, str(job), str(mount), "2"],
        capture_output=True, text=True, timeout=180, env={**os.environ, **env},
    )  # fmt: skip


def test_a_webdataset_job_under_tierstore_run_is_read_ahead_by_shard(
    store: Any, tier: str, tmp_path: Path
) -> None:
    pytest.importorskip("webdataset", reason="webdataset is in the dev extra; `make setup` installs it")
    backing, mount = store
    plain = subprocess.run(
        [sys.executable, "-c", JOB, str(backing), "2"], capture_output=True, text=True, timeout=120
    )
    assert plain.returncode == 0, plain.stderr
    off = run_job(mount, tier + "-off", tmp_path, TIERSTORE_SAMPLER_PREFETCH="off")
    assert off.returncode == 0, off.stderr
    assert "by shard" not in off.stderr
    before = store_stats(mount)
    on = run_job(mount, tier, tmp_path)
    after = store_stats(mount)
    assert on.returncode == 0, on.stderr
    # The same samples in the same order with the read-ahead, without it and without tierstore.
    assert on.stdout == off.stdout == plain.stdout and on.stdout.startswith("digest"), (
        on.stdout,
        plain.stdout,
    )
    assert f"reading ahead by shard, in the order of dataset.pipeline[0].urls ({SHARDS} shards)" in on.stderr
    m = re.search(r"epoch 1: (\d+) shards opened, (\d+) of them read ahead; (\d+) fetched ahead", on.stderr)
    assert m, on.stderr
    opened, read_ahead, fetched = map(int, m.groups())
    # Each worker's first shard cannot be foreseen; every later one is (2 workers, list order).
    assert opened == SHARDS and read_ahead >= SHARDS - 2 - 1 and fetched >= read_ahead, on.stderr
    # Each shard read from the store once for the whole job: read-ahead and readers together.
    size = sum(p.stat().st_size for p in backing.glob("shard-*.tar"))
    assert after["open"] - before["open"] == SHARDS, (before, after)
    assert after["bytes_read"] - before["bytes_read"] == size


# In a process that imported tierstore: an iterable dataset reading through its own Cache -------------


class ThroughCache(IterableDataset[bytes]):
    """Reads its shards through its cache, `split_by_worker`'s way: worker w of W takes w, w + W, ..."""

    def __init__(self, cache: tierstore.Cache, shards: list[str]) -> None:
        self.cache = cache
        self.shards = shards

    def __iter__(self) -> Iterator[bytes]:
        info = get_worker_info()
        w, n = (0, 1) if info is None else (info.id, info.num_workers)
        for shard in self.shards[w::n]:
            with self.cache.open(shard) as f, tarfile.open(fileobj=f, mode="r|") as tar:
                for member in tar:
                    data = tar.extractfile(member)
                    if member.name.endswith(".bin") and data is not None:
                        yield data.read(4)


def test_an_iterable_dataset_reading_through_its_own_cache_is_read_ahead_and_shown(
    store: Any, tier: str
) -> None:
    _, mount = store
    shards = sorted(str(p) for p in mount.glob("shard-*.tar"))
    cache = tierstore.Cache(str(mount), [f"{tier}:1G"])
    loader = DataLoader(ThroughCache(cache, shards), batch_size=5, num_workers=2)
    first = [bytes(b) for batch in loader for b in batch]
    made = auto_order.prefetch_of(loader)
    assert isinstance(made, ShardReadAhead) and made.found == "dataset.shards"
    second = [bytes(b) for batch in loader for b in batch]
    expected = sorted((s * 100 + k).to_bytes(4, "little") for s in range(SHARDS) for k in range(SAMPLES))
    assert sorted(first) == sorted(second) == expected
    made.update()  # whatever the workers wrote last
    # Epoch 1's later shards were fetched ahead; epoch 2 repeated epoch 1, all of it cached.
    assert made.last_counts is not None and made.last_counts["opened"] == SHARDS, made.last_counts
    assert made.last_counts["fetched_ahead"] >= SHARDS - 2 and made.last_counts["failed"] == 0, (
        made.last_counts
    )
    assert made.last == {0: shards[0::2], 1: shards[1::2]}
    # `tierstore status`, from another process, shows the loader and where its order came from.
    status = [sys.executable, "-m", "tierstore.cli", "--source", str(mount), "--tier", f"{tier}:1G", "status"]
    shown = subprocess.run([*status, "--json"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    mine = [r for r in json.loads(shown.stdout)["loaders"] if r["pid"] == os.getpid()]
    assert len(mine) == 1 and mine[0]["found"] == "shard order (dataset.shards)", shown.stdout
    assert mine[0]["epoch"] == 2 and mine[0]["shards_opened"] == SHARDS, mine
    table = subprocess.run(status, capture_output=True, text=True, timeout=60)
    assert f"{SHARDS} shards opened" in table.stdout, table.stdout


def made_counts(loader: DataLoader[Any]) -> dict[str, int] | None:
    """The loader's read-ahead counts, for a failure's message."""
    made = auto_order.prefetch_of(loader)
    return made.counts if isinstance(made, ShardReadAhead) else None


def test_shards_twice_the_tier_are_read_ahead_past_a_full_tier_and_read_once_each(
    store: Any, tier: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The default placement keeps what it placed: once the tier is full, a shard read ahead finds room
    # only in the copies of shards the workers have moved on from, which the read-ahead lets go of.
    _, mount = store
    shards = sorted(mount.glob("shard-*.tar"))
    size = {str(p): p.stat().st_size for p in shards}
    quota = sum(size.values()) // 2
    cache = tierstore.Cache(str(mount), [f"{tier}:{quota}B"])
    monkeypatch.setenv(auto_order.VARIABLE, str(4 * max(size.values())))  # the tier is too small for auto
    loader = DataLoader(ThroughCache(cache, sorted(size)), batch_size=5, num_workers=2)
    expected = sorted((s * 100 + k).to_bytes(4, "little") for s in range(SHARDS) for k in range(SAMPLES))
    for epoch in range(3):
        uncached = [p for p in size if cache._core.lookup(p, False) is None]
        before = store_stats(mount)
        assert sorted(bytes(b) for batch in loader for b in batch) == expected
        cache.wait()  # the fetches ahead of the epoch's last shards land
        after = store_stats(mount)
        opens, read = (after.get(k, 0) - before.get(k, 0) for k in ("open", "bytes_read"))
        # Each shard the tier did not hold as the epoch began read from the store once, by its worker or
        # ahead of it, and none twice; and opened once: the read-ahead holds room for a shard before it
        # opens it, so a worker's own fetch that takes the room meanwhile leaves it unopened.
        assert read == sum(size[p] for p in uncached), (epoch, read, len(uncached))
        assert opens == len(uncached), (epoch, opens, len(uncached), made_counts(loader))
        assert cache.stats()["tiers"][0]["bytes_used"] <= quota
        made = auto_order.prefetch_of(loader)
        assert isinstance(made, ShardReadAhead)
        if epoch == 0:
            made.update()
            # More shards fetched ahead than the tier holds: the later ones into room let go of.
            assert made.counts["let_go"] >= 1 and made.counts["fetched_ahead"] > SHARDS // 2, made.counts


def test_a_log_another_could_have_swapped_is_neither_read_nor_written(tmp_path: Path) -> None:
    from tierstore.learned_order import LearnedLog

    log = LearnedLog.create(str(tmp_path / "log"))
    log.append(3, ["/data/a"])
    assert log.added() == [(3, ["/data/a"])]
    log.append(4, ["/data/b"])
    assert log.added() == [(4, ["/data/b"])]  # only what was added since, from the descriptor kept open

    # A link in the log's place (to a file of records this user wrote) is not followed, by the loader's
    # reader nor by a worker's writer.
    real = tmp_path / "elsewhere"
    real.write_bytes(b'[7, ["/data/forged"]]\n')
    (tmp_path / "linked").symlink_to(real)
    linked = LearnedLog(str(tmp_path / "linked"))
    assert linked.added() == []
    linked.append(8, ["/data/c"])
    assert real.read_bytes() == b'[7, ["/data/forged"]]\n'

    # A log others may write is not this loader's either.
    shared = LearnedLog.create(str(tmp_path / "shared"))
    os.chmod(shared.path, 0o666)
    shared.append(9, ["/data/d"])
    assert Path(shared.path).read_bytes() == b""
    Path(shared.path).write_bytes(b'[9, ["/data/forged"]]\n')
    assert shared.added() == []
