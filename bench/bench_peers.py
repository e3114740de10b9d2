"""Benchmark of tierstore beside the tools users compare it with, on one S3 store one round trip away.

One file of about 900 lines, on purpose: one benchmark's setups, the mounting of each peer, paired rounds and
report read together, and no other script uses any of it.

A SeaweedFS server on loopback (`tierstore.testing.s3server`) holds `--small` objects of `--small-size` and
`--large` of `--large-size` under s3://bench/data/, and every request reaches it through
`tierstore.testing.s3server.LatencyProxy`, which holds each one `--latency` (10 ms) and counts them by kind
(GET, HEAD, LIST, PUT...). In one process, `--rounds` times and in a new order each round, the same job
(bench/s3_job.py: a DataLoader with `--workers` persistent workers reading every small object whole,
shuffled, and every large one in 1 MiB records, for 3 epochs by default) runs in these setups:

  local                 plain open() of a copy of every object on /dev/shm: the bar
  tierstore 60s         tierstore.Cache(source="s3://bench/data"), a tier on /dev/shm, no revalidate setting:
                        the default, "60s" (a copy confirmed within a minute is trusted; checked at start)
  tierstore always      the same with revalidate "always" (one HEAD per open of a cached copy)
  tierstore never       revalidate "never"
  ... +prefetch         each of the three with tierstore.torch.prefetching (the sampler's order fetched ahead)
  tierstore 60s +auto   the defaults, no line of tierstore's in the job beyond its Cache: the datasets hold
                        each object's full name (`files`), and the DataLoader hook (tierstore.auto_order)
                        finds the sampler's order and the shards' by itself
  juicefs               JuiceFS CE mounted with --cache-dir on /dev/shm, metadata in a local redis-server
                        (sqlite without one), data on the same bucket through the proxy. JuiceFS keeps files
                        in its own chunked format, so the dataset is copied in through a mount once, before
                        the timed jobs; only the jobs' requests are counted.
  rclone modtime        rclone mount --vfs-cache-mode full --use-server-modtime of s3://bench/data
  rclone                the same without --use-server-modtime (rclone's default)
  s3fs-fuse             s3fs -o use_cache, path-style requests to the proxy
  simplecache           fsspec's simplecache::s3:// over s3fs (its cache directory on /dev/shm)

Every FUSE tool is mounted fresh with an empty cache directory on /dev/shm before each job, and unmounted
after; every tierstore and simplecache job starts with an empty cache too. Also in each round, the whole
dataset is warmed into an empty cache by `tierstore prefetch s3://bench/data`, by `juicefs warmup` of a fresh
mount and, as the floor, by boto3 downloading every object from 32 threads (bench/peers_job.py).

Reported per setup: epoch 1 in seconds, warm epochs (2 on) against the local copy, by time and by CPU time (the median of the rounds'
paired ratios), the proxy's requests per object per epoch by kind (epoch 1 and warm), each warm-up's time,
and the cache directory's size at the end of each job. Then a POSIX source: the stand-in shared store
(`tierstore.slowfs` over a directory, its default latencies) read by tierstore and by JuiceFS with its data
on that store (`--storage file`), `--pfs-rounds` rounds.

"tierstore's defaults" is `tierstore 60s`: no revalidate setting, no prefetch; `always` and `never` are the
other revalidate modes, measured beside it without a target of their own.

    .venv/bin/python bench/bench_peers.py --out docs/benchmarks/peers.md --plot docs/benchmarks/peers.png

The targets: epoch 1 ahead of every peer, at least 3x JuiceFS's with sampler-aware prefetch and ahead of it
without; with the order found by the DataLoader hook (`+auto`) within 1.15x of the explicit wrapper's; warm epochs at least 0.95x the local copy and ahead of every peer, with the defaults each tool gives
a user; with revalidate "never", one fetch per object in epoch 1 and no request in later epochs; `tierstore
prefetch` of the dataset at most the boto3 floor's time. A target measured by a ratio is met when every
round's paired ratio meets it, missed when none does, and undecided when the rounds' ratios fall on both
sides of its threshold (the median alone would decide it by the noise). The exit status is 1 unless every
target is met. A tool that cannot run here is skipped, and the page says why.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

import machine
import page
from tierstore.testing import slowfs
from tierstore.testing.s3server import ACCESS_KEY, SECRET_KEY, LatencyProxy, S3Server
from units import blob, human, size

PY = sys.executable
BIN = Path(PY).parent
HERE = Path(__file__).resolve().parent
JOB = str(HERE / "s3_job.py")
FLOOR_JOB = str(HERE / "peers_job.py")
BUCKET, PREFIX = "bench", "data"
RANGE = 8 << 20  # tierstore's default range_size: a larger object is fetched as ranges of this size
JOB_TIMEOUT = 900.0


# tierstore's revalidate modes: the setup's name -> the setting passed ("": none, the default).
DEFAULT_MODE = "60s"  # config::DEFAULT_REVALIDATE since issue #36; main() checks the build agrees
MODES = {DEFAULT_MODE: "", "always": "always", "never": "never"}


@dataclass(frozen=True)
class Setup:
    name: str
    kind: str  # local, tierstore, juicefs, rclone, s3fs-fuse, simplecache
    revalidate: str = "never"  # tierstore's setting; "" sets none (the default)
    prefetch: str = ""
    options: tuple[str, ...] = ()
    names: bool = False  # the job's datasets hold each object's full name (s3_job.py --names)


S3_SETUPS = [
    Setup("local", "local"),
    *(Setup(f"tierstore {r}", "tierstore", MODES[r]) for r in MODES),
    *(Setup(f"tierstore {r} +prefetch", "tierstore", MODES[r], "1G") for r in MODES),
    Setup(f"tierstore {DEFAULT_MODE} +auto", "tierstore", MODES[DEFAULT_MODE], names=True),
    Setup("juicefs", "juicefs"),
    Setup("rclone modtime", "rclone", options=("--use-server-modtime",)),
    Setup("rclone", "rclone"),
    Setup("s3fs-fuse", "s3fs-fuse"),
    Setup("simplecache", "simplecache"),
]
PFS_SETUPS = [
    Setup("local", "local"),
    Setup(f"tierstore {DEFAULT_MODE}", "tierstore", ""),
    Setup("tierstore always", "tierstore", "always"),
    Setup("tierstore never", "tierstore", "never"),
    Setup("tierstore never +prefetch", "tierstore", "never", "1G"),
    Setup("juicefs", "juicefs"),
]
WARMUPS = ["tierstore prefetch", "juicefs warmup", "boto3 floor"]
DEFAULTS = f"tierstore {DEFAULT_MODE}"  # what a user gets: no revalidate setting, no prefetch
# Each peer as it comes, with no option beyond pointing it at the store and its cache at /dev/shm.
PEER_DEFAULTS = ["juicefs", "rclone", "s3fs-fuse", "simplecache"]


class Unavailable(Exception):
    """A tool that cannot run on this machine; the message says why."""


def keys(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    items = [(f"small/{i:05d}.bin", args.small_size, i) for i in range(args.small)]
    return items + [(f"large/{i:02d}.bin", args.large_size, 100_000 + i) for i in range(args.large)]


def allocated(path: Path) -> int:
    """Bytes a directory holds on its file system (sparse files count what they hold)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
    return total


def fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def tool_env(**extra: str) -> dict[str, str]:
    # The store is plain HTTP on loopback, so a CA bundle means nothing to it; rclone 1.60's AWS SDK refuses
    # to start with AWS_CA_BUNDLE set ("unable to load custom CA bundle"), and this machine sets one.
    env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}
    return {**env, "TIERSTORE_LOG": "off", **extra}


def binary(name: str) -> str | None:
    return str(BIN / name) if (BIN / name).exists() else shutil.which(name)


def first_line(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        return (out.stdout or out.stderr).strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired) as e:
        return f"? ({e})"


class Mounts:
    """Mounts each FUSE tool fresh over the store, its cache directory emptied first, and unmounts it."""

    def __init__(self, base: Path, proxy: str) -> None:
        self.base, self.proxy = base, proxy
        self.redis: subprocess.Popen[bytes] | None = None
        self.meta: dict[str, str] = {}  # JuiceFS volume -> metadata URL
        self.why: dict[str, str] = {}  # tool -> why it cannot run here
        for tool, name in (("juicefs", "juicefs"), ("rclone", "rclone"), ("s3fs-fuse", "s3fs")):
            if binary(name) is None:
                self.why[tool] = f"`{name}` is not installed (`make bench-setup` installs it)"
        if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
            for tool in ("juicefs", "rclone", "s3fs-fuse"):
                self.why[tool] = "FUSE is not available here (no /dev/fuse or no fusermount3)"
        self.passwd = base / "s3fs.passwd"
        self.passwd.write_text(f"{ACCESS_KEY}:{SECRET_KEY}\n")
        self.passwd.chmod(0o600)

    def meta_url(self, db: int) -> str:
        """A metadata engine for JuiceFS: a redis-server of our own on a free loopback port, else sqlite."""
        if shutil.which("redis-server") is None:
            return f"sqlite3://{self.base / f'juicefs-{db}.db'}"
        if self.redis is None:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            self.redis = subprocess.Popen(
                ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"],
                stdout=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
            self.redis_port = port
            deadline = time.monotonic() + 30
            while True:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                    break
                if time.monotonic() > deadline:
                    raise Unavailable("redis-server did not answer on loopback in 30 s")
                time.sleep(0.05)
        return f"redis://127.0.0.1:{self.redis_port}/{db}"

    def juicefs_format(self, volume: str, db: int, storage: list[str], fill: Path) -> dict[str, Any]:
        """Formats a JuiceFS volume and copies the dataset at `fill` in through a mount."""
        if "juicefs" in self.why:
            raise Unavailable(self.why["juicefs"])
        meta = self.meta_url(db)
        out = subprocess.run(
            [binary("juicefs"), "format", *storage, meta, volume],  # type: ignore[list-item]
            capture_output=True, text=True, env=tool_env(),
        )  # fmt: skip
        if out.returncode != 0:
            raise Unavailable(f"juicefs format failed: {out.stderr.strip()[-400:]}")
        self.meta[volume] = meta
        t0 = time.perf_counter()
        with self.mounted(Setup(volume, "juicefs")) as (mnt, _):
            files = [p.relative_to(fill) for p in fill.rglob("*") if p.is_file()]

            def copy(rel: Path) -> None:
                (mnt / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(fill / rel, mnt / rel)

            with ThreadPoolExecutor(16) as pool:
                list(pool.map(copy, files))
        return {"seconds": time.perf_counter() - t0, "files": len(files)}

    @contextlib.contextmanager
    def mounted(self, setup: Setup, volume: str = "") -> Iterator[tuple[Path, Path]]:
        """The tool mounted fresh: (where the job reads, the cache directory), unmounted on the way out."""
        tool = setup.kind
        if tool in self.why:
            raise Unavailable(self.why[tool])
        mnt = self.base / f"mnt-{tool}"
        mnt.mkdir(exist_ok=True)
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)
        cache = fresh(self.base / f"cache-{tool}")
        log = self.base / f"{tool}.log"
        env = tool_env()
        if tool == "juicefs":
            volume = volume or setup.name
            cmd = [binary("juicefs"), "mount", self.meta[volume], str(mnt), "--cache-dir", str(cache),
                   "--no-usage-report", *setup.options]  # fmt: skip
        elif tool == "rclone":
            cmd = [binary("rclone"), "mount", f"store:{BUCKET}/{PREFIX}", str(mnt), "--vfs-cache-mode", "full",
                   "--cache-dir", str(cache), "--config", str(self.base / "rclone.conf"), *setup.options]  # fmt: skip
            remote = {"TYPE": "s3", "PROVIDER": "Other", "ENDPOINT": self.proxy, "ACCESS_KEY_ID": ACCESS_KEY,
                      "SECRET_ACCESS_KEY": SECRET_KEY, "REGION": "us-east-1", "FORCE_PATH_STYLE": "true"}  # fmt: skip
            env.update({f"RCLONE_CONFIG_STORE_{k}": v for k, v in remote.items()})
        else:
            cmd = [binary("s3fs"), f"{BUCKET}:/{PREFIX}", str(mnt), "-f", "-o", f"url={self.proxy}",
                   "-o", "use_path_request_style", "-o", f"use_cache={cache}", "-o", f"passwd_file={self.passwd}",
                   *setup.options]  # fmt: skip
        with open(log, "wb") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)  # type: ignore[arg-type]
        try:
            deadline = time.monotonic() + 60
            while not os.path.ismount(mnt):
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = log.read_text(errors="replace").strip()[-400:]
                    raise Unavailable(f"{tool} did not mount: {tail or f'exit {proc.poll()}'}")
                time.sleep(0.05)
            yield mnt, cache
        finally:
            # Processes of a job that just ended may still be closing files there: retry, then detach.
            deadline = time.monotonic() + 10
            while os.path.ismount(mnt):
                if subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True).returncode == 0:
                    break
                if time.monotonic() > deadline:
                    subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)
                    break
                time.sleep(0.2)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def close(self) -> None:
        if self.redis is not None:
            self.redis.kill()
            self.redis.wait(10)


