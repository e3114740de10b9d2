"""Nodes of one job on this machine's loopback, each with its own agent, port, tiers and counters, and the
dataset they read from one stand-in store (tests/cluster: test_cluster, test_registry, test_netns)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tests.helpers.agents import exited
from tierstore import agent as agent_mod

if TYPE_CHECKING:
    from tierstore.testing.netns import Nodes

# Files under and over one chunk of the wire protocol (1 MiB), and one over inline_max (set to 1 MiB).
SIZES = [0, 1, 4096, 100_000, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 3 * (1 << 20) + 17]


def job_token(path: Path) -> Path:
    """A job's token at `path`, as tierstore asks for one: 32 random bytes as base64, mode 0600."""
    path.write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
    path.chmod(0o600)
    return path


def free_port() -> int:
    """A loopback port free now (for a server the test starts next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Node:
    name: str
    env: dict[str, str]
    tier: Path
    socket: Path
    pid: int = 0


@dataclass
class Cluster:
    mount: Path
    nodes: list[Node] = field(default_factory=list)

    def read_all(self, node: Node, rels: list[str], timeout: float = 120, log: str | None = None) -> dict:
        """Reads every file through `tierstore.Cache` in a process of `node` (logging at `log`, a
        `TIERSTORE_LOG` level, when given); returns the digests it read, its counters, how long it took
        and what it wrote to stderr."""
        code = (
            "import hashlib, json, os, sys, time, tierstore\n"
            "c = tierstore.Cache()\n"
            "t = time.monotonic()\n"
            "got = {r: hashlib.sha256(c.open(os.path.join(c.source, r)).read()).hexdigest() for r in sys.argv[1:]}\n"
            "print(json.dumps({'got': got, 'seconds': time.monotonic() - t, 'stats': c.stats()['source']}))\n"
        )
        p = subprocess.run(
            [sys.executable, "-c", code, *rels],
            env={**node.env, **({"TIERSTORE_LOG": log} if log else {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert p.returncode == 0, f"reader on {node.name} failed: {p.stderr[-3000:]}"
        out = json.loads(p.stdout)
        out["stderr"] = p.stderr
        return out

    def stats(self, node: Node) -> dict:
        """The node's source counters now (its processes' and its agent's)."""
        code = "import json, tierstore; print(json.dumps(tierstore.Cache().stats()['source']))"
        p = subprocess.run(
            [sys.executable, "-c", code], env=node.env, capture_output=True, text=True, timeout=60
        )
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)

    def agent_status(self, node: Node) -> dict:
        report = agent_mod.status(node.socket)
        assert report is not None, f"the agent of {node.name} does not answer"
        return json.loads(report)


