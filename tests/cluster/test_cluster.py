"""One dataset cache across the nodes of a job: each node's agent serves the files it owns to the others.

The nodes here share this machine's loopback (each with its own agent, port, tiers and counters) and one
stand-in store mounted once, which counts every byte the job reads from it. tests/cluster/test_netns.py runs
the same job on nodes in their own network namespaces.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers.cluster import (
    SIZES,
    Cluster,
    Node,
    dataset,
    free_port,
    job_token,
    make_cluster,
    owner_of,
    stop_cluster,
)
from tests.helpers.data import flip_byte
from tests.helpers.stores import store_stats
from tierstore import agent as agent_mod


@pytest.mark.parametrize("sharing", ["inclusive", "partitioned"])
def test_the_job_reads_each_file_from_the_store_once(
    tmp_path: Path, store: tuple[Path, dict[str, str]], sharing: str
) -> None:
    mount, digests = store
    rels = sorted(digests)
    total = sum(SIZES) * 3
    cluster = make_cluster(tmp_path, mount, 3, sharing)
    try:
        before = store_stats(mount)
        epochs = []
        for epoch in range(2):
            for node in cluster.nodes:
                out = cluster.read_all(node, rels)
                assert out["got"] == digests, f"{node.name}, epoch {epoch + 1}: wrong bytes"
                epochs.append(out["stats"])
            read = store_stats(mount).get("bytes_read", 0) - before.get("bytes_read", 0)
            # Every file came from the store once, read by its owner's node, whichever node asked first.
            assert read == total, (
                f"epoch {epoch + 1}: the store served {read} bytes for a {total}-byte dataset"
            )
        first = epochs[:3]
        # Each node received the files the others own from them, not from the store.
        assert all(s["peer_hits"] > 0 for s in first), first
        assert all(s["peer_faults"] == 0 for s in epochs), epochs
        # Counters are per node: what the nodes received is what their agents served.
        now = [cluster.stats(n) for n in cluster.nodes]
        assert sum(s["peer_bytes"] for s in now) == sum(s["served_bytes"] for s in now) > 0
        if sharing == "inclusive":
            # A file a peer served is kept: the second epoch reads only local tiers.
            assert [a["peer_hits"] for a in epochs[3:]] == [b["peer_hits"] for b in epochs[:3]]
        else:
            # Only owners keep files: each node again receives what the others own.
            assert all(b["peer_hits"] > a["peer_hits"] for a, b in zip(epochs[:3], epochs[3:], strict=True))
            # And no node holds a file it does not own: the job's cache is the sum of the nodes'.
            held = sum(sum(1 for p in (n.tier).rglob("data/*/*") if p.is_file()) for n in cluster.nodes)
            assert held == len(rels), f"{held} copies of {len(rels)} files across the nodes"
    finally:
        stop_cluster(cluster)


def test_a_killed_owner_sends_its_readers_to_the_store(
    tmp_path: Path, store: tuple[Path, dict[str, str]]
) -> None:
    mount, digests = store
    rels = sorted(digests)
    cluster = make_cluster(tmp_path, mount, 3, "partitioned")
    try:
        dead = cluster.nodes[2]
        os.kill(dead.pid, signal.SIGKILL)
        out = cluster.read_all(cluster.nodes[0], rels, timeout=60, log="debug")
        assert out["got"] == digests
        # The dead node's files were rerouted after one failed attempt, not one per file.
        assert out["stats"]["peer_faults"] >= 1
        assert out["seconds"] < 10, f"reading with a dead owner took {out['seconds']:.1f} s"
        assert "cannot be reached" in out["stderr"] or "did not answer" in out["stderr"], out["stderr"]
        # At -vv, each later file of the dead owner says where it is read instead, and why.
        assert f"its owner {dead.env['TIERSTORE_NODE']} is marked down" in out["stderr"], out["stderr"]
    finally:
        stop_cluster(cluster)


def test_a_damaged_copy_on_the_owner_is_never_served(
    tmp_path: Path, store: tuple[Path, dict[str, str]]
) -> None:
    mount, digests = store
    rels = sorted(digests)
    cluster = make_cluster(tmp_path, mount, 2, "partitioned")
    try:
        owner, other = cluster.nodes
        # The owner's node reads everything: it holds its own files (and not the others').
        assert cluster.read_all(owner, rels)["got"] == digests
        copies = [p for p in owner.tier.rglob("data/*/*") if p.is_file() and p.stat().st_size > 0]
        assert copies, "the owner holds no copy"
        for p in copies:
            flip_byte(p, 0)
        out = cluster.read_all(other, rels)
        assert out["got"] == digests, "a damaged byte reached a reader"
        assert out["stats"]["peer_faults"] == len(copies)
        # The damaged copies are gone from the owner.
        assert not any(p.exists() for p in copies)
    finally:
        stop_cluster(cluster)


def test_a_file_changed_at_the_source_is_not_served_stale_by_a_peer(
    tmp_path: Path, slow_store: tuple[Path, Path]
) -> None:
    backing, mount = slow_store
    digests = dataset(backing)
    rels = sorted(digests)
    cluster = make_cluster(tmp_path, mount, 2, "inclusive", revalidate="always")
    try:
        for node in cluster.nodes:
            assert cluster.read_all(node, rels)["got"] == digests
        for rel in rels[:6]:
            data = b"rewritten " + rel.encode()
            (backing / rel).write_bytes(data)
            digests[rel] = hashlib.sha256(data).hexdigest()
        for node in cluster.nodes:
            assert cluster.read_all(node, rels)["got"] == digests, f"{node.name} read a stale file"
    finally:
        stop_cluster(cluster)


def test_a_wrong_token_is_refused_and_the_reader_uses_the_store(
    tmp_path: Path, store: tuple[Path, dict[str, str]]
) -> None:
    mount, digests = store
    rels = sorted(digests)
    good, bad = job_token(tmp_path / "token"), job_token(tmp_path / "bad-token")
    ports = [free_port(), free_port()]
    cluster = Cluster(mount)
    try:
        for i, port in enumerate(ports):
            runtime = tmp_path / f"n{i}"
            runtime.mkdir()
            env = {
                **os.environ,
                "XDG_RUNTIME_DIR": str(runtime),
                "TIERSTORE_SOURCE": str(mount),
                "TIERSTORE_TIERS": f"{tmp_path / f't{i}'}:64M",
                "TIERSTORE_SHARING": "partitioned",
                "TIERSTORE_PEERS": ",".join(f"127.0.0.1:{p}" for p in ports),
                "TIERSTORE_NODE": f"127.0.0.1:{port}",
                "TIERSTORE_TOKEN_FILE": str(good if i == 0 else bad),
            }
            node = Node(f"n{i}", env, tmp_path / f"t{i}", runtime / "tierstore" / "agent.sock")
            subprocess.run(
                [sys.executable, "-m", "tierstore.cli", "agent", "start"], env=env, check=True, timeout=60
            )
            node.pid = cluster.agent_status(node)["pid"]
            cluster.nodes.append(node)
        out = cluster.read_all(cluster.nodes[1], rels)
        assert out["got"] == digests
        assert out["stats"]["peer_hits"] == 0 and out["stats"]["peer_faults"] >= 1
        assert "wrong token" in out["stderr"], out["stderr"]
        assert cluster.agent_status(cluster.nodes[0])["refused"] >= 1
    finally:
        stop_cluster(cluster)


# The sharing matters little here (test_the_job_reads_each_file_from_the_store_once checks both): one is
# `slow`.
@pytest.mark.parametrize("sharing", ["inclusive", pytest.param("partitioned", marks=pytest.mark.slow)])
def test_tierstore_run_starts_the_agent_on_demand_and_programs_read_across_nodes(
    tmp_path: Path, store: tuple[Path, dict[str, str]], sharing: str
) -> None:
    """No agent is started by hand: `tierstore run` starts each node's, and a program that is not Python
    (sha256sum, through the LD_PRELOAD shim) reads the files other nodes own from their agents."""
    mount, digests = store
    rels = sorted(digests)
    ports = [free_port(), free_port()]
    cluster = Cluster(mount)
    for i, port in enumerate(ports):
        runtime = tmp_path / f"n{i}"
        runtime.mkdir()
        env = {
            **os.environ,
            "XDG_RUNTIME_DIR": str(runtime),
            "TIERSTORE_SOURCE": str(mount),
            "TIERSTORE_TIERS": f"{tmp_path / f't{i}'}:64M",
            "TIERSTORE_INLINE_MAX": str(1 << 20),
            "TIERSTORE_SHARING": sharing,
            "TIERSTORE_PEERS": ",".join(f"127.0.0.1:{p}" for p in ports),
            "TIERSTORE_NODE": f"127.0.0.1:{port}",
        }
        cluster.nodes.append(Node(f"n{i}", env, tmp_path / f"t{i}", runtime / "tierstore" / "agent.sock"))
    try:
        # Every node's job starts (here with a command that reads nothing) before any reads: a node whose
        # agent is not up yet is read around, from the store.
        for node in cluster.nodes:
            run = [sys.executable, "-m", "tierstore.cli", "run", "--", "true"]
            subprocess.run(run, env=node.env, check=True, timeout=60)
            assert agent_mod.answers(node.socket), f"tierstore run started no agent on {node.name}"
        before = store_stats(mount).get("bytes_read", 0)
        for epoch in range(2):
            for node in cluster.nodes:
                p = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "tierstore.cli",
                        "run",
                        "--revalidate",
                        "never",
                        "--",
                        "sha256sum",
                        *rels,
                    ],
                    env=node.env,
                    cwd=mount,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                assert p.returncode == 0, p.stderr
                got = dict(reversed(line.split()) for line in p.stdout.splitlines())
                assert got == digests, f"{node.name}, epoch {epoch + 1}: wrong bytes"
                node.pid = cluster.agent_status(node)["pid"]
        read = store_stats(mount).get("bytes_read", 0) - before
        assert read == sum(SIZES) * 3, f"the store served {read} bytes over two epochs on two nodes"
        stats = [cluster.stats(n) for n in cluster.nodes]
        assert all(s["peer_hits"] > 0 and s["served_files"] > 0 for s in stats), stats
    finally:
        stop_cluster(cluster)


def test_status_shows_every_member_and_a_dead_one_as_down(
    tmp_path: Path, store: tuple[Path, dict[str, str]]
) -> None:
    mount, digests = store
    rels = sorted(digests)
    cluster = make_cluster(tmp_path, mount, 2, "partitioned")
    try:
        first, second = cluster.nodes
        assert cluster.read_all(first, rels)["got"] == digests

        def status() -> dict:
            p = subprocess.run(
                [sys.executable, "-m", "tierstore.cli", "status", "--json"],
                env=first.env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert p.returncode == 0, p.stderr
            return json.loads(p.stdout)["cluster"]

        c = status()
        assert c["sharing"] == "partitioned"
        by = {m["address"]: m for m in c["members"]}
        assert set(by) == {first.env["TIERSTORE_NODE"], second.env["TIERSTORE_NODE"]}
        assert all(m["up"] for m in c["members"]), c
        views = [m["report"]["cache"] for m in c["members"]]
        # What the first node received, the second served; both hold only what they own.
        assert (
            views[0]["peer_bytes"] + views[1]["peer_bytes"]
            == views[0]["served_bytes"] + views[1]["served_bytes"]
        )
        assert sum(v["store_bytes"] for v in views) == sum(SIZES) * 3
        text = subprocess.run(
            [sys.executable, "-m", "tierstore.cli", "status"], env=first.env, capture_output=True, text=True
        ).stdout
        assert "cluster (partitioned)" in text and second.env["TIERSTORE_NODE"] in text
        os.kill(second.pid, signal.SIGKILL)
        down = {m["address"]: m for m in status()["members"]}
        assert down[first.env["TIERSTORE_NODE"]]["up"]
        assert not down[second.env["TIERSTORE_NODE"]]["up"]
        error = down[second.env["TIERSTORE_NODE"]]["error"]
        assert "no agent at" in error
        # The table names the dead member and its whole reason, errno included, on one line.
        text = subprocess.run(
            [sys.executable, "-m", "tierstore.cli", "status"], env=first.env, capture_output=True, text=True
        ).stdout
        assert f"{second.env['TIERSTORE_NODE']} is down: {error}" in text, text
    finally:
        stop_cluster(cluster)


def test_the_agent_serves_prometheus_metrics_when_asked(
    tmp_path: Path, store: tuple[Path, dict[str, str]]
) -> None:
    import urllib.request

    mount, digests = store
    rels = sorted(digests)
    cluster = make_cluster(tmp_path, mount, 2, "partitioned")
    try:
        first, second = cluster.nodes
        # A second agent of node 0 is not possible (one per socket); restart it with metrics.
        subprocess.run([sys.executable, "-m", "tierstore.cli", "agent", "stop"], env=first.env, check=True)
        port = free_port()
        start = [sys.executable, "-m", "tierstore.cli", "agent", "start", "--metrics", f"127.0.0.1:{port}"]
        subprocess.run(start, env=first.env, check=True, timeout=60)
        first.pid = cluster.agent_status(first)["pid"]
        assert cluster.read_all(second, rels)["got"] == digests
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
        served = cluster.stats(first)["served_bytes"]
        assert served > 0 and float(samples["tierstore_served_bytes_total"]) == served
        assert samples[f'tierstore_peer_up{{peer="{second.env["TIERSTORE_NODE"]}"}}'] == "1"
        assert "# TYPE tierstore_store_read_bytes_total counter" in text
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=10)
        assert e.value.code == 404
    finally:
        stop_cluster(cluster)


# "partitioned" checks also that each file is held once: "inclusive" is `slow`.
@pytest.mark.parametrize("sharing", [pytest.param("inclusive", marks=pytest.mark.slow), "partitioned"])
def test_a_prefetch_on_one_node_asks_the_owners_and_the_store_serves_each_file_once(
    tmp_path: Path, store: tuple[Path, dict[str, str]], sharing: str
) -> None:
    mount, digests = store
    rels = sorted(digests)
    cluster = make_cluster(tmp_path, mount, 3, sharing)
    try:
        before = store_stats(mount).get("bytes_read", 0)
        first = cluster.nodes[0]
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "tierstore.cli",
                "prefetch",
                str(mount / "shard0"),
                str(mount / "shard1"),
                str(mount / "shard2"),
                str(mount / "shard3"),
            ],
            env=first.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 0, p.stderr
        assert store_stats(mount).get("bytes_read", 0) - before == sum(SIZES) * 3
        # Every node now reads the whole dataset without the store.
        for node in cluster.nodes:
            out = cluster.read_all(node, rels)
            assert out["got"] == digests
        assert store_stats(mount).get("bytes_read", 0) - before == sum(SIZES) * 3
        held = [sum(1 for f in n.tier.rglob("data/*/*") if f.is_file()) for n in cluster.nodes]
        if sharing == "partitioned":
            assert sum(held) == len(rels), held
    finally:
        stop_cluster(cluster)


def test_an_owner_with_a_full_tier_still_serves_its_files(
    tmp_path: Path, store: tuple[Path, dict[str, str]]
) -> None:
    """The owner's tier has no room: it serves each file from the store as it reads it, and nothing
    breaks; its reader's node keeps what the owner could not (inclusive)."""
    mount, digests = store
    rels = sorted(digests)
    cluster = make_cluster(tmp_path, mount, 2, "inclusive")
    try:
        owner, reader = cluster.nodes
        # Restart the first node's agent over a tier of 4 KiB.
        subprocess.run([sys.executable, "-m", "tierstore.cli", "agent", "stop"], env=owner.env, check=True)
        owner.env["TIERSTORE_TIERS"] = f"{tmp_path / 'full-tier'}:4K"
        subprocess.run([sys.executable, "-m", "tierstore.cli", "agent", "start"], env=owner.env, check=True)
        owner.pid = cluster.agent_status(owner)["pid"]
        out = cluster.read_all(reader, rels)
        assert out["got"] == digests
        assert out["stats"]["peer_hits"] > 0 and out["stats"]["peer_faults"] == 0, out["stats"]
        served = cluster.stats(owner)
        assert served["served_files"] == out["stats"]["peer_hits"]
        assert served["uncached"] > 0, served
    finally:
        stop_cluster(cluster)


