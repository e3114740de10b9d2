"""Model streaming: a trainer publishes weights; consumers are notified and hot-swap them between requests.

    # trainer
    from tierstore import stream
    stream.publish("policy", model, step=step)               # or sync=False: returns once snapshotted

    # inference server, any process of the node
    hot = stream.HotModel(model, "policy")
    with hot.serving() as m:                                  # one version for the whole request
        out = m(batch)

A version's tensors are placed once in shared memory held by the node's agent (`tierstore agent`), one
file per distinct tensor content named by its blake3; a publish writes only the tensors that differ from
the version before (compared byte for byte, then hashed; told which may have changed, `changed=`, it
compares the others at their first 64 KiB only). The agent numbers the version and pushes a notice
to every subscriber over its Unix socket: no polling. A consumer's `HotModel` keeps two copies of the model,
loads a new version into the one no request uses (only the tensors whose hash differs from what that copy
holds), and swaps between requests: no request waits for an update and none sees two versions. A version
is never visible before every tensor of it is placed: a publisher killed mid-publish leaves nothing.

`HotModel(model, name, mode="in-place")` keeps one copy and pauses requests for the length of each update
(reported). `DistributedPublisher` with `HotModel(..., group=, src=)` moves the changed tensors inside a
torch.distributed process group (NCCL GPU to GPU, gloo on CPUs), the agent still announcing every version.

Every notice leases its version to the subscriber's connection; the agent keeps the last `--stream-keep`
versions (2) and any leased one, and a consumer that dies releases its leases with its connection.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import json
import os
import socket as so
import struct
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tierstore import _core
from tierstore import agent as _agent
from tierstore.models.tensors import TensorSpec, mapped, spec_and_bytes, writable_bytes

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


@dataclass(frozen=True)
class StreamTensor:
    """One tensor of a version, as its manifest records it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    hash: str
    nbytes: int


@dataclass(frozen=True)
class StreamVersion:
    """One version of a model stream, as the agent numbered it."""

    name: str
    version: int
    step: int | None
    nbytes: int
    new_bytes: int
    created: float
    manifest: Path
    tensors: tuple[StreamTensor, ...] = ()
    metadata: dict[str, Any] = field(default_factory=dict)
    # Whether this node's agent holds the tensors (False: a notice relayed to a notices-only subscriber
    # from another node's agent; `Subscriber.fetch` pulls them).
    held: bool = True

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"

    def state_dict(self, framework: str = "torch") -> dict[str, Any]:
        """The tensors, read-only and without a copy (mapped from the agent's shared memory; the mapping
        stays valid after the agent frees the version). Take it while the version is held: right after
        `latest()`/`wait()` or inside `on_update`.

        Raises:
            StreamError: the version was relayed without its tensors (a notices-only subscriber); take it
                with `Subscriber.fetch(version)`.
        """
        if not self.held:
            raise StreamError(
                f"{self} was relayed to this node without its tensors (notices only); "
                "`with subscriber.fetch(version) as v:` has the agent pull them"
            )
        blobs = self.manifest.parent.parent.parent / "blobs"
        out: dict[str, Any] = {}
        for t in self.tensors:
            spec = TensorSpec(t.dtype, t.shape)
            if t.nbytes == 0:
                out[t.name] = mapped(b"", 0, spec, framework)
                continue
            buf = np.memmap(blobs / t.hash, dtype=np.uint8, mode="r")
            if framework == "numpy":
                out[t.name] = mapped(buf, 0, spec, "numpy")
            else:
                # torch.frombuffer wants a writable buffer; a private copy-on-write mapping never writes back.
                out[t.name] = mapped(np.memmap(blobs / t.hash, dtype=np.uint8, mode="c"), 0, spec, framework)
        return out


def _mapped_state(v: StreamVersion) -> dict[str, Any]:
    """A version's tensors mapped from the agent's files: numpy where numpy has the dtype, else torch."""
    try:
        return v.state_dict("numpy")
    except TypeError:
        return v.state_dict("torch")


def _version_of(event: Mapping[str, Any]) -> StreamVersion:
    path = Path(event["manifest"])
    m = json.loads(path.read_text())
    tensors = tuple(
        StreamTensor(t["name"], t["dtype"], tuple(t["shape"]), t["hash"], int(t["nbytes"]))
        for t in m["tensors"]
    )
    return StreamVersion(
        name=m["name"],
        version=int(m["version"]),
        step=m.get("step"),
        nbytes=int(event.get("nbytes", sum(t.nbytes for t in tensors))),
        new_bytes=int(event.get("new_bytes", 0)),
        created=float(m.get("created", 0.0)),
        manifest=path,
        tensors=tensors,
        metadata=m.get("metadata") or {},
        held=bool(event.get("held", True)),
    )


def _said_unchanged(model_or_state_dict: Any, names: list[str], changed: Any) -> set[str]:
    """The tensors `publish(changed=...)` says are unchanged since the publish before: none for None; those
    not named for a list of names; the frozen parameters (`requires_grad=False`) for "trainable"."""
    if changed is None:
        return set()
    if isinstance(changed, str):
        if changed != "trainable":
            raise ValueError(
                f"publish(changed={changed!r}): pass a list of tensor names (for one tensor, [{changed!r}]) "
                'or "trainable" (every tensor but the frozen parameters)'
            )
        if not hasattr(model_or_state_dict, "named_parameters"):
            raise TypeError(
                'publish(changed="trainable") needs the nn.Module (it reads requires_grad); with a state_dict, '
                "pass the names of the tensors that may have changed"
            )
        frozen = {
            n for n, p in model_or_state_dict.named_parameters(remove_duplicate=False) if not p.requires_grad
        }
        return {n for n in names if n in frozen}
    named = {str(n) for n in changed}
    unknown = sorted(named.difference(names))
    if unknown:
        raise ValueError(
            f"publish(changed=...) names {unknown[0]!r}"
            + (f" and {len(unknown) - 1} more" if len(unknown) > 1 else "")
            + f", not a tensor of the model (its names are like {names[:3]}); name the state_dict's keys"
        )
    return set(names).difference(named)


