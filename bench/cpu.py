"""CPU time of the processes under test, which this shared machine's load does not stretch as it stretches
wall time: a benchmark reports it beside every timed ratio.

psutil reads it from /proc: the process, every live descendant (a DataLoader's persistent workers), and
the children it has already waited for (workers that exited), user and system time together.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable
from typing import Any

import psutil


def tree_seconds(pid: int | None = None) -> float:
    """CPU seconds used so far by process `pid` (this one by default) and its descendants."""
    p = psutil.Process(pid)
    t = p.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in p.children(recursive=True):
        try:
            c = child.cpu_times()
        except psutil.NoSuchProcess:
            continue  # exited between the listing and the read: counted in children_* once waited for
        total += c.user + c.system
    return total


def timed_epochs(
    loader: Iterable[Any], epochs: int, summary: Callable[[Any], object], step_ms: float
) -> None:
    """Runs `epochs` epochs of `loader`, a `step_ms` step after each batch standing in for the model, and
    prints one JSON line: each epoch's seconds (from `iter(loader)` to the last batch) and CPU seconds of
    this process and its workers, and a digest of every batch's `summary`, so that setups can be checked
    to see the same samples."""
    digest = hashlib.sha256()
    seconds, cpu = [], []
    for _ in range(epochs):
        c0, t0 = tree_seconds(), time.perf_counter()
        for batch in loader:
            digest.update(repr(summary(batch)).encode())
            time.sleep(step_ms / 1000)
        seconds.append(time.perf_counter() - t0)
        cpu.append(tree_seconds() - c0)
    print(json.dumps({"seconds": seconds, "cpu": cpu, "digest": digest.hexdigest()}), flush=True)
