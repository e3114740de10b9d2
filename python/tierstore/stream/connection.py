"""A connection to the node's agent for model streams: one Unix socket past its hello, requests and events
as JSON in the wire protocol's stream frames, each call with a deadline."""

from __future__ import annotations

import contextlib
import json
import os
import socket as so
import struct
import threading
import time
from pathlib import Path
from typing import Any

from tierstore import _core
from tierstore import agent as _agent

# How long any request to the agent may take before it is given up, in seconds.
DEFAULT_DEADLINE = 10.0


# The wire protocol of crates/tierstore-core/src/wire.rs (the one definition of it): the frames a stream
# client sends and receives. A frame is a u32 big-endian body length, a kind byte, then the kind's fields.
_PROTOCOL = 1


_CHALLENGE, _HELLO, _WELCOME, _PING, _PONG, _ERROR = 1, 2, 3, 4, 5, 10


_STREAM_REQUEST, _STREAM_EVENT = 40, 41


class StreamError(_core.TierstoreError):
    """A stream request failed; the message names the stream, the version and what to do."""


def _socket_path(socket: str | os.PathLike[str] | None) -> Path:
    """The agent's socket: the one given, else this user's (`$XDG_RUNTIME_DIR/tierstore/agent.sock`)."""
    return Path(socket) if socket is not None else _agent.default_socket()


class _Connection:
    """One connection to the node's agent, past its hello. Calls are serialized; each has a deadline."""

    def __init__(self, path: Path, deadline: float) -> None:
        self.path = path
        self.deadline = deadline
        self._send_lock = threading.Lock()
        self._sock = so.socket(so.AF_UNIX, so.SOCK_STREAM)
        self._sock.settimeout(deadline)
        try:
            self._sock.connect(str(path))
        except OSError as e:
            self._sock.close()
            raise StreamError(
                f"no agent answers on {path} ({e}); start one with `tierstore agent start` "
                "(or pass socket= the agent's socket)"
            ) from e
        try:
            kind, body = self._recv(deadline)
            if kind != _CHALLENGE or body[0] != _PROTOCOL:
                raise StreamError(
                    f"the agent on {path} speaks protocol {body[0] if body else '?'}, this tierstore "
                    f"{_PROTOCOL}: run the same tierstore for the agent and its clients"
                )
            node = b"local"
            self._send(_HELLO, bytes([_PROTOCOL]) + struct.pack(">H", len(node)) + node + bytes(32))
            kind, body = self._recv(deadline)
            if kind != _WELCOME:
                raise StreamError(f"the agent on {path} refused the connection: {self._message(kind, body)}")
        except BaseException:
            self._sock.close()
            raise

    @staticmethod
    def _message(kind: int, body: bytes) -> str:
        if kind == _ERROR and len(body) >= 4:
            (n,) = struct.unpack(">H", body[2:4])
            return body[4 : 4 + n].decode(errors="replace")
        return f"unexpected frame kind {kind}"

    def _send(self, kind: int, body: bytes) -> None:
        with self._send_lock:
            self._sock.sendall(struct.pack(">I", len(body) + 1) + bytes([kind]) + body)

    def _recv_exact(self, n: int, end: float | None) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            if end is not None:
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"the agent on {self.path} did not answer within {self.deadline:.1f} s"
                    )
                self._sock.settimeout(left)
            else:
                self._sock.settimeout(None)
            try:
                r = self._sock.recv_into(view[got:])
            except TimeoutError as e:
                raise TimeoutError(
                    f"the agent on {self.path} did not answer within {self.deadline:.1f} s"
                ) from e
            if r == 0:
                raise ConnectionError(f"the agent on {self.path} closed the connection")
            got += r
        return bytes(buf)

    def _recv(self, timeout: float | None) -> tuple[int, bytes]:
        end = None if timeout is None else time.monotonic() + timeout
        (n,) = struct.unpack(">I", self._recv_exact(4, end))
        body = self._recv_exact(n, end)
        return body[0], body[1:]

    def send(self, request: dict[str, Any]) -> None:
        data = json.dumps(request).encode()
        self._send(_STREAM_REQUEST, struct.pack(">I", len(data)) + data)

    def recv(self, timeout: float | None) -> dict[str, Any]:
        """The next stream event (an answer or a notice)."""
        while True:
            kind, body = self._recv(timeout)
            if kind == _STREAM_EVENT:
                (n,) = struct.unpack(">I", body[:4])
                event: dict[str, Any] = json.loads(body[4 : 4 + n])
                return event
            if kind == _PONG:
                continue
            raise StreamError(f"the agent on {self.path}: {self._message(kind, body)}")

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        self.send(request)
        return self.recv(self.deadline)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(so.SHUT_RDWR)
        self._sock.close()


def _connect(socket: str | os.PathLike[str] | None, deadline: float) -> _Connection:
    """A connection to the node's agent; the default agent is started on demand (it exits when idle)."""
    path = _socket_path(socket)
    if path == _agent.default_socket() and not _agent.answers(path):
        with contextlib.suppress(_agent.AgentError):
            _agent.start(path, idle_exit=_agent.ON_DEMAND_IDLE_EXIT)
    return _Connection(path, deadline)
