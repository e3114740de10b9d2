"""Benchmark of the model repository (`tierstore.models`) against torch.save, safetensors, h5py and raw I/O.

One file of about 1,300 lines, on purpose: one benchmark's workloads, baselines, paired rounds and report
read together, and no other script uses any of it.

Workloads, all float32 with random weights built locally (no downloads):

  synthetic-10/100/1000  DStore's generator: 1 GiB in 10, 100 or 1000 tensors, sizes drawn uniformly within
                         +-30% of total/layers (seeded), then scaled so that they sum to the total.
  vgg19                  the parameter shapes of torchvision's VGG19 (16 3x3 convs + 3 linear layers,
                         548 MiB).
  bert-large             the parameter shapes of BERT-large (24 layers, hidden 1024, 1.34 GB).

Systems, each saving to and loading from its own directory on the same local disk:

  raw          every tensor's bytes written into one file (one writev per 1024 tensors) + fsync; read
               back with readinto per tensor, sequentially, into fresh buffers: what this machine's disk
               and memory allow.
  raw-par      raw's file read with 4 threads in 8 MiB preadv pieces: the virtual disk here can read
               faster with requests in flight, so the load limit is the faster of raw and raw-par.
  tierstore    Repository.save / Repository.load (every tensor's blake3 hash is checked on load); the
               default load maps the pack (copy-on-write, no copy), like safetensors' load_file.
  tierstore-copy  Repository.load(mmap=False): the same load into fresh memory of its own (loads only).
  safetensors  save_file + fsync; load_file (its default mmap backend); safe_open + get_tensor for partial.
  torch        torch.save to an open file + fsync; torch.load(map_location="cpu", weights_only=True).
  h5py         one dataset per tensor, file closed + fsync; each dataset read into numpy, torch.from_numpy.

Measured per workload: the save (fsync included), the full load and a ~25% partial load with the page cache
dropped before every load, and a second save after changing 10% of the tensors. Right before every timed
save and load, twice the model's bytes of memory are touched and freed (see `prime_memory`). Every loaded tensor is
touched once per 4 KiB page inside the timing, so lazy (mmap) loaders pay for reading their bytes like the
eager ones; the first repetition of each load is checked byte for byte against the saved model, outside the
timing. Then the stable-ID hashing of a 1000-layer model (`layer_ids`), cold and memoized.

Usage: .venv/bin/python bench/bench_models.py [--small] [--out docs/benchmarks/models.md] [--plot docs/benchmarks/models.png]
The exit status is 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np
import safetensors
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import page
import tierstore
from tierstore import _core
from tierstore.models import Repository, layer_ids
from units import human

MB = 1_000_000
MiB = 1 << 20
GiB = 1 << 30
PAGE = 4096

# The targets of the issue.
RAW_FACTOR = 1.3  # tierstore save and cold load within 1.3x of raw
PARTIAL_RATIO = 0.35  # a 25% partial load at most 0.35x the full load
PARTIAL_FRACTION = 0.25
CHANGED_FRACTION = 0.10  # tensors changed (by count) before the second save
SECOND_SAVE_MAX = 0.15  # ... which may write at most 15% of the model's bytes
LAYER_ID_MS = 5.0
LAYER_ID_LAYERS = 1000
LAYER_ID_CALLS = 50

SAVE_SYSTEMS = ("raw", "tierstore", "safetensors", "torch", "h5py")
# raw-par reads raw's file with several threads: on this virtual disk, parallel reads can beat one
# sequential stream, and the limit a loader is held to must be the faster of the two.
LOAD_SYSTEMS = ("raw", "raw-par", "tierstore", "tierstore-copy", "safetensors", "torch", "h5py")
RAW_THREADS = 4
RAW_CHUNK = 8 * MiB
# The systems whose second save is compared: the two formats that rewrite the whole file, and tierstore.
SECOND_SAVE_SYSTEMS = ("tierstore", "safetensors", "torch")
COLORS = {
    "raw": "#9e9e9e",
    "raw-par": "#e0e0e0",
    "tierstore": "#1f77b4",
    "tierstore-copy": "#aec7e8",
    "safetensors": "#ff7f0e",
    "torch": "#2ca02c",
    "h5py": "#d62728",
}
HATCH = {"raw": "//", "raw-par": "xx"}

StateDict = dict[str, torch.Tensor]


# ------------------------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Workload:
    """A named set of tensor shapes; the tensors are generated when the workload runs."""

    name: str
    title: str
    shapes: list[tuple[str, tuple[int, ...]]]

    @property
    def nbytes(self) -> int:
        return sum(4 * math.prod(s) for _, s in self.shapes)


def synthetic(total: int, layers: int, variance: float = 0.30, seed: int = 0) -> Workload:
    """DStore's synthetic generator: `layers` tensors summing to `total` bytes, each within +-variance of
    the mean before the rescaling to the exact total."""
    rng = np.random.default_rng(seed + layers)
    weights = rng.uniform(1 - variance, 1 + variance, layers)
    elems = np.floor(weights / weights.sum() * (total // 4)).astype(np.int64)
    elems[-1] += total // 4 - int(elems.sum())  # the rounding remainder, so the total is exact
    return Workload(
        f"synthetic-{layers}",
        f"synthetic, {human(total, 2)} in {layers} tensors (+-{variance:.0%} size variance)",
        [(f"layers.{i:04d}.weight", (int(n),)) for i, n in enumerate(elems)],
    )


def vgg19(div: int = 1) -> Workload:
    """The parameters of torchvision's VGG19 under torchvision's names (features.N are the conv layers,
    classifier.0/3/6 the linear ones); `div` narrows every layer for the quick mode."""
    cfg = [
        64,
        64,
        "M",
        128,
        128,
        "M",
        256,
        256,
        256,
        256,
        "M",
        512,
        512,
        512,
        512,
        "M",
        512,
        512,
        512,
        512,
        "M",
    ]
    shapes: list[tuple[str, tuple[int, ...]]] = []
    idx, cin = 0, 3
    for v in cfg:
        if v == "M":
            idx += 1
            continue
        cout = int(v) // div
        shapes += [(f"features.{idx}.weight", (cout, cin, 3, 3)), (f"features.{idx}.bias", (cout,))]
        cin = cout
        idx += 2  # conv, then ReLU
    hidden = 4096 // div
    for i, (fin, fout) in enumerate([(cin * 7 * 7, hidden), (hidden, hidden), (hidden, 1000)]):
        shapes += [(f"classifier.{3 * i}.weight", (fout, fin)), (f"classifier.{3 * i}.bias", (fout,))]
    return Workload("vgg19", "VGG19-shaped" + (f" (1/{div} width)" if div > 1 else ""), shapes)


def bert(layers: int = 24, hidden: int = 1024, inter: int = 4096, vocab: int = 30522) -> Workload:
    """The parameters of BERT (HuggingFace names): embeddings, `layers` encoder layers with q/k/v/o,
    LayerNorms and the feed-forward pair, and the pooler."""
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("embeddings.word_embeddings.weight", (vocab, hidden)),
        ("embeddings.position_embeddings.weight", (512, hidden)),
        ("embeddings.token_type_embeddings.weight", (2, hidden)),
        ("embeddings.LayerNorm.weight", (hidden,)),
        ("embeddings.LayerNorm.bias", (hidden,)),
    ]
    for i in range(layers):
        p = f"encoder.layer.{i}"
        for name in ("query", "key", "value"):
            shapes += [
                (f"{p}.attention.self.{name}.weight", (hidden, hidden)),
                (f"{p}.attention.self.{name}.bias", (hidden,)),
            ]
        shapes += [
            (f"{p}.attention.output.dense.weight", (hidden, hidden)),
            (f"{p}.attention.output.dense.bias", (hidden,)),
            (f"{p}.attention.output.LayerNorm.weight", (hidden,)),
            (f"{p}.attention.output.LayerNorm.bias", (hidden,)),
            (f"{p}.intermediate.dense.weight", (inter, hidden)),
            (f"{p}.intermediate.dense.bias", (inter,)),
            (f"{p}.output.dense.weight", (hidden, inter)),
            (f"{p}.output.dense.bias", (hidden,)),
            (f"{p}.output.LayerNorm.weight", (hidden,)),
            (f"{p}.output.LayerNorm.bias", (hidden,)),
        ]
    shapes += [("pooler.dense.weight", (hidden, hidden)), ("pooler.dense.bias", (hidden,))]
    title = f"BERT-shaped ({layers} layers, hidden {hidden})"
    return Workload("bert-large" if layers == 24 else f"bert-{layers}", title, shapes)


def materialize(w: Workload, seed: int = 0) -> StateDict:
    """Random weights for every tensor, each in its own storage (safetensors refuses shared storage, and
    torch.save would write a shared one once)."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.empty(shape).uniform_(-1, 1, generator=g) for name, shape in w.shapes}


