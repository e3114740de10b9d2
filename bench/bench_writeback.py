"""Benchmark of write-back staging: Cache VOL's checkpointing experiment on the stand-in store.

A job loops: compute (a fixed sleep, standing in for GPU work: it takes no host CPU), then a checkpoint of
S bytes (4 shard files and a small commit file written last, each written, flushed and fsynced) under a
destination on the stand-in store (`tierstore.slowfs`, FUSE) whose write bandwidth is capped well below
the local disk's. The compute time of a step is `ratio` times the time one checkpoint takes written
straight to the store (measured first), for ratios 0.5, 1 and 2. In one run:

  local disk    the same job writing to a directory of the local disk, no tierstore: the target;
  store         the same job writing straight to the stand-in store, no tierstore: the baseline;
  tierstore     the job writing through `tierstore.open(path, "wb")` (durability "local": each close
                returns once the bytes and their journal entry are fsynced on the node's stage), the
                node's agent migrating to the store in the background; then `tierstore.sync()`.

The local device's raw write+fsync bandwidth is the local-disk job's own observed bandwidth: the same
files written and fsynced on the stage's disk inside the same loop (rounds alternate which job runs first,
and each tierstore job is paired with the same round's local-disk job). A standalone write+fsync on the
idle disk is measured before every round for context: this VM's disk is often faster right after
`os.sync()` than inside a loop. Reported: the observed write bandwidth of the tierstore job (bytes over the time spent in its
writes and closes, Cache VOL's measure) against the device's, and each job's total time (to its last close;
for tierstore also to the end of the final sync) against the local-disk job's.

    .venv/bin/python bench/bench_writeback.py --out docs/benchmarks/writeback.md --plot docs/benchmarks/writeback.png

Then `torch.distributed.checkpoint.async_save` (one gloo process, a state of `--dcp-mib` MiB): a loop of
compute and an asynchronous save per step (each save waits for the one before, as a trainer's does),
compute = ratio x one save straight to the store; the job's time with the checkpoint going to the local
disk, straight to the store, and to the store under `tierstore run` (its files staged). `--no-dcp` skips it.

The exit status is 1 when a target (for ratios >= 1: observed bandwidth >= 0.95x the device's, job time
<= 1.05x the local-disk job's) is missed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import page

RATIOS = (0.5, 1.0, 2.0)
BW_TARGET = 0.95
TIME_TARGET = 1.05


@dataclass
class Spec:
    shards: int = 4
    shard_size: int = 16 << 20
    steps: int = 6
    store_write_bw: str = "100MiB/s"

    @property
    def size(self) -> int:
        return self.shards * self.shard_size + 4096


def payload(spec: Spec) -> list[tuple[str, bytes]]:
    """The files of one checkpoint: shards, then the commit file (written last)."""
    rnd = os.urandom(1 << 20)
    shards = [(f"shard{i}.bin", rnd * (spec.shard_size >> 20)) for i in range(spec.shards)]
    return [*shards, ("commit.json", b"{}".ljust(4096))]


def write_plain(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_staged(path: str, data: bytes) -> None:
    import tierstore

    f: IO[Any] = tierstore.open(path, "wb")
    with f:
        f.write(data)
        f.flush()


def checkpoint(
    root: Path, step: int, files: list[tuple[str, bytes]], write: Callable[[str, bytes], None]
) -> float:
    """Writes one checkpoint; returns the seconds spent in writes and closes."""
    t0 = time.perf_counter()  # from creating the checkpoint's directory to the last close (Cache VOL's)
    d = root / f"step{step:03d}"
    d.mkdir(parents=True, exist_ok=True)
    for name, data in files:
        write(str(d / name), data)
    return time.perf_counter() - t0


@dataclass
class Job:
    io: float  # seconds in writes and closes
    total: float  # seconds to the last close
    durable: float  # seconds until on the store (tierstore: after the final sync)


def job(
    root: Path,
    spec: Spec,
    files: list[tuple[str, bytes]],
    compute: float,
    write: Callable[[str, bytes], None],
    sync: Callable[[], None] | None = None,
) -> Job:
    io = 0.0
    start = time.perf_counter()
    for step in range(spec.steps):
        time.sleep(compute)
        io += checkpoint(root, step, files, write)
    total = time.perf_counter() - start
    if sync is not None:
        sync()
    return Job(io, total, time.perf_counter() - start)


@contextlib.contextmanager
def store(root: Path, backing: Path, write_bw: str) -> Iterator[tuple[Path, Path]]:
    mount = root / "store"
    shutil.rmtree(backing, ignore_errors=True)
    backing.mkdir(parents=True)
    mount.mkdir(exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierstore.testing.slowfs", str(backing), str(mount), "--foreground", "--meta-latency", "1ms",
         "--data-latency", "0", "--bandwidth", "0", "--write-bandwidth", write_bw],
        stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while not os.path.ismount(mount):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the stand-in store did not mount: {proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
        time.sleep(0.05)
    try:
        yield backing, mount
    finally:
        for _ in range(50):
            if subprocess.run(["fusermount3", "-u", str(mount)], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        proc.wait(30)
        shutil.rmtree(backing, ignore_errors=True)


DCP_JOB = r"""
import json, os, sys, time, warnings
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

