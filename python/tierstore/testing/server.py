"""What every server of `tierstore.testing` shares (SeaweedFS, fake-gcs-server, rclone's WebDAV): a process
in a session of its own, its output in a log under its directory, polled until it answers, and killed,
paused or resumed as a whole, as a crash or a hung store would be.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T", bound="LoopbackServer")


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on 127.0.0.1 now (all held until all are found, so none is given twice)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LoopbackServer:
    """The lifecycle of one server process on loopback. A server sets `name` (for messages) and `log_name`,
    `root` and `endpoint`, and says when it answers (`_answers`)."""

    name = "the server"
    log_name = "server.log"
    # How often `_launch` asks whether the server answers.
    poll_s = 0.05

    root: Path
    endpoint: str
    proc: subprocess.Popen[bytes] | None = None

    def _answers(self) -> bool:
        raise NotImplementedError

    def _launch(self, args: Sequence[str], timeout: float, env: Mapping[str, str] | None = None) -> None:
        """Starts `args` and waits until the server answers: an error with its log's tail when it exits
        first or does not answer within `timeout` seconds."""
        log = open(self.root / self.log_name, "ab")  # noqa: SIM115 (the server keeps it)
        self.proc = subprocess.Popen(
            list(args), stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited at start: {self.log_tail()}")
            if self._answers():
                break
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"{self.name} did not answer on {self.endpoint} in {timeout:.0f} s: {self.log_tail()}"
                )
            time.sleep(self.poll_s)

    def log_tail(self, n: int = 2000) -> str:
        try:
            return (self.root / self.log_name).read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILLs the server (every process of it at once, as a crash would)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOPs the server: it keeps its connections and answers nothing, as a hung store does."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONTs a paused server."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def __enter__(self: T) -> T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
