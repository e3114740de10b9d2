"""Four nodes, each in its own network namespace, joined by veth pairs and a bridge: each runs its own
agent (listening on its own address, with the job's token), its own tiers and a PyTorch DataLoader with
two worker processes, and all read one stand-in store mounted once, as a shared file system is.

Needs root (CI runs as root) to create namespaces and links.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.cluster import SIZES, dataset, job_token, node_env, owners_by_env
from tests.helpers.marks import needs
from tests.helpers.stores import store_stats
from tierstore.testing.netns import Nodes

NODES = 4

LOADER = r"""
import hashlib, json, os, sys, time
import torch
import tierstore
from tierstore.torch import CachedDataset

rels = sys.argv[1:]
cache = tierstore.Cache()
files = CachedDataset([os.path.join(cache.source, r) for r in rels], cache=cache,
                      decode=lambda f: hashlib.sha256(f.read()).hexdigest())

class Tagged(torch.utils.data.Dataset):
    def __len__(self):
        return len(files)

    def __getitem__(self, i):
        return i, files[i]

loader = torch.utils.data.DataLoader(Tagged(), batch_size=None, num_workers=2, shuffle=True,
                                     generator=torch.Generator().manual_seed(int(os.environ["SEED"])))
t = time.monotonic()
got = {}
for epoch in range(2):
    for i, digest in loader:
        got[rels[i]] = digest
print(json.dumps({"got": got, "seconds": time.monotonic() - t, "stats": cache.stats()["source"]}))
"""


@pytest.fixture
@needs("root", "netns")
def namespaces() -> Iterator[list[str]]:
    """NODES namespaces on one bridge, as "name|address"; torn down after the test."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root)")
    with Nodes(NODES) as nodes:
        yield [f"{n.name}|{n.address}" for n in nodes.nodes]


