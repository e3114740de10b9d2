"""A file staged on one node, read on another before it is on the store: two nodes in their own network
namespaces (each with its own agent, listening on its own address with the job's token, and its own
stage), one stand-in store mounted once as a shared file system is, its outage switch holding migration.

Needs root (CI runs as root) to create namespaces and links.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.cluster import job_token
from tests.helpers.stores import mounted_store
from tierstore.testing.netns import Nodes

pytestmark = [pytest.mark.fuse, pytest.mark.root, pytest.mark.netns]

READ = r"""
import hashlib, sys, time, tierstore
for p in sys.argv[1:]:
    t = time.monotonic()
    try:
        with tierstore.open(p, "rb") as f:
            got = hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        got = "missing"
    print(p, got, f"{time.monotonic() - t:.3f}")
"""

# The same reads by a program that knows nothing of tierstore, under `tierstore run`.
READ_PLAIN = r"""
import hashlib, sys, time
for p in sys.argv[1:]:
    t = time.monotonic()
    try:
        with open(p, "rb") as f:
            got = hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        got = "missing"
    print(p, got, f"{time.monotonic() - t:.3f}")
"""

# What `stat` and `os.path.exists` show under `tierstore run`: {name: size, or -1 when missing}.
STAT = r"""
import json, os, sys
print(json.dumps({os.path.basename(p): os.stat(p).st_size if os.path.exists(p) else -1 for p in sys.argv[1:]}))
"""

WRITE = r"""
import sys, tierstore
for p, n, seed in zip(sys.argv[1::3], sys.argv[2::3], sys.argv[3::3]):
    with tierstore.open(p, "wb") as f:
        f.write(bytes([int(seed)]) * int(n))
