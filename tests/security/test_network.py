"""The job's agent seen from the network (issue #35, items 5, 7 and 9): another user of the node, or a host
without the job's token, gets no session and no byte, and floods before the handshake neither lock the job
out nor grow the agent. The strangers here use only Python's standard library: they bring nothing of ours."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.cli import agent_cli
from tests.helpers.cluster import free_port, job_token
from tests.helpers.users import User, throwaway_user
from tierstore import agent

pytestmark = pytest.mark.root

SECRET = b"a private file of the job's user"

# A stranger's client: the handshake with a zero proof (it has no token), then a Fetch of the secret.
STRANGER = """
import socket, struct, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5)
def frame(kind, body):
    s.sendall(struct.pack(">I", 1 + len(body)) + bytes([kind]) + body)
def text(t):
    return struct.pack(">H", len(t)) + t.encode()
def read():
    head = b""
    while len(head) < 4:
        more = s.recv(4 - len(head))
        if not more:
            return None
        head += more
    n = struct.unpack(">I", head)[0]
    body = b""
    while len(body) < n:
        more = s.recv(n - len(body))
        if not more:
            break
        body += more
    return body
challenge = read()
frame(2, bytes([challenge[1]]) + text("stranger") + b"\\1" * 32 + b"\\0" * 32)
answer = read()
print("answer-kind", answer[0] if answer else None)
frame(11, struct.pack(">I", 1) + text(sys.argv[2]) + text("secret.bin") + struct.pack(">I", 1 << 30))
rest = b""
try:
    while True:
        more = s.recv(1 << 16)
        if not more:
            break
        rest += more
except OSError:
    pass
sys.stdout.write(rest.decode("latin-1"))
"""


@pytest.fixture
def stranger() -> Iterator[User]:
    with throwaway_user("stranger") as u:
        yield u


def vm_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def agent_with_a_source(tmp_path: Path) -> tuple[dict[str, str], int, Path]:
    """An agent serving a source that holds a 0600 secret, listening on 127.0.0.1 with the job's token:
    (its environment, its port, the source)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "secret.bin").write_bytes(SECRET)
    (src / "secret.bin").chmod(0o600)
    (tmp_path / "run").mkdir()
    port = free_port()
    env = {
        **os.environ,
        "XDG_RUNTIME_DIR": str(tmp_path / "run"),
        "TIERSTORE_SOURCE": str(src),
        "TIERSTORE_TIERS": f"{tmp_path / 'tier'}:64M",
    }
    token = job_token(tmp_path / "token")
    started = agent_cli("start", "--listen", f"127.0.0.1:{port}", "--token-file", str(token), env=env)
    assert started.returncode == 0, started.stderr
    return env, port, src


def test_a_local_user_without_the_token_gets_no_session_and_no_byte(tmp_path: Path, stranger: User) -> None:
    env, port, src = agent_with_a_source(tmp_path)
    try:
        got = stranger.python(STRANGER, str(port), str(src))
        assert got.returncode == 0, got.stderr
        assert "answer-kind 10" in got.stdout, got.stdout  # an Error frame, never a Welcome (3)
        assert SECRET.decode() not in got.stdout
        # The node's socket is out of its reach too.
        sock = tmp_path / "run" / "tierstore" / "agent.sock"
        reach = stranger.python(
            "import socket, sys\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect(sys.argv[1])\n"
            "    print('connected')\nexcept OSError as e:\n    print(type(e).__name__)",
            str(sock),
        )
        assert reach.stdout.strip() == "PermissionError", reach.stdout
        report = agent_cli("status", "--json", env=env)
        assert report.returncode == 0 and json.loads(report.stdout)["refused"] == 1, report.stdout
    finally:
        agent_cli("stop", env=env)