def _flatten(model_or_state_dict: Any) -> tuple[list[str], list[TensorSpec], list[np.ndarray]]:
    state = (
        model_or_state_dict.state_dict()
        if hasattr(model_or_state_dict, "state_dict")
        else model_or_state_dict
    )
    if not isinstance(state, Mapping):
        raise TypeError(
            f"publish takes an nn.Module, a state_dict or a dict of numpy arrays, not {type(state).__name__}"
        )
    names, specs, views = [], [], []
    for key, value in state.items():
        spec, view, _ = spec_and_bytes(value, str(key))
        names.append(str(key))
        specs.append(spec)
        views.append(view)
    return names, specs, views


class Publisher:
    """Publishes versions of one stream through the node's agent. `publish` is the usual way in.

    Args:
        name: the stream.
        history: a `tierstore.models.Repository` (or its path) where every `history_every`-th version is
            saved in the background (deduplicated against the versions saved before), without holding up
            the publisher. A flush that falls behind skips to the newest version due, and counts it.
        history_every: which versions are saved: those whose number is a multiple of it.
        background_threads: the threads a `sync=False` publish places with while training goes on
            (default: half the cores, at least one), so that it does not take the trainer's cores. A
            synchronous publish uses every core: the trainer is waiting for it.
    """

    def __init__(
        self,
        name: str,
        *,
        socket: str | os.PathLike[str] | None = None,
        deadline: float = DEFAULT_DEADLINE,
        history: Any = None,
        history_every: int = 1,
        background_threads: int | None = None,
    ) -> None:
        self.name = name
        self._background_threads = background_threads or max(1, (os.cpu_count() or 2) // 2)
        self._conn = _connect(socket, deadline)
        if history is not None and not hasattr(history, "save"):
            from tierstore.models import Repository

            history = Repository(history)
        self._history = history
        self._history_every = max(1, history_every)
        self._flush_cond = threading.Condition()
        self._flush_due: tuple[StreamVersion, dict[str, Any]] | None = None
        self._flushing = False
        self._flusher: threading.Thread | None = None
        # Stream versions saved to the history, those skipped because the flush fell behind, and why any
        # flush failed.
        self.flushed: list[int] = []
        self.flush_skipped = 0
        self.flush_errors: list[str] = []
        self._lock = threading.Lock()
        self._last: tuple[int, dict[str, tuple[str, int]]] | None = None
        self._staging: list[np.ndarray] = []
        self._staging_names: list[str] = []
        # The version the staging buffer's content was placed as (None: not placed as it is).
        self._staged_version: int | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future[StreamVersion] | None = None
        # The version the last publish call placed (None while one is under way, or if it failed): what a
        # `changed=` hint is relative to. And whether that call was a snapshot into the staging buffer.
        self._hint_version: int | None = None
        self._last_call_staged = False
        # Tensors a `changed=` hint said unchanged whose first bytes differed (they were published all the
        # same), each as a message.
        self.hint_misses: list[str] = []
        # When the last commit was sent (time.time()): where publish-to-notified is measured from.
        self.last_commit_sent: float | None = None

    def publish(
        self,
        model_or_state_dict: Any,
        *,
        step: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        sync: bool = True,
        changed: Any = None,
    ) -> StreamVersion | Future[StreamVersion]:
        """Publishes the tensors as the stream's next version.

        Args:
            model_or_state_dict: an nn.Module, a state_dict, or a dict of numpy arrays.
            step: the trainer's step, recorded with the version.
            metadata: JSON-serializable facts recorded with the version.
            sync: True: returns the version once it is placed and announced. False: returns a Future as
                soon as the tensors are copied into a staging buffer (reused from one publish to the
                next); training may change them at once. A publish waits for the one before to finish.
            changed: which tensors may differ from this publisher's publish before: None (any: every
                tensor is compared whole with the version before, which reads the whole model), a list
                of names, or "trainable" (every tensor but the parameters with `requires_grad=False`,
                say a LoRA's frozen base). Of the others only the first 64 KiB are compared: a tensor
                said unchanged whose head differs is published all the same and reported
                (`hint_misses`, a warning); one changed past its head is not seen, and the version
                keeps its old bytes. The hint is ignored when the publish before failed or another
                publisher's version came between.

        Raises:
            StreamError: the agent refused the version (the message says why) or cannot be reached.
            TimeoutError: the agent did not answer within the deadline.
            ValueError, TypeError: `changed` names no tensor of the model, or is not one of the above.
        """
        names, specs, views = _flatten(model_or_state_dict)
        said = _said_unchanged(model_or_state_dict, names, changed)
        meta = dict(metadata or {})
        self._wait_pending()
        since, self._hint_version = self._hint_version, None
        staged_before, self._last_call_staged = self._last_call_staged, False
        if sync:
            return self._place(names, specs, views, step, meta, said=said, said_since=since)
        same_layout = self._staging_names == names and all(
            s.nbytes == v.nbytes for s, v in zip(self._staging, views, strict=True)
        )
        if not same_layout:
            self._staging = [np.empty(v.nbytes, dtype=np.uint8) for v in views]
            self._staging_names = names
            self._staged_version = None
        # The snapshot compares as it copies: a tensor equal to the snapshot before, which was placed as
        # the version the agent still has as its latest, keeps its hash without being compared again. A
        # tensor said unchanged is compared at its head only, if the snapshot before was the publish before.
        heads_only = [n in said for n in names] if said and same_layout and staged_before else None
        copied = _core.stream_copy(views, self._staging, heads_only)
        self._last_call_staged = True
        if heads_only is not None:
            self._note_misses([n for n, c, h in zip(names, copied, heads_only, strict=True) if c and h])
        unchanged = {n for n, c in zip(names, copied, strict=True) if not c} if same_layout else set()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"tierstore-publish-{self.name}")
        # Until this snapshot is placed, the staging buffer holds no placed version.
        since, self._staged_version = self._staged_version, None
        self._pending = self._pool.submit(
            self._place, names, specs, self._staging, step, meta, unchanged, since, self._background_threads
        )
        return self._pending

    def _wait_pending(self) -> None:
        if self._pending is not None:
            with contextlib.suppress(Exception):  # its error went to its Future
                self._pending.result()
            self._pending = None

    def _place(
        self,
        names: list[str],
        specs: list[TensorSpec],
        views: list[np.ndarray],
        step: int | None,
        metadata: dict[str, Any],
        unchanged: set[str] | None = None,
        unchanged_since: int | None = None,
        threads: int | None = None,
        said: set[str] | None = None,
        said_since: int | None = None,
    ) -> StreamVersion:
        """Places a version and commits it. `unchanged`: tensors known equal to version `unchanged_since`
        (not compared); `said`: tensors said unchanged since version `said_since` (compared at their
        head). Each holds only if that version is the agent's latest."""
        with self._lock:
            begun = self._conn.call({"op": "begin", "name": self.name})
            tmp, blobs = Path(begun["dir"]), Path(begun["blobs"])
            base: dict[str, tuple[str, int]] = {}
            if begun.get("base"):
                bv = int(begun["base"]["version"])
                if self._last is not None and self._last[0] == bv:
                    base = self._last[1]
                else:
                    m = json.loads(Path(begun["base"]["manifest"]).read_text())
                    base = {t["name"]: (t["hash"], int(t["nbytes"])) for t in m["tensors"]}
            known: dict[int, bytes] = {}
            if unchanged and begun.get("base") and unchanged_since == int(begun["base"]["version"]):
                known = {
                    i: bytes.fromhex(base[n][0]) for i, n in enumerate(names) if n in unchanged and n in base
                }
            bases: list[tuple[Path, bytes] | None] = []
            todo = [i for i in range(len(names)) if i not in known]
            for i in todo:
                b = base.get(names[i])
                nbytes = views[i].nbytes
                bases.append(
                    (blobs / b[0], bytes.fromhex(b[0])) if b is not None and b[1] == nbytes else None
                )
            heads_only = None
            if said and begun.get("base") and said_since == int(begun["base"]["version"]):
                heads_only = [names[i] in said and b is not None for i, b in zip(todo, bases, strict=True)]
            placed_todo = _core.stream_place([views[i] for i in todo], bases, tmp, threads, heads_only)
            if heads_only is not None:
                self._note_misses(
                    [names[i] for i, h, (_, w) in zip(todo, heads_only, placed_todo, strict=True) if h and w]
                )
            placed_at = dict(zip(todo, placed_todo, strict=True))
            placed = [placed_at[i] if i in placed_at else (known[i], False) for i in range(len(names))]
            tensors = [
                StreamTensor(n, s.dtype, tuple(s.shape), h.hex(), int(v.nbytes))
                for n, s, v, (h, _) in zip(names, specs, views, placed, strict=True)
            ]
            entries = [
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "hash": t.hash, "nbytes": t.nbytes}
                for t in tensors
            ]
            body = {"step": step, "metadata": metadata, "tensors": entries}
            (tmp / "manifest.json").write_text(json.dumps(body))
            self.last_commit_sent = time.time()
            reply = self._conn.call({"op": "commit", "publish": begun["publish"]})
            version = int(reply["version"])
            self._last = (version, {t.name: (t.hash, t.nbytes) for t in tensors})
            self._hint_version = version
            if views is self._staging:
                self._staged_version = version
            published = StreamVersion(
                name=self.name,
                version=version,
                step=step,
                nbytes=int(reply["nbytes"]),
                new_bytes=int(reply["new_bytes"]),
                created=time.time(),
                manifest=Path(reply["manifest"]),
                tensors=tuple(tensors),
                metadata=metadata,
            )
            if self._history is not None and version % self._history_every == 0:
                # Mapped now, while the agent surely keeps the version: the mapping outlives its files.
                self._flush_later(published, _mapped_state(published))
            return published

    def _note_misses(self, names: list[str]) -> None:
        """Reports tensors a `changed=` hint said unchanged whose first bytes differed."""
        if not names:
            return
        msg = (
            f"{self.name}: publish(changed=...) left out {len(names)} tensor(s) whose bytes changed "
            f"({', '.join(repr(n) for n in names[:3])}{', ...' if len(names) > 3 else ''}); they were published, "
            "but a change past a tensor's first 64 KiB is not seen: name every tensor that may change"
        )
        self.hint_misses.append(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def _flush_later(self, version: StreamVersion, state: dict[str, Any]) -> None:
        with self._flush_cond:
            if self._flush_due is not None:
                self.flush_skipped += 1
                self.flush_errors.append(f"history fell behind: {self._flush_due[0]} was not saved")
            self._flush_due = (version, state)
            self._flush_cond.notify_all()
            if self._flusher is None:
                self._flusher = threading.Thread(
                    target=self._flush_loop, name=f"tierstore-history-{self.name}"
                )
                self._flusher.daemon = True
                self._flusher.start()

    def _flush_loop(self) -> None:
        while True:
            with self._flush_cond:
                self._flush_cond.wait_for(lambda: self._flush_due is not None)
                assert self._flush_due is not None
                version, state = self._flush_due
                self._flush_due = None
                self._flushing = True
            try:
                meta = {"stream": self.name, "stream_version": version.version, "step": version.step}
                self._history.save(self.name, state, metadata={**version.metadata, **meta})
                with self._flush_cond:
                    self.flushed.append(version.version)
            except Exception as e:
                with self._flush_cond:
                    self.flush_errors.append(f"saving {version} to the history failed: {e!r}")
            finally:
                with self._flush_cond:
                    self._flushing = False
                    self._flush_cond.notify_all()

    def flush_history(self, timeout: float | None = None) -> bool:
        """Waits until every version due has been saved to the history; False on timeout."""
        with self._flush_cond:
            return self._flush_cond.wait_for(lambda: self._flush_due is None and not self._flushing, timeout)

    def flush(self) -> None:
        """Waits for an asynchronous publish in progress."""
        self._wait_pending()

    def close(self) -> None:
        """Waits for an asynchronous publish and the history flush, then disconnects."""
        self._wait_pending()
        self.flush_history()
        if self._pool is not None:
            self._pool.shutdown()
        self._conn.close()


_publishers: dict[tuple[str, str], Publisher] = {}
_publishers_lock = threading.Lock()


def publish(
    name: str,
    model_or_state_dict: Any,
    *,
    step: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    sync: bool = True,
    changed: Any = None,
    socket: str | os.PathLike[str] | None = None,
    history: Any = None,
    history_every: int = 1,
) -> StreamVersion | Future[StreamVersion]:
    """Publishes a model's weights as the next version of stream `name` (see `Publisher.publish`). The
    publisher of a stream is kept for the process: its connection and staging buffer are reused, and the
    `history` (see `Publisher`) given on its first publish."""
    key = (name, str(_socket_path(socket)))
    with _publishers_lock:
        p = _publishers.get(key)
        if p is None:
            if not _publishers:
                _at_shutdown(_close_publishers)
            p = _publishers[key] = Publisher(
                name, socket=socket, history=history, history_every=history_every
            )
    return p.publish(model_or_state_dict, step=step, metadata=metadata, sync=sync, changed=changed)


def _at_shutdown(fn: Callable[[], None]) -> None:
    """Runs `fn` when the interpreter begins to shut down, before thread pools refuse new work (the hook
    concurrent.futures itself uses; its hooks run last-registered first). `atexit` would be too late: a
    history save needs a thread pool."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(fn)
    else:
        register(fn)


def _close_publishers() -> None:
    """At exit: the last `sync=False` publish of each stream finishes and its history is saved (the saving
    thread is a daemon, which the interpreter would otherwise stop mid-save)."""
    with _publishers_lock:
        publishers = list(_publishers.values())
        _publishers.clear()
    for p in publishers:
        with contextlib.suppress(Exception):
            p.close()


def _default_group_device(group: Any) -> Any:
    """Where the group's own small tensors live: the current GPU for NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class DistributedPublisher(Publisher):
    """Publishes versions of one stream through the node's agent and sends their changed tensors to the
    consumers of a torch.distributed process group, GPU to GPU with NCCL (gloo on CPUs).

    The version is placed and announced as `Publisher` does (the agent keeps it for consumers outside the
    group, the history and the CLI; nobody misses it); the `HotModel(..., group=, src=)` of every other
    rank of the group receives the tensors whose hash changed since the version sent before by
    `broadcast`, bucketed, instead of reading the agent's shared memory.

    The constructor is collective: every rank of the group constructs its side (this on rank `src`, a
    `HotModel` with `group=` on the others) before the first version is sent. Every collective waits at most
    the process group's timeout; a publish whose collectives fail (a consumer died, a deadline passed)
    raises `StreamError` once the version is announced, and the versions after it go through the agent only
    (`group_error` says why): a process group that failed a collective cannot be trusted to match the next.

    Args:
        name: the stream.
        group: the process group (None: the default one).
        src: this rank (the global rank, as torch.distributed's `src`); default: this process's rank.
        bucket_bytes: the most bytes one collective moves; tensors smaller than it are packed together.
        device: where the constructor's handshake tensor lives (default: the current GPU with NCCL, else
            the CPU); the tensors are sent from their own device.
        Others as `Publisher`.
    """

    def __init__(
        self,
        name: str,
        *,
        group: Any = None,
        src: int | None = None,
        bucket_bytes: int = 64 << 20,
        device: Any = None,
        socket: str | os.PathLike[str] | None = None,
        deadline: float = DEFAULT_DEADLINE,
        history: Any = None,
        history_every: int = 1,
    ) -> None:
        import torch
        import torch.distributed as dist

        from tierstore import _group

        super().__init__(name, socket=socket, deadline=deadline, history=history, history_every=history_every)
        self.group = group
        self.src = dist.get_rank() if src is None else src
        self.device = torch.device(device) if device is not None else _default_group_device(group)
        self._bucket = _group.Bucket(bucket_bytes)
        self.bucket_bytes = bucket_bytes
        token = int.from_bytes(os.urandom(7), "big") or 1
        self.session = _group.handshake(group, self.src, self.device, token)
        # The version last sent to the group and its tensors' hashes: the next one sends what differs.
        self._sent: tuple[int, dict[str, str]] = (0, {})
        # Why the group was given up (None while it works), and the bytes sent through it.
        self.group_error: str | None = None
        self.bytes_sent = 0
        self.last_sent_bytes = 0

    def publish(
        self,
        model_or_state_dict: Any,
        *,
        step: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        sync: bool = True,
        changed: Any = None,
    ) -> StreamVersion:
        """Publishes the tensors as the stream's next version and sends what changed to the group.

        Synchronous only: the collective reads the model's own tensors (on their device). `changed` as
        `Publisher.publish`.

        Raises:
            ValueError: `sync=False` (use a `Publisher` for that).
            StreamError: the agent refused the version, or the group's collectives failed (the version is
                announced through the agent all the same; the message says so).
            TimeoutError: the agent did not answer within the deadline.
        """
        from tierstore import _group

        if not sync:
            raise ValueError(
                "DistributedPublisher.publish is synchronous (the group's collectives read the model's own "
                "tensors); publish with a Publisher for sync=False"
            )
        state = (
            model_or_state_dict.state_dict()
            if hasattr(model_or_state_dict, "state_dict")
            else model_or_state_dict
        )
        if changed is not None:
            # Resolved against the module ("trainable" reads requires_grad): the rest sees a state_dict.
            said = _said_unchanged(model_or_state_dict, [str(k) for k in state], changed)
            changed = [str(k) for k in state if str(k) not in said]
        # Checked before the version is announced: every tensor can be sent as it is.
        byte_views = (
            {str(k): _group.byte_view(t) for k, t in state.items()} if self.group_error is None else {}
        )
        meta = dict(metadata or {})
        sending = self.group_error is None
        if sending:
            meta[_group.META_KEY] = {"session": self.session, "base": self._sent[0], "src": self.src}
        v = super().publish(state, step=step, metadata=meta, sync=True, changed=changed)
        assert isinstance(v, StreamVersion)
        if not sending:
            return v
        idx = _group.changed(v.tensors, self._sent[1])
        views = [byte_views[v.tensors[i].name] for i in idx]
        t0 = time.monotonic()
        try:
            sent = _group.send(views, self._bucket, self.group, self.src)
        except Exception as e:
            self.group_error = (
                f"{v}: sending the changed tensors ({len(idx)}, {sum(int(x.numel()) for x in views)} "
                f"bytes) to the process group failed after "
                f"{time.monotonic() - t0:.1f} s ({e}); the version is announced through the agent, and "
                "later versions go through the agent only"
            )
            raise StreamError(self.group_error) from e
        self._sent = (v.version, {t.name: t.hash for t in v.tensors})
        self.last_sent_bytes = sent
        self.bytes_sent += sent
        return v


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


class HotModel:
    """A model kept up to date with stream `name`, swapped between requests.

    Two copies of the model (mode "double", the default): requests run on the active one; a new version is
    loaded into the other (only the tensors whose hash differs from what that copy holds), then the two are
    swapped. A request enters with `with hot.serving() as m:` and sees exactly one version; it never waits
    for an update.

    One copy (mode "in-place"), where memory is short: an update holds new requests back (`serving()`
    blocks), waits for those in flight to end, writes the changed tensors into the model, then lets requests
    in again. Every request still sees exactly one version; the pause each update cost is reported
    (`last_pause_s`, `max_pause_s`, `pauses`) and passed to `on_pause` callbacks.

    With `group=` (and `src=` the publisher's rank), the changed tensors come from a `DistributedPublisher`
    through the torch.distributed process group, on the model's device (GPU to GPU with NCCL), instead of
    from the agent's shared memory; the agent still announces every version, and a version published
    outside the group (before it, or after the group failed) is read from shared memory. The subscription
    is then for notices only: on another node than the publisher's, the agent relays each version without
    pulling its tensors (they cross the network once, through the group), and pulls one only when this
    consumer needs it from shared memory. The constructor is collective (see `DistributedPublisher`), and
    every version is loaded, in order: each is a collective.

    Each swap is reported to the agent (`tierstore stream show|watch` list every consumer's lag).

    An update that fails (a version whose tensors do not fit the model, a deadline missed, a collective that
    failed) leaves the served version in place; `last_error` says why. In place, a failure after the model's
    first bytes were written leaves no whole version: requests raise `StreamError` until the next update.

    Args:
        model: an nn.Module (or dict of numpy arrays) whose tensors are contiguous, on the CPU (on any
            device with `group=`).
        name: the stream.
        spare: the second copy in mode "double"; default `copy.deepcopy(model)`.
        deadline: how long an update may wait for the requests still using the copy it writes.
        mode: "double" (two copies, no pause) or "in-place" (one copy, a short pause per update).
        group: a torch.distributed process group the changed tensors arrive through (see above).
        src: the publisher's rank in torch.distributed's numbering (global); default 0.
        bucket_bytes: the most bytes one collective moves; tensors smaller than it are packed together into
            a buffer of at most this size.
        label: what `tierstore stream show|watch` call this consumer (default: "HotModel").
    """

    def __init__(
        self,
        model: Any,
        name: str,
        *,
        socket: str | os.PathLike[str] | None = None,
        spare: Any = None,
        deadline: float = DEFAULT_DEADLINE,
        mode: str = "double",
        group: Any = None,
        src: int | None = None,
        bucket_bytes: int = 64 << 20,
        label: str | None = None,
    ) -> None:
        if mode not in ("double", "in-place"):
            raise ValueError(
                f'HotModel mode {mode!r}: use "double" (two copies, no pause) or "in-place" (one copy, a '
                "short pause per update)"
            )
        if mode == "in-place" and spare is not None:
            raise ValueError('HotModel: mode "in-place" keeps one copy; leave spare= out')
        self.name = name
        self.deadline = deadline
        self.mode = mode
        self._grouped = group is not None or src is not None
        if mode == "double":
            self._buffers = [model, spare if spare is not None else copy.deepcopy(model)]
        else:
            self._buffers = [model]
        copies = len(self._buffers)
        self._views = [self._group_views(m) if self._grouped else self._writable(m) for m in self._buffers]
        self._hashes: list[dict[str, str]] = [{} for _ in range(copies)]
        self._versions: list[int | None] = [None] * copies
        self._inflight = [0] * copies
        self._active = 0
        self._cond = threading.Condition()
        self._closed = False
        # In place: new requests are held back while True; why no version is whole, after a torn update.
        self._paused = False
        self._torn: str | None = None
        self.updates = 0
        self.failures = 0
        self.bytes_copied = 0
        self.bytes_caught_up = 0
        # Of the bytes written: those read from the agent's shared memory, and those from the group.
        self.bytes_shared = 0
        self.bytes_received = 0
        self.swapped_at = 0.0
        # The newest version whose swap's on_swap callbacks have all returned: what wait_version waits for.
        self._swap_done = 0
        self._swap_callbacks: list[Callable[[int, float], None]] = []
        self._pause_callbacks: list[Callable[[int, float], None]] = []
        self.last_error: str | None = None
        self.last_swap_s = 0.0
        # In place: the time new requests were held back by the last update, the longest, and how many.
        self.last_pause_s = 0.0
        self.max_pause_s = 0.0
        self.pauses = 0
        self._thread: threading.Thread | None = None
        # Why the process group was given up (None while it works, and without one).
        self.group_error: str | None = None
        if not self._grouped:
            self._sub = Subscriber(name, socket=socket, deadline=deadline, label=label or "HotModel")
            self._thread = threading.Thread(target=self._run, name=f"tierstore-hot-{name}", daemon=True)
            self._thread.start()
            return
        from tierstore import _group

        self.group = group
        self.src = 0 if src is None else src
        self._device = self._views[0][next(iter(self._views[0]))].device if self._views[0] else None
        self._bucket = _group.Bucket(bucket_bytes)
        # The version last received through the group and its hashes: the next one sends what differs.
        self._group_base: tuple[int, dict[str, str]] = (0, {})
        self._session = 0
        self._joined = threading.Event()
        # Subscribed before the handshake, so that no version sent to the group can be announced unseen.
        self._sub = Subscriber(
            name,
            socket=socket,
            deadline=deadline,
            on_update=self._arrived,
            notices_only=True,
            label=label or "HotModel",
        )
        try:
            self._session = _group.handshake(group, self.src, _default_group_device(group))
        except BaseException:
            self._closed = True
            self._joined.set()
            self._sub.close()
            raise
        self._joined.set()

    @staticmethod
    def _writable(model: Any) -> dict[str, Any]:
        state = model.state_dict() if hasattr(model, "state_dict") else model
        out = {}
        for k, v in state.items():
            w = writable_bytes(v)
            if w is None:
                raise TypeError(
                    f"HotModel: tensor {k!r} is not a contiguous CPU tensor; move the model to the CPU "
                    "(or receive GPU models through a process group: group=)"
                )
            out[str(k)] = w
        return out

    @staticmethod
    def _group_views(model: Any) -> dict[str, Any]:
        from tierstore import _group

        state = model.state_dict() if hasattr(model, "state_dict") else model
        return {str(k): _group.byte_view(v) for k, v in state.items()}

    @property
    def version(self) -> int | None:
        """The version new requests are served (None before the first one is loaded, and during a pause)."""
        with self._cond:
            return self._versions[self._active]

    @property
    def copies(self) -> int:
        """The copies of the model this HotModel holds: 2, or 1 in place."""
        return len(self._buffers)

    @property
    def subscriber(self) -> Subscriber:
        return self._sub

    @contextlib.contextmanager
    def serving(self) -> Iterator[Any]:
        """Pins the active copy for one request: it is not written until the request ends. In place, waits
        while an update writes the model.

        Raises:
            StreamError: in place, an update failed after writing part of the model (until the next one).
        """
        with self._cond:
            if self._paused:
                self._cond.wait_for(lambda: not self._paused or self._closed)
            if self._torn is not None:
                raise StreamError(self._torn)
            i = self._active
            self._inflight[i] += 1
        try:
            yield self._buffers[i]
        finally:
            with self._cond:
                self._inflight[i] -= 1
                if self._inflight[i] == 0:
                    self._cond.notify_all()

    def wait_version(self, version: int, timeout: float) -> None:
        """Waits until version `version` (or a newer one) is served and the `on_swap` callbacks of its swap
        have returned.

        Raises:
            TimeoutError: it was not within `timeout` seconds; the message carries the last error.
        """
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._swap_done >= version and (self._versions[self._active] or 0) >= version,
                timeout,
            )
            if not ok:
                raise TimeoutError(
                    f"{self.name}: version {version} not served within {timeout} s (serving "
                    f"{self._versions[self._active]}, on_swap callbacks done through {self._swap_done}; "
                    f"last error: {self.last_error})"
                )

    def _swapped(self, version: int, callbacks: list[Callable[[int, float], None]]) -> None:
        """After a swap to `version`: tells the agent, runs the on_swap callbacks (outside the lock requests
        take), then lets wait_version return."""
        self._sub.report_serving(version)
        for cb in callbacks:
            with contextlib.suppress(Exception):
                cb(version, self.swapped_at)
        with self._cond:
            self._swap_done = max(self._swap_done, version)
            self._cond.notify_all()

    def _run(self) -> None:
        done = 0
        while not self._closed:
            v = self._sub._newest_pinned(done, 0.5)
            if v is None:
                continue
            done = v.version
            try:
                self._update(v)
            finally:
                self._sub.unpin(v.version)

    def _arrived(self, v: StreamVersion) -> None:
        """With a group: every version, in order, on the subscriber's thread (which holds it meanwhile)."""
        self._joined.wait()
        if not self._closed:
            self._update(v)

    def _update(self, v: StreamVersion) -> None:
        try:
            self._load(v)
        except Exception as e:
            with self._cond:
                self.failures += 1
                if self._torn is None:
                    self.last_error = f"{v}: {e}; still serving version {self._versions[self._active]}"
                else:
                    self.last_error = (
                        f"{v}: {e}; the model was written in part: requests raise until an update"
                    )

    def _check(self, v: StreamVersion) -> None:
        """Raises unless `v`'s tensors are the model's, byte for byte in size."""
        views = self._views[0]
        names = {t.name for t in v.tensors}
        missing = [k for k in views if k not in names]
        if missing:
            raise StreamError(
                f"the version has no tensor {missing[0]!r} of the model; publish the whole model"
            )
        for t in v.tensors:
            dest = views.get(t.name)
            if dest is None:
                raise StreamError(f"tensor {t.name!r} is not in the model; is it the same architecture?")
            if dest.nbytes != t.nbytes:
                raise StreamError(f"tensor {t.name!r} has {t.nbytes} bytes, the model's {dest.nbytes}")

    def _via_group(self, v: StreamVersion) -> list[int] | None:
        """The tensors of `v` (indices) coming through the group, in the order sent; None: not sent to it.

        Raises:
            StreamError: it was sent against a version this consumer did not receive: the group is given up.
        """
        from tierstore import _group

        info = v.metadata.get(_group.META_KEY) if self._grouped else None
        if not isinstance(info, dict) or info.get("session") != self._session or self.group_error is not None:
            return None
        base = int(info.get("base", 0))
        if base not in (0, self._group_base[0]):
            self.group_error = (
                f"{v} was sent to the group against version {base}, this consumer received "
                f"{self._group_base[0]}; later versions are read from the agent's shared memory"
            )
            raise StreamError(self.group_error)
        return _group.changed(v.tensors, self._group_base[1] if base else {})

    def _receive(self, i: int | None, v: StreamVersion, idx: list[int]) -> None:
        """Takes part in `v`'s collectives, writing into copy `i` (None: discarding what arrives)."""
        from tierstore import _group

        tensors = [v.tensors[k] for k in idx]
        dests = None
        if i is not None:
            for t in tensors:
                self._hashes[i].pop(t.name, None)
            dests = [self._views[i][t.name] for t in tensors]
        t0 = time.monotonic()
        try:
            got = _group.receive(
                [t.nbytes for t in tensors], dests, self._device, self._bucket, self.group, self.src
            )
        except Exception as e:
            self.group_error = (
                f"receiving the changed tensors ({len(tensors)}, {sum(t.nbytes for t in tensors)} bytes) "
                f"from rank {self.src} failed after "
                f"{time.monotonic() - t0:.1f} s ({e}); later versions are read from the agent's shared memory"
            )
            raise StreamError(self.group_error) from e
        self._group_base = (v.version, {t.name: t.hash for t in v.tensors})
        self.bytes_received += got
        if i is not None:
            self._hashes[i].update({t.name: t.hash for t in tensors})

    def _fill(self, i: int, v: StreamVersion) -> int:
        """Writes into copy `i` (which no request uses) the tensors of `v` it does not hold, from the other
        copy where that holds them, else from the agent's shared memory; the bytes written."""
        views, hashes = self._views[i], self._hashes[i]
        todo = [t for t in v.tensors if hashes.get(t.name) != t.hash]
        for t in todo:
            hashes.pop(t.name, None)  # what the copy holds is unknown until the write completes
        hashes_read, dests = [], []
        for t in todo:
            j = next(
                (j for j in range(len(self._views)) if j != i and self._hashes[j].get(t.name) == t.hash), None
            )
            if j is not None:
                _copy_bytes(views[t.name], self._views[j][t.name])
            else:
                hashes_read.append(t.hash)
                dests.append(views[t.name])
        if hashes_read and not v.held:
            # Relayed without its tensors (notices only): the agent pulls the version, held while read.
            with self._sub.fetch(v.version, timeout=self.deadline) as held:
                self._read(held, hashes_read, dests)
        elif hashes_read:
            self._read(v, hashes_read, dests)
        self.bytes_shared += sum(int(d.nbytes) for d in dests)
        hashes.update({t.name: t.hash for t in todo})
        return sum(t.nbytes for t in todo)

    def _read(self, v: StreamVersion, hashes: list[str], dests: list[Any]) -> None:
        """Reads tensors of `v` (by hash) from the agent's shared memory into `dests`."""
        blobs = v.manifest.parent.parent.parent / "blobs"
        paths = [blobs / h for h in hashes]
        if self._grouped:
            for p, d in zip(paths, dests, strict=True):
                if d.numel():
                    d.copy_(_torch_from_file(p))
        else:
            _core.stream_read(paths, dests)

    def _load(self, v: StreamVersion) -> None:
        try:
            self._check(v)
        except StreamError:
            idx = self._via_group(v)
            if idx is not None:
                self._receive(None, v, idx)  # the group's collectives stay matched
            raise
        if self.mode == "in-place":
            self._load_in_place(v)
        else:
            self._load_double(v)

    def _load_double(self, v: StreamVersion) -> None:
        idx = self._via_group(v)
        with self._cond:
            idle = 1 - self._active
            drained = self._cond.wait_for(lambda: self._inflight[idle] == 0, self.deadline)
            if drained:
                self._versions[idle] = None
        if not drained:
            if idx is not None:
                self._receive(None, v, idx)
            raise TimeoutError(
                f"requests held the idle copy for more than {self.deadline} s; it was not updated"
            )
        if idx is not None:
            self._receive(idle, v, idx)
            received = sum(v.tensors[k].nbytes for k in idx)
        else:
            received = 0
        copied = received + self._fill(idle, v)
        with self._cond:
            self._versions[idle] = v.version
            t0 = time.perf_counter()
            self._active = idle
            self.last_swap_s = time.perf_counter() - t0
            self.swapped_at = time.time()
            self.updates += 1
            self.bytes_copied += copied
            self.last_error = None
            callbacks = list(self._swap_callbacks)
            self._cond.notify_all()
        self._swapped(v.version, callbacks)
        if self._grouped:
            return  # the retired copy catches up at the next update, once that one's collectives are done
        # Off the critical path: bring the copy just retired to this version too, once its requests end,
        # so that the next update copies only its own changes (unless a newer version already waits).
        old = 1 - idle
        with self._cond:
            drained = self._cond.wait_for(lambda: self._inflight[old] == 0, self.deadline)
        newer = self._sub._latest
        if drained and not self._closed and (newer is None or newer.version == v.version):
            with self._cond:
                self._versions[old] = None
            self.bytes_caught_up += self._fill(old, v)
            with self._cond:
                self._versions[old] = v.version

    def _load_in_place(self, v: StreamVersion) -> None:
        idx = self._via_group(v)
        with self._cond:
            self._paused = True
            t0 = time.perf_counter()
            drained = self._cond.wait_for(lambda: self._inflight[0] == 0, self.deadline)
            if drained:
                self._versions[0] = None
            else:
                self._paused = False
                self._cond.notify_all()
        if not drained:
            if idx is not None:
                self._receive(None, v, idx)
            raise TimeoutError(f"requests held the model for more than {self.deadline} s; it was not updated")
        whole = False
        try:
            received = 0
            if idx is not None:
                self._receive(0, v, idx)
                received = sum(v.tensors[k].nbytes for k in idx)
            copied = received + self._fill(0, v)
            whole = True
        finally:
            with self._cond:
                pause = time.perf_counter() - t0
                self._paused = False
                self.last_pause_s = pause
                self.max_pause_s = max(self.max_pause_s, pause)
                self.pauses += 1
                if whole:
                    self._versions[0] = v.version
                    self._torn = None
                    self.swapped_at = time.time()
                    self.updates += 1
                    self.bytes_copied += copied
                    self.last_error = None
                else:
                    self._torn = f"{v}: an in-place update failed midway; no whole version until the next one"
                callbacks = list(self._swap_callbacks) if whole else []
                paused = list(self._pause_callbacks)
                self._cond.notify_all()
        for cb in paused:
            with contextlib.suppress(Exception):
                cb(v.version, pause)
        if whole:
            self._swapped(v.version, callbacks)

    @property
    def idle_version(self) -> int | None:
        """The version the copy no request is served from holds (None while it is being written, and in
        place, where there is no such copy)."""
        with self._cond:
            return self._versions[1 - self._active] if len(self._versions) == 2 else None

    def on_swap(self, callback: Callable[[int, float], None]) -> None:
        """Calls `callback(version, time.time())` right after each swap, on the loader's thread."""
        with self._cond:
            self._swap_callbacks.append(callback)

    def on_pause(self, callback: Callable[[int, float], None]) -> None:
        """In place: calls `callback(version, seconds)` after each update with the time new requests were
        held back (also after an update that failed), on the loader's thread."""
        with self._cond:
            self._pause_callbacks.append(callback)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._sub.close()
        if self._thread is not None:
            self._thread.join(timeout=self.deadline)

    def __enter__(self) -> HotModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _copy_bytes(dest: Any, src: Any) -> None:
    """Copies one tensor's bytes between two copies of the model (numpy arrays or torch tensors)."""
    if isinstance(dest, np.ndarray):
        np.copyto(dest, src)
    else:
        dest.copy_(src)


def _torch_from_file(path: Path) -> Any:
    """The bytes of a tensor file of the agent's, as a CPU uint8 torch tensor over a private mapping."""
    import torch

    return torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c"))


def streams(
    socket: str | os.PathLike[str] | None = None, deadline: float = DEFAULT_DEADLINE
) -> dict[str, Any]:
    """The agent's streams: their versions (sizes, leases), subscribers, and the shared memory held."""
    conn = _Connection(_socket_path(socket), deadline)
    try:
        return conn.call({"op": "list"})
    finally:
        conn.close()


__all__ = [
    "DistributedPublisher",
    "HotModel",
    "Publisher",
    "StreamError",
    "StreamTensor",
    "StreamVersion",
    "Subscriber",
    "publish",
    "streams",
]