"""


def digest(seed: int, n: int) -> str:
    return hashlib.sha256(bytes([seed]) * n).hexdigest()


class Job:
    """Two nodes, each with its agent and stage, writing under one destination of one store."""

    def __init__(self, tmp_path: Path, nodes: Nodes, mount: Path) -> None:
        self.nodes = nodes
        self.dest = mount / "ckpt"
        self.dest.mkdir()
        token = job_token(tmp_path / "token")
        data = tmp_path / "data"
        data.mkdir()
        addresses = [n.address for n in nodes.nodes]
        self.envs = []
        for i in range(len(nodes.nodes)):
            run = tmp_path / f"node{i}"
            run.mkdir()
            self.envs.append(
                {
                    **os.environ,
                    "XDG_RUNTIME_DIR": str(run),
                    "TIERSTORE_WRITEBACK": f"{self.dest}:{tmp_path / f'stage{i}'}:1G:local",
                    "TIERSTORE_SOURCE": str(data),
                    "TIERSTORE_TIERS": f"{tmp_path / f'tier{i}'}:64M",
                    "TIERSTORE_SHARING": "partitioned",
                    "TIERSTORE_PEERS": ",".join(addresses),
                    "TIERSTORE_NODE": addresses[i],
                    "TIERSTORE_LISTEN": addresses[i],
                    "TIERSTORE_TOKEN_FILE": str(token),
                    "TIERSTORE_PEER_CONNECT_MS": "500",
                    "TIERSTORE_PEER_DEADLINE_MS": "2000",
                }
            )

    def run(self, i: int, *argv: str, timeout: float = 120) -> str:
        p = subprocess.run(
            self.nodes.nodes[i].cmd(*argv), env=self.envs[i], capture_output=True, text=True, timeout=timeout
        )
        assert p.returncode == 0, f"node {i}: {' '.join(argv[:4])}: {p.stderr[-3000:]}"
        return p.stdout

    def tierstore(self, i: int, *args: str, timeout: float = 120) -> str:
        return self.run(i, sys.executable, "-m", "tierstore.cli", *args, timeout=timeout)

    def read(self, i: int, *names: str, plain: bool = False) -> dict[str, tuple[str, float]]:
        """What node `i` reads: {name: (sha256 or "missing", seconds)}."""
        paths = [str(self.dest / n) for n in names]
        if plain:
            out = self.tierstore(i, "run", "--", sys.executable, "-c", READ_PLAIN, *paths)
        else:
            out = self.run(i, sys.executable, "-c", READ, *paths)
        got = {}
        for line in out.splitlines():
            p, h, t = line.split()
            got[os.path.basename(p)] = (h, float(t))
        return got

    def stat(self, i: int, *names: str) -> dict[str, int]:
        """The sizes `stat` gives on node `i` under `tierstore run` (-1: missing)."""
        import json

        paths = [str(self.dest / n) for n in names]
        out = self.tierstore(i, "run", "--", sys.executable, "-c", STAT, *paths)
        return json.loads(out.strip().splitlines()[-1])

    def write(self, i: int, files: list[tuple[str, int, int]]) -> None:
        args = [a for name, n, seed in files for a in (str(self.dest / name), str(n), str(seed))]
        self.run(i, sys.executable, "-c", WRITE, *args)

    def agent_pid(self, i: int) -> int:
        import json

        return int(json.loads(self.tierstore(i, "agent", "status", "--json"))["pid"])


@pytest.fixture
def job(tmp_path: Path) -> Iterator[tuple[Job, Path, Path]]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root)")
    fail_file = tmp_path / "store-outage"
    with mounted_store(tmp_path, fail_file=fail_file) as (backing, mount), Nodes(2) as nodes:
        j = Job(tmp_path, nodes, mount)
        for i in range(2):
            j.tierstore(i, "agent", "start")
        yield j, backing / "ckpt", fail_file


def test_a_file_staged_on_one_node_reads_on_another_until_it_is_on_the_store(
    job: tuple[Job, Path, Path],
) -> None:
    j, stored, outage = job
    mib = 1 << 20
    # Version 1 of the model reaches the store; then, with the store refusing writes (migration held),
    # node 0 writes version 2 of it and a new commit file.
    j.write(0, [("model.bin", 3 * mib + 5, 1)])
    j.tierstore(0, "sync", str(j.dest), "--timeout", "30")
    assert hashlib.sha256((stored / "model.bin").read_bytes()).hexdigest() == digest(1, 3 * mib + 5)
    outage.touch()
    j.write(0, [("model.bin", 2 * mib + 7, 2), ("meta.json", 100, 3), ("empty", 0, 4)])
    assert hashlib.sha256((stored / "model.bin").read_bytes()).hexdigest() == digest(1, 3 * mib + 5)
    assert not (stored / "meta.json").exists()

    # Node 1 reads what node 0 wrote, not the store's older copy, through the API and under `run`.
    want = {"model.bin": digest(2, 2 * mib + 7), "meta.json": digest(3, 100), "empty": digest(4, 0)}
    for plain in (False, True):
        got = j.read(1, *want, "never-written", plain=plain)
        assert {k: v[0] for k, v in got.items()} == {**want, "never-written": "missing"}, (
            f"under run: {plain}"
        )
    assert not (stored / "meta.json").exists(), "still staged: the bytes came from node 0's agent"
    # `stat` on node 1 agrees with what it reads: node 0's sizes, not the store's older copy or its absence.
    sizes = {"model.bin": 2 * mib + 7, "meta.json": 100, "empty": 0, "never-written": -1}
    assert j.stat(1, *sizes) == sizes

    # A staging node whose agent is gone never hangs a reader: it goes to the store within the deadline.
    pid = j.agent_pid(0)
    os.kill(pid, signal.SIGKILL)
    got = j.read(1, "meta.json")
    assert got["meta.json"][0] == "missing" and got["meta.json"][1] < 3.0, got
    assert j.stat(1, "meta.json", "model.bin") == {"meta.json": -1, "model.bin": 3 * mib + 5}

    # Node 0's agent again, the store back: the files migrate, and the store's copies are what node 1 reads,
    # also once node 0's agent is gone for good.
    j.tierstore(0, "agent", "start")
    outage.unlink()
    j.tierstore(0, "sync", str(j.dest), "--timeout", "60")
    assert hashlib.sha256((stored / "meta.json").read_bytes()).hexdigest() == want["meta.json"]
    os.kill(j.agent_pid(0), signal.SIGKILL)
    time.sleep(0.1)
    for plain in (False, True):
        got = j.read(1, *want, plain=plain)
        assert {k: v[0] for k, v in got.items()} == want
