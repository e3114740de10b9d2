"""Benchmark: MLPerf Storage's workloads, run by its engine DLIO, on the stand-in shared store.

DLIO (`dlio-benchmark` 2.0.0 from PyPI, in its own venv `.venv-dlio`: `make bench-dlio-setup`) is the
program MLPerf Storage runs: it reads a generated dataset with a real PyTorch DataLoader and stands in for
the accelerator with a sleep of the workload's compute time per step. Its accelerator utilisation (AU) is
the compute time over the wall time of an epoch (the first step left out), and its throughput the samples
of an epoch over its wall time; both come from DLIO's own `summary.json`. Nothing here imitates DLIO: this
script generates the data with DLIO, runs DLIO as a subprocess and reads what DLIO wrote.

The workloads, scaled to this 2-core machine (the scaling is printed on the page):

  unet3d    MLPerf's unet3d_h100 (npz, one large sample per file, batch 7, 0.323 s per step): the samples
            35 times smaller (4.0 MiB mean instead of 140 MiB, the same spread), 112 files
  resnet50  MLPerf's resnet50_h100 has 114,660-byte samples read by TensorFlow; here the PyTorch loader
            reads npz files of one such sample each (many small files), batch 32 instead of 400 with
            the step's 0.224 s kept, so one accelerator wants 143 samples/s instead of 1,786
  resnet50-hdf5  the same samples in HDF5 files (DLIO's `hdf5` format, one sample per file), read with
            h5py in the DataLoader's workers, which DLIO forks and keeps across epochs

each for 3 epochs, 2 DataLoader workers (`read_threads`), in three setups of one round:

  store          the dataset on the stand-in store (`tierstore.testing.slowfs`, its default latencies and
                 500 MiB/s), read directly
  tierstore run  the same under `tierstore run` (the LD_PRELOAD shim; the store as the cache's source, a
                 fresh tier on /dev/shm, `--revalidate never`): epoch 1 fetches, epochs 2-3 hit the tier
  local copy     the store's backing directory on the local disk read directly (in the page cache): the bar

Each setup runs twice a round: once with the workload's compute time (its AU and samples/s per epoch), and
once with no compute (`computation_time=0`), which makes the epoch as fast as the setup's I/O path can
feed one DLIO process: its capacity C in samples/s. How many simulated accelerators the setup keeps at AU
>= 90% is computed from that, not run: one accelerator at 100% AU consumes D = batch / compute samples/s,
so N accelerators get AU = C / (N x D) once I/O-bound, and AU >= 0.9 holds for N <= C / (0.9 x D). DLIO
would run N accelerators as N MPI ranks; 2 cores cannot host several ranks with 2 workers each without
measuring the CPU instead of the storage, so this assumes C is what the storage path can deliver to any
number of ranks (true of the local copy and the tier, both in memory; generous to the store, whose
FUSE daemon would be shared by the ranks). Target: from epoch 2 on, AU >= 90% and N of `tierstore run` at
least 0.95x the local copy's, in the same round. As a cross-check of that assumption, each setup then runs
once more with the compute as `--ranks` MPI ranks (DLIO's own multi-process mode, `mpirun`; 2 by default),
and the page puts the AU DLIO measures beside the AU the one-process capacity predicts for that many.

Then the checkpointing workload, llama3-8b-shaped: DLIO 2.0.0 checkpoints from its training loop (PyPI has
no release with the checkpoint-only llama workloads of DLIO's main branch), so a tiny dataset is trained
for 4 steps of 2 s with a checkpoint after every step: per checkpoint, `model_size` bytes of embeddings,
one file per layer for 32 layers (attention and MLP tensors) and the optimizer's groups, each sized from
llama3-8b (fp16 weights, fp32 Adam states) divided by 400 (about 280 MB; DLIO writes each file with
`torch.save`, without fsync). Written (i) straight to a second stand-in store whose writes are capped at
`--ckpt-store-bw` (its files in RAM, another device than the stage's disk), (ii) under `tierstore run`
with that store's directory a write-back destination (stage on the local disk) with the default durability
"buffered" (each close returns once the file is hashed and journaled, its bytes in the page cache, as on a
local disk), (iii) the same with durability "local" (each close returns once the file is fsynced on the
stage); the agent migrates in the background, and the script waits for `tierstore sync` after the job;
(iv) to the local disk. Write throughput: a checkpoint's bytes
over DLIO's checkpoint duration (its per_epoch_stats.json). Read throughput: DLIO 2.0.0 never reads a
checkpoint back, so the script reads the last checkpoint's files itself (plain 1 MiB reads after
POSIX_FADV_DONTNEED, in a subprocess; under `tierstore run` for the staged setup) and says so on the page.
Target: write throughput through staging >= 0.95x the local disk's.

    .venv/bin/python bench/bench_dlio.py --out docs/benchmarks/dlio.md --plot docs/benchmarks/dlio.png

The exit status is 1 when a target is missed in every round (rounds that straddle it leave it undecided).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

import machine
from page import verdict
from tierstore.testing.slowfs import mounted

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
SETUPS = ("store", "tierstore run", "local copy")
CKPT_SETUPS = ("store", "tierstore run", "tierstore run, local", "local disk")
AU_TARGET = 90.0
ACCEL_TARGET = 0.95
WRITE_TARGET = 0.95
MIB = 1 << 20


@dataclass(frozen=True)
class Training:
    """One training workload: where it starts in DLIO's configs and how it is scaled."""

    name: str
    base: str  # the DLIO workload config it starts from
    files: int
    record: int  # bytes per sample, mean
    stdev: int
    batch: int
    compute: float  # seconds of simulated accelerator work per step
    threads: int = 2
    epochs: int = 3
    extra: tuple[str, ...] = ()

    @property
    def format(self) -> str:
        """The files' format: the `dataset.format` override, else the base config's (npz for both)."""
        given = [o.split("=", 1)[1] for o in self.extra if o.startswith("++workload.dataset.format=")]
        return given[0] if given else "npz"

    @property
    def demand(self) -> float:
        """Samples per second one accelerator consumes at 100% AU."""
        return self.batch / self.compute

    def overrides(self, data: Path) -> list[str]:
        return [
            f"workload={self.base}",
            *self.extra,
            "++workload.workflow.checkpoint=False",
            f"++workload.dataset.data_folder={data}",
            f"++workload.dataset.num_files_train={self.files}",
            "++workload.dataset.num_samples_per_file=1",
            f"++workload.dataset.record_length={self.record}",
            f"++workload.dataset.record_length_stdev={self.stdev}",
            "++workload.dataset.record_length_resize=0",
            f"++workload.reader.batch_size={self.batch}",
            f"++workload.reader.read_threads={self.threads}",
            f"++workload.train.epochs={self.epochs}",
        ]


