"""Unmodified savers under `tierstore run` (torch.save, numpy.save, h5py, torch.distributed.checkpoint,
tmp+rename, writes through a mapping): the files on the store are identical to a direct run's, and
listings show the staged files."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import signal
import warnings
from pathlib import Path

import pytest

from tests.helpers.writeback import setup, staged_copies_go

# Saved under `tierstore run` by the frameworks' own savers: each file's digest as the program reads it back
# (through the shim: read-your-writes of the staged copy) is printed, and a local copy is written too.
SAVERS = r"""
import hashlib, json, os, sys
import numpy as np
import torch
from safetensors.numpy import save_file
import h5py

out, ref = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
state = {"w": torch.randn(64, 64), "b": torch.arange(10)}
arrays = {"emb": np.arange(4096, dtype=np.float32).reshape(64, 64)}
for d in (out, ref):
    os.makedirs(d, exist_ok=True)
    torch.save(state, os.path.join(d, "model.pt"))
    np.save(os.path.join(d, "arr.npy"), arrays["emb"])
    save_file(arrays, os.path.join(d, "w.safetensors"))
    with h5py.File(os.path.join(d, "data.h5"), "w") as f:
        f.create_dataset("x", data=arrays["emb"])
    tmp = os.path.join(d, "last.ckpt.tmp")          # a Lightning-style saver: temporary, then rename
    with open(tmp, "wb") as f:
        torch.save(state, f)
    os.replace(tmp, os.path.join(d, "last.ckpt"))
    with open(os.path.join(d, "log.txt"), "a") as f:  # stdio append
        f.write("epoch 1\n")
    if d == out:  # creat(2) through libc, as C programs call it
        import ctypes
        fd = ctypes.CDLL(None, use_errno=True).creat(os.path.join(d, "creat.bin").encode(), 0o644)
        assert fd >= 0, ctypes.get_errno()
        os.write(fd, b"made by creat")
        os.close(fd)
    fd = os.open(os.path.join(d, "unclosed.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.write(fd, b"left open at exit")  # never closed: journaled by the shim at exit
import warnings
import torch.distributed.checkpoint as dcp
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # a single process, no process group: dcp says so
    dcp.save(state, checkpoint_id=os.path.join(out, "dcp"))
names = ["model.pt", "arr.npy", "w.safetensors", "data.h5", "last.ckpt", "log.txt", "unclosed.bin", "creat.bin"]
seen = {}
for n in names:
    p = os.path.join(out, n)
    seen[n] = [os.path.getsize(p), hashlib.sha256(open(p, "rb").read()).hexdigest()]
print(json.dumps(seen))
"""


@pytest.mark.fuse
def test_framework_savers_under_run_give_identical_files_on_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("h5py")
    pytest.importorskip("safetensors")
    with setup(tmp_path, monkeypatch, write_bandwidth="16MiB/s") as s:
        ref = tmp_path / "local-ref"
        p = s.python(SAVERS, str(s.dest / "run1"), str(ref), run=True)
        assert p.returncode == 0, p.stderr[-3000:]
        seen = json.loads(p.stdout.strip().splitlines()[-1])
        # Read-your-writes: the program saw its files (sizes and bytes) before they were on the store.
        p = s.cli("sync", str(s.dest), "--timeout", "60")
        assert p.returncode == 0, p.stderr
        for name, (size, digest) in seen.items():
            stored = s.stored(f"run1/{name}").read_bytes()
            assert (len(stored), hashlib.sha256(stored).hexdigest()) == (size, digest), name
            # HDF5 files carry no timestamps here, but the check is kept to formats that promise it.
            if name not in ("data.h5", "creat.bin"):
                assert stored == (ref / name).read_bytes(), (
                    f"{name} differs from the same save to a local disk"
                )
        assert not s.stored("run1/last.ckpt.tmp").exists()
        staged_copies_go(s.stage)
        import torch

        state = torch.load(s.stored("run1/last.ckpt"))
        assert torch.equal(state["b"], torch.arange(10))
        # torch.distributed.checkpoint's FileSystemWriter (`dcp.save`): loads back from the store.
        import torch.distributed.checkpoint as dcp

        into = {"w": torch.zeros(64, 64), "b": torch.zeros(10, dtype=torch.long)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(into, checkpoint_id=str(s.stored("run1/dcp")))
        assert torch.equal(into["w"], state["w"]) and torch.equal(into["b"], state["b"])


ASYNC_SAVE = r"""
import hashlib, json, os, sys, warnings
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.fsspec_filesystem import FsspecWriter

out, ref, how, pg = sys.argv[1:5]
os.environ["MASTER_ADDR"] = "127.0.0.1"  # the saving process's own group: on loopback
dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{pg}")
torch.manual_seed(0)
state = {"w": torch.randn(512, 512), "b": torch.arange(1000), "step": torch.tensor(7)}
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    # The checkpoint is saved in the background while the program goes on; the future ends it.
    if how == "api":  # the Python API: fsspec's tierstore:// through torch's FsspecWriter
        future = dcp.async_save(state, storage_writer=FsspecWriter(f"tierstore://{out}"))
    elif how == "process":  # under `tierstore run`, saved by a background process torch starts
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        future = dcp.async_save(state, checkpoint_id=out, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    else:  # an unmodified program under `tierstore run`: FileSystemWriter
        future = dcp.async_save(state, checkpoint_id=out)
    future.result()
    dcp.save(state, checkpoint_id=ref)
dist.destroy_process_group()
seen = {}
for name in ("__0_0.distcp", ".metadata"):  # read back before they are on the store
    opener = open if how != "api" else __import__("tierstore").open
    with opener(os.path.join(out, name), "rb") as f:
        seen[name] = hashlib.sha256(f.read()).hexdigest()
print(json.dumps(seen))
"""


# `make test-fast` runs "api"; "run" and "process" are `slow` (5-10 s each: a process that imports torch,
# and for "process" a second one torch starts to save in). The framework savers' test above saves with dcp
# under `tierstore run` in the fast set too.
@pytest.mark.fuse
@pytest.mark.parametrize(
    "how",
    [pytest.param("run", marks=pytest.mark.slow), pytest.param("process", marks=pytest.mark.slow), "api"],
)
def test_dcp_async_save_gives_identical_files_on_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """torch.distributed.checkpoint.async_save (one gloo process), under `tierstore run` (saved by a
    thread, or by the background process torch starts) and through the Python API (fsspec's
    tierstore:// under torch's FsspecWriter): after sync, the store holds the
    bytes the program wrote and read back, the data file identical to the same save to a local disk,
    and the checkpoint loads from the store."""
    pytest.importorskip("torch")
    with setup(tmp_path, monkeypatch, write_bandwidth="16MiB/s") as s:
        s.start_agent()
        ref = tmp_path / "local-ref"
        out = s.dest / f"async-{how}"
        if how == "api":
            out.mkdir()
        p = s.python(ASYNC_SAVE, str(out), str(ref), how, str(tmp_path / "pg"), run=how != "api", timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        seen = json.loads(p.stdout.strip().splitlines()[-1])
        p = s.cli("sync", str(s.dest), "--timeout", "60")
        assert p.returncode == 0, p.stderr
        for name, digest in seen.items():
            stored = s.stored(f"async-{how}/{name}").read_bytes()
            assert hashlib.sha256(stored).hexdigest() == digest, name
        # .metadata differs from save to save (torch writes a fresh id in it); the data does not.
        assert s.stored(f"async-{how}/__0_0.distcp").read_bytes() == (ref / "__0_0.distcp").read_bytes()
        assert not list(s.stored(f"async-{how}").glob("*.tmp")), "the commit rename reached the store"
        staged_copies_go(s.stage)
        import torch
        import torch.distributed.checkpoint as dcp

        into = {"w": torch.zeros(512, 512), "b": torch.zeros(1000, dtype=torch.long), "step": torch.tensor(0)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(into, checkpoint_id=str(s.stored(f"async-{how}")))
        torch.manual_seed(0)
        assert torch.equal(into["w"], torch.randn(512, 512)) and int(into["step"]) == 7


LISTING = r"""
import json, os, sys
d = sys.argv[1]
for n in ("a.bin", "b.bin", "sub/c.bin"):
    with open(os.path.join(d, n), "wb") as f:
        f.write(n.encode())
files = sorted((e.name, e.stat().st_size) for e in os.scandir(d) if e.is_file())
print(json.dumps({"top": sorted(os.listdir(d)), "sub": sorted(os.listdir(os.path.join(d, "sub"))), "files": files}))
"""


@pytest.mark.fuse
def test_listings_under_run_show_staged_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `tierstore run`, a listing of a destination's directory shows the files staged there and not
    yet on the store (once each, also when an older copy is on the store), with their staged sizes."""
    with setup(tmp_path, monkeypatch) as s:
        s.start_agent()
        s.stored("l/sub").mkdir(parents=True)
        s.stored("l/old.bin").write_bytes(b"on the store")
        s.stored("l/a.bin").write_bytes(b"an older a")
        s.fail_file.touch()  # the store takes no write: everything written stays staged
        p = s.python(LISTING, str(s.dest / "l"), run=True)
        assert p.returncode == 0, p.stderr[-3000:]
        out = json.loads(p.stdout.strip().splitlines()[-1])
        assert out["top"] == ["a.bin", "b.bin", "old.bin", "sub"]
        assert out["sub"] == ["c.bin"]
        assert out["files"] == [["a.bin", 5], ["b.bin", 5], ["old.bin", 12]]
        assert not s.stored("l/b.bin").exists() and s.stored("l/a.bin").read_bytes() == b"an older a"
        s.fail_file.unlink()
        p = s.cli("sync", str(s.dest), "--timeout", "60")
        assert p.returncode == 0, p.stderr
        assert sorted(os.listdir(s.stored("l"))) == out["top"]
        assert s.stored("l/a.bin").read_bytes() == b"a.bin"


MAPPED = r"""
import ctypes, json, mmap, os, sys
import numpy as np

d = sys.argv[1]
size = 1 << 20
pattern = lambda n: (np.arange(size, dtype=np.uint64) * n % 251).astype(np.uint8)
seen = {}
# numpy's memmap closes its file at once and writes through the mapping afterwards.
a = np.memmap(os.path.join(d, "np.bin"), dtype=np.uint8, mode="w+", shape=(size,))
a[:] = pattern(3)
a.flush()
with open(os.path.join(d, "np.bin"), "rb") as f:  # read-your-writes while still mapped
    seen["np.bin"] = f.read() == pattern(3).tobytes()
del a
# Python's mmap: the descriptor is closed first, the mapping written and closed later.
with open(os.path.join(d, "py.bin"), "wb+") as f:
    f.truncate(size)
    m = mmap.mmap(f.fileno(), size)
m[:] = pattern(5).tobytes()
m.close()
# A mapping never unmapped: the file is taken at exit.
fd = os.open(os.path.join(d, "exit.bin"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
os.ftruncate(fd, size)
kept = mmap.mmap(fd, size)
os.close(fd)
kept[:] = pattern(7).tobytes()
ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))  # never freed: still mapped when the process exits
print(json.dumps(seen))
"""


@pytest.mark.fuse
def test_writes_through_a_mapping_after_close_are_taken_at_munmap_or_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A staged file written through `mmap` after its descriptor was closed (numpy's memmap, Python's
    mmap) is journaled when its last mapping goes, or at exit: the store gets the mapped writes."""
    np = pytest.importorskip("numpy")
    with setup(tmp_path, monkeypatch) as s:
        s.start_agent()
        (s.dest / "m").mkdir()
        p = s.python(MAPPED, str(s.dest / "m"), run=True)
        assert p.returncode == 0, p.stderr[-3000:]
        assert json.loads(p.stdout.strip().splitlines()[-1]) == {"np.bin": True}
        p = s.cli("sync", str(s.dest), "--timeout", "60", timeout=120)
        assert p.returncode == 0, p.stderr
        size = 1 << 20
        for name, n in (("np.bin", 3), ("py.bin", 5), ("exit.bin", 7)):
            want = (np.arange(size, dtype=np.uint64) * n % 251).astype(np.uint8).tobytes()
            assert s.stored(f"m/{name}").read_bytes() == want, f"{name}: the store lacks the mapped writes"
        staged_copies_go(s.stage)


CHECKPOINT = r"""
import os, sys
d = sys.argv[1]
os.makedirs(d, exist_ok=True)
for i in range(int(sys.argv[2])):
    with open(os.path.join(d, f"shard-{i}.pt"), "wb") as f:
        f.write(b"shard %d" % i)
try:
    open(d, "wb")
    print("opened a directory")
except IsADirectoryError:
    print("EISDIR")
os.mkdir(os.path.join(d, "sub"))
try:  # in the burst: the directory of the shards was found a moment ago
    open(os.path.join(d, "sub"), "wb")
    print("opened a directory")
except IsADirectoryError:
    print("EISDIR")
"""


@pytest.mark.fuse
def test_a_checkpoint_asks_the_store_for_its_directory_once_not_for_each_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst of files created in one directory under `tierstore run` asks the store about that directory
    once, not again for each file; a directory opened to write is still EISDIR, in the burst too."""
    from tierstore.testing.slowfs import read_stats

    with setup(tmp_path, monkeypatch) as s:
        agent = s.start_agent()
        asked = {}
        # Twice, with 30 files and with 60: what the 30 more cost (starting Python and `tierstore run` ask
        # the store too, the same each time). The agent is stopped while the program runs, so that nothing
        # migrates and the counts are the program's own: after a `sync`, so that the stop finds it idle. The
        # journal's write lock is held meanwhile, as an agent stopped in the middle of a write to the journal
        # holds it: a program's buffered closes never wait for it (they once waited for it without end,
        # opening the journal).
        for n in (30, 60):
            assert s.cli("sync", str(s.dest), "--timeout", "60").returncode == 0
            os.kill(agent, signal.SIGSTOP)
            try:
                with open(s.stage / "journal" / "writer.lock", "rb") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    before = read_stats(s.mount)
                    p = s.python(CHECKPOINT, str(s.dest / f"step-{n}"), str(n), run=True, timeout=60)
                    asked[n] = read_stats(s.mount).get("getattr", 0) - before.get("getattr", 0)
            finally:
                os.kill(agent, signal.SIGCONT)
            assert p.returncode == 0, p.stderr[-3000:]
            assert p.stdout.split() == ["EISDIR", "EISDIR"], p.stdout
        # What one `stat` of a missing file there costs the store (the kernel looks up each component).
        before = read_stats(s.mount)
        assert not (s.dest / "step-60" / "missing.pt").exists()
        one = read_stats(s.mount).get("getattr", 0) - before.get("getattr", 0)
        # A stat of each new file, and of its directory once per burst (before: also once per file).
        more = asked[60] - asked[30]
        assert 0 < more <= 30 * one + 4, f"metadata requests by files written: {asked}; one stat: {one}"
        p = s.cli("sync", str(s.dest), "--timeout", "60")
        assert p.returncode == 0, p.stderr
        for n in (30, 60):
            for i in range(n):
                assert s.stored(f"step-{n}/shard-{i}.pt").read_bytes() == b"shard %d" % i


# Under `tierstore run`: the parent writes a file (its write-back starts, configured), spoils the
# configuration in its environment, and forks a child that writes another.
FORKED_WRITER = r"""
import os, sys
out = sys.argv[1]
with open(os.path.join(out, "parent.bin"), "wb") as f:
    f.write(b"p" * 100_000)
os.environ["TIERSTORE_WRITEBACK"] = "not a destination"
pid = os.fork()
if pid == 0:
    with open(os.path.join(out, "child.bin"), "wb") as f:
        f.write(b"c" * 100_000)
    os._exit(0)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.fuse
def test_a_forked_writer_stages_to_the_destinations_its_parent_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forked child under `tierstore run` keeps the write-back destinations its parent read (issue #51,
    item 5: no configuration read again per worker), with journal handles of its own: both files are
    staged and reach the store whole."""
    with setup(tmp_path, monkeypatch) as s:
        (s.dest / "fork").mkdir()
        s.fail_file.touch()  # the store takes no write: a file written straight to it fails the writer
        p = s.python(FORKED_WRITER, str(s.dest / "fork"), run=True)
        assert p.returncode == 0, p.stderr[-3000:]
        assert "writes go straight to the store" not in p.stderr, p.stderr
        s.fail_file.unlink()
        p = s.cli("sync", str(s.dest), "--timeout", "60")
        assert p.returncode == 0, p.stderr
        for name, byte in (("parent.bin", b"p"), ("child.bin", b"c")):
            assert s.stored(f"fork/{name}").read_bytes() == byte * 100_000, name
