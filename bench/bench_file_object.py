"""The Python API's file object, paired in one process: what a warm `Cache.open` + `read` + `close` costs
with `tierstore.CachedFile` built in Rust ("Cache.open"), against "before": `Cache.open` as it was until
2026-12-04, whose file was a Python `io.RawIOBase` around the engine's reader (both kept here, `before_open`
and `PythonWrapper`, around the same Rust object: their Python frames are what they cost), against fsspec's
`tierstore://` open, and against `open` + `read` of a local copy in the page cache.

Every side reads the same 2,000 files per pass (a local copy of them on the local disk for the baseline;
the tier on a tmpfs mounted `huge=within_size` when we are root, else /dev/shm), the sides alternate in
each round, and each round's figure is the process's CPU time per file (user + system, which this shared
machine's load does not stretch). Two sizes: 4 KiB, where the open is most of the cost, and 128 KiB.

    .venv/bin/python bench/bench_file_object.py --out docs/benchmarks/file-object.md
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_warm_read import huge_tmpfs, make_dataset
from bench.machine import describe
from bench.page import Check, finish, met, rounds, targets

TARGET = 0.97  # a warm read through the cache at least 0.97x as fast as a local read (#51)


class PythonWrapper(io.RawIOBase):
    """`tierstore.CachedFile` as it was until 2026-12-04 (python/tierstore/_file.py at 8967bea): a Python
    `RawIOBase` whose methods call the engine's reader. Wrapped around the Rust object, it costs what the
    old one did: its frames and IOBase's, over the same calls into the engine."""

    def __init__(self, reader: Any, name: str) -> None:
        self._reader = reader
        self.name = name

    @property
    def closed(self) -> bool:  # type: ignore[override]
        return self._reader.closed  # type: ignore[no-any-return]

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        return self._reader.read(-1 if size is None else size)  # type: ignore[no-any-return]

    def close(self) -> None:
        self._reader.close()


def passes(paths: list[str], opener: Any, n: int) -> float:
    """CPU seconds of `n` passes reading every file whole through `opener`."""
    cpu = time.process_time()
    for _ in range(n):
        for p in paths:
            with opener(p) as f:
                f.read()
    return time.process_time() - cpu


