"""The node agent: one long-lived process per node (see docs/design/architecture.md, "The node agent").

`tierstore agent run` runs it in the foreground (for a launcher: `srun --ntasks-per-node=1 tierstore
agent run`, a systemd unit); `start` starts it as a detached daemon and returns once it answers;
`status` and `stop` talk to it over its Unix socket. The executable is `tierstore-agent`, installed
beside the `tierstore` command by the same `pip install`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tierstore import _core
from tierstore.types import ClusterConfig


class AgentError(_core.TierstoreError, RuntimeError):
    """The agent could not be started, reached or stopped; the message says why and what to do. A
    `TierstoreError`, as every error of tierstore's own is (and a RuntimeError, as it always was)."""


def executable() -> str:
    """The path of `tierstore-agent`, which the wheel installs as a script of the package: beside this
    Python (a venv), in the scripts directory of the install scheme (`pip install --user` too), else on
    PATH."""
    import sysconfig

    places = [Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))]
    # The user scheme's directory: unknown to sysconfig in a venv (it names no user base there).
    with contextlib.suppress(KeyError, AttributeError):
        places.append(Path(sysconfig.get_path("scripts", f"{os.name}_user")))
    for place in places:
        if (place / "tierstore-agent").exists():
            return str(place / "tierstore-agent")
    found = shutil.which("tierstore-agent")
    if not found:
        raise AgentError(
            "tierstore-agent is not installed beside tierstore (looked in "
            f"{', '.join(str(p) for p in places)} and PATH); reinstall with `pip install tierstore`"
        )
    return found


def default_socket() -> Path:
    """This user's agent socket: in $XDG_RUNTIME_DIR, or in a private directory under /tmp, or, where
    another user made /tmp/tierstore-UID first, in ~/.tierstore/run-HOST (the agent's own rule, from
    `_core`)."""
    return Path(_core.default_socket())


def run_args(
    socket: Path,
    node: str | None = None,
    listen: str | None = None,
    token_file: str | None = None,
    idle_exit: float | None = None,
    metrics: str | None = None,
    stream_redis: str | None = None,
    stream_keep: int | None = None,
    stream_dir: str | None = None,
) -> list[str]:
    """The command line that runs an agent with these settings (unset ones come from the configuration)."""
    args = [executable(), "run", "--socket", str(socket)]
    for flag, value in (
        ("--node", node),
        ("--listen", listen),
        ("--token-file", token_file),
        ("--metrics", metrics),
        ("--stream-redis", stream_redis),
        ("--stream-keep", None if stream_keep is None else str(stream_keep)),
        ("--stream-dir", stream_dir),
    ):
        if value:
            args += [flag, value]
    if idle_exit is not None:
        args += ["--idle-exit", str(idle_exit)]
    return args


