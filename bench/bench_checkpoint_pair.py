"""A checkpoint through staging against the local disk, paired in one process.

DLIO's checkpoint page (`bench_dlio.py`) compares jobs run one after another, and this VM's disk changes
speed between them: a local-disk job may write at page-cache speed (1.5-2 GB/s) and the staged job after it
at the disk's write-back speed (300-450 MB/s), or the other way round. Here one process under
`tierstore run` writes each checkpoint twice in the same round: once to a directory of the local disk
(which the shim passes by) and once under a write-back destination staged on the same disk, with the
default durability ("buffered": the close returns with the bytes in the page cache, as the local disk's
does). The order alternates by round, and a pause between rounds stands for the training step in which
the agent migrates. Each round gives one paired ratio of the two write throughputs.

A checkpoint is `torch.save` of 34 files, 268 MiB (DLIO's llama3-8b-shaped checkpoint divided by 400: the
embeddings and the head, 32 layer files, the optimizer's states). The time spent in the closes is reported
apart: a staged close appends one record to the stage's log of closes (the agent hashes the file and
commits the journal after the burst). The store is a directory in
/dev/shm (a cluster's store takes none of the node's CPU; a FUSE stand-in would). After the job, every
file staged must be on the store, whole.

    .venv/bin/python bench/bench_checkpoint_pair.py --out docs/benchmarks/checkpoint-pair.md
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe
from page import Check, finish, met, targets, verdict

REPO = Path(__file__).resolve().parent.parent
FILES = 34
MIB = 1 << 20
TARGET = 0.95


def checkpoint_state(total: int) -> list[dict]:
    """`FILES` state dicts of float16 tensors, `total` bytes in all."""
    import torch

    per = total // FILES // 2  # float16: 2 bytes an element
    gen = torch.Generator().manual_seed(0)
    return [{"weight": torch.randn(per, generator=gen, dtype=torch.float32).half()} for _ in range(FILES)]


def save(state: list[dict], folder: Path) -> tuple[float, float]:
    """Writes one checkpoint into `folder`: (seconds in all, seconds in the closes)."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    closing = 0.0
    start = time.perf_counter()
    for i, part in enumerate(state):
        f = open(folder / f"part-{i:02}.pt", "wb")  # noqa: SIM115 - the close is timed apart
        torch.save(part, f)
        t = time.perf_counter()
        f.close()
        closing += time.perf_counter() - t
    return time.perf_counter() - start, closing


def child(args: argparse.Namespace) -> int:
    """The job, run under `tierstore run`: the paired rounds, as JSON on stdout."""
    state = checkpoint_state(args.size)
    size = sum(p["weight"].numel() * 2 for p in state)
    rounds = []
    for r in range(args.rounds):
        order = ["local", "staged"] if r % 2 == 0 else ["staged", "local"]
        got = {}
        for setup in order:
            folder = (args.local if setup == "local" else args.dest) / f"round-{r}"
            seconds, closing = save(state, folder)
            got[setup] = {"seconds": seconds, "closing": closing}
        # The local copy goes, as a trainer's older checkpoints do; the staged one goes to the store.
        shutil.rmtree(args.local / f"round-{r}")
        rounds.append(got)
        print(f"round {r + 1} of {args.rounds}: {json.dumps(got)}", file=sys.stderr, flush=True)
        time.sleep(args.step)
    json.dump({"size": size, "rounds": rounds}, sys.stdout)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write the results as Markdown here")
    ap.add_argument("--root", type=Path, default=Path("/var/tmp/tierstore-bench-ckpt-pair"))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--size", type=int, default=268 * MIB, help="bytes of one checkpoint")
    ap.add_argument("--step", type=float, default=2.5, help="seconds of compute between rounds")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--local", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--dest", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)

    command = " ".join([".venv/bin/python", "bench/bench_checkpoint_pair.py", *(argv or sys.argv[1:])])
    root: Path = args.root
    store = Path("/dev/shm") / f"tierstore-bench-ckpt-pair-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    local, stage, run = root / "local", root / "stage", root / "run"
    for d in (local, stage, run, store):
        d.mkdir(parents=True)
    env = {
        **os.environ,
        "XDG_RUNTIME_DIR": str(run),
        "TIERSTORE_WRITEBACK": f"{store}:{stage}:8G",
    }
    env.pop("TIERSTORE_CONFIG", None)
    tierstore = str(Path(sys.executable).parent / "tierstore")
    try:
        job = [sys.executable, __file__, "--child", "--local", str(local), "--dest", str(store)]
        job += ["--rounds", str(args.rounds), "--size", str(args.size), "--step", str(args.step)]
        out = subprocess.run(
            [tierstore, "run", "--", *job], env=env, stdout=subprocess.PIPE, check=True, text=True
        )
        result = json.loads(out.stdout)
        t = time.perf_counter()
        subprocess.run([tierstore, "sync", str(store)], env=env, check=True, capture_output=True)
        synced = time.perf_counter() - t
        # Every round saved the same state: each part's file must be the same bytes in every round.
        on_store = sorted(store.glob("round-*/part-*.pt"))
        digests = {p: hashlib.blake2b(p.read_bytes()).digest() for p in on_store}
        whole = len(on_store) == args.rounds * FILES and all(
            len({d for p, d in digests.items() if p.name == f"part-{i:02}.pt"}) == 1 for i in range(FILES)
        )
        subprocess.run([tierstore, "agent", "stop"], env=env, capture_output=True)
    finally:
        shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)

    size, rounds = result["size"], result["rounds"]
    mibs = lambda s: size / s / MIB  # noqa: E731
    ratios = [r["local"]["seconds"] / r["staged"]["seconds"] for r in rounds]
    lines = [
        "# A checkpoint through staging against the local disk, paired in one process",
        "",
        "```",
        command,
        "```",
        "",
        f"{describe()}. {len(rounds)} rounds; one checkpoint: {size / MIB:.0f} MiB in {FILES} files "
        f"(`torch.save`, no fsync), {args.step:.1f} s of compute between rounds. See the script's docstring "
        "for the setup.",
        "",
        "| round | first | local disk MiB/s | staged MiB/s | staged / local | closes, local ms | closes, staged ms |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for i, (r, ratio) in enumerate(zip(rounds, ratios, strict=True)):
        first = "local" if i % 2 == 0 else "staged"
        lines.append(
            f"| {i + 1} | {first} | {mibs(r['local']['seconds']):.0f} | {mibs(r['staged']['seconds']):.0f} | "
            f"{ratio:.2f} | {r['local']['closing'] * 1000:.0f} | {r['staged']['closing'] * 1000:.0f} |"
        )
    med = statistics.median(ratios)
    close_share = statistics.median(r["staged"]["closing"] / r["staged"]["seconds"] for r in rounds)
    lines += [
        "",
        f"Median of the paired ratios: **{med:.2f}x** (rounds {min(ratios):.2f}-{max(ratios):.2f}). The staged "
        f"closes (a record appended to the log of closes) take {close_share:.0%} of a staged checkpoint's time "
        "(median).",
        f"After the job, `tierstore sync` took {synced:.1f} s more; every staged file is on the store, whole: "
        f"{'yes' if whole else 'NO'}.",
    ]
    checks: list[Check] = [
        (
            f"staged write throughput >= {TARGET}x the local disk's, paired",
            met(ratios, TARGET),
            verdict(ratios, TARGET),
        ),
        (
            "every staged file reaches the store whole",
            whole,
            f"{len(on_store)} of {args.rounds * FILES} files",
        ),
    ]
    return finish(lines + targets(checks), checks, args.out)


if __name__ == "__main__":
    sys.exit(main())
