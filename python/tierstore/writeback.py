"""Write-back staging: files written under a `[[writeback]]` destination land on the node's stage at
local-disk speed and reach the shared store in the background, in the order they were closed, never
half-written (see docs/design/architecture.md, "Write-back staging").

    import tierstore
    with tierstore.open("/lustre/ckpt/step_1000/model.pt", "wb") as f:   # staged, journaled at close
        torch.save(state, f)
    tierstore.sync("/lustre/ckpt/step_1000")                             # on the store, checked

With `durability = "buffered"` (the default), `close()` returns once the bytes are in the node's page cache
and their journal entry is appended to the stage's log of closes, as a local disk's close (the agent hashes
the file and commits the entry to the fsynced journal within 1 s); with `"local"`, once the bytes and the
entry are fsynced on the node; with `"remote"`, once the file is fsynced and checked on the shared store. The node's agent
migrates (it is started on demand); `sync()` waits for it and raises if the files cannot reach the store.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import sys
import threading
import time
from typing import IO, Any

from tierstore import _core
from tierstore.types import WritebackPending

PathLike = str | os.PathLike[str]

_lock = threading.Lock()
# Directories of the store seen to exist (a checkpoint directory is checked once, not once per file).
_dirs_seen: set[str] = set()
# "any": whether the configuration read names any destination at all.
_state: dict[str, Any] = {"wb": None, "agent": False, "any": False}


def _forget_in_child() -> None:
    """After a fork: the child reads the configuration again and makes its own write-back (the parent's
    engine state is not its to use), under a lock of its own (another thread may have held the parent's
    at the fork). So `destination` need not compare process ids on every call."""
    global _lock
    _lock = threading.Lock()
    _state.update(wb=None, agent=False, any=False)


os.register_at_fork(after_in_child=_forget_in_child)


def _writeback() -> _core.Writeback:
    """This process's write-back (configuration read once per process)."""
    with _lock:
        wb: _core.Writeback | None = _state["wb"]
        if wb is None:  # a forked child starts with none (`_forget_in_child`)
            wb = _state["wb"] = _core.Writeback()
            _state["agent"] = False
            _state["any"] = bool(wb.destinations())
        return wb


def reload() -> None:
    """Reads the configuration again on next use (after changing `TIERSTORE_WRITEBACK` or the file)."""
    with _lock:
        _state["wb"] = None


def _ensure_agent() -> None:
    """Starts this node's agent once per process if none answers: it migrates the staged files."""
    if _state["agent"]:
        return
    from tierstore import agent

    socket = agent.default_socket()
    if not agent.answers(socket):
        try:
            agent.start(socket, env=dict(os.environ), idle_exit=agent.ON_DEMAND_IDLE_EXIT)
        except agent.AgentError:
            if not agent.answers(socket):  # another process may have started it meanwhile
                raise
    _state["agent"] = True


def configured() -> bool:
    """Whether any write-back destination is configured."""
    _writeback()
    return bool(_state["any"])


def destination(path: PathLike) -> str | None:
    """The write-back destination holding `path`, or None if writes to it go straight to the store."""
    # Read once in this process (a fork forgets it): no lock to take, no process id to ask.
    wb: _core.Writeback | None = _state["wb"]
    if wb is None:
        wb = _writeback()
    if not _state["any"]:
        return None  # asked for every file an fsspec `tierstore://` opens: no call into the core for nothing
    return wb.destination(os.fspath(path))


class _StagedRaw(io.FileIO):
    """The staged file of one write: closing it journals it (and, with remote durability, waits). A file
    one of whose writes failed (the stage's disk is full) is never journaled: its close removes it, so
    that no part of it reaches the store and its space is free for the next file at once."""

    def __init__(self, staged: str, mode: str, dest: str, name: str) -> None:
        super().__init__(staged, mode)
        self._staged = staged
        self._dest = dest
        self._journal_name = name
        self._committed = False
        self._failed: OSError | None = None

    def write(self, b: Any, /) -> int:
        try:
            return super().write(b)
        except OSError as e:
            self._failed = e
            raise

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        if self._committed:
            return
        self._committed = True
        if self._failed is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._staged)
            raise OSError(
                self._failed.errno,
                f"{self._dest} was not written ({self._failed.strerror} in the stage); nothing of it "
                "reaches the store: free space in the stage or raise its quota, then write it again",
                self._dest,
            )
        _writeback().commit(self._dest, self._journal_name)

    @property
    def destination(self) -> str:
        """The path this file goes to on the shared store."""
        return self._dest


