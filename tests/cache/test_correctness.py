"""What must never happen: a byte fetched twice, stale or partial bytes served, a fault that fails a read."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import tierstore
from tests.helpers.data import content, flip_byte, make_files
from tests.helpers.soak import EVICTION_READS


def _read_all_in_process(args: tuple[str, str, list[str], int]) -> dict[str, str]:
    source, tier, paths, seed = args
    cache = tierstore.Cache(source, [tier])
    random.Random(seed).shuffle(paths)
    out = {}
    for p in paths:
        with cache.open(p) as f:
            out[p] = hashlib.sha256(f.read()).hexdigest()
    cache.wait()
    return out


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_eight_processes_read_each_source_file_exactly_once(
    source: Path, tier: str, start_method: str
) -> None:
    files = make_files(source, 200, size=20_000)
    files.update(make_files(source, 4, size=3 << 20, prefix="large"))  # streamed copies, followed by readers
    spec = f"{tier}:1G"
    cache = tierstore.Cache(source, [spec])
    paths = [str(p) for p in files]
    ctx = mp.get_context(start_method)
    with ctx.Pool(8) as pool:
        results = pool.map(
            _read_all_in_process, [(str(source), spec, list(paths), seed) for seed in range(8)]
        )
    expected = {str(p): hashlib.sha256(b).hexdigest() for p, b in files.items()}
    for r in results:
        assert r == expected
    s = cache.stats()
    total = sum(len(b) for b in files.values())
    assert s["source"]["opens"] == len(files), "a source file was opened more than once"
    assert s["source"]["bytes_read"] == total, f"read amplification {s['source']['bytes_read'] / total:.3f}"
    assert s["tiers"][0]["entries"] == len(files)


def test_forked_workers_share_the_parents_cache(source: Path, tier: str) -> None:
    """The DataLoader pattern: the cache is created in the parent and used in forked workers."""
    files = make_files(source, 60, size=10_000)
    cache = tierstore.Cache(source, [f"{tier}:64M"])
    with cache.open(next(iter(files))) as f:  # the parent has used it: threads, index, locks exist
        f.read()

    def worker(paths: list[Path], q: mp.Queue) -> None:
        q.put(all(cache.open(p).read() == files[p] for p in paths))
        cache.wait()

    ctx = mp.get_context("fork")
    q: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(list(files), q)) for _ in range(4)]
    for p in procs:
        p.start()
    assert all(q.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert cache.stats()["source"]["opens"] == len(files)


def _read_and_leave_at_once(cache: tierstore.Cache, paths: list[Path]) -> None:
    for p in paths:
        cache.open(p).read()  # small files: handed over at once, published by the pool afterwards


def test_worker_exit_publishes_queued_copies(source: Path, tier: str) -> None:
    """multiprocessing children leave through os._exit; their queued copies must still be published."""
    files = make_files(source, 300, size=200_000)
    cache = tierstore.Cache(source, [f"{tier}:1G"], threads=1)
    ctx = mp.get_context("fork")
    p = ctx.Process(target=_read_and_leave_at_once, args=(cache, list(files)))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    s = cache.stats()["tiers"][0]
    assert s["entries"] == len(files) and s["in_flight"] == 0


# A process that imports tierstore before multiprocessing: tierstore registers its exit flush as
# multiprocessing loads, and must not have loaded it (nor its own cache module) itself.
_IMPORTED_FIRST = """
import sys
import tierstore
assert "multiprocessing.util" not in sys.modules and "tierstore.cache" not in sys.modules, sorted(sys.modules)
cache = tierstore.Cache(sys.argv[1], [sys.argv[2] + ":1G"], threads=1)
import multiprocessing

def leave_at_once(paths):
    for p in paths:
        cache.open(p).read()

