"""A stand-in parallel file system for tests and benchmarks: a FUSE passthrough that adds latency to
metadata and data operations, caps bandwidth, and counts every operation it is asked.

A job reading through it sees what a job on a loaded Lustre sees: every open, stat and read pays a round
trip, and bytes arrive at a per-node share of the store's bandwidth. Its counters are the ground truth of
what reached the "shared store", independent of tierstore's own counters.

    python -m tierstore.slowfs /data/real /mnt/pfs --meta-latency 1ms --data-latency 0.5ms --bandwidth 500MiB
    cat /mnt/pfs/.slowfs-stats          # JSON counters (reading them, and stat of the mount root, not counted)
    umount /mnt/pfs

Defaults, from the figures of the papers this project builds on: DStore's Lustre delivers about 210 GB/s to
126 nodes behind 7 GB/s links (about 1.7 GB/s per node at peak); a store shared with other jobs gives a
node a fraction of that, hence 500 MiB/s. Metadata operations cost a round trip to the metadata server,
1 ms under load (MONARCH counts them as a PFS bottleneck of its own), and each data request pays 0.5 ms
before its bytes flow.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STATS = "/.slowfs-stats"
META_OPS = ("getattr", "readdir", "open", "access", "statfs", "readlink", "opendir", "listxattr", "getxattr")
DATA_OPS = ("read",)
WRITE_OPS = ("write", "create", "truncate", "unlink", "rename", "mkdir", "rmdir", "utimens", "chmod")


def parse_duration(text: str) -> float:
    """ "1ms", "500us", "0.002s", "2" (seconds) -> seconds."""
    t = text.strip().lower()
    for unit, scale in (("us", 1e-6), ("µs", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if t.endswith(unit):
            return float(t[: -len(unit)]) * scale
    return float(t)


def parse_rate(text: str) -> float:
    """ "500MiB" or "500MiB/s" -> bytes per second; "0" or "inf" means no cap."""
    from tierstore import parse_size

    t = text.strip().removesuffix("/s")
    if t in ("0", "inf", "none"):
        return 0.0
    n = parse_size(t)
    if n is None:
        raise argparse.ArgumentTypeError(f"bandwidth {text!r}: use a size per second like 500MiB/s")
    return float(n)


class Throttle:
    """A shared bandwidth cap: every request reserves its share of a timeline and sleeps until its turn.

    The timeline may lag the clock by up to `BURST`: time a client spends between its requests (FUSE's
    round trip, this Python process's own work, a sleep that overslept) counts toward its share. Restarting
    the timeline at each request instead made the cap add its time to that overhead rather than bound the
    rate: a 100 MiB/s cap gave a writer 21-31 MiB/s where it got 49 MiB/s uncapped."""

    BURST = 0.05

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.next_free = time.monotonic()
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        if self.rate <= 0:
            return
        with self.lock:
            now = time.monotonic()
            self.next_free = max(self.next_free, now - self.BURST) + nbytes / self.rate
            wait = self.next_free - now
        if wait > 0:
            time.sleep(wait)


def make_operations(
    root: str,
    meta_latency: float,
    data_latency: float,
    bandwidth: float,
    access_log: str | None = None,
    write_bandwidth: float = 0.0,
    fail_file: str | None = None,
) -> Any:
    from mfusepy import FuseOSError, Operations

    counts: Counter[str] = Counter()
    lock = threading.Lock()
    throttle = Throttle(bandwidth)
    # Writes have their own cap: a store shared with other jobs takes writes at a fraction of a local disk.
    write_throttle = Throttle(write_bandwidth)

    def failing(op: str) -> None:
        """The error-injection switch: while `fail_file` exists, every operation that changes the store
        fails with EIO (counted), as a store in an outage does; removing the file ends the outage."""
        if fail_file is not None and os.path.exists(fail_file):
            count("injected_errors")
            raise FuseOSError(errno.EIO)

    # One line per file opened, in the order the store saw them: how tests see which order files were
    # fetched in (an ordered prefetch), which counts alone cannot show.
    log = open(access_log, "a", buffering=1) if access_log else None  # noqa: SIM115 (open while mounted)

    def note_open(path: str) -> None:
        if log is not None:
            with lock:
                log.write(f"{time.monotonic_ns()} open {path}\n")

    def count(op: str, nbytes: int = 0) -> None:
        with lock:
            counts[op] += 1
            if nbytes:
                counts["bytes_read" if op == "read" else "bytes_written"] += nbytes

    # Handles of opens of the stats file (far above any descriptor number), and what each one reads.
    stats_handles = itertools.count(1 << 40)
    snapshots: dict[int, bytes] = {}

    def stats_bytes() -> bytes:
        with lock:
            data = dict(counts)
        data["metadata_ops"] = sum(data.get(o, 0) for o in META_OPS)
        data["data_ops"] = sum(data.get(o, 0) for o in DATA_OPS)
        return (json.dumps(data, sort_keys=True) + "\n").encode()

    class SlowFS(Operations):
        use_ns = True

        def _full(self, path: str) -> str:
            return os.path.join(root, path.lstrip("/"))

        def _meta(self, op: str) -> None:
            count(op)
            if meta_latency > 0:
                time.sleep(meta_latency)

        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            if path == STATS:
                return {"st_mode": 0o100444, "st_nlink": 1, "st_size": len(stats_bytes()) + 4096}
            if path == "/":
                # The kernel revalidates the mount root on every path lookup, reading the counters
                # included; counting it would make the counters move when read.
                return self._stat(path)
            self._meta("getattr")
            return self._stat(path)

        def _stat(self, path: str) -> dict[str, Any]:
            st = os.lstat(self._full(path))
            keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_atime_ns", "st_mtime_ns",
                    "st_ctime_ns", "st_ino", "st_blocks", "st_blksize")  # fmt: skip
            out = {k: getattr(st, k) for k in keys}
            for k in ("atime", "mtime", "ctime"):
                out[f"st_{k}"] = out.pop(f"st_{k}_ns")
            return out

        def readdir(self, path: str, fh: int) -> list[str]:
            self._meta("readdir")
            names = [".", "..", *os.listdir(self._full(path))]
            return [*names, STATS.lstrip("/")] if path == "/" else names

        def readlink(self, path: str) -> str:
            self._meta("readlink")
            return os.readlink(self._full(path))

        def access(self, path: str, amode: int) -> int:
            if path == STATS:
                return 0
            self._meta("access")
            if not os.access(self._full(path), amode):
                raise FuseOSError(errno.EACCES)
            return 0

        def statfs(self, path: str) -> dict[str, int]:
            self._meta("statfs")
            s = os.statvfs(self._full(path))
            keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag",
                    "f_frsize", "f_namemax")  # fmt: skip
            return {k: getattr(s, k) for k in keys}

        # Extended attributes (and ACLs, which Linux stores as `system.posix_acl_*` attributes) are the
        # backing file's own, asked of the file itself as the kernel names it: a store answers for the node
        # the kernel's lookup reached, symlinks already followed or not.
        def listxattr(self, path: str) -> list[str]:
            if path == STATS:
                return []
            self._meta("listxattr")
            return os.listxattr(self._full(path), follow_symlinks=False)

        def getxattr(self, path: str, name: str, position: int = 0) -> bytes:
            if path == STATS:
                raise FuseOSError(errno.ENODATA)
            self._meta("getxattr")
            return os.getxattr(self._full(path), name, follow_symlinks=False)

        def setxattr(self, path: str, name: str, value: bytes, options: int, position: int = 0) -> int:
            count("setxattr")
            os.setxattr(self._full(path), name, value, options, follow_symlinks=False)
            return 0

        def removexattr(self, path: str, name: str) -> int:
            count("removexattr")
            os.removexattr(self._full(path), name, follow_symlinks=False)
            return 0

        def open(self, path: str, flags: int) -> int:
            if path == STATS:
                # One snapshot per open: a reader taking the file in several reads gets one consistent
                # JSON document even while the counters move.
                with lock:
                    fh = next(stats_handles)
                snapshots[fh] = stats_bytes()
                return fh
            self._meta("open")
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
                failing("open")
            note_open(path)
            return os.open(self._full(path), flags)

        def create(self, path: str, mode: int, fi: Any = None) -> int:
            failing("create")
            count("create")
            return os.open(self._full(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            if path == STATS:
                return snapshots.get(fh, b"")[offset : offset + size]
            if data_latency > 0:
                time.sleep(data_latency)
            data = os.pread(fh, size, offset)
            throttle.take(len(data))
            count("read", len(data))
            return data

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            failing("write")
            write_throttle.take(len(data))
            count("write", len(data))
            return os.pwrite(fh, data, offset)

        def truncate(self, path: str, length: int, fh: int | None = None) -> int:
            failing("truncate")
            count("truncate")
            os.truncate(self._full(path), length)
            return 0

        def release(self, path: str, fh: int) -> int:
            if path == STATS:
                snapshots.pop(fh, None)
            else:
                count("release")
                os.close(fh)
            return 0

        def flush(self, path: str, fh: int) -> int:
            return 0

        def fsync(self, path: str, datasync: int, fh: int) -> int:
            failing("fsync")
            count("fsync")
            os.fsync(fh)
            return 0

        def unlink(self, path: str) -> int:
            failing("unlink")
            count("unlink")
            os.unlink(self._full(path))
            return 0

        def rename(self, old: str, new: str) -> int:
            failing("rename")
            count("rename")
            os.rename(self._full(old), self._full(new))
            return 0

        def mkdir(self, path: str, mode: int) -> int:
            failing("mkdir")
            count("mkdir")
            os.mkdir(self._full(path), mode)
            return 0

        def rmdir(self, path: str) -> int:
            count("rmdir")
            os.rmdir(self._full(path))
            return 0

        def chmod(self, path: str, mode: int) -> int:
            count("chmod")
            os.chmod(self._full(path), mode)
            return 0

        def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
            count("utimens")
            if times is None:
                os.utime(self._full(path))
            else:
                os.utime(self._full(path), ns=times)
            return 0

    return SlowFS()


def read_stats(mountpoint: str | os.PathLike[str]) -> dict[str, int]:
    """The counters of a mounted stand-in store."""
    with open(os.path.join(mountpoint, STATS.lstrip("/"))) as f:
        return json.loads(f.read())


@contextlib.contextmanager
def mounted(
    source: str | os.PathLike[str],
    mountpoint: str | os.PathLike[str],
    *,
    meta_latency: str | None = None,
    data_latency: str | None = None,
    bandwidth: str | None = None,
    write_bandwidth: str | None = None,
    fail_file: str | os.PathLike[str] | None = None,
    access_log: str | os.PathLike[str] | None = None,
    direct_io: bool = False,
    queue: int | None = None,
    timeout: float = 30.0,
) -> Iterator[Path]:
    """The stand-in store over `source`, mounted at `mountpoint` by a child process for the duration.

    Options left as None keep the command's defaults (`python -m tierstore.slowfs --help`). `queue` sets
    how many requests the kernel sends the store at once before it stops reading ahead (`set_queue`); by
    default the kernel's own. A mount left
    behind at `mountpoint` by a killed run is detached first. On the way out the unmount is retried for
    five seconds, because processes of a job that just ended may still be closing files there, then the
    mount is detached.

    Raises:
        RuntimeError: the store did not mount within `timeout` seconds; the message holds its stderr.
    """
    mnt = Path(mountpoint)
    mnt.mkdir(parents=True, exist_ok=True)
    if os.path.ismount(mnt):
        subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)
    options = {
        "--meta-latency": meta_latency,
        "--data-latency": data_latency,
        "--bandwidth": bandwidth,
        "--write-bandwidth": write_bandwidth,
        "--fail-file": fail_file,
        "--access-log": access_log,
    }
    cmd = [sys.executable, "-m", "tierstore.testing.slowfs", str(source), str(mnt), "--foreground"]
    cmd += [str(x) for k, v in options.items() if v is not None for x in (k, v)]
    if direct_io:
        cmd.append("--direct-io")
    # stderr to a file, not a pipe nobody reads while the store runs: a full pipe would stall the store.
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stderr=err)
        deadline = time.monotonic() + timeout
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                err.seek(0)
                raise RuntimeError(
                    f"the stand-in store did not mount at {mnt} (it needs fuse3 and mfusepy): "
                    f"{err.read().decode(errors='replace')[-2000:]}"
                )
            time.sleep(0.05)
        try:
            if queue is not None:
                set_queue(mnt, queue)
            yield mnt
        finally:
            for _ in range(50):
                if subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True).returncode == 0:
                    break
                time.sleep(0.1)
            else:
                subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def set_queue(mountpoint: str | os.PathLike[str], queue: int) -> None:
    """Lets the kernel keep `queue` requests in flight to the store mounted at `mountpoint`, and read
    ahead until three quarters of them are queued.

    The kernel's FUSE client keeps at most 12 background requests (readahead among them) per mount, and
    once 9 are queued it drops readahead and reads page by page: with a dozen files fetched at once, each
    4 KiB page of a file is then a round trip to the store. A Lustre or GPFS client has no such limit;
    a benchmark of many fetches at once mounts the stand-in with a deeper queue. Needs root, and the
    fusectl file system (mounted here if it is not).

    Raises:
        RuntimeError: the queue could not be set; the message says why and what it needs.
    """
    connections = Path("/sys/fs/fuse/connections")
    conn = connections / str(os.minor(os.stat(mountpoint).st_dev))
    if not conn.exists():
        subprocess.run(["mount", "-t", "fusectl", "none", str(connections)], capture_output=True)
    try:
        (conn / "max_background").write_text(f"{queue}\n")
        (conn / "congestion_threshold").write_text(f"{max(1, queue * 3 // 4)}\n")
    except OSError as e:
        raise RuntimeError(
            f"cannot let the kernel queue {queue} requests to the store at {mountpoint} ({e}): it takes root "
            f"and the fusectl file system at {connections} (mount -t fusectl none {connections})"
        ) from e


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tierstore.slowfs",
        description="Mount SOURCE at MOUNTPOINT as a slow, counting shared store (FUSE passthrough).",
    )
    ap.add_argument("source", help="the real directory to serve")
    ap.add_argument("mountpoint", help="an empty directory to mount it on")
    ap.add_argument("--meta-latency", type=parse_duration, default="1ms",
                    help="added to every metadata operation (open, stat, readdir...); default 1ms")  # fmt: skip
    ap.add_argument("--data-latency", type=parse_duration, default="0.5ms",
                    help="added to every read request; default 0.5ms")  # fmt: skip
    ap.add_argument("--bandwidth", type=parse_rate, default="500MiB/s",
                    help="read bandwidth cap shared by all readers; default 500MiB/s, 0 for none")  # fmt: skip
    ap.add_argument("--write-bandwidth", type=parse_rate, default="0",
                    help="write bandwidth cap shared by all writers; default 0 (none)")  # fmt: skip
    ap.add_argument("--fail-file", metavar="FILE",
                    help="while FILE exists, every write, create, rename, fsync, mkdir, unlink fails with EIO "
                         "(an outage of the store: create FILE to start it, remove it to end it)")  # fmt: skip
    ap.add_argument("--access-log", metavar="FILE",
                    help="append a line per file opened (monotonic ns, 'open', path) to FILE")  # fmt: skip
    ap.add_argument("--direct-io", action="store_true",
                    help="keep file data out of the page cache: every read reaches the store, as for processes "
                         "of nodes that do not share one kernel (network namespaces on one machine do)")  # fmt: skip
    ap.add_argument("--foreground", action="store_true", help="stay in the foreground")
    args = ap.parse_args(argv)
    try:
        from mfusepy import FUSE
    except ImportError:
        print("error: the stand-in store needs mfusepy: pip install mfusepy (and fuse3 from your distribution)",
              file=sys.stderr)  # fmt: skip
        return 2
    ops = make_operations(
        os.path.abspath(args.source),
        args.meta_latency,
        args.data_latency,
        args.bandwidth,
        args.access_log,
        args.write_bandwidth,
        args.fail_file and os.path.abspath(args.fail_file),
    )
    # No kernel attribute or entry caching: every stat reaches the store, as on a PFS without client caching,
    # so the counters see every operation a job sends.
    FUSE(ops, args.mountpoint, foreground=args.foreground, nothreads=False, attr_timeout=0, entry_timeout=0,
         negative_timeout=0, default_permissions=True, **({"direct_io": True} if args.direct_io else {}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