# MLPerf's unet3d_h100 with samples 35 times smaller (its mean and spread both divided).
UNET3D = Training(
    name="unet3d",
    base="unet3d_h100",
    files=112,
    record=146600628 // 35,
    stdev=68341808 // 35,
    batch=7,
    compute=0.323,
)
# MLPerf's resnet50_h100 samples, one per npz file for the PyTorch loader; batch 32 instead of 400.
RESNET50 = Training(
    name="resnet50",
    base="resnet50_h100",
    files=1600,
    record=114660,
    stdev=0,
    batch=32,
    compute=0.224,
    extra=(
        "++workload.framework=pytorch",
        "++workload.reader.data_loader=pytorch",
        "++workload.dataset.format=npz",
    ),
)
# The same samples in HDF5, one per file, read with h5py by the PyTorch loader's workers, which DLIO forks
# and keeps across epochs (`persistent_workers`): the reader of issue #51 item 5.
RESNET50_HDF5 = replace(
    RESNET50,
    name="resnet50-hdf5",
    extra=(
        "++workload.framework=pytorch",
        "++workload.reader.data_loader=pytorch",
        "++workload.dataset.format=hdf5",
        # DLIO's HDF5 generator draws this many bytes of random samples for every file (2 GB by default:
        # seconds per file of 112 KiB).
        "++workload.dataset.generation_buffer_size=1048576",
    ),
)

# llama3-8b: 32 layers of hidden 4096, FFN 14336, 8 KV heads of 128, a 128,256-token vocabulary; fp16
# weights (2 bytes a parameter) and fp32 Adam states (DLIO saves two tensors per group and their sum, so
# 12 bytes a parameter is 3 x 4-byte groups). Everything divided by CKPT_SCALE.
CKPT_SCALE = 400
LAYERS = 32
ATTENTION = 4096 * (2 * 4096 + 2 * 1024)  # q, o; k, v
MLP = 3 * 4096 * 14336
EMBEDDINGS = 2 * 128256 * 4096  # input embedding and output head
CKPT_STEPS = 4
CKPT_COMPUTE = 2.0