class _ThroughRaw(io.FileIO):
    """A file written straight to the store (the stage was full) under a hidden name beside its
    destination: closing it fsyncs it and renames it into place, so no reader sees part of it."""

    def __init__(self, temp: str, mode: str, dest: str) -> None:
        super().__init__(temp, mode)
        self._temp = temp
        self._dest = dest
        self._placed = False

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        if not self._placed:
            self._placed = True
            _writeback().finish_through(self._temp, self._dest)

    @property
    def destination(self) -> str:
        """The path this file goes to on the shared store."""
        return self._dest


def open(path: PathLike, mode: str = "wb", *, encoding: str | None = None) -> IO[Any]:
    """Opens `path` (under a write-back destination) for writing through the stage.

    Args:
        path: A file under a `[[writeback]]` destination.
        mode: "wb", "xb", "ab" or "r+b" (binary), or "w", "x", "a" (text); "+" reads back what was written.
        encoding: The text encoding for text modes.

    Returns:
        A file object; its `close()` journals the file (durability "buffered" or "local") or waits until it is on the store
        (durability "remote"). A full stage gives a file of the store itself (written through), under a
        hidden name until its `close()` renames it into place.

    Raises:
        ValueError: `path` is not under a destination, or `mode` does not write.
        FileExistsError: mode "x" and the file exists (staged or on the store).
        TimeoutError: durability "remote" and the store did not take the file within the destination's
            timeout (the file stays staged and migrates later).
    """
    wb = _writeback()
    dest = os.path.abspath(os.fspath(path))
    if wb.destination(dest) is None:
        raise ValueError(
            f"tierstore.open({dest!r}, {mode!r}): not under a [[writeback]] destination "
            f"({', '.join(d['path'] for d in wb.destinations()) or 'none configured'}); configure one, "
            "or write with the built-in open()"
        )
    kind = mode.replace("b", "").replace("t", "").replace("+", "")
    if kind not in ("w", "x", "a", "r") or (kind == "r" and "+" not in mode):
        raise ValueError(f"tierstore.open({dest!r}, {mode!r}): a write mode is needed (w, x, a, r+)")
    binary = "b" in mode
    staged_now = wb.lookup(dest)
    # "w" needs no look at the store (each costs a round trip to its metadata server); the others do.
    exists = staged_now is not None or (kind != "w" and os.path.exists(dest))
    if kind == "x" and exists:
        raise FileExistsError(17, "File exists", dest)
    if kind == "r" and not exists:
        raise FileNotFoundError(2, "No such file or directory", dest)
    parent = os.path.dirname(dest)
    if parent not in _dirs_seen:
        if not os.path.isdir(parent):
            raise FileNotFoundError(2, "No such file or directory (create the directory first)", parent)
        _dirs_seen.add(parent)
    _ensure_agent()
    name, staged = wb.begin(dest)
    if kind in ("a", "r"):
        # The file's current bytes come first: the staged copy if there is one, else the store's.
        src = staged_now if staged_now is not None else dest
        if os.path.exists(src):
            shutil.copyfile(src, staged)
    raw_mode = {"w": "w", "x": "w", "a": "a", "r": "r+"}[kind] + ("+" if "+" in mode and kind != "r" else "")
    # No journal name: the stage is full, and `staged` is a hidden file beside `dest` on the store.
    raw: io.FileIO = (
        _StagedRaw(staged, raw_mode, dest, name) if name is not None else _ThroughRaw(staged, raw_mode, dest)
    )
    buffered: io.BufferedRandom | io.BufferedWriter
    buffered = io.BufferedRandom(raw) if "+" in mode else io.BufferedWriter(raw)
    if binary:
        return buffered
    return io.TextIOWrapper(buffered, encoding=encoding)


