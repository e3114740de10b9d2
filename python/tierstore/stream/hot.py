"""HotModel: a model an inference server serves while new versions are swapped in between its requests."""

from __future__ import annotations

import contextlib
import copy
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tierstore import _core
from tierstore.models.tensors import writable_bytes
from tierstore.stream.connection import DEFAULT_DEADLINE, StreamError, closed_at_exit
from tierstore.stream.subscriber import Subscriber
from tierstore.stream.version import StreamVersion


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
            _open.add(self)
            return
        from tierstore.stream import group as _group

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
            self._session = _group.handshake(group, self.src, _group.default_device(group))
        except BaseException:
            self._closed = True
            self._joined.set()
            self._sub.close()
            raise
        self._joined.set()
        _open.add(self)

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
        from tierstore.stream import group as _group

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
                if self._sub._closed:
                    return  # no version can come any more
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
        from tierstore.stream import group as _group

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
        from tierstore.stream import group as _group

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


# Models still open when the interpreter exits are closed first (this set is made after the subscribers'),
# each loader thread joined within its deadline.
_open: weakref.WeakSet[HotModel] = closed_at_exit()


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
