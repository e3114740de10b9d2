"""What a command under `tierstore run` still asks the store once the cache is warm.

Runs COMMAND under `tierstore run` on the stand-in store (`tierstore.slowfs`) one or more times to warm
the cache, then once more, and prints the store operations that last pass caused, per kind, from the
stand-in's own counters. With `--strace`, the last pass runs under `strace -f -y` and the system calls
that reached the store (those naming a path on the mount, or a descriptor of one) are grouped by call,
flags and path: each is a libc call the shim did not answer.

    # mount a stand-in over a directory; {mnt} in the command is replaced by the mount
    .venv/bin/python bench/trace_store_ops.py --backing /data/set --strace -- md5sum {mnt}/a.bin
    # or use a stand-in already mounted (its root is the source)
    .venv/bin/python bench/trace_store_ops.py --mount /mnt/pfs -- python job.py /mnt/pfs
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tierstore.testing import slowfs

PY = sys.executable
TOTALS = ("metadata_ops", "data_ops")


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Operations between two readings of the counters, per kind, without the totals."""
    return {
        k: after[k] - before.get(k, 0)
        for k in sorted(after)
        if k not in TOTALS and after[k] != before.get(k, 0)
    }


@contextlib.contextmanager
def fresh_mount(backing: Path, meta_latency: str, data_latency: str) -> Iterator[Path]:
    """The stand-in store over `backing`, on a fresh mount point, for the duration."""
    mnt = Path(tempfile.mkdtemp(prefix="tierstore-trace-mnt-"))
    try:
        with slowfs.mounted(
            backing, mnt, meta_latency=meta_latency, data_latency=data_latency, bandwidth="0"
        ):
            yield mnt
    finally:
        with contextlib.suppress(OSError):
            mnt.rmdir()


def run_pass(
    mnt: Path, tier: str, revalidate: str, command: list[str], strace_log: Path | None
) -> tuple[int, dict[str, int]]:
    """One run of `command` under `tierstore run`; its exit status and the store operations it caused."""
    cmd = command
    if strace_log is not None:
        # Inside `run`, so that the trace holds the command's calls, not the CLI's.
        cmd = ["strace", "-f", "-y", "-qq", "-s", "256", "-o", str(strace_log),
               "-e", "trace=%file,%stat,%desc,getdents64,readlink,readlinkat,clone,clone3,fork,vfork", *command]  # fmt: skip
    argv = [PY, "-m", "tierstore.cli", "--source", str(mnt), "--tier", tier, "run", "--revalidate", revalidate,
            "--", *cmd]  # fmt: skip
    before = slowfs.read_stats(mnt)
    rc = subprocess.run(argv, stdout=subprocess.DEVNULL).returncode
    return rc, delta(before, slowfs.read_stats(mnt))


# `PID call(args) = result`, as strace -f writes it once the halves of an interrupted call are joined.
UNFINISHED = re.compile(r"^(?P<pid>\d+)\s+(?P<start>.*) <unfinished \.\.\.>$")
RESUMED = re.compile(r"^(?P<pid>\d+)\s+<\.\.\. \w+ resumed>(?P<rest>.*)$")
LINE = re.compile(r"^(?P<pid>\d+)\s+(?P<call>\w+)\((?P<args>.*)\)\s+=\s+(?P<ret>.*)$")
FD = re.compile(r"(?:\d+|AT_FDCWD)<([^>]*)>")
QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
FLAGS = re.compile(r"\b(AT_(?!FDCWD)[A-Z_]+|O_[A-Z_]+|[FRWX]_OK|STATX_[A-Z_]+)\b")
IGNORED = {
    "execve",
    "close",
    "read",
    "pread64",
    "lseek",
    "mmap",
    "munmap",
    "write",
    "fcntl",
    "dup",
    "dup2",
    "dup3",
}