def open_read(path: PathLike, mode: str = "rb", *, encoding: str | None = None) -> IO[Any]:
    """Opens `path` for reading: its staged copy while it is not on the store yet (this node's, else the
    one another node of the job's `[cluster]` staged, received whole from that node's agent), else the
    store's.

    Raises:
        TierstoreError: Another node holds the file staged but it could not be read from there (the store's
            copy, if any, is older, so it is not read instead).
    """
    import builtins

    dest = os.path.abspath(os.fspath(path))
    wb = _writeback()
    staged = wb.lookup(dest)
    if staged is not None:
        try:
            return builtins.open(staged, mode, encoding=encoding)
        except FileNotFoundError:
            pass  # migrated meanwhile: the store has it
    received = wb.fetch_staged(dest)
    if received is not None:
        try:
            return builtins.open(received, mode, encoding=encoding)
        finally:
            os.unlink(received)  # the open file keeps its bytes
    return builtins.open(dest, mode, encoding=encoding)


def sync(path: PathLike | None = None, timeout: float | None = None) -> None:
    """Waits until every file closed so far under `path` (every destination when None) is fsynced and
    checked on the shared store.

    Args:
        path: A file or directory under a destination, or None for all of them.
        timeout: Seconds to wait at most (default: the destinations' `timeout`).

    Raises:
        TimeoutError: Files are still pending after `timeout`; the message says how many and the last
            store errors.
        TierstoreError: Files are pending and no agent runs to migrate them; or `path` is under no
            destination of this configuration (nothing can be said of it: run with the job's
            configuration).
    """
    wb = _writeback()
    if any(p["files"] for p in wb.pending(None if path is None else os.fspath(path))):
        _ensure_agent()
    wb.sync(None if path is None else os.fspath(path), timeout)


def pending(path: PathLike | None = None) -> list[WritebackPending]:
    """What waits for migration, per destination: path, stage, files, bytes, oldest_ns (when the oldest
    pending file was closed, ns since the epoch), errors [(file, attempts, last error)]."""
    return _writeback().pending(None if path is None else os.fspath(path))


def rename(src: PathLike, dst: PathLike) -> None:
    """`os.replace` for files written through `open`: a file not yet on the store moves in the journal
    (and reaches the store under its new name, after everything closed before the rename); any other file
    is renamed on the store once what was closed before in its directory is there, so a checkpoint's
    commit-by-rename never shows before the files it publishes."""
    wb = _writeback()
    s, d = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
    if wb.destination(s) is not None and wb.destination(d) is not None and wb.rename(s, d):
        return
    if wb.destination(d) is not None:
        wb.wait(s if os.path.isdir(s) else os.path.dirname(d), None)
    os.replace(s, d)
    _forget_dirs(s)


def staged_in(directory: PathLike) -> list[tuple[str, str]]:
    """The files written directly in `directory` (a destination or a directory under one) and not yet on
    the store: what a listing of `directory` adds to the store's.

    Returns:
        (name, staged copy) pairs. A copy may be gone by the time it is read: the file reached the store
        meanwhile, and the store's listing, read after this one, shows it.
    """
    return _writeback().pending_in(os.path.abspath(os.fspath(directory)))


def rmdir(path: PathLike) -> None:
    """`os.rmdir` for a directory under a destination: refused while files written in it are not on the
    store yet (they would bring it back).

    Raises:
        OSError: ENOTEMPTY, files are staged in it (or on the store).
    """
    p = os.path.abspath(os.fspath(path))
    staged = staged_in(p)
    if staged:
        raise OSError(
            errno.ENOTEMPTY,
            f"Directory not empty: {len(staged)} file(s) written in it are staged ({staged[0][0]}, ...); "
            "remove them first, or remove the directory recursively",
            p,
        )
    os.rmdir(p)
    _forget_dirs(p)


def rmtree(path: PathLike) -> None:
    """`shutil.rmtree` for a directory under a destination: the files pending in it leave the journal and
    the stage, then the store's tree goes. Nothing removed comes back: a pending file migrated after the
    store's tree was gone would bring its directory back with it."""
    top = os.path.abspath(os.fspath(path))
    wb = _writeback()
    for d, _, _ in os.walk(top, onerror=_raise):
        for name, _ in staged_in(d):
            wb.remove(os.path.join(d, name))
    # Files pending in a directory the store does not have (removed behind tierstore's back), or closed
    # while the tree was walked: on the store, they go with the rest.
    if any(p["files"] for p in wb.pending(top)):
        sync(top)
    _rmtree_past_migrations(top)
    _forget_dirs(top)


