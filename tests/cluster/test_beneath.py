"""A symlink inside the source never lets another node read a file outside it through this node's agent
(issue #35, item 8): the owner's agent opens a peer's request beneath the source, so a symlink out of it is
refused, and the reader reads the file from the store itself, with its own rights, as any local open does.
A symlink to a file inside the source is served as any file."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tests.helpers.cluster import make_cluster, owners_of, stop_cluster

SECRET = b"SECRET-OF-A:id_rsa;" * 200
BIG_SECRET = b"BIG-SECRET-OF-A;" * (3 * (1 << 20) // 16 + 7)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_symlink_out_of_the_source_is_never_served_to_another_node(tmp_path: Path) -> None:
    source, home = tmp_path / "source", tmp_path / "home-of-a"
    (source / "shared").mkdir(parents=True)
    home.mkdir()
    (home / "id_rsa").write_bytes(SECRET)
    (home / "big_secret").write_bytes(BIG_SECRET)
    inside = os.urandom(5000)
    (source / "inside.bin").write_bytes(inside)
    want: dict[str, str] = {}
    outside: list[str] = []
    for i in range(12):
        # Out of the source: an absolute target, `..` past the root, a large file (followed as it is
        # copied), and through a directory symlink.
        innocent, big = f"shared/innocent{i}.txt", f"shared/big{i}.bin"
        for link, target, rel, data in [
            (innocent, home / "id_rsa", innocent, SECRET),
            (f"up{i}", Path("../home-of-a/id_rsa"), f"up{i}", SECRET),
            (big, Path("../../home-of-a/big_secret"), big, BIG_SECRET),
            (f"home{i}", home, f"home{i}/id_rsa", SECRET),
        ]:
            os.symlink(target, source / link)
            want[rel] = sha(data)
            outside.append(rel)
        # Inside it.
        os.symlink("inside.bin", source / f"link_in{i}")
        want[f"link_in{i}"] = sha(inside)

    cluster = make_cluster(tmp_path, source, 2, "partitioned")
    try:
        reader, owner = cluster.nodes
        owners = owners_of(cluster.nodes, sorted(want))
        rels = sorted(r for r in want if owners[r] == 1)
        escapes = [r for r in rels if r in outside]
        assert escapes and len(escapes) < len(rels), rels
        # The owner's node reads every file first: a local open follows the symlinks, so it gets the
        # secrets, and its tier holds copies of them.
        assert cluster.read_all(owner, rels)["got"] == {r: want[r] for r in rels}
        served_before = cluster.stats(owner)["served_bytes"]

        out = cluster.read_all(reader, rels)
        # The reader has every file right: the ones the owner refused, from the store itself.
        assert out["got"] == {r: want[r] for r in rels}
        stats = out["stats"]
        assert stats["peer_faults"] == len(escapes), stats
        assert stats["peer_hits"] == len(rels) - len(escapes), stats
        assert "resolves outside the source" in out["stderr"], out["stderr"]
        # And not one byte of a secret crossed: the owner's agent served the links inside the source only.
        served = cluster.stats(owner)["served_bytes"] - served_before
        assert served == len(inside) * (len(rels) - len(escapes)), served
    finally:
        stop_cluster(cluster)
