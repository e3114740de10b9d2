"""Counting what a command executes, with valgrind's callgrind: user-space instructions, a count that this
shared machine's load does not move as it moves time and CPU time. The kernel's part is not in it; a page
that decides a target by a count says so, and counts the system calls apart where they differ.
"""

from __future__ import annotations

import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
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
    dumps = callgrind_dumps(cmd, env, options)
    if before_exec:
        # The first part of the first process: everything before its first execve (`out.PID.1`).
        dumps = [(name, text) for name, text in dumps if name.endswith(".1")][:1]
    return sum(
        int(line.split()[1]) for _, text in dumps for line in text.splitlines() if line.startswith("summary:")
    )


def callgrind_dumps(cmd: list[str], env: dict[str, str], options: list[str]) -> list[tuple[str, str]]:
    """The callgrind dumps of `cmd` run with `COUNTED` added to `env` and valgrind's `options`: each dump's
    file name (`out.PID` or `out.PID.PART`) and text, in the order of their names."""
    with tempfile.TemporaryDirectory(prefix="callgrind-") as d:
        subprocess.run(
            ["valgrind", "--tool=callgrind", *options, f"--callgrind-out-file={d}/out.%p", *cmd],
            env={**env, **COUNTED}, stdin=subprocess.DEVNULL, capture_output=True, check=True, timeout=3600,
        )  # fmt: skip
        return [(p.name, p.read_text(errors="replace")) for p in sorted(Path(d).iterdir())]


@dataclass
class Profile:
    """One process's callgrind profile: its pid, its command line, and the instructions executed in each
    ELF object and in each function (`(object, function)`), by the function itself, not its callees."""

    pid: int
    command: str
    objects: Counter[str] = field(default_factory=Counter)
    functions: Counter[tuple[str, str]] = field(default_factory=Counter)


def profiles(cmd: list[str], env: dict[str, str]) -> list[Profile]:
    """The profile of every process `cmd` runs (a forked child's starts from its parent's counts at the
    fork), in the order of their pids."""
    found = [_profile(name, text) for name, text in callgrind_dumps(cmd, env, ["--trace-children=yes"])]
    return sorted(found, key=lambda p: p.pid)


def _profile(name: str, text: str) -> Profile:
    """Reads one dump: callgrind's format names each object and function once, as `(N) name`, and `(N)`
    after; the line after `calls=` is a callee's inclusive cost, left out."""
    profile = Profile(pid=int(name.split(".")[1]), command="")
    names: dict[str, dict[str, str]] = {"ob": {}, "fn": {}, "fl": {}}
    kinds = {"ob": "ob", "cob": "ob", "fn": "fn", "cfn": "fn", "fl": "fl", "fi": "fl", "fe": "fl", "cfi": "fl",
             "cfl": "fl"}  # fmt: skip
    obj = fn = ""
    callee_cost = False
    for line in text.splitlines():
        if callee_cost:
            callee_cost = False
            continue
        if line.startswith("cmd:"):
            profile.command = line[4:].strip()
            continue
        if line.startswith("calls="):
            callee_cost = True
            continue
        head, eq, rest = line.partition("=")
        if eq and head in kinds:
            named = _name(names[kinds[head]], rest)
            if head == "ob":
                obj = named
            elif head == "fn":
                fn = named
            continue
        fields = line.split()
        if len(fields) >= 2 and (line[0].isdigit() or line[0] in "+-*"):
            profile.objects[obj] += int(fields[1])
            profile.functions[obj, fn] += int(fields[1])
    return profile


def _name(table: dict[str, str], text: str) -> str:
    """A compressed name: `(N) name` defines N, `(N)` uses it."""
    if not text.startswith("("):
        return text
    number, _, name = text[1:].partition(")")
    if name.strip():
        table[number] = name.strip()
    return table.get(number, text)


def per_warm_epoch(job: Callable[[int], int]) -> tuple[int, int, int]:
    """`job(epochs)` counted for 2 epochs and for 4, and one warm epoch's count: the difference halved, so
    that the start, the first epoch and the workers' fork cancel out."""
    two, four = job(2), job(4)
    return two, four, (four - two) // 2
