"""Model streaming on one node: a publisher and consumers in separate processes, through a real agent.

Publishers are SIGKILLed mid-publish (consumers never see a partial version), consumers are SIGKILLed
(their leases end with them), and a soak checks that no version is missed and no request mixes versions.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import child, start_agent, stop_agent
from tierstore import _core, stream


def wait_for(what: str, cond: object, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.01)
    pytest.fail(f"{what}: not within {timeout} s")


def model(value: float, sizes: tuple[int, ...] = (1000, 30, 5000)) -> dict[str, np.ndarray]:
    return {f"t{i}": np.full(n, value, dtype=np.float32) for i, n in enumerate(sizes)}


def info(name: str) -> dict[str, object]:
    for s in stream.streams()["streams"]:
        if s["name"] == name:
            return s  # type: ignore[no-any-return]
    return {}


def test_versions_reach_a_consumer_process_whole_and_only_changed_tensors_are_placed(sock: Path) -> None:
    consumer = child(
        """
        import json, sys
        from tierstore import stream
        sub = stream.Subscriber("m")
        print("ready", flush=True)
        for want in (1, 2, 3):
            v = sub.wait(timeout=30, after=want - 1)
            sd = stream.StreamVersion.state_dict(v, "numpy")
            print(json.dumps({"version": v.version, "step": v.step, "meta": v.metadata,
                              "values": {k: [float(a.min()), float(a.max())] for k, a in sd.items()}}), flush=True)
        """,
        sock,
    )
    assert consumer.stdout is not None
    assert consumer.stdout.readline().strip() == "ready", consumer.stderr.read() if consumer.stderr else ""
    m = model(1.0)
    v1 = stream.publish("m", m, step=10, metadata={"lr": 0.1})
    assert isinstance(v1, stream.StreamVersion)
    assert (v1.version, v1.new_bytes, v1.nbytes) == (1, 4 * 6030, 4 * 6030)
    # The consumer reads version 1 before version 2 is published: it must see every one.
    seen = [json.loads(consumer.stdout.readline())]
    m["t1"][:] = 2.0
    v2 = stream.publish("m", m, step=11)
    assert isinstance(v2, stream.StreamVersion)
    assert (v2.version, v2.new_bytes) == (2, 4 * 30), "only the changed tensor is placed"
    seen.append(json.loads(consumer.stdout.readline()))
    m["t0"][:] = 3.0
    stream.publish("m", m, step=12)
    seen.append(json.loads(consumer.stdout.readline()))
    assert consumer.wait(timeout=30) == 0, consumer.stderr.read() if consumer.stderr else ""
    assert [s["version"] for s in seen] == [1, 2, 3]
    assert seen[0]["meta"] == {"lr": 0.1} and seen[0]["step"] == 10
    assert seen[1]["values"] == {"t0": [1.0, 1.0], "t1": [2.0, 2.0], "t2": [1.0, 1.0]}
    assert seen[2]["values"] == {"t0": [3.0, 3.0], "t1": [2.0, 2.0], "t2": [1.0, 1.0]}
    # Two versions kept: version 1 and the tensor only it held are freed.
    wait_for("version 1 freed", lambda: [v["version"] for v in info("m")["versions"]] == [2, 3])  # type: ignore[attr-defined]
    assert stream.streams()["tensor_files"] == 4


def test_hot_model_loads_changed_tensors_into_the_idle_copy_and_swaps(sock: Path) -> None:
    torch = pytest.importorskip("torch")
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    trainer = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    hot = stream.HotModel(net, "policy")
    try:
        v1 = stream.publish("policy", trainer, step=1)
        assert isinstance(v1, stream.StreamVersion)
        hot.wait_version(1, timeout=20)
        x = torch.randn(4, 64)
        with hot.serving() as m, torch.no_grad():
            assert torch.equal(m(x), trainer(x))
        copied = hot.bytes_copied
        assert copied == v1.nbytes
        with torch.no_grad():
            trainer[1].bias.add_(1.0)
        # After a swap, the retired copy is brought to the served version off the critical path.
        wait_for("the idle copy caught up", lambda: hot.idle_version == 1)
        assert hot.bytes_caught_up == v1.nbytes
        stream.publish("policy", trainer, step=2)
        hot.wait_version(2, timeout=20)
        # An update copies only the tensors that changed: the 8 floats of one bias.
        assert hot.bytes_copied - copied == 8 * 4
        wait_for("the idle copy caught up", lambda: hot.idle_version == 2)
        with torch.no_grad():
            trainer[1].bias.add_(1.0)
        stream.publish("policy", trainer, step=3)
        hot.wait_version(3, timeout=20)
        assert hot.bytes_copied - copied == 2 * 8 * 4
        wait_for("the idle copy caught up", lambda: hot.idle_version == 3)
        assert hot.bytes_caught_up == v1.nbytes + 2 * 8 * 4
        with hot.serving() as m, torch.no_grad():
            assert torch.equal(m(x), trainer(x))
        assert hot.failures == 0 and hot.last_error is None
    finally:
        hot.close()


@pytest.mark.parametrize("mode", ["double", "in-place"])
def test_wait_version_returns_only_once_the_on_swap_callbacks_of_that_swap_have_run(
    sock: Path, mode: str
) -> None:
    """The callbacks run after the swap, outside the lock requests take (a request is served meanwhile);
    wait_version waits for them too."""
    hot = stream.HotModel(model(0.0), "cb", mode=mode)
    ran: list[int] = []
    served_during_callback: list[int | None] = []

    def slow(version: int, _: float) -> None:
        with hot.serving():  # requests are not held back by a callback
            served_during_callback.append(hot.version)
        time.sleep(0.5)
        ran.append(version)

    hot.on_swap(slow)
    try:
        for n in (1, 2):
            stream.publish("cb", model(float(n)))
            hot.wait_version(n, timeout=20)
            assert ran == list(range(1, n + 1)), f"wait_version({n}) returned before its on_swap callback"
        assert served_during_callback == [1, 2]
        with pytest.raises(TimeoutError, match="on_swap callbacks done through 2"):
            hot.wait_version(3, timeout=0.1)
    finally:
        hot.close()


def test_an_update_that_does_not_fit_leaves_the_served_version_and_says_why(sock: Path) -> None:
    served = model(0.0)
    hot = stream.HotModel(served, "m")
    try:
        stream.publish("m", model(1.0))
        hot.wait_version(1, timeout=20)
        stream.publish("m", model(2.0, sizes=(1000, 31, 5000)))
        wait_for("the failed update reported", lambda: hot.failures == 1)
        assert hot.version == 1
        assert (
            hot.last_error is not None
            and "'t1'" in hot.last_error
            and "still serving version 1" in hot.last_error
        )
        with hot.serving() as m:
            assert all((a == 1.0).all() for a in m.values())
        stream.publish("m", model(3.0))
        hot.wait_version(3, timeout=20)
        with hot.serving() as m:
            assert all((a == 3.0).all() for a in m.values())
    finally:
        hot.close()


def test_async_publish_snapshots_before_returning(sock: Path) -> None:
    m = model(1.0)
    fut = stream.publish("m", m, sync=False, step=1)
    m["t0"][:] = 9.0  # training goes on at once
    v = fut.result(timeout=20)  # type: ignore[union-attr]
    assert v.version == 1
    with stream.Subscriber("m") as sub:
        got = sub.wait(timeout=20).state_dict("numpy")
        assert (got["t0"] == 1.0).all()
    with stream.Subscriber("m") as sub, pytest.raises(TimeoutError, match="no version of m newer than 1"):
        sub.wait(timeout=0.2, after=1)


def blake3(a: Any) -> str:
    return _core.hash_buffers([np.ascontiguousarray(a).reshape(-1).view(np.uint8)])[0].hex()


def test_a_changed_hint_compares_the_other_tensors_at_their_head_only_and_reports_a_wrong_one(
    sock: Path,
) -> None:
    # t2 is 160,000 bytes: past its first 64 KiB, a tensor said unchanged is not read.
    m = model(1.0, sizes=(1000, 30, 40000))
    pub = stream.Publisher("m")
    v1 = pub.publish(m)
    assert isinstance(v1, stream.StreamVersion)
    old = {t.name: t.hash for t in v1.tensors}
    m["t0"][:] = 2.0
    m["t2"][30000] = 7.0  # past the head of a tensor the hint leaves out
    v2 = pub.publish(m, changed=["t0"])
    assert isinstance(v2, stream.StreamVersion)
    got = {t.name: t.hash for t in v2.tensors}
    assert got["t0"] == blake3(m["t0"]) != old["t0"]
    assert got["t2"] == old["t2"], "a tensor said unchanged was read past its head"
    assert v2.new_bytes == 4000 and pub.hint_misses == []
    # A wrong hint whose heads differ is caught: the tensors are published and named.
    m["t1"][:] = 3.0
    m["t2"][0] = 8.0
    with pytest.warns(RuntimeWarning, match=r"left out 2 tensor\(s\) whose bytes changed \('t1', 't2'\)"):
        v3 = pub.publish(m, changed=["t0"])
    assert isinstance(v3, stream.StreamVersion)
    assert {t.name: t.hash for t in v3.tensors} == {k: blake3(a) for k, a in m.items()}
    assert len(pub.hint_misses) == 1
    # Another publisher's version came between: the hint is relative to a version the agent no longer has
    # as its latest, and every tensor is compared whole.
    other = stream.Publisher("m")
    m2 = {k: a.copy() for k, a in m.items()}
    m2["t2"][30000] = 1.0
    other.publish(m2)
    other.close()
    v5 = pub.publish(m, changed=[])
    assert isinstance(v5, stream.StreamVersion)
    assert {t.name: t.hash for t in v5.tensors} == {k: blake3(a) for k, a in m.items()}
    # Bad hints are refused before anything is placed.
    with pytest.raises(ValueError, match=r"for one tensor, \['t0'\]"):
        pub.publish(m, changed="t0")
    with pytest.raises(ValueError, match=r"names 'nope' and 1 more, not a tensor of the model"):
        pub.publish(m, changed=["t0", "nope", "nope2"])
    with pytest.raises(TypeError, match=r"needs the nn\.Module"):
        pub.publish(m, changed="trainable")
    pub.close()
    assert info("m")["latest"] == 5


def test_a_changed_hint_spares_an_async_snapshot_the_copy_of_the_tensors_left_out(sock: Path) -> None:
    m = model(1.0, sizes=(1000, 40000))
    pub = stream.Publisher("m")
    first = pub.publish(m, sync=False)
    assert isinstance(first, Future)
    old = {t.name: t.hash for t in first.result(timeout=20).tensors}
    m["t0"][:] = 2.0
    m["t1"][30000] = 7.0  # past the head: not copied into the staging buffer
    v2 = pub.publish(m, sync=False, changed=["t0"]).result(timeout=20)  # type: ignore[union-attr]
    assert {t.name: t.hash for t in v2.tensors} == {"t0": blake3(m["t0"]), "t1": old["t1"]}
    m["t1"][0] = 9.0
    with pytest.warns(RuntimeWarning, match="'t1'"):
        fut = pub.publish(m, sync=False, changed=["t0"])
    v3 = fut.result(timeout=20)  # type: ignore[union-attr]
    assert {t.name: t.hash for t in v3.tensors} == {k: blake3(a) for k, a in m.items()}
    pub.close()


def test_changed_trainable_takes_frozen_parameters_as_unchanged(sock: Path) -> None:
    torch = pytest.importorskip("torch")
    net = torch.nn.Sequential(torch.nn.Linear(200, 200), torch.nn.Linear(200, 4))
    for p in net[0].parameters():
        p.requires_grad_(False)  # a frozen base, trained through the head only (as a LoRA's adapters)
    pub = stream.Publisher("m")
    v1 = pub.publish(net)
    assert isinstance(v1, stream.StreamVersion)
    old = {t.name: t.hash for t in v1.tensors}
    with torch.no_grad():
        net[1].weight.add_(1.0)
        net[0].weight.view(-1)[30000] += 1.0  # a frozen tensor changed past its head: trusted unchanged
    v2 = pub.publish(net, changed="trainable")
    assert isinstance(v2, stream.StreamVersion)
    got = {t.name: t.hash for t in v2.tensors}
    assert got["1.weight"] == blake3(net[1].weight.detach().numpy()) != old["1.weight"]
    assert got["0.weight"] == old["0.weight"] and got["0.bias"] == old["0.bias"]
    assert v2.new_bytes == net[1].weight.numel() * 4
    pub.close()


def test_a_distributed_publisher_takes_the_changed_hint_against_its_module(sock: Path) -> None:
    torch = pytest.importorskip("torch")
    dist = pytest.importorskip("torch.distributed")
    # A group of one: the hint is resolved against the module before the group sees a state_dict.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        net = torch.nn.Sequential(torch.nn.Linear(200, 200), torch.nn.Linear(200, 4))
        net[0].requires_grad_(False)
        pub = stream.DistributedPublisher("m")
        v1 = pub.publish(net)
        with torch.no_grad():
            net[1].weight.add_(1.0)
            net[0].weight.view(-1)[30000] += 1.0  # frozen, changed past its head: trusted unchanged
        v2 = pub.publish(net, changed="trainable")
        old, got = ({t.name: t.hash for t in v.tensors} for v in (v1, v2))
        assert got["0.weight"] == old["0.weight"] and got["1.weight"] != old["1.weight"]
        assert v2.new_bytes == net[1].weight.numel() * 4
        pub.close()
    finally:
        dist.destroy_process_group()


def test_a_publisher_killed_mid_publish_leaves_no_version(sock: Path) -> None:
    with stream.Subscriber("big") as sub:
        seen: list[int] = []
        sub.on_update(lambda v: seen.append(v.version))
        publisher = child(
            """
            import numpy as np
            from tierstore import stream
            stream.publish("big", {"w": np.zeros(1 << 20, dtype=np.float32)})
            print("published", flush=True)
            rng = np.random.default_rng(0)
            stream.publish("big", {"w": rng.random(1 << 20, dtype=np.float32)} |
                           {f"x{i}": rng.random(1 << 22, dtype=np.float32) for i in range(40)})
            print("should not get here", flush=True)
            """,
            sock,
        )
        assert publisher.stdout is not None
        assert publisher.stdout.readline().strip() == "published"
        tmp = Path(stream.streams()["dir"]) / "tmp"
        # Killed while its tensors are being placed.
        wait_for("the second publish placing tensors", lambda: any(p.iterdir() for p in tmp.iterdir()), 60)
        os.kill(publisher.pid, signal.SIGKILL)
        publisher.wait(timeout=20)
        wait_for("the publish's directory removed", lambda: not any(tmp.iterdir()))
        assert info("big")["latest"] == 1
        assert seen == [1]
        # The next publisher's version is whole and numbered next.
        v = stream.publish("big", {"w": np.ones(1 << 20, dtype=np.float32)})
        assert isinstance(v, stream.StreamVersion) and v.version == 2
        got = sub.wait(timeout=20, after=1)
        assert got.version == 2 and (got.state_dict("numpy")["w"] == 1.0).all()
        assert seen == [1, 2]


def test_a_killed_consumer_releases_its_lease(sock: Path) -> None:
    stream.publish("m", model(1.0))
    consumer = child(
        """
        import time
        from tierstore import stream
        sub = stream.Subscriber("m")
        v = sub.wait(timeout=20)
        assert sub.pin(v.version)
        print(v.version, flush=True)
        time.sleep(600)
        """,
        sock,
    )
    assert consumer.stdout is not None
    assert consumer.stdout.readline().strip() == "1"
    for value in (2.0, 3.0, 4.0):
        stream.publish("m", model(value))
    held = [v["version"] for v in info("m")["versions"]]  # type: ignore[attr-defined]
    assert held == [1, 3, 4], "version 1 is leased by the consumer"
    os.kill(consumer.pid, signal.SIGKILL)
    consumer.wait(timeout=20)
    # Its lease ends with its connection; the next eviction frees version 1.
    wait_for("version 1 freed", lambda: [v["version"] for v in info("m")["versions"]] == [3, 4])  # type: ignore[attr-defined]
    assert stream.streams()["tensor_files"] == 6


SOAK_UPDATES = 10_000


def test_soak_no_version_missed_and_no_request_mixes_versions(sock: Path) -> None:
    consumer = child(
        f"""
        import json, threading, time
        import numpy as np
        from tierstore import stream
        model = {{f"t{{i}}": np.zeros(256, dtype=np.float32) for i in range(4)}}
        hot = stream.HotModel(model, "soak")
        order = []
        hot.subscriber.on_update(lambda v: order.append(v.version))
        print("ready", flush=True)
        requests = mixed = 0
        versions = set()
        while True:
            with hot.serving() as m:
                values = {{float(a[0]) for a in m.values()}}
                whole = all((a == a[0]).all() for a in m.values())
            requests += 1
            mixed += len(values) != 1 or not whole
            versions |= values
            if hot.version == {SOAK_UPDATES}:
                break
        time.sleep(0.2)
        print(json.dumps({{"order_ok": order == list(range(1, {SOAK_UPDATES} + 1)), "received": len(order),
                          "requests": requests, "mixed": mixed, "versions_served": len(versions),
                          "skipped": hot.subscriber.skipped, "failures": hot.failures,
                          "errors": hot.subscriber.errors[:3]}}), flush=True)
        """,
        sock,
    )
    assert consumer.stdout is not None
    assert consumer.stdout.readline().strip() == "ready", consumer.stderr.read() if consumer.stderr else ""
    m = {f"t{i}": np.zeros(256, dtype=np.float32) for i in range(4)}
    publisher = stream.Publisher("soak")
    t0 = time.monotonic()
    for n in range(1, SOAK_UPDATES + 1):
        for a in m.values():
            a[:] = n
        v = publisher.publish(m, step=n)
        assert isinstance(v, stream.StreamVersion) and v.version == n
    took = time.monotonic() - t0
    publisher.close()
    out = consumer.stdout.readline()
    assert consumer.wait(timeout=60) == 0, consumer.stderr.read() if consumer.stderr else ""
    report = json.loads(out)
    print(f"soak: {SOAK_UPDATES} updates in {took:.1f} s; consumer {report}")
    assert report["order_ok"] and report["received"] == SOAK_UPDATES, report
    assert report["mixed"] == 0 and report["skipped"] == 0 and report["failures"] == 0, report
    assert report["versions_served"] > 1


def test_across_namespaces_a_node_pulls_only_what_it_lacks_once_and_catches_up_after_redis_restarts(
    tmp_path: Path,
) -> None:
    """Two nodes (network namespaces), Redis on the first: two consumers on the second node are served by
    one pull per version of the tensors their node lacks; Redis restarted, they catch up."""
    from tierstore.testing.netns import Nodes, start_redis

    token = tmp_path / "token"
    token.write_text("0123456789abcdef0123456789abcdef\n")
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


def child_in(cmd: object, code: str, sock: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(sock.parent.parent)}
    return subprocess.Popen(
        cmd(sys.executable, "-c", textwrap.dedent(code)),  # type: ignore[operator]
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_async_publishes_reuse_the_hashes_of_tensors_unchanged_since_the_last_snapshot(sock: Path) -> None:
    m = model(1.0)
    publisher = stream.Publisher("m")
    versions = []
    for value in (1.0, 2.0, 3.0):
        m["t2"][:] = value
        fut = publisher.publish(m, sync=False)
        assert isinstance(fut, Future)
        versions.append(fut.result(timeout=20))
    m["t0"][:] = 5.0
    sync = publisher.publish(m)
    assert isinstance(sync, stream.StreamVersion)
    publisher.close()
    assert [v.version for v in versions] == [1, 2, 3]
    assert [v.new_bytes for v in versions[1:]] == [4 * 5000, 4 * 5000], "only t2 placed"
    assert sync.new_bytes == 4 * 1000
    with stream.Subscriber("m") as sub:
        got = sub.wait(timeout=20).state_dict("numpy")
        assert got["t0"][0] == 5.0 and got["t1"][0] == 1.0 and got["t2"][0] == 3.0
        want = {k: _core.hash_buffers([a.reshape(-1).view(np.uint8)])[0].hex() for k, a in m.items()}
        assert {t.name: t.hash for t in sub.latest().tensors} == want  # type: ignore[union-attr]


def test_the_cli_lists_shows_and_watches_streams(sock: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tierstore.cli", "stream", *args, "--socket", str(sock)],
            capture_output=True,
            text=True,
            timeout=60,
        )

    m = model(1.0)
    stream.publish("cli-model", m, step=7)
    m["t1"][:] = 2.0
    stream.publish("cli-model", m, step=8)
    ls = cli("ls")
    assert ls.returncode == 0, ls.stderr
    row = next(line.split() for line in ls.stdout.splitlines() if line.startswith("cli-model"))
    assert row[1:3] == ["2", "2"], ls.stdout  # latest 2, two versions kept
    show = cli("show", "cli-model")
    assert show.returncode == 0, show.stderr
    versions, consumers = show.stdout.split("\nconsumers: ")
    rows = [line.split() for line in versions.splitlines()[2:]]
    assert consumers.startswith("0, newest version 2"), show.stdout
    assert [(r[0], r[1]) for r in rows] == [("1", "7"), ("2", "8")], show.stdout
    missing = cli("show", "nope")
    assert missing.returncode != 0 and "no stream 'nope'" in missing.stderr and "cli-model" in missing.stderr
    watch = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tierstore.cli",
            "stream",
            "watch",
            "cli-model",
            "--count",
            "2",
            "--socket",
            str(sock),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert watch.stdout is not None
    first = watch.stdout.readline()  # the latest, on subscribing
    assert first.startswith("cli-model@2 step 8"), first
    m["t0"][:] = 3.0
    stream.publish("cli-model", m, step=9)
    assert watch.stdout.readline().startswith("cli-model@3 step 9")
    assert watch.wait(timeout=30) == 0


def test_every_kth_version_is_flushed_to_the_repository_in_the_background(sock: Path, tmp_path: Path) -> None:
    from tierstore.models import Repository

    repo = Repository(tmp_path / "repo")
    publisher = stream.Publisher("h", history=repo, history_every=2)
    m = model(0.0)
    for n in range(1, 6):
        m["t1"][:] = n
        publisher.publish(m, step=100 + n, metadata={"run": "a"})
        if n == 2:
            # Saved in the background; waited for here only so that version 4 cannot find it still due
            # (a flush that falls behind skips to the newest version and counts it).
            assert publisher.flush_history(timeout=60)
    assert publisher.flush_history(timeout=60)
    publisher.close()
    assert publisher.flushed == [2, 4] and publisher.flush_skipped == 0, publisher.flush_errors
    saved = repo.versions("h")
    assert [v.metadata["stream_version"] for v in saved] == [2, 4]
    assert saved[1].metadata["step"] == 104 and saved[1].metadata["run"] == "a"
    assert saved[1].written_bytes == 4 * 30, "the history deduplicates: only the changed tensor is written"
    last = repo.load("h", mmap=False)
    assert (np.asarray(last["t1"]) == 4.0).all() and (np.asarray(last["t0"]) == 0.0).all()


def test_a_process_that_exits_right_after_an_async_publish_still_places_it_and_saves_its_history(
    sock: Path, tmp_path: Path
) -> None:
    """`publish(sync=False)` returns before the version exists and the history is saved on a daemon
    thread: leaving the program at once must not lose either."""
    from tierstore.models import Repository

    proc = child(
        f"""
        import numpy as np
        from tierstore import stream
        m = {{"w": np.full(1 << 20, 7.0, dtype=np.float32)}}
        stream.publish("bye", m, step=9, sync=False, history={str(tmp_path / "repo")!r})
        """,
        sock,
    )
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert info("bye")["latest"] == 1, "the asynchronous publish was lost at exit"
    saved = Repository(tmp_path / "repo").versions("bye")
    assert [v.metadata["step"] for v in saved] == [9], "the history was not saved before exit"
    assert (np.asarray(Repository(tmp_path / "repo").load("bye", mmap=False)["w"]) == 7.0).all()


def test_an_agent_that_stops_frees_the_shared_memory_of_its_versions(tmp_path: Path) -> None:
    path = tmp_path / "tierstore" / "agent.sock"
    path.parent.mkdir()
    proc = start_agent(path)
    try:
        stream.publish("gone", model(1.0), socket=path)
        held = Path(stream.streams(path)["dir"])
        assert len(list((held / "blobs").iterdir())) == 3
    finally:
        stop_agent(proc)
    assert proc.returncode == 0
    assert not held.exists(), f"{held} left behind"


IN_PLACE_UPDATES = 200


def test_in_place_mode_keeps_one_copy_pauses_requests_briefly_and_never_mixes_versions(sock: Path) -> None:
    """A consumer process serves requests without a break while versions arrive; its HotModel writes them
    into the one copy of the model it has, holding requests back for the pause each update reports."""
    consumer = child(
        f"""
        import json, tracemalloc
        import numpy as np
        from tierstore import stream
        model = {{f"t{{i}}": np.zeros(1 << 18, dtype=np.float32) for i in range(4)}}  # 4 MiB
        tracemalloc.start()
        hot = stream.HotModel(model, "inplace", mode="in-place")
        pauses = []
        hot.on_pause(lambda version, seconds: pauses.append(seconds))
        print("ready", flush=True)
        requests = mixed = 0
        versions = set()
        while hot.version != {IN_PLACE_UPDATES}:
            with hot.serving() as m:
                assert m is model
                first = float(m["t0"][0])
                whole = all(bool((a == first).all()) for a in m.values())
            requests += 1
            mixed += not whole
            versions.add(first)
        _, peak = tracemalloc.get_traced_memory()
        print(json.dumps({{"requests": requests, "mixed": mixed, "versions_served": len(versions),
                          "updates": hot.updates, "pauses": hot.pauses, "reported": len(pauses),
                          "max_pause_s": hot.max_pause_s, "sum_pause_s": sum(pauses), "copies": hot.copies,
                          "peak": peak, "model": sum(a.nbytes for a in model.values()),
                          "failures": hot.failures, "error": hot.last_error}}), flush=True)
        hot.close()
        """,
        sock,
    )
    assert consumer.stdout is not None
    assert consumer.stdout.readline().strip() == "ready", consumer.stderr.read() if consumer.stderr else ""
    m = {f"t{i}": np.zeros(1 << 18, dtype=np.float32) for i in range(4)}
    publisher = stream.Publisher("inplace")
    for n in range(1, IN_PLACE_UPDATES + 1):
        for a in m.values():
            a[:] = n
        publisher.publish(m)
    publisher.close()
    out = consumer.stdout.readline()
    assert consumer.wait(timeout=60) == 0, consumer.stderr.read() if consumer.stderr else ""
    report = json.loads(out)
    print(f"in place: {report}")
    assert report["mixed"] == 0 and report["failures"] == 0, report
    assert report["versions_served"] > 1, report
    # Each update paused requests once, and said for how long.
    assert report["pauses"] == report["updates"] == report["reported"] > 0, report
    assert 0 < report["max_pause_s"] < 1.0, report
    # One copy: nothing model-sized was allocated besides the model itself.
    assert report["copies"] == 1 and report["peak"] < report["model"] // 4, report


def test_an_in_place_update_torn_midway_stops_requests_until_the_next_one(sock: Path) -> None:
    served = model(0.0)
    hot = stream.HotModel(served, "torn", mode="in-place")
    try:
        stream.publish("torn", model(1.0))
        hot.wait_version(1, timeout=20)

        def fails(paths: list[Path], dests: list[np.ndarray]) -> None:
            dests[0][:] = 0xFF  # part of the model written, then the read fails
            raise OSError("the read failed")

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_core, "stream_read", fails)
            stream.publish("torn", model(2.0))
            wait_for("the torn update reported", lambda: hot.failures == 1)
        assert hot.last_error is not None and "the read failed" in hot.last_error
        assert "requests raise until an update" in hot.last_error and hot.pauses == 2
        with pytest.raises(stream.StreamError, match="failed midway; no whole version"), hot.serving():
            pass
        # Version 3 changes only t1 from version 2; what the torn update left is rewritten as well.
        m3 = model(2.0)
        m3["t1"][:] = 3.0
        stream.publish("torn", m3)
        hot.wait_version(3, timeout=20)
        with hot.serving() as m:
            assert {k: float(a.min()) for k, a in m.items()} == {"t0": 2.0, "t1": 3.0, "t2": 2.0}
            assert {k: float(a.max()) for k, a in m.items()} == {"t0": 2.0, "t1": 3.0, "t2": 2.0}
    finally:
        hot.close()


def test_double_mode_allocates_a_second_copy_which_in_place_does_not(sock: Path) -> None:
    """The measure the in-place test relies on: a second copy of a numpy model shows in tracemalloc."""
    import tracemalloc

    m = model(0.0, sizes=(1 << 18, 1 << 18))  # 2 MiB
    nbytes = sum(a.nbytes for a in m.values())
    update = model(1.0, sizes=(1 << 18, 1 << 18))
    for mode, copies in (("double", 2), ("in-place", 1)):
        tracemalloc.start()
        try:
            with stream.HotModel(m, f"mem-{mode}", mode=mode) as hot:
                stream.publish(f"mem-{mode}", update)
                hot.wait_version(1, timeout=20)
                _, peak = tracemalloc.get_traced_memory()
                assert hot.copies == copies
        finally:
            tracemalloc.stop()
        assert (peak >= nbytes) if copies == 2 else (peak < nbytes // 4), (mode, peak, nbytes)
    with pytest.raises(ValueError, match='use "double"'):
        stream.HotModel(m, "x", mode="twice")


# A rank of a gloo process group of 3 on loopback (the test holds the TCP store); MODEL below follows it.
RANK = """
import datetime, json, os, signal, sys, time
import torch, torch.distributed as dist
from tierstore import _core, stream
from tierstore.stream import group as _group
store = dist.TCPStore("127.0.0.1", {port}, is_master=False, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank={rank}, world_size={world},
                        timeout=datetime.timedelta(seconds=60))
