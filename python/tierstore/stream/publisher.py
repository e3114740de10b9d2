"""The trainer's side of a model stream: publishing versions (only the tensors that changed are placed) and,
in a torch.distributed process group, moving them inside the group."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from tierstore import _core
from tierstore.models.tensors import TensorSpec, spec_and_bytes
from tierstore.stream.connection import DEFAULT_DEADLINE, StreamError, _connect, _socket_path
from tierstore.stream.version import StreamTensor, StreamVersion, _mapped_state
from tierstore.types import StreamManifest


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
                    m: StreamManifest = json.loads(_core.stream_manifest_read(begun["base"]["manifest"]))
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
            placed_todo = _core.stream_place(
                [views[i] for i in todo], bases, tmp, threads, heads_only, begun.get("spares")
            )
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
            _core.stream_manifest_write(
                tmp / "manifest.json",
                [(t.name, t.dtype, list(t.shape), t.hash, t.nbytes) for t in tensors],
                step,
                json.dumps(metadata),
            )
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
        socket: as for `Publisher`: the agent's socket.
        deadline: as for `Publisher`: how long a request to the agent may take.
        history: as for `Publisher`: a model repository every `history_every`-th version is saved to.
        history_every: as for `Publisher`.
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

        from tierstore.stream import group as _group

        super().__init__(name, socket=socket, deadline=deadline, history=history, history_every=history_every)
        self.group = group
        self.src = dist.get_rank() if src is None else src
        self.device = torch.device(device) if device is not None else _group.default_device(group)
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
        from tierstore.stream import group as _group

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