@pytest.mark.parametrize("revalidate", ["never", "always", "60s"])
@pytest.mark.parametrize("sharing", ["inclusive", "partitioned"])
def test_four_nodes_in_namespaces_read_the_dataset_from_the_store_once(
    tmp_path: Path, slow_store: tuple[Path, Path], namespaces: list[str], sharing: str, revalidate: str
) -> None:
    """Four nodes read the same cold files at once: the store opens each file once for the whole job,
    whatever the sharing mode and the revalidation setting (opens are the honest count: on one kernel some
    duplicate reads of a file come from the page cache)."""
    backing, mount = slow_store
    digests = dataset(backing)
    rels = sorted(digests)
    token = job_token(tmp_path / "token")
    addresses = [n.split("|")[1] for n in namespaces]
    envs = []
    for i in range(len(namespaces)):
        runtime = tmp_path / f"node{i}"
        runtime.mkdir()
        envs.append(
            {
                **os.environ,
                "XDG_RUNTIME_DIR": str(runtime),
                "TIERSTORE_SOURCE": str(mount),
                "TIERSTORE_TIERS": f"{tmp_path / f'tier{i}'}:256M",
                "TIERSTORE_INLINE_MAX": str(1 << 20),
                "TIERSTORE_REVALIDATE": revalidate,
                "TIERSTORE_SHARING": sharing,
                "TIERSTORE_PEERS": ",".join(addresses),
                "TIERSTORE_NODE": addresses[i],
                "TIERSTORE_LISTEN": addresses[i],
                "TIERSTORE_TOKEN_FILE": str(token),
                "SEED": str(i),
            }
        )
    in_ns = [["ip", "netns", "exec", n.split("|")[0]] for n in namespaces]
    # Each node's agent first (a launcher's `srun --ntasks-per-node=1 tierstore agent run`), then the
    # four jobs at once.
    for cmd, env in zip(in_ns, envs, strict=True):
        start = [*cmd, sys.executable, "-m", "tierstore.cli", "agent", "start"]
        p = subprocess.run(start, env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
    before = store_stats(mount)
    procs = [
        subprocess.Popen(
            [*cmd, sys.executable, "-c", LOADER, *rels],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for cmd, env in zip(in_ns, envs, strict=True)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out))
    for i, r in enumerate(results):
        assert r["got"] == digests, f"node {i} read wrong bytes"
    after = store_stats(mount)
    read = after.get("bytes_read", 0) - before.get("bytes_read", 0)
    opens = after.get("open", 0) - before.get("open", 0)
    assert opens == len(rels), f"the store opened {opens} times for {len(rels)} files"
    total = sum(SIZES) * 3
    stats = [r["stats"] for r in results]
    assert all(s["peer_hits"] > 0 for s in stats), stats
    assert all(s["peer_faults"] == 0 for s in stats), stats
    # Four nodes, two epochs each, concurrently: the store served the dataset once (single flight per
    # job: a node asking for a file its owner is still fetching waits for it). The one allowance: once, on
    # a heavily loaded machine, the store served one extra first copy chunk (256 KiB), a copy abandoned
    # after its first chunk and done again. Suspected, not confirmed: torch terminates a worker that has
    # not exited 5 s after the epoch, in the middle of a background copy.
    assert total <= read <= total + (256 << 10), f"the store served {read} bytes for a {total}-byte dataset"
    for cmd, env in zip(in_ns, envs, strict=True):
        subprocess.run([*cmd, sys.executable, "-m", "tierstore.cli", "agent", "stop"], env=env, timeout=60)
    time.sleep(0.1)


READER = r"""
import hashlib, json, os, sys, time, tierstore
c = tierstore.Cache()
got, slowest = {}, 0.0
for r in sys.argv[1:]:
    t = time.monotonic()
    got[r] = hashlib.sha256(c.open(os.path.join(c.source, r)).read()).hexdigest()
    slowest = max(slowest, time.monotonic() - t)
print(json.dumps({"got": got, "slowest": slowest, "stats": c.stats()["source"]}))
"""


@pytest.mark.netns
def test_a_node_whose_link_goes_down_is_read_around_within_two_seconds(
    tmp_path: Path, slow_store: tuple[Path, Path]
) -> None:
    """The link of one node is taken down (its peers see it vanish, no reset): every read on the others
    completes, correct, none waits more than 2 s, and the failures are counted.

    The node taken down is the one that owns the most files: the members' addresses change from run to
    run, and once in about two thousand runs a fixed node owned none of them (then no read ever asked it,
    and no failure could be counted)."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root)")
    backing, mount = slow_store
    digests = dataset(backing)
    rels = sorted(digests)
    token = job_token(tmp_path / "token")
    with Nodes(NODES) as nodes:
        addresses = [n.address for n in nodes.nodes]
        envs = []
        for i, n in enumerate(nodes.nodes):
            env = node_env(tmp_path / f"node{i}", tmp_path / f"tier{i}", mount, addresses, i, token,
                           revalidate="never", sharing="partitioned")  # fmt: skip
            envs.append(env)
            start = n.cmd(sys.executable, "-m", "tierstore.cli", "agent", "start")
            subprocess.run(start, env=env, check=True, capture_output=True, timeout=60)
        owned = list(owners_by_env(envs, rels).values())
        down = max(range(NODES), key=owned.count)
        nodes.link_down(down)
        for i in (i for i in range(NODES) if i != down):
            p = subprocess.run(nodes.nodes[i].cmd(sys.executable, "-c", READER, *rels), env=envs[i],
                               capture_output=True, text=True, timeout=120)  # fmt: skip
            assert p.returncode == 0, p.stderr[-3000:]
            out = json.loads(p.stdout)
            assert out["got"] == digests, f"node {i} read wrong bytes"
            assert out["slowest"] < 2.0, f"node {i}: a read waited {out['slowest']:.2f} s"
            assert out["stats"]["peer_faults"] >= 1, out["stats"]
            assert "did not answer" in p.stderr or "cannot be reached" in p.stderr, p.stderr