def ckpt_overrides(data: Path, folder: Path) -> list[str]:
    layer = [2 * ATTENTION // CKPT_SCALE, 2 * MLP // CKPT_SCALE]
    groups = [4 * LAYERS * (ATTENTION + MLP) // CKPT_SCALE, 4 * EMBEDDINGS // CKPT_SCALE]
    return [
        "workload=unet3d_h100",
        "++workload.model=llama3_8b_scaled",
        "++workload.workflow.checkpoint=True",
        f"++workload.dataset.data_folder={data}",
        f"++workload.dataset.num_files_train={CKPT_STEPS}",
        "++workload.dataset.record_length=65536",
        "++workload.dataset.record_length_stdev=0",
        "++workload.dataset.record_length_resize=0",
        "++workload.reader.batch_size=1",
        "++workload.reader.read_threads=1",
        "++workload.train.epochs=1",
        f"++workload.train.computation_time={CKPT_COMPUTE}",
        f"++workload.checkpoint.checkpoint_folder={folder}",
        "++workload.checkpoint.steps_between_checkpoints=1",
        "++workload.checkpoint.type=rank_zero",
        f"++workload.checkpoint.model_size={2 * EMBEDDINGS // CKPT_SCALE}",
        f"++workload.checkpoint.num_layers={LAYERS}",
        f"++workload.checkpoint.layer_parameters=[{layer[0]},{layer[1]}]",
        f"++workload.checkpoint.optimization_groups=[{groups[0]},{groups[1]}]",
    ]


def dlio(
    dlio_bin: Path, overrides: list[str], out: Path, env: dict[str, str], wrap: bool, ranks: int = 1
) -> Path:
    """Runs DLIO with `overrides` (under `tierstore run` if `wrap`), as `ranks` MPI ranks when more than
    one (each a simulated accelerator, as MLPerf Storage runs it); returns its output folder."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [str(dlio_bin), *overrides, f"++workload.output.folder={out}", f"hydra.run.dir={out}/hydra"]
    if ranks > 1:
        # The ranks inherit mpirun's environment, the shim's LD_PRELOAD included under `tierstore run`.
        cmd = [
            "mpirun",
            "--allow-run-as-root",
            "--oversubscribe",
            "--bind-to",
            "none",
            "-np",
            str(ranks),
            *cmd,
        ]
    if wrap:
        cmd = [PY, "-m", "tierstore.cli", "run", "--", *cmd]
    env = {**env, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONUNBUFFERED": "1"}
    with open(out / "console.log", "wb") as log:
        p = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1200)
    if p.returncode != 0:
        tail = (out / "console.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"DLIO failed ({p.returncode}): {' '.join(cmd)}\n{tail}")
    return out


def children_cpu() -> float:
    """User + system CPU seconds of this process's waited-for children and their waited-for descendants.
    Not `cpu.tree_seconds`: that also counts live children, and the stand-in store serving the job is one."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TIERSTORE_")}


def cache_env(source: Path, tier: Path) -> dict[str, str]:
    return {
        **clean_env(),
        "TIERSTORE_SOURCE": str(source),
        "TIERSTORE_TIERS": f"{tier}:4G",
        "TIERSTORE_REVALIDATE": "never",
    }


@dataclass
class Epochs:
    au: list[float]  # percent, per epoch
    samples: list[float]  # samples/s, per epoch
    cpu: float = 0.0  # CPU seconds of the whole job: DLIO, its workers and the tierstore run wrapper


def summary(out: Path) -> Epochs:
    m = json.loads((out / "summary.json").read_text())["metric"]
    return Epochs(list(m["train_au_percentage"]), list(m["train_throughput_samples_per_second"]))


def train_round(
    dlio_bin: Path, w: Training, backing: Path, mount: Path, root: Path, r: int
) -> dict[str, dict[str, Epochs]]:
    """Round `r` of a training workload: every setup with the workload's compute, and with none, the
    setups' order rotated by one each round so that none always follows the same one."""
    result: dict[str, dict[str, Epochs]] = {}
    tier = Path("/dev/shm") / f"tierstore-bench-dlio-tier-{os.getpid()}"
    k = r % len(SETUPS)
    for setup in SETUPS[k:] + SETUPS[:k]:
        result[setup] = {}
        for kind, compute in (("au", w.compute), ("capacity", 0.0)):
            data = backing if setup == "local copy" else mount
            overrides = [*w.overrides(data / w.name), f"++workload.train.computation_time={compute}"]
            shutil.rmtree(tier, ignore_errors=True)
            wrap = setup == "tierstore run"
            env = cache_env(mount, tier) if wrap else clean_env()
            before = children_cpu()
            out = dlio(
                dlio_bin, overrides, root / "out" / f"{w.name}-{kind}-{setup.replace(' ', '-')}", env, wrap
            )
            cpu = children_cpu() - before
            shutil.rmtree(tier, ignore_errors=True)
            result[setup][kind] = replace(summary(out), cpu=cpu)
            print(f"{w.name} {setup} {kind}: {result[setup][kind]}", file=sys.stderr, flush=True)
    return result


def mpi_round(
    dlio_bin: Path, w: Training, backing: Path, mount: Path, root: Path, ranks: int
) -> dict[str, Epochs]:
    """DLIO's own multi-process mode, as a cross-check of the accelerator counts computed from one
    process's capacity: every setup once with the workload's compute, as `ranks` MPI ranks."""
    result: dict[str, Epochs] = {}
    tier = Path("/dev/shm") / f"tierstore-bench-dlio-tier-{os.getpid()}"
    for setup in SETUPS:
        data = backing if setup == "local copy" else mount
        overrides = [*w.overrides(data / w.name), f"++workload.train.computation_time={w.compute}"]
        shutil.rmtree(tier, ignore_errors=True)
        wrap = setup == "tierstore run"
        env = cache_env(mount, tier) if wrap else clean_env()
        name = f"{w.name}-mpi{ranks}-{setup.replace(' ', '-')}"
        result[setup] = summary(dlio(dlio_bin, overrides, root / "out" / name, env, wrap, ranks))
        shutil.rmtree(tier, ignore_errors=True)
        print(f"{w.name} {setup} {ranks} ranks: {result[setup]}", file=sys.stderr, flush=True)
    return result