class Bench:
    """One store, its proxy, the tools' mounts and the dataset; runs jobs and warm-ups."""

    def __init__(self, args: argparse.Namespace, base: Path, s3: S3Server, proxy: LatencyProxy) -> None:
        self.args, self.base, self.s3, self.proxy = args, base, s3, proxy
        self.mounts = Mounts(base, proxy.endpoint)
        self.local = base / "local"
        s3fs_options = {"key": ACCESS_KEY, "secret": SECRET_KEY,
                        "client_kwargs": {"endpoint_url": proxy.endpoint, "region_name": "us-east-1"}}  # fmt: skip
        self.settings = {"tierstore": s3.settings(endpoint=proxy.endpoint), "s3fs": s3fs_options}

    def populate(self) -> None:
        self.s3.create_bucket(BUCKET)
        client = self.s3.client()

        def put(item: tuple[str, int, int]) -> None:
            key, n, seed = item
            body = blob(seed, n)
            client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{key}", Body=body)
            (self.local / key).parent.mkdir(parents=True, exist_ok=True)
            (self.local / key).write_bytes(body)

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(put, keys(self.args)))

    def job(
        self, setup: Setup, read: Path | None = None, source: str = "", stats: Path | None = None
    ) -> dict[str, Any]:
        """One job of `--epochs` epochs: seconds, CPU seconds and requests (the proxy's, or the stand-in store's
        at `stats`) per epoch."""
        a = self.args
        tier = fresh(self.base / "tier")
        mode = "local" if setup.kind in ("local", "juicefs", "rclone", "s3fs-fuse") else setup.kind
        cmd = [PY, JOB, "--mode", mode, "--bucket", f"{BUCKET}/{PREFIX}", "--source", source,
               "--tier", f"{tier}:8G" if setup.kind == "tierstore" else str(tier),
               "--local", str(read or self.local), "--small", str(a.small), "--large", str(a.large),
               "--workers", str(a.workers), "--revalidate", setup.revalidate, "--handshake",
               "--epochs", str(a.epochs)]  # fmt: skip
        if setup.prefetch:
            cmd += ["--prefetch", setup.prefetch]
        if setup.names:
            cmd.append("--names")
        env = tool_env(BENCH_S3=json.dumps(self.settings))
        counts = (lambda: store_ops(stats)) if stats else self.proxy.counts
        self.proxy.reset()
        before = counts()
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        assert p.stdin is not None and p.stdout is not None
        watchdog = threading.Timer(JOB_TIMEOUT, p.kill)
        watchdog.start()
        epochs = []
        try:
            for _ in range(a.epochs):
                line = p.stdout.readline()
                if not line:
                    raise RuntimeError(f"the {setup.name} job failed (exit {p.wait()})")
                e = json.loads(line)
                now = counts()
                e["requests"] = {k: v - before.get(k, 0) for k, v in now.items() if v - before.get(k, 0)}
                before = now
                epochs.append(e)
                p.stdin.write("\n")
                p.stdin.flush()
            if p.wait() != 0:
                raise RuntimeError(f"the {setup.name} job exited with {p.returncode}")
        finally:
            watchdog.cancel()
            if p.poll() is None:
                p.kill()
                p.wait()
        return {"epochs": epochs, "cache": allocated(tier)}

    def run(
        self, setup: Setup, source: str = "", stats: Path | None = None, volume: str = ""
    ) -> dict[str, Any]:
        if setup.kind in ("juicefs", "rclone", "s3fs-fuse"):
            with self.mounts.mounted(setup, volume) as (mnt, cache):
                job = self.job(setup, read=mnt, stats=stats)
                job["cache"] = allocated(cache)
            return job
        if setup.kind == "simplecache":
            return self.job(setup)
        return self.job(setup, source=source or f"s3://{BUCKET}/{PREFIX}", stats=stats)

    def cpu_split(self) -> dict[str, float]:
        """CPU seconds so far of the command a warm-up runs (this process's children), of the proxy (this
        process: while a command runs, its only busy threads are the proxy's) and of SeaweedFS. On two
        cores, what a warm-up can reach is their sum's share of the machine, not the store's latency."""
        children, me = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)
        store = 0.0
        if self.s3.proc is not None:
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{self.s3.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
                store = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return {
            "command": children.ru_utime + children.ru_stime,
            "proxy": me.ru_utime + me.ru_stime,
            "store": store,
        }

    def warmup(self, name: str) -> dict[str, Any]:
        """Every object of the dataset into an empty cache: seconds, requests by kind, cache bytes."""
        dest = fresh(self.base / "warm")
        env = tool_env(**{**self.s3.env(), "AWS_ENDPOINT_URL": self.proxy.endpoint})
        if name == "juicefs warmup":
            with self.mounts.mounted(Setup("juicefs", "juicefs")) as (mnt, cache):
                self.proxy.reset()
                t0 = time.perf_counter()
                out = subprocess.run([binary("juicefs"), "warmup", str(mnt)], capture_output=True, text=True)  # type: ignore[list-item]
                seconds = time.perf_counter() - t0
                requests, held = self.proxy.counts(), allocated(cache)
            if out.returncode != 0:
                raise RuntimeError(f"juicefs warmup failed: {out.stderr.strip()[-400:]}")
            return {"seconds": seconds, "requests": requests, "cache": held}
        if name == "tierstore prefetch":
            url = f"s3://{BUCKET}/{PREFIX}"
            cmd = [
                str(BIN / "tierstore"),
                "--source",
                url,
                "--tier",
                f"{dest}:8G",
                "prefetch",
                "--no-progress",
                url,
            ]
        else:
            cmd = [PY, FLOOR_JOB, "--bucket", BUCKET, "--prefix", f"{PREFIX}/", "--dest", str(dest)]
        self.proxy.reset()
        cpu0 = self.cpu_split()
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=JOB_TIMEOUT)
        seconds = time.perf_counter() - t0
        cpu = {k: v - cpu0[k] for k, v in self.cpu_split().items()}
        if out.returncode != 0:
            raise RuntimeError(f"{name} failed: {out.stderr.strip()[-400:]}")
        result = {"seconds": seconds, "requests": self.proxy.counts(), "cache": allocated(dest), "cpu": cpu}
        if name == "boto3 floor":
            # The floor is the downloads alone (listing included), without starting Python and boto3.
            result["wall"], result["seconds"] = seconds, json.loads(out.stdout)["seconds"]
        return result