# The group the tests use, with a short deadline; made once every rank is up, as ranks start unevenly.
group = dist.new_group(list(range({world})), timeout=datetime.timedelta(seconds={timeout}))

def change(m, n):
    if n == 2:
        m["small1"] += 1
    if n == 3:
        m["big"][5:10] = n
        m["flag"][n] = True
    if n == 4:
        m["half"] *= 2
        m["small0"] -= 1
"""

# The model the group tests publish (several dtypes: one tensor larger than the tests' 64 KiB buckets, and
# small ones packed together), and its tensors' hashes; test_stream_group_nodes uses it too.
MODEL = """
def weights(zero=False):
    g = torch.Generator().manual_seed(0)
    m = {"big": torch.randn(100_000, generator=g), "small0": torch.randn(100, generator=g),
         "small1": torch.randint(0, 100, (50,), generator=g),
         "half": torch.randn(3000, generator=g).to(torch.bfloat16), "flag": torch.zeros(7, dtype=torch.bool)}
    if zero:
        for t in m.values():
            t.zero_()
    return m

def hashes(m):
    return {k: _core.hash_buffers([v.reshape(-1).view(torch.uint8).numpy()])[0].hex() for k, v in m.items()}
"""

CONSUMER = """
model = weights(zero=True)
hot = stream.HotModel(model, "g", group=group, src=0, bucket_bytes=64 << 10, mode=mode)
seen = {}
def swapped(version, _):
    with hot.serving() as m:
        seen[version] = hashes(m)
