"""Benchmark of read-ahead by shard for an iterable dataset nobody changed: a webdataset job under
`tierstore run`, no options.

The store: `tierstore.slowfs` (FUSE) with 5 ms per metadata operation and 10 ms per read request, no
bandwidth cap: a latency-bound shared store. The data: 32 webdataset shards (`shard-NNNN.tar`), each of 32
samples of 64 KiB (`.npy` of noise and a `.cls`), 64 MiB in all. The job (bench/shard_order_job.py) is an
ordinary script: a `webdataset.WebDataset` in list order, samples shuffled in a buffer, a DataLoader
(batch 16, 2 fork workers, persistent) and a 10 ms step per batch.

Setups, alternated within each round, each on a freshly mounted store and an empty RAM tier:

  store      the job reading the store directly, no tierstore
  off        `tierstore run` with TIERSTORE_SAMPLER_PREFETCH=off: each shard fetched as a worker opens it
  auto       `tierstore run`, no options: each worker's next shards fetched as it opens one
             (tierstore.shard_order, the shard list found in the WebDataset's pipeline)
  local      the job reading a local copy in the page cache: the floor

Two epochs per job, each timed inside the job (from `iter(loader)` to the last batch): epoch 1 reads the
store, epoch 2 is warm (every shard cached), where the read-ahead may only cost.

The store is mounted with a queue of 64 requests (`slowfs.set_queue`): the kernel's FUSE client
otherwise keeps 12, and with 9 queued stops reading ahead and asks the store for each 4 KiB page, which
a parallel file system's client does not do. A second part runs `off` and `auto` on the kernel's default
queue, to show what that costs.

    .venv/bin/python bench/bench_shard_order.py --out docs/benchmarks/shard-order.md
"""

from __future__ import annotations

import argparse
import io
import shutil
import statistics
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from bench_auto_order import _run, drop_cache, job_env, run_counted
from page import Check, finish, met, rounds, targets
from tierstore.testing.slowfs import mounted

HERE = Path(__file__).resolve().parent
JOB = HERE / "shard_order_job.py"
SHARDS, PER_SHARD, SIZE = 32, 32, 64 << 10
META, DATA = "5ms", "10ms"
SETUPS = ("store", "off", "auto", "local")
QUEUE = 64