def _raise(e: OSError) -> None:
    raise e


def migrating(name: str) -> bool:
    """Whether the file `name` of the store is a file on its way there under a hidden name: the copy of a
    file being migrated (`.NAME.tierstore-part`, renamed to NAME once checked; listed under its own name
    meanwhile, from the journal), or one written through a full stage (`.NAME.tierstore-through-PID-N`,
    renamed to NAME at its close)."""
    return name.startswith(".") and (name.endswith(".tierstore-part") or ".tierstore-through-" in name)


# The names FUSE and NFS give a file removed while a process still has it open, until it is closed: a
# temporary copy the walk removed while the agent was still writing it.
_KEPT_WHILE_OPEN = (".fuse_hidden", ".nfs")

# How long `rmtree` waits for the agent to drop the temporary copy of a file whose migration was under
# way when the file was removed: the agent sees the file gone within a tenth of a second of copying, or
# after reading the copy back (seconds for a large checkpoint), and deletes the copy.
_MIGRATION_WAIT_S = 120.0


def _temporary(name: str) -> bool:
    """Whether `name` is a copy of the agent's that it deletes by itself: one being migrated, or one the
    file system keeps while the agent still has it open."""
    return migrating(name) or name.startswith(_KEPT_WHILE_OPEN)


def _rmtree_past_migrations(top: str) -> None:
    """`shutil.rmtree(top)` while the agent may still be migrating files just removed from the journal:
    a temporary copy that vanishes under the walk was deleted by the agent; a directory left holding
    only temporary copies is removed again once the agent has deleted them.

    Raises:
        OSError: the tree could not be removed, or a temporary copy was still there after
            `_MIGRATION_WAIT_S` (the agent is stuck: `tierstore status` shows its errors).
    """

    def vanished_is_gone(exc: BaseException) -> None:
        if not isinstance(exc, FileNotFoundError):
            raise exc

    deadline = time.monotonic() + _MIGRATION_WAIT_S
    while True:
        try:
            if sys.version_info >= (3, 12):
                shutil.rmtree(top, onexc=lambda _f, _p, exc: vanished_is_gone(exc))
            else:
                shutil.rmtree(top, onerror=lambda _f, _p, info: vanished_is_gone(info[1]))
            return
        except OSError as e:
            if e.errno != errno.ENOTEMPTY:
                raise
            left = [os.path.join(d, n) for d, _, names in os.walk(top) for n in names]
            written = [p for p in left if not _temporary(os.path.basename(p))]
            if written:
                # Named, so that a file written meanwhile (by this program or another) says which it was.
                raise OSError(
                    errno.ENOTEMPTY, f"cannot remove {top}: {written[:5]} written there meanwhile", top
                ) from e
            if time.monotonic() > deadline:
                raise OSError(
                    errno.ENOTEMPTY,
                    f"cannot remove {top}: tierstore's temporary copies {left[:3]} are still there "
                    f"{_MIGRATION_WAIT_S:.0f} s after their files were removed; the agent is stuck "
                    "(`tierstore status` shows its errors)",
                    top,
                ) from e
            time.sleep(0.02)


def _forget_dirs(path: str) -> None:
    """Forgets that `path` and the directories under it exist on the store: a write there checks again."""
    for d in list(_dirs_seen):  # a copy: writers of other threads add to it meanwhile
        if d == path or d.startswith(path + os.sep):
            _dirs_seen.discard(d)


def remove(path: PathLike) -> None:
    """`os.remove` for files written through `open`: a pending file leaves the stage and the journal, and
    the store's copy (if any) goes too."""
    p = os.path.abspath(os.fspath(path))
    pending_removed = _writeback().remove(p) if _writeback().destination(p) is not None else False
    try:
        os.remove(p)
    except FileNotFoundError:
        if not pending_removed:
            raise
