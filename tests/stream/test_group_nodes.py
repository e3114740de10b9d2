"""Model streaming through a torch.distributed process group across two nodes (network namespaces).

The publisher rank runs on the first node, a consumer rank on the second; each node has its own agent, and
the agents meet through Redis. The changed tensors go through the group (gloo over the namespaces' link);
the consumer subscribes for notices only, so its node's agent relays each version's manifest and pulls no
tensor: the bytes cross the link once, not twice. A version published outside the group is pulled when the
consumer asks for it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers.agents import start_agent, stop_agent
from tests.helpers.cluster import job_token
from tests.helpers.stream import MODEL, line
from tierstore import stream

pytestmark = [pytest.mark.root, pytest.mark.netns, pytest.mark.redis]

# A rank of a gloo process group of 2 spanning the nodes: rank 0 holds the TCP store, on its node's address.
RANK = """
import datetime, json, os, time
import torch, torch.distributed as dist
from tierstore import _core, stream
store = dist.TCPStore({host!r}, {port}, is_master={master}, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank={rank}, world_size=2, timeout=datetime.timedelta(seconds=60))
group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=30))
"""

PUBLISHER = """
model = weights()
pub = stream.DistributedPublisher("g", group=group, bucket_bytes=64 << 10)
store.wait(["ready1"])
for n in range(1, 4):
    if n == 2:
        model["small1"] += 1
    if n == 3:
        model["big"][5:10] = n
    v = pub.publish(model, step=n)
    print(json.dumps({"version": v.version, "sent": pub.last_sent_bytes, "hashes": hashes(model)}), flush=True)
    store.wait([f"served{n}"])
store.wait(["finished"], datetime.timedelta(seconds=120))
"""

CONSUMER = """
hot = stream.HotModel(weights(zero=True), "g", group=group, src=0, bucket_bytes=64 << 10, label="group rank 1")
seen = {}
def swapped(version, _):
    with hot.serving() as m:
        seen[version] = hashes(m)
hot.on_swap(swapped)
store.set("ready1", "1")
def report():
    print(json.dumps({"version": hot.version, "seen": seen, "received": hot.bytes_received,
                      "shared": hot.bytes_shared, "failures": hot.failures, "error": hot.last_error,
                      "group_error": hot.group_error, "notices_only": hot.subscriber.notices_only}), flush=True)
for n in range(1, 4):
    hot.wait_version(n, 60)
    store.set(f"served{n}", "1")
report()
hot.wait_version(4, 60)
report()
store.set("finished", "1")
"""


def rank_in(node: Any, sock: Path, n: int, code: str, port: int, host: str) -> subprocess.Popen[str]:
    """Rank `n` inside `node`, its agent's socket `sock`; gloo talks over the node's link."""
    prelude = textwrap.dedent(RANK).format(host=host, port=port, master=n == 0, rank=n) + MODEL
    env = {
        **os.environ,
        "XDG_RUNTIME_DIR": str(sock.parent.parent),
        "GLOO_SOCKET_IFNAME": node.link,
    }
    return subprocess.Popen(
        node.cmd(sys.executable, "-c", prelude + textwrap.dedent(code)),
        env=env,
        stdout=subprocess.PIPE,
        stderr=open(sock.parent / f"rank{n}.log", "w"),
        text=True,
    )


def of(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in report["streams"] if s["name"] == name)


def test_a_group_consumer_on_another_node_gets_the_tensors_once_through_the_group_and_its_agent_pulls_none(
    tmp_path: Path,
) -> None:
    """3 versions through the group: served byte for byte, and the consumer's node's agent pulled 0 bytes
    (it relayed 3 notices); then a version published outside the group is pulled once, when asked for."""
    pytest.importorskip("torch")
    from tierstore.testing.netns import Nodes, start_redis

    token = job_token(tmp_path / "token")
    with Nodes(2) as nodes:
        n0, n1 = nodes.nodes
        url = f"redis://{n0.address}:6391/"
        server = start_redis(n0.address, 6391, node=n0)
        agents, socks = [], []
        for i, n in enumerate((n0, n1)):
            sock = tmp_path / f"node{i}" / "tierstore" / "agent.sock"
            sock.parent.mkdir(parents=True)
            args = ["--listen", f"{n.address}:7079", "--token-file", str(token), "--stream-redis", url]
            agents.append(start_agent(sock, *args, node=f"node{i}", inside=n.cmd))
            socks.append(sock)
        ranks: list[subprocess.Popen[str]] = []
        try:
            publisher = rank_in(n0, socks[0], 0, PUBLISHER, 29571, n0.address)
            consumer = rank_in(n1, socks[1], 1, CONSUMER, 29571, n0.address)
            ranks = [publisher, consumer]
            logs = [socks[0].parent / "rank0.log", socks[1].parent / "rank1.log"]
            published = [json.loads(line(publisher, logs[0])) for _ in range(3)]
            assert [p["version"] for p in published] == [1, 2, 3]
            got = json.loads(line(consumer, logs[1]))
            assert got["notices_only"] and got["failures"] == 0 and got["group_error"] is None, got
            assert got["seen"] == {str(p["version"]): p["hashes"] for p in published}, got
            assert got["received"] == sum(p["sent"] for p in published) and got["shared"] == 0, got
            far, near = of(stream.streams(socks[1]), "g"), of(stream.streams(socks[0]), "g")
            print(
                f"through the group: {got['received']} bytes; the consumer node's agent pulled "
                f"{far['pulled_bytes']} bytes and relayed {far['relayed']} notices"
            )
            assert far["pulled"] == 0 and far["pulled_bytes"] == 0, far
            assert far["relayed"] == 3 and far["newest"] == 3, far
            assert stream.streams(socks[0])["served_bytes"] == 0, "no tensor left the publisher's agent"
            assert near["latest"] == 3, near
            [c] = far["consumers"]
            assert c["label"] == "group rank 1" and c["notices_only"] and c["serving"] == 3, c
            assert c["behind"] == 0, c

            # Outside the group (as after a group failure): the consumer fetches it, its agent pulls it once.
            m = {"big": np.full(100_000, 4, dtype=np.float32), "small0": np.full(100, 4, dtype=np.float32)}
            m |= {"small1": np.full(50, 4, dtype=np.int64), "half": np.full(3000, 4, dtype=np.uint16)}
            m["flag"] = np.ones(7, dtype=bool)
            v4 = stream.publish("g", m, socket=socks[0])
            assert isinstance(v4, stream.StreamVersion) and v4.version == 4
            got = json.loads(line(consumer, logs[1]))
            assert got["version"] == 4 and got["error"] is None, got
            assert got["seen"]["4"] == {t.name: t.hash for t in v4.tensors}, got
            assert got["shared"] == v4.nbytes, got
            far = of(stream.streams(socks[1]), "g")
            assert far["pulled"] == 1 and far["pulled_bytes"] == v4.nbytes, far
            assert stream.streams(socks[0])["served_bytes"] == v4.nbytes
            for r, log in zip(ranks, logs, strict=True):
                assert r.wait(timeout=60) == 0, log.read_text()
        finally:
            for r in ranks:
                if r.poll() is None:
                    r.kill()
            server.kill()
            for a in agents:
                stop_agent(a)