out, compute, steps, mib, pg = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{pg}")
state = {"w": torch.randn(mib << 18), "step": torch.tensor(0)}
warnings.simplefilter("ignore")
start = time.perf_counter()
waited = 0.0
future = None
for step in range(steps):
    time.sleep(compute)  # the step's GPU work
    t = time.perf_counter()
    if future is not None:
        future.result()  # a trainer saves again only once the last save is done
    state["step"] += 1
    future = dcp.async_save(state, checkpoint_id=os.path.join(out, f"step{step:03d}"))
    waited += time.perf_counter() - t
t = time.perf_counter()
future.result()
waited += time.perf_counter() - t
total = time.perf_counter() - start
dist.destroy_process_group()
print(json.dumps({"total": total, "waited": waited}))
"""


def dcp_job(
    out: Path, compute: float, steps: int, mib: int, pg: Path, run: bool, env: dict[str, str]
) -> dict[str, float]:
    """One async_save job in its own process (torch's import is not timed); under `tierstore run` if `run`."""
    import json

    cmd = [sys.executable, "-c", DCP_JOB, str(out), str(compute), str(steps), str(mib), str(pg)]
    if run:
        cmd = [sys.executable, "-m", "tierstore.cli", "run", "--", *cmd]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"the async_save job failed: {p.stderr[-3000:]}")
    with contextlib.suppress(FileNotFoundError):
        pg.unlink()
    result: dict[str, float] = json.loads(p.stdout.strip().splitlines()[-1])
    return result


def run_dcp(args: argparse.Namespace, root: Path, mount: Path, dest: Path, results: dict[str, Any]) -> None:
    """`torch.distributed.checkpoint.async_save` with and without tierstore (see the module's description)."""
    import tierstore

    env = {**os.environ, "TIERSTORE_SOURCE": str(root / "data"), "TIERSTORE_TIERS": f"{root / 'tier'}:64M"}
    (root / "data").mkdir(exist_ok=True)
    pg = root / "pg"
    steps, mib = args.steps, args.dcp_mib
    probe = dcp_job(mount / "dcp-probe", 0.0, 2, mib, pg, False, env)
    t_save = probe["total"] / 2
    shutil.rmtree(mount / "dcp-probe", ignore_errors=True)
    results["dcp"] = {"t_save": t_save, "mib": mib, "steps": steps, "ratios": {}}
    for ratio in RATIOS:
        compute = ratio * t_save
        rows: dict[str, list[dict[str, float]]] = {"local disk": [], "store": [], "tierstore run": []}
        for _ in range(args.repeats):
            rows["local disk"].append(dcp_job(root / "dcp-local", compute, steps, mib, pg, False, env))
            drop_tree(root / "dcp-local")
            rows["store"].append(dcp_job(mount / "dcp-direct", compute, steps, mib, pg, False, env))
            shutil.rmtree(mount / "dcp-direct", ignore_errors=True)
            row = dcp_job(dest / "dcp", compute, steps, mib, pg, True, env)
            t = time.perf_counter()
            tierstore.sync(timeout=600)
            row["durable"] = row["total"] + time.perf_counter() - t  # the job, then the final sync
            rows["tierstore run"].append(row)
            shutil.rmtree(dest / "dcp", ignore_errors=True)
            os.sync()
        results["dcp"]["ratios"][ratio] = {"compute": compute, **rows}
        print(f"async_save ratio {ratio}: done", file=sys.stderr)