p = multiprocessing.get_context("fork").Process(target=leave_at_once, args=(sys.argv[3:],))
p.start()
p.join(60)
assert p.exitcode == 0, p.exitcode
s = cache.stats()["tiers"][0]
print(s["entries"], s["in_flight"])
"""


def test_worker_exit_publishes_queued_copies_when_multiprocessing_is_imported_after_tierstore(
    source: Path, tier: str
) -> None:
    files = make_files(source, 300, size=200_000)
    r = subprocess.run(
        [sys.executable, "-c", _IMPORTED_FIRST, str(source), tier, *map(str, files)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(len(files)), "0"], r.stdout


def test_rewritten_source_file_is_fetched_again(source: Path, tier: str) -> None:
    cache = tierstore.Cache(source, [f"{tier}:16M"], revalidate="always")
    p = source / "epoch.bin"
    p.write_bytes(b"version one")
    for _ in range(2):
        assert cache.open(p).read() == b"version one"
        cache.wait()
    # Same size, rewritten in place: mtime tells. Then replaced by rename: the inode tells.
    p.write_bytes(b"version two")
    assert cache.open(p).read() == b"version two"
    cache.wait()
    assert cache.open(p).read() == b"version two"
    tmp = source / "new.tmp"
    tmp.write_bytes(b"version three, longer")
    os.replace(tmp, p)
    assert cache.open(p).read() == b"version three, longer"
    cache.wait()
    with cache.open(p) as f:
        assert f.backing == "tier" and f.read() == b"version three, longer"


def test_rewrite_in_place_with_the_old_mtime_put_back_is_fetched_again(source: Path, tier: str) -> None:
    """rsync --times, tar x and cp -p restore the mtime after writing: the ctime still tells."""
    cache = tierstore.Cache(source, [f"{tier}:16M"], revalidate="always")
    p = source / "restored.bin"
    p.write_bytes(b"version one")
    before = p.stat()
    assert cache.open(p).read() == b"version one"
    cache.wait()
    time.sleep(0.01)  # a ctime tick apart, however coarse the file system's clock
    p.write_bytes(b"version two")
    os.utime(p, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (p.stat().st_size, p.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert cache.open(p).read() == b"version two"
    cache.wait()
    with cache.open(p) as f:
        assert f.backing == "tier" and f.read() == b"version two"


@pytest.mark.fuse
def test_a_large_file_copied_by_ranged_readers_is_followed_whole_and_read_once(
    tmp_path: Path, tier: str
) -> None:
    """A file of 64 MiB or more is copied from a POSIX store by several ranged readers at once
    (`TIERSTORE_COPY_STREAMS`, 4 by default): the reader that follows the growing copy gets every byte in
    order, the store sends each byte once, and the copy's blake3 (taken once, as it is written) checks."""
    from tests.helpers.stores import mounted_store, store_stats

    with mounted_store(tmp_path, data_latency="1ms") as (backing, mount):
        data = content(5, (72 << 20) + 12345)
        (backing / "pack.bin").write_bytes(data)
        cache = tierstore.Cache(mount, [f"{tier}:1G"], verify="checksum")
        before = store_stats(mount).get("bytes_read", 0)
        with cache.open(mount / "pack.bin") as f:
            got = hashlib.sha256()
            while chunk := f.read(3 << 20):
                got.update(chunk)
        assert got.digest() == hashlib.sha256(data).digest()
        cache.wait()
        assert store_stats(mount)["bytes_read"] - before == len(data)
        with cache.open(mount / "pack.bin") as f:  # the copy, checked against its blake3 as it is read
            assert hashlib.sha256(f.read()).digest() == hashlib.sha256(data).digest()
        assert store_stats(mount)["bytes_read"] - before == len(data), "served from the copy"
        assert cache.stats()["tiers"][0]["faults"] == 0, "the copy's blake3 matched"
        del cache


def test_copy_keeps_the_source_mtime(source: Path, tier: str) -> None:
    cache = tierstore.Cache(source, [f"{tier}:16M"])
    p = source / "m.bin"
    p.write_bytes(b"x" * 100)
    os.utime(p, ns=(1_600_000_000_123_456_789, 1_600_000_000_123_456_789))
    cache.open(p).read()
    cache.wait()
    assert os.stat(cache.lookup(p)).st_mtime_ns == 1_600_000_000_123_456_789