def status(socket: Path, timeout: float = 10.0) -> str | None:
    """The agent's status as JSON text, or None when no agent answers on `socket`.

    Raises:
        AgentError: something answers there but is refused (another user's process bound in its place),
            or refuses this client; the message says which.
    """
    p = subprocess.run(
        [executable(), "status", "--json", "--socket", str(socket)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if p.returncode == 0:
        return p.stdout
    said = p.stderr.strip().removeprefix("tierstore-agent: ")
    if " refused: " in said or "served by uid" in said:
        raise AgentError(said)
    return None


def start(
    socket: Path,
    *,
    log: Path | None = None,
    deadline: float = 10.0,
    env: dict[str, str] | None = None,
    **settings: Any,
) -> tuple[int, Path]:
    """Starts an agent as a detached daemon (its own session, its output in `log`) and returns once it
    answers: (its pid, its log). `env` is the job's environment (its TIERSTORE_* configuration names
    the source the agent serves). An agent already answering on `socket` is left as it is.

    Raises:
        AgentError: the agent exited or did not become ready within `deadline` seconds; the message
            carries the end of its log.
    """
    log = log or socket.parent / "agent.log"
    # The runtime directory is this user's own (made 0700, or checked: never one another user made
    # first), and the log is never opened through a link another user planted. Nothing in it is looked
    # at before the check: another user's directory may not even be searchable.
    try:
        _core.private_dir(socket.parent)
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        logged = os.fstat(fd).st_size
    except OSError as e:
        raise AgentError(f"cannot start an agent on {socket}: {e}") from e
    with open(fd, "ab") as out:
        proc = subprocess.Popen(
            run_args(socket, **settings),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=out,
            start_new_session=True,  # survives the shell and the job step that started it
            close_fds=True,
            env=env,
        )
    assert proc.stdout is not None
    end = time.monotonic() + deadline
    os.set_blocking(proc.stdout.fileno(), False)
    seen = b""
    while time.monotonic() < end:
        chunk = proc.stdout.read() or b""
        seen += chunk
        if seen.startswith(b"ready"):
            proc.stdout.close()
            # Reap it whenever it exits, so a long job that started it keeps no zombie.
            threading.Thread(target=proc.wait, name="tierstore-agent-reaper", daemon=True).start()
            return proc.pid, log
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    exited = proc.poll()
    if exited is None:
        proc.kill()
        what = f"the agent did not start on {socket} within {deadline:.0f} s"
    else:
        what = f"the agent exited at once (status {exited}) instead of starting on {socket}"
    # What this agent wrote, not what earlier ones left in the log.
    said = ""
    with contextlib.suppress(OSError), open(log, "rb") as f:
        f.seek(logged)
        said = f.read().decode(errors="replace")[-2000:].strip()
    raise AgentError(f"{what}; it said (in {log}):\n{said or '(nothing)'}{_fix_for(said)}")


def _fix_for(said: str) -> str:
    """What to do about a failed start, from what the agent said."""
    if "Address already in use" in said or "address in use" in said:
        return (
            "\nanother process listens on the agent's port: stop it (`tierstore agent status` says whether it "
            "is an agent of yours), or give this job another port with [cluster] port or TIERSTORE_PORT"
        )
    return ""


def peer_status(address: str, env: dict[str, str] | None = None, timeout: float = 5.0) -> dict[str, Any]:
    """The status of the agent of another node (`host:port`), asked over TCP with the job's token (from
    the configuration in `env`): its report, or {"error": why}."""
    p = subprocess.run(
        [executable(), "status", "--json", "--peer", address],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    if p.returncode != 0:
        return {"error": p.stderr.strip().removeprefix("tierstore-agent: ")}
    report: dict[str, Any] = json.loads(p.stdout)
    return report


def cluster_status(members: list[str], env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Every member's agent status, asked at once: [{"address": ..., "up": ..., "report"/"error": ...}]."""
    from concurrent.futures import ThreadPoolExecutor

    def one(address: str) -> dict[str, Any]:
        try:
            r = peer_status(address, env)
        except subprocess.TimeoutExpired:
            r = {"error": "no answer within 5 s"}
        if "error" in r:
            return {"address": address, "up": False, "error": r["error"]}
        return {"address": address, "up": True, "report": r}

    with ThreadPoolExecutor(min(32, max(1, len(members)))) as pool:
        return list(pool.map(one, members))


# How long an agent started on demand waits, with no peer or local client, before it exits.
ON_DEMAND_IDLE_EXIT = 600.0

_ensured: set[Path] = set()


def answers(socket: Path) -> bool:
    """Whether an agent of this user accepts connections on `socket` within 2 s (a connect, no request; a
    socket served by another user's process does not count)."""
    import socket as so
    import struct

    with so.socket(so.AF_UNIX, so.SOCK_STREAM) as s:
        # A blocking connect whose wait for room in a busy agent's queue the send timeout bounds; with a
        # timeout of Python's own (a non-blocking socket), a full queue would fail at once with EAGAIN, and
        # the caller would start a second agent beside a live one.
        s.setsockopt(so.SOL_SOCKET, so.SO_SNDTIMEO, struct.pack("ll", 2, 0))
        try:
            s.connect(str(socket))
            _pid, uid, _gid = struct.unpack(
                "3i", s.getsockopt(so.SOL_SOCKET, so.SO_PEERCRED, struct.calcsize("3i"))
            )
        except OSError:
            return False
    return uid in (os.geteuid(), 0)


def ensure(cluster: ClusterConfig, env: dict[str, str] | None = None, socket: Path | None = None) -> None:
    """Starts this node's agent on demand when the configuration shares the cache across nodes (once per
    process): the node's files must be served to its peers while the job runs. It exits after
    ON_DEMAND_IDLE_EXIT seconds without a client.

    Raises:
        AgentError: no agent answers and none could be started; the message carries its log.
    """
    if cluster.get("sharing", "off") == "off":
        return
    socket = socket or default_socket()
    if socket in _ensured or answers(socket):
        _ensured.add(socket)
        return
    try:
        start(socket, env=env, idle_exit=ON_DEMAND_IDLE_EXIT)
    except AgentError:
        # Another process of the node may have started it meanwhile.
        if not answers(socket):
            raise
    _ensured.add(socket)


def stop(socket: Path, timeout: float = 15.0) -> str:
    """Stops the agent on `socket` gracefully; returns what it said."""
    p = subprocess.run(
        [executable(), "stop", "--socket", str(socket)], capture_output=True, text=True, timeout=timeout
    )
    if p.returncode != 0:
        raise AgentError(p.stderr.strip().removeprefix("tierstore-agent: "))
    return p.stdout.strip()