def report_dcp(d: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## torch.distributed.checkpoint.async_save, with and without tierstore",
        "",
        f"One gloo process saves a {d['mib']} MiB state with `dcp.async_save` every step, {d['steps']} steps per "
        "job; each save waits for the one before (`future.result()`), and the job ends when the last is done. "
        f"One save straight to the store took {d['t_save']:.2f} s; a step's compute is ratio x that. "
        "`tierstore run`: the same program, its checkpoint directory under the write-back destination on the "
        "store (staged, migrated in the background). Job time excludes torch's import and the process group's "
        "start (the same in every column). Medians of the rounds.",
        "",
        "| compute/save | job time: local disk | store | tierstore run | tierstore vs store | tierstore vs local "
        "disk | waiting for saves: store | tierstore run | tierstore run, synced at the end |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for ratio, row in d["ratios"].items():
        med = {k: statistics.median(j["total"] for j in v) for k, v in row.items() if k != "compute"}
        wait = {k: statistics.median(j["waited"] for j in v) for k, v in row.items() if k != "compute"}
        durable = statistics.median(j["durable"] for j in row["tierstore run"])
        lines.append(
            f"| {ratio:g} | {med['local disk']:.2f} s | {med['store']:.2f} s | {med['tierstore run']:.2f} s | "
            f"{med['tierstore run'] / med['store']:.2f}x | {med['tierstore run'] / med['local disk']:.2f}x | "
            f"{wait['store']:.2f} s | {wait['tierstore run']:.2f} s | {durable:.2f} s |"
        )
    lines += ["", "Every round, the same round's jobs paired (job time, `tierstore run` over the other):", ""]
    for ratio, row in d["ratios"].items():
        runs = zip(row["local disk"], row["store"], row["tierstore run"], strict=True)
        pairs = [(t["total"] / s["total"], t["total"] / loc["total"]) for loc, s, t in runs]
        lines.append(
            f"- compute/save {ratio:g}: over the store "
            + ", ".join(f"{a:.2f}x" for a, _ in pairs)
            + "; over the local disk "
            + ", ".join(f"{b:.2f}x" for _, b in pairs)
        )
    return lines


def drop_tree(p: Path) -> None:
    shutil.rmtree(p, ignore_errors=True)
    os.sync()


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = Spec(steps=args.steps, shard_size=args.shard_mib << 20, store_write_bw=args.store_bw)
    root: Path = args.root
    drop_tree(root)
    root.mkdir(parents=True)
    files = payload(spec)
    local = root / "local"
    stage = root / "stage"
    results: dict[str, Any] = {"spec": spec, "device": [], "ratios": {}}
    with store(root, args.store_backing, spec.store_write_bw) as (backing, mount):
        dest = mount / "ckpt"
        dest.mkdir()
        os.environ["XDG_RUNTIME_DIR"] = str(root / "run")
        (root / "run").mkdir()
        os.environ["TIERSTORE_WRITEBACK"] = f"{dest}:{stage}:{4 * spec.size * spec.steps}:local"
        import tierstore
        from tierstore import agent, writeback

        writeback.reload()
        pid, _ = agent.start(agent.default_socket(), env=dict(os.environ), idle_exit=600)
        try:

            def synced() -> None:
                tierstore.sync(timeout=600)

            # The device: the checkpoint's files written and fsynced on the stage's disk (again before every
            # round below: this VM's disk varies from minute to minute).
            def device() -> None:
                t = checkpoint(stage.parent / "raw", 0, files, write_plain)
                results["device"].append(spec.size / t)
                drop_tree(stage.parent / "raw")

            # The store: one checkpoint written straight to it gives the I/O time the ratios scale.
            direct = [checkpoint(mount / "probe", i, files, write_plain) for i in range(2)]
            t_store = statistics.median(direct)
            results["t_store"] = t_store
            if args.dcp_only:
                device()
            for ratio in () if args.dcp_only else RATIOS:
                compute = ratio * t_store
                rows: dict[str, list[Job]] = {"local disk": [], "store": [], "tierstore": []}

                for i in range(args.repeats):
                    device()
                    # Every other round runs tierstore first, so that neither job always follows the store's.
                    order = (
                        ("local disk", "store", "tierstore")
                        if i % 2 == 0
                        else ("tierstore", "local disk", "store")
                    )
                    for name in order:
                        if name == "local disk":
                            rows[name].append(job(local, spec, files, compute, write_plain))
                            drop_tree(local)
                        elif name == "store":
                            rows[name].append(job(mount / "direct", spec, files, compute, write_plain))
                            shutil.rmtree(mount / "direct", ignore_errors=True)
                            os.sync()
                        else:
                            rows[name].append(
                                job(dest / f"r{ratio}", spec, files, compute, write_staged, synced)
                            )
                            assert not any(p["files"] for p in writeback.pending()), (
                                "sync returned with files pending"
                            )
                            shutil.rmtree(dest / f"r{ratio}", ignore_errors=True)
                            os.sync()
                results["ratios"][ratio] = {"compute": compute, **rows}
                print(f"ratio {ratio}: done", file=sys.stderr)
            if args.dcp:
                run_dcp(args, root, mount, dest, results)
            # Byte-exact on the store: one more checkpoint, synced and compared.
            job(dest / "check", Spec(steps=1, shards=spec.shards, shard_size=spec.shard_size), files, 0, write_staged,
                synced)  # fmt: skip
            for name, data in files:
                assert (backing / "ckpt" / "check" / "step000" / name).read_bytes() == data, name
        finally:
            agent.stop(agent.default_socket())
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
    results["load"] = os.getloadavg()
    return results


def report(r: dict[str, Any], command: str) -> tuple[list[str], bool]:
    if not r["ratios"]:  # --dcp-only
        return ["# Write-back staging: async_save", "", f"Command: {command}", *report_dcp(r["dcp"])], True
    spec: Spec = r["spec"]
    dev = statistics.median(r["device"])
    mib = 1 << 20
    lines = [
        "# Write-back staging: Cache VOL's checkpointing experiment",
        "",
        f"Command: {command}",
        "",
        f"Load average at the end: {r['load'][0]:.2f}, {r['load'][1]:.2f}, {r['load'][2]:.2f} (1, 5, 15 min) on "
        f"{os.cpu_count()} cores: the machine is shared, and its other work stretches the local-disk job as "
        "much as tierstore's, which is why every ratio below is taken within one round.",
        "",
        f"Checkpoint: {spec.shards} shards of {spec.shard_size // mib} MiB and a 4 KiB commit file written last "
        f"({spec.size / mib:.1f} MiB), {spec.steps} steps per job; every file written, flushed and fsynced "
        "(tierstore: closed, which fsyncs and journals it). The store: `tierstore.slowfs` with writes capped at "
        f"{spec.store_write_bw}, 1 ms per metadata operation, its files kept in RAM (another device than the "
        "stage's disk, as a parallel file system is). One checkpoint straight to the store took "
        f"{r['t_store']:.2f} s; a step's compute is ratio x that. Times and bandwidths: medians of the rounds; ratios: "
        "each round's own (each round runs the three jobs back to back, alternating which comes first), their "
        "median first.",
        "",
        "The local device's raw write+fsync bandwidth, two ways:",
        "",
        "- **In the job's loop** (the reference of the target): the local-disk job is the same files written, "
        "flushed and fsynced with plain `open` on the stage's disk, between the same sleeps. Its observed bandwidth "
        "is the device's as this loop sees it; each round's tierstore job is compared with the same round's "
        "local-disk job, and the table gives every round's paired ratio.",
        f"- **Alone, on an idle disk**: one checkpoint's files written and fsynced right after `os.sync()`, before "
        f"every round: {dev / mib:.0f} MiB/s median (rounds: {', '.join(f'{x / mib:.0f}' for x in r['device'])}). "
        "This VM's disk is often faster right after `os.sync()` on an idle disk than inside a loop of writes and "
        "sleeps (and varies from minute to minute), so this figure is not the target's reference; it is shown "
        "for context.",
        "",
        "| compute/IO | observed write bandwidth: tierstore | local-disk job | tierstore vs the local-disk job "
        "(paired, per round) | tierstore vs the idle device | job time: local disk | store | tierstore | tierstore "
        "vs local disk (paired, per round) | tierstore, synced at the end | store vs local disk (per round) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    checks: list[page.Check] = []
    for ratio, row in r["ratios"].items():
        med = {k: statistics.median(j.total for j in v) for k, v in row.items() if k != "compute"}
        ts, loc = row["tierstore"], row["local disk"]
        bw = statistics.median(spec.size * spec.steps / j.io for j in ts)
        local_bw = statistics.median(spec.size * spec.steps / j.io for j in loc)
        durable = statistics.median(j.durable for j in ts)
        # Each round's tierstore job against the same round's local-disk job.
        bw_ratios = [lj.io / tj.io for tj, lj in zip(ts, loc, strict=True)]
        t_ratios = [tj.total / lj.total for tj, lj in zip(ts, loc, strict=True)]
        store_ratios = [sj.total / lj.total for sj, lj in zip(row["store"], loc, strict=True)]
        if ratio >= 1:
            checks.append((f"compute/IO {ratio:g}: observed bandwidth >= {BW_TARGET}x the local-disk job's",
                           page.met(bw_ratios, BW_TARGET), page.rounds(bw_ratios)))  # fmt: skip
            # tierstore's time <= 1.05x the local-disk job's: the local-disk job's over tierstore's >= 1/1.05
            checks.append((f"compute/IO {ratio:g}: job time <= {TIME_TARGET}x the local-disk job's",
                           page.met([1 / x for x in t_ratios], 1 / TIME_TARGET), page.rounds(t_ratios)))  # fmt: skip
        lines.append(
            f"| {ratio:g} | {bw / mib:.0f} MiB/s | {local_bw / mib:.0f} MiB/s | {page.rounds(bw_ratios)} | "
            f"{bw / dev:.2f}x | {med['local disk']:.2f} s | {med['store']:.2f} s | "
            f"{med['tierstore']:.2f} s | {page.rounds(t_ratios)} | {durable:.2f} s | {page.rounds(store_ratios)} |"
        )
    ok = all(c is not False for _, c, _ in checks)
    lines += [
        "",
        f"Targets for compute/IO >= 1 (observed bandwidth against the local-disk job's, the device's in the job's "
        f"loop; job time against the local-disk job's), judged round by round: met when every one of the "
        f"{len(ts)} rounds meets it, missed when none does, undecided when the rounds straddle it.",
        *page.targets(checks),
        "",
        '"tierstore, synced at the end" adds the final `tierstore.sync()`: the time until every checkpoint is fsynced '
        "and checked on the store. At ratio 0.5 the store cannot keep up with the job, so the stage grows and the "
        "final sync waits for the backlog.",
    ]
    if "dcp" in r:
        lines += report_dcp(r["dcp"])
    return lines, ok


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec: Spec = r["spec"]
    dev = statistics.median(r["device"])
    ratios = list(r["ratios"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.4
    for i, (k, label, color) in enumerate(
        (
            ("local disk", "local-disk job (the device, in the loop)", "tab:blue"),
            ("tierstore", "tierstore", "tab:green"),
        )
    ):
        bws = [
            statistics.median(spec.size * spec.steps / j.io for j in r["ratios"][x][k]) / (1 << 20)
            for x in ratios
        ]
        a.bar([j + (i - 0.5) * width for j in range(len(ratios))], bws, width, color=color, label=label)
    a.set_xticks(range(len(ratios)), [str(x) for x in ratios])
    a.axhline(dev / (1 << 20), color="k", linestyle="--", label="device alone, idle disk")
    a.set_xlabel("compute / IO")
    a.set_ylabel("MiB/s")
    a.set_title("observed write bandwidth")
    a.legend(fontsize="small")
    width = 0.25
    for i, k in enumerate(("local disk", "store", "tierstore")):
        ys = [statistics.median(j.total for j in r["ratios"][x][k]) for x in ratios]
        b.bar([j + (i - 1) * width for j in range(len(ratios))], ys, width, label=k)
    b.set_xticks(range(len(ratios)), [str(x) for x in ratios])
    b.set_xlabel("compute / IO")
    b.set_ylabel("job time (s)")
    b.set_title("job time")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write the results as Markdown here")
    ap.add_argument("--plot", type=Path, help="write a chart (PNG) here")
    ap.add_argument("--root", type=Path, default=Path("/var/tmp/tierstore-bench-writeback"))
    ap.add_argument(
        "--store-backing",
        type=Path,
        default=Path("/dev/shm/tierstore-bench-writeback-store"),
        help="the stand-in store's backing directory: another device than --root's (default: RAM), so that "
        "the store's writes do not compete with the stage's for the local disk, as a parallel file system's "
        "do not",
    )
    ap.add_argument("--repeats", type=int, default=5, help="rounds of every job; tables give medians")
    ap.add_argument("--steps", type=int, default=Spec.steps)
    ap.add_argument("--shard-mib", type=int, default=Spec.shard_size >> 20)
    ap.add_argument(
        "--store-bw", default=Spec.store_write_bw, help="the store's write cap (default %(default)s)"
    )
    ap.add_argument(
        "--dcp-mib", type=int, default=64, help="the async_save state's size (default %(default)s)"
    )
    ap.add_argument("--no-dcp", dest="dcp", action="store_false", help="skip the async_save measurement")
    ap.add_argument("--dcp-only", action="store_true", help="only the async_save measurement")
    args = ap.parse_args(argv)
    started = time.time()
    r = run(args)
    command = " ".join(
        [".venv/bin/python", "bench/bench_writeback.py", *(argv if argv is not None else sys.argv[1:])]
    )
    command = f"`{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, {time.time() - started:.0f} s)"
    lines, ok = report(r, command)
    if args.out and args.plot:
        link = os.path.relpath(args.plot, args.out.parent)
        lines += ["", f"![observed write bandwidth and job time per compute/IO ratio]({link})"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.plot:
        plot(r, args.plot)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
