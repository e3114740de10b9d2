"""Members of a job found in the Redis registry instead of a member list: they share the cache, a stopped
Redis stops nothing, and two jobs on one Redis never see each other. Each test starts a redis-server of its
own on a free loopback port."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.cluster import SIZES, Cluster, Node, free_port, stop_cluster
from tests.helpers.marks import needs
from tests.helpers.stores import store_stats


@pytest.fixture
@needs("redis")
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A redis-server of this test's own on a free loopback port."""
    from tierstore.testing.netns import start_redis

    port = free_port()
    proc = start_redis("127.0.0.1", port)
    try:
        yield f"redis://127.0.0.1:{port}/"
    finally:
        proc.kill()
        proc.wait()


def registry_cluster(
    tmp_path: Path, mount: Path, n: int, url: str, job: dict[str, str] | None = None, name: str = "r"
) -> Cluster:
    """`n` nodes that find each other in the registry: no member list anywhere. `job`: the variables that
    name the job (default TIERSTORE_JOB=test-job)."""
    cluster = Cluster(mount)
    for i in range(n):
        runtime = tmp_path / f"{name}{i}"
        runtime.mkdir()
        port = free_port()
        env = {
            **os.environ,
            "XDG_RUNTIME_DIR": str(runtime),
            "TIERSTORE_SOURCE": str(mount),
            "TIERSTORE_TIERS": f"{tmp_path / f'{name}t{i}'}:64M",
            "TIERSTORE_SHARING": "partitioned",
            "TIERSTORE_REGISTRY": url,
            "TIERSTORE_NODE": f"127.0.0.1:{port}",
            "TIERSTORE_PEER_CONNECT_MS": "500",
            **({"TIERSTORE_JOB": "test-job"} if job is None else job),
        }
        node = Node(f"{name}{i}", env, tmp_path / f"{name}t{i}", runtime / "tierstore" / "agent.sock")
        subprocess.run(
            [sys.executable, "-m", "tierstore.cli", "agent", "start"], env=env, check=True, timeout=60
        )
        node.pid = cluster.agent_status(node)["pid"]
        cluster.nodes.append(node)
    deadline = time.monotonic() + 15
    while not all(len(cluster.agent_status(x)["members"]) == n - 1 for x in cluster.nodes):
        assert time.monotonic() < deadline, [cluster.agent_status(x)["members"] for x in cluster.nodes]
        time.sleep(0.2)
    return cluster


def test_members_found_in_redis_share_the_cache_and_a_stopped_redis_stops_nothing(
    tmp_path: Path, store: tuple[Path, dict[str, str]], redis_url: str
) -> None:
    mount, digests = store
    rels = sorted(digests)
    cluster = registry_cluster(tmp_path, mount, 3, redis_url)
    try:
        before = store_stats(mount).get("bytes_read", 0)
        for node in cluster.nodes:
            out = cluster.read_all(node, rels)
            assert out["got"] == digests
            assert out["stats"]["peer_hits"] > 0 and out["stats"]["peer_faults"] == 0, out["stats"]
        assert store_stats(mount).get("bytes_read", 0) - before == sum(SIZES) * 3
        # An agent that stops leaves the registry at once: the others drop it at their next heartbeat.
        leaving = cluster.nodes.pop()
        subprocess.run([sys.executable, "-m", "tierstore.cli", "agent", "stop"], env=leaving.env, check=True)
        deadline = time.monotonic() + 10
        while any(len(cluster.agent_status(x)["members"]) != 1 for x in cluster.nodes):
            assert time.monotonic() < deadline, "a stopped agent is still a member"
            time.sleep(0.2)
        # Redis goes away: the agents keep the members they knew, reads go on, the errors are counted.
        port = int(redis_url.rsplit(":", 1)[1].strip("/"))
        subprocess.run(["redis-cli", "-p", str(port), "shutdown", "nosave"], capture_output=True, timeout=10)
        time.sleep(1.5)
        for node in cluster.nodes:
            out = cluster.read_all(node, rels)
            assert out["got"] == digests
            assert out["stats"]["peer_faults"] == 0, out["stats"]
        assert all(cluster.agent_status(x)["registry_errors"] > 0 for x in cluster.nodes)
        assert all(len(cluster.agent_status(x)["members"]) == 1 for x in cluster.nodes)
    finally:
        stop_cluster(cluster)