def mpi_report(
    w: Training, ranks: int, mpi: dict[str, Epochs], rounds: list[dict[str, dict[str, Epochs]]]
) -> list[str]:
    """The cross-check's table: each setup's AU with `ranks` ranks as DLIO measured it (its mean over the
    ranks), beside the AU the one-process capacity predicts for that many accelerators."""
    lines = [
        f"### {w.name}: {ranks} MPI ranks, DLIO's own multi-process mode (a cross-check)",
        "",
        f"Each setup once, with the compute, as {ranks} ranks of {w.threads} DataLoader workers each (on 2 cores). "
        f"Predicted: the AU {ranks} accelerators get from the capacity measured above with one process "
        f"(median over the rounds of the mean of epochs 2 on), min(100, C / ({ranks} D)).",
        "",
        "| setup | AU % predicted, epoch 2 on | AU % measured (epoch "
        + " / ".join(str(e + 1) for e in range(w.epochs))
        + ") | samples/s of all ranks |",
        "|---|---:|---|---|",
    ]
    for s in SETUPS:
        capacity = median([statistics.mean(r[s]["capacity"].samples[1:]) for r in rounds])
        predicted = min(100.0, 100.0 * capacity / (ranks * w.demand))
        au = " / ".join(f"{x:.1f}" for x in mpi[s].au)
        sps = " / ".join(f"{x:.1f}" for x in mpi[s].samples)
        lines.append(f"| {s} | {predicted:.1f} | {au} | {sps} |")
    return lines


def generate(dlio_bin: Path, w: Training, backing: Path, root: Path) -> None:
    """The workload's dataset, generated by DLIO into the store's backing directory (once)."""
    marker = backing / f".complete-{w.name}-{w.files}-{w.record}"
    if marker.exists():
        return
    shutil.rmtree(backing / w.name, ignore_errors=True)
    dlio(
        dlio_bin,
        [
            *w.overrides(backing / w.name),
            "++workload.workflow.generate_data=True",
            "++workload.workflow.train=False",
        ],
        root / "out" / f"{w.name}-generate",
        clean_env(),
        False,
    )
    marker.touch()


READ_JOB = r"""
import os, sys, time
files = sys.argv[1:]
t = time.perf_counter()  # timed from the first open: under tierstore run, an open fetches the file
for f in files:  # out of the page cache, so that the read reaches the file's device
    fd = os.open(f, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
n = 0
for f in files:
    with open(f, "rb", buffering=0) as fh:
        while chunk := fh.read(1 << 20):
            n += len(chunk)
print(n / (time.perf_counter() - t))
"""


def read_back(files: list[Path], env: dict[str, str], wrap: bool) -> float:
    """Bytes per second reading `files` whole, in a subprocess (under `tierstore run` if `wrap`)."""
    cmd = [PY, "-c", READ_JOB, *map(str, files)]
    if wrap:
        cmd = [PY, "-m", "tierstore.cli", "run", "--", *cmd]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"reading the checkpoint back failed: {p.stderr[-2000:]}")
    return float(p.stdout.strip().splitlines()[-1])


def ckpt_durations(out: Path) -> list[float]:
    """Seconds of every checkpoint DLIO took, from its start and end timestamps."""
    stats = json.loads((out / "per_epoch_stats.json").read_text())
    return [
        (datetime.fromisoformat(v["end"]) - datetime.fromisoformat(v["start"])).total_seconds()
        for epoch in stats.values()
        if isinstance(epoch, dict)
        for k, v in epoch.items()
        if k.startswith("ckpt")
    ]


@dataclass
class Ckpt:
    size: int  # bytes of one checkpoint
    write: list[float]  # bytes/s per checkpoint
    read: float  # bytes/s, the last checkpoint read back
    synced: float = 0.0  # tierstore: seconds from the job's end until `tierstore sync` returned


@contextlib.contextmanager
def writeback_agent(dest: Path, fsynced: Path, stage: Path, root: Path) -> Iterator[dict[str, str]]:
    """The node's agent with `dest` (the default durability) and `fsynced` (durability "local") write-back
    destinations staged on `stage`; yields the jobs' env."""
    env = {
        **clean_env(),
        "XDG_RUNTIME_DIR": str(root / "run"),
        "TIERSTORE_WRITEBACK": f"{dest}:{stage}:8G,{fsynced}:{stage}:8G:local",
    }
    (root / "run").mkdir(parents=True, exist_ok=True)
    saved = dict(os.environ)
    os.environ.update(env)
    from tierstore import agent, writeback

    writeback.reload()
    pid, _ = agent.start(agent.default_socket(), env=env, idle_exit=600)
    try:
        yield env
    finally:
        agent.stop(agent.default_socket())
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
        os.environ.clear()
        os.environ.update(saved)