def pick_partial(sizes: Sequence[int], fraction: float = PARTIAL_FRACTION) -> list[int]:
    """Indices of tensors whose bytes sum to about `fraction` of the model, spread over the whole model.

    Walking the tensors in order, a tensor is taken when that brings the bytes taken closer to `fraction` of
    the bytes walked so far; a tensor that would overshoot the goal by more than 5% is skipped (VGG19's first
    linear layer alone is 75% of the model). The largest remaining tensors that fit top the selection up.
    """
    goal = fraction * sum(sizes)
    chosen: set[int] = set()
    taken = walked = 0
    for i, nb in enumerate(sizes):
        walked += nb
        line = fraction * walked
        if abs(taken + nb - line) < abs(taken - line) and taken + nb <= 1.05 * goal:
            chosen.add(i)
            taken += nb
    for i in sorted(set(range(len(sizes))) - chosen, key=lambda i: -sizes[i]):
        if taken >= 0.95 * goal:
            break
        if taken + sizes[i] <= 1.05 * goal:
            chosen.add(i)
            taken += sizes[i]
    return sorted(chosen)


# ------------------------------------------------------------------------------------------- helpers


def fsync_path(path: Path) -> None:
    """fsync of a file some library wrote and closed: its bytes are on the disk when this returns."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def byte_view(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a uint8 numpy array, without a copy (the tensors here are contiguous)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def write_all(f: object, buf: np.ndarray) -> None:
    """Writes a whole buffer with an unbuffered file, which may accept less than asked per call."""
    mv = memoryview(buf)
    while mv.nbytes:
        n = f.write(mv)  # type: ignore[attr-defined]
        mv = mv[n:]


def touch(tensors: StateDict) -> int:
    """Reads one byte per 4 KiB page and the last byte of every tensor, so that a lazy (mmap) loader has
    really read every page from the file; negligible for tensors already in memory."""
    acc = 0
    for t in tensors.values():
        b = t.reshape(-1).view(torch.uint8)
        if b.numel():
            acc += int(b[::PAGE].sum()) + int(b[-1])
    return acc


def drop_page_cache(notes: list[str]) -> None:
    """Drops the page cache so that the next load reads from the disk (needs root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError as e:
        msg = f"the page cache could not be dropped ({e}): 'cold' loads may have read from RAM"
        if msg not in notes:
            print(f"note: {msg}")
            notes.append(msg)


def disk_reads() -> int:
    """Bytes this process has fetched from the disk so far (page faults of mappings and readahead
    included): `read_bytes` of /proc/self/io."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def prime_memory(nbytes: int) -> None:
    """Touches `nbytes` of fresh memory and frees it, right before a timed step.

    This VM reports freed memory to its host (virtio-balloon free page reporting, about 2 s after the
    free), and the host backs a reported page again only when it is next touched: slowly. A step that
    allocates its page cache or buffers from reported pages ran about 4x slower (1 GiB written and
    fsynced: 2.2-2.4 s after a pause, 0.53-0.62 s right after this priming). Which pages a step gets
    was chance, so every system paid it at random; priming gives every step pages the host backs.
    """
    buf = np.ones(nbytes, dtype=np.uint8)
    del buf


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def rotated(items: Sequence[str], k: int) -> list[str]:
    """The systems in a different order every repetition, so that none always runs first after a drop or
    right after a neighbour's writeback."""
    k %= len(items)
    return [*items[k:], *items[:k]]


# --------------------------------------------------------------------------------------------- systems


class System:
    """One way of storing a state_dict in `root`: save, full or partial load, and a second save."""

    name = ""

    def __init__(self, root: Path) -> None:
        self.root = root

    def reset(self) -> None:
        """Removes what the last save wrote, so that the next save starts from an empty directory."""
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)

    def save(self, sd: StateDict) -> None:
        raise NotImplementedError

    def load(self, keys: list[str] | None) -> StateDict:
        raise NotImplementedError

    def save_again(self, sd: StateDict) -> int:
        """Saves a changed model beside the first; returns the bytes written."""
        raise NotImplementedError

    def undo_save_again(self) -> None:
        raise NotImplementedError