def test_two_slurm_jobs_on_one_redis_never_see_each_other(
    tmp_path: Path, store: tuple[Path, dict[str, str]], redis_url: str
) -> None:
    """The README's recipe twice on one Redis: the job's name in the registry comes from Slurm's job id
    (no TIERSTORE_JOB), so two jobs' agents register apart and each sees only its own members."""
    mount, _ = store
    first = registry_cluster(tmp_path, mount, 2, redis_url, job={"SLURM_JOB_ID": "4101"}, name="a")
    try:
        second = registry_cluster(tmp_path, mount, 2, redis_url, job={"SLURM_JOB_ID": "4102"}, name="b")
        try:
            time.sleep(1.5)  # a heartbeat or two: time for a wrong member to show up
            for cluster in (first, second):
                own = {n.env["TIERSTORE_NODE"] for n in cluster.nodes}
                for node in cluster.nodes:
                    members = {m["address"] for m in cluster.agent_status(node)["members"]}
                    assert members == own - {node.env["TIERSTORE_NODE"]}, members
            config = subprocess.run(
                [sys.executable, "-m", "tierstore.cli", "config", "show"],
                env=first.nodes[0].env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert "slurm-4101" in config.stdout, config.stdout + config.stderr
        finally:
            stop_cluster(second)
    finally:
        stop_cluster(first)


def redis_cli(url: str, *args: str) -> str:
    """A command to the test's Redis at `url`, as anyone who reaches it may send one."""
    port = url.rsplit(":", 1)[1].strip("/")
    return subprocess.run(
        ["redis-cli", "-p", port, *args], capture_output=True, text=True, timeout=10, check=True
    ).stdout


MEMBERS = "tierstore:test-job:members"


def test_forged_registry_entries_are_refused_and_counted_once(tmp_path: Path, redis_url: str) -> None:
    """Anyone who reaches the Redis can write into the job's key (issue #49, item 2): five members written
    there are never members, and the agent's status counts each once among its registry errors, however
    many heartbeats list them again; `tierstore status` shows the count."""
    source = tmp_path / "src"
    source.mkdir()
    cluster = registry_cluster(tmp_path, source, 1, redis_url)
    try:
        (node,) = cluster.nodes
        for i in range(5):
            redis_cli(redis_url, "ZADD", MEMBERS, str(int(time.time() * 1000) + 60_000), f"10.6.6.{i}:7078")
        time.sleep(1.5)  # a few heartbeats: each lists the five again
        status = cluster.agent_status(node)
        assert status["members"] == [], status["members"]
        assert status["registry_errors"] == 5, status
        shown = subprocess.run(
            [sys.executable, "-m", "tierstore.cli", "status"],
            env=node.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert f"{node.env['TIERSTORE_NODE']}: 5 registry errors" in shown.stdout, shown.stdout + shown.stderr
    finally:
        stop_cluster(cluster)


@pytest.mark.slow
def test_the_entry_of_a_member_that_left_put_back_far_ahead_is_refused(
    tmp_path: Path, redis_url: str
) -> None:
    """The MAC of a member's entry covers its end, not only its address (issue #49, item 2): the entry of
    a member that left, put back into Redis with a score a day ahead, is a member until the end it was
    written with (10 s, the registration's life) and never after; then it is counted as refused. Slow:
    that end is 10 s away."""
    source = tmp_path / "src"
    source.mkdir()
    cluster = registry_cluster(tmp_path, source, 2, redis_url)
    try:
        stays, leaving = cluster.nodes
        address = leaving.env["TIERSTORE_NODE"]
        # Its newest entry: a heartbeat that re-registers at this moment leaves two until the old one goes.
        entries = [
            e for e in redis_cli(redis_url, "ZRANGE", MEMBERS, "0", "-1").split() if e.startswith(address)
        ]
        assert entries, "the leaving member never registered"
        entry = max(entries, key=lambda e: int(e.split("#")[1]) if e.count("#") == 2 else 0)
        subprocess.run([sys.executable, "-m", "tierstore.cli", "agent", "stop"], env=leaving.env, check=True)
        cluster.nodes.pop()
        deadline = time.monotonic() + 10
        while cluster.agent_status(stays)["members"]:
            assert time.monotonic() < deadline, "a stopped agent is still a member"
            time.sleep(0.1)
        redis_cli(redis_url, "ZADD", MEMBERS, str(int(time.time() * 1000) + 86_400_000), entry)
        fields = entry.split("#")
        ends = int(fields[1]) / 1000 if len(fields) == 3 else time.time() + 10
        time.sleep(max(0.0, ends - time.time()) + 3)  # past its end, and the 2 s a listing may lag it
        status = cluster.agent_status(stays)
        assert status["members"] == [], f"a member that left is listed again: {status['members']}"
        assert status["registry_errors"] == 1, status
    finally:
        stop_cluster(cluster)
