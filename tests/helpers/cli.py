"""The `tierstore` command line, run in a process of its own as a user runs it (`python -m tierstore.cli`),
its output captured as text."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def tierstore(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`tierstore ARGS`. `env`: the command's whole environment (default: this process's)."""
    return subprocess.run(
        [sys.executable, "-m", "tierstore.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`tierstore ARGS` with `env` added to this process's environment."""
    return tierstore(*args, env={**os.environ, **(env or {})}, timeout=120)


def agent_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`tierstore agent ARGS`. `env`: the command's whole environment (default: this process's)."""
    return tierstore("agent", *args, env=env, timeout=60)


def stream_cli(sock: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`tierstore stream ARGS --socket SOCK`: the streams of the agent on `sock`."""
    return tierstore("stream", *args, "--socket", str(sock), timeout=60)


def tierstore_run(
    source: Path, tier: str, *cmd: str, revalidate: str | None = "never", **kw: Any
) -> subprocess.Popen[str]:
    """`tierstore --source SOURCE --tier TIER run --revalidate MODE -- CMD` (no `--revalidate` when MODE is
    None: the default), started with its stdin, stdout and stderr as text pipes (`kw`: more `Popen`
    arguments, such as `env`)."""
    mode = ["--revalidate", revalidate] if revalidate is not None else []
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tierstore.cli",
            "--source",
            str(source),
            "--tier",
            tier,
            "run",
            *mode,
            "--",
            *cmd,
        ],
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kw,
    )
