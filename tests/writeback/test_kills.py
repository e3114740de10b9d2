"""Kills of the writer, of the agent and of both at random moments of multi-file checkpoint saves, through
the Python API and under `tierstore run`: nothing acknowledged is lost, no file on the store holds bytes
the program did not write, and no commit file reaches the store before its data files."""

from __future__ import annotations

import contextlib
import inspect
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import soak
from tests.helpers.data import blob
from tests.helpers.wait import wait_for
from tests.helpers.writeback import PART, Setup, setup
from tierstore.agent import answers

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


def no_agent(s: Setup) -> bool:
    """Whether no agent answers at the stage's socket; one that does is killed. It may be another than the
    one killed last: a writer that found no agent meanwhile starts one of its own (on demand), and waiting
    for the killed one's socket to go quiet would then wait for good."""
    if not answers(s.socket):
        return True
    pid = s.agent_pid()
    if pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return False


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
                    # Dead once its socket refuses connections. A killed process takes a moment to go, and
                    # longer while it waits on the loaded FUSE store (10 s was once too little in `make test`).
                    wait_for("the killed agent is gone", lambda: no_agent(s), 30)
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
        wait_for("the killed agent is gone", lambda: no_agent(s), 30)
        s.start_agent()
        wait_for("the orphans are swept", lambda: not list((s.stage / "data").iterdir()), 5)
        print(f"{mode}: {kills} kills ({kinds}) in {elapsed:.1f} s, {len(acked)} acknowledged files")
        assert sum(kinds.values()) == kills and len(acked) > kills