def generate(root: Path) -> Path:
    """The store's backing directory of webdataset shards."""
    import numpy as np

    backing = root / "shards"
    if backing.exists():
        return backing
    backing.mkdir(parents=True)
    rng = np.random.default_rng(7)
    for s in range(SHARDS):
        with tarfile.open(backing / f"shard-{s:04d}.tar", "w") as tar:
            for k in range(PER_SHARD):
                buf = io.BytesIO()
                np.save(buf, rng.integers(0, 255, SIZE - 128, dtype=np.uint8))
                for ext, data in (("npy", buf.getvalue()), ("cls", str(k % 10).encode())):
                    info = tarfile.TarInfo(f"s{s:04d}k{k:04d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return backing


def run(setup: str, backing: Path, root: Path, queue: int | None = QUEUE) -> dict[str, Any]:
    """One job of `setup`: its JSON report, plus the store's operations."""
    import os

    env = job_env()
    job = [sys.executable, str(JOB), "ROOT", "--epochs", "2"]
    if setup == "local":
        local = root / "local"
        if not local.exists():
            shutil.copytree(backing, local)
        for p in local.iterdir():
            p.read_bytes()
        return _run([*job[:2], str(local), *job[3:]], env, None)
    drop_cache(backing)
    with mounted(
        backing, root / "mnt", meta_latency=META, data_latency=DATA, bandwidth="0", queue=queue
    ) as mnt:
        cmd = [*job[:2], str(mnt), *job[3:]]
        tier = Path("/dev/shm") / f"tierstore-bench-shards-{os.getpid()}"
        shutil.rmtree(tier, ignore_errors=True)
        try:
            if setup != "store":
                env["TIERSTORE_SAMPLER_PREFETCH"] = "off" if setup == "off" else "auto"
                cmd = [sys.executable, "-m", "tierstore.cli", "--source", str(mnt), "--tier", f"{tier}:1G",
                       "run", "--revalidate", "never", "--", *cmd]  # fmt: skip
            return run_counted(cmd, env, mnt)
        finally:
            shutil.rmtree(tier, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write the page (Markdown) here")
    ap.add_argument("--root", type=Path, default=Path("/tmp/tierstore-bench-shard-order"))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    started = time.time()
    args.root.mkdir(parents=True, exist_ok=True)
    backing = generate(args.root)
    size = sum(p.stat().st_size for p in backing.iterdir())
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        for setup in SETUPS[r % len(SETUPS) :] + SETUPS[: r % len(SETUPS)]:
            out = run(setup, backing, args.root)
            runs.setdefault(setup, []).append(out)
            print(f"round {r + 1} {setup:6} epochs {[round(s, 2) for s in out['seconds']]} "
                  f"store opens {out.get('opens', '-')}", flush=True)  # fmt: skip
    congested: dict[str, list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        for setup in ("off", "auto") if r % 2 == 0 else ("auto", "off"):
            out = run(setup, backing, args.root, queue=None)
            congested.setdefault(setup, []).append(out)
            print(f"round {r + 1} {setup:6} (the kernel's queue) epochs {[round(s, 2) for s in out['seconds']]}",
                  flush=True)  # fmt: skip
    checks: list[Check] = []
    lines = [
        "# Read-ahead by shard for an unchanged webdataset job: `tierstore run`, no options",
        "",
        f"Command: `python bench/bench_shard_order.py --rounds {args.rounds} --out docs/benchmarks/shard-order.md` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, {time.time() - started:.0f} s)",
        "",
        "## Method",
        "",
        *[f"    {line}" if line.strip() else "" for line in __doc__.strip().splitlines()[3:21]],
        "",
        f"{args.rounds} rounds; every setup of a round is one job; the setups' order rotates from round to "
        "round. Each ratio is per round, the same round's jobs paired.",
        "",
        "## Every round",
        "",
        "| setup | epoch 1, s | epoch 2 (warm), s | CPU s of the job, epoch 1 / 2 | store opens | MiB read from the store | same batches as `store` |",
        "| --- | --- | --- | --- | ---: | ---: | --- |",
    ]
    reference = runs["store"][0]["digest"]
    for setup in SETUPS:
        rs = runs[setup]
        e1 = ", ".join(f"{o['seconds'][0]:.2f}" for o in rs)
        e2 = ", ".join(f"{o['seconds'][1]:.2f}" for o in rs)
        cpu = ", ".join(f"{o['cpu'][0]:.2f} / {o['cpu'][1]:.2f}" for o in rs)
        opens = statistics.median(o["opens"] for o in rs) if setup != "local" else "-"
        mib = f"{statistics.median(o['bytes_read'] for o in rs) / 2**20:.1f}" if setup != "local" else "-"
        same = all(o["digest"] == reference for o in rs)
        lines.append(f"| {setup} | {e1} | {e2} | {cpu} | {opens} | {mib} | {'yes' if same else 'NO'} |")
        checks.append(
            (f"{setup}: the same batches as reading the store directly", same, "digest of every batch")
        )
        if setup in ("off", "auto"):
            once = all(o["opens"] == SHARDS and o["bytes_read"] == size for o in rs)
            checks.append((f"{setup}: each shard opened and read from the store once", once,
                           f"{SHARDS} shards, {size / 2**20:.1f} MiB"))  # fmt: skip

    def ratio(base: str, than: str, epoch: int) -> list[float]:
        return [
            a["seconds"][epoch] / b["seconds"][epoch] for a, b in zip(runs[base], runs[than], strict=True)
        ]

    lines += ["", "## Ratios (per round)", ""]
    for base, than, epoch, target in (
        ("off", "auto", 0, 1.0),
        ("store", "auto", 0, 3.0),
        ("auto", "local", 0, None),
    ):
        rs = ratio(base, than, epoch)
        lines.append(f"- epoch {epoch + 1}: `{base}` over `{than}`: {rounds(rs)}")
        if target is not None:
            said = "faster than" if target == 1.0 else f"at least {target}x faster than"
            checks.append((f"epoch 1: `auto` {said} `{base}`", met(rs, target), rounds(rs)))
    warm = ratio("auto", "off", 1)
    lines.append(f"- epoch 2 (warm): `auto` over `off`: {rounds(warm)}")
    cpu = [a["cpu"][1] / b["cpu"][1] for a, b in zip(runs["auto"], runs["off"], strict=True)]
    lines.append(f"- epoch 2 (warm), CPU s of the job: `auto` over `off`: {rounds(cpu)}")
    checks.append(
        ("epoch 2 (warm): `auto` at most 1.03x `off`", met([1.03 / r for r in warm], 1.0), rounds(warm))
    )
    lines += [
        "",
        "## On the kernel's default FUSE queue (12 requests, readahead dropped at 9)",
        "",
        "| setup | epoch 1, s | epoch 2 (warm), s | store opens | MiB read from the store |",
        "| --- | --- | --- | ---: | ---: |",
    ]
    for setup in ("off", "auto"):
        rs = congested[setup]
        e1 = ", ".join(f"{o['seconds'][0]:.2f}" for o in rs)
        e2 = ", ".join(f"{o['seconds'][1]:.2f}" for o in rs)
        opens = statistics.median(o["opens"] for o in rs)
        mib = statistics.median(o["bytes_read"] for o in rs) / 2**20
        lines.append(f"| {setup} | {e1} | {e2} | {opens} | {mib:.1f} |")
    queued = [
        a["seconds"][0] / b["seconds"][0] for a, b in zip(congested["off"], congested["auto"], strict=True)
    ]
    lines += ["", f"- epoch 1: `off` over `auto`: {rounds(queued)}"]
    lines += ["", "## Targets", *targets(checks)]
    return finish(lines, checks, args.out)


if __name__ == "__main__":
    sys.exit(main())