def test_an_entry_kept_by_a_process_is_looked_up_again_once_another_process_changes_the_index(
    source: Path, tier: str
) -> None:
    """A process keeps the first tier's entries it found while the index's change number stays the same:
    another process that replaces the copy moves the number, and this one reads the new copy as it is
    published, with no fault and no request to the store of its own."""
    cache = tierstore.Cache(source, [f"{tier}:16M"], revalidate="never")
    p = source / "kept.bin"
    p.write_bytes(b"version one")
    for _ in range(3):  # fetched, then found in the index, then the entry kept
        assert cache.open(p).read() == b"version one"
        cache.wait()
    p.write_bytes(b"version two, longer")
    replace = (
        "import sys, tierstore\n"
        "c = tierstore.Cache(sys.argv[1], [sys.argv[2]], revalidate='never')\n"
        "c._core.invalidate(sys.argv[3])\n"
        "assert c.open(sys.argv[3]).read() == b'version two, longer'\n"
        "c.wait()\n"
    )
    subprocess.run(
        [sys.executable, "-c", replace, str(source), f"{tier}:16M", str(p)], check=True, timeout=120
    )
    before = cache.stats()
    with cache.open(p) as f:
        assert f.backing == "tier" and f.read() == b"version two, longer"
    after = cache.stats()
    assert after["source"]["opens"] == before["source"]["opens"], "read from the store again"
    assert after["tiers"][0]["faults"] == before["tiers"][0]["faults"] == 0, after


@pytest.mark.parametrize("damage", ["truncate", "overwrite", "delete"])
def test_damaged_copy_falls_back_then_is_repaired(source: Path, tier: str, damage: str) -> None:
    cache = tierstore.Cache(source, [f"{tier}:16M"])
    p = source / "d.bin"
    data = content(7, 50_000)
    p.write_bytes(data)
    cache.open(p).read()
    cache.wait()
    copy = Path(cache.lookup(p))
    if damage == "truncate":
        os.truncate(copy, 1000)
    elif damage == "overwrite":
        with open(copy, "r+b") as f:
            f.write(b"\0" * 100)
    else:
        copy.unlink()
    assert cache.open(p).read() == data
    s = cache.stats()
    assert s["tiers"][0]["faults"] == 1 and s["source"]["fallbacks"] == 1
    cache.wait()
    assert Path(cache.lookup(p)).read_bytes() == data
    with cache.open(p) as f:
        assert f.backing == "tier" and f.read() == data


def test_checksum_mode_catches_silent_corruption(source: Path, tier: str) -> None:
    cache = tierstore.Cache(source, [f"{tier}:16M"], verify="checksum")
    p = source / "rot.bin"
    data = content(8, 30_000)
    p.write_bytes(data)
    cache.open(p).read()
    cache.wait()
    flip_byte(Path(cache.lookup(p)), 12345)
    assert cache.open(p).read() == data
    assert cache.stats()["tiers"][0]["faults"] == 1


def test_checksum_mode_gives_programs_the_checked_bytes_not_the_store(source: Path, tier: str) -> None:
    """Under `verify = "checksum"` a program's descriptor of a cached file (what the shim hands out, and
    what a mapped model load maps) holds the bytes the open checked, in memory: not the store's file,
    which every open used to fall back to. A damaged copy is still never handed out."""
    cache = tierstore.Cache(source, [f"{tier}:16M"], verify="checksum")
    p = source / "checked.bin"
    data = content(9, 30_000)
    p.write_bytes(data)
    cache.open(p).read()
    cache.wait()
    for _ in range(2):
        fd = cache._core.open_file(p)
        try:
            assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:tierstore:"), "the store's own file"
            assert os.pread(fd, len(data) + 1, 0) == data
        finally:
            os.close(fd)
    flip_byte(Path(cache.lookup(p)), 777)
    fd = cache._core.open_file(p)
    try:
        assert os.pread(fd, len(data) + 1, 0) == data
    finally:
        os.close(fd)
    assert cache.stats()["tiers"][0]["faults"] == 1


def test_quota_full_tier_still_serves_every_read(source: Path, tier: str) -> None:
    files = make_files(source, 40, size=10_000)
    cache = tierstore.Cache(source, [f"{tier}:50000B"])  # room for 4 files
    for _ in range(2):
        for p, b in files.items():
            assert cache.open(p).read() == b
        cache.wait()
    s = cache.stats()
    assert s["tiers"][0]["entries"] == 4 and s["tiers"][0]["bytes_used"] <= 50_000
    assert s["source"]["uncached"] == 36 + 36


