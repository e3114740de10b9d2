"""What the LD_PRELOAD shim costs a forked DataLoader worker: at its start and per call, measured as a
paired A/B in one process (the same calls on a cached file of the source and on a local copy of it,
interleaved), so that the machine's drift cancels out.

    python bench/shim_costs.py [--rounds N]

It makes a small source directory and a local copy of it (one 4 KiB .npy file per sample, as the
per-sample job of bench_run.py reads), then runs itself under `tierstore run --revalidate never` with a
tier on /dev/shm, warms the cache and measures:

- per call: `numpy.load` of a sample, and `open` + `fstat` + `read` + `close` of it, over the source
  (served from the tier by the shim) and over the local copy (the shim only compares the path), in
  alternating blocks;
- in a forked worker: a child forked from a process that already used the cache loads one sample,
  then 50 more, each new to the child. The first load pays the shim's start (its own engine:
  configuration, index, counters; the parent's is not usable after fork); "worker start extra" is the
  first load's excess over the next ones', shim minus local, and "worker next loads extra" what each
  later sample costs more under the shim. Children of both kinds alternate.

Times are medians over the rounds of per-round figures, and each figure is printed with its spread
(the 25th and 75th percentiles): a difference inside the spread is noise.
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

SAMPLES = 200
WORKER_LOADS = 51  # samples a forked child loads: the first, then 50 more


def make_data(root: Path) -> tuple[Path, Path]:
    import numpy as np

    src, local = root / "src", root / "local"
    for d in (src, local):
        (d / "part000").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(3)
    for i in range(SAMPLES):
        rows = rng.standard_normal((4, 256), dtype=np.float32)
        for d in (src, local):
            np.save(d / "part000" / f"{i:06d}.npy", rows)
    return src, local


def spread(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4)
    return f"{statistics.median(xs):.1f} (IQR {q[0]:.1f}-{q[2]:.1f})"


def per_call(paths: list[str], how: str) -> float:
    """Microseconds per sample for one pass over `paths`."""
    import numpy as np

    t0 = time.perf_counter_ns()
    if how == "load":
        for p in paths:
            np.load(p)
    else:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            os.fstat(fd)
            os.read(fd, 8192)
            os.close(fd)
    return (time.perf_counter_ns() - t0) / 1000 / len(paths)


def minor_faults() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def child_loads(paths: list[str]) -> tuple[float, float, int, float]:
    """In a forked child: microseconds of the first `numpy.load` (of `paths[0]`), and per sample of the
    next ones (each file new to the child, as in a worker that lives one epoch), the threads the child
    has after them, and its minor page faults per sample in the next ones."""
    import numpy as np

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        t0 = time.perf_counter_ns()
        np.load(paths[0])
        t1 = time.perf_counter_ns()
        f1 = minor_faults()
        for p in paths[1:]:
            np.load(p)
        t2 = time.perf_counter_ns()
        faults = (minor_faults() - f1) / (len(paths) - 1)
        threads = len(os.listdir("/proc/self/task"))
        n = len(paths) - 1
        os.write(w, json.dumps([(t1 - t0) / 1000, (t2 - t1) / 1000 / n, threads, faults]).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = json.loads(f.read())
    os.waitpid(pid, 0)
    return out[0], out[1], out[2], out[3]


def inner(src: Path, local: Path, rounds: int) -> None:
    import numpy as np

    files = sorted(p.relative_to(src) for p in src.rglob("*.npy"))
    paths = {"shim": [str(src / f) for f in files], "local": [str(local / f) for f in files]}
    for p in paths["shim"] + paths["local"]:  # warm the cache and the page cache
        np.load(p)
    results: dict[str, list[float]] = {}
    for how in ("load", "open+fstat+read+close"):
        for r in range(rounds):
            order = ("shim", "local") if r % 2 == 0 else ("local", "shim")
            got = {side: per_call(paths[side], "load" if how == "load" else "raw") for side in order}
            results.setdefault(f"{how} shim", []).append(got["shim"])
            results.setdefault(f"{how} local", []).append(got["local"])
            results.setdefault(f"{how} extra", []).append(got["shim"] - got["local"])
    threads: dict[str, set[int]] = {}
    for r in range(rounds * 4):
        order = ("shim", "local") if r % 2 == 0 else ("local", "shim")
        got = {}
        for side in order:
            i = r % (len(files) - WORKER_LOADS)
            got[side] = child_loads(paths[side][i : i + WORKER_LOADS])
            threads.setdefault(side, set()).add(got[side][2])
        for side in order:
            results.setdefault(f"worker first load {side}", []).append(got[side][0])
            results.setdefault(f"worker next loads {side}", []).append(got[side][1])
            results.setdefault(f"worker page faults per load {side}", []).append(got[side][3])
        results.setdefault("worker next loads extra", []).append(got["shim"][1] - got["local"][1])
        results.setdefault("worker start extra", []).append(
            (got["shim"][0] - got["shim"][1]) - (got["local"][0] - got["local"][1])
        )
    print("microseconds; median over rounds (interquartile range)")
    for name, xs in results.items():
        print(f"  {name:36s} {spread(xs)}")
    print(
        f"  threads in a worker after its loads: shim {sorted(threads['shim'])}, local {sorted(threads['local'])}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--root", type=Path, default=Path("/tmp/tierstore-shim-costs"))
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    src, local = args.root / "src", args.root / "local"
    if args.inner:
        inner(src, local, args.rounds)
        return 0
    shutil.rmtree(args.root, ignore_errors=True)
    make_data(args.root)
    tier = Path("/dev/shm/tierstore-shim-costs")
    shutil.rmtree(tier, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERSTORE_")}
    env.update(TIERSTORE_SOURCE=str(src), TIERSTORE_TIERS=f"{tier}:1G")
    cmd = [sys.executable, "-m", "tierstore.cli", "run", "--revalidate", "never", "--",
           sys.executable, __file__, "--inner", "--root", str(args.root), "--rounds", str(args.rounds)]  # fmt: skip
    rc = subprocess.run(cmd, env=env).returncode
    shutil.rmtree(tier, ignore_errors=True)
    shutil.rmtree(args.root, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
