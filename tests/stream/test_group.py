"""Model streaming through a torch.distributed process group on one node (gloo on loopback): a publisher
rank sends only the changed tensors to its consumer ranks, a dead or hung rank fails the transfer at the
group's deadline, and the version still reaches the others through the agent. (Across nodes:
test_group_nodes.py.)"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers.agents import child
from tests.helpers.stream import MODEL, line
from tierstore import stream

# A rank of a gloo process group of 3 on loopback (the test holds the TCP store); MODEL (tests/helpers/stream.py)
# follows it.
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


# Waits out the group's deadline, then a consumer's report: about 10 s.
@pytest.mark.slow
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
