"""Predicts what a job's nodes cache, read from the store and send each other, epoch by epoch, with the
agents' own owner hashing (`tierstore._core.owners`) and the same rules as the read path:

  a read of file f by node n: a local copy serves it; else if n owns f, the store does and n keeps it if
  its tier has room; else the owner serves it (reading the store first if it does not hold f, and keeping
  it if it has room), and in inclusive mode n keeps it too if it has room.

Tiers use the "fill" policy (no eviction): a copy is kept while the tier's quota has room for it. Each
node reads its DistributedSampler share of the dataset every epoch (num_replicas = nodes, shuffled by
seed + epoch), as a data-parallel job does. `bench_cluster.py` checks the prediction against a measured
4-node run; run alone, this tabulates 16 to 1000 nodes:

  .venv/bin/python bench/simulate_cluster.py [--files 100000] [--size 131072] [--tier-fraction 0.5]
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from tierstore import _core


@dataclass
class Epoch:
    source_bytes: int = 0
    peer_bytes: int = 0
    cached_bytes: list[int] = field(default_factory=list)


def shares(n_files: int, nodes: int, epoch: int, seed: int = 0) -> list[list[int]]:
    """Each node's indices for `epoch`, as torch's DistributedSampler(shuffle=True, drop_last=False) gives."""
    try:
        import torch

        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = torch.randperm(n_files, generator=g).tolist()
    except ImportError:  # the prediction does not depend on which permutation, only on the partition
        order = list(range(n_files))
        random.Random(seed + epoch).shuffle(order)
    total = -(-n_files // nodes) * nodes
    order += order[: total - n_files]
    return [order[r:total:nodes] for r in range(nodes)]


def simulate(
    sizes: Sequence[int],
    rels: Sequence[str],
    nodes: int,
    tier_bytes: int,
    mode: str,
    epochs: int,
    seed: int = 0,
    members: Sequence[str] | None = None,
    every_node_reads_all: bool = False,
) -> list[Epoch]:
    """The prediction for `epochs` epochs; `mode` is "off", "inclusive" or "partitioned"."""
    members = list(members or [f"node{i:05d}:7078" for i in range(nodes)])
    index = {m: i for i, m in enumerate(members)}
    owner = [index[o] for o in _core.owners(members, list(rels))]  # type: ignore[index]
    held: list[set[int]] = [set() for _ in range(nodes)]
    used = [0] * nodes
    out = []

    def keep(n: int, f: int) -> None:
        if f not in held[n] and used[n] + sizes[f] <= tier_bytes:
            held[n].add(f)
            used[n] += sizes[f]

    for e in range(epochs):
        ep = Epoch()
        per_node = (
            [list(range(len(sizes)))] * nodes if every_node_reads_all else shares(len(sizes), nodes, e, seed)
        )
        # The nodes read at the same time: interleave their reads (which copies fill a tier first
        # depends on it when tiers are short).
        longest = max(map(len, per_node))
        steps = [(n, per_node[n][k]) for k in range(longest) for n in range(nodes) if k < len(per_node[n])]
        for n, f in steps:
            if f in held[n]:
                continue
            o = owner[f]
            if mode == "off" or o == n:
                ep.source_bytes += sizes[f]
                keep(n, f)
                continue
            if f not in held[o]:
                ep.source_bytes += sizes[f]
                keep(o, f)
            ep.peer_bytes += sizes[f]
            if mode == "inclusive":
                keep(n, f)
        ep.cached_bytes = list(used)
        out.append(ep)
    return out


def balance(nodes: int, files: int) -> tuple[float, float]:
    """(busiest node's files / mean, share of files that move when one node leaves)."""
    members = [f"node{i:05d}:7078" for i in range(nodes)]
    rels = [f"train/{i:08d}.jpg" for i in range(files)]
    owners = _core.owners(members, rels)
    count: dict[str | None, int] = {}
    for o in owners:
        count[o] = count.get(o, 0) + 1
    busiest = max(count.values()) / (files / nodes)
    after = _core.owners(members, rels, [members[nodes // 2]])
    moved = sum(a != b for a, b in zip(owners, after, strict=True)) / files
    return busiest, moved


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=128 * 1024)
    ap.add_argument("--tier-fraction", type=float, default=0.5, help="one node's tier / the dataset")
    ap.add_argument("--epochs", type=int, default=3)
    a = ap.parse_args(argv)
    sizes = [a.size] * a.files
    rels = [f"train/{i:08d}.jpg" for i in range(a.files)]
    dataset = sum(sizes)
    tier = int(dataset * a.tier_fraction)
    print(f"dataset {a.files} x {a.size} B, one node's tier {a.tier_fraction:.2f} of it, {a.epochs} epochs")
    print("| nodes | mode | source bytes / dataset, per epoch | peer bytes / dataset, per epoch |")
    print("|---|---|---|---|")
    for nodes in (16, 64, 256, 1000):
        for mode in ("off", "inclusive", "partitioned"):
            eps = simulate(sizes, rels, nodes, tier, mode, a.epochs)
            src = " ".join(f"{e.source_bytes / dataset:.2f}" for e in eps)
            peer = " ".join(f"{e.peer_bytes / dataset:.2f}" for e in eps)
            print(f"| {nodes} | {mode} | {src} | {peer} |")


if __name__ == "__main__":
    main()
