"""Benchmark of where a peer transfer lands its bytes in memory: what the receiving side pays per GiB to
take a file from a socket into an anonymous memory file (`memfd_create`, where a partitioned peer read
puts a file its node does not keep), three ways.

  buffer     each 1 MiB chunk received into one reused buffer, then `pwrite` into the memory file: two
             copies, the second from a buffer the cache still holds (what `Transfer::receive_into`
             does for `Dest::File`)
  mapped     the memory file sized, mapped, and each chunk received straight into its pages: one copy,
             but every fresh 4 KiB page is zeroed and mapped on a page fault of its own
  populated  the same mapping made with `MAP_POPULATE`: the pages zeroed and mapped up front, no faults

Issue #51 asked whether a received file could be written without the extra user-space copy by
receiving into the copy's mapping: this is the measurement that answers it on this machine. A child
process sends files of `--file-mib` MiB over a Unix socket pair (1 MiB `sendall`s, 4 MiB socket buffers),
one file per request; the receiver times each way over 1 GiB a round, in turn, for `--rounds` rounds.
The figure is the receiving process's CPU time (`getrusage`), which the machine's other work does not
stretch; each round's ratio pairs the ways within that round.

    .venv/bin/python bench/bench_receive_into.py --out docs/benchmarks/receive-into.md

The exit status is 1 when the buffer is not the cheapest in every round (the decision it records would
then be wrong).
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import machine
import page

GIB = 1 << 30
CHUNK = 1 << 20


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def recv_exact(s: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = s.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if n == 0:
            raise EOFError("the sender closed inside a file")
        got += n


def send_files(s: socket.socket, size: int) -> None:
    """The sender: one file of `size` bytes for each request byte `k`, until any other byte."""
    chunk = os.urandom(CHUNK)
    while s.recv(1) == b"k":
        for _ in range(size // CHUNK):
            s.sendall(chunk)


def through_buffer(s: socket.socket, size: int) -> None:
    buf = memoryview(bytearray(CHUNK))
    fd = os.memfd_create("receive-into")
    try:
        for offset in range(0, size, CHUNK):
            recv_exact(s, buf)
            os.pwrite(fd, buf, offset)
    finally:
        os.close(fd)


def into_mapping(s: socket.socket, size: int, populate: bool) -> None:
    fd = os.memfd_create("receive-into")
    try:
        os.ftruncate(fd, size)
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        with mmap.mmap(fd, size, flags=flags) as m:
            view = memoryview(m)
            for offset in range(0, size, CHUNK):
                recv_exact(s, view[offset : offset + CHUNK])
            view.release()
    finally:
        os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file-mib", type=int, default=64, help="the size of each file, in MiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    started = time.time()
    size = args.file_mib * CHUNK
    files = max(1, GIB // size)
    ways: dict[str, Callable[[socket.socket, int], None]] = {
        "buffer": through_buffer,
        "mapped": lambda s, n: into_mapping(s, n, False),
        "populated": lambda s, n: into_mapping(s, n, True),
    }
    ours, theirs = socket.socketpair()
    for end in (ours, theirs):
        end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    pid = os.fork()
    if pid == 0:
        ours.close()
        send_files(theirs, size)
        os._exit(0)
    theirs.close()
    cpu: dict[str, list[float]] = {w: [] for w in ways}
    wall: dict[str, list[float]] = {w: [] for w in ways}
    try:
        for r in range(args.rounds):
            for way, receive in ways.items():
                t, c = time.perf_counter(), cpu_seconds()
                for _ in range(files):
                    ours.send(b"k")
                    receive(ours, size)
                cpu[way].append((cpu_seconds() - c) * GIB / (files * size))
                wall[way].append((time.perf_counter() - t) * GIB / (files * size))
            print(f"round {r + 1}: " + ", ".join(f"{w} {cpu[w][-1]:.3f} CPU s/GiB" for w in ways), flush=True)
    finally:
        ours.send(b"q")
        os.waitpid(pid, 0)

    def ratios(way: str) -> list[float]:
        return [x / b for x, b in zip(cpu[way], cpu["buffer"], strict=True)]

    checks: list[page.Check] = [
        (f"receiving through the buffer costs less CPU than `{w}`, every round", page.met(ratios(w), 1.0),
         page.rounds(ratios(w)))
        for w in ("mapped", "populated")
    ]  # fmt: skip
    load = os.getloadavg()
    lines = [
        "# Where a received file lands: a reused buffer, or the memory file's mapping",
        "",
        f"Command: `{' '.join(['.venv/bin/python', *sys.argv])}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, {time.time() - started:.0f} s); load "
        f"average at the end {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f} (1, 5, 15 min; the machine is shared).",
        "",
        f"Machine: {machine.describe()}. {files} files of {args.file_mib} MiB a round (1 GiB) over a Unix socket "
        f"pair; {args.rounds} rounds, the three ways in turn within each. The receiving process's CPU seconds "
        "per GiB, every round, and the ratio to the buffer's in the same round:",
        "",
        "| way | CPU s per GiB, median (rounds) | vs the buffer, per round | wall s per GiB, median |",
        "| --- | --- | --- | --- |",
        *[
            f"| {w} | {statistics.median(cpu[w]):.3f} ({', '.join(f'{x:.3f}' for x in cpu[w])}) | "
            f"{'1.00x' if w == 'buffer' else page.rounds(ratios(w))} | {statistics.median(wall[w]):.3f} |"
            for w in ways
        ],
        *page.targets(checks),
    ]
    return page.finish(lines, checks, args.out)


if __name__ == "__main__":
    sys.exit(main())