def ckpt_round(dlio_bin: Path, root: Path, store_mount: Path, local: Path, r: int) -> dict[str, Ckpt]:
    """Round `r` of the checkpointing workload, the setups' order rotated by one each round."""
    import tierstore

    data = local / "llama-data"
    if not (data / "train").exists():
        dlio(
            dlio_bin,
            [
                *ckpt_overrides(data, local / "unused"),
                "++workload.workflow.generate_data=True",
                "++workload.workflow.train=False",
            ],
            root / "out" / "ckpt-generate",
            clean_env(),
            False,
        )
    result: dict[str, Ckpt] = {}
    dest, fsynced = store_mount / "ckpt", store_mount / "ckpt-local"
    dest.mkdir(exist_ok=True)
    fsynced.mkdir(exist_ok=True)
    stage = root / "stage"
    with writeback_agent(dest, fsynced, stage, root) as wb_env:
        k = r % len(CKPT_SETUPS)
        for setup in CKPT_SETUPS[k:] + CKPT_SETUPS[:k]:
            folder = {
                "store": store_mount / "direct",
                "tierstore run": dest / "run",
                "tierstore run, local": fsynced / "run",
                "local disk": local / "ckpt",
            }[setup]
            shutil.rmtree(folder, ignore_errors=True)
            wrap = setup.startswith("tierstore run")
            out = dlio(
                dlio_bin,
                ckpt_overrides(data, folder),
                root / "out" / f"ckpt-{re.sub(r'[^a-z0-9]+', '-', setup)}",
                wb_env if wrap else clean_env(),
                wrap,
            )
            synced = 0.0
            if wrap:
                t = time.perf_counter()
                tierstore.sync(str(folder.parent), timeout=600)
                synced = time.perf_counter() - t
            files = sorted(folder.glob("*"))
            size = sum(f.stat().st_size for f in files) // CKPT_STEPS
            last = [f for f in files if f"-{CKPT_STEPS}-0." in f.name]
            env = {
                **wb_env,
                "TIERSTORE_SOURCE": str(folder.parent),
                "TIERSTORE_TIERS": f"{root / 'read-tier'}:2G",
            }
            read = read_back(last, env if wrap else clean_env(), wrap)
            shutil.rmtree(root / "read-tier", ignore_errors=True)
            result[setup] = Ckpt(size, [size / d for d in ckpt_durations(out)], read, synced)
            shutil.rmtree(folder, ignore_errors=True)
            os.sync()
            print(f"checkpoint {setup}: {result[setup]}", file=sys.stderr, flush=True)
    return result


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def accelerators(capacity: float, w: Training) -> float:
    """Simulated accelerators kept at AU >= 90% by `capacity` samples/s."""
    return capacity / (AU_TARGET / 100 * w.demand)


def provenance() -> list[str]:
    """A line naming the tierstore build used, when it is not the checkout's own (a frozen copy of it)."""
    import tierstore

    here = Path(tierstore.__file__).resolve().parent
    if here == REPO / "python" / "tierstore":
        return []
    return [
        f"- tierstore: the build at `{here}` (the package with its `_core` and shim), not the checkout's."
    ]


