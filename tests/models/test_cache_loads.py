"""Loads of a repository that lives under a cache's source read its packs through the cache: once per node,
once per job across the nodes of a job, never a damaged byte."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tierstore
from tests.helpers.cluster import Node, netns_job, owner_of, tier_bytes
from tests.helpers.data import flip_byte
from tests.helpers.marks import needs
from tests.helpers.stores import store_stats
from tests.helpers.wait import wait_for
from tierstore.models import IntegrityError, Repository
from tierstore.testing.netns import Nodes

NODES = 4


def weights(n: int = 8, size: int = 1 << 20, seed: int = 0) -> dict[str, np.ndarray]:
    """`n` float32 tensors of `size` bytes each, different in every byte."""
    rng = np.random.default_rng(seed)
    return {f"layer{i}.weight": rng.random(size // 4, dtype=np.float32) for i in range(n)}


def same(got: dict, want: dict[str, np.ndarray]) -> bool:
    return got.keys() == want.keys() and all(np.array_equal(np.asarray(got[k]), want[k]) for k in want)


def pack_of(repo: Path) -> Path:
    (pack,) = (repo / "packs").iterdir()
    return pack


@pytest.fixture
def saved(tmp_path: Path, tier: str) -> tuple[tierstore.Cache, Path, dict[str, np.ndarray]]:
    """A repository saved under a source directory, and a cache of that source (revalidate "always", the
    default, so that any question to the store would show in its counters)."""
    source = tmp_path / "store"
    want = weights()
    Repository(source / "repo", cache=False).save("m", want)
    return tierstore.Cache(source=source, tiers=[f"{tier}:256M"]), source / "repo", want


@pytest.mark.parametrize("mmap", [True, False])
def test_a_load_reads_each_pack_from_the_store_once_per_node(
    saved: tuple[tierstore.Cache, Path, dict[str, np.ndarray]], mmap: bool
) -> None:
    """The first load fetches the pack into the tier; the second reads the tier's copy and asks the store
    nothing at all (a pack never changes, so its copy needs no revalidation). A copying load of this pack
    (8 MiB, no larger than inline_max) reads it whole into memory and the tier's copy is published in the
    background, as for any small file read through the cache."""
    cache, repo, want = saved
    size = pack_of(repo).stat().st_size
    cache.reset_counters()
    assert same(Repository(repo, cache=cache).load("m", mmap=mmap), want)
    first = cache.stats()["source"]
    assert first["bytes_read"] == size, first
    wait_for("the tier's copy of the pack", lambda: cache.lookup(pack_of(repo), validate=False), timeout=10)
    cache.reset_counters()
    assert same(Repository(repo, cache=cache).load("m", mmap=mmap), want)
    second = cache.stats()["source"]
    assert (second["opens"], second["stats"], second["bytes_read"]) == (0, 0, 0), second


def test_a_small_partial_load_reads_its_blocks_from_the_store_without_fetching_the_pack(
    saved: tuple[tierstore.Cache, Path, dict[str, np.ndarray]],
) -> None:
    """One tensor of eight is an eighth of the pack: it is read from the store's pack directly, and no
    tier copy of the whole pack is made for it. Once the pack is cached, partial loads read the copy."""
    cache, repo, want = saved
    cache.reset_counters()
    got = Repository(repo, cache=cache).load("m", keys="layer3.*", mmap=False)
    assert same(got, {"layer3.weight": want["layer3.weight"]})
    assert cache.stats()["source"]["bytes_read"] == 0
    assert cache.lookup(pack_of(repo), validate=False) is None
    Repository(repo, cache=cache).load("m")
    cache.reset_counters()
    got = Repository(repo, cache=cache).load("m", keys="layer3.*")
    assert same(got, {"layer3.weight": want["layer3.weight"]})
    assert cache.stats()["source"]["bytes_read"] == 0


@pytest.mark.parametrize("mmap", [True, False])
def test_a_damaged_cached_pack_is_dropped_refetched_and_never_returned(
    saved: tuple[tierstore.Cache, Path, dict[str, np.ndarray]], mmap: bool
) -> None:
    """A byte of the tier's copy flips after it was made: the load notices by the tensor's hash, drops the
    copy, fetches the pack again, and returns the right bytes; the new copy is whole."""
    cache, repo, want = saved
    repository = Repository(repo, cache=cache)
    repository.load("m")
    flip_byte(Path(str(cache.lookup(pack_of(repo), validate=False))), 3 << 20)
    assert same(repository.load("m", mmap=mmap), want)
    assert repository._packs.refetched == 1
    again = cache.lookup(pack_of(repo), validate=False)
    assert again is not None
    assert Path(again).read_bytes() == pack_of(repo).read_bytes()


@pytest.mark.parametrize("verify", ["metadata", "checksum"])
def test_damage_in_the_store_itself_is_reported_not_hidden_by_the_cache(
    saved: tuple[tierstore.Cache, Path, dict[str, np.ndarray]], tier: str, verify: str
) -> None:
    """When the store's pack is the damaged one, the refetched copy fails too: the load raises
    IntegrityError naming the tensor (as it does without a cache) and returns nothing. A cache that
    hashes its copies as they land finds the copy's hash is not the pack's, and the tensors are hashed."""
    _, repo, _ = saved
    cache = tierstore.Cache(source=repo.parent, tiers=[f"{tier}/{verify}:256M"], verify=verify)
    with open(pack_of(repo), "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    for mmap in (False, True):
        with pytest.raises(IntegrityError, match=r"layer0\.weight"):
            Repository(repo, cache=cache).load("m", mmap=mmap)


def test_a_copy_the_cache_hashed_as_it_arrived_is_not_hashed_again_tensor_by_tensor(
    tmp_path: Path, tier: str
) -> None:
    """A cache that hashes the copies it makes (`verify = "checksum"` here; every cache of a cluster)
    hashes a pack's copy whole as it lands. When that hash is the pack's own, recorded by its save in the
    manifest, the load that had the copy made reads the tensors without hashing them again: each byte is
    hashed once. A later load of the copy (at rest in its tier since) hashes every tensor, as does a
    load whose manifest records no hash, or another one, for the pack; all return the saved tensors."""
    source = tmp_path / "store"
    want = weights(n=6, size=4 << 20)  # 24 MiB: larger than inline_max, so the copy grows as it is read
    Repository(source / "repo", cache=False).save("m", want)
    manifest = next((source / "repo" / "models" / "m").glob("v*.json"))

    def loads(verify: str) -> list[int]:
        """How many of two copying loads, through a new cache, were vouched for by the pack's hash."""
        cache = tierstore.Cache(source=source, tiers=[f"{tier}/{verify}-{len(list(tmp_path.iterdir()))}:256M"],
                                verify=verify)  # fmt: skip
        repository = Repository(source / "repo", cache=cache)
        counts = []
        for _ in range(2):
            before = repository._packs.vouched
            assert same(repository.load("m", mmap=False), want)
            counts.append(repository._packs.vouched - before)
        return counts

    assert loads("checksum") == [1, 0]
    assert loads("metadata") == [0, 0], "a cache that hashes no copy vouched for one"
    recorded = json.loads(manifest.read_text())
    (pack,) = recorded["pack_hashes"]
    for pack_hashes in ({}, {pack: "0" * 64}):
        manifest.write_text(json.dumps(recorded | {"pack_hashes": pack_hashes}))
        assert loads("checksum") == [0, 0], pack_hashes


