"""A connection to the node's agent for model streams: requests and events as JSON objects, each call with a
deadline. The frames themselves are `_core.AgentLink`'s, the wire protocol's one implementation
(crates/tierstore-core/src/wire.rs): nothing here packs bytes."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import weakref
from pathlib import Path
from typing import Any

from tierstore import _core
from tierstore import agent as _agent

# How long any request to the agent may take before it is given up, in seconds.
DEFAULT_DEADLINE = 10.0

# A stream request failed; the message names the stream, the version and what to do (made by `_core`, so
# that the agent's refusals, which the connection reads, are raised as this type).
StreamError = _core.StreamError


def _socket_path(socket: str | os.PathLike[str] | None) -> Path:
    """The agent's socket: the one given, else this user's (`$XDG_RUNTIME_DIR/tierstore/agent.sock`)."""
    return Path(socket) if socket is not None else _agent.default_socket()


class _Connection:
    """One connection to the node's agent, past its hello. Sends are serialized, and so are receives; each
    waits at most its deadline.

    Raises:
        StreamError: No agent answers on `path`, it speaks another protocol, or it refused the connection.
    """

    def __init__(self, path: Path, deadline: float) -> None:
        self.path = path
        self.deadline = deadline
        self._link = _core.AgentLink(path, deadline)

    def send(self, request: dict[str, Any]) -> None:
        self._link.send(json.dumps(request))

    def recv(self, timeout: float | None) -> dict[str, Any]:
        """The next stream event (an answer or a notice)."""
        event: dict[str, Any] = json.loads(self._link.recv(timeout))
        return event

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        answer: dict[str, Any] = json.loads(self._link.call(json.dumps(request)))
        return answer

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._link.close()


def _connect(socket: str | os.PathLike[str] | None, deadline: float) -> _Connection:
    """A connection to the node's agent; the default agent is started on demand (it exits when idle)."""
    path = _socket_path(socket)
    if path == _agent.default_socket() and not _agent.answers(path):
        with contextlib.suppress(_agent.AgentError):
            _agent.start(path, idle_exit=_agent.ON_DEMAND_IDLE_EXIT)
    return _Connection(path, deadline)


def closed_at_exit() -> weakref.WeakSet[Any]:
    """A set of objects with a `close()` that closes those still open when the interpreter exits, by an
    atexit hook registered now (hooks run last-registered first: a set made later is closed earlier).
    Each close joins its object's thread, so that none is left to wake while the interpreter finalizes
    (see crates/tierstore-py/src/exiting.rs)."""
    members: weakref.WeakSet[Any] = weakref.WeakSet()

    def close_all() -> None:
        for member in list(members):
            with contextlib.suppress(Exception):
                member.close()

    atexit.register(close_all)
    return members
