"""Node agents started by a test, and the client processes that talk to them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from tierstore import agent


def start_agent(
    path: Path, *extra: str, node: str = "n1", inside: Callable[..., list[str]] | None = None
) -> subprocess.Popen[bytes]:
    """A node agent on socket `path` (inside a network namespace: `inside=Node.cmd`), once it is ready."""
    argv = [*agent.run_args(path, node=node), *extra]
    proc = subprocess.Popen(
        inside(*argv) if inside is not None else argv,
        stdout=subprocess.PIPE,
        stderr=open(path.parent / "agent.log", "ab"),  # noqa: SIM115
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith(b"ready"), (path.parent / "agent.log").read_text()
    return proc


def stop_agent(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(timeout=20)


def exited(pid: int) -> bool:
    """Whether process `pid` has ended: gone, or a zombie. An agent `tierstore agent start` detached is
    reaped by init, which may take a second or more after it exited (this machine's init polls), and a
    zombie still answers `kill(pid, 0)`."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    # The state follows the command name, which is in parentheses and may hold any character.
    return stat[stat.rindex(")") + 2 :].startswith(("Z", "X"))


def child(code: str, sock: Path) -> subprocess.Popen[str]:
    """A Python process running `code`, talking to the agent on `sock` (…/tierstore/agent.sock)."""
    env = {**os.environ, "XDG_RUNTIME_DIR": str(sock.parent.parent)}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def child_in(cmd: Callable[..., list[str]], code: str, sock: Path) -> subprocess.Popen[str]:
    """`child` inside a network namespace (`cmd=Node.cmd`); its stderr is this process's."""
    env = {**os.environ, "XDG_RUNTIME_DIR": str(sock.parent.parent)}
    return subprocess.Popen(
        cmd(sys.executable, "-c", textwrap.dedent(code)),
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
