"""Benchmark of revalidation on an S3 store one round trip away: what each `revalidate` mode costs a
DataLoader job's cold and warm epochs, in requests and in time, against a local copy of the objects.

A SeaweedFS server on loopback (`tierstore.testing.s3server`) holds `--objects` objects of `--size` bytes, and every
request reaches it through `tierstore.testing.s3server.LatencyProxy`, which holds each one `--latency` (10 ms: a
store in another rack or region) and counts them by kind (GET, HEAD, LIST). In one process, `--rounds`
times and in a new order each round, the same job (bench/s3_job.py: a DataLoader with `--workers` workers
reading every object whole, shuffled, for `--epochs` epochs, 3 by default) runs in these modes:

  local              plain open() of a copy of every object on /dev/shm: the bar
  default            tierstore as the docs' S3 example is written: no revalidate given ("60s")
  never              tierstore, revalidate "never" (a read-only dataset)
  60s                tierstore, revalidate "60s" (a copy confirmed within a minute is used as it is)
  always             tierstore, revalidate "always" (one HEAD per open of a cached object)
  never+prefetch     "never" with tierstore.torch.prefetching (the sampler's order fetched ahead)
  60s+prefetch       "60s" with tierstore.torch.prefetching

Each tierstore job starts with an empty tier. Reported per mode: epoch 1 and the warm epochs in seconds,
warm epochs against the local copy by time and by the CPU time of the job's processes (every round's
ratio, and their median), and the proxy's requests per object in epoch 1 and in the warm epochs, by kind.

    .venv/bin/python bench/bench_revalidate.py --out docs/benchmarks/revalidate.md

The exit status is 1 when a target is missed: epoch 1 costs one GET per object (no HEAD) in every mode;
warm epochs with "60s" at least 0.90x the local copy and 0.95x "never"; "always" one request per open;
prefetching adds at most 5% to a warm epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

import page
from tierstore.testing.s3server import LatencyProxy, S3Server
from units import blob

PY = sys.executable
JOB = str(Path(__file__).resolve().parent / "s3_job.py")
BUCKET = "bench"
MODES = {
    "local": ("local", "never", ""),
    "default": ("tierstore", "", ""),
    "never": ("tierstore", "never", ""),
    "60s": ("tierstore", "60s", ""),
    "always": ("tierstore", "always", ""),
    "never+prefetch": ("tierstore", "never", "1G"),
    "60s+prefetch": ("tierstore", "60s", "1G"),
}


def populate(s3: S3Server, n: int, size: int, local: Path) -> None:
    s3.create_bucket(BUCKET)
    client = s3.client()
    (local / "small").mkdir(parents=True, exist_ok=True)

    def put(i: int) -> None:
        key = f"small/{i:05d}.bin"
        body = blob(i, size)
        client.put_object(Bucket=BUCKET, Key=key, Body=body)
        (local / key).write_bytes(body)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, range(n)))


def run_job(
    proxy: LatencyProxy, s3: S3Server, args: argparse.Namespace, mode: str, base: Path
) -> dict[str, Any]:
    """One job of `--epochs` epochs in `mode`; seconds, CPU seconds of the job's processes and the proxy's
    requests (by kind) in each epoch."""
    kind, revalidate, prefetch = MODES[mode]
    tier = base / "tier"
    shutil.rmtree(tier, ignore_errors=True)
    tier.mkdir(parents=True)
    settings = {"tierstore": s3.settings(endpoint=proxy.endpoint)}
    env = {**os.environ, "BENCH_S3": json.dumps(settings), "TIERSTORE_LOG": "off"}
    cmd = [PY, JOB, "--mode", kind, "--bucket", BUCKET, "--tier", f"{tier}:4G", "--local", str(base / "local"),
           "--small", str(args.objects), "--workers", str(args.workers), "--revalidate", revalidate,
           "--handshake", "--epochs", str(args.epochs)]  # fmt: skip
    if prefetch:
        cmd += ["--prefetch", prefetch]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    assert p.stdin is not None and p.stdout is not None
    proxy.reset()
    epochs = []
    for _ in range(args.epochs):
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"the {mode} job failed (exit {p.wait()})")
        e = json.loads(line)
        e["requests"] = proxy.counts()
        proxy.reset()
        epochs.append(e)
        p.stdin.write("\n")
        p.stdin.flush()
    if p.wait() != 0:
        raise RuntimeError(f"the {mode} job exited with {p.returncode}")
    return {"mode": mode, "epochs": epochs}


def per_object(requests: dict[str, int], objects: int, epochs: int = 1) -> str:
    if not requests:
        return "0"
    return ", ".join(f"{k} {v / objects / epochs:.2f}" for k, v in sorted(requests.items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objects", type=int, default=2000)
    ap.add_argument("--size", type=int, default=128 << 10)
    ap.add_argument("--latency", type=float, default=0.010, help="seconds added to each request")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=3, help="epochs of each job: the first cold, the rest warm")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    modes = args.modes.split(",")
    base = Path(tempfile.mkdtemp(prefix="bench-revalidate-", dir="/dev/shm"))
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    try:
        with S3Server(base / "weed") as s3, LatencyProxy(s3.endpoint, args.latency) as proxy:
            populate(s3, args.objects, args.size, base / "local")
            for r in range(args.rounds):
                order = modes[:]
                random.Random(r).shuffle(order)
                for m in order:
                    job = run_job(proxy, s3, args, m, base)
                    results[m].append(job)
                    secs = ", ".join(f"{e['seconds']:.2f}" for e in job["epochs"])
                    print(f"round {r + 1} {m:>15}: epochs {secs} s; requests {[e['requests'] for e in job['epochs']]}",
                          flush=True)  # fmt: skip
    finally:
        shutil.rmtree(base, ignore_errors=True)

    def warm(job: dict[str, Any], measure: str = "seconds") -> float:
        return statistics.mean(e[measure] for e in job["epochs"][1:])

    def ratio(m: str, against: str, measure: str = "seconds") -> list[float]:
        # Paired by round: each round's jobs ran back to back on the same machine state.
        return [
            warm(a, measure) / warm(b, measure) for a, b in zip(results[against], results[m], strict=True)
        ]

    warm_epochs = args.epochs - 1

    lines = [
        "# Revalidation on an S3 store one round trip away",
        "",
        f"`{' '.join(['.venv/bin/python', *sys.argv])}`",
        "",
        f"{args.objects} objects of {args.size >> 10} KiB on SeaweedFS behind a proxy adding "
        f"{args.latency * 1000:.0f} ms per request; a DataLoader with {args.workers} workers reads every object "
        f"whole, shuffled, for {args.epochs} epochs; {args.rounds} rounds, modes in a new order each round. Speed "
        "is the local copy's warm epoch time over the mode's (1.00x: as fast as a local copy), CPU the local "
        "copy's CPU time over the mode's (the job's processes: bench/cpu.py), each the median of the rounds' "
        "ratios, each taken within one round; a target is met when every round meets it, undecided when the "
        "rounds straddle it. Requests are the proxy's counts per object.",
        "",
        "| mode | epoch 1 (s) | warm epoch (s) | warm speed vs local | warm CPU vs local | epoch 1 requests per "
        "object | warm requests per object per epoch |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    summary: dict[str, dict[str, float]] = {}
    for m in modes:
        jobs = results[m]
        e1 = statistics.median(j["epochs"][0]["seconds"] for j in jobs)
        w = statistics.median(warm(j) for j in jobs)
        speed = statistics.median(ratio(m, "local")) if "local" in results else float("nan")
        cpu = page.rounds(ratio(m, "local", "cpu")) if "local" in results else "n/a"
        first: dict[str, int] = {}
        later: dict[str, int] = {}
        for j in jobs:
            for k, v in j["epochs"][0]["requests"].items():
                first[k] = first.get(k, 0) + v
            for e in j["epochs"][1:]:
                for k, v in e["requests"].items():
                    later[k] = later.get(k, 0) + v
        summary[m] = {"speed": speed, "first": sum(first.values()) / len(jobs) / args.objects}
        summary[m]["first_get"] = first.get("GET", 0) / len(jobs) / args.objects
        summary[m]["warm_requests"] = sum(later.values()) / len(jobs) / warm_epochs / args.objects
        each = page.rounds(ratio(m, "local")) if "local" in results else f"{speed:.2f}x"
        lines.append(
            f"| {m} | {e1:.2f} | {w:.3f} | {each} | {cpu} | {per_object(first, args.objects, len(jobs))} | "
            f"{per_object(later, args.objects, warm_epochs * len(jobs))} |"
        )
    checks = []
    for m in modes:
        if m != "local":
            ok = abs(summary[m]["first"] - 1.0) < 0.005 and abs(summary[m]["first_get"] - 1.0) < 0.005
            checks.append((f"{m}: epoch 1 costs one GET per object", ok, f"{summary[m]['first']:.3f}"))
    if "60s" in summary and "local" in summary:
        r = ratio("60s", "local")
        checks.append(("60s: warm epochs >= 0.90x local", page.met(r, 0.90), page.rounds(r)))
    if "default" in summary and "local" in summary:
        r = ratio("default", "local")
        checks.append(("default: warm epochs >= 0.95x local", page.met(r, 0.95), page.rounds(r)))
        r = ratio("default", "local", "cpu")
        checks.append(("default: warm epochs' CPU time >= 0.95x local's (local's over tierstore's)",
                       page.met(r, 0.95), page.rounds(r)))  # fmt: skip
    if "60s" in summary and "never" in summary:
        r = ratio("60s", "never")
        checks.append(("60s: warm epochs >= 0.95x never", page.met(r, 0.95), page.rounds(r)))
    if "always" in summary:
        checks.append(("always: one request per open", abs(summary["always"]["warm_requests"] - 1.0) < 0.005,
                       f"{summary['always']['warm_requests']:.3f}"))  # fmt: skip
    for with_p, without in (("never+prefetch", "never"), ("60s+prefetch", "60s")):
        if with_p in summary and without in summary:
            r = ratio(with_p, without)
            checks.append((f"{with_p}: warm epochs >= 0.95x {without} (at most 1.05x its time)", page.met(r, 0.95),
                           page.rounds(r)))  # fmt: skip
    lines += page.targets(checks)
    lines += ["", "Per round (epoch seconds, CPU seconds, then the proxy's requests per epoch):", ""]
    for m in modes:
        for i, j in enumerate(results[m]):
            secs = ", ".join(f"{e['seconds']:.3f}" for e in j["epochs"])
            cpus = ", ".join(f"{e['cpu']:.3f}" for e in j["epochs"])
            lines.append(f"- {m}, round {i + 1}: {secs}; CPU {cpus}; {[e['requests'] for e in j['epochs']]}")
    return page.finish(lines, checks, args.out)


if __name__ == "__main__":
    sys.exit(main())