class Raw(System):
    name = "raw"

    def save(self, sd: StateDict) -> None:
        self.layout: dict[str, tuple[int, torch.Size]] = {}
        path = self.root / "model.bin"
        offset = 0
        views = []
        for k, t in sd.items():
            views.append(byte_view(t))
            self.layout[k] = (offset, t.shape)
            offset += views[-1].nbytes
        # A write per tensor costs more than its bytes on this VM (1000 writes of 1 MiB: 2.6-3.5 s, against
        # 0.25-0.36 s in writevs): the limit writes up to 1024 tensors per call.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for i in range(0, len(views), 1024):
                writev_all(fd, views[i : i + 1024])
            os.fsync(fd)
        finally:
            os.close(fd)

    def load(self, keys: list[str] | None) -> StateDict:
        names = sorted(keys or self.layout, key=lambda k: self.layout[k][0])  # in file order: sequential
        out: StateDict = {}
        with open(self.root / "model.bin", "rb", buffering=0) as f:
            for k in names:
                offset, shape = self.layout[k]
                # torch.empty only reserves the memory: its pages are faulted in by the read, as with the
                # other loaders, so the raw limit pays the same first-touch cost.
                t = torch.empty(shape)
                mv = memoryview(byte_view(t))
                f.seek(offset)
                while mv.nbytes:
                    n = f.readinto(mv)
                    if not n:
                        raise EOFError(f"{k}: raw file truncated")
                    mv = mv[n:]
                out[k] = t
        return out


def writev_all(fd: int, bufs: list[np.ndarray]) -> None:
    """writev until every buffer is written (a call may write less than asked)."""
    pending = [memoryview(b) for b in bufs if b.nbytes]
    while pending:
        done = os.writev(fd, pending)
        while pending and done >= pending[0].nbytes:
            done -= pending.pop(0).nbytes
        if pending and done:
            pending[0] = pending[0][done:]


def pread_all(fd: int, offset: int, bufs: list[memoryview]) -> None:
    """preadv until every buffer is full (a read may return less than asked)."""
    done = os.preadv(fd, bufs, offset)
    for b in bufs:
        if done >= b.nbytes:
            done -= b.nbytes
            offset += b.nbytes
            continue
        rest, offset, done = b[done:], offset + done, 0
        while rest.nbytes:
            got = os.preadv(fd, [rest], offset)
            if not got:
                raise EOFError("raw file truncated")
            rest, offset = rest[got:], offset + got


class RawParallel(System):
    """raw's file read by RAW_THREADS threads in RAW_CHUNK pieces (tensors adjacent in the file share a
    piece through preadv's scatter list), into fresh buffers: the disk's limit with requests in flight."""

    name = "raw-par"

    def __init__(self, raw: Raw) -> None:
        super().__init__(raw.root)
        self.raw = raw

    def load(self, keys: list[str] | None) -> StateDict:
        layout = self.raw.layout
        names = sorted(keys or layout, key=lambda k: layout[k][0])
        out = {k: torch.empty(layout[k][1]) for k in names}
        jobs: list[tuple[int, list[memoryview]]] = []
        start, bufs, size = 0, [], 0
        for k in names:
            offset, mv, pos = layout[k][0], memoryview(byte_view(out[k])), 0
            while pos < mv.nbytes:
                # A new piece when the file is not contiguous with the current one, or it is full.
                if bufs and (start + size != offset + pos or size >= RAW_CHUNK or len(bufs) >= 512):
                    jobs.append((start, bufs))
                    bufs, size = [], 0
                if not bufs:
                    start = offset + pos
                take = min(RAW_CHUNK - size, mv.nbytes - pos)
                bufs.append(mv[pos : pos + take])
                size += take
                pos += take
        if bufs:
            jobs.append((start, bufs))
        fd = os.open(self.raw.root / "model.bin", os.O_RDONLY)
        try:
            with ThreadPoolExecutor(RAW_THREADS) as ex:
                list(ex.map(lambda job: pread_all(fd, *job), jobs))
        finally:
            os.close(fd)
        return out


class Tierstore(System):
    name = "tierstore"

    def reset(self) -> None:
        super().reset()
        self.repo = Repository(self.root)  # created outside the timing: a job opens its repository once

    def save(self, sd: StateDict) -> None:
        self.repo.save("model", sd)

    def load(self, keys: list[str] | None) -> StateDict:
        return self.repo.load("model", keys=keys)

    def save_again(self, sd: StateDict) -> int:
        self.second = self.repo.save("model", sd)
        return self.second.written_bytes

    def undo_save_again(self) -> None:
        # Back to one version and its pack only, so that every repetition deduplicates against v1 alone.
        self.repo.delete("model", self.second.version)
        self.repo.gc()


class TierstoreCopy(System):
    """tierstore's load into fresh memory of its own (mmap=False), from the tierstore system's repository."""

    name = "tierstore-copy"

    def __init__(self, ts: Tierstore) -> None:
        super().__init__(ts.root)
        self.ts = ts

    def load(self, keys: list[str] | None) -> StateDict:
        return self.ts.repo.load("model", keys=keys, mmap=False)


class Safetensors(System):
    name = "safetensors"

    def save(self, sd: StateDict, path: Path | None = None) -> None:
        path = path or self.root / "model.safetensors"
        save_file(sd, path)
        fsync_path(path)

    def load(self, keys: list[str] | None) -> StateDict:
        path = self.root / "model.safetensors"
        if keys is None:
            return load_file(path)
        with safe_open(path, framework="pt") as f:
            return {k: f.get_tensor(k) for k in keys}

    def save_again(self, sd: StateDict) -> int:
        path = self.root / "model-v2.safetensors"
        self.save(sd, path)
        return path.stat().st_size

    def undo_save_again(self) -> None:
        (self.root / "model-v2.safetensors").unlink()


