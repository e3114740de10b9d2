"""Model streaming on one node: a publisher and consumers in separate processes, through a real agent.

Publishers are SIGKILLed mid-publish (consumers never see a partial version), consumers are SIGKILLed
(their leases end with them), and a soak checks that no version is missed and no request mixes versions.
(Through a process group: test_group.py; across nodes: test_nodes.py, test_group_nodes.py.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers import soak
from tests.helpers.agents import child, start_agent, stop_agent
from tests.helpers.cli import stream_cli
from tests.helpers.wait import wait_for
from tierstore import _core, stream


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


def test_a_wrong_request_fails_in_the_client_naming_its_fault_and_the_connection_goes_on(sock: Path) -> None:
    """Requests go through the one Rust type the agent parses (tierstore_core::models::requests): a misspelt
    op or a missing field raises in the client, and never reaches the agent."""
    from tierstore.stream.connection import _Connection

    conn = _Connection(sock, deadline=10.0)
    try:
        with pytest.raises(ValueError, match=r"unknown variant `fecth`, expected one of .*`fetch`"):
            conn.send({"op": "fecth", "name": "policy", "version": 1})
        with pytest.raises(ValueError, match=r"missing field `version`"):
            conn.call({"op": "release", "name": "policy"})
        assert conn.call({"op": "list"})["streams"] == []  # the same connection, still in step
        # A publish given up is answered by its number, and is then no longer in progress.
        begun = conn.call({"op": "begin", "name": "policy"})
        assert conn.call({"op": "abort", "publish": begun["publish"]}) == {"aborted": begun["publish"]}
        with pytest.raises(stream.StreamError, match=f"publish {begun['publish']} is not in progress"):
            conn.call({"op": "abort", "publish": begun["publish"]})
    finally:
        conn.close()


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

    # The consumer holds each notice's lease until its subscriber thread has taken the notice and let go of
    # it (it pins only version 1): on a busy machine version 2 can still be leased when 4 is committed, and
    # goes at that release.
    def held() -> list[int]:
        return [v["version"] for v in info("m")["versions"]]  # type: ignore[attr-defined]

    wait_for("only the pinned version 1 kept besides the newest two", lambda: held() == [1, 3, 4])
    os.kill(consumer.pid, signal.SIGKILL)
    consumer.wait(timeout=20)
    # Its lease ends with its connection; the next eviction frees version 1.
    wait_for("version 1 freed", lambda: [v["version"] for v in info("m")["versions"]] == [3, 4])  # type: ignore[attr-defined]
    assert stream.streams()["tensor_files"] == 6


SOAK_UPDATES = soak.STREAM_SOAK_UPDATES  # TIERSTORE_TEST_STREAM_SOAK_UPDATES


@pytest.mark.slow
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
        return stream_cli(sock, *args)

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
    # Watching a stream nobody published yet waits for it, and says so at once.
    waiting = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tierstore.cli",
            "stream",
            "watch",
            "nope",
            "--count",
            "1",
            "--socket",
            str(sock),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert waiting.stderr is not None
    said = waiting.stderr.readline()
    waiting.kill()
    waiting.wait()
    assert "no version of stream 'nope' yet" in said and "cli-model" in said, said
    watch = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tierstore.cli",
            "stream",
            "watch",
            "cli-model",
            "--count",
            "1",  # cli-model@3: cli-model@2, the latest already, is printed first and not counted
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


def test_a_publish_writes_its_changed_tensors_into_the_spares_the_agent_allocated_after_the_last(
    sock: Path,
) -> None:
    big = 1 << 18  # float32s: 1 MiB tensors, above the size spares are kept for; "small" is below it
    m = {
        "a": np.full(big, 1.0, np.float32),
        "b": np.full(big, 2.0, np.float32),
        "small": np.ones(10, np.float32),
    }
    v1 = stream.publish("spared", m)
    assert isinstance(v1, stream.StreamVersion)
    spares = Path(stream.streams()["dir"]) / "spares"
    # One spare per size written new at or above 256 KiB: both 1 MiB tensors, not the small one.
    wait_for(
        "two spares", lambda: sorted(p.name.split("-")[0] for p in spares.iterdir()) == [str(4 * big)] * 2
    )
    inodes = {p.stat().st_ino for p in spares.iterdir()}
    m["a"][:] = 5.0
    v2 = stream.publish("spared", m)
    assert isinstance(v2, stream.StreamVersion)
    assert v2.new_bytes == 4 * big, "only the changed tensor is placed"
    blobs = Path(stream.streams()["dir"]) / "blobs"
    placed = blobs / next(t.hash for t in v2.tensors if t.name == "a")
    assert placed.stat().st_ino in inodes, "the changed tensor was written into a spare"
    got = stream.StreamVersion.state_dict(v2, "numpy")
    assert float(got["a"].min()) == float(got["a"].max()) == 5.0
    assert float(got["b"].min()) == 2.0 and got["small"].tolist() == [1.0] * 10
    # After that publish the spares follow its sizes: one 1 MiB spare, none left of the one taken.
    wait_for("one spare", lambda: len(list(spares.iterdir())) == 1)
    assert all(p.stat().st_size == 4 * big for p in spares.iterdir())
    # What they hold is reported beside the versions' memory.
    assert stream.streams()["spare_bytes"] == 4 * big
    shown = stream_cli(sock, "ls")
    assert shown.returncode == 0 and "allocated ahead for the next publish" in shown.stdout, shown


def test_the_stream_directory_of_a_killed_agent_goes_when_the_next_agent_starts(tmp_path: Path) -> None:
    """A killed agent cannot remove its stream directory (shared memory): the next agent of the user
    removes it, and never one whose agent lives."""
    socks = [tmp_path / name / "tierstore" / "agent.sock" for name in ("killed", "living", "next")]
    for s in socks:
        s.parent.mkdir(parents=True)
    killed, living = start_agent(socks[0]), start_agent(socks[1], node="n2")
    try:
        dirs = [Path(stream.streams(s)["dir"]) for s in socks[:2]]
        stream.publish("left", model(1.0), socket=socks[0])
        killed.kill()
        killed.wait(timeout=20)
        assert dirs[0].exists()
        following = start_agent(socks[2], node="n3")
        try:
            assert not dirs[0].exists(), f"{dirs[0]} of the killed agent is left behind"
            assert dirs[1].exists(), "the directory of a living agent was removed"
            assert Path(stream.streams(socks[2])["dir"]).exists()
        finally:
            stop_agent(following)
    finally:
        stop_agent(living)


IN_PLACE_UPDATES = soak.STREAM_IN_PLACE_UPDATES  # TIERSTORE_TEST_STREAM_IN_PLACE_UPDATES


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