def test_the_default_cache_is_used_when_its_source_holds_the_repository(tmp_path: Path, tier: str) -> None:
    source = tmp_path / "store"
    want = weights(n=2)
    Repository(source / "repo", cache=False).save("m", want)
    cache = tierstore.configure(source=source, tiers=[f"{tier}:64M"])
    assert same(Repository(source / "repo").load("m"), want)
    assert cache.lookup(pack_of(source / "repo"), validate=False) is not None
    elsewhere = tmp_path / "local-repo"
    Repository(elsewhere, cache=False).save("m", want)
    direct = Repository(elsewhere)  # not under the source: read directly
    assert direct._packs.cache is None
    assert same(direct.load("m"), want)


def test_a_cache_whose_source_does_not_hold_the_repository_is_refused(
    saved: tuple[tierstore.Cache, Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    cache, _, _ = saved
    with pytest.raises(ValueError, match="not under the cache's source"):
        Repository(tmp_path / "elsewhere", cache=cache)


LOADER = r"""
import hashlib, json, sys, time
import numpy as np
import tierstore
from tierstore.models import IntegrityError, Repository

t = time.monotonic()
repository = Repository(sys.argv[1], create=False)
keys = sys.argv[2] if len(sys.argv) > 2 else None
got = repository.load("m", keys=keys, mmap=len(sys.argv) > 3 and sys.argv[3] == "mmap")
h = hashlib.sha256()
for k in sorted(got):
    h.update(k.encode()); h.update(np.ascontiguousarray(got[k]).tobytes())
print(json.dumps({"digest": h.hexdigest(), "seconds": time.monotonic() - t,
                  "refetched": repository._packs.refetched, "vouched": repository._packs.vouched,
                  "stats": tierstore.default_cache().stats()["source"]}))
"""


def digest_of(want: dict[str, np.ndarray]) -> str:
    """What LOADER prints for tensors equal in every byte to `want`."""
    h = hashlib.sha256()
    for k in sorted(want):
        h.update(k.encode())
        h.update(want[k].tobytes())
    return h.hexdigest()


def start_load(
    inside: list[str], node: Node, repo: Path, keys: str | None = None, mmap: bool = False
) -> subprocess.Popen[str]:
    """LOADER loading version "m" of `repo` in a process of `node` (`inside`: its namespace's command):
    the tensors `keys` match (all when None), mapped or copied out."""
    args = [] if keys is None else [keys, "mmap" if mmap else "copy"]
    return subprocess.Popen([*inside, sys.executable, "-c", LOADER, str(repo), *args], env=node.env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def finished(p: subprocess.Popen[str], timeout: float) -> dict:
    """LOADER's report, once it exited successfully within `timeout` seconds."""
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err[-3000:]
    report: dict = json.loads(out)
    report["stderr"] = err
    return report


@pytest.mark.netns
@pytest.mark.parametrize("sharing", ["inclusive", "partitioned"])
@needs("root")
def test_four_nodes_loading_one_version_at_once_read_its_pack_from_the_store_once(
    tmp_path: Path, slow_store: tuple[Path, Path], sharing: str
) -> None:
    """Four nodes in their own network namespaces load the same version at the same moment, each with the
    cache configured the usual way (TIERSTORE_* variables): the store serves the pack's bytes once for the
    job, and every node gets the right tensors. A node that receives the pack from its owner hashes it
    once: its cache checks the copy against the owner's chaining values as it arrives, and the load,
    finding the copy's hash to be the pack's own, does not hash each tensor again. (The owner's own load
    may find the copy its agent made for a peer already in its tier, at rest since before the load began:
    that copy is hashed tensor by tensor.)"""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root)")
    backing, mount = slow_store
    want = weights(n=12)
    Repository(backing / "repo", cache=False).save("m", want)
    pack = pack_of(backing / "repo").stat().st_size
    with netns_job(tmp_path, mount, NODES, sharing=sharing) as (nodes, job):
        before = store_stats(mount)
        procs = [start_load(n.cmd(), node, mount / "repo") for n, node in zip(nodes.nodes, job, strict=True)]
        results = [finished(p, timeout=180) for p in procs]
        after = store_stats(mount)
    assert [r["digest"] for r in results] == [digest_of(want)] * NODES
    read = after.get("bytes_read", 0) - before.get("bytes_read", 0)
    manifest = next((backing / "repo" / "models" / "m").glob("v*.json")).stat().st_size
    # The pack once; each node reads the small manifest (and the format marker) itself.
    assert pack <= read <= pack + NODES * (manifest + 64), (
        f"the store served {read} bytes for a {pack}-byte pack"
    )
    assert sum(r["stats"]["peer_hits"] for r in results) >= NODES - 1, [r["stats"] for r in results]
    received = [r["vouched"] for r in results if r["stats"]["peer_hits"] > 0]
    assert received == [1] * len(received) and len(received) >= NODES - 1, [r["stats"] for r in results]


@pytest.mark.netns
@pytest.mark.parametrize("mmap", [False, True], ids=["copied", "mapped"])
def test_a_load_whose_pack_owner_is_killed_mid_transfer_finishes_with_the_saved_tensors(
    tmp_path: Path, throttled_store: tuple[Path, Path], mmap: bool
) -> None:
    """Two nodes in their own network namespaces; the store sends 8 MiB/s, so the 32 MiB pack takes its
    owner's agent about 4 s to fetch. The other node loads the version, which asks the owner for the pack;
    a quarter of the way through, the owner's agent is killed (SIGKILL). The load finishes, within a
    bound, with every tensor equal to what was saved and no damaged copy met on the way (no tensor's
    hash failed, so nothing was refetched), and the reader counts the owner's failure. Copied out or
    mapped, the reader goes on from the store where the owner stopped: the store serves the pack about
    once for the job, not once and then again whole."""
    backing, mount = throttled_store
    want = weights(n=8, size=4 << 20)
    Repository(backing / "repo", cache=False).save("m", want)
    pack = pack_of(backing / "repo")
    with netns_job(tmp_path, mount, 2, sharing="inclusive") as (nodes, job):
        owner = owner_of(job, str(pack.relative_to(backing)))
        reader = 1 - owner
        before = tier_bytes(job[owner].tier)
        store_before = store_stats(mount)
        keys = "layer*" if mmap else None
        p = start_load(nodes.nodes[reader].cmd(), job[reader], mount / "repo", keys=keys, mmap=mmap)
        try:
            # Not the store's counters: a read of them while they change can come back torn.
            wait_for(
                "the owner's tier holding a quarter of the pack",
                lambda: tier_bytes(job[owner].tier) - before >= pack.stat().st_size // 4,
                timeout=30,
            )
            assert p.poll() is None, "the load ended before the owner was killed"
            os.kill(job[owner].pid, signal.SIGKILL)
            report = finished(p, timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
    assert report["digest"] == digest_of(want), "the load returned other tensors than were saved"
    assert report["refetched"] == 0, report
    assert report["stats"]["peer_faults"] >= 1, report["stats"]
    # The reader went on from the store where the owner stopped: what it received and what it read from
    # the store add up to the pack, not the pack read again whole. (A copying load's readers go on from
    # where each had read, a little behind the bytes received: up to an eighth of this pack again.)
    size = pack.stat().st_size
    stats = report["stats"]
    received, read = stats["peer_bytes"], stats["bytes_read"]
    assert received > 0 and received + read <= 1.125 * size, {
        k: stats[k] for k in ("bytes_read", "peer_bytes")
    }
    total = store_stats(mount).get("bytes_read", 0) - store_before.get("bytes_read", 0)
    print(
        f"received {received / size:.2f}, read {read / size:.2f}, the store served {total / size:.2f}x the pack"
    )


def cached_on_owner(
    nodes: Nodes, job: list[Node], backing: Path, mount: Path, want: dict
) -> tuple[int, Path]:
    """The pack's owner (of two nodes) loads version "m" of the repository whole, so that its tier keeps
    the pack; returns the other node's index and the owner's tier copy of the pack."""
    pack = pack_of(backing / "repo")
    owner = owner_of(job, str(pack.relative_to(backing)))
    first = finished(start_load(nodes.nodes[owner].cmd(), job[owner], mount / "repo"), timeout=60)
    assert first["digest"] == digest_of(want)
    size = pack.stat().st_size
    (copy,) = [f for f in job[owner].tier.rglob("data/*/*") if f.is_file() and f.stat().st_size == size]
    return 1 - owner, copy


@pytest.mark.netns
def test_a_flipped_byte_in_the_owners_copy_of_a_pack_never_reaches_another_node(
    tmp_path: Path, slow_store: tuple[Path, Path]
) -> None:
    """The pack's owner loads the version (its tier keeps the pack); one byte of that copy then flips,
    its size and times unchanged. The other node loads the version: the owner's agent sends the pack, the
    reader finds it damaged before any tensor is built from it (no tensor's hash fails), counts the fault,
    and returns the saved tensors; the owner drops its damaged copy."""
    backing, mount = slow_store
    want = weights()
    Repository(backing / "repo", cache=False).save("m", want)
    with netns_job(tmp_path, mount, 2, sharing="inclusive") as (nodes, job):
        reader, copy = cached_on_owner(nodes, job, backing, mount, want)
        flip_byte(copy, 3 << 20)
        second = finished(start_load(nodes.nodes[reader].cmd(), job[reader], mount / "repo"), timeout=60)
    assert second["digest"] == digest_of(want), "a damaged byte reached the reader"
    assert second["refetched"] == 0, second
    assert second["stats"]["peer_faults"] == 1, second["stats"]
    assert not copy.exists(), "the owner kept its damaged copy"


@pytest.mark.netns
@pytest.mark.parametrize("mmap", [True, False])
def test_four_nodes_loading_the_same_few_tensors_read_only_their_blocks_from_the_store_once(
    tmp_path: Path, slow_store: tuple[Path, Path], mmap: bool
) -> None:
    """Four nodes load the same 2 tensors of 16 (an eighth of the pack) at the same moment, mapped or
    copied out. No node fetches the pack: each asks the agent of the pack's owner for the two tensors (the
    owner's own process too), and that agent reads their blocks from the store once for the job. The
    store serves those blocks once, far less than the pack; every node gets the saved tensors, and no
    tier holds a copy of the pack."""
    backing, mount = slow_store
    want = weights(n=16, size=4 << 20)
    Repository(backing / "repo", cache=False).save("m", want)
    pack = pack_of(backing / "repo")
    chosen = {k: want[k] for k in ("layer5.weight", "layer6.weight")}
    with netns_job(tmp_path, mount, NODES, sharing="inclusive") as (nodes, job):
        before = store_stats(mount)
        procs = [
            start_load(n.cmd(), node, mount / "repo", keys="layer[56].*", mmap=mmap)
            for n, node in zip(nodes.nodes, job, strict=True)
        ]
        results = [finished(p, timeout=120) for p in procs]
        after = store_stats(mount)
        held = [tier_bytes(node.tier) for node in job]
    assert [r["digest"] for r in results] == [digest_of(chosen)] * NODES
    read = after.get("bytes_read", 0) - before.get("bytes_read", 0)
    manifest = next((backing / "repo" / "models" / "m").glob("v*.json")).stat().st_size
    tensors = sum(a.nbytes for a in chosen.values())
    # The two tensors' blocks of 1 MiB once (a tensor not on a block boundary adds a block at each end),
    # and each node's manifest; against 4 x 8 MiB if each node read its own, and 64 MiB for the pack.
    assert tensors <= read <= tensors + (2 << 20) + NODES * (manifest + 64), (
        f"the store served {read} bytes for {tensors} bytes of tensors"
    )
    assert sum(r["stats"]["peer_hits"] for r in results) == NODES, [r["stats"] for r in results]
    assert all(r["stats"]["peer_faults"] == 0 for r in results), [r["stats"] for r in results]
    assert max(held) < pack.stat().st_size // 2, f"a tier holds {held} bytes: the pack was fetched"


@pytest.mark.netns
def test_a_flipped_byte_in_the_owners_copy_never_reaches_a_partial_load_on_another_node(
    tmp_path: Path, slow_store: tuple[Path, Path]
) -> None:
    """The pack's owner loads the whole version (its tier keeps the pack); one byte of a tensor in that
    copy then flips. The other node loads that tensor alone: the owner's agent sends it from its copy, the
    tensor's hash fails on the reader, which tells the owner (who drops its damaged copy) and reads the
    store's pack: the saved tensor, never the damaged one."""
    backing, mount = slow_store
    want = weights(n=16)
    Repository(backing / "repo", cache=False).save("m", want)
    manifest = json.loads(next((backing / "repo" / "models" / "m").glob("v*.json")).read_text())
    (offset,) = [t["offset"] for t in manifest["tensors"] if t["name"] == "layer3.weight"]
    with netns_job(tmp_path, mount, 2, sharing="inclusive") as (nodes, job):
        reader, copy = cached_on_owner(nodes, job, backing, mount, want)
        flip_byte(copy, offset + 1000)
        p = start_load(nodes.nodes[reader].cmd(), job[reader], mount / "repo", keys="layer3.*")
        second = finished(p, timeout=60)
    assert second["digest"] == digest_of({"layer3.weight": want["layer3.weight"]}), (
        "a damaged byte got through"
    )
    assert second["refetched"] == 1, second
    assert second["stats"]["peer_faults"] == 1, second["stats"]
    assert not copy.exists(), "the owner kept its damaged copy"


@pytest.mark.netns
def test_a_partial_load_whose_pack_owner_is_dead_reads_the_store_and_counts_the_fault(
    tmp_path: Path, slow_store: tuple[Path, Path]
) -> None:
    """The agent of the pack's owner is killed (SIGKILL) before the other node loads two tensors: the
    load's request for them finds nobody, counts the fault and reads the store's pack, with the saved
    tensors and no refetch."""
    backing, mount = slow_store
    want = weights(n=16)
    Repository(backing / "repo", cache=False).save("m", want)
    pack = pack_of(backing / "repo")
    chosen = {k: want[k] for k in ("layer1.weight", "layer2.weight")}
    with netns_job(tmp_path, mount, 2, sharing="inclusive") as (nodes, job):
        owner = owner_of(job, str(pack.relative_to(backing)))
        reader = 1 - owner
        os.kill(job[owner].pid, signal.SIGKILL)
        p = start_load(nodes.nodes[reader].cmd(), job[reader], mount / "repo", keys="layer[12].*")
        report = finished(p, timeout=60)
    assert report["digest"] == digest_of(chosen), "the load returned other tensors than were saved"
    assert report["refetched"] == 0, report
    assert report["stats"]["peer_faults"] >= 1, report["stats"]
    assert report["stats"]["peer_hits"] == 0, report["stats"]