class Torch(System):
    name = "torch"

    def save(self, sd: StateDict, path: Path | None = None) -> None:
        with open(path or self.root / "model.pt", "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())

    def load(self, keys: list[str] | None) -> StateDict:
        # torch.load cannot read part of a checkpoint: a partial load is a full load, then a selection.
        sd = torch.load(self.root / "model.pt", map_location="cpu", weights_only=True)
        return sd if keys is None else {k: sd[k] for k in keys}

    def save_again(self, sd: StateDict) -> int:
        path = self.root / "model-v2.pt"
        self.save(sd, path)
        return path.stat().st_size

    def undo_save_again(self) -> None:
        (self.root / "model-v2.pt").unlink()


class H5py(System):
    name = "h5py"

    def save(self, sd: StateDict) -> None:
        path = self.root / "model.h5"
        with h5py.File(path, "w") as f:
            for k, t in sd.items():
                f.create_dataset(k, data=t.numpy())
        fsync_path(path)

    def load(self, keys: list[str] | None) -> StateDict:
        with h5py.File(self.root / "model.h5", "r") as f:
            return {k: torch.from_numpy(f[k][()]) for k in (keys or list(f.keys()))}


CLASSES: dict[str, type[System]] = {c.name: c for c in (Raw, Tierstore, Safetensors, Torch, H5py)}


# -------------------------------------------------------------------------------------------- measuring


@dataclass
class Result:
    """Every repetition of every measurement of one workload, in seconds."""

    workload: Workload
    partial_names: list[str]
    partial_bytes: int
    save: dict[str, list[float]] = field(default_factory=dict)
    full: dict[str, list[float]] = field(default_factory=dict)
    partial: dict[str, list[float]] = field(default_factory=dict)
    second: dict[str, list[float]] = field(default_factory=dict)
    second_written: dict[str, int] = field(default_factory=dict)
    changed_bytes: int = 0
    changed_count: int = 0
    # tierstore's load taken apart: warm loads (bytes already in the page cache) and the hashing alone.
    warm: dict[str, list[float]] = field(default_factory=dict)
    hash_s: list[float] = field(default_factory=list)
    # Bytes each system's first cold partial load fetched from the disk (read_bytes of /proc/self/io).
    partial_fetched: dict[str, int] = field(default_factory=dict)

    def med(self, table: dict[str, list[float]], system: str) -> float:
        return statistics.median(table[system])


def verify(system: str, got: StateDict, sd: StateDict, names: Sequence[str]) -> None:
    """Checks a load byte for byte (outside the timing): a fast wrong answer must not pass."""
    if set(got) != set(names):
        raise AssertionError(f"{system}: loaded {len(got)} tensors, expected {len(names)}")
    for k in names:
        if got[k].shape != sd[k].shape or not torch.equal(got[k], sd[k]):
            raise AssertionError(f"{system}: tensor {k!r} differs from the saved one")


def run_workload(w: Workload, base: Path, reps: int, notes: list[str]) -> Result:
    t0 = time.perf_counter()
    sd = materialize(w)
    names = list(sd)
    sizes = [t.numel() * t.element_size() for t in sd.values()]
    picked = pick_partial(sizes)
    r = Result(w, [names[i] for i in picked], sum(sizes[i] for i in picked))
    print(
        f"\n== {w.name}: {w.title}, {len(names)} tensors, {human(w.nbytes, 2)} "
        f"(generated in {time.perf_counter() - t0:.1f} s); partial: {len(picked)} tensors, "
        f"{r.partial_bytes / w.nbytes:.1%} of the bytes",
        flush=True,
    )
    systems: dict[str, System] = {name: CLASSES[name](base / w.name / name) for name in SAVE_SYSTEMS}
    systems["raw-par"] = RawParallel(systems["raw"])  # type: ignore[arg-type]
    systems["tierstore-copy"] = TierstoreCopy(systems["tierstore"])  # type: ignore[arg-type]
    try:
        # Saves: every repetition starts from an empty directory; the last one's files stay for the loads.
        for rep in range(reps):
            for name in rotated(SAVE_SYSTEMS, rep):
                s = systems[name]
                s.reset()
                # ext4 is mounted with `discard` here: the deleted file's blocks are trimmed at the next
                # journal commit. A sync commits now, so that the timed fsync does not pay for it.
                os.sync()
                gc.collect()
                prime_memory(2 * w.nbytes)
                seconds, _ = timed(lambda s=s: s.save(sd))
                r.save.setdefault(name, []).append(seconds)
        print("  save s:  " + fmt_reps(r.save), flush=True)

        # Cold loads, full then partial, each after dropping the page cache.
        for rep in range(reps):
            for name in rotated(LOAD_SYSTEMS, rep):
                s = systems[name]
                for keys, table in ((None, r.full), (r.partial_names, r.partial)):
                    drop_page_cache(notes)
                    prime_memory(2 * w.nbytes)
                    fetched = disk_reads()
                    seconds, got = timed(lambda s=s, keys=keys: load_and_touch(s, keys))
                    table.setdefault(name, []).append(seconds)
                    if rep == 0 and keys is not None:
                        r.partial_fetched[name] = disk_reads() - fetched
                    if rep == 0:
                        verify(name, got, sd, keys or names)  # type: ignore[arg-type]
                    del got
                    gc.collect()
        print("  full s:  " + fmt_reps(r.full), flush=True)
        print("  part s:  " + fmt_reps(r.partial), flush=True)

        # tierstore's full load taken apart: the same load from the page cache (no disk), the raw read from
        # the page cache, and the blake3 hashing of the model's bytes alone (the integrity check's work).
        for _ in range(reps):
            for name in ("raw", "tierstore"):
                s = systems[name]
                touch(s.load(None))  # brings the bytes into the page cache
                gc.collect()
                prime_memory(w.nbytes)
                seconds, _ = timed(lambda s=s: touch(s.load(None)))
                r.warm.setdefault(name, []).append(seconds)
                gc.collect()
            views = [byte_view(t) for t in sd.values()]
            seconds, _ = timed(lambda views=views: _core.hash_buffers(views))
            r.hash_s.append(seconds)

        # Second save after changing 10% of the tensors (by count, seeded): tierstore writes only the new
        # tensors; safetensors and torch.save write the whole model again.
        changed = random.Random(1).sample(range(len(names)), max(1, round(CHANGED_FRACTION * len(names))))
        with torch.no_grad():
            for i in changed:
                sd[names[i]].add_(1.0)
        r.changed_count = len(changed)
        r.changed_bytes = sum(sizes[i] for i in changed)
        for rep in range(reps):
            for name in rotated(SECOND_SAVE_SYSTEMS, rep):
                s = systems[name]
                gc.collect()
                prime_memory(2 * w.nbytes)
                seconds, written = timed(lambda s=s: s.save_again(sd))
                r.second.setdefault(name, []).append(seconds)
                r.second_written[name] = int(written)  # type: ignore[call-overload]
                s.undo_save_again()
                os.sync()  # the trim of what was deleted, outside the next timing (see the saves)
        print("  2nd s:   " + fmt_reps(r.second), flush=True)
        print(
            f"  2nd save: {r.changed_count} tensors changed ({r.changed_bytes / w.nbytes:.1%} of the bytes); "
            f"tierstore wrote {r.second_written['tierstore'] / w.nbytes:.1%}",
            flush=True,
        )
    finally:
        shutil.rmtree(base / w.name, ignore_errors=True)
    return r


def load_and_touch(s: System, keys: list[str] | None) -> StateDict:
    got = s.load(keys)
    touch(got)
    return got


def fmt_reps(table: dict[str, list[float]]) -> str:
    return "; ".join(f"{k} " + "/".join(f"{v:.2f}" for v in vs) for k, vs in table.items())


def layer_id_timing() -> dict[str, float]:
    """layer_ids of nn.Sequential(1000 x nn.Linear): the first call (fx trace and every layer's signature),
    then repeated calls on the unchanged model, which use the memoized structure and signatures."""
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(LAYER_ID_LAYERS)])
    cold, ids = timed(lambda: layer_ids(model))
    assert len(ids) == LAYER_ID_LAYERS  # type: ignore[arg-type]
    warm = []
    for _ in range(LAYER_ID_CALLS):
        seconds, again = timed(lambda: layer_ids(model))
        warm.append(seconds)
        assert again == ids
    return {
        "cold_ms": cold * 1e3,
        "median_ms": statistics.median(warm) * 1e3,
        "best_ms": min(warm) * 1e3,
        "worst_ms": max(warm) * 1e3,
    }


