"""Counting what a command executes, with valgrind's callgrind: user-space instructions, a count that this
shared machine's load does not move as it moves time and CPU time. The kernel's part is not in it; a page
that decides a target by a count says so, and counts the system calls apart where they differ.
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

# What makes a count the same in every run: a fixed hash seed (Python's dicts then do the same work), and
# one thread for OpenBLAS and OpenMP, whose idle workers spin for as long as the scheduler lets them. Two
# counts of `import torch` so set differ by about 1,000 instructions in 6 billion.
COUNTED = {"PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def instructions(
    cmd: list[str], env: dict[str, str], *, children: bool = False, before_exec: bool = False
) -> int:
    """User-space instructions `cmd` executes, with `COUNTED` added to `env`.

    With `children`, every process it starts is counted too (a DataLoader's forked workers). A forked
    child's count starts from its parent's at the fork: what the parent did before is in both, and cancels
    out of the difference of two jobs that fork at the same point. With `before_exec`, only what the
    process executes before it first calls `execve` (`tierstore run`'s own part: it ends by exec'ing the
    job)."""
    options = ["--trace-children=yes"] if children else []
    options += ["--dump-before=execve"] if before_exec else []
    with tempfile.TemporaryDirectory(prefix="callgrind-") as d:
        subprocess.run(
            ["valgrind", "--tool=callgrind", *options, f"--callgrind-out-file={d}/out.%p", *cmd],
            env={**env, **COUNTED}, stdin=subprocess.DEVNULL, capture_output=True, check=True, timeout=3600,
        )  # fmt: skip
        dumps = sorted(Path(d).iterdir())
        if before_exec:
            # The first part of the first process: everything before its first execve (`out.PID.1`).
            dumps = [p for p in dumps if p.name.endswith(".1")][:1]
        return sum(
            int(line.split()[1])
            for dump in dumps
            for line in dump.read_text().splitlines()
            if line.startswith("summary:")
        )


def per_warm_epoch(job: Callable[[int], int]) -> tuple[int, int, int]:
    """`job(epochs)` counted for 2 epochs and for 4, and one warm epoch's count: the difference halved, so
    that the start, the first epoch and the workers' fork cancel out."""
    two, four = job(2), job(4)
    return two, four, (four - two) // 2
