"""Benchmark of model streaming (`tierstore.stream`) on one node, against the file-and-poll baseline.

One file of about 1,100 lines, on purpose: one benchmark's scenarios (updates, the trainer's overhead, the
process group, the 4 GB run), baselines and report read together, and no other script uses any of it.

A private agent; the publisher runs in this process, the consumer (a `HotModel` serving requests on one
thread) in another. Models: float32 tensors, 100 of them, totalling 100 MB and 1 GB (seeded random values).

Measured:
  notify      publish-to-notified: from the publisher sending its commit to the consumer's `on_update`
              callback (a 4 KiB model, 300 versions, 5 ms apart).
  update      same node, 3% of the bytes changed (3 of 100 tensors) and 100% changed: from `publish()` to the
              consumer serving the version (its swap), with the parts: placing (publisher), notified->served
              (consumer load + swap). Against a memcpy of the changed bytes, measured in this run. The
              3% update again with `publish(changed=[the 3 names])`: the other 97 tensors are compared at
              their head only. And the floor this machine sets: writing the changed bytes into new files
              in /dev/shm (pages touched for the first time, as every new version's are) plus a memcpy,
              and the blake3 of the changed bytes alone (every new tensor's file is named by it).
  bytes       of a 3%-changed update: the bytes the publisher placed and the bytes the consumer copied before
              its swap, as a share of the model.
  baseline    torch.save to the stand-in store (`tierstore.slowfs`, its defaults: 1 ms per metadata operation,
              0.5 ms per read request, 500 MiB/s) under a temporary name, renamed; the consumer polls the
              file's mtime every second and torch.loads it: from the start of the save to the load's end.
  trainer     a trainer's step time with `publish(sync=False)` after every step and history, in paired
              blocks against without, split into the snapshot, slower steps and waiting for a CPU.
  requests    request latency (a 256x256 matmul over one of the model's tensors) while 3%-changed updates
              arrive continuously, against steady state, in the consumer.

  --full      only full updates (every tensor changed) of one size, printed (not in the report): publish()
              to served and its parts, with the consumer idle and with it serving requests, alternated;
              and each round's floor: the model's two copies (written into allocated /dev/shm, read
              back), every core, without tierstore, with its blake3 alone beside them.
  --group     only this, printed (not in the report): 3%-changed updates, publish() to served, through a
              gloo process group of 2 against shared memory (two copies) and shared memory in place, in
              turn on the same versions; and the in-place mode's pause per update.

Usage: .venv/bin/python bench/bench_stream.py [--group 100MB] [--sizes 100MB,1GB] [--out docs/benchmarks/stream.md] [--plot docs/benchmarks/stream.png]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

import page
from tierstore.testing import slowfs
from units import human

PY = sys.executable
TENSORS = 100


def ms(x: float) -> str:
    return f"{x * 1e3:.2f} ms" if x < 0.1 else f"{x * 1e3:.0f} ms"


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def parse_size(text: str) -> int:
    t = text.upper().removesuffix("B")
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}
    return int(float(t[:-1]) * scale[t[-1]]) if t[-1] in scale else int(t)


def shapes(total: int) -> list[int]:
    """Element counts of TENSORS float32 tensors summing to about `total` bytes."""
    return [total // 4 // TENSORS] * TENSORS


def random_model(counts: list[int]) -> dict[str, np.ndarray]:
    """Float32 tensors t000, t001, ... of `counts` elements, the same seeded values every time."""
    rng = np.random.default_rng(0)
    return {f"t{i:03d}": rng.random(n, dtype=np.float32) for i, n in enumerate(counts)}


# ---------------------------------------------------------------------------------------------- consumer


def consumer_main(args: argparse.Namespace) -> None:
    """Runs in its own process: a HotModel over `args.name`, requests on a thread, events on stdout."""
    import torch

    from tierstore import stream

    torch.set_num_threads(1)
    out_lock = threading.Lock()

    def emit(obj: dict[str, Any]) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    counts = [int(x) for x in args.shapes.split(",")] if args.shapes else []
    model = {f"t{i:03d}": torch.zeros(n, dtype=torch.float32) for i, n in enumerate(counts)}
    group: dict[str, Any] = {}
    if args.group_port:
        import datetime

        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", args.group_port, is_master=False)
        dist.init_process_group(
            "gloo", store=store, rank=1, world_size=2, timeout=datetime.timedelta(seconds=60)
        )
        group = {"group": dist.group.WORLD, "src": 0}
    hot = stream.HotModel(model, args.name, mode=args.mode, **group)
    hot.subscriber.on_update(lambda v: emit({"event": "notified", "version": v.version, "t": time.time()}))
    hot.on_swap(
        lambda v, t: emit(
            {
                "event": "served",
                "version": v,
                "t": t,
                "copied": hot.bytes_copied,
                "swap": hot.last_swap_s,
                "pause": hot.last_pause_s,
                "received": hot.bytes_received,
                "shared": hot.bytes_shared,
            }
        )
    )
    stop = threading.Event()
    lat: list[tuple[float, float]] = []

    def requests() -> None:
        side = int(min(counts[0], 256 * 256) ** 0.5)
        x = torch.randn(side)
        while not stop.is_set():
            t0 = time.perf_counter()
            with hot.serving() as m:
                w = m["t000"][: side * side].view(side, side)
                (w @ x).sum()
            lat.append((time.time(), time.perf_counter() - t0))

    worker = threading.Thread(target=requests, daemon=True)
    if args.requests:
        worker.start()
    emit({"event": "ready"})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "latencies":
            emit({"event": "latencies", "lat": [(t, d) for t, d in lat if cmd["start"] <= t <= cmd["end"]]})
        elif cmd["cmd"] == "stop":
            break
    stop.set()
    # A daemon thread still inside torch when the interpreter exits ends the process in C++'s terminate().
    if worker.is_alive():
        worker.join(timeout=10)
    hot.close()


def poll_consumer_main(args: argparse.Namespace) -> None:
    """The baselines' consumer: polls a file's mtime every second; torch.load (or h5py) when it changes."""
    import torch

    def load(path: Path) -> dict[str, Any]:
        if args.format == "h5py":
            import h5py

            with h5py.File(path, "r") as f:
                return {k: torch.from_numpy(np.asarray(f[k][()])) for k in f}
        out: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
        return out

    path = Path(args.path)
    seen = 0.0
    print(json.dumps({"event": "ready"}), flush=True)
    while True:
        try:
            st = path.stat()
        except FileNotFoundError:
            st = None
        if st is not None and st.st_mtime != seen:
            seen = st.st_mtime
            sd = load(path)
            print(
                json.dumps({"event": "loaded", "step": int(sd["step"].item()), "t": time.time()}), flush=True
            )
            if int(sd["step"].item()) < 0:
                return
        time.sleep(1.0)


# ------------------------------------------------------------------------------------------------ runner


class Consumer:
    def __init__(
        self, argv: list[str], env: dict[str, str], prefix: list[str] | None = None, ready: bool = True
    ) -> None:
        self.proc = subprocess.Popen(
            [*(prefix or []), PY, __file__, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.events: list[dict[str, Any]] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        if ready:
            self.wait(lambda e: e["event"] == "ready", 120)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.cond:
                self.events.append(json.loads(line))
                self.cond.notify_all()

    def wait(self, pred: Any, timeout: float) -> dict[str, Any]:
        end = time.monotonic() + timeout
        with self.cond:
            while True:
                for e in self.events:
                    if pred(e):
                        return e
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the consumer did not report in time")
                self.cond.wait(left)

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        try:
            self.send({"cmd": "stop"})
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


@contextlib.contextmanager
def private_agent(base: Path, spares: bool = True) -> Iterator[dict[str, str]]:
    """A node agent of the benchmark's own under `base`, made every client's default (a client's socket is
    $XDG_RUNTIME_DIR/tierstore/agent.sock), stopped on the way out; yields the environment for children.
    `spares`: its `[stream] spares` (allocating the next publish's memory ahead)."""
    from tierstore import agent

    sock = base / "run" / "tierstore" / "agent.sock"
    os.environ["TIERSTORE_STREAM_SPARES"] = "true" if spares else "false"
    agent.start(sock, node="bench")
    os.environ["XDG_RUNTIME_DIR"] = str(sock.parent.parent)
    try:
        yield dict(os.environ)
    finally:
        agent.stop(sock)


def memcpy_time(nbytes: int, reps: int = 5) -> float:
    src = np.random.default_rng(1).random(nbytes // 8)
    dst = np.empty_like(src)
    best = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best.append(time.perf_counter() - t0)
    return statistics.median(best)


def hash_time(nbytes: int, reps: int = 5) -> float:
    """tierstore's blake3 (every core) of `nbytes`: what every changed tensor of a version costs before
    anything is written (its file is named by it). Median."""
    from tierstore import _core

    src = np.random.default_rng(3).random(nbytes // 8)
    took = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _core.hash_buffers([src.view(np.uint8)])
        took.append(time.perf_counter() - t0)
    return statistics.median(took)


def shm_floor_times(nbytes: int, reps: int = 5) -> tuple[float, float]:
    """The two steps of an update through shared memory, alone: writing `nbytes` into a new file in
    /dev/shm (a new version's pages are new: the one before is still served), and reading the file into a
    buffer the process has written before (the consumer's idle copy), as the consumer reads. Medians."""
    from tierstore import _core

    src = np.random.default_rng(2).random(nbytes // 8)
    dst = np.zeros_like(src)
    writes, reads = [], []
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="bench-stream-floor-") as d:
        for i in range(reps):
            path = Path(d) / str(i)
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                f.write(memoryview(src).cast("B"))
            t1 = time.perf_counter()
            _core.stream_read([path], [dst.view(np.uint8)])
            reads.append(time.perf_counter() - t1)
            writes.append(t1 - t0)
            path.unlink()
    return statistics.median(writes), statistics.median(reads)


def shm_allocation_times(nbytes: int, tensors: int = TENSORS, reps: int = 5) -> list[tuple[float, float]]:
    """What the kernel's allocation of new pages costs a publish, alone: writing `nbytes` as `tensors` files
    in /dev/shm that are new, then into files of the same sizes allocated before (`posix_fallocate`, as the
    agent's spares are), each rep: (new, allocated before) seconds."""
    piece = np.random.default_rng(3).integers(0, 255, nbytes // tensors, dtype=np.uint8)
    out = []
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="bench-stream-alloc-") as d:
        for r in range(reps):
            times = []
            for allocated in (False, True):
                paths = [Path(d) / f"{r}-{allocated}-{i}" for i in range(tensors)]
                if allocated:
                    for p in paths:
                        fd = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
                        os.posix_fallocate(fd, 0, piece.nbytes)
                        os.close(fd)
                t0 = time.perf_counter()
                for p in paths:
                    fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o600)
                    os.pwrite(fd, piece, 0)
                    os.close(fd)
                times.append(time.perf_counter() - t0)
                for p in paths:
                    p.unlink()
            out.append((times[0], times[1]))
    return out


def full_floor_times(total: int, reps: int = 5) -> list[tuple[float, float, float, float]]:
    """The work every full same-node update of a `total`-byte model must do, each step alone and on every
    core, without tierstore: hash the tensors (each new tensor's file is named by its blake3), copy them
    into files in /dev/shm allocated before (the agent's spares: the kernel's allocation is not counted),
    and copy those files into buffers written before (the consumer's idle copy). Each rep: (hash, write,
    read) seconds, and the CPU seconds the three took together (every thread of this process): what one
    core left free would need for the bytes alone."""
    from concurrent.futures import ThreadPoolExecutor

    from tierstore import _core

    counts = shapes(total)
    tensors = [a.view(np.uint8) for a in random_model(counts).values()]
    dests = [np.ones_like(t) for t in tensors]
    out = []
    with (
        tempfile.TemporaryDirectory(dir="/dev/shm", prefix="bench-stream-full-floor-") as d,
        ThreadPoolExecutor(os.cpu_count() or 1) as pool,
    ):
        for r in range(reps):
            paths = [Path(d) / f"{r}-{i}" for i in range(len(tensors))]
            fds = []
            for p, t in zip(paths, tensors, strict=True):
                fd = os.open(p, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
                os.posix_fallocate(fd, 0, t.nbytes)
                fds.append(fd)
            c0, t0 = time.process_time(), time.perf_counter()
            _core.hash_buffers(tensors)
            t1 = time.perf_counter()
            list(pool.map(lambda ft: os.pwrite(ft[0], ft[1], 0), zip(fds, tensors, strict=True)))
            t2 = time.perf_counter()
            _core.stream_read(paths, dests)
            t3, c3 = time.perf_counter(), time.process_time()
            for fd, p in zip(fds, paths, strict=True):
                os.close(fd)
                p.unlink()
            assert all(np.array_equal(a, b) for a, b in zip(tensors[:3], dests[:3], strict=False))
            out.append((t1 - t0, t2 - t1, t3 - t2, c3 - c0))
    return out


def notify_run(env: dict[str, str], n: int = 300) -> list[float]:
    from tierstore import stream

    c = Consumer(["--consumer", "--name", "tiny", "--shapes", "1024"], env)
    pub = stream.Publisher("tiny")
    a = {"t000": np.zeros(1024, dtype=np.float32)}
    sent: dict[int, float] = {}
    for i in range(1, n + 1):
        a["t000"][:] = i
        t_before = time.time()
        v = pub.publish(a)
        assert isinstance(v, stream.StreamVersion)
        sent[v.version] = pub.last_commit_sent or t_before
        time.sleep(0.005)
    c.wait(lambda e: e["event"] == "served" and e["version"] == n, 60)
    got = {e["version"]: e["t"] for e in c.events if e["event"] == "notified"}
    c.close()
    pub.close()
    return [got[v] - sent[v] for v in sent if v in got]


def update_run(total: int, env: dict[str, str], updates: int = 6, lean: bool = False) -> dict[str, Any]:
    """Same-node updates of a `total`-byte model (see the module's description). `lean`: for a model that
    fills memory, only the first full version and the 3%-changed ones, synchronous: no asynchronous
    publish (its staging buffer is another copy) and no further full update (each is another version in
    shared memory while the consumer still maps the one before)."""
    from tierstore import stream

    counts = shapes(total)
    model = random_model(counts)
    nbytes = sum(a.nbytes for a in model.values())
    c = Consumer(["--consumer", "--name", "m", "--shapes", ",".join(map(str, counts)), "--requests"], env)
    pub = stream.Publisher("m")
    res: dict[str, Any] = {"nbytes": nbytes, "full": [], "delta": [], "place_full": [], "place_delta": []}
    res |= {"hinted": [], "place_hinted": [], "load_hinted": [], "placed_hinted": [], "copied_hinted": []}
    res["load_delta"], res["load_full"], res["placed_delta"], res["copied_delta"], res["swap"] = (
        [],
        [],
        [],
        [],
        [],
    )

    def one(changed: int, key: str) -> None:
        names = [f"t{(i + 7 * len(res[key])) % TENSORS:03d}" for i in range(changed)]
        for k in names:
            model[k] += 1.0
        before = next((e["copied"] for e in reversed(c.events) if e["event"] == "served"), 0)
        t0 = time.time()
        if key == "async":
            fut = pub.publish(model, sync=False)
            res["async_block"].append(time.time() - t0)
            v = fut.result(timeout=300)  # type: ignore[union-attr]
        elif key == "hinted":
            v = pub.publish(model, changed=names)
        else:
            v = pub.publish(model)
        t1 = time.time()
        assert isinstance(v, stream.StreamVersion)
        served = c.wait(lambda e: e["event"] == "served" and e["version"] == v.version, 300)
        notified = c.wait(lambda e: e["event"] == "notified" and e["version"] == v.version, 10)
        res[key].append(served["t"] - t0)
        res["place_" + key].append(t1 - t0)
        res["load_" + key].append(served["t"] - notified["t"])
        res["swap"].append(served["swap"])
        if key in ("delta", "hinted"):
            res["placed_" + key].append(v.new_bytes)
            res["copied_" + key].append(served["copied"] - before)
        # Let the consumer bring its retired copy up to date, as between real updates.
        time.sleep(max(0.2, 3 * (served["t"] - notified["t"])))

    one(TENSORS, "full")  # first version: everything
    if not lean:
        one(TENSORS, "full")  # the other copy takes everything once
    steady_start = time.time()
    time.sleep(3.0)
    steady_end = time.time()
    upd_start = time.time()
    for _ in range(updates):
        one(3, "delta")
    upd_end = time.time()
    hint_start = time.time()
    for _ in range(updates):
        one(3, "hinted")
    hint_end = time.time()
    if not lean:
        res["async"], res["place_async"], res["load_async"], res["async_block"] = [], [], [], []
        one(3, "async")  # the first asynchronous publish fills the staging buffer
        res["async"], res["place_async"], res["load_async"], res["async_block"] = [], [], [], []
        for _ in range(updates):
            one(3, "async")
        for _ in range(2):
            one(TENSORS, "full")
    changed = 3 * counts[0] * 4
    res["memcpy_delta"] = memcpy_time(changed)
    res["shm_write_delta"], res["shm_read_delta"] = shm_floor_times(changed)
    res["hash_delta"] = hash_time(changed)
    if not lean:
        res["memcpy_full"] = memcpy_time(nbytes)
    res["changed_bytes"] = changed
    c.send({"cmd": "latencies", "start": steady_start, "end": steady_end})
    res["steady"] = [d for _, d in c.wait(lambda e: e["event"] == "latencies", 30)["lat"]]
    c.events = [e for e in c.events if e["event"] != "latencies"]
    c.send({"cmd": "latencies", "start": upd_start, "end": upd_end})
    res["during"] = [d for _, d in c.wait(lambda e: e["event"] == "latencies", 30)["lat"]]
    c.events = [e for e in c.events if e["event"] != "latencies"]
    c.send({"cmd": "latencies", "start": hint_start, "end": hint_end})
    res["during_hinted"] = [d for _, d in c.wait(lambda e: e["event"] == "latencies", 30)["lat"]]
    c.close()
    pub.close()
    return res


def group_run(total: int, env: dict[str, str], updates: int = 5) -> dict[str, Any]:
    """3%-changed updates, publish() to served, three ways in turn on the same versions: through a gloo
    process group of 2 (DistributedPublisher, HotModel(group=)), through shared memory (two copies), and
    through shared memory in place (one copy; its pause per update)."""
    import datetime

    import torch.distributed as dist

    from tierstore import stream

    counts = shapes(total)
    arg = ",".join(map(str, counts))
    store = dist.TCPStore("127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=False)
    g = Consumer(
        ["--consumer", "--name", "grp", "--shapes", arg, "--group-port", str(store.port)], env, ready=False
    )
    dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=datetime.timedelta(seconds=60))
    gpub = stream.DistributedPublisher("grp")  # collective with the consumer's HotModel
    g.wait(lambda e: e["event"] == "ready", 120)
    ways = {
        "group": (gpub, g),
        "shm": (stream.Publisher("shm"), Consumer(["--consumer", "--name", "shm", "--shapes", arg], env)),
        "in-place": (
            stream.Publisher("inp"),
            Consumer(["--consumer", "--name", "inp", "--shapes", arg, "--mode", "in-place"], env),
        ),
    }
    model = random_model(counts)
    res: dict[str, Any] = {"nbytes": sum(a.nbytes for a in model.values()), "pause": [], "received": []}
    res |= {k: [] for k in ways}
    for u in range(updates + 2):  # the first two versions fill both copies
        if u >= 2:
            for i in range(3):
                model[f"t{(i + 7 * u) % TENSORS:03d}"] += 1.0
        for key, (pub, c) in ways.items():
            t0 = time.time()
            v = pub.publish(model)
            assert isinstance(v, stream.StreamVersion)
            served = c.wait(lambda e, n=v.version: e["event"] == "served" and e["version"] == n, 300)
            if u >= 2:
                res[key].append(served["t"] - t0)
                if key == "in-place":
                    res["pause"].append(served["pause"])
                if key == "group":
                    res["received"].append(served["received"])
            time.sleep(0.2)
    res["changed_bytes"] = 3 * counts[0] * 4
    res["memcpy_delta"] = memcpy_time(res["changed_bytes"])
    for pub, c in ways.values():
        c.close()
        pub.close()
    dist.destroy_process_group()
    return res


def baseline_run(total: int, tmp: Path, updates: int = 3, fmt: str = "torch") -> list[float]:
    """torch.save (or h5py, one dataset per tensor) to the stand-in store, poll every second, load:
    from the start of the save to the end of the load."""
    import torch

    def save(sd: dict[str, Any], path: Path) -> None:
        if fmt == "h5py":
            import h5py

            with h5py.File(path, "w") as f:
                for k, v in sd.items():
                    f.create_dataset(k, data=v.numpy())
        else:
            torch.save(sd, path)

    backing = tmp / "pfs-backing"
    backing.mkdir(parents=True)
    with slowfs.mounted(backing, tmp / "pfs") as mnt:
        path = mnt / "model.pt"
        c = Consumer(["--poll-consumer", "--path", str(path), "--format", fmt], dict(os.environ))
        counts = shapes(total)
        rng = np.random.default_rng(0)
        sd = {f"t{i:03d}": torch.from_numpy(rng.random(n, dtype=np.float32)) for i, n in enumerate(counts)}
        out = []
        for step in range(1, updates + 1):
            sd["step"] = torch.tensor(step)
            t0 = time.time()
            save(sd, mnt / "model.pt.tmp")
            os.replace(mnt / "model.pt.tmp", path)
            e = c.wait(lambda e, s=step: e["event"] == "loaded" and e["step"] == s, 600)
            out.append(e["t"] - t0)
            time.sleep(1.3)
        sd = {"step": torch.tensor(-1)}
        save(sd, mnt / "model.pt.tmp")
        os.replace(mnt / "model.pt.tmp", path)
        c.proc.wait(timeout=60)
        return out


def cross_node_run(total: int, work: Path, fulls: int, deltas: int = 3) -> dict[str, Any]:
    """Publisher on node 0, a HotModel consumer on node 1 (network namespaces, the link shaped to 1 Gbit/s
    with tc tbf), Redis on node 0: publish -> served, and node 1's pull rate against iperf3 on the link."""
    from tierstore import stream
    from tierstore.testing.netns import Nodes, start_redis

    work.mkdir(parents=True)
    token = work / "token"
    token.write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
    token.chmod(0o600)
    res: dict[str, Any] = {"full": [], "delta": [], "full_rate": [], "delta_pulled": [], "nbytes": 0}
    with Nodes(2) as nodes:
        n0, n1 = nodes.nodes
        nodes.shape("1gbit")
        procs: list[subprocess.Popen[Any]] = []
        try:
            procs.append(start_redis(n0.address, 6390, node=n0))
            socks = []
            from tierstore import agent as agent_mod

            for i, n in enumerate((n0, n1)):
                sock = work / f"node{i}" / "tierstore" / "agent.sock"
                sock.parent.mkdir(parents=True)
                args = [*agent_mod.run_args(sock, node=f"node{i}"), "--listen", f"{n.address}:7078",
                        "--token-file", str(token), "--stream-redis", f"redis://{n0.address}:6390/"]  # fmt: skip
                log = work / f"node{i}" / "agent.log"
                a = subprocess.Popen(n.cmd(*args), stdout=subprocess.PIPE, stderr=open(log, "wb"))  # noqa: SIM115
                assert a.stdout is not None
                if not a.stdout.readline().startswith(b"ready"):
                    raise RuntimeError(f"the agent of node {i} did not start: {log.read_text()[-2000:]}")
                procs.append(a)
                socks.append(sock)
            # iperf3 in the direction tensors go: node 0 sends (-R), node 1 receives.
            srv = subprocess.Popen(n0.cmd("iperf3", "-s", "-1", "-B", n0.address), stdout=subprocess.DEVNULL)
            time.sleep(0.5)
            out = subprocess.run(
                n1.cmd("iperf3", "-c", n0.address, "-R", "-t", "4", "-J"),
                capture_output=True,
                text=True,
                timeout=60,
            )
            srv.wait(timeout=20)
            res["iperf_bps"] = float(json.loads(out.stdout)["end"]["sum_received"]["bits_per_second"])
            counts = shapes(total)
            model = random_model(counts)
            res["nbytes"] = sum(a.nbytes for a in model.values())
            env = {**os.environ, "XDG_RUNTIME_DIR": str(socks[1].parent.parent)}
            c = Consumer(["--consumer", "--name", "x", "--shapes", ",".join(map(str, counts))], env, n1.cmd())
            pub = stream.Publisher("x", socket=socks[0])

            def pulled() -> int:
                s = stream.streams(socks[1])["streams"]
                return int(s[0]["pulled_bytes"]) if s else 0

            def one(changed: int, key: str) -> None:
                for i in range(changed):
                    model[f"t{(i + 7 * len(res[key])) % TENSORS:03d}"] += 1.0
                before = pulled()
                t0 = time.time()
                v = pub.publish(model)
                assert isinstance(v, stream.StreamVersion)
                committed = pub.last_commit_sent or t0
                served = c.wait(lambda e: e["event"] == "served" and e["version"] == v.version, 600)
                moved = pulled() - before
                res[key].append(served["t"] - t0)
                if key == "full":
                    res["full_rate"].append(moved * 8 / (served["t"] - committed))
                else:
                    res["delta_pulled"].append(moved)
                time.sleep(0.5)

            for _ in range(fulls):
                one(TENSORS, "full")
            for _ in range(deltas):
                one(3, "delta")
            res["changed_bytes"] = 3 * counts[0] * 4
            c.close()
            pub.close()
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
            nodes.unshape()
    return res


def thread_sched() -> tuple[float, float]:
    """The calling thread's CPU time and its time waiting for a CPU (run queue), in seconds, from
    /proc/thread-self/schedstat: what tells a slower step from one that was kept off its core."""
    run, delay, _ = Path("/proc/thread-self/schedstat").read_text().split()
    return int(run) / 1e9, int(delay) / 1e9


def trainer_run(total: int, work: Path, matmuls: int, pairs: int = 5, per_block: int = 10) -> dict[str, Any]:
    """A trainer's step time (a fixed amount of compute, then every parameter changed) without publishing,
    and with `publish(sync=False)` every step plus every 10th version saved to a Repository. Paired, as the
    machine drifts: blocks of `per_block` steps alternate, without and with, each pair in the other order
    from the pair before; a block with publishing ends when its last version is placed and its history
    saved (that wait counts as the block's), so no background work spills into the block after. Per block
    also the trainer thread's CPU time and its wait for a CPU, which split the overhead into the snapshot,
    a slower step (caches and memory shared with the background work) and a step kept off its core."""
    import torch

    from tierstore import stream
    from tierstore.models import Repository

    torch.set_num_threads(1)
    counts = shapes(total)
    params = [torch.rand(n) for n in counts]
    a, b = torch.rand(384, 384), torch.rand(384, 384)

    def step() -> None:
        for _ in range(matmuls):
            a.copy_(torch.tanh(a @ b))
        for p in params:
            p.add_(1e-3)

    pub = stream.Publisher(f"trainer{matmuls}", history=Repository(work / "history"), history_every=10)
    plain: list[float] = []
    with_publish: list[float] = []
    blocked: list[float] = []
    ratios: list[float] = []
    step_ratios: list[float] = []
    # Per pair, as a share of the block without publishing: the time blocked in publish(), the trainer
    # thread's extra CPU time outside it, and its extra wait for a CPU.
    parts: dict[str, list[float]] = {"blocked": [], "cpu": [], "wait": []}
    for k in range(pairs):
        block: dict[bool, float] = {}
        steps: dict[bool, float] = {}
        cpu: dict[bool, float] = {}
        wait: dict[bool, float] = {}
        stalled = in_publish_cpu = in_publish_wait = 0.0
        for publishing in (False, True) if k % 2 == 0 else (True, False):
            b0 = time.perf_counter()
            c0, w0 = thread_sched()
            took_steps = 0.0
            for _ in range(per_block):
                t0 = time.perf_counter()
                step()
                if publishing:
                    t1, (c2, w2) = time.perf_counter(), thread_sched()
                    pub.publish({f"t{i:03d}": p for i, p in enumerate(params)}, sync=False)
                    blocked.append(time.perf_counter() - t1)
                    stalled += blocked[-1]
                    c3, w3 = thread_sched()
                    in_publish_cpu += c3 - c2
                    in_publish_wait += w3 - w2
                took = time.perf_counter() - t0
                took_steps += took
                (with_publish if publishing else plain).append(took)
            c1, w1 = thread_sched()
            if publishing:
                pub.flush()
                pub.flush_history()
            block[publishing] = time.perf_counter() - b0
            steps[publishing], cpu[publishing], wait[publishing] = took_steps, c1 - c0, w1 - w0
            if publishing:  # the steps' part alone: publish() is counted as blocked
                cpu[True] -= in_publish_cpu
                wait[True] -= in_publish_wait
        ratios.append(block[True] / block[False])
        step_ratios.append(steps[True] / steps[False])
        parts["blocked"].append(stalled / steps[False])
        parts["cpu"].append((cpu[True] - cpu[False]) / steps[False])
        parts["wait"].append((wait[True] - wait[False]) / steps[False])
    pub.close()
    return {
        "plain": plain,
        "publish": with_publish,
        "blocked": blocked,
        "ratios": ratios,
        "step_ratios": step_ratios,
        "parts": parts,
        "flushed": len(pub.flushed),
        "flush_skipped": pub.flush_skipped,
        "steps": pairs * per_block,
        "pairs": pairs,
        "per_block": per_block,
        "matmuls": matmuls,
        "nbytes": sum(p.numel() * 4 for p in params),
    }


def median_pct(xs: list[float]) -> str:
    return f"{statistics.median(xs):+.1%}"


def trainer_line(t: dict[str, Any]) -> str:
    parts = t["parts"]
    return (
        f"trainer, {t['matmuls']} matmuls: step p50 {ms(statistics.median(t['plain']))} without, "
        f"{ms(statistics.median(t['publish']))} with publish; overhead, steps alone "
        f"{median_pct([r - 1 for r in t['step_ratios']])} (blocks {median_pct([r - 1 for r in t['ratios']])}): "
        f"blocked {median_pct(parts['blocked'])}, slower steps {median_pct(parts['cpu'])}, "
        f"waiting for a CPU {median_pct(parts['wait'])}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--consumer", action="store_true")
    ap.add_argument("--poll-consumer", action="store_true")
    ap.add_argument("--name", default="m")
    ap.add_argument("--shapes", default="")
    ap.add_argument("--path", default="")
    ap.add_argument("--format", default="torch")
    ap.add_argument("--requests", action="store_true")
    ap.add_argument("--sizes", default="100MB,1GB")
    ap.add_argument("--baseline-updates", type=int, default=3)
    ap.add_argument(
        "--rounds", type=int, default=3, help="rounds of the same-node updates and their baselines, paired"
    )
    ap.add_argument("--cross-sizes", default="100MB,1GB", help="model sizes across nodes (needs root)")
    ap.add_argument("--trainer-size", default="100MB")
    ap.add_argument(
        "--trainer-only", action="store_true", help="only the trainer's step overhead, printed (no report)"
    )
    ap.add_argument("--out", default="docs/benchmarks/stream.md")
    ap.add_argument("--plot", default="docs/benchmarks/stream.png")
    ap.add_argument("--mode", default="double", help="a consumer's HotModel mode")
    ap.add_argument("--group-port", type=int, default=0, help="a consumer: the gloo group's TCP store")
    ap.add_argument(
        "--group", default="", help="only the process-group and in-place comparison, at these sizes"
    )
    ap.add_argument(
        "--full",
        default="",
        help="only full updates of a model of this size, the consumer idle and serving requests, printed",
    )
    ap.add_argument(
        "--large",
        default="",
        help="only a model that fills memory (e.g. 4GB), lean (see update_run), with the torch.save and h5py "
        "baselines; its report goes to --out",
    )
    args = ap.parse_args()
    args.started = time.time()
    if args.consumer:
        consumer_main(args)
        return
    if args.poll_consumer:
        poll_consumer_main(args)
        return
    command = "python bench/bench_stream.py " + " ".join(sys.argv[1:])
    if args.group:
        group_main(args.group)
        return
    if args.full:
        full_main(args.full, args.rounds)
        return
    if args.large:
        large_main(args, command)
        return
    if args.trainer_only:
        with tempfile.TemporaryDirectory(prefix="bench-stream-") as d, private_agent(Path(d)) as env:
            os.environ.update(env)
            for k in (40, 400):
                print(trainer_line(trainer_run(parse_size(args.trainer_size), Path(d) / f"trainer{k}", k)))
        return
    with tempfile.TemporaryDirectory(prefix="bench-stream-") as d:
        tmp = Path(d)
        with private_agent(tmp) as env:
            notify = notify_run(env)
            print(f"notify p50 {ms(pct(notify, 0.5))} p99 {ms(pct(notify, 0.99))}", flush=True)
            results = {}
            for size in args.sizes.split(","):
                total = parse_size(size)
                rounds = []
                for i in range(args.rounds):
                    # A round: tierstore's updates and both baselines, back to back (every other round the
                    # baselines first); each round's ratios compare its own runs.
                    r: dict[str, Any] = {}
                    for part in ("tierstore", "baselines") if i % 2 == 0 else ("baselines", "tierstore"):
                        if part == "tierstore":
                            r |= update_run(total, env)
                        else:
                            tag = f"{total}-{i}"
                            r["baseline"] = baseline_run(total, tmp / f"b{tag}", args.baseline_updates)
                            r["baseline_h5"] = baseline_run(
                                total, tmp / f"h{tag}", args.baseline_updates, "h5py"
                            )
                    rounds.append(r)
                    print(
                        f"{size} round {i}: delta p50 {ms(statistics.median(r['delta']))}, torch.save+poll+load "
                        f"p50 {ms(statistics.median(r['baseline']))}",
                        flush=True,
                    )
                r = merge_rounds(rounds)
                results[size] = r
                print(
                    f"{size}: delta update p50 {ms(statistics.median(r['delta']))} "
                    f"(memcpy of the changed bytes {ms(r['memcpy_delta'])}), full {ms(statistics.median(r['full']))}, "
                    f"baseline {ms(statistics.median(r['baseline']))}",
                    flush=True,
                )
            trainer = [trainer_run(parse_size(args.trainer_size), tmp / f"trainer{k}", k) for k in (40, 400)]
            for t in trainer:
                print(trainer_line(t), flush=True)
        cross: dict[str, Any] = {}
        if os.geteuid() == 0 and args.cross_sizes:
            for size in args.cross_sizes.split(","):
                total = parse_size(size)
                cross[size] = cross_node_run(total, tmp / f"x{total}", fulls=2 if total < 5e8 else 1)
                print(f"{size} across nodes: {cross[size]}"[:300], flush=True)
    write_report(args, command, notify, results, cross, trainer)


def large_main(args: argparse.Namespace, command: str) -> None:
    """A model of `args.large` bytes, same node: the lean update run, then the baselines (one after the
    other, so that at most the publisher's model, one version in shared memory and the consumer's two
    copies are in memory at once)."""
    total = parse_size(args.large)
    with tempfile.TemporaryDirectory(prefix="bench-stream-") as d:
        tmp = Path(d)
        with private_agent(tmp) as env:
            r = update_run(total, env, lean=True)
        base = baseline_run(total, tmp / "b", args.baseline_updates)
        h5 = baseline_run(total, tmp / "h", args.baseline_updates, "h5py")
    n = r["nbytes"]
    delta, place, load = (statistics.median(r[k]) for k in ("delta", "place_delta", "load_delta"))
    hinted, hplace, hload = (statistics.median(r[k]) for k in ("hinted", "place_hinted", "load_hinted"))
    floor = r["shm_write_delta"] + r["shm_read_delta"]
    first = r["full"][0]
    placed, copied = statistics.median(r["placed_delta"]), statistics.median(r["copied_delta"])
    steady, during = r["steady"], r["during"]
    lines = [
        f"# Model streaming: a {args.large} model on one node",
        "",
        f"Command: `{command}`.",
        "",
        f"Machine: {os.cpu_count()} cores, Linux {platform.release()}; load average at the end "
        f"{os.getloadavg()[0]:.1f} (the machine is shared). The same publisher, consumer (`HotModel`, double-"
        f"buffered, requests on one thread) and baselines as [the 100 MB and 1 GB runs](stream.md), with a model of {TENSORS} "
        f"float32 tensors, {human(n)} in all. Lean, so that it fits this machine's 24 GiB beside its "
        "baselines: the first version (everything new, into empty copies), then "
        f"{len(r['delta'])} updates with 3% of the bytes changed, all synchronous; the baselines run after, "
        "one at a time.",
        "",
        "| | publish->served | place | notified->served | against |",
        "| --- | --- | --- | --- | --- |",
        f"| first version | {ms(first)} | {ms(r['place_full'][0])} | {ms(r['load_full'][0])} | |",
        f"| 3% changed, p50 | {ms(delta)} | {ms(place)} | {ms(load)} | memcpy of the changed bytes "
        f"{ms(r['memcpy_delta'])}: publish->served {delta / r['memcpy_delta']:.1f}x, notified->served "
        f"{load / r['memcpy_delta']:.1f}x |",
        f"| 3% changed, `changed=` hint, p50 | {ms(hinted)} | {ms(hplace)} | {ms(hload)} | memcpy: "
        f"publish->served {hinted / r['memcpy_delta']:.1f}x; the floor (writing the changed bytes into new "
        f"/dev/shm pages {ms(r['shm_write_delta'])}, reading them into a buffer {ms(r['shm_read_delta'])}): "
        f"{hinted / floor:.2f}x; blake3 of the changed bytes alone (every core) {ms(r['hash_delta'])}, "
        f"{r['hash_delta'] / r['memcpy_delta']:.1f}x the memcpy |",
        f"| torch.save + poll 1 s + torch.load, p50 of {len(base)} | {ms(statistics.median(base))} | | | "
        f"{statistics.median(base) / delta:.1f}x the 3% update, {statistics.median(base) / first:.1f}x the first "
        "version |",
        f"| h5py + poll 1 s + h5py read, p50 of {len(h5)} | {ms(statistics.median(h5))} | | | "
        f"{statistics.median(h5) / delta:.1f}x the 3% update, {statistics.median(h5) / first:.1f}x the first "
        "version |",
        "",
        f"A 3%-changed update: the publisher placed {human(placed)} ({placed / n:.1%} of the model), the consumer "
        f"copied {human(copied)} ({copied / n:.1%}) before its swap. With the hint: "
        f"{human(statistics.median(r['placed_hinted']))} and {human(statistics.median(r['copied_hinted']))}.",
        "",
        f"Requests (a 256x256 matmul over a model tensor): steady p50 {pct(steady, 0.5) * 1e6:.0f} us, p99 "
        f"{pct(steady, 0.99) * 1e6:.0f} us ({len(steady)} requests); during the updates p50 "
        f"{pct(during, 0.5) * 1e6:.0f} us, p99 {pct(during, 0.99) * 1e6:.0f} us ({len(during)}): p99 "
        f"{pct(during, 0.99) / pct(steady, 0.99):.2f}x steady; during the hinted updates p99 "
        f"{pct(r['during_hinted'], 0.99) * 1e6:.0f} us ({len(r['during_hinted'])}): "
        f"{pct(r['during_hinted'], 0.99) / pct(steady, 0.99):.2f}x steady; swap at most "
        f"{max(r['swap']) * 1e6:.1f} us.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


def group_main(sizes: str) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-stream-") as d, private_agent(Path(d)) as env:
        for size in sizes.split(","):
            r = group_run(parse_size(size), env)
            grp, shm, inp = (statistics.median(r[k]) for k in ("group", "shm", "in-place"))
            print(
                f"{size} ({human(r['nbytes'])}), 3% changed ({human(r['changed_bytes'])}; memcpy "
                f"{ms(r['memcpy_delta'])}), publish() to served, median of {len(r['group'])}: "
                f"gloo group {ms(grp)} ({grp / shm:.2f}x shared memory), shared memory {ms(shm)}, "
                f"in place {ms(inp)} ({inp / shm:.2f}x), in-place pause p50 "
                f"{ms(statistics.median(r['pause']))} max {ms(max(r['pause']))}",
                flush=True,
            )


def full_run(total: int, env: dict[str, str], requests: bool, updates: int = 4) -> list[dict[str, float]]:
    """Full updates of a `total`-byte model (every tensor changed), same node, the consumer serving requests
    on its thread or idle: for each, publish() to served and its two parts, and the CPU seconds this
    process (the publisher) spent in publish()."""
    from tierstore import stream

    counts = shapes(total)
    model = random_model(counts)
    argv = ["--consumer", "--name", "m", "--shapes", ",".join(map(str, counts))]
    c = Consumer([*argv, "--requests"] if requests else argv, env)
    pub = stream.Publisher("m")
    out = []
    for i in range(updates + 2):  # the first two fill the consumer's two copies
        for a in model.values():
            a += 1.0
        t0, c0 = time.time(), time.process_time()
        v = pub.publish(model)
        t1, c1 = time.time(), time.process_time()
        assert isinstance(v, stream.StreamVersion) and v.new_bytes == total
        served = c.wait(lambda e, n=v.version: e["event"] == "served" and e["version"] == n, 300)
        notified = c.wait(lambda e, n=v.version: e["event"] == "notified" and e["version"] == n, 10)
        if i >= 2:
            out.append(
                {
                    "served": served["t"] - t0,
                    "place": t1 - t0,
                    "load": served["t"] - notified["t"],
                    "place_cpu": c1 - c0,
                }
            )
        time.sleep(max(0.2, 3 * (served["t"] - notified["t"])))
    c.close()
    pub.close()
    return out


def full_main(size: str, rounds: int) -> None:
    """`--full`: full updates with the consumer idle and serving, alternated, each round printed; in every
    round with the agent's spares (`[stream] spares`, the default) and without them, in alternating order,
    and each round's ratio of the two."""
    total = parse_size(size)
    print(f"memcpy of {size}: {ms(memcpy_time(total))}", flush=True)
    alloc = shm_allocation_times(total)
    print(
        f"writing {size} as {TENSORS} files in /dev/shm, new / allocated before, each rep: "
        + ", ".join(f"{ms(a)} / {ms(b)}" for a, b in alloc),
        flush=True,
    )
    p50s: dict[tuple[bool, bool], list[dict[str, float]]] = {}
    floors: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-stream-") as d:
        for r in range(rounds):
            steps = full_floor_times(total)
            floor = statistics.median(w + rd for _, w, rd, _ in steps)
            floors.append(floor)
            print(
                f"round {r + 1} floor, the model's two copies (written into allocated /dev/shm, read back; "
                f"every core, no tierstore): {ms(floor)}; with its blake3, CPU "
                f"{statistics.median(c for *_, c in steps) * 1e3:.0f} ms; each rep blake3 + write + read: "
                + ", ".join(f"{ms(h)} + {ms(w)} + {ms(rd)} ({c * 1e3:.0f} ms CPU)" for h, w, rd, c in steps),
                flush=True,
            )
            for spares in (True, False) if r % 2 == 0 else (False, True):
                with private_agent(Path(d) / f"{r}-{spares}", spares=spares) as env:
                    for requests in (False, True) if r % 2 == 0 else (True, False):
                        runs = full_run(total, env, requests)
                        p50 = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
                        p50s.setdefault((spares, requests), []).append(p50)
                        print(
                            f"round {r + 1} {'spares   ' if spares else 'no spares'} "
                            f"{'serving' if requests else 'idle   '}: publish->served p50 "
                            f"{ms(p50['served'])} (each: {', '.join(ms(x['served']) for x in runs)}), place "
                            f"{ms(p50['place'])} ({p50['place_cpu'] * 1e3:.0f} ms of the publisher's CPU), "
                            f"notified->served {ms(p50['load'])}",
                            flush=True,
                        )
    for requests in (False, True):
        on, off = p50s[(True, requests)], p50s[(False, requests)]
        over = [a["served"] / f for a, f in zip(on, floors, strict=True)]
        print(
            f"{'serving' if requests else 'idle'}: publish->served with spares / that round's two copies, each "
            f"round: {statistics.median(over):.2f}x ({', '.join(f'{x:.2f}' for x in over)})",
            flush=True,
        )
        for key, what in (("served", "publish->served"), ("place_cpu", "the publisher's CPU")):
            ratios = [b[key] / a[key] for a, b in zip(on, off, strict=True)]
            print(
                f"{'serving' if requests else 'idle'}: {what} without spares / with them, each round: "
                f"{statistics.median(ratios):.2f}x ({', '.join(f'{x:.2f}' for x in ratios)}); with spares "
                f"p50 {', '.join(ms(a[key]) if key == 'served' else f'{a[key] * 1e3:.0f} ms' for a in on)}",
                flush=True,
            )


def merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds of one size as one result: every sample of every round, the median of the single
    measurements (memcpy, hashing), and the rounds themselves (for the per-round ratios)."""
    out: dict[str, Any] = {"rounds": rounds}
    for k, v in rounds[0].items():
        if isinstance(v, list):
            out[k] = [x for r in rounds for x in r[k]]
        else:
            out[k] = statistics.median(r[k] for r in rounds)
    return out


def per_round(r: dict[str, Any], base: str, key: str) -> list[float]:
    """Each round's p50 of `base` over its p50 of `key`: how many times sooner tierstore served."""
    return [statistics.median(x[base]) / statistics.median(x[key]) for x in r["rounds"]]


def write_report(
    args: argparse.Namespace,
    command: str,
    notify: list[float],
    results: dict[str, Any],
    cross: dict[str, Any],
    trainer: list[dict[str, Any]],
) -> None:
    lines = [
        "# Model streaming: same-node updates against memcpy and against file-and-poll",
        "",
        f"Command: `{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(args.started))}, "
        f"{time.time() - args.started:.0f} s).",
        "",
        f"Machine: {os.cpu_count()} cores, {platform.machine()}, Linux {platform.release()}, Python "
        f"{platform.python_version()}; load average at the end {os.getloadavg()[0]:.1f} (the machine is shared). Publisher in the benchmark's process, consumer (`HotModel`, requests on "
        f"one thread, torch with 1 thread) in another, one agent; models of {TENSORS} float32 tensors. "
        "Every figure below was measured in this one run; ratios are against baselines of the same run.",
        "",
        "## Publish to notified",
        "",
        f"From the publisher sending its commit to the consumer's `on_update` callback, {len(notify)} versions of a "
        f"4 KiB model 5 ms apart: p50 **{ms(pct(notify, 0.5))}**, p99 **{ms(pct(notify, 0.99))}**, "
        f"max {ms(max(notify))}.",
        "",
        "## Update latency, same node",
        "",
        "From `publish()` to the consumer serving the version (its swap). `place` is the publisher's part "
        "(compare with the version before, hash and write what changed, commit); `notified->served` is the "
        "consumer's (read the changed tensors into its idle copy, swap). memcpy: one copy of the changed "
        "bytes in this process. Baselines, through the stand-in store (`tierstore.slowfs`, its defaults): torch.save + poll every 1 s + torch.load (how Triton and TF-Serving pick up versions), and h5py (one dataset per tensor) + poll + h5py read (Viper's baseline).",
        "",
        "| model | change | publish->served p50 | place p50 | notified->served p50 | memcpy of changed bytes | "
        "notified->served / memcpy | publish->served / memcpy | torch.save+poll+load p50 | / tierstore | "
        "h5py+poll+load p50 | / tierstore |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for size, r in results.items():
        base = statistics.median(r["baseline"])
        h5 = statistics.median(r["baseline_h5"])
        for key, label, mc in (
            ("delta", "3% (3 of 100 tensors)", "memcpy_delta"),
            ("hinted", "3%, `changed=` the 3", "memcpy_delta"),
            ("async", "3%, `sync=False`", "memcpy_delta"),
            ("full", "100%", "memcpy_full"),
        ):
            e2e, place, load = (statistics.median(r[k]) for k in (key, "place_" + key, "load_" + key))
            lines.append(
                f"| {size} | {label} | {ms(e2e)} | {ms(place)} | {ms(load)} | {ms(r[mc])} | {load / r[mc]:.1f}x | "
                f"{e2e / r[mc]:.1f}x | {ms(base)} | {page.rounds(per_round(r, 'baseline', key))} | {ms(h5)} | "
                f"{page.rounds(per_round(r, 'baseline_h5', key))} |"
            )
    lines += [
        "",
        f"{args.rounds} rounds per size, each round tierstore's updates and both baselines back to back (every "
        "other round the baselines first); a round: "
        + ", ".join(
            f"{s}: {len(r['rounds'][0]['baseline'])} baseline runs of each" for s, r in results.items()
        )
        + "; "
        "tierstore: 6 updates of 3% (sync), 6 of 3% with the hint, 6 of 3% (`sync=False`), 4 of 100% per size. "
        "Times: p50 of every round's runs together; \"/ tierstore\": each round's baseline p50 over its tierstore "
        "p50, their median first, then every round's. In a `sync=False` "
        "publish the trainer waits only for the snapshot into the staging buffer (compared as it copies): "
        + ", ".join(f"{s}: {ms(statistics.median(r['async_block']))}" for s, r in results.items())
        + "; `place` is then the background part.",
        "",
        "The floor this machine sets on a same-node update through shared memory: the publisher writes the "
        "changed bytes into new pages of /dev/shm (the version before is still served from its own), and the "
        "consumer reads them into its idle copy. Each step alone, in this process (write + read), and the "
        "hinted update's publish->served against their sum: "
        + ", ".join(
            f"{s}: {ms(r['shm_write_delta'])} + {ms(r['shm_read_delta'])}, "
            f"{statistics.median(r['hinted']) / (r['shm_write_delta'] + r['shm_read_delta']):.2f}x"
            for s, r in results.items()
        )
        + ". And the blake3 every changed tensor needs before it is written (its file is named by it), "
        "alone, on every core, against the memcpy: "
        + ", ".join(
            f"{s}: {ms(r['hash_delta'])}, {r['hash_delta'] / r['memcpy_delta']:.1f}x"
            for s, r in results.items()
        )
        + ".",
        "",
        "## Bytes moved by a 3%-changed update",
        "",
        "| model | changed | hint | placed by the publisher | copied by the consumer before its swap |",
        "| --- | --- | --- | --- | --- |",
    ]
    for size, r in results.items():
        n = r["nbytes"]
        for key, hint in (("delta", "none"), ("hinted", "`changed=`")):
            placed, copied = statistics.median(r["placed_" + key]), statistics.median(r["copied_" + key])
            lines.append(
                f"| {size} | {human(r['changed_bytes'])} ({r['changed_bytes'] / n:.1%}) | {hint} | {human(placed)} "
                f"({placed / n:.1%}) | {human(copied)} ({copied / n:.1%}) |"
            )
    lines += [
        "",
        "## Requests while updates arrive",
        "",
        "A request: one 256x256 float32 matmul over a model tensor inside `with hot.serving()`. Steady state: 3 s "
        "with no update; during: the 3%-changed updates above (each followed by the consumer's catch-up copy), "
        "without the hint and with it. Swap: the time the active copy's switch takes under the lock.",
        "",
        "| model | steady p50 | steady p99 | during p50 | during p99 | p99 during / steady | hinted: during p99 "
        "| / steady | requests | swap max |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for size, r in results.items():
        s, d, h = r["steady"], r["during"], r["during_hinted"]
        lines.append(
            f"| {size} | {pct(s, 0.5) * 1e6:.0f} us | {pct(s, 0.99) * 1e6:.0f} us | {pct(d, 0.5) * 1e6:.0f} us | "
            f"{pct(d, 0.99) * 1e6:.0f} us | {pct(d, 0.99) / pct(s, 0.99):.2f}x | {pct(h, 0.99) * 1e6:.0f} us | "
            f"{pct(h, 0.99) / pct(s, 0.99):.2f}x | {len(s)} / {len(d)} / {len(h)} | {max(r['swap']) * 1e6:.1f} us |"
        )
    lines += [
        "",
        "## Across nodes",
        "",
        "Two network namespaces joined by veth pairs and a bridge, each node's link shaped to 1 Gbit/s "
        "(`tc tbf`); Redis and the publisher's agent on node 0, a `HotModel` consumer on node 1 whose agent "
        "follows the stream in Redis and pulls from node 0's agent. iperf3 (one stream, 4 s, node 0 sending) "
        "on the same link in the same run. Rate: the bytes node 1 pulled over the time from the commit to "
        "the consumer serving.",
        "",
        "| model | full update publish->served | pull rate | iperf3 | rate / iperf3 | 3% update publish->served | "
        "3% update bytes pulled |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    if not cross:
        lines.append("| (not run: network namespaces need root) | | | | | | |")
    for size, r in cross.items():
        rate = statistics.median(r["full_rate"])
        lines.append(
            f"| {size} | {ms(statistics.median(r['full']))} | {rate / 1e9:.2f} Gbit/s | "
            f"{r['iperf_bps'] / 1e9:.2f} Gbit/s | {rate / r['iperf_bps']:.2f}x | "
            f"{ms(statistics.median(r['delta']))} | {human(statistics.median(r['delta_pulled']))} "
            f"({statistics.median(r['delta_pulled']) / r['nbytes']:.1%}) |"
        )
    if cross:
        lines += ["", "Runs per size: " + ", ".join(
            f"{s}: {len(r['full'])} full, {len(r['delta'])} of 3%" for s, r in cross.items()) + "."]  # fmt: skip
    t0 = trainer[0]
    lines += [
        "",
        "## The trainer's step with asynchronous publishing and history",
        "",
        f"A {human(t0['nbytes'])} model (100 float32 tensors, torch with 1 thread); a step: N 384x384 matmuls, "
        "then every parameter changed (so every publish places the whole model). Without publishing, and "
        "with `publish(sync=False)` after every step and every 10th version saved to a `Repository` on local "
        f"disk in the background: {t0['pairs']} pairs of {t0['per_block']}-step blocks, each pair in the "
        "other order from the one before. A block with publishing ends when its last version is placed and "
        "its history saved (the 10th version of each block), so that no background work spills into the "
        "block after. Overhead, median of the pairs, two ways: the steps alone (the last version's "
        "background work not counted), and the block with publishing over the one without, that last wait "
        "included (an upper bound: in a run that goes on, it overlaps the steps after). The steps' overhead "
        "in parts, from the trainer thread's own accounting (/proc/thread-self/schedstat), each as a share "
        "of the block without publishing: blocked (the time inside `publish()`, the snapshot), slower steps "
        "(the trainer thread's extra CPU time for the same steps: caches and memory shared with the "
        "background work) and waiting for a CPU (the thread ready but kept off the cores).",
        "",
        "| step | step p50 without | step p50 with | overhead, steps alone (each pair) | blocked | slower "
        "steps | waiting for a CPU | overhead, blocks (each pair) | blocked in publish() p50 | versions "
        "saved to the history |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def pairs(rs: list[float]) -> str:
        return f"{statistics.median(rs) - 1:+.1%} ({', '.join(f'{r - 1:+.1%}' for r in rs)})"

    for t in trainer:
        plain, pub = statistics.median(t["plain"]), statistics.median(t["publish"])
        parts = t["parts"]
        lines.append(
            f"| {t['matmuls']} matmuls | {ms(plain)} | {ms(pub)} | {pairs(t['step_ratios'])} | "
            f"{median_pct(parts['blocked'])} | {median_pct(parts['cpu'])} | {median_pct(parts['wait'])} | "
            f"{pairs(t['ratios'])} | {ms(statistics.median(t['blocked']))} | "
            f"{t['flushed']} ({t['flush_skipped']} skipped) |"
        )
    lines += [
        "",
        "A `sync=False` publish waits for the one before it: when placing the whole model (hash and write, on "
        "the publisher's background thread) takes longer than a step, the trainer waits for it.",
        "",
        f"![update latency per model and change]({os.path.relpath(args.plot, Path(args.out).parent)})",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    plot(args.plot, results)


def plot(path: str, results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = ["memcpy of changed", "tierstore 3%", "tierstore 100%", "torch.save+poll+load", "h5py+poll+load"]
    width = 0.8 / len(results)
    for i, (size, r) in enumerate(results.items()):
        vals = [r["memcpy_delta"], statistics.median(r["delta"]), statistics.median(r["full"])]
        vals.append(statistics.median(r["baseline"]))
        vals.append(statistics.median(r["baseline_h5"]))
        xs = [j + i * width for j in range(len(labels))]
        ax.bar(xs, [v * 1e3 for v in vals], width, label=size)
    ax.set_xticks([j + width * (len(results) - 1) / 2 for j in range(len(labels))], labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("publish -> consumer serving (ms, log)")
    ax.set_title("Model update latency, same node")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
