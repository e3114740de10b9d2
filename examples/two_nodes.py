"""Two nodes of one job sharing one cache, on this one machine over loopback.

Each "node" is only an environment: its own runtime directory (so its own agent and socket), its own tier,
its own member address 127.0.0.1:PORT, and the job's member list and token, exactly what each node of a real
job would have. The demo writes a small dataset (200 files of 64 KiB and one of 8 MiB) to a fresh
temporary directory that stands in for the shared store, starts both agents, reads every file on node 0
(the job's first read: it prints the job-wide hit rate, 0, and what node 1 counted for the files it
fetched from the store for node 0), then on node 1, checks every byte against the files it wrote, prints
`tierstore status` for node 1, and stops both agents and removes everything. It exits with status 1 if a
byte differs or node 1 read the store.

The sharing mode is "inclusive" (the default, "off", shares nothing): a node keeps what a peer sent it, as a
data-parallel job wants for its next epoch. `--sharing partitioned` keeps each file on its owner only.

Usage: .venv/bin/python examples/two_nodes.py [--sharing inclusive|partitioned]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FILES, FILE_SIZE, BIG_SIZE = 200, 64 << 10, 8 << 20
MiB = 1 << 20

# What one process of a node runs: everything comes from the node's TIERSTORE_* environment. The counters
# are node-wide (this process's and its agent's), so the reader reports what changed while it read.
READER = """
import hashlib, json, os, sys, tierstore
cache = tierstore.Cache()
before = cache.stats()["source"]
digests = {}
for rel in sys.argv[1:]:
    with cache.open(os.path.join(cache.source, rel)) as f:
        digests[rel] = hashlib.sha256(f.read()).hexdigest()
after = cache.stats()["source"]
counters = {k: v - before[k] for k, v in after.items() if type(v) is int}
print(json.dumps({"digests": digests, "counters": counters}))
"""


# What a node's tiers and store counted so far (node-wide: every process of the node and its agent).
COUNTS = """
import json, tierstore
s = tierstore.Cache().stats()
print(json.dumps({"hits": sum(t["hits"] for t in s["tiers"]), "misses": sum(t["misses"] for t in s["tiers"]),
                  "store_opens": s["source"]["opens"]}))