@pytest.mark.slow  # two 20 MiB files past a peer's 2 s deadline: about 8 s
def test_an_owner_still_fetching_a_large_file_keeps_its_readers_waiting_not_rereading(
    tmp_path: Path, throttled_store: tuple[Path, Path]
) -> None:
    """Two files that take the store longer than a peer's deadline (2 s) to send: the owner says within
    each half deadline that the file is still coming, so the other node waits for that one fetch instead
    of giving up and reading the store a second time. Both nodes read both files at once."""
    backing, mount = throttled_store
    digests = {}
    for name in ("a.bin", "b.bin"):
        data = os.urandom(20 << 20)
        (backing / name).write_bytes(data)
        digests[name] = hashlib.sha256(data).hexdigest()
    cluster = make_cluster(tmp_path, mount, 2, "inclusive")
    try:
        before = store_stats(mount)
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda n: cluster.read_all(n, sorted(digests), timeout=120), cluster.nodes))
        after = store_stats(mount)
    finally:
        stop_cluster(cluster)
    assert all(o["got"] == digests for o in outs)
    read = after.get("bytes_read", 0) - before.get("bytes_read", 0)
    assert read == 40 << 20, (
        f"the store sent {read} bytes for two 20 MiB files: {[o['stderr'] for o in outs]}"
    )
    assert sum(o["stats"]["peer_hits"] for o in outs) == 2, [o["stats"] for o in outs]
    assert sum(o["stats"]["peer_faults"] for o in outs) == 0, [o["stats"] for o in outs]