def train_report(w: Training, rounds: list[dict[str, dict[str, Epochs]]]) -> tuple[list[str], bool]:
    """The workload's table (medians over rounds per epoch) and whether its target is met."""
    epochs = range(w.epochs)

    def med(setup: str, kind: str, field: str, e: int) -> float:
        return median([getattr(r[setup][kind], field)[e] for r in rounds])

    # N per round and setup from the mean capacity of epochs 2 on (DLIO's own summary averages epochs too).
    accel = {
        s: [accelerators(statistics.mean(r[s]["capacity"].samples[1:]), w) for r in rounds] for s in SETUPS
    }
    ratios = [
        a / b for a, b in zip(accel["tierstore run"], accel["local copy"], strict=True)
    ]  # paired in the round
    au_ok = all(med("tierstore run", "au", "au", e) >= AU_TARGET for e in epochs[1:])
    ok = au_ok and verdict(ratios, ACCEL_TARGET) != "missed"  # undecided is not a miss
    mb = w.record / MIB
    per_epoch = " / ".join(str(e + 1) for e in epochs)
    lines = [
        f"## {w.name}",
        "",
        f"{w.files} {w.format} files of one sample, {mb:.2f} MiB mean{f' (sd {w.stdev / MIB:.2f} MiB)' if w.stdev else ''}; "
        f"batch {w.batch}, {w.compute} s of compute per step: one accelerator consumes D = {w.demand:.1f} samples/s "
        f"({w.demand * mb:.0f} MiB/s) at 100% AU. {w.threads} DataLoader workers, {w.epochs} epochs. Medians over the "
        f"{len(rounds)} rounds.",
        "",
        f"| setup | AU % (epoch {per_epoch}) | samples/s ({per_epoch}) | capacity, no compute: samples/s "
        f"({per_epoch}) | accelerators at AU >= 90%, from epoch 2 | vs local copy |",
        "|---|---|---|---|---:|---:|",
    ]
    for s in SETUPS:
        au = " / ".join(f"{med(s, 'au', 'au', e):.1f}" for e in epochs)
        sps = " / ".join(f"{med(s, 'au', 'samples', e):.1f}" for e in epochs)
        cap = " / ".join(f"{med(s, 'capacity', 'samples', e):.0f}" for e in epochs)
        paired = median([a / b for a, b in zip(accel[s], accel["local copy"], strict=True)])
        lines.append(f"| {s} | {au} | {sps} | {cap} | {median(accel[s]):.2f} | {paired:.2f}x |")
    lines += [
        "",
        f"Target (from epoch 2 on, `tierstore run`): AU >= {AU_TARGET:.0f}% in every epoch (median of the rounds) "
        f"({'met' if au_ok else 'missed'}), and at least {ACCEL_TARGET}x the accelerators of the local copy "
        f"(median of the rounds' paired ratios: {median(ratios):.2f}x; rounds "
        f"{', '.join(f'{r:.2f}' for r in ratios)}): **{verdict(ratios, ACCEL_TARGET)}**.",
    ]
    if all(r[s]["capacity"].cpu > 0 for r in rounds for s in SETUPS):
        cpu = {s: [r[s]["capacity"].cpu for r in rounds] for s in SETUPS}
        cpu_ratios = [a / b for a, b in zip(cpu["tierstore run"], cpu["local copy"], strict=True)]
        lines += [
            "",
            "CPU of each round's capacity job (no compute; DLIO, its workers and the `tierstore run` wrapper, all "
            f"{w.epochs} epochs: epoch 1 of `tierstore run` copies every file into the tier): "
            + "; ".join(f"{s} {median(cpu[s]):.1f} s" for s in SETUPS)
            + f" (medians). `tierstore run` over the local copy, per round: {median(cpu_ratios):.2f}x (rounds "
            f"{', '.join(f'{r:.2f}' for r in cpu_ratios)}).",
        ]
    return lines, ok


def ckpt_report(rounds: list[dict[str, Ckpt]], store_bw: str) -> tuple[list[str], bool]:
    size = rounds[0]["local disk"].size
    write = {s: median([median(r[s].write) for r in rounds]) for s in CKPT_SETUPS}
    read = {s: median([r[s].read for r in rounds]) for s in CKPT_SETUPS}
    per_round = [median(r["tierstore run"].write) / median(r["local disk"].write) for r in rounds]
    ratio = median(per_round)
    ratio_local = median(
        [median(r["tierstore run, local"].write) / median(r["local disk"].write) for r in rounds]
    )
    judged = verdict(per_round, WRITE_TARGET)
    ok = judged != "missed"
    synced = median([r["tierstore run"].synced for r in rounds])
    lines = [
        "## Checkpointing, llama3-8b-shaped",
        "",
        f"One checkpoint: {size / MIB:.0f} MiB in {LAYERS + 2} files (llama3-8b's fp16 weights and fp32 Adam "
        f"states divided by {CKPT_SCALE}: embeddings and head, {LAYERS} layer files, the optimizer groups), written "
        f"by DLIO's PyTorch checkpointing (`torch.save`, no fsync) after each of {CKPT_STEPS} steps of "
        f"{CKPT_COMPUTE:g} s. The store: a stand-in store with writes capped at {store_bw}, its files in RAM. "
        "Write throughput: bytes of a checkpoint over DLIO's checkpoint duration, the median of the job's "
        f"checkpoints. Medians over the {len(rounds)} rounds.",
        "",
        "| setup | write MiB/s | vs local disk | read MiB/s (not DLIO: see below) |",
        "|---|---:|---:|---:|",
    ]
    for s in CKPT_SETUPS:
        lines.append(
            f"| {s} | {write[s] / MIB:.0f} | {write[s] / write['local disk']:.2f}x | {read[s] / MIB:.0f} |"
        )
    lines += [
        "",
        "Every round (write MiB/s, the median of the job's checkpoints; the ratios are to the same round's "
        "local disk):",
        "",
        "| round | " + " | ".join(CKPT_SETUPS) + ' | tierstore run / local disk | "local" / local disk |',
        "|---:|" + "---:|" * (len(CKPT_SETUPS) + 2),
    ]
    for i, r in enumerate(rounds):
        mibs = " | ".join(f"{median(r[s].write) / MIB:.0f}" for s in CKPT_SETUPS)
        local_disk = median(r["local disk"].write)
        lines.append(
            f"| {i + 1} | {mibs} | {median(r['tierstore run'].write) / local_disk:.2f}x "
            f"| {median(r['tierstore run, local'].write) / local_disk:.2f}x |"
        )
    lines += [
        "",
        f"Target: write throughput through staging with the default durability >= {WRITE_TARGET}x the local "
        f"disk's (median of the rounds' paired ratios: {ratio:.2f}x): **{judged}**. With "
        f'durability "local" (recorded, no target): {ratio_local:.2f}x. After the staged job, `tierstore sync` '
        f"took {synced:.1f} s more until every checkpoint was on the store (median).",
        "",
        'With the default durability ("buffered") a close leaves the bytes in the page cache, as the local-disk '
        "job's `torch.save` does, and costs one record appended to the stage's log of closes (the agent hashes "
        'the files and commits the journal after the burst); with "local" each close also hashes and fsyncs '
        "the file and commits the journal, so it runs at the disk's write speed rather than the page cache's.",
        "",
        "Read: DLIO 2.0.0, the release on PyPI, has no checkpoint-read phase (DLIO's main branch added one with "
        "the llama workloads, not released), so the script reads the last checkpoint's files itself, whole, "
        "in 1 MiB reads, after dropping them from the page cache (timed from the first open): from the store, "
        "under `tierstore run` after the sync (the destination as the cache's source, an empty tier on the local "
        "disk: the first open of each file fetches it from the store, and the reads are served from the tier), "
        "and from the local disk.",
    ]
    return lines, ok


