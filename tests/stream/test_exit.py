"""A thread left inside a call into the engine when the interpreter exits (a `HotModel`'s reader in the
middle of a version, a subscriber waiting on the agent) comes back while the interpreter finalizes. Taking
the GIL then ends the thread with a forced unwind that Rust frames cannot pass: the process used to abort
(SIGABRT, exit 134) in 8 of 15 runs of the README's streaming example under load (issue #37 item 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