def make_cluster(tmp_path: Path, mount: Path, n: int, sharing: str, revalidate: str = "never") -> Cluster:
    """`n` nodes on loopback ports, members of one job over the store mounted at `mount`, each with its
    agent started (`tierstore agent start`)."""
    ports = [free_port() for _ in range(n)]
    members = ",".join(f"127.0.0.1:{p}" for p in ports)
    cluster = Cluster(mount)
    for i, port in enumerate(ports):
        runtime = tmp_path / f"node{i}" / "run"
        runtime.mkdir(parents=True)
        tier = tmp_path / f"node{i}" / "tier"
        env = {
            **os.environ,
            "XDG_RUNTIME_DIR": str(runtime),
            "TIERSTORE_SOURCE": str(mount),
            "TIERSTORE_TIERS": f"{tier}:256M",
            "TIERSTORE_INLINE_MAX": str(1 << 20),
            "TIERSTORE_REVALIDATE": revalidate,
            "TIERSTORE_SHARING": sharing,
            "TIERSTORE_PEERS": members,
            "TIERSTORE_NODE": f"127.0.0.1:{port}",
            "TIERSTORE_PEER_CONNECT_MS": "500",
            "TIERSTORE_PEER_DEADLINE_MS": "2000",
        }
        cluster.nodes.append(Node(f"node{i}", env, tier, runtime / "tierstore" / "agent.sock"))
    for node in cluster.nodes:
        p = subprocess.run(
            [sys.executable, "-m", "tierstore.cli", "agent", "start"],
            env=node.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 0, f"{node.name}: {p.stderr}"
        node.pid = cluster.agent_status(node)["pid"]
    return cluster


def node_env(runtime: Path, tier: Path, source: Path, addresses: list[str], i: int, token: Path,
             **settings: str) -> dict[str, str]:  # fmt: skip
    """The environment of node `i` of a job whose members are `addresses` (each in its own network
    namespace): its runtime directory (the agent's socket), its tier, the job's token, and `settings` as
    further TIERSTORE_* variables (`sharing="partitioned"` sets TIERSTORE_SHARING)."""
    runtime.mkdir(parents=True, exist_ok=True)
    return {
        **os.environ,
        "XDG_RUNTIME_DIR": str(runtime),
        "TIERSTORE_SOURCE": str(source),
        "TIERSTORE_TIERS": f"{tier}:256M",
        "TIERSTORE_PEERS": ",".join(addresses),
        "TIERSTORE_NODE": addresses[i],
        "TIERSTORE_LISTEN": addresses[i],
        "TIERSTORE_TOKEN_FILE": str(token),
        **{f"TIERSTORE_{k.upper()}": v for k, v in settings.items()},
    }


@contextlib.contextmanager
def netns_job(
    tmp_path: Path, source: Path, count: int, **settings: str
) -> Iterator[tuple[Nodes, list[Node]]]:
    """`count` nodes of one job, each in its own network namespace (`tierstore.testing.netns.Nodes`) with
    its agent started (`tierstore agent start`, the job's token, `settings` as `node_env` takes them):
    (the namespaces, each node's `Node` with its agent's pid). The agents are stopped and the namespaces
    removed after. Needs root."""
    from tierstore.testing.netns import Nodes

    token = job_token(tmp_path / "token")
    with Nodes(count) as nodes:
        addresses = [n.address for n in nodes.nodes]
        job: list[Node] = []
        try:
            for i, n in enumerate(nodes.nodes):
                runtime, tier = tmp_path / f"node{i}", tmp_path / f"tier{i}"
                env = node_env(runtime, tier, source, addresses, i, token, **settings)
                node = Node(n.name, env, tier, runtime / "tierstore" / "agent.sock")
                job.append(node)
                start = n.cmd(sys.executable, "-m", "tierstore.cli", "agent", "start")
                p = subprocess.run(start, env=env, capture_output=True, text=True, timeout=60)
                assert p.returncode == 0, f"{n.name}: {p.stderr}"
                report = agent_mod.status(node.socket)
                assert report is not None, f"the agent of {n.name} does not answer"
                node.pid = json.loads(report)["pid"]
            yield nodes, job
        finally:
            for n, node in zip(nodes.nodes, job, strict=False):
                stop = n.cmd(sys.executable, "-m", "tierstore.cli", "agent", "stop")
                subprocess.run(stop, env=node.env, capture_output=True, timeout=60)


def owner_of(job: list[Node], rel: str) -> int:
    """The place in `job` of the node that owns `rel` (a path under the source) while every node is up,
    by the agents' own rendezvous hashing over the members as the job's configuration names them."""
    return owners_of(job, [rel])[rel]


def owners_of(job: list[Node], rels: list[str]) -> dict[str, int]:
    """`owner_of` for each of `rels`, the job's members asked for once (one process, not one a path)."""
    return owners_by_env([node.env for node in job], rels)


def owners_by_env(envs: list[dict[str, str]], rels: list[str]) -> dict[str, int]:
    """The place in `envs` (each node's environment, as `node_env` makes it) of the node that owns each of
    `rels` while every node is up, by the agents' own rendezvous hashing over the configured members."""
    from tierstore import _core

    code = "import json, tierstore; print(json.dumps(tierstore.Cache().config()['cluster'][0]['members']))"
    p = subprocess.run([sys.executable, "-c", code], env=envs[0], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    owners = _core.owners(json.loads(p.stdout), rels)
    assert len(owners) == len(rels), (owners, rels)
    places: dict[str, int] = {}
    for rel, owner in zip(rels, owners, strict=True):
        # A member is `host:port`; a node's TIERSTORE_NODE names its host, and its port where not the default.
        at = [i for i, env in enumerate(envs) if f"{owner}:".startswith(f"{env['TIERSTORE_NODE']}:")]
        assert len(at) == 1, f"the owner {owner} of {rel} is none of the job's nodes"
        places[rel] = at[0]
    return places


def tier_bytes(tier: Path) -> int:
    """The bytes of every file under `tier` now: its copies, those still being fetched, its index. A file
    that goes while it is counted (a fetched copy renamed into place) is passed over."""
    total = 0
    for f in tier.rglob("*"):
        with contextlib.suppress(FileNotFoundError):
            if f.is_file():
                total += f.stat().st_size
    return total


def stop_cluster(cluster: Cluster) -> None:
    """Stops every node's agent and waits (10 s at most each) for it to exit (`agents.exited`). A node whose agent never
    started (pid 0) is passed over: `kill(0, ...)` would signal this test's own process group."""
    started = [node for node in cluster.nodes if node.pid > 0]
    for node in started:
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.pid, signal.SIGTERM)
    for node in started:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not exited(node.pid):
            time.sleep(0.05)


def dataset(backing: Path) -> dict[str, str]:
    """Writes the files to the store's backing directory; returns their digests by relative path."""
    digests = {}
    for i, size in enumerate(SIZES * 3):
        rel = f"shard{i % 4}/sample{i:03d}.bin"
        data = hashlib.sha256(f"{i}".encode()).digest() * (size // 32 + 1)
        path = backing / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data[:size])
        digests[rel] = hashlib.sha256(data[:size]).hexdigest()
    return digests
