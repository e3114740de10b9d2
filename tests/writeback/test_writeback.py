"""Write-back staging against real processes, real files and the stand-in store (FUSE): writes land on
the node's stage, the agent migrates them in close order, kills of the writer and of the agent lose
nothing acknowledged and never show a partial file or a commit file early."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import soak
from tests.helpers.cli import tierstore
from tests.helpers.data import blob
from tests.helpers.stores import mounted_store
from tests.helpers.wait import wait_for
from tierstore.agent import answers

PART = ".tierstore-part"


@dataclass
class Setup:
    """A destination on the stand-in store, a stage, this test's own agent socket, and the environment."""

    backing: Path
    mount: Path
    dest: Path
    stage: Path
    env: dict[str, str]
    fail_file: Path
    started: list[int] = field(default_factory=list)

    @property
    def socket(self) -> Path:
        return Path(self.env["XDG_RUNTIME_DIR"]) / "tierstore" / "agent.sock"

    def stored(self, rel: str) -> Path:
        """The file as the store's backing directory holds it (what a reader of the store gets)."""
        return self.backing / "ckpt" / rel

    def start_agent(self) -> int:
        from tierstore import agent

        try:
            pid, _ = agent.start(self.socket, env=self.env, idle_exit=600)
        except agent.AgentError:
            # A writer started one on demand meanwhile.
            found = self.agent_pid()
            if found is None:
                raise
            pid = found
        self.started.append(pid)
        return pid

    def agent_pid(self) -> int | None:
        from tierstore import agent

        report = agent.status(self.socket)
        return json.loads(report)["pid"] if report else None

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return tierstore(*args, env=self.env, timeout=timeout)

    def python(
        self, code: str, *args: str, run: bool = False, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-c", code, *args]
        if run:
            cmd = [sys.executable, "-m", "tierstore.cli", "run", "--", *cmd]
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def setup(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    quota: str = "1G",
    durability: str = "local",
    stage: Path | None = None,
    **store: str,
) -> Iterator[Setup]:
    fail_file = tmp_path / "store-outage"
    with mounted_store(tmp_path, fail_file=fail_file, **store) as (backing, mount):  # type: ignore[arg-type]
        dest = mount / "ckpt"
        dest.mkdir()
        stage = stage or tmp_path / "stage"
        data = tmp_path / "data"
        data.mkdir()
        run = tmp_path / "run"
        run.mkdir()
        env = {
            **os.environ,
            "XDG_RUNTIME_DIR": str(run),
            "TIERSTORE_WRITEBACK": f"{dest}:{stage}:{quota}:{durability}",
            "TIERSTORE_SOURCE": str(data),
            "TIERSTORE_TIERS": f"{tmp_path / 'tier'}:64M",
        }
        for k in ("XDG_RUNTIME_DIR", "TIERSTORE_WRITEBACK"):
            monkeypatch.setenv(k, env[k])
        import tierstore.writeback

        tierstore.writeback.reload()
        s = Setup(backing, mount, dest, stage, env, fail_file)
        try:
            yield s
        finally:
            from tierstore import agent

            with contextlib.suppress(Exception):
                agent.stop(s.socket)
            for pid in s.started:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            tierstore.writeback.reload()


@pytest.mark.fuse
def test_a_job_that_only_stages_its_checkpoints_needs_no_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Write-back alone is one variable: `tierstore run` with no source configured stages the writes, and
    no process of the job warns about the missing source."""
    with setup(tmp_path, monkeypatch) as s:
        s.env.pop("TIERSTORE_SOURCE")
        s.env.pop("TIERSTORE_TIERS")
        code = (
            "import sys, subprocess; open(sys.argv[1], 'wb').write(b'ckpt' * 1000); subprocess.run(['true'])"
        )
        s.fail_file.touch()  # the store refuses writes: what reaches it later was staged
        p = s.python(code, str(s.dest / "a.bin"), run=True)
        assert p.returncode == 0, p.stderr
        assert "source" not in p.stderr, p.stderr
        from tierstore import writeback

        assert writeback.pending()[0]["files"] == 1, "the write was not staged"
        assert not (s.backing / "ckpt" / "a.bin").exists()
        s.fail_file.unlink()
        synced = s.cli("sync", str(s.dest), "--timeout", "60")
        assert synced.returncode == 0, synced.stderr
        assert (s.backing / "ckpt" / "a.bin").read_bytes() == b"ckpt" * 1000
        ordered = s.cli("run", "--order", str(tmp_path / "order.txt"), "--", "true")
        assert ordered.returncode != 0 and "no source" in ordered.stderr, ordered.stderr


def test_configuration_errors_name_the_key_and_the_fix(tmp_path: Path) -> None:
    env = {**os.environ, "TIERSTORE_WRITEBACK": f"{tmp_path}/nowhere:{tmp_path}/stage"}
    p = subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "sync"], env=env, capture_output=True, text=True
    )
    assert p.returncode == 1
    assert "writeback[0].path" in p.stderr and "mkdir" in p.stderr, p.stderr
    (tmp_path / "d").mkdir()
    env["TIERSTORE_WRITEBACK"] = f"{tmp_path}/d:{tmp_path}/stage:1G:eventually"
    p = subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "sync"], env=env, capture_output=True, text=True
    )
    assert p.returncode == 1 and "writeback[0].durability" in p.stderr and '"remote"' in p.stderr, p.stderr


@pytest.mark.fuse
def test_python_writes_stage_read_back_and_sync_to_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tierstore
    from tierstore import writeback

    with setup(tmp_path, monkeypatch, write_bandwidth="4MiB/s") as s:
        s.start_agent()
        data = blob("model.bin", 3 << 20)
        start = time.monotonic()
        with tierstore.open(s.dest / "model.bin", "wb") as f:
            f.write(data)
        closed = time.monotonic() - start
        # Staged, not yet on the store (which takes 3 MiB in about 0.75 s): read-your-writes from the stage.
        assert not s.stored("model.bin").exists()
        with tierstore.open(s.dest / "model.bin", "rb") as f:
            assert f.read() == data
        pending = writeback.pending()
        assert pending[0]["files"] == 1 and pending[0]["bytes"] == len(data)
        status = json.loads(s.cli("status", "--json").stdout)
        assert status["writeback"][0]["files"] == 1 and status["writeback"][0]["oldest_age_s"] >= 0
        tierstore.sync(timeout=30)
        assert s.stored("model.bin").read_bytes() == data
        assert closed < 0.75, f"close waited for the store ({closed:.2f} s)"
        assert list((s.stage / "data").iterdir()) == [], "the staged copy goes once the store has it"
        assert not list(s.stored("").glob(f"*{PART}"))
        # Once migrated, reads go to the store; `tierstore sync` has nothing left.
        assert tierstore.open(s.dest / "model.bin", "rb").read() == data
        p = s.cli("sync", str(s.dest), "--timeout", "5")
        assert p.returncode == 0, p.stderr


@pytest.mark.fuse
def test_fsspec_writes_stage_read_back_and_sync_to_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fsspec

    import tierstore

    with setup(tmp_path, monkeypatch, write_bandwidth="4MiB/s") as s:
        s.start_agent()
        data = blob("fs.bin", 2 << 20)
        with fsspec.open(f"tierstore://{s.dest}/fs.bin", "wb") as f:
            f.write(data)
        with fsspec.open(f"tierstore://{s.dest}/notes.txt", "w") as f:
            f.write("written as text")
        # Staged (the store takes 2 MiB in about 0.5 s); fsspec reads it back from the stage.
        assert not s.stored("fs.bin").exists()
        with fsspec.open(f"tierstore://{s.dest}/fs.bin", "rb") as f:
            assert f.read() == data
        fs = fsspec.filesystem("tierstore")
        with fs.open(str(s.dest / "notes.txt"), "a") as f:
            f.write(", then appended")
        tierstore.sync(timeout=30)
        assert s.stored("fs.bin").read_bytes() == data
        assert s.stored("notes.txt").read_text() == "written as text, then appended"
        assert list((s.stage / "data").iterdir()) == []
        with pytest.raises(ValueError, match="reads only outside"):
            fs.open(str(tmp_path / "elsewhere.bin"), "wb")


@pytest.mark.fuse
def test_remote_durability_returns_once_on_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tierstore

    with setup(tmp_path, monkeypatch, durability="remote") as s:
        data = blob("r.bin", 1 << 20)
        with tierstore.open(s.dest / "r.bin", "wb") as f:
            f.write(data)
        assert s.stored("r.bin").read_bytes() == data, "close returned before the store had the file"


@pytest.mark.fuse
def test_files_reach_the_store_in_close_and_rename_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tierstore
    from tierstore import writeback

    with setup(tmp_path, monkeypatch, write_bandwidth="8MiB/s") as s:
        seen: list[tuple[float, str]] = []
        stop = threading.Event()

        def watch() -> None:
            known: set[str] = set()
            while not stop.is_set():
                for p in (s.backing / "ckpt" / "step").glob("*"):
                    if p.name not in known and not p.name.endswith(PART):
                        known.add(p.name)
                        seen.append((time.monotonic(), p.name))
                time.sleep(0.002)

        (s.dest / "step").mkdir()
        t = threading.Thread(target=watch)
        t.start()
        names = [f"shard{i}.bin" for i in range(4)]
        for n in names:
            with tierstore.open(s.dest / "step" / n, "wb") as f:
                f.write(blob(n, 512 << 10))
        with tierstore.open(s.dest / "step" / "meta.tmp", "wb") as f:
            f.write(b"commit")
        writeback.rename(s.dest / "step" / "meta.tmp", s.dest / "step" / "meta")
        tierstore.sync(timeout=30)
        stop.set()
        t.join()
        order = [n for _, n in sorted(seen)]
        assert order == [*names, "meta"], order
        for n in names:
            assert s.stored(f"step/{n}").read_bytes() == blob(n, 512 << 10)
        assert not s.stored("step/meta.tmp").exists()


# The writer of the kill test: checkpoint after checkpoint, each a few data files and then a commit file
# (written under a temporary name and renamed, every other step), each close acknowledged in a log.
# (`blob` is tests.helpers.data.blob's own source, so that the test checks the store by the same function.)
WRITER = (
    r"""
import hashlib, os, sys, time
import tierstore
from tierstore import writeback

dest, acks, first, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
# "api": tierstore.open and tierstore.writeback.rename; "run": plain open and os.replace under `tierstore run`.
save = tierstore.open if mode == "api" else open
replace = writeback.rename if mode == "api" else os.replace

"""
    + inspect.getsource(blob)
    + r"""
log = open(acks, "a", buffering=1)
step = first
while True:
    d = os.path.join(dest, f"step{step:05d}")
    os.makedirs(d, exist_ok=True)
    for i in range(3):
        name = f"step{step:05d}/data{i}"
        with save(os.path.join(dest, name), "wb") as f:
            f.write(blob(name, 20000 + 7000 * i))
        log.write(name + "\n")
    name = f"step{step:05d}/meta"
    if step % 2:
        with save(os.path.join(dest, name + ".tmp"), "wb") as f:
            f.write(blob(name, 300))
        replace(os.path.join(dest, name + ".tmp"), os.path.join(dest, name))
    else:
        with save(os.path.join(dest, name), "wb") as f:
            f.write(blob(name, 300))
    log.write(name + "\n")
    step += 1
    time.sleep(0.03)  # the training steps between checkpoints
"""
)


def sizes_of(name: str) -> int:
    leaf = name.rsplit("/", 1)[1]
    return 300 if leaf == "meta" else 20000 + 7000 * int(leaf.removeprefix("data"))


# Kill counts: TIERSTORE_TEST_WRITEBACK_KILLS and TIERSTORE_TEST_WRITEBACK_RUN_KILLS (tests/helpers/soak.py).
@pytest.mark.slow
@pytest.mark.fuse
@pytest.mark.parametrize(
    ("mode", "kills"),
    [("api", soak.WRITEBACK_KILLS), ("run", soak.WRITEBACK_RUN_KILLS)],
    ids=["api", "run"],
)
def test_kills_of_the_writer_and_the_agent_lose_nothing_and_keep_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, kills: int
) -> None:
    """SIGKILL of the writer, of the agent, or of both at random moments of multi-file checkpoint saves:
    after a restart and a sync, every acknowledged file is on the store byte-exact, no file on the store
    holds bytes the program did not write, and no commit file appeared before its step's data files.
    The writer saves through the Python API (100 kills), or with plain open/os.replace under
    `tierstore run`, captured by the shim (fewer kills: each restart of `tierstore run` costs more)."""
    rng = random.Random(14)
    with setup(tmp_path, monkeypatch, write_bandwidth="32MiB/s") as s:
        acks = tmp_path / "acks.log"
        acks.touch()
        script = tmp_path / "writer.py"
        script.write_text(WRITER)
        violations: list[str] = []
        checked: set[str] = set()
        stop = threading.Event()

        def check(path: Path) -> None:
            rel = str(path.relative_to(s.backing / "ckpt"))
            if rel in checked or path.name.endswith(PART) or path.name == "meta.tmp":
                return
            got = path.read_bytes()
            if got != blob(rel, sizes_of(rel)):
                violations.append(f"{rel}: {len(got)} bytes the program did not write")
            if path.name == "meta":
                for i in range(3):
                    if not (path.parent / f"data{i}").exists():
                        violations.append(f"{rel} on the store before data{i}")
            checked.add(rel)

        def watch() -> None:
            while not stop.is_set():
                for d in sorted((s.backing / "ckpt").glob("step*")):
                    # The commit file first: its data files must already be there when it is seen.
                    for name in ("meta", "data0", "data1", "data2"):
                        p = d / name
                        if p.exists():
                            check(p)
                time.sleep(0.005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        writer: subprocess.Popen[bytes] | None = None
        agent_pid: int | None = s.start_agent()
        kinds = {"writer": 0, "agent": 0, "both": 0}

        def start_writer() -> subprocess.Popen[bytes]:
            steps = [line.split("/")[0] for line in acks.read_text().split()]
            first = int(steps[-1].removeprefix("step")) + 1 if steps else 0
            cmd = [sys.executable, str(script), str(s.dest), str(acks), str(first), mode]
            if mode == "run":  # `tierstore run` execs the command: the pid is the writer's
                cmd = [sys.executable, "-m", "tierstore.cli", "run", "--", *cmd]
            return subprocess.Popen(cmd, env=s.env, stderr=subprocess.PIPE)

        try:
            start = time.monotonic()
            for _ in range(kills):
                if writer is None:
                    writer = start_writer()
                kind = rng.choice(["writer", "agent", "both"])
                kinds[kind] += 1
                # A writer under `tierstore run` takes longer to start (the CLI, then the program).
                time.sleep(rng.uniform(0.15, 0.5) + (0.6 if mode == "run" else 0.0))
                if writer.poll() is not None:
                    raise AssertionError(f"the writer failed: {writer.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
                if kind in ("writer", "both"):
                    writer.kill()
                    writer.wait()
                    writer = None
                if kind in ("agent", "both"):
                    agent_pid = agent_pid or s.agent_pid()
                    if agent_pid:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(agent_pid, signal.SIGKILL)
                    # Dead once its socket refuses connections (a killed process takes a moment to go).
                    wait_for("the killed agent is gone", lambda: not answers(s.socket), 10)
                    agent_pid = s.start_agent()
            elapsed = time.monotonic() - start
        finally:
            if writer is not None:
                writer.kill()
                writer.wait()
        from tierstore import writeback

        writeback.sync(timeout=60)
        time.sleep(0.05)
        stop.set()
        watcher.join()
        for d in sorted((s.backing / "ckpt").glob("step*")):
            for p in d.iterdir():
                check(p)
        acked = acks.read_text().split()
        missing = [a for a in acked if not s.stored(a).exists()]
        assert not missing, f"{len(missing)} acknowledged file(s) lost: {missing[:5]}"
        assert not violations, violations[:10]
        # What is left in the stage are the files of writers killed before their close (never acknowledged):
        # a new agent sweeps them at start.
        os.kill(s.agent_pid() or 0, signal.SIGKILL)
        wait_for("the killed agent is gone", lambda: not answers(s.socket), 10)
        s.start_agent()
        wait_for("the orphans are swept", lambda: not list((s.stage / "data").iterdir()), 5)
        print(f"{mode}: {kills} kills ({kinds}) in {elapsed:.1f} s, {len(acked)} acknowledged files")
        assert sum(kinds.values()) == kills and len(acked) > kills


@pytest.mark.fuse
def test_a_store_outage_holds_the_data_and_resumes_by_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tierstore
    from tierstore import writeback

    outage = soak.WRITEBACK_OUTAGE_S
    with setup(tmp_path, monkeypatch) as s:
        s.start_agent()
        s.fail_file.touch()
        files = {f"o{i}.bin": blob(f"o{i}.bin", 200_000) for i in range(5)}
        began = time.monotonic()
        for name, data in files.items():
            with tierstore.open(s.dest / name, "wb") as f:
                f.write(data)
        # The store fails; the closes returned anyway (local durability), the data wait on the stage.
        wait_for("the failure is recorded", lambda: any(p["errors"] for p in writeback.pending()), 5)
        p = s.cli("sync", "--timeout", "1")
        assert (
            p.returncode == 1 and "not on the shared store" in p.stderr and "Input/output error" in p.stderr
        ), p.stderr
        status = s.cli("status")
        assert "errors" in status.stdout and "5" in status.stdout, status.stdout
        time.sleep(max(0.0, outage - (time.monotonic() - began)))
        s.fail_file.unlink()
        ended = time.monotonic()
        tierstore.sync(timeout=30)
        took = time.monotonic() - ended
        for name, data in files.items():
            assert s.stored(name).read_bytes() == data
        assert took < 4, f"migration resumed {took:.1f} s after the outage ended (back-off cap 2 s)"


@pytest.mark.fuse
def test_a_full_stage_writes_through_and_keeps_the_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tierstore

    with setup(tmp_path, monkeypatch, quota="1M", write_bandwidth="1MiB/s") as s:
        s.start_agent()
        names = [f"f{i}.bin" for i in range(4)]
        for n in names[:3]:
            with tierstore.open(s.dest / n, "wb") as f:
                f.write(blob(n, 700_000))
        # f0 and f1 were staged and filled the 1 MiB stage (the store takes 0.7 s for each): f2 waited for
        # them to reach the store, then went straight there. No ENOSPC, never more staged than the quota.
        for n in names[:3]:
            assert s.stored(n).read_bytes() == blob(n, 700_000), n
        assert not (s.stage / "data").exists() or list((s.stage / "data").iterdir()) == []
        # The stage is empty again: the next file is staged.
        with tierstore.open(s.dest / names[3], "wb") as f:
            f.write(blob(names[3], 700_000))
        assert not s.stored(names[3]).exists()
        tierstore.sync(timeout=30)
        assert s.stored(names[3]).read_bytes() == blob(names[3], 700_000)


@pytest.mark.fuse
def test_a_file_renamed_while_it_migrates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tierstore
    from tierstore import writeback

    with setup(tmp_path, monkeypatch, write_bandwidth="2MiB/s") as s:
        data = blob("big", 4 << 20)
        with tierstore.open(s.dest / "big.tmp", "wb") as f:
            f.write(data)
        part = s.stored(f".big.tmp{PART}")
        wait_for("the upload started", lambda: part.exists() and part.stat().st_size > 0, 10)
        writeback.rename(s.dest / "big.tmp", s.dest / "big")
        tierstore.sync(timeout=60)
        assert s.stored("big").read_bytes() == data
        assert not s.stored("big.tmp").exists(), "the old name never reaches the store"
        assert not list(s.stored("").glob(f"*{PART}"))


@pytest.mark.fuse
def test_resume_after_an_agent_restart_is_prompt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tierstore
    from tierstore import _core

    with setup(tmp_path, monkeypatch) as s:
        pid = s.start_agent()
        s.fail_file.touch()
        for i in range(3):
            with tierstore.open(s.dest / f"r{i}", "wb") as f:
                f.write(blob(f"r{i}", 100_000))
        os.kill(pid, signal.SIGKILL)
        wait_for("the killed agent is gone", lambda: not answers(s.socket), 10)
        s.fail_file.unlink()
        # No agent: the files wait in the journal, and a wait says so instead of hanging.
        with pytest.raises(_core.TierstoreError, match="no agent answers"):
            _core.Writeback().wait(None, 30)
        assert not s.stored("r0").exists()
        s.start_agent()
        took = wait_for("migration after the restart", lambda: s.stored("r2").exists(), 5)
        for i in range(3):
            assert s.stored(f"r{i}").read_bytes() == blob(f"r{i}", 100_000)
        print(f"migrated 3 files {took:.2f} s after the agent restarted")


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
        assert list((s.stage / "data").iterdir()) == []
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


@pytest.mark.fuse
@pytest.mark.parametrize("how", ["run", "process", "api"])
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
        assert list((s.stage / "data").iterdir()) == []
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
        assert list((s.stage / "data").iterdir()) == []


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `path` (root only: CI runs as root), for a stage that fills up."""
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def hidden_through(s: Setup, name: str) -> list[str]:
    """The hidden names a file written through a full stage has on the store while it is written."""
    return [
        p.name for p in (s.backing / "ckpt").iterdir() if p.name.startswith(f".{name}.tierstore-through-")
    ]


@pytest.mark.fuse
@pytest.mark.root
@pytest.mark.skipif(
    os.geteuid() != 0, reason="mounts a small tmpfs for the stage: needs root (CI runs as root)"
)
def test_a_small_stage_stages_and_a_full_one_writes_through_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 16 MiB stage keeps an eighth of itself free (not 64 MiB, which sent every file of a small stage to
    the store); once it is full, a file goes to the store under a hidden name and appears under its own
    only whole, through the Python API and under `tierstore run` alike."""
    import tierstore

    with (
        small_disk(tmp_path / "small", "16m") as disk,
        setup(tmp_path, monkeypatch, stage=disk / "stage") as s,
    ):
        s.start_agent()
        with tierstore.open(s.dest / "staged.bin", "wb") as f:
            f.write(blob("staged.bin", 4 << 20))
        assert not s.stored("staged.bin").exists(), "a file that fits a small stage is staged"
        tierstore.sync(timeout=30)
        assert s.stored("staged.bin").read_bytes() == blob("staged.bin", 4 << 20)
        filler = disk / "filler"
        filler.write_bytes(b"\0" * (15 << 20))  # leaves less than the stage's reserve free

        body = blob("through.bin", 3 << 20)
        with tierstore.open(s.dest / "through.bin", "wb") as f:
            f.write(body[: len(body) // 2])
            f.flush()
            assert not s.stored("through.bin").exists(), "half a file is visible under its name"
            assert len(hidden_through(s, "through.bin")) == 1
            f.write(body[len(body) // 2 :])
        assert s.stored("through.bin").read_bytes() == body
        assert hidden_through(s, "through.bin") == []

        code = (
            "import sys\n"
            "f = open(sys.argv[1], 'wb')\n"
            "f.write(bytes(1 << 20)); f.flush()\n"
            "print('half', flush=True); sys.stdin.readline()\n"
            "f.write(b'x' * (1 << 20)); f.close()\n"
        )
        child = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tierstore.cli",
                "run",
                "--",
                sys.executable,
                "-c",
                code,
                str(s.dest / "run.bin"),
            ],
            env=s.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "half"
        assert not s.stored("run.bin").exists(), "half a file is visible under its name"
        assert len(hidden_through(s, "run.bin")) == 1
        child.stdin.write("go\n")
        child.stdin.close()
        assert child.wait(60) == 0
        assert s.stored("run.bin").read_bytes() == bytes(1 << 20) + b"x" * (1 << 20)
        assert hidden_through(s, "run.bin") == []


@pytest.mark.fuse
@pytest.mark.root
@pytest.mark.skipif(
    os.geteuid() != 0, reason="mounts a small tmpfs for the stage: needs root (CI runs as root)"
)
def test_a_file_that_overflows_the_stage_frees_it_at_once_and_never_reaches_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tierstore

    with (
        small_disk(tmp_path / "small", "16m") as disk,
        setup(tmp_path, monkeypatch, stage=disk / "stage") as s,
    ):
        s.start_agent()
        f = tierstore.open(s.dest / "big.bin", "wb")
        with pytest.raises(OSError, match="No space left"):
            for _ in range(24):
                f.write(bytes(1 << 20))
        with pytest.raises(OSError, match="nothing of it reaches the store") as failed:
            f.close()
        assert failed.value.errno == 28  # ENOSPC
        data = s.stage / "data"
        assert not data.exists() or list(data.iterdir()) == [], "the failed file still holds the stage"
        # The next file is staged, not written through.
        with tierstore.open(s.dest / "next.bin", "wb") as f:
            f.write(b"next")
        assert not s.stored("next.bin").exists()
        tierstore.sync(timeout=30)
        assert s.stored("next.bin").read_bytes() == b"next"
        assert not s.stored("big.bin").exists()