def store_ops(stats: Path) -> dict[str, int]:
    data = json.loads(stats.read_text())
    return {"metadata": data.get("metadata_ops", 0), "read": data.get("data_ops", 0)}


# ---------------------------------------------------------------------------------------------------------
# Summaries


def warm(job: dict[str, Any]) -> float:
    return statistics.mean(e["seconds"] for e in job["epochs"][1:])


def warm_cpu(job: dict[str, Any]) -> float:
    """CPU seconds of the job's processes in a warm epoch (bench/cpu.py): the load of this shared machine
    stretches wall time, not this."""
    return statistics.mean(e["cpu"] for e in job["epochs"][1:])


def paired(results: dict[str, list[Any]], over: str, under: str, measure: Any) -> list[float]:
    """measure(over) / measure(under), round by round (each round's jobs ran back to back)."""
    return [measure(a) / measure(b) for a, b in zip(results[over], results[under], strict=True)]


def per_object(jobs: list[dict[str, Any]], epochs: slice, objects: int) -> dict[str, float]:
    total: dict[str, int] = {}
    n = 0
    for j in jobs:
        for e in j["epochs"][epochs]:
            n += 1
            for k, v in e["requests"].items():
                total[k] = total.get(k, 0) + v
    return {k: v / n / objects for k, v in sorted(total.items())}


def kinds(d: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in d.items() if round(v, 2)) or "0"


def epoch_tables(
    results: dict[str, list[dict[str, Any]]], objects: int, dataset: int, against: str, what: str
) -> list[str]:
    """Epoch 1, warm epochs, requests and cache bytes, one table each."""
    present = [m for m in results if results[m]]
    lines = [
        "### Epoch 1 (a cold cache)",
        "",
        f"| setup | epoch 1 (s), median | each round (s) | time vs {against} (median of paired ratios) |",
        "| --- | ---: | --- | ---: |",
    ]
    for m in present:
        e1 = [j["epochs"][0]["seconds"] for j in results[m]]
        vs = "n/a"
        if results.get(against):
            vs = f"{statistics.median(paired(results, m, against, lambda j: j['epochs'][0]['seconds'])):.2f}x"
        lines.append(f"| {m} | {statistics.median(e1):.2f} | {', '.join(f'{s:.2f}' for s in e1)} | {vs} |")
    lines += [
        "",
        f"### Warm epochs (2-{len(results[present[0]][0]['epochs'])})",
        "",
        "Speed is the local copy's time over the setup's; CPU is the local copy's CPU seconds over the "
        "setup's, counting the job's processes only (a FUSE tool's daemon is not counted, so a mounted "
        "tool's CPU figure flatters it).",
        "",
        "| setup | warm epoch (s), median | speed vs local (median of paired ratios) | each round | CPU s, median | CPU vs local | each round |",
        "| --- | ---: | ---: | --- | ---: | ---: | --- |",
    ]
    for m in present:
        ratios = paired(results, "local", m, warm) if results.get("local") else []
        speed = f"{statistics.median(ratios):.2f}x" if ratios else "n/a"
        each = ", ".join(f"{r:.2f}x" for r in ratios)
        cpu = paired(results, "local", m, warm_cpu) if results.get("local") else []
        cpu_each = ", ".join(f"{r:.2f}x" for r in cpu)
        cpu_vs = f"{statistics.median(cpu):.2f}x" if cpu else "n/a"
        lines.append(
            f"| {m} | {statistics.median(warm(j) for j in results[m]):.3f} | {speed} | {each} | "
            f"{statistics.median(warm_cpu(j) for j in results[m]):.3f} | {cpu_vs} | {cpu_each} |"
        )
    lines += [
        "",
        f"### {what} per object per epoch, by kind",
        "",
        "| setup | epoch 1 | warm epochs |",
        "| --- | --- | --- |",
    ]
    for m in present:
        first = per_object(results[m], slice(0, 1), objects)
        later = per_object(results[m], slice(1, None), objects)
        lines.append(f"| {m} | {kinds(first)} | {kinds(later)} |")
    lines += [
        "",
        "### Cache size at the end of each job",
        "",
        "| setup | cache directory, median | of the dataset |",
        "| --- | ---: | ---: |",
    ]
    for m in present:
        held = statistics.median(j["cache"] for j in results[m])
        lines.append(
            f"| {m} | {human(held)} | {held / dataset:.2f}x |" if m != "local" else f"| {m} | n/a | n/a |"
        )
    return lines