def test_floods_before_the_handshake_leave_the_job_answered_and_the_agent_small(tmp_path: Path) -> None:
    """300 hellos announcing 1 MiB and 1,000 idle connections, from two other loopback addresses: the job's
    own peer status is answered within its deadline and the agent stays under 64 MiB."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    env, port, _ = agent_with_a_source(tmp_path)
    pid = json.loads(agent_cli("status", "--json", env=env).stdout)["pid"]
    held: list[socket.socket] = []
    try:
        for i in range(1300):
            s = socket.socket()
            s.setblocking(True)
            s.bind(("127.0.0.2" if i < 300 else "127.0.0.3", 0))
            try:
                s.connect(("127.0.0.1", port))
                if i < 300:
                    s.sendall(struct.pack(">I", 1 << 20) + b"\x02" + b"x" * 1000)
            except OSError:
                s.close()
                continue
            held.append(s)
        asked = time.monotonic()
        peer = ["--peer", f"127.0.0.1:{port}", "--token-file", str(tmp_path / "token")]
        status = subprocess.run(
            [agent.executable(), "status", "--json", *peer],
            capture_output=True,
            text=True,
            env=env,
            timeout=30,
        )
        took = time.monotonic() - asked
        assert status.returncode == 0, status.stderr
        assert took < 3.0, f"the job's own request took {took:.1f} s"
        rss = vm_rss_kib(pid)
        assert rss < 64 * 1024, f"the agent holds {rss} KiB"
    finally:
        for s in held:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        agent_cli("stop", env=env)


class Capture:
    """Every frame crossing a network interface, kept in memory: an eavesdropper on the job's network (an
    AF_PACKET socket, as tcpdump uses)."""

    def __init__(self, interface: str) -> None:
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        # Room for a burst of the whole transfer: dropped packets would hide bytes (root may force it).
        self.sock.setsockopt(socket.SOL_SOCKET, 33, 256 << 20)  # SO_RCVBUFFORCE
        self.sock.bind((interface, 0))
        self.sock.settimeout(0.2)
        self.seen = bytearray()
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                # Segmentation offload makes packets of up to 64 KiB and more: read them whole.
                self.seen += self.sock.recv(1 << 18)
            except TimeoutError:
                if not self.running:
                    return  # stopped, and the queue empty
                continue
            except OSError:
                return

    def stop(self) -> bytes:
        """Everything captured, the frames still queued when asked included: on a busy machine this
        thread reads behind the transfer, and CI saw a capture stopped with a sixth of it unread."""
        self.running = False
        self.thread.join(timeout=5)
        self.sock.close()
        return bytes(self.seen)


READ_ON_NODE = """
import hashlib, json, os, sys, tierstore
c = tierstore.Cache()
data = c.open(os.path.join(c.source, sys.argv[1])).read()
print(json.dumps({"sha256": hashlib.sha256(data).hexdigest(), "stats": c.stats()["source"]}))
"""


@pytest.mark.netns
@pytest.mark.parametrize("encrypt", ["false", "true"])
def test_with_encrypt_a_file_crosses_the_network_unreadable(tmp_path: Path, encrypt: str) -> None:
    """Two nodes in network namespaces; one reads a file the other's agent holds, while an eavesdropper on
    the bridge keeps every packet. With `[cluster] encrypt` none of the file's bytes is on the wire; without
    it (the control, which shows the eavesdropper sees the transfer) they are, tagged but readable. Either
    way the reader gets the file whole, from the peer."""
    from tests.helpers.cluster import netns_job, owner_of

    source = tmp_path / "store"
    source.mkdir()
    marker = b"a line of the job's private data, readable only by the job; "
    (source / "private.bin").write_bytes(marker * ((2 << 20) // len(marker)))
    want = hashlib.sha256((source / "private.bin").read_bytes()).hexdigest()
    size = (source / "private.bin").stat().st_size
    with netns_job(tmp_path, source, 2, sharing="partitioned", encrypt=encrypt) as (nodes, job):
        owner = owner_of(job, "private.bin")
        reader = 1 - owner
        # The owner caches the file first (its own read, no network), so the reader's bytes come from it.
        first = nodes.nodes[owner].cmd(sys.executable, "-c", READ_ON_NODE, "private.bin")
        p = subprocess.run(first, env=job[owner].env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        capture = Capture(nodes.nodes[reader].port)
        try:
            cmd = nodes.nodes[reader].cmd(sys.executable, "-c", READ_ON_NODE, "private.bin")
            p = subprocess.run(cmd, env=job[reader].env, capture_output=True, text=True, timeout=60)
        finally:
            seen = capture.stop()
        assert p.returncode == 0, p.stderr
        got = json.loads(p.stdout)
    assert got["sha256"] == want
    assert got["stats"]["peer_bytes"] == size, got["stats"]
    assert len(seen) >= size, f"the eavesdropper saw {len(seen)} bytes: it missed the transfer"
    readable = seen.count(marker)
    if encrypt == "true":
        assert readable == 0, f"{readable} lines of the file crossed the wire readable"
    else:
        assert readable > 1000, f"the control saw {readable} readable lines: the capture sees nothing"
