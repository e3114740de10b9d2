"""The consumer's side of a model stream: following its versions, in order, as the agent pushes them."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from tierstore.stream.connection import (
    DEFAULT_DEADLINE,
    StreamError,
    _connect,
    _Connection,
    _socket_path,
    closed_at_exit,
)
from tierstore.stream.version import StreamVersion, _version_of


class Subscriber:
    """Follows the versions of stream `name` on this node, pushed by the agent as they are committed.

    Every version is seen in order, by `on_update` callbacks; `latest()` and `wait()` give the newest.
    Versions published while this subscriber was not connected are reported in `skipped`, never silently.

    Args:
        name: the stream.
        after: the newest version already had: only newer ones are announced.
        on_update: a callback for every version, the latest one at subscription included.
        notices_only: this consumer takes the tensors by other means (a process group): while every
            subscriber of the stream on this node asks so, the agent relays the versions another node
            publishes without pulling their tensors (`StreamVersion.held` is False; `fetch` pulls one).
            Ignored by an agent that does not offer it (`notices_only` is then False).
        label: what `tierstore stream show|watch` calls this consumer (default: "Subscriber").
    """

    def __init__(
        self,
        name: str,
        *,
        socket: str | os.PathLike[str] | None = None,
        deadline: float = DEFAULT_DEADLINE,
        after: int = 0,
        on_update: Callable[[StreamVersion], None] | None = None,
        notices_only: bool = False,
        label: str | None = None,
    ) -> None:
        self.name = name
        self._notices_only = notices_only
        self._label = label or "Subscriber"
        # What the agent offers beyond the first protocol (stream::FEATURES), from its subscribe answer.
        self._features: frozenset[str] = frozenset()
        # The version this consumer reported serving: told again to the agent after a reconnect.
        self._serving: int | None = None
        self._socket = _socket_path(socket)
        self._deadline = deadline
        self._cond = threading.Condition()
        self._latest: StreamVersion | None = None
        self._returned = after
        self._seen = after
        # A callback given here also sees the version that is latest when the subscription starts.
        self._callbacks: list[Callable[[StreamVersion], None]] = [on_update] if on_update else []
        self._pins: dict[int, int] = {}
        self._held: set[int] = set()
        self._closed = False
        self.received = 0
        self.skipped = 0
        self.errors: list[str] = []
        self._conn = self._subscribe()
        self._thread = threading.Thread(target=self._run, name=f"tierstore-subscriber-{name}", daemon=True)
        self._thread.start()
        _open.add(self)

    def _subscribe(self, first: bool = True) -> _Connection:
        # Only the first connection may start an agent on demand: one stopped later stays stopped.
        conn = _connect(self._socket, self._deadline) if first else _Connection(self._socket, self._deadline)
        try:
            answer = conn.call(
                {
                    "op": "subscribe",
                    "name": self.name,
                    "after": self._seen,
                    "notices_only": self._notices_only,
                    "pid": os.getpid(),
                    "label": self._label,
                }
            )
            self._features = frozenset(answer.get("features", ()))
            if self._serving is not None and "serving" in self._features:
                conn.send({"op": "serving", "version": self._serving})
        except BaseException:
            conn.close()
            raise
        return conn

    @property
    def notices_only(self) -> bool:
        """Whether the agent relays versions held elsewhere without pulling them (as asked, where offered)."""
        return self._notices_only and "notices_only" in self._features

    def report_serving(self, version: int) -> None:
        """Tells the agent that this consumer serves `version` from now on (one small frame, no answer), so
        that `tierstore stream show|watch` list its lag. `HotModel` calls it at each swap."""
        self._serving = version
        if "serving" in self._features:
            with contextlib.suppress(OSError):  # a lost agent is resubscribed, and told again
                self._conn.send({"op": "serving", "version": version})

    @contextlib.contextmanager
    def fetch(self, version: int, timeout: float | None = None) -> Iterator[StreamVersion]:
        """Version `version`, held by this node's agent while the block runs: one it was only told of
        (relayed, `held` False) is pulled from the node that holds it first.

        Args:
            version: the version.
            timeout: how long the pull may take, in seconds (default: the deadline).

        Raises:
            StreamError: the agent no longer knows of the version, or pulling it failed (the message says
                from where and why), or the agent does not offer `fetch`.
            TimeoutError: the agent did not answer within `timeout`.
        """
        if "fetch" not in self._features:
            raise StreamError(
                f"the agent on {self._socket} cannot fetch a version; run the same tierstore for the agent "
                "and its clients"
            )
        conn = _Connection(self._socket, self._deadline)
        try:
            conn.send({"op": "fetch", "name": self.name, "version": version})
            yield _version_of(conn.recv(self._deadline if timeout is None else timeout))
        finally:
            conn.close()  # the lease ends with the connection

    def _run(self) -> None:
        while not self._closed:
            try:
                event = self._conn.recv(None)
            except (OSError, StreamError, ValueError) as e:
                if self._closed:
                    return
                self._record(f"lost the agent on {self._conn.path} ({e}); reconnecting")
                self._reconnect()
                continue
            if event.get("event") == "version":
                self._arrived(event)

    def _reconnect(self) -> None:
        with self._cond:
            self._held.clear()  # the old connection's leases ended with it
        delay = 0.05
        while not self._closed:
            try:
                self._conn = self._subscribe(first=False)
                return
            except (OSError, StreamError) as e:
                self._record(f"cannot resubscribe to {self.name} ({e}); retrying in {delay:.2f} s")
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _record(self, message: str) -> None:
        with self._cond:
            self.errors.append(message)
            del self.errors[:-100]

    def _arrived(self, event: Mapping[str, Any]) -> None:
        number = int(event["version"])
        try:
            version = _version_of(event)
        except (OSError, ValueError, KeyError) as e:
            self._record(f"{self.name} version {number}: unreadable manifest ({e})")
            self._release(number)
            return
        with self._cond:
            if self._seen and number > self._seen + 1:
                self.skipped += number - self._seen - 1
                self.errors.append(
                    f"{self.name}: versions {self._seen + 1}..{number - 1} were published while away"
                )
            previous = self._latest
            self._seen = max(self._seen, number)
            self._latest = version
            self._held.add(number)
            self._pins[number] = self._pins.get(number, 0) + 1  # held through the callbacks
            self.received += 1
            callbacks = list(self._callbacks)
            self._cond.notify_all()
        for cb in callbacks:
            try:
                cb(version)
            except Exception as e:
                self._record(f"on_update callback {getattr(cb, '__name__', cb)!r} failed on {version}: {e!r}")
        self.unpin(number)
        if previous is not None:
            self._maybe_release(previous.version)

    def _maybe_release(self, number: int) -> None:
        with self._cond:
            if (
                self._pins.get(number, 0) > 0
                or number not in self._held
                or (self._latest is not None and self._latest.version == number)
            ):
                return
            self._held.discard(number)
        self._release(number)

    def _release(self, number: int) -> None:
        with contextlib.suppress(OSError):
            self._conn.send({"op": "release", "name": self.name, "version": number})

    def pin(self, number: int) -> bool:
        """Keeps version `number` held by the agent until `unpin`; False if it is no longer held."""
        with self._cond:
            if number not in self._held:
                return False
            self._pins[number] = self._pins.get(number, 0) + 1
            return True

    def unpin(self, number: int) -> None:
        with self._cond:
            n = self._pins.get(number, 0) - 1
            if n > 0:
                self._pins[number] = n
                return
            self._pins.pop(number, None)
        self._maybe_release(number)

    def latest(self) -> StreamVersion | None:
        """The newest version this subscriber was told of (None before the first)."""
        with self._cond:
            if self._latest is not None:
                self._returned = self._latest.version
            return self._latest

    def wait(self, timeout: float | None = None, after: int | None = None) -> StreamVersion:
        """The newest version once one newer than `after` (default: the one `latest`/`wait` last returned)
        arrives.

        Raises:
            TimeoutError: none arrived within `timeout` seconds.
        """
        threshold = self._returned if after is None else after
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._closed or (self._latest is not None and self._latest.version > threshold),
                timeout,
            )
            if not ok or self._latest is None or self._latest.version <= threshold:
                raise TimeoutError(
                    f"no version of {self.name} newer than {threshold} within {timeout} s"
                    + (f" (last error: {self.errors[-1]})" if self.errors else "")
                )
            self._returned = self._latest.version
            return self._latest

    def _newest_pinned(self, after: int, timeout: float) -> StreamVersion | None:
        """The newest version once it is newer than `after`, pinned (the latest is always held)."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._closed or (self._latest is not None and self._latest.version > after), timeout
            )
            if not ok or self._closed or self._latest is None or self._latest.version not in self._held:
                return None
            v = self._latest
            self._pins[v.version] = self._pins.get(v.version, 0) + 1
            return v

    def on_update(self, callback: Callable[[StreamVersion], None]) -> None:
        """Calls `callback(version)` for every version from now on, in order, on the subscriber's thread
        (the version is held while it runs)."""
        with self._cond:
            self._callbacks.append(callback)

    def close(self) -> None:
        """Ends the subscription; the agent releases what it held for it."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._conn.close()
        self._thread.join(timeout=self._deadline)

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def streams(
    socket: str | os.PathLike[str] | None = None, deadline: float = DEFAULT_DEADLINE
) -> dict[str, Any]:
    """The agent's streams: their versions (sizes, leases), subscribers, and the shared memory held."""
    conn = _Connection(_socket_path(socket), deadline)
    try:
        return conn.call({"op": "list"})
    finally:
        conn.close()


# Subscriptions still open when the interpreter exits are closed first, each thread joined within its
# deadline: a thread left blocked in a process group's collective (a group subscriber waits there for the
# next version) that returns once the interpreter is finalizing aborts the process ("FATAL: exception not
# rethrown": CPython ends it with a forced unwind that torch's C++ frames swallow).
_open: weakref.WeakSet[Subscriber] = closed_at_exit()