hot.on_swap(swapped)
def wait_seen(n):
    end = time.monotonic() + 60
    while n not in seen and time.monotonic() < end:
        time.sleep(0.01)
store.set(f"ready{rank}", "1")
print("ready", flush=True)
def report():
    print(json.dumps({"version": hot.version, "seen": seen, "received": hot.bytes_received,
                      "shared": hot.bytes_shared, "failures": hot.failures, "error": hot.last_error,
                      "group_error": hot.group_error}), flush=True)
"""


@pytest.fixture
def group_store() -> Iterator[Any]:
    """The TCP store the ranks of a test's process group meet at, on a free loopback port."""
    torch = pytest.importorskip("torch")
    import datetime

    store = torch.distributed.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )
    yield store


def rank(
    sock: Path, store: Any, n: int, code: str, timeout: float = 5.0, world: int = 3, mode: str = "double"
) -> subprocess.Popen[str]:
    prelude = textwrap.dedent(RANK).format(port=store.port, rank=n, timeout=timeout, world=world) + MODEL
    return child(prelude + f"rank = {n}\nmode = {mode!r}\n" + textwrap.dedent(code), sock)


def line(proc: subprocess.Popen[str], log: Path | None = None) -> str:
    """The rank's next line of output; the test fails with its stderr (or `log`, where that went) if it
    exited instead."""
    assert proc.stdout is not None
    out = proc.stdout.readline()
    if not out:
        proc.wait(timeout=20)
        err = log.read_text() if log is not None else proc.stderr.read() if proc.stderr else ""
        pytest.fail(f"rank exited {proc.returncode}: {err}")
    return out