@pytest.mark.parametrize("policy", ["fill", "lru"])
def test_sources_sharing_a_tier_directory_share_its_quota(tmp_path: Path, tier: str, policy: str) -> None:
    """Two datasets cached in one tier directory (with quota 1M each said) hold at most 1M together."""
    caches, data = [], []
    for name in ("a", "b"):
        src = tmp_path / name
        src.mkdir()
        data.append(make_files(src, 12, size=50_000))  # 0.6 MB each: together more than the quota
        caches.append(tierstore.Cache(src, [f"{tier}:1M"], policy=policy))
    for cache, files in zip(caches, data, strict=True):
        for p, b in files.items():
            assert cache.open(p).read() == b
        cache.wait()
    for cache, files in zip(caches, data, strict=True):
        for p, b in files.items():
            assert cache.open(p).read() == b
        cache.wait()
    used = [c.stats()["tiers"][0]["bytes_used"] for c in caches]
    assert sum(used) <= 1 << 20, f"the tier holds {used} bytes for a quota of 1 MiB"
    assert used[0] > 0 and used[1] > 0
    on_disk = sum(f.stat().st_size for f in Path(tier).rglob("data/*/*") if f.is_file())
    assert on_disk <= 1 << 20


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs to fill a real disk needs root")
def test_disk_full_under_the_tier_falls_back(source: Path, shm_dir: Path) -> None:
    mnt = shm_dir / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True)
    try:
        files = make_files(source, 30, size=200_000)
        cache = tierstore.Cache(source, [f"{mnt}/tier:2M"])
        (mnt / "filler").write_bytes(b"\0" * 1_500_000)  # the disk fills up behind the cache's back
        for p, b in files.items():
            assert cache.open(p).read() == b
        cache.wait()
        for p, b in files.items():
            assert cache.open(p).read() == b
        cache.wait()
        s = cache.stats()
        assert s["tiers"][0]["faults"] > 0 and s["tiers"][0]["entries"] < len(files)
        assert s["tiers"][0]["in_flight"] == 0, "a failed copy left its reservation behind"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo"])
def test_eviction_under_quota_with_concurrent_readers(source: Path, tier: str, policy: str) -> None:
    files = make_files(source, 120, size=8_000)
    quota = 200_000  # about a fifth of the data
    cache = tierstore.Cache(source, [f"{tier}:{quota}B"], policy=policy)
    pinned = next(iter(files))
    held = cache.open(pinned)  # a reader that holds its copy open across all the churn
    cache.wait()
    errors: list[str] = []
    over: list[int] = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        keys = list(files)
        for _ in range(EVICTION_READS):
            p = rng.choice(keys)
            with cache.open(p) as f:
                if f.read() != files[p]:
                    errors.append(str(p))
            used = cache.stats()["tiers"][0]["bytes_used"]
            if used > quota:
                over.append(used)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cache.wait()
    assert not errors and not over
    assert held.read() == files[pinned], "an evicted copy changed under its reader"
    s = cache.stats()["tiers"][0]
    assert s["evictions"] > 0 and s["bytes_used"] <= quota
    assert s["faults"] == 0, "a copy evicted between lookup and open was counted as damage"


def test_reader_holding_a_copy_blocks_its_eviction(source: Path, tier: str) -> None:
    files = make_files(source, 3, size=40_000)
    a, b, c = files
    cache = tierstore.Cache(source, [f"{tier}:100000B"], policy="fifo")
    for p in (a, b):
        cache.open(p).read()
        cache.wait()
    held = cache.open(a)  # the oldest entry, first in FIFO order, is being read
    assert held.backing == "tier"
    cache.open(c).read()
    cache.wait()
    assert cache.lookup(a) is not None and cache.lookup(b) is None, "eviction took the copy being read"
    assert held.read() == files[a]


SLOW_FETCH = """
import sys, time, tierstore
cache = tierstore.Cache(sys.argv[1], [sys.argv[2]], inline_max="1MiB")
f = cache.open(sys.argv[3])
f.read(1)            # the copy has started
print("started", flush=True)
time.sleep(60)
"""


