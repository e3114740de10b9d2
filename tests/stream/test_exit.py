"""A thread left inside a call into the engine when the interpreter exits (a `HotModel`'s reader in the
middle of a version, a subscriber waiting on the agent) comes back while the interpreter finalizes. Taking
the GIL then ends the thread with a forced unwind that Rust frames cannot pass: the process used to abort
(SIGABRT, exit 134) in 8 of 15 runs of the README's streaming example under load (issue #37 item 2), and
still crashed (SIGSEGV: 1 run of 16 in CI, about 1 of 300 here) when the thread came back just before the last
atexit hook ran."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import soak

VERSION = 5  # tierstore_core::cluster::wire::VERSION

# A daemon thread waits in the engine for the agent's next stream event, as a subscriber's thread does.
# The "agent" is this program's main thread on a Unix socket (the handshake written by hand); the event
# comes only once the interpreter is finalizing, from the __del__ of garbage only the finalizing
# interpreter collects, which then gives the thread a second to come back while finalization goes on.
PROGRAM = r"""
import gc, json, os, socket, struct, sys, threading, time
import tierstore
from tierstore import _core
from tierstore.cluster_wire_version import VERSION

path = sys.argv[1]
server = socket.socket(socket.AF_UNIX)
server.bind(path)
server.listen(1)

def frame(kind, body):
    return struct.pack(">I", 1 + len(body)) + bytes([kind]) + body

def subscriber():
    link = _core.AgentLink(path, 5.0)
    try:
        link.recv(None)
    except Exception:
        pass

threading.Thread(target=subscriber, daemon=True).start()
conn, _ = server.accept()
conn.sendall(frame(1, bytes([VERSION]) + os.urandom(32)))  # Challenge
n = struct.unpack(">I", conn.recv(4, socket.MSG_WAITALL))[0]
conn.recv(n, socket.MSG_WAITALL)  # Hello
conn.sendall(frame(3, struct.pack(">H", 5) + b"agent" + bytes(32) + b"\x00"))  # Welcome
time.sleep(0.3)

class AtFinalization:
    # What __del__ needs, held here: the module's names may already be None when it runs.
    def __init__(self, conn, event, sleep):
        self.conn, self.event, self.sleep = conn, event, sleep

    def __del__(self):
        self.conn.sendall(self.event)
        self.sleep(1.0)

# Garbage in a reference cycle, with the collector off: collected only by the finalizing interpreter.
gc.disable()
event = json.dumps({"event": "late"}).encode()
keep = AtFinalization(conn, frame(41, struct.pack(">I", len(event)) + event), time.sleep)  # StreamEvent
keep.cycle = keep
del keep
print("main returns", flush=True)
"""


def test_a_thread_inside_the_engine_at_exit_never_aborts_the_process(tmp_path: Path) -> None:
    program = PROGRAM.replace("from tierstore.cluster_wire_version import VERSION", f"VERSION = {VERSION}")
    for attempt in range(3):
        sock = tmp_path / f"agent{attempt}.sock"
        p = subprocess.run(
            [sys.executable, "-c", program, str(sock)], capture_output=True, text=True, timeout=60
        )
        assert p.returncode == 0, f"run {attempt}: exit {p.returncode}\n{p.stdout}\n{p.stderr[-2000:]}"
        assert "main returns" in p.stdout


# A daemon thread's call into the engine (a read from a FIFO) returns while an atexit hook that runs
# before tierstore's last one holds the GIL: the thread has looked at the "exiting" flag before it was set,
# and waits for the GIL through the last hooks. Then the finalizing interpreter gives the GIL up (a
# __del__ that sleeps). Before the last hook waited for such threads, the thread took the GIL back only
# then and was ended by a forced unwind through the engine's frames: exit -11 (SIGSEGV) every time.
RACE = r"""
import atexit, gc, os, subprocess, sys, threading, time
import numpy as np
from tierstore import _core

fifo = sys.argv[1]
os.mkfifo(fifo)
subprocess.Popen(["sh", "-c", f"sleep 0.5; printf abcd > {fifo}"])  # while the hook below runs

def reader():
    try:
        _core.stream_read([fifo], [np.zeros(4, np.uint8)])
    except OSError:
        pass  # a FIFO has no size to check the read against: the call fails, and returns all the same
    print("the engine call returned", flush=True)
    while True:
        time.sleep(0.01)

threading.Thread(target=reader, daemon=True).start()

def hold_the_gil():
    sys.setswitchinterval(1000)  # the waiting thread does not ask for the GIL before this hook ends
    end = time.perf_counter() + 1.0
    while time.perf_counter() < end:
        pass
    sys.setswitchinterval(0.005)

atexit.register(hold_the_gil)

class AtFinalization:
    def __init__(self, sleep):
        self.sleep = sleep

    def __del__(self):
        self.sleep(0.3)

gc.disable()
keep = AtFinalization(time.sleep)
keep.cycle = keep
del keep
print("main returns", flush=True)
"""


def test_a_thread_back_from_the_engine_as_the_last_hooks_run_never_crashes_the_process(
    tmp_path: Path,
) -> None:
    for attempt in range(3):
        p = subprocess.run(
            [sys.executable, "-c", RACE, str(tmp_path / f"fifo{attempt}")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 0, f"run {attempt}: exit {p.returncode}\n{p.stdout}\n{p.stderr[-2000:]}"
        assert "the engine call returned" in p.stdout and "main returns" in p.stdout, p.stdout


def readme_streaming_example() -> str:
    """The README's streaming example, as written."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```python[^\n]*\n(.*?)```", readme, re.S) if "stream.HotModel" in b]
    return block


@pytest.mark.slow
def test_the_readme_streaming_example_never_aborts_at_exit_under_load(tmp_path: Path) -> None:
    """The README's example, which never calls close(), run TIERSTORE_TEST_EXIT_RUNS times (16), four at a
    time, so that the machine is loaded as when it aborted: every run exits 0. (With 50 runs, beside a
    benchmark and another test suite: 50 of 50 exited 0, 249 s.)"""
    script = tmp_path / "example.py"
    script.write_text(readme_streaming_example())
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    (tmp_path / "run").mkdir(mode=0o700)

    def run(_: int) -> tuple[int, str]:
        p = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
        )
        return p.returncode, p.stderr[-1500:]

    try:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(run, range(soak.EXIT_RUNS)))
    finally:
        subprocess.run([sys.executable, "-m", "tierstore.cli", "agent", "stop"], env=env, capture_output=True)
    failed = [(code, err) for code, err in results if code != 0]
    assert not failed, (
        f"{len(failed)} of {len(results)} runs failed, the first: exit {failed[0][0]}\n{failed[0][1]}"
    )