GROUP_TIMEOUT = 5.0


def test_a_process_group_moves_only_changed_tensors_and_a_dead_consumer_fails_the_publish_in_time(
    sock: Path, group_store: Any
) -> None:
    """A publisher rank and 2 consumer ranks (gloo; one keeps two copies, one updates in place): 4 versions
    with partial changes are served byte for byte; then a consumer rank is SIGKILLed: the next publish raises within the group's timeout, the version
    is announced all the same, and the one after reaches the live consumer through shared memory."""
    consumers = [
        rank(
            sock,
            group_store,
            n,
            CONSUMER
            + "wait_seen(4)\nreport()\n"
            + ("time.sleep(600)\n" if n == 2 else "wait_seen(6)\nreport()\n"),
            mode="in-place" if n == 2 else "double",
        )
        for n in (1, 2)
    ]
    publisher = rank(
        sock,
        group_store,
        0,
        """
        model = weights()
        pub = stream.DistributedPublisher("g", group=group, bucket_bytes=64 << 10)
        store.wait(["ready1", "ready2"])
        for n in range(1, 5):
            change(model, n)
            v = pub.publish(model, step=n)
            print(json.dumps({"version": v.version, "sent": pub.last_sent_bytes,
                              "hashes": {t.name: t.hash for t in v.tensors}, "mine": hashes(model)}), flush=True)
        store.wait(["killed"])
        model["small0"] += 10
        t0 = time.monotonic()
        try:
            pub.publish(model)
            error = None
        except stream.StreamError as e:
            error = str(e)
        took = time.monotonic() - t0
        model["small1"] += 10
        v = pub.publish(model)
        print(json.dumps({"took": took, "error": error, "version": v.version, "hashes": hashes(model)}), flush=True)
        """,
    )
    published = [json.loads(line(publisher)) for _ in range(4)]
    assert [p["version"] for p in published] == [1, 2, 3, 4]
    assert all(p["hashes"] == p["mine"] for p in published)
    full = 400_000 + 400 + 400 + 6000 + 7
    # Only the tensors whose hash changed are sent: all of them first, then small1; big and flag; half and small0.
    assert [p["sent"] for p in published] == [full, 400, 400_000 + 7, 6000 + 400]
    for c in consumers:
        assert line(c).strip() == "ready"
        got = json.loads(line(c))
        assert got["failures"] == 0 and got["error"] is None and got["group_error"] is None, got
        # Every version was served whole, byte for byte the publisher's, and none came through shared memory.
        assert got["seen"] == {str(p["version"]): p["hashes"] for p in published}, got
        assert got["received"] == sum(p["sent"] for p in published) and got["shared"] == 0, got
    os.kill(consumers[1].pid, signal.SIGKILL)
    consumers[1].wait(timeout=20)
    group_store.set("killed", "1")
    after = json.loads(line(publisher))
    assert publisher.wait(timeout=30) == 0, publisher.stderr.read() if publisher.stderr else ""
    print(f"publish with a dead consumer rank: {after['took']:.2f} s: {after['error']}")
    assert after["error"] is not None and after["error"].startswith(
        "g@5: sending the changed tensors (1, 400 bytes)"
    ), after
    assert "the version is announced through the agent" in after["error"], after
    assert after["took"] < GROUP_TIMEOUT + 2, after
    live = json.loads(line(consumers[0]))
    assert consumers[0].wait(timeout=30) == 0, consumers[0].stderr.read() if consumers[0].stderr else ""
    print(f"the live consumer: {live['error']}; {live['group_error']}")
    assert live["version"] == 6 and live["seen"]["6"] == after["hashes"], live
    assert live["shared"] > 0, "version 6 was read from the agent's shared memory"
    # Version 5 either reached it before the publisher met the dead rank, or failed and was reported.
    assert live["failures"] + ("5" in live["seen"]) == 1, live