"""


class Failed(Exception):
    pass


def make_dataset(store: Path) -> dict[str, str]:
    """The files the job reads, by path relative to the store, with their sha256."""
    sizes = {f"shard{i % 4}/sample{i:03d}.bin": FILE_SIZE for i in range(FILES)}
    sizes["big/weights.bin"] = BIG_SIZE  # over 1 MiB: crosses the wire in checked 1 MiB pieces
    digests = {}
    for rel, size in sizes.items():
        data = os.urandom(size)
        (store / rel).parent.mkdir(parents=True, exist_ok=True)
        (store / rel).write_bytes(data)
        digests[rel] = hashlib.sha256(data).hexdigest()
    return digests


def job_token(secret_dir: Path) -> Path:
    """The job's shared secret, made as the docs' recipe makes it. Sharing refuses a token that others can
    read, even on loopback, since every user of a machine can reach 127.0.0.1."""
    secret_dir.mkdir(mode=0o700)
    token = secret_dir / "token"
    token.write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
    token.chmod(0o600)
    return token


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node_env(
    root: Path, i: int, members: list[str], token: Path, store: Path, sharing: str
) -> dict[str, str]:
    """Node `i`'s environment. On a real cluster only TIERSTORE_NODE would differ between nodes (and the
    rest could sit in one tierstore.toml); here the runtime and tier directories must differ too, since
    both nodes share one file system."""
    home = root / f"node{i}"
    (home / "run").mkdir(parents=True, mode=0o700)
    # The developer's own TIERSTORE_* settings would leak into the demo's nodes: leave them out.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERSTORE_")}
    env.update(
        XDG_RUNTIME_DIR=str(home / "run"),  # the agent's socket and log: one agent per node
        XDG_CACHE_HOME=str(home / "cache"),
        TIERSTORE_SOURCE=str(store),
        TIERSTORE_TIERS=f"{home / 'tier'}:64M",
        TIERSTORE_SHARING=sharing,
        TIERSTORE_PEERS=",".join(members),
        TIERSTORE_NODE=members[i],
        TIERSTORE_TOKEN_FILE=str(token),
    )
    return env


def run(env: dict[str, str], args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """A process of the node. It runs in the node's own directory, so that a tierstore.toml in the current
    directory does not configure it."""
    cwd = Path(env["XDG_RUNTIME_DIR"]).parent
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def cli(env: dict[str, str], *args: str) -> str:
    p = run(env, [sys.executable, "-m", "tierstore.cli", *args], timeout=60)
    if p.returncode != 0:
        raise Failed(f"`tierstore {' '.join(args)}` failed: {p.stderr.strip()}")
    return p.stdout


def read_all(env: dict[str, str], rels: list[str]) -> dict[str, Any]:
    p = run(env, [sys.executable, "-c", READER, *rels], timeout=120)
    if p.returncode != 0:
        raise Failed(f"the reader failed:\n{p.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(p.stdout)
    return out


def counts(env: dict[str, str]) -> dict[str, int]:
    p = run(env, [sys.executable, "-c", COUNTS], timeout=60)
    if p.returncode != 0:
        raise Failed(f"reading the counters failed:\n{p.stderr[-3000:]}")
    out: dict[str, int] = json.loads(p.stdout)
    return out


def stop_agents(envs: list[dict[str, str]], pids: list[int]) -> None:
    """Stops each agent, and waits for it to exit, so that nothing outlives the demo."""
    for env in envs:
        sock = Path(env["XDG_RUNTIME_DIR"]) / "tierstore" / "agent.sock"
        if sock.exists():
            run(env, [sys.executable, "-m", "tierstore.cli", "agent", "stop"], timeout=60)
    deadline = time.monotonic() + 15
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            print(f"warning: the agent {pid} has not exited", file=sys.stderr)


def demo(root: Path, sharing: str, envs: list[dict[str, str]], pids: list[int]) -> dict[str, Any]:
    store = root / "store"
    store.mkdir()
    digests = make_dataset(store)
    rels = sorted(digests)
    total = FILE_SIZE * FILES + BIG_SIZE
    print(f"dataset: {len(rels)} files, {total / MiB:.1f} MiB in {store}", flush=True)

    token = job_token(root / "secret")
    members = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    envs += [node_env(root, i, members, token, store, sharing) for i in range(2)]
    for i, env in enumerate(envs):
        cli(env, "agent", "start")
        pids.append(json.loads(cli(env, "agent", "status", "--json"))["pid"])
        print(f"node {i}: agent {pids[-1]} serves peers on {members[i]} (sharing {sharing!r})", flush=True)

    # Every file has an owner (rendezvous hashing over the member list). Node 0 reads the files node 1 owns
    # through node 1's agent, which reads them from the store once and keeps them.
    before = [counts(env) for env in envs]
    first = read_all(envs[0], rels)
    c0 = first["counters"]
    print(
        f"node 0: read {len(rels)} files: {c0['bytes_read'] / MiB:.1f} MiB from the store, "
        f"{c0['peer_hits']} files ({c0['peer_bytes'] / MiB:.1f} MiB) from node 1",
        flush=True,
    )
    # A cold run is all misses, on every node: node 1 fetched from the store what it sent node 0 (a miss
    # there), and node 0 missed in its own tier before it received each file (a peer hit).
    cold = [{k: v - b[k] for k, v in counts(env).items()} for env, b in zip(envs, before, strict=True)]
    hits = sum(c["hits"] for c in cold)
    looks = hits + sum(c["misses"] for c in cold)
    print(
        f"job-wide: {hits} hits of {looks} looks in the tiers ({100 * hits / max(looks, 1):.1f}%); node 1 "
        f"fetched from the store the {c0['peer_hits']} files it sent node 0: {cold[1]['misses']} misses, "
        f"{cold[1]['store_opens']} store opens",
        flush=True,
    )

    # Node 1 finds the files node 0 owns on node 0, and its own in its tier: none come from the store.
    second = read_all(envs[1], rels)
    c1 = second["counters"]
    print(
        f"node 1: read {len(rels)} files: {c1['bytes_read']} bytes from the store, "
        f"received {c1['peer_hits']} files ({c1['peer_bytes'] / MiB:.1f} MiB) from node 0, "
        "the rest from its own tier",
        flush=True,
    )

    for name, got in (("node 0", first["digests"]), ("node 1", second["digests"])):
        wrong = [rel for rel in rels if got.get(rel) != digests[rel]]
        if wrong:
            raise Failed(f"{name} read {len(wrong)} of {len(rels)} files unlike the store, e.g. {wrong[0]}")
    print(f"verified: every byte of the {len(rels)} files matches the store on both nodes (sha256)")
    if c1["bytes_read"] != 0 or c1["peer_hits"] == 0:
        raise Failed(f"node 1 should have read nothing from the store and some files from node 0: {c1}")

    print("\n$ tierstore status   # on node 1")
    print(cli(envs[1], "status"), flush=True)
    return {
        "root": str(root),
        "sharing": sharing,
        "files": len(rels),
        "bytes": total,
        "node0_store_bytes": c0["bytes_read"],
        "node0_peer_hits": c0["peer_hits"],
        "cold": {"node0": cold[0], "node1": cold[1]},
        "node1_store_bytes": c1["bytes_read"],
        "node1_peer_hits": c1["peer_hits"],
        "node1_peer_bytes": c1["peer_bytes"],
        "agents": pids,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sharing", choices=["inclusive", "partitioned"], default="inclusive")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="tierstore-two-nodes-"))
    print(f"temp root: {root}", flush=True)
    envs: list[dict[str, str]] = []
    pids: list[int] = []
    try:
        summary = demo(root, args.sharing, envs, pids)
    except (Failed, subprocess.TimeoutExpired) as e:
        print(f"two_nodes: FAILED: {e}", file=sys.stderr)
        return 1
    finally:
        stop_agents(envs, pids)
        shutil.rmtree(root, ignore_errors=True)
        print(f"cleaned up: stopped {len(pids)} agents, removed {root}", flush=True)
    print("summary: " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