# ----------------------------------------------------------------------------------------------- report


@dataclass
class Target:
    name: str
    workload: str
    goal: str
    measured: str
    ok: bool | None  # None: undecided, the rounds straddle the goal


def at_most(ratios: list[float], limit: float) -> bool | None:
    """A target of `ratios <= limit`, judged round by round (page.met, on the inverse ratios)."""
    return page.met([1 / x for x in ratios], 1 / limit)


def targets_of(results: list[Result], ids: dict[str, float]) -> list[Target]:
    """Every timed target from each round's paired ratio: round i of tierstore against round i of the
    baseline (one round runs every system back to back, in a rotating order)."""
    out = []
    for r in results:
        w = r.workload.name

        def paired(table: dict[str, list[float]], base: str | list[float]) -> list[float]:
            other = table[base] if isinstance(base, str) else base
            return [t / b for t, b in zip(table["tierstore"], other, strict=True)]

        ts_save, raw_save, st_save = (r.med(r.save, s) for s in ("tierstore", "raw", "safetensors"))
        ts_full, st_full = r.med(r.full, "tierstore"), r.med(r.full, "safetensors")
        # The load limit of each round: the faster of that round's raw and raw-par.
        raw_rounds = [min(a, b) for a, b in zip(r.full["raw"], r.full["raw-par"], strict=True)]
        raw_full = statistics.median(raw_rounds)
        ts_part = r.med(r.partial, "tierstore")
        written = r.second_written["tierstore"] / r.workload.nbytes
        save_raw, save_st = paired(r.save, "raw"), paired(r.save, "safetensors")
        full_raw, full_st = paired(r.full, raw_rounds), paired(r.full, "safetensors")
        part = [p / f for p, f in zip(r.partial["tierstore"], r.full["tierstore"], strict=True)]
        out += [
            Target(
                "save within 1.3x of raw write+fsync",
                w,
                f"<= {RAW_FACTOR}x",
                f"{page.rounds(save_raw)} (medians {ts_save:.2f} s vs {raw_save:.2f} s)",
                at_most(save_raw, RAW_FACTOR),
            ),
            Target(
                "save no slower than safetensors",
                w,
                "<= 1.00x",
                f"{page.rounds(save_st)} (medians {ts_save:.2f} s vs {st_save:.2f} s)",
                at_most(save_st, 1.0),
            ),
            Target(
                "cold full load within 1.3x of raw read (the faster of raw, raw-par in each round)",
                w,
                f"<= {RAW_FACTOR}x",
                f"{page.rounds(full_raw)} (medians {ts_full:.2f} s vs {raw_full:.2f} s)",
                at_most(full_raw, RAW_FACTOR),
            ),
            Target(
                "cold full load no slower than safetensors",
                w,
                "<= 1.00x",
                f"{page.rounds(full_st)} (medians {ts_full:.2f} s vs {st_full:.2f} s)",
                at_most(full_st, 1.0),
            ),
            Target(
                "25% partial load / full load",
                w,
                f"<= {PARTIAL_RATIO}",
                f"{page.rounds(part).replace('x', '')} (medians {ts_part:.2f} s / {ts_full:.2f} s; "
                f"{r.partial_bytes / r.workload.nbytes:.1%} of the bytes)",
                at_most(part, PARTIAL_RATIO),
            ),
            Target(
                "second save, 10% of tensors changed: bytes written",
                w,
                f"<= {SECOND_SAVE_MAX:.0%} of the model",
                f"{written:.1%} ({r.second_written['tierstore']:,} B; the changed tensors are "
                f"{r.changed_bytes / r.workload.nbytes:.1%})",
                written <= SECOND_SAVE_MAX,
            ),
        ]
    out.append(
        Target(
            f"layer_ids of {LAYER_ID_LAYERS} layers, cached",
            f"nn.Sequential({LAYER_ID_LAYERS} x Linear)",
            f"< {LAYER_ID_MS:.0f} ms",
            f"{ids['median_ms']:.2f} ms median of {LAYER_ID_CALLS} (best {ids['best_ms']:.2f}); "
            f"cold first call {ids['cold_ms']:.0f} ms",
            ids["median_ms"] < LAYER_ID_MS,
        )
    )
    return out


def mbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / MB / seconds:,.0f}"


