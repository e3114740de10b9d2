"""Loads of a repository that lives under a cache's source read its packs through the cache: once per node,
once per job across the nodes of a job, never a damaged byte."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tierstore
from tests.helpers.cluster import node_env
from tests.helpers.marks import needs
from tests.helpers.stores import store_stats
from tierstore.models import IntegrityError, Repository

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
    nothing at all (a pack never changes, so its copy needs no revalidation)."""
    cache, repo, want = saved
    size = pack_of(repo).stat().st_size
    cache.reset_counters()
    assert same(Repository(repo, cache=cache).load("m", mmap=mmap), want)
    first = cache.stats()["source"]
    assert first["bytes_read"] == size, first
    assert cache.lookup(pack_of(repo), validate=False) is not None
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
    copy = Path(str(cache.lookup(pack_of(repo), validate=False)))
    with open(copy, "r+b") as f:
        f.seek(3 << 20)
        b = f.read(1)
        f.seek(3 << 20)
        f.write(bytes([b[0] ^ 0x40]))
    assert same(repository.load("m", mmap=mmap), want)
    assert repository._packs.refetched == 1
    again = cache.lookup(pack_of(repo), validate=False)
    assert again is not None
    assert Path(again).read_bytes() == pack_of(repo).read_bytes()


def test_damage_in_the_store_itself_is_reported_not_hidden_by_the_cache(
    saved: tuple[tierstore.Cache, Path, dict[str, np.ndarray]],
) -> None:
    """When the store's pack is the damaged one, the refetched copy fails too: the load raises
    IntegrityError naming the tensor (as it does without a cache) and returns nothing."""
    cache, repo, _ = saved
    with open(pack_of(repo), "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(IntegrityError, match=r"layer0\.weight"):
        Repository(repo, cache=cache).load("m", mmap=False)


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
got = Repository(sys.argv[1], create=False).load("m", mmap=False)
h = hashlib.sha256()
for k in sorted(got):
    h.update(k.encode()); h.update(np.ascontiguousarray(got[k]).tobytes())
print(json.dumps({"digest": h.hexdigest(), "seconds": time.monotonic() - t,
                  "stats": tierstore.default_cache().stats()["source"]}))
"""


@pytest.mark.netns
@pytest.mark.parametrize("sharing", ["inclusive", "partitioned"])
@needs("root")
def test_four_nodes_loading_one_version_at_once_read_its_pack_from_the_store_once(
    tmp_path: Path, slow_store: tuple[Path, Path], sharing: str
) -> None:
    """Four nodes in their own network namespaces load the same version at the same moment, each with the
    cache configured the usual way (TIERSTORE_* variables): the store serves the pack's bytes once for the
    job, and every node gets the right tensors."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root)")
    from tierstore.testing.netns import Nodes

    backing, mount = slow_store
    want = weights(n=12)
    Repository(backing / "repo", cache=False).save("m", want)
    pack = pack_of(backing / "repo").stat().st_size
    digest = hashlib.sha256()
    for k in sorted(want):
        digest.update(k.encode())
        digest.update(want[k].tobytes())
    token = tmp_path / "token"
    token.write_text(hashlib.sha256(str(tmp_path).encode()).hexdigest())
    token.chmod(0o600)
    with Nodes(NODES) as nodes:
        addresses = [n.address for n in nodes.nodes]
        envs = []
        for i, n in enumerate(nodes.nodes):
            env = node_env(
                tmp_path / f"node{i}", tmp_path / f"tier{i}", mount, addresses, i, token, sharing=sharing
            )
            envs.append(env)
            start = n.cmd(sys.executable, "-m", "tierstore.cli", "agent", "start")
            subprocess.run(start, env=env, check=True, capture_output=True, timeout=60)
        try:
            before = store_stats(mount)
            procs = [
                subprocess.Popen(n.cmd(sys.executable, "-c", LOADER, str(mount / "repo")), env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for n, env in zip(nodes.nodes, envs, strict=True)
            ]  # fmt: skip
            results = []
            for p in procs:
                out, err = p.communicate(timeout=180)
                assert p.returncode == 0, err[-3000:]
                results.append(json.loads(out))
            after = store_stats(mount)
        finally:
            for n, env in zip(nodes.nodes, envs, strict=True):
                stop = n.cmd(sys.executable, "-m", "tierstore.cli", "agent", "stop")
                subprocess.run(stop, env=env, capture_output=True, timeout=60)
    assert [r["digest"] for r in results] == [digest.hexdigest()] * NODES
    read = after.get("bytes_read", 0) - before.get("bytes_read", 0)
    manifest = next((backing / "repo" / "models" / "m").glob("v*.json")).stat().st_size
    # The pack once; each node reads the small manifest (and the format marker) itself.
    assert pack <= read <= pack + NODES * (manifest + 64), (
        f"the store served {read} bytes for a {pack}-byte pack"
    )
    assert sum(r["stats"]["peer_hits"] for r in results) >= NODES - 1, [r["stats"] for r in results]
