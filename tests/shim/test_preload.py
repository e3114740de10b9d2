"""`tierstore run`: unmodified programs (Python with DataLoader workers, C, h5py) read through the cache,
measured by the stand-in parallel file system's own counters."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.cli import tierstore, tierstore_run
from tests.helpers.stores import store_stats

LOADER_JOB = textwrap.dedent(
    """
    import hashlib, json, os, sys
    import numpy as np, torch
    from torch.utils.data import DataLoader, Dataset

    class Images(Dataset):
        def __init__(self, paths): self.paths = paths
        def __len__(self): return len(self.paths)
        def __getitem__(self, i):
            with open(self.paths[i], "rb") as f:   # plain open(): the job is not changed for tierstore
                return torch.from_numpy(np.load(f))

    if __name__ == "__main__":
        root, workers, context = sys.argv[1], int(sys.argv[2]), sys.argv[3]
        paths = sorted(os.path.join(d, n) for d, _, ns in os.walk(root) for n in ns if n.endswith(".npy"))
        loader = DataLoader(Images(paths), batch_size=16, num_workers=workers,
                            multiprocessing_context=None if workers == 0 else context)
        for epoch in range(3):
            h = hashlib.sha256()
            for batch in loader:
                h.update(batch.numpy().tobytes())
            print(json.dumps({"epoch": epoch + 1, "digest": h.hexdigest()}), flush=True)
            sys.stdin.readline()   # the test reads the store's counters between epochs
    """
)


def make_images(root: Path, n: int) -> str:
    rng = np.random.default_rng(1)
    h = hashlib.sha256()
    batch = []
    for i in range(n):
        img = rng.integers(0, 256, size=(3, 32, 32), dtype=np.uint8)
        d = root / f"c{i % 3}"
        d.mkdir(exist_ok=True)
        np.save(d / f"{i:04d}.npy", img)
    # The digest of one epoch in sorted-path order, as the job computes it.
    paths = sorted(str(p) for p in root.rglob("*.npy"))
    for k in range(0, len(paths), 16):
        batch = np.stack([np.load(p) for p in paths[k : k + 16]])
        h.update(batch.tobytes())
    return h.hexdigest()


# Spawned and forkserver workers import torch anew every epoch: 6-15 s on 2 cores, twice that when busy.
# `make test-fast` runs 2 forked workers; no worker and 4 of them are `slow` too (3-5 s each).
@pytest.mark.parametrize(
    ("workers", "context"),
    [
        pytest.param(0, "fork", marks=pytest.mark.slow),
        (2, "fork"),
        pytest.param(4, "fork", marks=pytest.mark.slow),
        pytest.param(2, "spawn", marks=pytest.mark.slow),
        pytest.param(4, "spawn", marks=pytest.mark.slow),
        pytest.param(2, "forkserver", marks=pytest.mark.slow),
    ],
)
def test_dataloader_under_tierstore_run_reads_the_store_only_in_epoch_one(
    slow_store: tuple[Path, Path], tier: str, tmp_path: Path, workers: int, context: str
) -> None:
    backing, mount = slow_store
    expected = make_images(backing, 80)
    job = tmp_path / "job.py"
    job.write_text(LOADER_JOB)
    proc = tierstore_run(mount, f"{tier}:256M", sys.executable, str(job), str(mount), str(workers), context)
    counters = []
    for epoch in (1, 2, 3):
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        result = json.loads(line)
        assert result == {"epoch": epoch, "digest": expected}, "samples differ from a direct read"
        counters.append(store_stats(mount))
        proc.stdin.write("\n")
        proc.stdin.flush()
    assert proc.wait(60) == 0, proc.stderr.read()
    first, last = counters[0], counters[2]
    total = sum(p.stat().st_size for p in backing.rglob("*.npy"))
    assert first["bytes_read"] == total, "epoch 1 read some file twice or not at all"
    # Workers start anew every epoch (and under spawn re-import everything): still not one operation.
    sent = {op: last.get(op, 0) - n for op, n in first.items() if last.get(op, 0) != n}
    assert sent == {}, f"epochs 2-3 sent operations to the store: {sent}"


C_READER = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static unsigned long sum(const unsigned char *b, long n) { unsigned long s = 1469598103934665603UL; for (long i = 0; i < n; i++) s = (s ^ b[i]) * 1099511628211UL; return s; }

int main(int argc, char **argv) {
    struct stat st;
    if (stat(argv[1], &st) != 0) { perror("stat"); return 1; }
    long n = st.st_size;
    unsigned char *a = malloc(n), *b = malloc(n), *d = malloc(n);
    int fd = open(argv[1], O_RDONLY);
    if (fd < 0) { perror("open"); return 1; }
    long got = 0, r;
    while ((r = read(fd, a + got, n - got)) > 0) got += r;
    if (pread(fd, b, n, 0) != n) { perror("pread"); return 1; }
    unsigned char *m = mmap(NULL, n, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) { perror("mmap"); return 1; }
    FILE *f = fopen(argv[1], "rb");
    if (!f || fread(d, 1, n, f) != (size_t)n) { perror("fopen"); return 1; }
    char link[4096] = {0};
    char proc[64]; snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
    readlink(proc, link, sizeof link - 1);
    printf("%ld %lx %lx %lx %lx %s\n", got, sum(a, n), sum(b, n), sum(m, n), sum(d, n), link);
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
def test_c_program_reads_identical_bytes_with_read_pread_mmap_fopen(
    slow_store: tuple[Path, Path], tier: str, tmp_path: Path
) -> None:
    backing, mount = slow_store
    data = os.urandom(3 << 20)
    (backing / "blob.bin").write_bytes(data)
    src = tmp_path / "reader.c"
    src.write_text(C_READER)
    exe = tmp_path / "reader"
    subprocess.run(["cc", "-O2", "-o", str(exe), str(src)], check=True)
    direct = subprocess.run([str(exe), str(mount / "blob.bin")], capture_output=True, text=True, check=True)
    outputs = []
    for _ in range(2):
        p = tierstore_run(mount, f"{tier}:64M", str(exe), str(mount / "blob.bin"))
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        outputs.append(out.split())
    want = direct.stdout.split()
    for out in outputs:
        assert out[:5] == want[:5], "bytes differ from a direct read"
        assert out[5].startswith(tier), f"the descriptor is not the tier copy: {out[5]}"
    assert int(want[0]) == len(data)


H5_JOB = textwrap.dedent(
    """
    import sys, h5py, numpy as np
    with h5py.File(sys.argv[1], "r") as h:
        print(repr({k: h[k][...].tobytes().hex()[:64] + str(h[k][...].sum()) for k in sorted(h)}))
    """
)


def test_h5py_under_tierstore_run_and_tierstore_open_match_a_direct_read(
    slow_store: tuple[Path, Path], tier: str, tmp_path: Path
) -> None:
    h5py = pytest.importorskip("h5py")
    import tierstore

    backing, mount = slow_store
    rng = np.random.default_rng(3)
    arrays = {"x": rng.normal(size=(300, 40)), "labels": rng.integers(0, 10, size=300)}
    with h5py.File(backing / "data.h5", "w") as h:
        for k, v in arrays.items():
            h.create_dataset(k, data=v, chunks=True, compression="gzip")
    job = tmp_path / "h5.py"
    job.write_text(H5_JOB)
    direct = subprocess.run(
        [sys.executable, str(job), str(mount / "data.h5")], capture_output=True, text=True
    )
    for _ in range(2):
        p = tierstore_run(mount, f"{tier}:64M", sys.executable, str(job), str(mount / "data.h5"))
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0 and out == direct.stdout, err
    cache = tierstore.Cache(mount, [f"{tier}:64M"])
    with cache.open(mount / "data.h5") as f, h5py.File(f, "r") as h:
        for k, v in arrays.items():
            np.testing.assert_array_equal(h[k][...], v)


REWRITE_JOB = textwrap.dedent(
    """
    import os, sys
    p = sys.argv[1]
    print(open(p, "rb").read().decode())
    with open(p, "wb") as f:                      # a write through the source invalidates the copy
        f.write(b"rewritten under tierstore run")
    print(open(p, "rb").read().decode())
    tmp = p + ".new"
    with open(tmp, "wb") as f:
        f.write(b"replaced by rename")
    os.rename(tmp, p)
    print(open(p, "rb").read().decode())
    os.unlink(p)
    print(os.path.exists(p))
    """
)


def test_file_rewritten_under_tierstore_run_is_read_back_new(
    slow_store: tuple[Path, Path], tier: str, tmp_path: Path
) -> None:
    backing, mount = slow_store
    (backing / "f.txt").write_bytes(b"original")
    job = tmp_path / "rw.py"
    job.write_text(REWRITE_JOB)
    p = tierstore_run(mount, f"{tier}:64M", sys.executable, str(job), str(mount / "f.txt"))
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert out.split("\n")[:4] == ["original", "rewritten under tierstore run", "replaced by rename", "False"]


REOPEN_JOB = textwrap.dedent(
    """
    import sys
    path = sys.argv[1]
    for _ in range(3):   # fetched, then warm: its name and its entry kept by this process
        with open(path, "rb") as f:
            print(f.read().decode(), flush=True)
    sys.stdin.readline()   # the test replaces the copy from another process meanwhile
    with open(path, "rb") as f:
        print(f.read().decode(), flush=True)
    """
)


def test_a_name_opened_again_after_another_process_replaced_its_copy_reads_the_new_copy(
    source: Path, tier: str, tmp_path: Path
) -> None:
    """The shim keeps the names it opened warm and the entries it found (see `names.rs`, `Lookup::published_of`);
    a copy replaced by another process moves the index's change number, and the next open of the same name
    reads the new copy, without a request to the store."""
    import tierstore

    f = source / "f.txt"
    f.write_bytes(b"version one")
    job = tmp_path / "reopen.py"
    job.write_text(REOPEN_JOB)
    p = tierstore_run(source, f"{tier}:64M", sys.executable, str(job), str(f))
    assert p.stdout is not None and p.stdin is not None
    assert [p.stdout.readline().strip() for _ in range(3)] == ["version one"] * 3
    cache = tierstore.Cache(source, [f"{tier}:64M"], revalidate="never")
    f.write_bytes(b"version two, longer")
    cache._core.invalidate(str(f))
    assert cache.open(f).read() == b"version two, longer"
    cache.wait()
    opens = cache.stats()["source"]["opens"]
    out, err = p.communicate("\n", timeout=60)
    assert p.returncode == 0, err
    assert out.strip() == "version two, longer"
    assert cache.stats()["source"]["opens"] == opens, "the job read the store again"


THREADS_JOB = textwrap.dedent(
    """
    import hashlib, os, signal, subprocess, sys, threading
    root = sys.argv[1]
    names = sorted(n for n in os.listdir(root) if n.endswith(".bin"))  # not the store's counters file
    signal.signal(signal.SIGUSR1, lambda *a: None)
    results = {}
    def reader(k):
        for n in names[k:] + names[:k]:
            with open(os.path.join(root, n), "rb") as f:
                results.setdefault(n, set()).add(hashlib.sha256(f.read()).hexdigest())
            os.kill(os.getpid(), signal.SIGUSR1)          # signals arrive mid-I/O
    threads = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
    [t.start() for t in threads]; [t.join() for t in threads]
    pid = os.fork()                                       # a forked child uses the cache too
    if pid == 0:
        os.chdir(root)
        with open(names[0], "rb") as f:                   # a relative path
            data = f.read()
        with open(os.path.join(root, "..", os.path.basename(root), names[1]), "rb") as f:   # with ..
            data2 = f.read()
        os._exit(0 if hashlib.sha256(data).hexdigest() in results[names[0]] and data2 else 3)
    _, status = os.waitpid(pid, 0)
    out = subprocess.run(["sha256sum", os.path.join(root, names[2])], capture_output=True, text=True).stdout
    print(all(len(v) == 1 for v in results.values()), os.waitstatus_to_exitcode(status), out.split()[0] in results[names[2]])
    """
)


def test_threads_fork_exec_signals_relative_paths(
    slow_store: tuple[Path, Path], tier: str, tmp_path: Path
) -> None:
    backing, mount = slow_store
    for i in range(30):
        (backing / f"{i:03d}.bin").write_bytes(os.urandom(50_000 + i))
    job = tmp_path / "threads.py"
    job.write_text(THREADS_JOB)
    p = tierstore_run(mount, f"{tier}:64M", sys.executable, str(job), str(mount))
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert out.split() == ["True", "0", "True"]
    assert store_stats(mount)["bytes_read"] == sum(50_000 + i for i in range(30)), "a file was fetched twice"


FORK_KEEPS_CONFIG_JOB = textwrap.dedent(
    """
    import os, sys
    files = sys.argv[1:]
    with open(files[0], "rb") as f:                  # the parent's engine starts, configured
        first = f.read()
    os.environ["TIERSTORE_REVALIDATE"] = "sometimes"  # no such mode: a configuration read now is an error
    pid = os.fork()
    if pid == 0:
        ok = True
        for name in files[1:]:
            with open(name, "rb") as f:
                ok &= f.read() == bytes([int(os.path.basename(name)[:2])]) * 1000
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), first == bytes([0]) * 1000)
    """
)


def test_a_forked_child_keeps_the_configuration_its_parent_read(tmp_path: Path, tier: str) -> None:
    """A forked worker builds an engine of its own but does not read the configuration again (issue #51,
    item 5): its parent's, read before the fork, serves it. Shown by an environment the parent spoiled
    after its first read: read again, it would leave the child without the cache."""
    source = tmp_path / "src"
    source.mkdir()
    files = [source / f"{i:02d}.bin" for i in range(10)]
    for i, f in enumerate(files):
        f.write_bytes(bytes([i]) * 1000)
    job = tmp_path / "fork.py"
    job.write_text(FORK_KEEPS_CONFIG_JOB)
    tiers = f"{tier}:16M"
    p = tierstore_run(source, tiers, sys.executable, str(job), *map(str, files))
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert out.split() == ["0", "True"], (out, err)
    assert "running without the cache" not in err, err
    status = tierstore("--source", str(source), "--tier", tiers, "status", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["tiers"][0]["misses"] == 10, (
        "the child's reads did not go through the cache"
    )


def test_symlink_into_the_source_reads_correct_bytes(
    slow_store: tuple[Path, Path], tier: str, tmp_path: Path
) -> None:
    backing, mount = slow_store
    (backing / "s.bin").write_bytes(b"through a symlink")
    link = tmp_path / "link"
    link.symlink_to(mount)
    p = tierstore_run(mount, f"{tier}:64M", "cat", str(link / "s.bin"))
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and out == "through a symlink", err


def test_run_reports_config_errors_and_missing_commands(tmp_path: Path, tier: str) -> None:
    r = tierstore("--source", str(tmp_path), "--tier", f"{tier}:9Q", "run", "--", "true")
    assert r.returncode != 0 and "not a size" in r.stderr
    r = tierstore("--source", str(tmp_path), "--tier", f"{tier}:1M", "run", "--", "no-such-program-xyz")
    assert r.returncode != 0 and "cannot run 'no-such-program-xyz'" in r.stderr


STREAM_JOB = textwrap.dedent(
    """
    import hashlib, json, os, sys, threading, time
    path, size = sys.argv[1], int(sys.argv[2])
    where = lambda fd: os.readlink(f"/proc/self/fd/{fd}")
    fd = os.open(path, os.O_RDONLY)
    first = os.read(fd, 65536)
    during = where(fd)                      # a miss on a large file: the source, while it is copied
    # read() in records with a seek back, pread() from threads, all while the copy grows
    parts, results = [first], {}
    os.lseek(fd, len(first) - 100, os.SEEK_SET)
    parts[0] = first[:-100]
    while chunk := os.read(fd, 1 << 20):
        parts.append(chunk)
    def preader(k):
        off = (k * 977_123) % size
        results[k] = (off, os.pread(fd, 300_000, off))
    threads = [threading.Thread(target=preader, args=(k,)) for k in range(6)]
    [t.start() for t in threads]; [t.join() for t in threads]
    # once the copy is finished, a read moves the descriptor to it, at the same offset
    os.lseek(fd, 1234, os.SEEK_SET)
    seen, deadline = set(), time.monotonic() + 60
    while not where(fd).startswith(sys.argv[3]) and time.monotonic() < deadline:
        seen.add(os.read(fd, 10)); os.lseek(fd, 1234, os.SEEK_SET)
        time.sleep(0.01)
    seen.add(os.read(fd, 10))
    after = where(fd)
    os.close(fd)
    print(json.dumps({
        "sha": hashlib.sha256(b"".join(parts)).hexdigest(),
        "preads": {k: [off, hashlib.sha256(b).hexdigest()] for k, (off, b) in results.items()},
        "during": during, "after": after, "seen": sorted(s.hex() for s in seen),
    }))
    """
)


def test_large_miss_under_tierstore_run_reads_while_copying_then_moves_to_the_copy(
    throttled_store: tuple[Path, Path], tier: str, tmp_path: Path
) -> None:
    """A large uncached file is served at once from its growing copy (the store is read once, by the copy)
    and the descriptor moves to the finished copy at the same offset (MONARCH's swap)."""
    backing, mount = throttled_store
    data = os.urandom(6 << 20)  # about 0.75 s to copy at 8 MiB/s
    (backing / "shard.bin").write_bytes(data)
    job = tmp_path / "stream.py"
    job.write_text(STREAM_JOB)
    env = {**os.environ, "TIERSTORE_INLINE_MAX": "1M"}
    p = tierstore_run(
        mount,
        f"{tier}:64M",
        sys.executable,
        str(job),
        str(mount / "shard.bin"),
        str(len(data)),
        tier,
        env=env,
    )
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    r = json.loads(out)
    assert r["sha"] == hashlib.sha256(data).hexdigest(), "read() with a seek back returned wrong bytes"
    for off, digest in r["preads"].values():
        assert digest == hashlib.sha256(data[off : off + 300_000]).hexdigest(), f"pread at {off} wrong"
    assert r["during"] == str(mount / "shard.bin"), "a miss should not wait for the whole copy"
    assert r["after"].startswith(tier), f"the descriptor did not move to the finished copy: {r['after']}"
    assert r["seen"] == [data[1234:1244].hex()], "the move lost the descriptor's offset"
    assert store_stats(mount)["bytes_read"] == len(data), "the store was not read exactly once"


STREAM_REUSE_JOB = textwrap.dedent(
    """
    import ctypes, os, sys
    big, other = sys.argv[1], sys.argv[2]
    fd = os.open(big, os.O_RDONLY)                  # followed by the shim while it is copied
    head = os.pread(fd, 16, 0)
    pid = os.fork()
    if pid == 0:                                    # a forked child reads the inherited descriptor natively
        ok = os.pread(fd, 4096, 5000) == open(sys.argv[3], "rb").read()[5000:9096]
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    libc = ctypes.CDLL(None, use_errno=True)
    sys_close = {"x86_64": 3, "aarch64": 57}[os.uname().machine]
    assert libc.syscall(sys_close, fd) == 0         # a raw system call: no shim sees this close
    fd2 = os.open(other, os.O_RDONLY)               # the same number, another file
    print(fd2 == fd, os.read(fd2, 100).decode(), os.waitstatus_to_exitcode(status), len(head))
    """
)


def test_descriptor_closed_behind_the_shim_and_reused_reads_its_own_file(
    throttled_store: tuple[Path, Path], tier: str, tmp_path: Path
) -> None:
    backing, mount = throttled_store
    data = os.urandom(6 << 20)
    (backing / "shard.bin").write_bytes(data)
    (tmp_path / "copy-of-shard.bin").write_bytes(data)
    (tmp_path / "other.txt").write_text("not the shard")
    job = tmp_path / "reuse.py"
    job.write_text(STREAM_REUSE_JOB)
    env = {**os.environ, "TIERSTORE_INLINE_MAX": "1M"}
    args = [str(mount / "shard.bin"), str(tmp_path / "other.txt"), str(tmp_path / "copy-of-shard.bin")]
    p = tierstore_run(mount, f"{tier}:64M", sys.executable, str(job), *args, env=env)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert out.split() == ["True", "not", "the", "shard", "0", "16"]


def test_status_counts_a_cold_run_as_misses_and_a_warm_run_as_hits_with_the_bytes_served(
    tmp_path: Path, tier: str
) -> None:
    """A cold open is one miss (not a miss and then a hit of the copy it fetched), and a program that reads
    the copy's descriptor itself is counted as served the copy's bytes."""
    source = tmp_path / "src"
    source.mkdir()
    files = [source / f"{i:02d}.bin" for i in range(20)]
    for i, f in enumerate(files):
        f.write_bytes(bytes([i]) * (1000 + i))
    total = sum(f.stat().st_size for f in files)
    tiers = f"{tier}:16M"

    def counts() -> dict[str, int]:
        status = tierstore("--source", str(source), "--tier", tiers, "status", "--json")
        assert status.returncode == 0, status.stderr
        t = json.loads(status.stdout)["tiers"][0]
        return {k: t[k] for k in ("hits", "misses", "bytes_served")}

    for run, expected in enumerate(
        (
            {"hits": 0, "misses": 20, "bytes_served": total},
            {"hits": 20, "misses": 20, "bytes_served": 2 * total},
        )
    ):
        proc = tierstore_run(source, tiers, "cat", *map(str, files))
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert len(out) == total
        assert counts() == expected, f"after run {run + 1}"