def workload_table(r: Result) -> list[str]:
    n = r.workload.nbytes
    lines = [
        "| system | save s | save MB/s | cold full load s | load MB/s | 25% partial load s "
        "| partial / full |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in LOAD_SYSTEMS:
        full, part = r.med(r.full, s), r.med(r.partial, s)
        save_cells = f"{r.med(r.save, s):.2f} | {mbps(n, r.med(r.save, s))}" if s in r.save else "- | -"
        label = f"{s} (limit)" if s.startswith("raw") else s
        note = " (loads everything)" if s == "torch" else ""
        lines.append(
            f"| {label} | {save_cells} | {full:.2f} | {mbps(n, full)} | {part:.2f}{note} "
            f"| {part / full:.2f} |"
        )
    return lines


def breakdown_table(results: list[Result]) -> list[str]:
    lines = [
        "| workload | tierstore cold | raw cold | tierstore warm | raw warm | blake3 of all bytes |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        n = r.workload.nbytes
        cells = [
            (r.med(r.full, "tierstore")),
            (r.med(r.full, "raw")),
            (r.med(r.warm, "tierstore")),
            (r.med(r.warm, "raw")),
            statistics.median(r.hash_s),
        ]
        lines.append(
            f"| {r.workload.name} | " + " | ".join(f"{c:.3f} s ({mbps(n, c)} MB/s)" for c in cells) + " |"
        )
    return lines


def second_table(results: list[Result]) -> list[str]:
    lines = [
        "| workload | tensors changed | changed bytes | system | second save s | bytes written "
        "| written / model |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in results:
        n = r.workload.nbytes
        for s in SECOND_SAVE_SYSTEMS:
            written = r.second_written[s]
            lines.append(
                f"| {r.workload.name} | {r.changed_count} of {len(r.workload.shapes)} | "
                f"{r.changed_bytes / n:.1%} | {s} | {r.med(r.second, s):.2f} | {written:,} "
                f"| {written / n:.1%} |"
            )
    return lines


def reps_table(results: list[Result]) -> list[str]:
    lines = [
        "| workload | system | save s | cold full load s | partial load s | second save s |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        for s in LOAD_SYSTEMS:
            cols = [
                "/".join(f"{v:.2f}" for v in table[s]) if s in table else "-"
                for table in (r.save, r.full, r.partial, r.second)
            ]
            lines.append(f"| {r.workload.name} | {s} | " + " | ".join(cols) + " |")
    return lines


def reading_notes(results: list[Result]) -> list[str]:
    """Caveats that hold whatever the run measured, with this run's numbers that support them."""
    spreads = [
        max(v) / min(v)
        for r in results
        for table in (r.save, r.full, r.partial, r.second)
        for v in table.values()
        if min(v) > 0
    ]
    raw_ratios = ", ".join(
        f"{r.workload.name} {r.med(r.partial, 'raw') / r.med(r.full, 'raw'):.2f} / "
        f"{r.med(r.partial, 'raw-par') / r.med(r.full, 'raw-par'):.2f}"
        for r in results
    )
    hash_share = ", ".join(
        f"{r.workload.name} {statistics.median(r.hash_s) / r.med(r.full, 'tierstore'):.0%}" for r in results
    )
    return [
        "- The disk is a virtual block device with a write-back cache on the host. Dropping the page cache "
        "empties this machine's cache only, and the host's cache and neighbours make repetitions of the "
        f"same measurement differ: slowest / fastest repetition is {statistics.median(spreads):.1f}x in the "
        f"median over all measurements here (worst {max(spreads):.1f}x). Read single ratios near a target "
        "with that in mind, and see every repetition below.",
        "- Loads into fresh memory pay its first-touch page faults (zero-filling every 4 KiB page), which on "
        "this virtual machine is a large part of a load. safetensors' default `load_file` maps the file "
        "instead: its tensors are the page cache's own pages, so it neither zero-fills nor copies; so does "
        "tierstore's default load. raw, raw-par, tierstore-copy, torch and h5py copy every byte into memory "
        "of their own, so the raw limit is a copying load's limit.",
        "- A partial load reads scattered ranges, which on this disk cost more per byte than one sequential "
        "stream: the raw reads' own partial / full ratios (sequential / 4 threads) are " + raw_ratios + ". "
        "tierstore's default (mapped) partial load reads the 2 MiB blocks that are at least a third chosen "
        "whole, into huge folios (about 3x faster per byte here than the single pages of exact reads), and "
        "asks for the chosen bytes of the other blocks exactly; what it fetches is listed above each "
        "workload's table.",
        "- tierstore's integrity check (blake3 of every byte, both cores) measured alone takes this share of "
        "its cold full load: " + hash_share + ".",
    ]


def machine(root: Path) -> list[str]:
    with open("/proc/meminfo") as f:
        mem_kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    best, kind, dev = "", "?", "?"
    with open("/proc/mounts") as f:
        for line in f:
            device, mnt, fstype = line.split()[:3]
            if str(root).startswith(mnt) and len(mnt) > len(best):
                best, kind, dev = mnt, fstype, device
    blk = Path("/sys/block") / Path(dev).name
    disk = ""
    if blk.exists():
        sched = (blk / "queue/scheduler").read_text().strip()
        ra = (blk / "queue/read_ahead_kb").read_text().strip()
        disk = f", scheduler {sched}, read-ahead {ra} KiB"
    return [
        f"- CPU: {os.cpu_count()} cores (nproc), {cpu}",
        f"- RAM: {mem_kib / 1024 / 1024:.1f} GiB",
        f"- kernel: {platform.system()} {platform.release()}",
        f"- disk: {root} on {dev}, {kind} ({best}){disk}",
        f"- Python {platform.python_version()}, tierstore {tierstore.__version__}, "
        f"torch {torch.__version__}, "
        f"safetensors {safetensors.__version__}, h5py {h5py.__version__} (HDF5 {h5py.version.hdf5_version}), "
        f"numpy {np.__version__}",
    ]


def report(
    command: str,
    facts: list[str],
    results: list[Result],
    ids: dict[str, float],
    targets: list[Target],
    reps: int,
    notes: list[str],
    seconds: float,
    plot_link: str | None,
) -> str:
    out = [
        "# Model repository benchmarks",
        "",
        "Produced by `bench/bench_models.py`; every number below is measured by that run.",
        "",
        f"Command: `{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {seconds:.0f} s)",
        "",
        "Load average at the end: {:.2f}, {:.2f}, {:.2f} (1, 5, 15 min); the machine is shared.".format(
            *os.getloadavg()
        ),
        "",
        "## Machine",
        "",
        *facts,
        "",
        "## Method",
        "",
        "- Workloads (float32, random weights built locally): "
        + "; ".join(
            f"`{r.workload.name}` {r.workload.title}: {len(r.workload.shapes)} tensors, "
            f"{human(r.workload.nbytes, 2)} ({r.workload.nbytes / MB:,.0f} MB)"
            for r in results
        )
        + ".",
        "- Systems, each in its own directory on the same disk, emptied before every save: "
        "**raw** (all tensor bytes into one file with `os.writev`, up to 1024 tensors per call, + fsync; "
        "read back with `readinto` "
        "per tensor, in file order, into fresh `torch.empty` buffers); **raw-par** (the raw file read by "
        f"{RAW_THREADS} threads in {RAW_CHUNK // MiB} MiB `os.preadv` pieces, tensors adjacent in the file "
        "sharing a piece, into fresh buffers; loads only); **tierstore** (`Repository.save`, "
        "`Repository.load`, which checks the blake3 hash of every tensor it returns; by default it maps the "
        "pack copy-on-write, as safetensors' `load_file` does); **tierstore-copy** (`Repository.load(..., "
        "mmap=False)`: the same checked load into fresh memory of its own; loads only); **safetensors** "
        "(`save_file` + fsync; `load_file`, default mmap backend; `safe_open` + `get_tensor` for the partial "
        "load); **torch** (`torch.save` to an open file + flush + fsync; `torch.load(map_location='cpu', "
        "weights_only=True)`, no mmap); **h5py** (one dataset per tensor, file closed + fsync; each dataset "
        "read with `ds[()]`, then `torch.from_numpy`).",
        "- Saves are timed from the call to the end of the fsync, each into an emptied directory; the "
        "deletion is followed by an untimed `sync`, because ext4 is mounted with `discard` here and would "
        "otherwise trim the deleted blocks inside the next save's fsync. tierstore's save also hashes "
        "every tensor, writes and fsyncs a manifest and fsyncs two directories; it is timed as a user "
        "calls it.",
        "- Right before every timed save and load, twice the model's bytes of memory are touched and freed "
        "(`prime_memory`): this VM hands freed memory back to its host (virtio-balloon free page reporting), "
        "and a step whose page cache or buffers land on such pages ran about 4x slower, at random. "
        "Unprimed, 1 GiB written and fsynced took 2.2-2.4 s after a 3 s pause and 0.53-0.62 s right after "
        "priming.",
        "- The limits: for saves, raw; for loads, the faster (by median) of raw and raw-par. "
        "Before every load, full or partial, the page cache is dropped (`sync; echo 1 > "
        "/proc/sys/vm/drop_caches`). Inside the timing, every loaded tensor is touched once per 4 KiB page "
        "(and at its last byte), so that safetensors' mmap-backed tensors have really been read; for tensors "
        "already in memory this costs about 11 us per tensor plus 4 ms per GB (11 ms for 1000 tensors). "
        "The first repetition of every load is compared with the saved tensors byte for byte, outside the "
        "timing.",
        f"- Partial load: tensors spread over the whole model whose bytes are about "
        f"{PARTIAL_FRACTION:.0%} of it (the exact share is above each table). torch.load cannot read "
        "part of a checkpoint, so its partial load reads everything and then selects.",
        f"- Second save: {CHANGED_FRACTION:.0%} of the tensors (by count, chosen with a seeded random "
        "generator) get +1.0 added, then the model is saved again beside the first save (a new tierstore "
        "version; a second file for safetensors and torch). Between repetitions the new version is deleted "
        "and `gc` removes its pack, so every repetition deduplicates against the first version only.",
        f"- Every measurement is repeated {reps} times with the systems in a rotating order; tables give the "
        "**median** (every repetition is listed at the end). MB = 10^6 bytes; MB/s is the model's bytes "
        "divided by the time.",
        *(f"- Note: {n}" for n in notes),
        "",
        "## Targets",
        "",
        f"Every timed target is judged from each round's paired ratio (tierstore's time over the baseline's "
        f"in the same round, the systems run back to back): PASS when all {reps} rounds meet it, FAIL when "
        "none does, undecided when the rounds straddle it. Measured: the median of those ratios, every "
        "round's in parentheses.",
        "",
        "| target | workload | goal | measured (paired per round) | result |",
        "|---|---|---|---|---|",
        *(
            f"| {t.name} | {t.workload} | {t.goal} | {t.measured} | "
            f"{ {True: 'PASS', False: 'FAIL', None: 'undecided'}[t.ok] } |"
            for t in targets
        ),
        "",
    ]
    if plot_link:
        out += [f"![save, cold load, partial load and second save per workload]({plot_link})", ""]
    for r in results:
        out += [
            f"## {r.workload.name}: {r.workload.title}, {len(r.workload.shapes)} tensors, "
            f"{human(r.workload.nbytes, 2)}",
            "",
            f"Partial load: {len(r.partial_names)} tensors, {r.partial_bytes / MB:,.0f} MB = "
            f"{r.partial_bytes / r.workload.nbytes:.1%} of the bytes. Fetched from the disk by the first "
            "cold partial load, in multiples of those bytes: "
            + ", ".join(f"{name} {n / r.partial_bytes:.2f}x" for name, n in r.partial_fetched.items())
            + ".",
            "",
            *workload_table(r),
            "",
        ]
    out += [
        "## Second save after changing 10% of the tensors",
        "",
        *second_table(results),
        "",
        "## Stable layer IDs",
        "",
        f"`layer_ids(model)` of `nn.Sequential` of {LAYER_ID_LAYERS} `nn.Linear(16, 16)`: first call "
        f"{ids['cold_ms']:.1f} ms (fx trace, one signature per layer); then {LAYER_ID_CALLS} calls on the "
        f"unchanged model: median {ids['median_ms']:.2f} ms, best {ids['best_ms']:.2f} ms, worst "
        f"{ids['worst_ms']:.2f} ms.",
        "",
        "## tierstore's full load taken apart",
        "",
        "Median times: the cold loads of the tables above; the same loads with the file already in the page "
        "cache (warm: no disk, but the same allocation, copy and hashing); and blake3 of all the model's "
        "bytes from memory with tierstore's own hasher (`hash_buffers`, both cores), which is the integrity "
        "check's share of a load.",
        "",
        *breakdown_table(results),
        "",
        "## Reading these numbers",
        "",
        *reading_notes(results),
        "",
        "## Every repetition (seconds)",
        "",
        *reps_table(results),
        "",
    ]
    return "\n".join(out)


def plot_results(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    names = [r.workload.name for r in results]
    x = np.arange(len(results))
    fig, axes = plt.subplots(2, 2, figsize=(15, 10))

    def bars(ax, systems: Sequence[str], values: Callable[[Result, str], float], fmt: str) -> None:
        width = 0.8 / len(systems)
        top = 0.0
        for j, s in enumerate(systems):
            ys = [values(r, s) for r in results]
            pos = x - 0.4 + width * (j + 0.5)
            hatch = HATCH.get(s)
            b = ax.bar(pos, ys, width, color=COLORS[s], hatch=hatch, edgecolor="black", linewidth=0.5)
            ax.bar_label(b, labels=[fmt.format(y) for y in ys], fontsize=7, rotation=90, padding=2)
            top = max(top, *ys)
        ax.set_xticks(x, names)
        ax.set_ylim(0, 1.2 * top)  # room for the rotated value labels above the tallest bar
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)

    def mbs(table: str) -> Callable[[Result, str], float]:
        return lambda r, s: r.workload.nbytes / MB / r.med(getattr(r, table), s)

    ax = axes[0, 0]
    bars(ax, SAVE_SYSTEMS, mbs("save"), "{:,.0f}")
    ax.set_title("(a) save incl. fsync: throughput (higher is better)")
    ax.set_ylabel("MB/s")

    ax = axes[0, 1]
    bars(ax, LOAD_SYSTEMS, mbs("full"), "{:,.0f}")
    ax.set_title("(b) cold full load, every byte materialized (higher is better)")
    ax.set_ylabel("MB/s")

    ax = axes[1, 0]
    bars(ax, LOAD_SYSTEMS, lambda r, s: r.med(r.partial, s) / r.med(r.full, s), "{:.2f}")
    ax.axhline(PARTIAL_RATIO, color="black", linestyle="--", linewidth=1)
    for i, r in enumerate(results):
        share = r.partial_bytes / r.workload.nbytes
        ax.hlines(share, i - 0.42, i + 0.42, color="purple", linewidth=2)
    ax.set_title("(c) ~25% partial load, time / same system's full load (lower is better)")
    ax.set_ylabel("partial / full time")
    ax.legend(
        handles=[
            Line2D([], [], color="black", linestyle="--", label=f"target {PARTIAL_RATIO}"),
            Line2D([], [], color="purple", linewidth=2, label="share of bytes read"),
        ],
        loc="upper left",
        fontsize=8,
    )

    ax = axes[1, 1]
    bars(ax, SECOND_SAVE_SYSTEMS, lambda r, s: r.med(r.second, s), "{:.2f}")
    # What tierstore wrote, against the whole model that the other two write again.
    ax.set_xticks(
        x,
        [
            f"{r.workload.name}\ntierstore wrote\n"
            f"{r.second_written['tierstore'] / r.workload.nbytes:.0%} of bytes"
            for r in results
        ],
        fontsize=9,
    )
    ax.set_title("(d) second save after changing 10% of the tensors (lower is better)")
    ax.set_ylabel("seconds")

    handles = [
        Patch(facecolor=COLORS[s], hatch=HATCH.get(s), edgecolor="black", label=label)
        for s, label in (
            ("raw", "raw write+fsync / sequential read"),
            ("raw-par", f"raw read, {RAW_THREADS} threads"),
            ("tierstore", "tierstore (hash-checked)"),
            ("safetensors", "safetensors"),
            ("torch", "torch.save / torch.load"),
            ("h5py", "h5py"),
        )
    ]
    fig.suptitle(
        "tierstore.models vs. torch, safetensors, h5py and raw I/O "
        "(medians, page cache dropped before loads)",
        y=0.99,
        fontsize=13,
    )
    fig.legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.96), ncol=6, fontsize=10, frameon=False
    )
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="quick run: 64 MiB synthetic, narrow VGG19 and BERT")
    ap.add_argument("--out", type=Path, help="write the results as Markdown to this file")
    ap.add_argument("--plot", type=Path, help="write the figure (PNG) to this file")
    ap.add_argument(
        "--root", type=Path, default=Path("/tmp/tierstore-bench-models"), help="where the systems write"
    )
    ap.add_argument("--reps", type=int, help="repetitions of every measurement (default 5, --small 2)")
    ap.add_argument("--only", help="comma-separated workload names to run (while iterating), e.g. vgg19")
    args = ap.parse_args(argv)
    reps = args.reps or (2 if args.small else 5)

    t_start = time.perf_counter()
    if args.small:
        workloads = [synthetic(64 * MiB, n) for n in (10, 100, 1000)] + [
            vgg19(div=4),
            bert(layers=4, hidden=256, inter=1024),
        ]
    else:
        workloads = [synthetic(GiB, n) for n in (10, 100, 1000)] + [vgg19(), bert()]
    if args.only:
        wanted = set(args.only.split(","))
        workloads = [w for w in workloads if w.name in wanted]
        if not workloads:
            ap.error(f"--only {args.only}: no such workload")
    # Room for the five systems' copies of the largest model, plus the second saves.
    need = 8 * max(w.nbytes for w in workloads)
    args.root.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(args.root).free < need:
        print(f"error: {args.root} has less than {human(need, 2)} free", file=sys.stderr)
        return 2
    notes: list[str] = []
    torch.set_num_threads(os.cpu_count() or 1)
    # First, on a quiet machine: after the workloads, the disk still trims gigabytes of deleted files and
    # the CPU timing of a few milliseconds varied 2.6-7.4 ms with it.
    print("stable layer IDs ...", flush=True)
    ids = layer_id_timing()
    results = []
    try:
        for w in workloads:
            results.append(run_workload(w, args.root, reps, notes))
    finally:
        shutil.rmtree(args.root, ignore_errors=True)

    targets = targets_of(results, ids)
    seconds = time.perf_counter() - t_start
    command = " ".join(
        [".venv/bin/python", "bench/bench_models.py", *(argv if argv is not None else sys.argv[1:])]
    )
    # The figure is linked relative to the Markdown file, so that it shows where the file is rendered.
    link = None
    if args.plot:
        base = args.out.parent if args.out else Path()
        link = os.path.relpath(args.plot.absolute(), base.absolute())
    text = report(command, machine(args.root), results, ids, targets, reps, notes, seconds, link)
    print()
    print(text)
    if args.plot:
        plot_results(results, args.plot)
        print(f"wrote {args.plot}")
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    return 0 if all(t.ok is not False for t in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
