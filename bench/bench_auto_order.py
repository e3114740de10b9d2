"""Benchmark of sampler-aware prefetch for a job nobody changed: `tierstore run python train.py`, no options.

The store: `tierstore.slowfs` (FUSE) with 5 ms per metadata operation and 10 ms per read request, no
bandwidth cap: a latency-bound shared store. The data: 400 images of ~64 KiB (PNG of noise, 8 classes in
a torchvision `DatasetFolder` layout) and 400 arrays of 64 KiB (`.npy`). The job (bench/auto_order_job.py)
is an ordinary script: a shuffled DataLoader (batch 16, 2 fork workers, persistent), a 5 ms step per
batch, its dataset either the folder (`samples`) or a custom list of `.npy` files (`files`).

Setups, alternated within each round, each on a freshly mounted store and an empty RAM tier:

  store      the job reading the store directly, no tierstore
  off        `tierstore run` with TIERSTORE_SAMPLER_PREFETCH=off: each file fetched on first read
  auto       `tierstore run`, no options: the DataLoader's order found by itself (tierstore.auto_order)
  order      `tierstore run --order FILE`, FILE the epoch's order computed beforehand from the seed
  wrapper    `tierstore run` and one line changed: `tierstore.torch.prefetching(loader, budget="64M")`
  local      the job reading a local copy in the page cache: the floor

Epoch 1 is timed inside the job (from `iter(loader)` to the last batch), so the interpreter's start,
which `--order` uses to get ahead, is not counted for anyone. A second part runs 3 epochs of the arrays
with the tier's quota half the data set (it never fits), `off` against `auto`: every epoch reads part of
the data from the store again, and only a prefetch in the next epoch's order hides that. A third runs the
same with a dataset that names no files (`computed`: each name built from the index), whose files `auto`
learns from epoch 1's opens and prefetches from epoch 2 on.

    .venv/bin/python bench/bench_auto_order.py --out docs/benchmarks/auto-order.md

JuiceFS CE is not beside these: it serves object stores, and this store is POSIX; docs/benchmarks/peers.md
puts the explicit wrapper beside it on S3.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from page import Check, finish, met, rounds
from tierstore.testing.slowfs import mounted, read_stats

HERE = Path(__file__).resolve().parent
JOB = HERE / "auto_order_job.py"
FILES = 400
SIZE = 64 << 10
META, DATA = "5ms", "10ms"
SETUPS = ("store", "off", "auto", "order", "wrapper", "local")


def generate(root: Path) -> Path:
    """The store's backing directory: `images/classN/*.png` and `arrays/*.npy`."""
    import numpy as np
    from PIL import Image

    backing = root / "data"
    done = root / f".complete-{FILES}"
    if done.exists():
        return backing
    shutil.rmtree(backing, ignore_errors=True)
    rng = np.random.default_rng(0)
    side = 148  # noise compresses to nothing: a 148 x 148 RGB PNG is ~64 KiB
    for i in range(FILES):
        d = backing / "images" / f"class{i % 8}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(d / f"img{i:04d}.png")
    (backing / "arrays").mkdir(parents=True)
    for i in range(FILES):
        np.save(backing / "arrays" / f"a{i:04d}.npy", rng.standard_normal(SIZE // 8 - 16).astype(np.float64))
    done.touch()
    return backing


def drop_cache(tree: Path) -> None:
    """Evicts the store's backing files from the page cache: every read of the store pays its latency."""
    for p in tree.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def epoch_order(root: Path, dataset: str) -> list[str]:
    """Epoch 1's files, in the order the job's loader will read them: the same seed, the same draws."""
    os.environ["TIERSTORE_SAMPLER_PREFETCH"] = "off"
    sys.path.insert(0, str(HERE))
    from torch.utils.data import Dataset

    import auto_order_job as job

    ds = job.Folder(str(root)) if dataset == "folder" else job.Arrays(str(root))
    names = [p for p, _ in ds.samples] if dataset == "folder" else ds.files

    class Indices(Dataset):
        def __len__(self) -> int:
            return len(names)

        def __getitem__(self, i: int) -> int:
            return i

    import torch
    from torch.utils.data import DataLoader

    # The job's loader without its workers: the same generator makes the same draws, and no file is read.
    loader = DataLoader(
        Indices(), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(job.SEED)
    )
    return [names[i] for batch in loader for i in batch.tolist()]


def run(setup: str, backing: Path, root: Path, dataset: str, epochs: int, quota: str) -> dict[str, Any]:
    """One job of `setup`: its JSON report, plus the store's operations and the run's wall seconds."""
    sub = "images" if dataset == "folder" else "arrays"  # npy and computed read the same arrays
    env = job_env()
    job = [sys.executable, str(JOB), "ROOT", "--dataset", dataset, "--epochs", str(epochs)]
    if setup == "local":
        local = root / "local"
        if not local.exists():
            shutil.copytree(backing, local)
        for p in (local / sub).rglob("*"):
            p.is_file() and p.read_bytes()
        return _run([*job[:2], str(local / sub), *job[3:]], env, None)
    drop_cache(backing)
    with mounted(backing, root / "mnt", meta_latency=META, data_latency=DATA, bandwidth="0") as mnt:
        data = mnt / sub
        cmd = [*job[:2], str(data), *job[3:]]
        tier = Path("/dev/shm") / f"tierstore-bench-auto-{os.getpid()}"
        shutil.rmtree(tier, ignore_errors=True)
        try:
            if setup != "store":
                front = [sys.executable, "-m", "tierstore.cli", "--source", str(mnt), "--tier", f"{tier}:{quota}",
                         "run", "--revalidate", "never"]  # fmt: skip
                if setup == "order":
                    listing = root / f"order-{dataset}.txt"
                    listing.write_text("".join(f"{p}\n" for p in epoch_order(data, dataset)))
                    front += ["--order", str(listing), "--budget", "64M"]
                if setup == "wrapper":
                    cmd += ["--wrap", "64M"]
                env["TIERSTORE_SAMPLER_PREFETCH"] = "off" if setup in ("off", "order", "wrapper") else "auto"
                cmd = [*front, "--", *cmd]
            return run_counted(cmd, env, mnt)
        finally:
            shutil.rmtree(tier, ignore_errors=True)


def job_env() -> dict[str, str]:
    """The environment of a benchmark's job: no setting of tierstore's from the caller's, the jobs'
    modules (bench/) importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERSTORE_")}
    env["PYTHONPATH"] = str(HERE)
    return env


def run_counted(cmd: list[str], env: dict[str, str], mnt: Path) -> dict[str, Any]:
    """`_run(cmd)`'s report, with what the stand-in store at `mnt` was asked meanwhile: opens, bytes read."""
    before = read_stats(mnt)
    out = _run(cmd, env, None)
    after = read_stats(mnt)
    out["opens"] = after.get("open", 0) - before.get("open", 0)
    out["bytes_read"] = after.get("bytes_read", 0) - before.get("bytes_read", 0)
    return out


def _run(cmd: list[str], env: dict[str, str], cwd: Path | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    report = json.loads(r.stdout.strip().splitlines()[-1])
    report["wall"] = time.perf_counter() - t0
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write the page (Markdown) here")
    ap.add_argument("--root", type=Path, default=Path("/tmp/tierstore-bench-auto-order"))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    started = time.time()
    args.root.mkdir(parents=True, exist_ok=True)
    backing = generate(args.root)
    epoch1: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        for dataset in ("folder", "npy"):
            order = SETUPS[r % len(SETUPS) :] + SETUPS[: r % len(SETUPS)]
            for setup in order:
                out = run(setup, backing, args.root, dataset, 1, "1G")
                epoch1.setdefault((dataset, setup), []).append(out)
                print(f"round {r + 1} {dataset:6} {setup:8} epoch 1 {out['seconds'][0]:6.2f} s, "
                      f"store opens {out.get('opens', '-')}", flush=True)  # fmt: skip
    # The data set twice the tier: 3 epochs of the arrays, off against auto.
    data_bytes = sum(p.stat().st_size for p in (backing / "arrays").iterdir())
    quota = str(data_bytes // 2)

    def three_epochs(dataset: str, label: str) -> dict[str, list[dict[str, Any]]]:
        """3 epochs of `dataset` on a tier half the data set, `off` against `auto`, every round."""
        out: dict[str, list[dict[str, Any]]] = {}
        for r in range(args.rounds):
            for setup in ("off", "auto") if r % 2 == 0 else ("auto", "off"):
                o = run(setup, backing, args.root, dataset, 3, quota)
                out.setdefault(setup, []).append(o)
                print(f"round {r + 1} {label} {setup:5} epochs {[round(s, 2) for s in o['seconds']]} "
                      f"opens {o['opens']}", flush=True)  # fmt: skip
        return out

    larger = three_epochs("npy", "2x tier")
    # A data set that names no files, twice the tier: its files learned from epoch 1.
    learned = three_epochs("computed", "learned")

    def ratios(dataset: str, base: str, than: str) -> list[float]:
        """Per round: `base`'s epoch 1 over `than`'s (above 1: `than` is faster)."""
        a, b = epoch1[(dataset, base)], epoch1[(dataset, than)]
        return [x["seconds"][0] / y["seconds"][0] for x, y in zip(a, b, strict=True)]

    checks: list[Check] = []
    lines = [
        "# Sampler-aware prefetch for an unchanged job: `tierstore run`, no options",
        "",
        f"Command: `python bench/bench_auto_order.py --rounds {args.rounds} --out docs/benchmarks/auto-order.md` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, {time.time() - started:.0f} s)",
        "",
        "## Method",
        "",
        *[f"    {line}" if line.strip() else "" for line in __doc__.strip().splitlines()[2:23]],
        "",
        f"{args.rounds} rounds; every setup of a round is one job; the setups' order rotates from round to "
        "round. Each ratio below is per round, the same round's jobs paired; a target is met when every "
        "round meets it, undecided when the rounds straddle it.",
        "",
        "## Epoch 1, seconds (every round)",
        "",
        "| data set | setup | epoch 1, s | CPU s of the job | store opens | same batches as `store` |",
        "| --- | --- | --- | --- | ---: | --- |",
    ]
    for dataset in ("folder", "npy"):
        reference = epoch1[(dataset, "store")][0]["digest"]
        for setup in SETUPS:
            runs = epoch1[(dataset, setup)]
            secs = ", ".join(f"{o['seconds'][0]:.2f}" for o in runs)
            cpu = ", ".join(f"{o['cpu'][0]:.2f}" for o in runs)
            opens = statistics.median(o.get("opens", 0) for o in runs) if setup != "local" else "-"
            same = all(o["digest"] == reference for o in runs)
            lines.append(f"| {dataset} | {setup} | {secs} | {cpu} | {opens} | {'yes' if same else 'NO'} |")
            checks.append(
                (
                    f"{dataset}, {setup}: the same batches as reading the store directly",
                    same,
                    "digest of every batch",
                )
            )
    lines += ["", "## Ratios of epoch 1 (per round)", ""]
    for dataset in ("folder", "npy"):
        for base, than, target in (
            ("off", "auto", 3.0),
            ("store", "auto", 3.0),
            ("auto", "order", None),
            ("auto", "wrapper", None),
        ):
            rs = ratios(dataset, base, than)
            lines.append(f"- {dataset}: `{base}` over `{than}`: {rounds(rs)}")
            if target is not None:
                checks.append(
                    (
                        f"{dataset}: `auto` at least {target}x faster than `{base}` in epoch 1",
                        met(rs, target),
                        rounds(rs),
                    )
                )
    lines += [
        "",
        f"## The data set twice the tier: 3 epochs of the arrays, quota {int(quota) >> 20} MiB",
        "",
        "| setup | round | epoch seconds | store opens (3 epochs) | MiB read from the store (3 epochs) |",
        "| --- | ---: | --- | ---: | ---: |",
    ]
    for setup in ("off", "auto"):
        for i, o in enumerate(larger[setup]):
            secs = ", ".join(f"{s:.2f}" for s in o["seconds"])
            lines.append(f"| {setup} | {i + 1} | {secs} | {o['opens']} | {o['bytes_read'] / 2**20:.1f} |")
    for e in (1, 2):
        rs = [a["seconds"][e] / b["seconds"][e] for a, b in zip(larger["off"], larger["auto"], strict=True)]
        lines.append(f"\n- epoch {e + 1}, `off` over `auto`: {rounds(rs)}")
        checks.append((f"2x the tier, epoch {e + 1}: `auto` faster than `off`", met(rs, 1.0), rounds(rs)))
    # "Never more store bytes than without prefetch": `off`'s bytes over `auto`'s at least 1.00 in every round.
    rs = [a["bytes_read"] / b["bytes_read"] for a, b in zip(larger["off"], larger["auto"], strict=True)]
    more = ", ".join(
        f"{(b['bytes_read'] / a['bytes_read'] - 1) * 100:+.2f}%"
        for a, b in zip(larger["off"], larger["auto"], strict=True)
    )
    checks.append(
        ("2x the tier: `auto` reads no more from the store than `off`", met(rs, 1.0), f"{more} (rounds)")
    )
    lines += [
        "",
        "## A data set that names no files, twice the tier: 3 epochs, files learned from epoch 1",
        "",
        "| setup | round | epoch seconds | CPU s of the job per epoch | store opens (3 epochs) | same batches as the list |",
        "| --- | ---: | --- | --- | ---: | --- |",
    ]
    same_as_list = larger["off"][0]["digest"]
    for setup in ("off", "auto"):
        for i, o in enumerate(learned[setup]):
            secs = ", ".join(f"{s:.2f}" for s in o["seconds"])
            cpu = ", ".join(f"{s:.2f}" for s in o["cpu"])
            same = o["digest"] == same_as_list
            lines.append(f"| {setup} | {i + 1} | {secs} | {cpu} | {o['opens']} | {'yes' if same else 'NO'} |")
            checks.append(
                (f"learned, {setup}, round {i + 1}: the same batches", same, "digest of every batch")
            )
    for e in (0, 1, 2):
        rs = [a["seconds"][e] / b["seconds"][e] for a, b in zip(learned["off"], learned["auto"], strict=True)]
        lines.append(f"\n- epoch {e + 1}, `off` over `auto`: {rounds(rs)}")
        if e > 0:
            checks.append((f"learned, epoch {e + 1}: `auto` faster than `off`", met(rs, 1.0), rounds(rs)))
    lines += ["", "## Targets", *finish_rows(checks)]
    return finish(lines, checks, args.out)


def finish_rows(checks: list[Check]) -> list[str]:
    from page import targets

    return targets(checks)


if __name__ == "__main__":
    sys.exit(main())