def test_fetcher_killed_mid_copy_blocks_nobody(source: Path, tmp_path: Path) -> None:
    big = source / "big.bin"
    size = 512 << 20
    block = content(99, 1 << 20)
    whole = hashlib.sha256()  # the file's digest, taken as it is written (not of one large bytes object)
    with open(big, "wb") as f:
        for _ in range(size // len(block)):
            f.write(block)
            whole.update(block)
    tier = f"{tmp_path}/disk-tier:4G"  # a local-disk tier: slower than RAM, so the copy is surely mid-way
    child = subprocess.Popen(
        [os.sys.executable, "-c", SLOW_FETCH, str(source), tier, str(big)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "started"
        temps = list(Path(tmp_path, "disk-tier").glob("*/*/tmp/*"))
        assert len(temps) == 1 and temps[0].stat().st_size < size, "the copy was not in flight"
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        child.kill()
    t0 = time.monotonic()
    cache = tierstore.Cache(source, [tier])  # a new process: sweeps the dead fetcher's temp file
    assert not temps[0].exists()
    h = hashlib.sha256()
    with cache.open(big) as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    assert h.hexdigest() == whole.hexdigest()
    assert time.monotonic() - t0 < 60
    cache.wait()
    s = cache.stats()["tiers"][0]
    assert s["entries"] == 1 and s["in_flight"] == 0 and s["bytes_used"] == size
    shutil.rmtree(Path(tmp_path, "disk-tier"))
    big.unlink()


def test_unreadable_index_falls_back_to_the_source(source: Path, tier: str) -> None:
    (source / "a").write_bytes(b"still served")
    cache = tierstore.Cache(source, [f"{tier}:1M"])
    cache.open(source / "a").read()
    cache.wait()
    del cache
    for mdb in Path(tier).glob("*/*/index/data.mdb"):
        mdb.write_bytes(b"this is not an LMDB file" * 1000)

    def fresh_process_reads() -> tuple[bytes, dict]:
        c = tierstore.Cache(source, [f"{tier}:1M"])
        return c.open(source / "a").read(), c.stats()

    q: mp.Queue = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=_unreadable_index_child, args=(str(source), tier, q))
    p.start()
    data, stats = q.get(timeout=60)
    p.join(30)
    assert data == b"still served"
    assert stats["tiers"][0]["error"] and "LMDB" in stats["tiers"][0]["error"]
    assert stats["tiers"][0]["faults"] >= 1


def _unreadable_index_child(source: str, tier: str, q: mp.Queue) -> None:
    c = tierstore.Cache(source, [f"{tier}:1M"])
    q.put((c.open(os.path.join(source, "a")).read(), c.stats()))


def test_prefetch_warms_everything_and_reports_progress(source: Path, tier: str) -> None:
    files = make_files(source, 150, size=5_000)
    cache = tierstore.Cache(source, [f"{tier}:64M"])
    r = cache.prefetch(source, progress=False)
    assert r["files_total"] == r["files_done"] == r["files_copied"] == 150
    assert r["bytes_done"] == sum(len(b) for b in files.values()) and r["first_error"] is None
    before = cache.stats()["source"]["bytes_read"]
    for p, b in files.items():
        with cache.open(p) as f:
            assert f.backing == "tier" and f.read() == b
    assert cache.stats()["source"]["bytes_read"] == before
    again = cache.prefetch([source / "f0"], progress=False)
    assert again["files_copied"] == 0 and again["files_done"] == 50


def test_every_name_the_package_exports_resolves_in_a_fresh_process() -> None:
    """The face loads its modules on first use: each name of `__all__`, and the modules `import tierstore`
    used to load with it, are still there, and `import *` gives them all."""
    script = (
        "import tierstore\n"
        "assert tierstore.types.CacheStats.__name__ == 'CacheStats'\n"
        "names = {n: getattr(tierstore, n) for n in tierstore.__all__}\n"
        "assert tierstore.cache.Cache is names['Cache'] and tierstore.writeback.sync is names['sync']\n"
        "ns = {}\n"
        "exec('from tierstore import *', ns)\n"
        "assert all(ns[n] is v for n, v in names.items())\n"
        "assert set(tierstore.__all__) <= set(dir(tierstore))\n"
        "print(sorted(names))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "'Cache'" in r.stdout and "'sync'" in r.stdout, r.stdout