def store_calls(log: Path, mnt: Path) -> collections.Counter[str]:
    """The traced calls that named the mount (by path or by descriptor), as `call(flags) path` keys,
    with paths relative to the mount. Reads of a descriptor are left out: opens and stats are what count."""
    root = str(mnt)
    calls: collections.Counter[str] = collections.Counter()
    pending: dict[str, str] = {}
    start = os.getcwd()  # where the traced command starts; chdir moves a process, fork copies it
    cwds: dict[str, str] = {}
    for raw in log.read_text(errors="replace").splitlines():
        if u := UNFINISHED.match(raw):
            pending[u["pid"]] = u["start"]
            continue
        if r := RESUMED.match(raw):
            raw = f"{r['pid']} {pending.pop(r['pid'], '')}{r['rest']}"
        m = LINE.match(raw)
        if not m or m["call"] in IGNORED:
            continue
        # Only what the call was asked about, its descriptor (or the working directory) and its first
        # path, not what it answered: readlink of /proc/self/fd/N answers a path on the store without
        # asking the store. strace -y names descriptors; the working directory is followed through chdir.
        args = m["args"]
        q = QUOTED.search(args)
        head = args[: q.end()] if q else args.split(",", 1)[0]
        base = FD.search(head)
        path = q[1] if q else ""
        cwd = cwds.get(m["pid"], start)
        if m["call"] in ("clone", "clone3", "fork", "vfork") and m["ret"].isdigit():
            cwds[m["ret"]] = cwd
            continue
        if m["call"] == "chdir" and m["ret"] == "0":
            cwds[m["pid"]] = os.path.normpath(os.path.join(cwd, path))
            continue
        if m["call"] == "chdir":
            continue
        if q and path.startswith("/"):
            full = path
        elif base:
            full = os.path.join(base[1], path) if path else base[1]
        elif q:
            full = os.path.join(cwd, path)
        else:
            continue
        full = os.path.normpath(full)
        if full != root and not full.startswith(root + "/"):
            continue
        where = "<mnt>" + full[len(root) :]
        flags = "|".join(sorted(set(FLAGS.findall(args))))
        failed = " -> " + m["ret"].split(" ", 2)[1] if m["ret"].startswith("-1") else ""
        calls[f"{m['call']}({flags}) {where}{failed}"] += 1
    return calls


FILL = (
    "import os, sys\n"
    "for d, _, names in os.walk(sys.argv[1]):\n"
    "    for n in names:\n"
    "        if n != '.slowfs-stats' and not os.path.islink(os.path.join(d, n)):\n"
    "            open(os.path.join(d, n), 'rb').read()\n"
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], usage="%(prog)s [options] -- COMMAND ..."
    )
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--backing", type=Path, help="a directory: mount the stand-in store over it for the run"
    )
    where.add_argument("--mount", type=Path, help="a stand-in store already mounted: its root is the source")
    ap.add_argument(
        "--tier", help="the cache tier PATH:QUOTA (default: a fresh directory on /dev/shm, removed)"
    )
    ap.add_argument("--revalidate", choices=("never", "always"), default="never")
    ap.add_argument("--warmups", type=int, default=1, help="passes before the one measured (default 1)")
    ap.add_argument(
        "--fill", action="store_true", help="read every file of the store once before the warm-ups"
    )
    ap.add_argument(
        "--strace", action="store_true", help="trace the measured pass and list the calls on the store"
    )
    ap.add_argument("--meta-latency", default="0", help="of a stand-in this script mounts (default 0)")
    ap.add_argument("--data-latency", default="0", help="of a stand-in this script mounts (default 0)")
    ap.add_argument("--trace-out", type=Path, help="with --strace: keep strace's whole log here")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no COMMAND given (put it after --)")
    if args.strace and shutil.which("strace") is None:
        ap.error("--strace needs strace (apt-get install strace)")
    tier_dir = None if args.tier else Path(tempfile.mkdtemp(prefix="tierstore-trace-", dir="/dev/shm"))
    tier = args.tier or f"{tier_dir}/tier:4G"
    stack = contextlib.ExitStack()
    try:
        mnt = args.mount or stack.enter_context(
            fresh_mount(args.backing, args.meta_latency, args.data_latency)
        )
        cmd = [a.replace("{mnt}", str(mnt)) for a in command]
        passes = []
        if args.fill:
            # Every file in the cache, including those the command only lists or stats.
            fill = [PY, "-c", FILL, str(mnt)]
            passes.append(run_pass(mnt, tier, args.revalidate, fill, None))
        for _ in range(args.warmups):
            passes.append(run_pass(mnt, tier, args.revalidate, cmd, None))
        log = None
        if args.strace:
            log = args.trace_out or Path(tempfile.mkstemp(prefix="tierstore-trace-", suffix=".strace")[1])
        rc, ops = run_pass(mnt, tier, args.revalidate, cmd, log)
        calls = store_calls(log, mnt) if log else None
        if log and not args.trace_out:
            log.unlink()
    finally:
        stack.close()
        if tier_dir:
            shutil.rmtree(tier_dir, ignore_errors=True)
    if args.json:
        out = {"warmups": [{"exit": r, "ops": o} for r, o in passes], "exit": rc, "ops": ops}
        if calls is not None:
            out["calls"] = dict(calls.most_common())
        print(json.dumps(out, indent=1))
        return rc
    for i, (r, o) in enumerate(passes, 1):
        what = "fill" if args.fill and i == 1 else "warm-up"
        print(f"{what} pass {i}: exit {r}, store operations {o or 'none'}")
    print(f"measured pass (revalidate={args.revalidate}): exit {rc}, store operations {ops or 'none'}")
    if calls is not None:
        print("system calls that named the store on the measured pass (count, call(flags), path):")
        for key, n in calls.most_common():
            print(f"  {n:6d}  {key}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
