"""Model streaming across two nodes (network namespaces), the agents meeting through Redis on the first:
a node pulls only the tensors it lacks, once per version whatever the number of its consumers, and catches
up after Redis restarts. (Through a process group across nodes: test_group_nodes.py.)"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.agents import child_in, start_agent, stop_agent
from tests.helpers.cluster import job_token
from tierstore import stream

pytestmark = [pytest.mark.root, pytest.mark.netns, pytest.mark.redis]


def test_across_namespaces_a_node_pulls_only_what_it_lacks_once_and_catches_up_after_redis_restarts(
    tmp_path: Path,
) -> None:
    """Two nodes (network namespaces), Redis on the first: two consumers on the second node are served by
    one pull per version of the tensors their node lacks; Redis restarted, they catch up."""
    from tierstore.testing.netns import Nodes, start_redis

    token = job_token(tmp_path / "token")
    with Nodes(2) as nodes:
        n0, n1 = nodes.nodes
        url = f"redis://{n0.address}:6390/"

        def redis() -> subprocess.Popen[bytes]:
            return start_redis(n0.address, 6390, node=n0)

        server = redis()
        agents, socks, args_of = [], [], []
        for i, n in enumerate((n0, n1)):
            sock = tmp_path / f"node{i}" / "tierstore" / "agent.sock"
            sock.parent.mkdir(parents=True)
            args = ["--listen", f"{n.address}:7078", "--token-file", str(token), "--stream-redis", url]
            agents.append(start_agent(sock, *args, node=f"node{i}", inside=n.cmd))
            socks.append(sock)
            args_of.append(args)
        try:
            consumers = [
                child_in(
                    n1.cmd,
                    """
                    import json, time
                    from tierstore import stream
                    sub = stream.Subscriber("xm")
                    def seen(v):
                        sd = v.state_dict("numpy")
                        print(json.dumps({"version": v.version, "skipped": sub.skipped,
                                          "values": {k: float(a[0]) for k, a in sd.items()},
                                          "whole": all(bool((a == a[0]).all()) for a in sd.values())}), flush=True)
                    sub.on_update(seen)
                    print("ready", flush=True)
                    time.sleep(600)
                    """,
                    socks[1],
                )
                for _ in range(2)
            ]
            for c in consumers:
                assert c.stdout is not None and c.stdout.readline().strip() == "ready"
            m = {f"t{i}": np.full(1 << 18, i + 1.0, dtype=np.float32) for i in range(4)}  # 4 x 1 MiB
            pub = stream.Publisher("xm", socket=socks[0])

            def next_seen() -> list[dict[str, object]]:
                return [json.loads(c.stdout.readline()) for c in consumers if c.stdout is not None]

            pub.publish(m)
            for got in next_seen():
                assert got["version"] == 1 and got["whole"], got
                assert got["values"] == {"t0": 1.0, "t1": 2.0, "t2": 3.0, "t3": 4.0}, got
            far = stream.streams(socks[1])["streams"][0]
            assert far["pulled"] == 1 and far["pulled_bytes"] == 4 << 20, far
            m["t2"][:] = 10.0
            pub.publish(m)
            for got in next_seen():
                assert got["version"] == 2 and got["whole"] and got["values"]["t2"] == 10.0  # type: ignore[index]
            far = stream.streams(socks[1])["streams"][0]
            assert far["pulled"] == 2 and far["pulled_bytes"] == 5 << 20, (
                "only the changed tensor crossed, once"
            )
            # Redis goes away: versions 3 and 4 are published meanwhile; the node catches up to 4 once it is back.
            server.kill()
            server.wait()
            m["t0"][:] = 20.0
            pub.publish(m)
            m["t1"][:] = 30.0
            pub.publish(m)
            time.sleep(0.5)
            server = redis()
            for got in next_seen():
                assert got["version"] == 4 and got["whole"], got
                assert (
                    got["values"] == {"t0": 20.0, "t1": 30.0, "t2": 10.0, "t3": 4.0} and got["skipped"] == 1
                ), got
            pub.close()
            # The publisher's agent restarts (its versions are gone): it numbers on from Redis's latest,
            # so the other node takes its next version as new.
            stop_agent(agents[0])
            agents[0] = start_agent(socks[0], *args_of[0], node="node0", inside=n0.cmd)
            m["t3"][:] = 40.0
            again = stream.publish("xm", m, socket=socks[0])
            assert isinstance(again, stream.StreamVersion) and again.version == 5
            for got in next_seen():
                assert got["version"] == 5 and got["values"]["t3"] == 40.0 and got["skipped"] == 1, got
            for c in consumers:
                c.kill()
                c.wait()
        finally:
            server.kill()
            for a in agents:
                stop_agent(a)