def test_a_publisher_rank_that_hangs_mid_transfer_fails_the_consumer_at_the_deadline_not_later(
    sock: Path, group_store: Any
) -> None:
    """The publisher rank stops (SIGSTOP) between announcing a version and sending its tensors: the
    consumer rank's collective fails at the group's timeout, it reports why and serves the version it had,
    and takes the next version (from another publisher) through shared memory."""
    consumer = rank(
        sock,
        group_store,
        1,
        CONSUMER
        + textwrap.dedent(
            """
        wait_seen(1)
        end = time.monotonic() + 60
        while hot.failures == 0 and time.monotonic() < end:
            with hot.serving() as m:
                assert hashes(m) == seen[1]
            time.sleep(0.01)
        with hot.serving() as m:
            serving = hashes(m)
        report()
        print(json.dumps({"serving_first": serving == seen[1]}), flush=True)
        wait_seen(3)
        report()
        """
        ),
        world=2,
    )
    publisher = rank(
        sock,
        group_store,
        0,
        """
        model = weights()
        pub = stream.DistributedPublisher("g", group=group, bucket_bytes=64 << 10)
        store.wait(["ready1"])
        pub.publish(model)
        print("published", flush=True)
        _group.send = lambda *args: os.kill(os.getpid(), signal.SIGSTOP)  # hangs once the version is announced
        change(model, 2)
        pub.publish(model)
        """,
        world=2,
    )
    assert line(publisher).strip() == "published"
    assert line(consumer).strip() == "ready"
    failed = json.loads(line(consumer))
    publisher.kill()
    assert publisher.wait(timeout=30) == -signal.SIGKILL
    print(f"the consumer: {failed['error']}")
    assert failed["version"] == 1 and failed["failures"] == 1, failed
    assert failed["error"].startswith(
        "g@2: receiving the changed tensors (1, 400 bytes) from rank 0 failed"
    ), failed
    waited = float(re.search(r"failed after ([0-9.]+) s", failed["error"]).group(1))  # type: ignore[union-attr]
    assert GROUP_TIMEOUT - 0.5 <= waited < GROUP_TIMEOUT + 2, failed
    assert failed["error"].endswith("still serving version 1"), failed
    assert json.loads(line(consumer))["serving_first"]
    m = {k: np.full(s, 3, dtype=d) for k, s, d in (("small0", 100, np.float32), ("small1", 50, np.int64))}
    m |= {"big": np.full(100_000, 3, dtype=np.float32), "flag": np.ones(7, dtype=bool)}
    m["half"] = np.full(3000, 3, dtype=np.uint16)  # bfloat16's bytes, as numpy has no bfloat16
    v3 = stream.publish("g", m)
    assert isinstance(v3, stream.StreamVersion) and v3.version == 3
    got = json.loads(line(consumer))
    assert consumer.wait(timeout=30) == 0, consumer.stderr.read() if consumer.stderr else ""
    assert got["seen"]["3"] == {t.name: t.hash for t in v3.tensors} and got["error"] is None, got


def test_the_group_packs_small_tensors_into_few_buckets_and_cuts_large_ones() -> None:
    from tierstore.stream import group as _group

    # 1,000 tensors of 100 bytes: 2 collectives of at most 64 KiB, not 1,000.
    small = _group.buckets([100] * 1000, 64 << 10)
    assert [sum(p[3] for p in b) for b in small] == [65536, 100_000 - 65536]
    # A large tensor is cut across buckets, its neighbours packed around it; every byte once, in order.
    sizes = [10, 150_000, 0, 7]
    cut = _group.buckets(sizes, 65536)
    assert [sum(p[3] for p in b) for b in cut] == [65536, 65536, 150_017 - 2 * 65536]
    covered = [(i, off, n) for b in cut for i, off, _, n in b]
    assert covered == [(0, 0, 10), (1, 0, 65526), (1, 65526, 65536), (1, 131062, 18938), (3, 0, 7)]
    assert all(at == sum(p[3] for p in b[:k]) for b in cut for k, (_, _, at, _) in enumerate(b))