# A reader on another node that reads a file in steps, told when to go on: it prints a JSON line after the
# first MiB (with how long that took) and waits for a line on its stdin before reading the rest.
STEPPED_READER = (
    "import hashlib, json, os, sys, time, tierstore\n"
    "c = tierstore.Cache()\n"
    "t = time.monotonic()\n"
    "f = c.open(os.path.join(c.source, sys.argv[1]))\n"
    "head = f.read(1 << 20)\n"
    "print(json.dumps({'first_mib': time.monotonic() - t}), flush=True)\n"
    "sys.stdin.readline()\n"
    "rest = f.read()\n"
    "print(json.dumps({'seconds': time.monotonic() - t, 'sha': hashlib.sha256(head + rest).hexdigest(),\n"
    "                  'stats': c.stats()['source']}), flush=True)\n"
)


def stepped_read(
    cluster: Cluster, rel: str, between: Callable[[], object] = lambda: None
) -> tuple[dict, dict, str]:
    """Reads `rel` on the node that does not own it, calling `between()` after its first MiB; returns
    the reader's two reports and its stderr."""
    owner = owner_of(cluster.nodes, rel)
    reader = cluster.nodes[1 - owner]
    p = subprocess.Popen(
        [sys.executable, "-c", STEPPED_READER, rel],
        env=reader.env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdin is not None and p.stdout is not None
    first = json.loads(p.stdout.readline() or "{}")
    between()
    out, err = p.communicate("go\n", timeout=120)
    assert p.returncode == 0, err[-3000:]
    return first, json.loads(out), err


def big_file_job(tmp_path: Path, throttled_store: tuple[Path, Path]) -> tuple[bytes, Cluster]:
    """A 24 MiB file of random bytes, big.bin, on the throttled store (3 s at 8 MiB/s), and a job of two
    nodes with inclusive sharing over it."""
    backing, mount = throttled_store
    data = os.urandom(24 << 20)
    (backing / "big.bin").write_bytes(data)
    return data, make_cluster(tmp_path, mount, 2, "inclusive")


def test_a_reader_on_another_node_reads_a_large_file_while_its_owner_is_still_copying_it(
    tmp_path: Path, throttled_store: tuple[Path, Path]
) -> None:
    """A 24 MiB file takes the store 3 s (8 MiB/s). The reader on the other node has its first MiB long
    before the owner's copy ends (each chunk is vouched for by the chaining value the owner recorded as
    it copied it, and checked on arrival), every byte is right, and the store sent the file once."""
    data, cluster = big_file_job(tmp_path, throttled_store)
    mount = throttled_store[1]
    try:
        before = store_stats(mount)
        first, done, err = stepped_read(cluster, "big.bin")
        after = store_stats(mount)
    finally:
        stop_cluster(cluster)
    assert done["sha"] == hashlib.sha256(data).hexdigest()
    assert first["first_mib"] < done["seconds"] / 4, (first, done["seconds"], err)
    assert after.get("bytes_read", 0) - before.get("bytes_read", 0) == len(data), err
    assert done["stats"]["peer_hits"] == 1 and done["stats"]["peer_faults"] == 0, (done["stats"], err)


@pytest.mark.slow  # a 24 MiB file at 8 MiB/s, as the test above: about 6 s
def test_a_reader_on_another_node_is_served_while_the_owners_own_process_copies_the_file(
    tmp_path: Path, throttled_store: tuple[Path, Path]
) -> None:
    """A process of the owner's node starts reading a 24 MiB file (3 s from the store at 8 MiB/s): it
    copies the file and holds the node's fetch lock. The reader on the other node asks the owner's agent
    meanwhile, and the agent follows that process's copy as it grows instead of waiting for its end: the
    reader has its first MiB long before its last, every byte on both nodes is right, and the store sent
    the file once."""
    data, cluster = big_file_job(tmp_path, throttled_store)
    mount = throttled_store[1]
    owner = cluster.nodes[owner_of(cluster.nodes, "big.bin")]
    try:
        before = store_stats(mount)
        local = subprocess.Popen(
            [sys.executable, "-c", STEPPED_READER, "big.bin"],
            env=owner.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert local.stdout is not None
        json.loads(local.stdout.readline() or "{}")  # its first MiB: the copy is under way
        first, done, err = stepped_read(cluster, "big.bin")
        out, local_err = local.communicate("go\n", timeout=120)
        after = store_stats(mount)
    finally:
        stop_cluster(cluster)
    assert local.returncode == 0, local_err[-3000:]
    assert json.loads(out)["sha"] == hashlib.sha256(data).hexdigest()
    assert done["sha"] == hashlib.sha256(data).hexdigest(), err
    assert first["first_mib"] < done["seconds"] / 4, (first, done["seconds"], err)
    assert after.get("bytes_read", 0) - before.get("bytes_read", 0) == len(data), err
    assert done["stats"]["peer_hits"] == 1 and done["stats"]["peer_faults"] == 0, (done["stats"], err)


@pytest.mark.slow  # a 24 MiB file at 8 MiB/s, as the tests above: about 6 s
def test_an_owner_killed_while_it_streams_a_file_leaves_its_reader_to_finish_from_the_store(
    tmp_path: Path, throttled_store: tuple[Path, Path]
) -> None:
    """The owner's agent dies after the reader on the other node had its first MiB: the reader goes on
    from the store at the offset where the peer's checked bytes end, and every byte is right."""
    data, cluster = big_file_job(tmp_path, throttled_store)
    owner = cluster.nodes[owner_of(cluster.nodes, "big.bin")]
    try:
        first, done, err = stepped_read(cluster, "big.bin", lambda: os.kill(owner.pid, signal.SIGKILL))
    finally:
        stop_cluster(cluster)
    assert done["sha"] == hashlib.sha256(data).hexdigest(), err
    assert first["first_mib"] < 2.0, first
    assert done["stats"]["peer_faults"] >= 1, (done["stats"], err)


PREFETCHER = (
    "import json, os, sys, tierstore\n"
    "c = tierstore.Cache()\n"
    "print('started', flush=True)\n"
    "done = c.prefetch(os.path.join(c.source, sys.argv[1]), progress=False)\n"
    "print(json.dumps({'done': done, 'stats': c.stats()['source']}), flush=True)\n"
)


@pytest.mark.slow  # a 24 MiB file at 8 MiB/s, as the tests above: about 5 s each
@pytest.mark.parametrize("store_changes", [False, True], ids=["resumed", "store-changed"])
def test_an_owner_killed_while_it_sends_a_prefetched_file_counts_one_peer_fault(
    tmp_path: Path, throttled_store: tuple[Path, Path], store_changes: bool
) -> None:
    """The other node prefetches big.bin into its tier (inclusive sharing) while its owner copies it from
    the store; the owner's agent dies 1 s in. The copy goes on from the store after the bytes the peer
    sent and checked; when the store holds another version by then, the new version is fetched whole.
    Either way the copy is the store's file byte for byte, and the one failed peer read is counted once
    (it was counted twice when going on from the store failed)."""
    data, cluster = big_file_job(tmp_path, throttled_store)
    backing = throttled_store[0]
    owner = cluster.nodes[owner_of(cluster.nodes, "big.bin")]
    reader = cluster.nodes[1 - owner_of(cluster.nodes, "big.bin")]
    try:
        p = subprocess.Popen(
            [sys.executable, "-c", PREFETCHER, "big.bin"],
            env={**reader.env, "TIERSTORE_LOG": "debug"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "started"
        time.sleep(1.0)
        if store_changes:
            data = os.urandom(len(data))
            (backing / "big.bin").write_bytes(data)
        os.kill(owner.pid, signal.SIGKILL)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        report = json.loads(out)
        got = cluster.read_all(reader, ["big.bin"])
    finally:
        stop_cluster(cluster)
    assert report["done"]["files_failed"] == 0, report
    assert got["got"]["big.bin"] == hashlib.sha256(data).hexdigest(), err[-3000:]
    stats = report["stats"]
    assert "the rest comes from the store" in err, err[-3000:]  # the peer failed part of the way
    if store_changes:
        assert "going on from the store failed too" in err, err[-3000:]
    else:
        assert 0 < stats["peer_bytes"] < len(data), stats
    assert stats["peer_faults"] == 1, (stats, err[-3000:])