def plot(results: dict[str, list[dict[str, Any]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [m for m in results if results[m]]
    e1 = [statistics.median(j["epochs"][0]["seconds"] for j in results[m]) for m in names]
    speed = [statistics.median(paired(results, "local", m, warm)) for m in names]
    colors = [
        "#2a9d8f" if m == "local" else "#1f77b4" if m.startswith("tierstore") else "#999999" for m in names
    ]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 0.45 * len(names) + 1.5), sharey=True)
    ys = range(len(names))
    a.barh(ys, e1, color=colors)
    labels = [f"{m} (default)" if m == DEFAULTS else m for m in names]
    a.set(title="epoch 1, cold (seconds, lower is better)", yticks=list(ys), yticklabels=labels)
    b.barh(ys, speed, color=colors)
    b.axvline(1.0, color="black", lw=0.8)
    b.set(title="warm epochs: speed vs the local copy (higher is better)", xscale="log")
    for y, (s, v) in enumerate(zip(e1, speed, strict=True)):
        a.text(s, y, f" {s:.1f}", va="center", fontsize=8)
        b.text(v, y, f" {v:.2f}x", va="center", fontsize=8)
    a.set_xlim(0, max(e1) * 1.15)
    b.set_xlim(min(speed) * 0.8, max(speed) * 1.6)
    a.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def versions(mounts: Mounts) -> list[str]:
    import tierstore

    def pkg(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    from tierstore.testing.s3server import weed_binary

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    tools = {
        "juicefs": ["juicefs", "--version"],
        "rclone": ["rclone", "version"],
        "s3fs": ["s3fs", "--version"],
    }
    lines = [f"- tierstore {tierstore.__version__} (commit {commit or '?'})"]
    for name, cmd in tools.items():
        path = binary(name)
        lines.append(f"- {name}: " + (f"`{first_line([path, *cmd[1:]])}`" if path else "not installed"))
    lines.append(f"- SeaweedFS: `{first_line([weed_binary(), 'version'])}`")
    lines.append(
        "- Python packages: "
        + ", ".join(f"{p} {pkg(p)}" for p in ("s3fs", "fsspec", "aiobotocore", "botocore", "boto3", "torch"))
    )
    return lines


# ---------------------------------------------------------------------------------------------------------


def run_rounds(
    bench: Bench, setups: list[Setup], rounds: int, skipped: dict[str, str], tasks_extra: list[str], **kw: Any
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[dict[str, Any]]]]:
    """Every setup (and warm-up) once a round, in a new order each round."""
    results: dict[str, list[dict[str, Any]]] = {s.name: [] for s in setups}
    warmups: dict[str, list[dict[str, Any]]] = {w: [] for w in tasks_extra}
    by_name = {s.name: s for s in setups}
    for r in range(rounds):
        order = [s.name for s in setups] + tasks_extra
        random.Random(r).shuffle(order)
        for name in order:
            if name in skipped:
                continue
            try:
                if name in warmups:
                    w = bench.warmup(name)
                    warmups[name].append(w)
                    print(f"round {r + 1} {name:>26}: {w['seconds']:.2f} s, {w['requests']}", flush=True)
                    continue
                job = bench.run(by_name[name], **kw)
            except Unavailable as e:
                skipped[name] = str(e)
                print(f"round {r + 1} {name:>26}: skipped: {e}", flush=True)
                continue
            results[name].append(job)
            secs = ", ".join(f"{e['seconds']:.2f}" for e in job["epochs"])
            print(
                f"round {r + 1} {name:>26}: epochs {secs} s; {[e['requests'] for e in job['epochs']]}",
                flush=True,
            )
    # A setup skipped after its first round has fewer rounds than the others: drop it from the pairing.
    for name, jobs in results.items():
        if name in skipped:
            jobs.clear()
    return results, warmups


def default_revalidate() -> str:
    """The revalidate a Cache with no setting gets here; the setups' names assume DEFAULT_MODE."""
    import tierstore

    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        (Path(d) / "src").mkdir()
        value, origin = tierstore.Cache(source=f"{d}/src", tiers=[f"{d}/tier:1M"]).config()["revalidate"]
    if (value, origin) != (DEFAULT_MODE, "default"):
        sys.exit(f'revalidate with no setting is {value!r} (from {origin}), not the default "{DEFAULT_MODE}" '
                 "the setups name: unset TIERSTORE_REVALIDATE and any configuration file's, or update MODES")  # fmt: skip
    return f'`("{value}", "{origin}")`'


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", type=int, default=2000)
    ap.add_argument("--small-size", type=size, default="128K")
    ap.add_argument("--large", type=int, default=2)
    ap.add_argument("--large-size", type=size, default="64M")
    ap.add_argument("--latency", type=float, default=0.010, help="seconds the proxy adds to each request")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3, help="epochs of each job: the first cold, the rest warm")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pfs-rounds", type=int, default=3, help="rounds of the POSIX source part (0: none)")
    ap.add_argument("--only", default="", help="comma-separated setups and warm-ups of the S3 part to run")
    ap.add_argument(
        "--quick", action="store_true", help="a smoke run: 200 small objects, 1 large of 16 MiB, 1 round"
    )
    ap.add_argument("--out", default="")
    ap.add_argument("--plot", default="")
    args = ap.parse_args()
    if args.quick:
        args.small, args.large, args.large_size, args.rounds = 200, 1, 16 << 20, 1
        args.pfs_rounds = min(args.pfs_rounds, 1)
    args.default_revalidate = default_revalidate()
    started = time.time()
    setups = [s for s in S3_SETUPS if not args.only or s.name in args.only.split(",")]
    extra = [w for w in WARMUPS if not args.only or w in args.only.split(",")]
    base = Path(tempfile.mkdtemp(prefix="bench-peers-", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    skipped: dict[str, str] = {}
    copy_in: dict[str, dict[str, Any]] = {}
    try:
        with S3Server(disk / "weed") as s3, LatencyProxy(s3.endpoint, args.latency) as proxy:
            bench = Bench(args, base, s3, proxy)
            try:
                print(
                    f"populating {args.small} x {human(args.small_size)} + {args.large} x {human(args.large_size)}"
                )
                bench.populate()
                tool_versions = versions(bench.mounts)
                storage = ["--storage", "s3", "--bucket", f"{proxy.endpoint}/{BUCKET}",
                           "--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY]  # fmt: skip
                try:
                    proxy.reset()
                    copy_in["s3"] = bench.mounts.juicefs_format("juicefs", 1, storage, bench.local)
                    copy_in["s3"]["requests"] = proxy.counts()
                except Unavailable as e:
                    skipped.update({"juicefs": str(e), "juicefs warmup": str(e)})
                results, warmups = run_rounds(bench, setups, args.rounds, skipped, extra)
                pfs_results: dict[str, list[dict[str, Any]]] = {}
                if args.pfs_rounds:
                    pfs_results = posix_part(bench, args, skipped, copy_in)
            finally:
                bench.mounts.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    text, checks = report(args, started, results, warmups, pfs_results, skipped, copy_in, tool_versions)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.plot and results.get("local"):
        plot(results, args.plot)
    return 0 if all(met == "yes" for _, met, _ in checks) else 1


def posix_part(
    bench: Bench, args: argparse.Namespace, skipped: dict[str, str], copy_in: dict[str, dict[str, Any]]
) -> dict[str, list[dict[str, Any]]]:
    """tierstore and JuiceFS with their data on the stand-in shared store (its default latencies)."""
    real, mnt = bench.base / "pfs-real", bench.base / "pfs"
    shutil.copytree(bench.local, real / "data")
    (real / "jfs").mkdir()
    with slowfs.mounted(real, mnt):
        pfs_skipped: dict[str, str] = {}
        try:
            copy_in["pfs"] = bench.mounts.juicefs_format(
                "juicefs-pfs", 2, ["--storage", "file", "--bucket", f"{mnt}/jfs/"], bench.local
            )
        except Unavailable as e:
            pfs_skipped["juicefs"] = str(e)
        results, _ = run_rounds(bench, PFS_SETUPS, args.pfs_rounds, pfs_skipped, [], source=str(mnt / "data"),
                                stats=mnt / ".slowfs-stats", volume="juicefs-pfs")  # fmt: skip
    skipped.update({f"posix: {k}": v for k, v in pfs_skipped.items()})
    return results


Check = tuple[str, str, str]  # (target, "yes" / "no" / "undecided", measured)


def verdict(ratios: list[float], ok: Any) -> str:
    """Met when every round's ratio meets the threshold, missed when none does, else undecided."""
    met = [ok(r) for r in ratios]
    return "yes" if all(met) else "no" if not any(met) else "undecided"


def targets(
    results: dict[str, list[dict[str, Any]]],
    warmups: dict[str, list[dict[str, Any]]],
    skipped: dict[str, str],
    fetches: int,
) -> list[Check]:
    """The issue's targets: (target, met, measured). One that could not be measured is not met."""
    ts = DEFAULTS
    ran = {m for m, jobs in results.items() if jobs}
    checks: list[Check] = []

    def missing(*names: str) -> str:
        return "not measured: " + "; ".join(f"{n} {skipped.get(n, 'not run')}" for n in names if n not in ran)

    def e1(j: dict[str, Any]) -> float:
        return j["epochs"][0]["seconds"]

    def ratio(name: str, over: str, under: str, measure: Any, ok: Any, text: str) -> None:
        """measure(over) / measure(under), round by round, against the target's threshold `ok`."""
        if {over, under} <= ran:
            r = paired(results, over, under, measure)
            checks.append((name, verdict(r, ok), text.format(page.rounds(r))))
        else:
            checks.append((name, "no", missing(over, under)))

    def ahead(name: str, peers: list[str], measure: Any) -> None:
        """tierstore's defaults ahead of every peer: each peer's time over tierstore's, round by round.

        Missed if one peer is behind in none of the rounds, undecided if one is ahead in some rounds only;
        the page names that peer, or the one with the smallest margin when every peer is behind."""
        if ts in ran and peers and set(peers) <= ran:
            margin = {p: paired(results, p, ts, measure) for p in peers}
            each = {p: verdict(margin[p], lambda r: r > 1.0) for p in peers}
            status = next((v for v in ("no", "undecided") if v in each.values()), "yes")
            near = min((p for p in peers if each[p] == status), key=lambda p: statistics.median(margin[p]))
            label = "smallest margin, " if status == "yes" else ""
            checks.append((name, status, f"{label}{near}: {page.rounds(margin[near])} tierstore's time"))
        else:
            checks.append((name, "no", missing(ts, *peers) if peers else "not measured: no peer was run"))

    peers = [m for m in results if m != "local" and not m.startswith("tierstore")]
    ahead("epoch 1 ahead of every peer (tierstore's defaults)", peers, e1)
    # Each revalidate mode apart: with "always" the open of a prefetched copy still asks the store (a HEAD).
    for r in MODES:
        setup = f"tierstore {r} +prefetch"
        default = ", the default" if r == DEFAULT_MODE else ""
        name = f'epoch 1 >= 3x JuiceFS CE\'s speed with sampler-aware prefetch (revalidate "{r}"{default})'
        ratio(name, "juicefs", setup, e1, lambda x: x >= 3.0, "JuiceFS's time {} tierstore's")
    ratio(f"epoch 1 of {ts} +auto within 1.15x of {ts} +prefetch (the order found by itself)", f"{ts} +prefetch",
          f"{ts} +auto", e1, lambda x: x >= 1 / 1.15, "the wrapper's time {} the hook's")  # fmt: skip
    ratio("epoch 1 ahead of JuiceFS CE without prefetch (tierstore's defaults)", "juicefs", ts, e1,
          lambda x: x > 1.0, "JuiceFS's time {} tierstore's")  # fmt: skip
    ratio("warm epochs >= 0.95x a local copy (tierstore's defaults)", "local", ts, warm,
          lambda x: x >= 0.95, "{}")  # fmt: skip
    ratio("warm epochs' CPU time at most 1/0.95 of a local copy's (tierstore's defaults)", "local", ts,
          warm_cpu, lambda x: x >= 0.95, "the local copy's CPU time {} tierstore's")  # fmt: skip
    ahead("warm epochs ahead of every peer, each with its defaults", PEER_DEFAULTS, warm)
    for m in ("tierstore never", "tierstore never +prefetch"):
        if m not in ran:
            checks.append((f"{m}: one fetch per object in epoch 1, none later", "no", missing(m)))
            continue
        first = [j["epochs"][0]["requests"] for j in results[m]]
        later = sum(sum(e["requests"].values()) for j in results[m] for e in j["epochs"][1:])
        ok = all(r == {"GET": fetches} for r in first) and later == 0
        mean = statistics.mean(sum(r.values()) for r in first)
        text = f"epoch 1 {mean / fetches:.2f} per fetch ({mean:.0f} requests, {fetches} fetches); later epochs {later}"
        checks.append((f"{m}: one fetch per object in epoch 1, none later", "yes" if ok else "no", text))
    name = "`tierstore prefetch` of the dataset at most the boto3 floor's time"
    if warmups.get("tierstore prefetch") and warmups.get("boto3 floor"):
        r = paired(warmups, "tierstore prefetch", "boto3 floor", lambda w: w["seconds"])
        checks.append((name, verdict(r, lambda x: x <= 1.0), f"{page.rounds(r)} the floor's time"))
    else:
        checks.append((name, "no", missing("tierstore prefetch", "boto3 floor")))
    return checks


def other_modes(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The default's targets as the other revalidate modes would meet them (no target is set on them)."""
    lines = []
    for m in (f"tierstore {r}" for r in MODES if r != DEFAULT_MODE):
        if not (results.get(m) and results.get(DEFAULTS) and results.get("local")):
            continue
        e1 = paired(results, m, DEFAULTS, lambda j: j["epochs"][0]["seconds"])
        local = paired(results, "local", m, warm)
        line = f"`{m}`: epoch 1 {page.rounds(e1)} the time of `{DEFAULTS}`; warm epochs {page.rounds(local)} a local copy"
        if all(results.get(p) for p in PEER_DEFAULTS):
            margin = {p: paired(results, p, m, warm) for p in PEER_DEFAULTS}
            near = min(margin, key=lambda p: statistics.median(margin[p]))
            line += f"; smallest warm margin over a peer's defaults, {near}: {page.rounds(margin[near])} tierstore's time"
        lines.append(line + ".")
    return lines


def report(
    args: argparse.Namespace,
    started: float,
    results: dict[str, list[dict[str, Any]]],
    warmups: dict[str, list[dict[str, Any]]],
    pfs: dict[str, list[dict[str, Any]]],
    skipped: dict[str, str],
    copy_in: dict[str, dict[str, Any]],
    tool_versions: list[str],
) -> tuple[str, list[Check]]:
    objects = args.small + args.large
    fetches = args.small + args.large * -(-args.large_size // RANGE)
    dataset = args.small * args.small_size + args.large * args.large_size
    checks = targets(results, warmups, skipped, fetches)
    lines = [
        "# tierstore beside its peers on one S3 store",
        "",
        f"Command: `{' '.join(['.venv/bin/python', *sys.argv])}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, {time.time() - started:.0f} s)",
        "",
    ]
    if args.out and args.plot:
        lines += [
            f"![epoch 1 and warm epochs per setup]({os.path.relpath(args.plot, Path(args.out).parent)})",
            "",
        ]
    lines += [
        "## Method",
        "",
        f"- The machine: {machine.describe()}, shared with other work; every setup and warm-up runs once a round, "
        f"{args.rounds} rounds, in a new order each round, and each comparison is the median of the rounds' "
        "ratios, each taken within one round.",
        f"- The store: SeaweedFS on loopback, every request through a proxy that adds {args.latency * 1000:.0f} ms "
        "and counts it by kind (a HEAD apart from a GET; LIST is a GET that lists).",
        f"- The dataset: {args.small} objects of {human(args.small_size)} and {args.large} of "
        f"{human(args.large_size)} ({human(dataset)}) under s3://bench/data/. Requests per object divide by "
        f"{objects} objects; tierstore fetches a large object as {human(RANGE)} ranges, so one fetch of the "
        f"dataset is {fetches} GETs.",
        f"- The job (`bench/s3_job.py`): {args.epochs} epochs of a DataLoader with {args.workers} persistent workers, the "
        "small objects one per sample (shuffled, batch 32), the large ones in 1 MiB records; it reads "
        "`open()`ed files of the local copy or of a tool's mount, `tierstore.Cache.open`, or fsspec's "
        f"`simplecache::s3://`. Warm epochs are epochs 2-{args.epochs}; each epoch's CPU time is that of the job's "
        "processes (the main one and its loader workers, bench/cpu.py).",
        "- Setups: `local` a copy on /dev/shm (the bar); `tierstore R` a tier on /dev/shm with revalidate R: "
        f'`{DEFAULT_MODE}` sets none and gets the default, "{DEFAULT_MODE}" (checked before the jobs: '
        f'`Cache.config()["revalidate"]` is {args.default_revalidate}), which trusts a copy confirmed within a minute and '
        "confirms it in the background after half of that; `always` asks the store at every open of a cached "
        "copy (one HEAD); `never` trusts a copy for good; `+prefetch` with `tierstore.torch.prefetching` (budget 1G); `juicefs` JuiceFS CE with its "
        "defaults and `--cache-dir` on /dev/shm, metadata in a redis-server on loopback; `rclone` "
        "`rclone mount --vfs-cache-mode full` and `rclone modtime` the same with `--use-server-modtime`; "
        "`s3fs-fuse` `s3fs -o use_cache`; `simplecache` fsspec's `simplecache::s3://` over s3fs. Every cache "
        "directory is on /dev/shm and empty when a job starts; every FUSE tool is mounted fresh before each "
        "job and unmounted after.",
    ]
    if "s3" in copy_in:
        c = copy_in["s3"]
        lines.append(
            f"- JuiceFS keeps files in its own chunked format, so it cannot read the objects as they are: the "
            f"dataset was copied in through a JuiceFS mount once, before the timed jobs ({c['files']} files, "
            f"{c['seconds']:.1f} s, requests {c['requests']}), into s3://bench/jfsvol/ on the same bucket. Only "
            "the jobs' own requests are counted."
        )
    lines += [
        "- Warm-up: the whole dataset into an empty cache. `tierstore prefetch s3://bench/data` and "
        "`juicefs warmup` of a fresh mount, timed as commands (start to exit); the floor is boto3 downloading "
        "every object from 32 threads (`bench/peers_job.py`, its own timer: the listing and the downloads, "
        "without starting Python).",
        "",
        "## Versions",
        "",
        *tool_versions,
        "",
        "## Targets",
        "",
        "| target | met | measured |",
        "| --- | --- | --- |",
        *[f"| {name} | {met} | {value} |" for name, met, value in checks],
        "",
        f'"tierstore\'s defaults" is `{DEFAULTS}`: no revalidate setting (the default, "{DEFAULT_MODE}"), no '
        f"prefetch. A peer's defaults are the setups {', '.join(f'`{p}`' for p in PEER_DEFAULTS)}. Time ratios "
        "are the other's time over tierstore's, the median of the rounds' paired ratios, each round's in "
        "parentheses. A target is met when every round's ratio meets it, missed when none does, and undecided "
        "when the rounds fall on both sides of its threshold.",
        *(["", "The other revalidate modes (no target is set on them):", ""] if other_modes(results) else []),
        *[f"- {line}" for line in other_modes(results)],
        "",
        "## An S3 source",
        "",
        *epoch_tables(results, objects, dataset, DEFAULTS, "Requests"),
        "",
        "### Warm-up of the whole dataset",
        "",
        "| warm-up | seconds, median | each round | time vs the boto3 floor | requests per object | cache |",
        "| --- | ---: | --- | ---: | --- | ---: |",
    ]
    for w, runs in warmups.items():
        if not runs:
            continue
        vs = "n/a"
        if warmups.get("boto3 floor"):
            vs = f"{statistics.median(paired(warmups, w, 'boto3 floor', lambda x: x['seconds'])):.2f}x"
        req = {k: v / len(runs) / objects for k, v in per_run_total(runs).items()}
        each = ", ".join(f"{x['seconds']:.2f}" for x in runs)
        lines.append(
            f"| {w} | {statistics.median(x['seconds'] for x in runs):.2f} | {each} | {vs} | {kinds(req)} | "
            f"{human(statistics.median(x['cache'] for x in runs))} |"
        )
    if warmups.get("boto3 floor"):
        walls = ", ".join(f"{x['wall']:.2f}" for x in warmups["boto3 floor"])
        lines += ["", f"The boto3 floor's command, start to exit, took {walls} s."]
    split = {w: [x["cpu"] for x in runs if "cpu" in x] for w, runs in warmups.items()}
    if any(split.values()):
        lines += [
            "",
            "CPU seconds during each warm-up (medians of the rounds): the command's processes, the proxy that "
            "holds each request 10 ms, SeaweedFS, and their sum against the two cores' seconds of its wall "
            "time. A sum near the cores' seconds says the machine, not the store's latency, set the pace.",
            "",
            "| warm-up | command | proxy | SeaweedFS | sum / (2 x wall) | command, each round |",
            "| --- | ---: | ---: | ---: | ---: | --- |",
        ]
        for w, cpus in split.items():
            if not cpus:
                continue
            runs = warmups[w]
            busy = statistics.median(
                sum(c.values()) / (2 * x.get("wall", x["seconds"])) for c, x in zip(cpus, runs, strict=True)
            )
            med = {k: statistics.median(c[k] for c in cpus) for k in ("command", "proxy", "store")}
            each = ", ".join(f"{c['command']:.2f}" for c in cpus)
            lines.append(
                f"| {w} | {med['command']:.2f} | {med['proxy']:.2f} | {med['store']:.2f} | {busy:.2f} | {each} |"
            )
    if pfs:
        lines += [
            "",
            "## A POSIX source: the stand-in shared store",
            "",
            "The same job over a directory of `tierstore.slowfs` (FUSE over /dev/shm, its defaults: 1 ms per "
            "metadata operation, 0.5 ms per read request, 500 MiB/s): tierstore with the directory as its "
            "source, and JuiceFS with its data on that store (`juicefs format --storage file --bucket "
            f"<the store>/jfs/`), {args.pfs_rounds} rounds. Operations are the store's own counters.",
        ]
        if "pfs" in copy_in:
            c = copy_in["pfs"]
            lines.append(f"JuiceFS's copy of the dataset was written through its mount before the jobs "
                         f"({c['files']} files, {c['seconds']:.1f} s).")  # fmt: skip
        lines += ["", *epoch_tables(pfs, objects, dataset, DEFAULTS, "Store operations")]
    if skipped:
        lines += ["", "## Not run", "", *[f"- {k}: {v}" for k, v in skipped.items()]]
    lines += [
        "",
        "## Each job",
        "",
        "Epoch seconds, then the requests (or store operations) of each epoch.",
        "",
    ]
    for part, res in (("S3", results), ("POSIX", pfs)):
        for m, jobs in res.items():
            for i, j in enumerate(jobs):
                secs = ", ".join(f"{e['seconds']:.3f}" for e in j["epochs"])
                lines.append(f"- {part} {m}, round {i + 1}: {secs}; {[e['requests'] for e in j['epochs']]}")
    for w, runs in warmups.items():
        for i, x in enumerate(runs):
            lines.append(f"- warm-up {w}, round {i + 1}: {x['seconds']:.3f} s; {x['requests']}")
    return "\n".join(lines) + "\n", checks


def per_run_total(runs: list[dict[str, Any]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for x in runs:
        for k, v in x["requests"].items():
            total[k] = total.get(k, 0) + v
    return dict(sorted(total.items()))


if __name__ == "__main__":
    sys.exit(main())
