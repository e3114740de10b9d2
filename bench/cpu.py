"""CPU time of the processes under test, which this shared machine's load does not stretch as it stretches
wall time: a benchmark reports it beside every timed ratio.

psutil reads it from /proc: the process, every live descendant (a DataLoader's persistent workers), and
the children it has already waited for (workers that exited), user and system time together.
"""

from __future__ import annotations

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