def plot(
    w_rounds: dict[str, tuple[Training, list[dict[str, dict[str, Epochs]]]]],
    ck: list[dict[str, Ckpt]],
    path: Path,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(w_rounds) + 1, figsize=(5 * (len(w_rounds) + 1), 4))
    for ax, (name, (w, rounds)) in zip(axes, w_rounds.items(), strict=False):
        for s in SETUPS:
            ys = [median([r[s]["capacity"].samples[e] for r in rounds]) for e in range(w.epochs)]
            ax.plot(range(1, w.epochs + 1), [accelerators(y, w) for y in ys], marker="o", label=s)
        ax.set_xlabel("epoch")
        ax.set_xticks(range(1, w.epochs + 1))
        ax.set_ylabel("simulated accelerators at AU >= 90%")
        ax.set_title(f"{name} (computed from capacity)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize="small")
    ax = axes[-1]
    xs = range(len(CKPT_SETUPS))
    write = [median([median(r[s].write) for r in ck]) / MIB for s in CKPT_SETUPS]
    read = [median([r[s].read for r in ck]) / MIB for s in CKPT_SETUPS]
    ax.bar([x - 0.2 for x in xs], write, 0.4, label="write (DLIO)")
    ax.bar([x + 0.2 for x in xs], read, 0.4, label="read back (not DLIO)")
    ax.set_xticks(list(xs), list(CKPT_SETUPS))
    ax.set_ylabel("MiB/s")
    ax.set_title("llama3-8b-shaped checkpoint")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write the results as Markdown here")
    ap.add_argument("--plot", type=Path, help="write the PNG figure here")
    ap.add_argument("--root", type=Path, default=Path("/var/tmp/tierstore-bench-dlio"))
    ap.add_argument(
        "--dlio",
        type=Path,
        default=REPO / ".venv-dlio" / "bin" / "dlio_benchmark",
        help="DLIO's command (make bench-dlio-setup installs it)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every setup; tables give medians")
    ap.add_argument("--ckpt-store-bw", default="200MiB/s", help="the checkpoint store's write cap")
    ap.add_argument(
        "--ranks",
        type=int,
        default=2,
        help="MPI ranks of the multi-process cross-check of each training workload (0: none)",
    )
    ap.add_argument(
        "--only",
        choices=("unet3d", "resnet50", "resnet50-hdf5", "checkpoint"),
        help="one workload (while iterating)",
    )
    args = ap.parse_args(argv)
    # A stopped run still unmounts its stores and stops its agent (their `finally` blocks).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    python = Path(sys.executable)
    python_name = str(python.relative_to(REPO)) if python.is_relative_to(REPO) else str(python)
    command = " ".join([python_name, "bench/bench_dlio.py", *(argv if argv is not None else sys.argv[1:])])
    if not args.dlio.exists():
        print(f"error: no DLIO at {args.dlio}: run `make bench-dlio-setup`", file=sys.stderr)
        return 2
    root: Path = args.root
    backing, local = root / "backing", root / "local"
    for d in (backing, local):
        d.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    workloads = [w for w in (UNET3D, RESNET50, RESNET50_HDF5) if args.only in (None, w.name)]
    trained: dict[str, tuple[Training, list[dict[str, dict[str, Epochs]]]]] = {}
    mpi: dict[str, dict[str, Epochs]] = {}
    mpi_failed: dict[str, str] = {}
    ck: list[dict[str, Ckpt]] = []
    with mounted(backing, root / "store") as mount:
        for w in workloads:
            generate(args.dlio, w, backing, root)
        # The cross-check first: a failure of mpirun shows at once, and is said on the page.
        for w in workloads if args.ranks > 1 else []:
            print(f"{w.name}: {args.ranks} MPI ranks", file=sys.stderr, flush=True)
            try:
                mpi[w.name] = mpi_round(args.dlio, w, backing, mount, root, args.ranks)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                mpi_failed[w.name] = str(e).splitlines()[0]
                print(f"{w.name}: the cross-check failed: {e}", file=sys.stderr, flush=True)
        for r in range(args.rounds):
            for w in workloads:
                print(f"{w.name}: round {r + 1} of {args.rounds}", file=sys.stderr, flush=True)
                trained.setdefault(w.name, (w, []))[1].append(
                    train_round(args.dlio, w, backing, mount, root, r)
                )
    if args.only in (None, "checkpoint"):
        ck_backing = Path("/dev/shm") / f"tierstore-bench-dlio-ckpt-store-{os.getpid()}"
        ck_backing.mkdir()
        try:
            with mounted(ck_backing, root / "ckpt-store", write_bandwidth=args.ckpt_store_bw) as ck_mount:
                for r in range(args.rounds):
                    print(f"checkpoint: round {r + 1} of {args.rounds}", file=sys.stderr, flush=True)
                    ck.append(ckpt_round(args.dlio, root, ck_mount, local, r))
        finally:
            shutil.rmtree(ck_backing, ignore_errors=True)
    # Every figure as measured, for a second look at the rounds (DLIO's own output is under --root/out).
    raw = {
        "training": {
            n: [{s: {k: e.__dict__ for k, e in r[s].items()} for s in r} for r in rs]
            for n, (_, rs) in trained.items()
        },
        "checkpoint": [{s: c.__dict__ for s, c in r.items()} for r in ck],
        "mpi": {n: {s: e.__dict__ for s, e in r.items()} for n, r in mpi.items()},
    }
    (root / "results.json").write_text(json.dumps(raw, indent=1))
    version = (
        subprocess.run(
            [str(args.dlio.parent / "pip"), "show", "dlio-benchmark"], capture_output=True, text=True
        )
        .stdout.split("Version: ", 1)[-1]
        .split()[0]
    )
    ok = True
    lines = [
        "# MLPerf Storage workloads through DLIO",
        "",
        "```",
        command,
        "```",
        "",
        f"- DLIO: `dlio-benchmark` {version} (PyPI) in `.venv-dlio`, driven by `bench/bench_dlio.py`; its "
        "`summary.json` and `per_epoch_stats.json` are the source of every training figure and of the write "
        "throughput. The workloads start from DLIO's own `unet3d_h100` and `resnet50_h100` configurations, "
        "scaled as each section says (the module docstring of `bench/bench_dlio.py` gives the reasons).",
        f"- The machine: {machine.describe()}.",
        *provenance(),
        "- The stand-in store: `tierstore.testing.slowfs` over a local directory with its defaults (1 ms per "
        "metadata operation, 0.5 ms per read, 500 MiB/s). `tierstore run`: a fresh tier on /dev/shm each job, "
        "`--revalidate never`. The local copy: the store's backing directory on the local disk, read directly "
        "(in the page cache).",
        "- Accelerators at AU >= 90% are computed, not run: a second DLIO job per setup has no compute "
        "(`computation_time=0`), so its samples/s is the capacity C of the setup's I/O path for one DLIO "
        "process with its workers; one accelerator consumes D = batch / compute samples/s at 100% AU, so N "
        "accelerators stay at AU >= 90% while N <= C / (0.9 D). Per round, the mean capacity of epochs 2 "
        "on gives N; the ratio to the local copy is taken within each round. Running N MPI ranks instead would "
        "measure this 2-core machine's CPU, not the storage; "
        + (
            f"DLIO's own multi-process mode with {args.ranks} ranks is run once per setup as a cross-check of "
            "the prediction (under each workload), before the rounds."
            if args.ranks > 1
            else "DLIO's own multi-process mode was not run (`--ranks 0`)."
        ),
        f"- Rounds: {args.rounds}, every setup once per round, their order rotated by one each round; the "
        "whole run took "
        f"{(time.perf_counter() - t0) / 60:.0f} minutes.",
        "",
    ]
    for w, rounds in trained.values():
        part, met = train_report(w, rounds)
        lines += [*part, ""]
        if w.name in mpi:
            lines += [*mpi_report(w, args.ranks, mpi[w.name], rounds), ""]
        elif w.name in mpi_failed:
            lines += [f"The {args.ranks}-rank cross-check of {w.name} failed: {mpi_failed[w.name]}", ""]
        ok = ok and met
    if ck:
        part, met = ckpt_report(ck, args.ckpt_store_bw)
        lines += [*part, ""]
        ok = ok and met
    if args.out and args.plot:
        link = os.path.relpath(args.plot, args.out.parent)
        lines += [f"![accelerators at AU >= 90% per epoch, and checkpoint throughput]({link})", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.plot and trained and ck:
        plot(trained, ck, args.plot)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