def measure(
    size: int, files: int, n: int, rounds_n: int, tier_root: Path, base: Path
) -> dict[str, list[float]]:
    """Microseconds of CPU per file, per side and round, for files of `size` bytes."""
    import fsspec

    import tierstore

    source, local = base / f"data-{size}", base / f"local-{size}"
    paths = make_dataset(source, files, size)
    shutil.copytree(source, local)
    local_paths = [p.replace(str(source), str(local), 1) for p in paths]
    cache = tierstore.Cache(source=str(source), tiers=[f"{tier_root}/tier-{size}:1G"], revalidate="never")
    fs = fsspec.filesystem("tierstore", cache=cache)

    plain_local = threading.local()  # the learned order's record as it was: no class default

    def before_open(path: str, mode: str = "rb") -> Any:
        """`Cache.open` as it was until 2026-12-04, its file the Python wrapper."""
        if mode != "rb" and mode not in ("br", "r", "rt", "tr"):
            raise ValueError(mode)
        name = path if type(path) is str else os.fsdecode(path)
        raw = PythonWrapper(cache._core.open(path), name)
        learning = getattr(plain_local, "paths", None)
        if learning is not None:
            learning.append(name)
        if "b" in mode:
            return raw
        return io.TextIOWrapper(io.BufferedReader(raw))

    sides = {
        "local": (local_paths, lambda p: open(p, "rb")),  # noqa: SIM115 - closed by passes' with
        "Cache.open": (paths, cache.open),
        "before": (paths, before_open),
        "fsspec": (paths, lambda p: fs.open(p, "rb")),
    }
    passes(paths, cache.open, 1)  # copies every file into the tier
    cache.wait()
    for ps, opener in sides.values():
        passes(ps, opener, 1)  # every side warm once
    out: dict[str, list[float]] = {name: [] for name in sides}
    order = list(sides)
    for r in range(rounds_n):
        for name in order if r % 2 == 0 else order[::-1]:
            ps, opener = sides[name]
            out[name].append(passes(ps, opener, n) / (n * len(ps)) * 1e6)
        print(
            f"  {size} B round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} us" for k, v in out.items()),
            flush=True,
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--passes", type=int, default=20, help="passes over the files per side and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    started = time.time()
    base = Path(tempfile.mkdtemp(prefix="tierstore-fileobj-", dir="/var/tmp"))
    huge_at = Path(tempfile.mkdtemp(prefix="tierstore-fileobj-huge-"))
    huge, why = huge_tmpfs(huge_at)
    tier_root = huge if huge is not None else Path(tempfile.mkdtemp(dir="/dev/shm"))
    tier_name = "a tmpfs mounted huge=within_size" if huge is not None else f"/dev/shm ({why})"
    results: dict[int, dict[str, list[float]]] = {}
    try:
        for size in (4096, 128 << 10):
            results[size] = measure(size, args.files, args.passes, args.rounds, tier_root, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        if huge is not None:
            subprocess.run(["umount", "-l", str(huge_at)], check=False)
            shutil.rmtree(huge_at, ignore_errors=True)
        else:
            shutil.rmtree(tier_root, ignore_errors=True)

    command = " ".join(["bench/bench_file_object.py", *sys.argv[1:]])
    lines = [
        "# The Python API's file object",
        "",
        f"Command: `.venv/bin/python {command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, "
        f"{time.time() - started:.0f} s)",
        "",
        describe(),
        "",
        (__doc__ or "").split("\n\n")[0].replace("\n", " "),
        "",
        f"{args.files} files per pass, {args.passes} passes per side and round, {args.rounds} rounds; tier on "
        f"{tier_name}, local copy on the local disk (page cache). CPU microseconds per file.",
    ]
    checks: list[Check] = []
    for size, out in results.items():
        names = list(out)
        lines += [
            "",
            f"## Files of {size >> 10} KiB",
            "",
            "| round | "
            + " | ".join(names)
            + " | local / Cache.open | local / fsspec | before / Cache.open |",
            "| ---: | " + " | ".join("---:" for _ in names) + " | ---: | ---: | ---: |",
        ]
        api = [lo / a for lo, a in zip(out["local"], out["Cache.open"], strict=True)]
        fss = [lo / f for lo, f in zip(out["local"], out["fsspec"], strict=True)]
        wrap = [w / a for w, a in zip(out["before"], out["Cache.open"], strict=True)]
        for r in range(len(api)):
            cells = " | ".join(f"{out[n][r]:.2f}" for n in names)
            lines.append(f"| {r + 1} | {cells} | {api[r]:.3f} | {fss[r]:.3f} | {wrap[r]:.3f} |")
        saved = statistics.median(w - a for w, a in zip(out["before"], out["Cache.open"], strict=True))
        lines += [
            "",
            f"- Cache.open: {rounds(api)} a local read's speed by CPU.",
            f"- fsspec: {rounds(fss)} a local read's speed by CPU.",
            f"- Before (the Python wrapper, and `Cache.open` as it was): {rounds(wrap)} the CPU of now, {saved:.2f} us "
            "more per file.",
        ]
        checks.append(
            (
                f"a warm {size >> 10} KiB read, Cache.open: >= {TARGET}x a local read (CPU)",
                met(api, TARGET),
                rounds(api),
            )
        )
        checks.append(
            (
                f"a warm {size >> 10} KiB read, fsspec: >= {TARGET}x a local read (CPU)",
                met(fss, TARGET),
                rounds(fss),
            )
        )
    lines += targets(checks)
    return finish(lines, checks, args.out)


if __name__ == "__main__":
    sys.exit(main())
