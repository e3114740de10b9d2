"""Checking a repository's stored tensors, and quarantining the damaged ones.

A stored tensor (a blob) is its bytes at an offset of a pack, found by its blake3 hash: a save that holds a
tensor the repository already stores refers to the stored copy instead of writing it again. A damaged
copy must therefore leave that index, or every later save of the same tensor would refer to it and be
as broken. `verify(..., repair=True)` records each damaged blob under `quarantine/` (one file per blob,
named by hash, offset and pack); the repository's index of stored tensors skips what is recorded there,
so the next save of those tensors writes them anew. Packs are never changed: the versions that refer to a
damaged blob stay broken and are reported, never silently "fixed".
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tierstore import _core
from tierstore.models.files import flock, fsync_dir, read_manifest
from tierstore.types import RepositoryManifest, StoredTensor

QUARANTINE = "quarantine"

# Bytes checked per call into the engine: the progress bar moves between calls.
_STEP = 256 << 20

REASONS = {
    "corrupt": "its bytes do not match the recorded hash",
    "truncated": "the pack is truncated",
    "unreadable": "its bytes cannot be read",
    "missing": "the pack is missing",
}

# (pack, offset, hash): one stored copy of a tensor.
BlobKey = tuple[str, int, str]


@dataclass(frozen=True)
class DamagedTensor:
    """A tensor of a version whose stored bytes are damaged."""

    model: str
    version: int
    tensor: str  # its key in the state dict
    pack: str
    offset: int
    nbytes: int
    hash: str
    reason: str  # "corrupt", "truncated", "unreadable" or "missing"

    def __str__(self) -> str:
        return (
            f"{self.model}@{self.version} tensor {self.tensor!r}: {REASONS[self.reason]} "
            f"(pack {self.pack}, offset {self.offset})"
        )


@dataclass
class VerifyReport:
    """What `Repository.verify` checked and found."""

    versions: int  # versions checked
    tensors: int  # their tensors
    blobs: int  # distinct stored copies checked (versions share unchanged tensors)
    nbytes: int  # bytes of those copies read and hashed
    # Every tensor whose stored copy is damaged, in the versions checked and in any other version that
    # refers to the same copy (it holds the same bytes).
    damaged: list[DamagedTensor] = field(default_factory=list)
    quarantined: int = 0  # damaged copies set aside by this call (repair=True)
    released: int = 0  # copies quarantined earlier and found intact now (a pack restored from a backup)

    @property
    def ok(self) -> bool:
        """True when no checked tensor is damaged."""
        return not self.damaged

    @property
    def broken_versions(self) -> list[str]:
        """The versions ("name@N") that refer to a damaged copy: loading them raises IntegrityError."""
        seen = {(d.model, d.version) for d in self.damaged}
        return [f"{n}@{v}" for n, v in sorted(seen)]


def entry_name(key: BlobKey) -> str:
    pack, offset, h = key
    return f"{h}.{offset}.{pack}"


def _parse_entry(name: str) -> BlobKey | None:
    h, _, rest = name.partition(".")
    offset, _, pack = rest.partition(".")
    if len(h) != 64 or not offset.isdigit() or not pack.endswith(".pack"):
        return None  # not an entry (a temporary file of an interrupted repair)
    return pack, int(offset), h


def quarantined(root: Path) -> frozenset[BlobKey]:
    """The stored copies recorded as damaged in the repository at `root`."""
    try:
        names = os.listdir(root / QUARANTINE)
    except FileNotFoundError:
        return frozenset()
    return frozenset(k for k in map(_parse_entry, names) if k is not None)


def is_quarantined(root: Path, t: StoredTensor) -> bool:
    """True when the stored copy a manifest entry refers to is quarantined."""
    return (root / QUARANTINE / entry_name((t["pack"], t["offset"], t["hash"]))).exists()


def verify(root: Path, chosen: list[Path], *, repair: bool, progress: bool | None) -> VerifyReport:
    """Checks the stored copies of the versions whose manifests are `chosen`, in the repository at `root`
    (see `Repository.verify`, which resolves the versions asked for)."""
    # Shared, as a save: gc (exclusive) cannot remove a pack while it is being checked.
    with flock(root / "repo.lock", exclusive=False):
        manifests = [m for m in map(_read_manifest, chosen) if m is not None]
        blobs: dict[BlobKey, int] = {}  # each stored copy once, with its length
        for m in manifests:
            for t in m["tensors"]:
                blobs[(t["pack"], t["offset"], t["hash"])] = t["nbytes"]
        total = sum(blobs.values())
        with _progress(total, sys.stderr.isatty() if progress is None else progress) as advance:
            bad = _check(root / "packs", blobs, advance)
    report = VerifyReport(
        versions=len(manifests),
        tensors=sum(len(m["tensors"]) for m in manifests),
        blobs=len(blobs),
        nbytes=total,
    )
    if repair:
        report.quarantined, report.released = _quarantine(root, bad, set(blobs) - set(bad))
    if bad:
        # Every version that refers to a damaged copy, asked or not: they all hold the same bytes.
        for p in sorted((root / "models").glob("*/v*.json")):
            other = _read_manifest(p)
            if other is None:
                continue
            for t in other["tensors"]:
                pack, offset, h = key = (t["pack"], t["offset"], t["hash"])
                if key in bad:
                    found = DamagedTensor(
                        other["name"], other["version"], t["name"], pack, offset, t["nbytes"], h, bad[key]
                    )
                    report.damaged.append(found)
        report.damaged.sort(key=lambda d: (d.model, d.version, d.tensor))
    return report


def _read_manifest(path: Path) -> RepositoryManifest | None:
    try:
        return read_manifest(path)
    except FileNotFoundError:
        return None  # deleted meanwhile


def _check(packs: Path, blobs: dict[BlobKey, int], advance: Callable[[int], None]) -> dict[BlobKey, str]:
    """The damaged copies among `blobs`, with why; pack by pack, in order of offset."""
    by_pack: dict[str, list[BlobKey]] = defaultdict(list)
    for key in sorted(blobs):
        by_pack[key[0]].append(key)
    bad: dict[BlobKey, str] = {}
    for pack, keys in by_pack.items():
        for batch in _steps(keys, blobs):
            spans = [(offset, blobs[(pack, offset, h)], bytes.fromhex(h)) for _, offset, h in batch]
            try:
                found = _core.verify_pack(packs / pack, spans)
            except FileNotFoundError:
                bad.update((key, "missing") for key in keys)
                advance(sum(blobs[k] for k in keys))
                break
            bad.update((key, r[0]) for key, r in zip(batch, found, strict=True) if r is not None)
            advance(sum(blobs[k] for k in batch))
    return bad


def _steps(keys: list[BlobKey], blobs: dict[BlobKey, int]) -> Iterator[list[BlobKey]]:
    """Consecutive groups of about `_STEP` bytes (a larger tensor makes its own group)."""
    batch: list[BlobKey] = []
    size = 0
    for key in keys:
        batch.append(key)
        size += blobs[key]
        if size >= _STEP:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _quarantine(root: Path, bad: dict[BlobKey, str], intact: set[BlobKey]) -> tuple[int, int]:
    """Records the damaged copies in quarantine and releases those found intact again; returns how many
    of each changed."""

    d = root / QUARANTINE
    d.mkdir(exist_ok=True)
    added = released = 0
    # Exclusive: a save that has already looked up its duplicates finishes first (its version refers to
    # the damaged copy, and is reported by the next verify); every later save sees the quarantine.
    with flock(root / "repo.lock", exclusive=True):
        before = quarantined(root)
        for key, reason in bad.items():
            if key in before:
                continue
            entry = d / entry_name(key)
            tmp = d / f".{entry.name}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps({"reason": reason, "quarantined": time.time()}) + "\n")
            os.rename(tmp, entry)
            added += 1
        for key in before & intact:
            (d / entry_name(key)).unlink()
            released += 1
        if added or released:
            fsync_dir(d)
    return added, released


@contextlib.contextmanager
def _progress(total: int, show: bool) -> Iterator[Callable[[int], None]]:
    """A callable that advances a bar of bytes checked, shown on stderr when `show`."""
    if not show:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("verify"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task("verify", total=total or 1)
        yield lambda n: bar.advance(task, n)
        bar.update(task, completed=total or 1)


@contextlib.contextmanager
def named_damage(m: RepositoryManifest, path: Path, tensors: Sequence[StoredTensor]) -> Iterator[None]:
    """Turns the engine's IntegrityError (message, index of the request, kind) into one that names the
    tensor, the version and the pack, and says what to do."""
    try:
        yield
    except _core.IntegrityError as e:
        index = e.args[1] if len(e.args) > 1 else None
        what = f"tensor {tensors[index]['name']!r}" if index is not None else "a tensor"
        why = (
            "the pack is truncated"
            if e.args[2:] == ("truncated",)
            else "its bytes do not match the recorded hash"
        )
        raise _core.IntegrityError(
            f"{what} of {m['name']}@{m['version']} is damaged in {path} ({why}); it was not returned. "
            + repair_advice(m, path, tensors[index] if index is not None else None)
        ) from e
    except FileNotFoundError as e:
        names = ", ".join(repr(t["name"]) for t in tensors[:3]) + (", ..." if len(tensors) > 3 else "")
        raise _core.IntegrityError(
            f"{m['name']}@{m['version']}: pack {path}, which holds tensor {names}, is missing. "
            + repair_advice(m, path, None)
        ) from e


def repair_advice(m: RepositoryManifest, pack: Path, t: StoredTensor | None) -> str:
    """What to do about a damaged tensor of version `m` in `pack`: a save of the same tensors would refer to
    the damaged copy (dedup) until `verify --repair` quarantines it."""
    root = pack.parent.parent
    ref = f"{m['name']}@{m['version']}"
    if t is not None and is_quarantined(root, t):
        return (
            f"The damaged copy is quarantined: {ref} stays broken. Restore the pack from a backup, or save "
            "the model again, which now writes the tensor anew, and delete this version"
        )
    return (
        f"Restore the pack from a backup, or run `tierstore models --repo {root} verify {ref} --repair` "
        "and then save the model again (until the repair, a save reuses the damaged copy)"
    )
