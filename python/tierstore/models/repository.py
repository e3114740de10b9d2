"""The model repository: versions of models stored tensor by tensor, deduplicated across versions.

Layout of a repository directory:

    packs/<id>.pack          tensors of one save, aligned, written in one sequential stream, then fsynced
    models/<name>/v<N>.json  one manifest per version: tensor table, layer IDs, graph, user metadata
    models/<name>/.lock      serializes version numbering of one model
    quarantine/<hash>.<offset>.<pack>  a damaged stored tensor, which saves no longer deduplicate against
    repo.lock                shared by saves, exclusive for gc (which must not delete a save's new pack)
                             and for quarantining (see `verify`)

A save hashes every tensor (blake3), writes only the tensors the repository does not hold yet into one new
pack, fsyncs it, and writes the manifest last (temporary name, fsync, rename, fsync of the directory): a
crashed save never appears and never touches earlier versions. A load reads only the chosen tensors,
straight into their destination's memory (or maps new CPU tensors onto the pack's pages, copying nothing),
and checks every hash: wrong bytes are never returned.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import json
import os
import re
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tierstore import _core
from tierstore.models import integrity, safetensors_io
from tierstore.models import layers as layer_ids
from tierstore.models.files import flock, fsync_dir, read_manifest, write_manifest
from tierstore.models.packs import NOT_SERVED, Packs, cache_for
from tierstore.models.staging import POOL
from tierstore.models.tensors import (
    TensorSpec,
    empty,
    is_torch_tensor,
    itemsize,
    mapped,
    spec_and_bytes,
    writable_bytes,
)
from tierstore.types import ManifestTensor, RepositoryManifest, StoredTensor

FORMAT = _core.REPOSITORY_FORMAT
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_GLOB = re.compile(r"[*?\[]")
IntegrityError = _core.IntegrityError


class RepositoryError(_core.TierstoreError):
    """A repository request that cannot be met (unknown model or version, keys that match nothing...)."""


@dataclass(frozen=True)
class Version:
    """One saved version of a model."""

    name: str
    version: int
    created: float
    tensors: int
    nbytes: int
    written_bytes: int
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def deduplicated_bytes(self) -> int:
        """Bytes of this version that were already stored and were not written again."""
        return self.nbytes - self.written_bytes

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass
class MatchReport:
    """What `Repository.load_matching` filled in."""

    matched: list[tuple[str, str]]  # (layer of the target model, layer of the stored model)
    unmatched: list[str]  # layers of the target model with no stored layer of the same ID
    tensors: int
    nbytes: int


def _flatten(obj: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The named tensors of `obj`, and the architecture graph when it is an nn.Module."""
    if hasattr(obj, "state_dict") and hasattr(obj, "named_modules"):
        state = obj.state_dict(keep_vars=False)
        return dict(state), layer_ids.describe(obj)
    if isinstance(obj, Mapping):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad:
            raise TypeError(f"tensor names must be strings, got {bad[0]!r}")
        return dict(obj), None
    raise TypeError(
        f"cannot save a {type(obj).__name__}: give an nn.Module, a state_dict or a dict of numpy arrays"
    )


class Repository:
    """A directory of model versions with tensor-level access.

    Args:
        root: The repository directory (created if missing), on a local disk or the shared store.
        create: False to open only a repository that exists: a path without one raises RepositoryError
            instead of becoming an empty repository (for tools that only read or maintain one).
        cache: Loads read packs through this `tierstore.Cache` (the repository must lie under its source):
            a node fetches each pack once, from the peer that owns it when the cache is shared across
            the job's nodes, and later loads read the fast tier's copy. By default, the default cache
            when one is configured (`tierstore.toml`, `TIERSTORE_SOURCE`, `tierstore.configure`) and its
            source holds the repository; False reads the repository directly.

    Raises:
        ValueError: `cache` is given and its source does not hold the repository.
    """

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True, cache: Any = None) -> None:
        self.root = Path(root).absolute()
        marker = self.root / "format"
        if not create and not marker.is_file():
            raise RepositoryError(
                f"{self.root} is not a tierstore model repository (it has no 'format' file); check the "
                "path. A repository is created by its first save: tierstore.models.Repository(path).save(...)"
            )
        for sub in ("packs", "models"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        if not marker.exists():
            marker.write_text(f"tierstore-models {FORMAT}\n")
        elif marker.read_text().split() != ["tierstore-models", str(FORMAT)]:
            raise RepositoryError(f"{self.root} is not a tierstore model repository of format {FORMAT}")
        # hash -> (pack, offset, nbytes): what the repository holds, built from the manifests, without the
        # quarantined (damaged) copies
        self._blobs: dict[str, tuple[str, int, int]] = {}
        # The blake3 of each pack file whole, where a manifest records it (by pack name).
        self._pack_hashes: dict[str, str] = {}
        self._seen: set[Path] = set()
        self._quarantined: frozenset[integrity.BlobKey] = frozenset()
        self._packs = Packs(self.root, cache_for(self.root, cache))

    # -- names and manifests ------------------------------------------------------------------------------

    def _model_dir(self, name: str) -> Path:
        if not _NAME.match(name):
            raise ValueError(
                f"model name {name!r}: use letters, digits, '.', '_' and '-' (at most 128, not starting with a dot)"
            )
        return self.root / "models" / name

    def _manifest_path(self, name: str, version: int) -> Path:
        return self._model_dir(name) / f"v{version}.json"

    def _version_numbers(self, name: str) -> list[int]:
        d = self._model_dir(name)
        if not d.is_dir():
            return []
        return sorted(int(p.stem[1:]) for p in d.glob("v*.json") if p.stem[1:].isdigit())

    def _resolve(self, name: str, version: int | str) -> int:
        numbers = self._version_numbers(name)
        if not numbers:
            known = ", ".join(self.models()) or "none"
            raise RepositoryError(f"no model named {name!r} in {self.root} (models: {known})")
        if version == "latest":
            return numbers[-1]
        try:
            v = int(version)
        except (TypeError, ValueError):
            raise RepositoryError(f"version {version!r} of {name}: give a number or 'latest'") from None
        if v not in numbers:
            raise RepositoryError(f"{name} has no version {v} (versions: {', '.join(map(str, numbers))})")
        return v

    def export(self, name: str, version: int | str, path: str | os.PathLike[str]) -> Path:
        """Writes a version as a standard safetensors file (the fnuz float8 types included).

        Every tensor is checked as it is read. The file is written under a temporary name beside `path`
        and renamed into place once whole; a failed export removes it and leaves `path` as it was.

        Returns:
            The path written.

        Raises:
            IntegrityError: A stored tensor is damaged: the message names it (its key in the state dict), the
                model and the version, and how to repair.
            ValueError: A tensor's dtype has no safetensors name.
        """
        return safetensors_io.export(self.manifest(name, version), self.root / "packs", path)

    def import_safetensors(self, path: str | os.PathLike[str], name: str) -> Version:
        """Stores a safetensors file as a new version of `name`."""
        raw, metadata = safetensors_io.read_file(path)
        return self._save_raw(name, raw, metadata=metadata)

    def manifest(self, name: str, version: int | str = "latest") -> RepositoryManifest:
        """The manifest of a version, as stored."""
        v = self._resolve(name, version)
        return read_manifest(self._manifest_path(name, v))

    def _refresh(self) -> None:
        """Brings the index of stored tensors up to date with the manifests on disk."""
        paths = set((self.root / "models").glob("*/v*.json"))
        quarantined = integrity.quarantined(self.root)
        # A version was deleted (its tensors may be gone after a gc), or a copy was quarantined (another
        # copy of the same tensor may be intact): start again.
        if not self._seen <= paths or quarantined != self._quarantined:
            self._blobs.clear()
            self._pack_hashes.clear()
            self._seen.clear()
            self._quarantined = quarantined
        for p in sorted(paths - self._seen):
            try:
                m = read_manifest(p)
            except (OSError, ValueError):
                continue  # deleted meanwhile, or damaged (`verify` names it)
            for t in m["tensors"]:
                if (t["pack"], t["offset"], t["hash"]) not in quarantined:
                    self._blobs.setdefault(t["hash"], (t["pack"], t["offset"], t["nbytes"]))
            self._pack_hashes.update(m.get("pack_hashes", {}))
            self._seen.add(p)

    # -- saving -------------------------------------------------------------------------------------------

    def save(self, name: str, obj: Any, *, metadata: Mapping[str, Any] | None = None) -> Version:
        """Stores a new version of a model.

        Args:
            name: The model's name.
            obj: An `nn.Module`, a state_dict, or a dict of numpy arrays.
            metadata: JSON-serializable information kept with the version.

        Returns:
            The new version, with how many bytes it wrote and how many it found already stored.
        """
        tensors, graph = _flatten(obj)
        entries = []
        frameworks = set()
        for key, value in tensors.items():
            spec, view, framework = spec_and_bytes(value, key)
            frameworks.add(framework)
            entries.append((key, spec, view))
        if len(frameworks) > 1:
            raise TypeError(f"{name}: mix of torch tensors and numpy arrays; convert them to one kind")
        return self._save_entries(name, entries, graph, metadata, frameworks.pop() if frameworks else "numpy")

    def _save_raw(
        self,
        name: str,
        raw: Mapping[str, tuple[str, tuple[int, ...], np.ndarray]],
        *,
        metadata: Mapping[str, Any],
    ) -> Version:
        """Saves tensors given as (dtype name, shape, uint8 bytes), as read from another format."""
        entries = []
        for key, (dtype, shape, view) in raw.items():
            spec = TensorSpec(dtype, tuple(shape))
            if spec.numel * itemsize(dtype) != view.nbytes:
                raise ValueError(f"tensor {key!r}: {view.nbytes} bytes for {dtype}{tuple(shape)}")
            entries.append((key, spec, view))
        return self._save_entries(name, entries, None, metadata, "torch")

    def _save_entries(
        self,
        name: str,
        entries: list[tuple[str, TensorSpec, np.ndarray]],
        graph: dict[str, Any] | None,
        metadata: Mapping[str, Any] | None,
        framework: str,
    ) -> Version:
        model_dir = self._model_dir(name)
        meta = json.loads(json.dumps(dict(metadata or {})))  # fails early on what JSON cannot hold
        with flock(self.root / "repo.lock", exclusive=False):
            self._refresh()
            hashes: list[str] = []
            locations: dict[str, tuple[str, int, int]] = {}
            written = 0
            writer = None
            pack = f"{uuid.uuid4().hex}.pack"
            try:
                # A tensor whose size no stored tensor has and no other tensor of this save shares cannot
                # be a duplicate: it is written at once, while a helper thread hashes (both release the
                # GIL). The others wait for their batch's hashes, which the helper computes ahead of the
                # writes. A first save thus never waits for hashing before its first write.
                stored_sizes = {nbytes for _, _, nbytes in self._blobs.values()}
                size_counts = Counter(view.nbytes for _, _, view in entries)

                def append(views: list[np.ndarray]) -> list[int]:
                    """Writes tensors with one writev (a write per tensor costs more than its bytes, see
                    pack.rs) into the pack, created on the first tensor; returns their offsets."""
                    nonlocal writer
                    if not views:
                        return []
                    if writer is None:
                        writer = _core.PackWriter(self.root / "packs" / pack)
                    return writer.append_all(views)

                for batch, hashed in _hashed_in_background(_batches(entries, 64 << 20)):
                    eager = [
                        k
                        for k, (_, _, view) in enumerate(batch)
                        if view.nbytes not in stored_sizes and size_counts[view.nbytes] == 1
                    ]
                    eager_offsets = append([batch[k][2] for k in eager])
                    batch_hashes = hashed.result()
                    hashes.extend(batch_hashes)
                    for k, offset in zip(eager, eager_offsets, strict=True):
                        view = batch[k][2]
                        locations[batch_hashes[k]] = (pack, offset, view.nbytes)
                        written += view.nbytes
                    new: dict[str, np.ndarray] = {}  # the batch's other tensors not stored yet, each once
                    for (_, _, view), h in zip(batch, batch_hashes, strict=True):
                        if h not in self._blobs and h not in locations and h not in new:
                            new[h] = view
                    offsets = append(list(new.values()))
                    for (h, view), offset in zip(new.items(), offsets, strict=True):
                        locations[h] = (pack, offset, view.nbytes)
                        written += view.nbytes
                if writer is not None:
                    self._pack_hashes[pack] = writer.commit()
            except BaseException:
                if writer is not None:
                    writer.abort()
                raise
            table: list[StoredTensor] = []
            for (key, spec, _), h in zip(entries, hashes, strict=True):
                pack, offset, nbytes = self._blobs.get(h) or locations[h]
                table.append(
                    {
                        "name": key,
                        "dtype": spec.dtype,
                        "shape": list(spec.shape),
                        "hash": h,
                        "pack": pack,
                        "offset": offset,
                        "nbytes": nbytes,
                    }
                )
            model_dir.mkdir(parents=True, exist_ok=True)
            with flock(model_dir / ".lock", exclusive=True):
                numbers = self._version_numbers(name)
                version = numbers[-1] + 1 if numbers else 1
                manifest: RepositoryManifest = {
                    "format": FORMAT,
                    "name": name,
                    "version": version,
                    "created": time.time(),
                    "framework": framework,
                    "metadata": meta,
                    "graph": graph,
                    "tensors": table,
                    # Every pack the version reads whose hash is known: this save's, and those of older
                    # saves that recorded theirs (a pack written before hashes were recorded has none).
                    "pack_hashes": {
                        p: self._pack_hashes[p]
                        for p in sorted({t["pack"] for t in table})
                        if p in self._pack_hashes
                    },
                    "written_bytes": written,
                }
                write_manifest(self._manifest_path(name, version), manifest)
            for h, loc in locations.items():
                self._blobs.setdefault(h, loc)
        return self._version_of(manifest)

    @staticmethod
    def _version_of(m: RepositoryManifest) -> Version:
        return Version(
            name=m["name"],
            version=m["version"],
            created=m["created"],
            tensors=len(m["tensors"]),
            nbytes=sum(t["nbytes"] for t in m["tensors"]),
            written_bytes=m["written_bytes"],
            metadata=m["metadata"],
        )

    # -- loading ------------------------------------------------------------------------------------------

    @staticmethod
    def _select(m: RepositoryManifest, keys: str | Iterable[str] | None) -> list[StoredTensor]:
        tensors = m["tensors"]
        if keys is None:
            return tensors
        patterns = [keys] if isinstance(keys, str) else list(keys)
        by_name = {t["name"]: t for t in tensors}
        chosen: dict[str, StoredTensor] = {}
        for pat in patterns:
            if pat in by_name:  # an exact name: a lookup, not a scan (partial loads name hundreds of tensors)
                chosen[pat] = by_name[pat]
                continue
            hits = [t for t in tensors if fnmatch.fnmatchcase(t["name"], pat)] if _GLOB.search(pat) else []
            if not hits:
                sample = ", ".join(t["name"] for t in tensors[:8]) + (", ..." if len(tensors) > 8 else "")
                raise RepositoryError(
                    f"no tensor of {m['name']}@{m['version']} matches {pat!r} (tensors: {sample})"
                )
            for t in hits:
                chosen[t["name"]] = t
        return [t for t in tensors if t["name"] in chosen]

    def load(
        self,
        name: str,
        version: int | str = "latest",
        *,
        keys: str | Iterable[str] | None = None,
        into: Any = None,
        device: str = "cpu",
        mmap: bool = True,
    ) -> dict[str, Any]:
        """Loads tensors of a version.

        Args:
            name: The model's name.
            version: A version number or "latest".
            keys: Tensor names or glob patterns (`"encoder.*"`); all tensors when None. Only the chosen
                tensors are read: by whole 2 MiB blocks of the pack where at least a third of the block
                is chosen, which is faster, and exactly elsewhere (a copying load reads exactly unless
                the blocks hold little else; see the README).
            into: An `nn.Module` or a state_dict to fill in place: bytes land in its tensors' memory.
            device: Where new tensors are created ("cpu", "cuda:0"...) when `into` is not given.
            mmap: For new CPU tensors: map them onto the pack's pages (copy-on-write, as safetensors'
                `load_file` does): no byte is copied, and processes that load the same model share one
                copy in the page cache. Writing to such a tensor copies the page and never changes the
                repository. False reads them into memory of their own instead, which outlives a
                repository whose disk goes away. Loads `into` a model or onto a GPU always copy.

        Returns:
            The loaded tensors by name (the tensors of `into` when given).

        Raises:
            IntegrityError: Stored bytes do not match their hash, or their pack is missing; the message
                names the tensor and how to repair (`verify`). Nothing wrong is returned (a destination given
                with `into` may be partly overwritten).
            RepositoryError: Unknown model, version, or keys that match nothing.
        """
        m = self.manifest(name, version)
        chosen = self._select(m, keys)
        framework = m["framework"]
        targets: dict[str, Any] = {}
        if into is not None:
            state = into.state_dict(keep_vars=True) if hasattr(into, "state_dict") else into
            for t in chosen:
                if t["name"] not in state:
                    raise RepositoryError(
                        f"{t['name']!r} of {name}@{m['version']} has no place in the target"
                    )
                dest = state[t["name"]]
                shape = tuple(dest.shape)
                dtype = (
                    str(dest.dtype).removeprefix("torch.")
                    if is_torch_tensor(dest)
                    else np.dtype(dest.dtype).name
                )
                if shape != tuple(t["shape"]) or dtype != t["dtype"]:
                    raise RepositoryError(
                        f"{t['name']!r}: stored {t['dtype']}{tuple(t['shape'])}, target {dtype}{shape}"
                    )
                targets[t["name"]] = dest
        else:
            if framework == "numpy" and device != "cpu":
                raise ValueError(f"{name} holds numpy arrays; device={device!r} needs torch tensors")
            if mmap and device == "cpu":
                return self._map(m, chosen)
            for t in chosen:
                targets[t["name"]] = empty(TensorSpec(t["dtype"], tuple(t["shape"])), framework, device)
        self._read(m, chosen, targets)
        return targets

    def _read(self, m: RepositoryManifest, chosen: list[StoredTensor], targets: dict[str, Any]) -> None:
        """Reads the chosen tensors into their targets, pack by pack, verifying every hash."""
        by_pack: dict[str, list[tuple[StoredTensor, np.ndarray]]] = defaultdict(list)
        staged: list[tuple[StoredTensor, Any]] = []
        shares = _shares(m, chosen)
        for t in chosen:
            _spec_of(t)  # the destination has the manifest's dtype and shape: their bytes must agree
            dest = targets[t["name"]]
            buf = writable_bytes(dest)
            if buf is None:  # on a GPU, or not contiguous: through the staging buffer
                staged.append((t, dest))
                continue
            by_pack[t["pack"]].append((t, buf))
        for pack, items in by_pack.items():
            self._read_pack(m, pack, items, shares[pack])
        if staged:
            with POOL.lock, _no_grad():
                for t, dest in staged:
                    host = POOL.acquire(t["nbytes"])
                    self._read_pack(m, t["pack"], [(t, host.numpy())], shares[t["pack"]])
                    src = host.view(dest.dtype).reshape(dest.shape)
                    dest.copy_(src, non_blocking=False)

    def _read_pack(
        self,
        m: RepositoryManifest,
        pack: str,
        items: list[tuple[StoredTensor, np.ndarray]],
        share: float,
    ) -> None:
        requests = [(t["offset"], buf, bytes.fromhex(t["hash"])) for t, buf in items]
        pack_hash = _pack_hash(m, pack)

        def read(path: Path, vouched: bool) -> None:
            _core.read_into(path, _unchecked(requests) if vouched else requests)

        def read_arriving(cache: _core.Cache, path: Path) -> None:
            self._packs.vouched += cache.read_into(path, requests, pack_hash)

        with integrity.named_damage(m, self._packs.path(pack), [t for t, _ in items]):
            self._packs.read(
                pack,
                share,
                read,
                arriving=read_arriving,
                parts=lambda cache, path: None if cache.read_parts(path, requests) else NOT_SERVED,
                pack_hash=pack_hash,
            )

    def _map(self, m: RepositoryManifest, chosen: list[StoredTensor]) -> dict[str, Any]:
        """The chosen tensors as views of their packs, mapped and checked (see `load`'s `mmap`)."""
        by_pack: dict[str, list[StoredTensor]] = defaultdict(list)
        specs: dict[str, TensorSpec] = {}
        shares = _shares(m, chosen)
        for t in chosen:
            specs[t["name"]] = _spec_of(t)
            by_pack[t["pack"]].append(t)
        out: dict[str, Any] = {}
        for pack, items in by_pack.items():
            spans = [(t["offset"], t["nbytes"], bytes.fromhex(t["hash"])) for t in items]
            with integrity.named_damage(m, self._packs.path(pack), items):
                mapping = self._packs.read(
                    pack,
                    shares[pack],
                    functools.partial(_map_pack, spans=spans),
                    parts=functools.partial(_map_parts, spans=spans),
                    pack_hash=_pack_hash(m, pack),
                )
            for t in items:
                out[t["name"]] = mapped(mapping, t["offset"], specs[t["name"]], m["framework"])
        return {t["name"]: out[t["name"]] for t in chosen}

    # -- transfer learning --------------------------------------------------------------------------------

    def load_matching(self, model: Any, source: str, version: int | str = "latest") -> MatchReport:
        """Fills every layer of `model` whose stable ID equals that of a stored layer of `source`,
        whatever the layers are called: a backbone reused under a new head, renamed modules.

        Returns:
            Which layers matched (target path, stored path) and which did not.
        """
        m = self.manifest(source, version)
        if not m.get("graph"):
            raise RepositoryError(
                f"{source}@{m['version']} was saved without layer IDs (not from an nn.Module)"
            )
        stored: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for layer in m["graph"]["layers"]:
            stored[layer["id"]].append(layer)
        ids = layer_ids.layer_ids(model)
        modules = dict(model.named_modules())
        matched, unmatched, plan = [], [], []
        for path, lid in ids.items():
            mod = modules[path]
            if not any(v is not None for v in [*mod._parameters.values(), *mod._buffers.values()]):
                continue  # a layer without weights (pooling, activation) has nothing to transfer
            candidates = stored.get(lid)
            if not candidates:
                unmatched.append(path)
                continue
            src = candidates.pop(0)
            matched.append((path, src["path"]))
            for full in src["tensors"]:
                local = full[len(src["path"]) + 1 :]
                plan.append((full, getattr(mod, local)))
        by_name = {t["name"]: t for t in m["tensors"]}
        chosen = [by_name[full] for full, _ in plan]
        self._read(m, chosen, {full: dest for full, dest in plan})
        return MatchReport(matched, unmatched, len(chosen), sum(t["nbytes"] for t in chosen))

    # -- listing and housekeeping ---------------------------------------------------------------------------

    def models(self) -> list[str]:
        """Names of the stored models."""
        return sorted(
            p.name for p in (self.root / "models").iterdir() if p.is_dir() and any(p.glob("v*.json"))
        )

    def versions(self, name: str) -> list[Version]:
        """Every version of a model, oldest first."""
        return [self._version_of(self.manifest(name, v)) for v in self._version_numbers(name)]

    def info(self, name: str, version: int | str = "latest") -> dict[str, Any]:
        """A summary of a version: sizes, dedup, tensors (name, dtype, shape, bytes), layers, metadata."""
        m = self.manifest(name, version)
        v = self._version_of(m)
        return {
            "name": name,
            "version": v.version,
            "created": v.created,
            "framework": m["framework"],
            "tensors": [{k: t[k] for k in ("name", "dtype", "shape", "nbytes")} for t in m["tensors"]],
            "nbytes": v.nbytes,
            "written_bytes": v.written_bytes,
            "deduplicated_bytes": v.deduplicated_bytes,
            "layers": len(m["graph"]["layers"]) if m.get("graph") else 0,
            "metadata": m["metadata"],
        }

    def delete(self, name: str, version: int | str) -> None:
        """Deletes a version (its tensors stay while another version uses them; `gc` frees the rest)."""
        v = self._resolve(name, version)
        d = self._model_dir(name)
        with flock(d / ".lock", exclusive=True):
            self._manifest_path(name, v).unlink()
            fsync_dir(d)

    def gc(self) -> dict[str, int]:
        """Removes packs no version uses, and leftovers of crashed saves.

        Returns:
            packs_removed, bytes_freed; bytes_of_deleted_versions (tensors of deleted versions that share a
            pack with tensors still in use: freed when the last user goes) and alignment_padding (the gaps
            that align each tensor in its pack), which add up to bytes_unused_in_live_packs.
        """
        with flock(self.root / "repo.lock", exclusive=True):
            live: dict[str, set[tuple[int, int]]] = defaultdict(set)
            for p in (self.root / "models").glob("*/v*.json"):
                for t in read_manifest(p)["tensors"]:
                    # By location, not by hash: a tensor saved anew after its copy was quarantined (or by
                    # two concurrent saves) is stored twice, and each copy's pack is in use.
                    live[t["pack"]].add((t["offset"], t["nbytes"]))
            removed = freed = dead = padding = 0
            for p in (self.root / "packs").iterdir():
                size = p.stat().st_size
                if p.name in live:
                    d, pad = _unused_in_pack(sorted(live[p.name]), size)
                    dead += d
                    padding += pad
                    continue
                p.unlink()  # unused pack, or a temporary left by a crashed save (no save runs now)
                removed += 1
                freed += size
            for p in (self.root / "models").glob("*/.v*.tmp"):
                p.unlink()
            for key in integrity.quarantined(self.root):
                if key[0] not in live:  # its pack is gone with the last version that referred to it
                    (self.root / integrity.QUARANTINE / integrity.entry_name(key)).unlink()
            self._blobs.clear()
            self._pack_hashes.clear()
            self._seen.clear()
        return {
            "packs_removed": removed,
            "bytes_freed": freed,
            "bytes_unused_in_live_packs": dead + padding,
            "bytes_of_deleted_versions": dead,
            "alignment_padding": padding,
        }

    def stats(self) -> dict[str, int]:
        """Bytes on disk against bytes the versions hold: what dedup saves."""
        logical = 0
        for p in (self.root / "models").glob("*/v*.json"):
            logical += sum(t["nbytes"] for t in read_manifest(p)["tensors"])
        stored = sum(p.stat().st_size for p in (self.root / "packs").glob("*.pack"))
        return {"logical_bytes": logical, "stored_bytes": stored, "saved_by_dedup": max(0, logical - stored)}

    def verify(
        self,
        name: str | None = None,
        version: int | str | None = None,
        *,
        repair: bool = False,
        progress: bool | None = None,
    ) -> integrity.VerifyReport:
        """Checks the blake3 hash of every stored tensor of the chosen versions (each stored copy once).

        A damaged copy cannot be mended here, and while it is the repository's copy of its tensor, a save
        of the same tensor refers to it instead of writing it (dedup) and is as broken. With `repair`,
        damaged copies are quarantined: the next save of those tensors writes them anew, and the new
        version loads. The versions that refer to a damaged copy stay broken (restore their packs from a
        backup, or delete them); they are reported, never silently changed. A copy quarantined earlier and
        found intact (its pack restored) is released.

        Args:
            name: The model to check; every model when None.
            version: A version number or "latest"; every version of `name` when None.
            repair: Quarantine the damaged copies found.
            progress: Show bytes checked, rate and ETA on stderr; by default only on a terminal.

        Returns:
            What was checked, and every damaged tensor by model, version and name (also those of versions
            not asked that refer to the same damaged copy). `report.ok` is False when damage was found.

        Raises:
            RepositoryError: Unknown model or version.
            ValueError: A version without a name.
        """
        if name is None:
            if version is not None:
                raise ValueError(
                    f"version {version!r} without a model name: give the name too (NAME@VERSION)"
                )
            refs = [(n, v) for n in self.models() for v in self._version_numbers(n)]
        elif version is None:
            refs = [(name, v) for v in self._version_numbers(name)] or [(name, self._resolve(name, "latest"))]
        else:
            refs = [(name, self._resolve(name, version))]
        chosen = [self._manifest_path(n, v) for n, v in refs]
        return integrity.verify(self.root, chosen, repair=repair, progress=progress)


def _pack_hash(m: RepositoryManifest, pack: str) -> bytes | None:
    """The blake3 of the pack file whole, as the manifest records it (None where it does not)."""
    h = m.get("pack_hashes", {}).get(pack)
    return bytes.fromhex(h) if h is not None else None


def _unchecked(requests: list[tuple[int, Any, bytes]]) -> list[tuple[int, Any, None]]:
    """The requests without their tensors' hashes: for a pack whose every byte is vouched for already."""
    return [(offset, dest, None) for offset, dest, _ in requests]


def _map_pack(path: Path, vouched: bool, spans: list[tuple[int, int, bytes]]) -> Any:
    """The pack mapped with `spans` brought in, each checked against its hash unless the whole pack's
    bytes are `vouched` for already (see `Packs.read`)."""
    return _core.map_pack(path, [(o, n, None) for o, n, _ in spans] if vouched else spans)


def _map_parts(cache: _core.Cache, path: Path, spans: list[tuple[int, int, bytes]]) -> Any:
    mapping = cache.map_parts(path, spans)
    return NOT_SERVED if mapping is None else mapping


def _shares(m: RepositoryManifest, chosen: list[StoredTensor]) -> dict[str, float]:
    """For each pack, the part of the version's bytes in it that a load of `chosen` reads (the whole load's,
    also when its tensors are read one at a time through the staging buffer)."""
    held: Counter[str] = Counter()
    read: Counter[str] = Counter()
    for t in m["tensors"]:
        held[t["pack"]] += t["nbytes"]
    for t in chosen:
        read[t["pack"]] += t["nbytes"]
    return {pack: read[pack] / held[pack] if held[pack] else 1.0 for pack in read}


def _spec_of(t: ManifestTensor) -> TensorSpec:
    """A manifest entry's dtype and shape, checked against the byte count it records (a manifest edited
    by hand, or written by a different program, must not make a load read the wrong range)."""
    spec = TensorSpec(t["dtype"], tuple(t["shape"]))
    needed = spec.numel * itemsize(spec.dtype)
    if needed != t["nbytes"]:
        raise IntegrityError(
            f"{t['name']!r}: the manifest records {t['nbytes']} bytes, but {spec.dtype}{spec.shape} needs "
            f"{needed}; the manifest is damaged"
        )
    return spec


def _hashed_in_background(batches: Iterable[list[Any]]) -> Iterator[tuple[list[Any], Future[list[str]]]]:
    """Each batch of entries with the future hex blake3 of its tensors: one helper thread hashes the batches
    in order, running ahead of the caller, who writes meanwhile."""

    def hash_batch(batch: list[Any]) -> list[str]:
        return [h.hex() for h in _core.hash_buffers([v for _, _, v in batch])]

    with ThreadPoolExecutor(1, thread_name_prefix="tierstore-hash") as pool:
        pending = [(batch, pool.submit(hash_batch, batch)) for batch in batches]
        try:
            yield from pending
        finally:
            for _, future in pending:
                future.cancel()  # a failed save stops hashing what it will not write


def _batches(entries: list[Any], nbytes: int) -> Iterator[list[Any]]:
    """Consecutive groups of entries of about `nbytes` each (one large entry makes its own group)."""
    batch: list[Any] = []
    size = 0
    for e in entries:
        batch.append(e)
        size += e[2].nbytes
        if size >= nbytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


@contextlib.contextmanager
def _no_grad() -> Iterator[None]:
    import torch

    with torch.no_grad():
        yield


def _alignment_for(nbytes: int) -> int:
    """The alignment a pack gives a tensor of `nbytes` (the Rust writer's `pack::alignment_for`)."""
    return 4096 if nbytes >= 64 << 10 else 64


def _unused_in_pack(tensors: list[tuple[int, int]], size: int) -> tuple[int, int]:
    """The bytes of a pack of `size` bytes that no live tensor (offset, nbytes, sorted) holds, as
    (bytes of tensors no version uses any more, alignment padding): a gap before a tensor narrower than
    that tensor's alignment is padding; a wider one held tensors since deleted, as does what follows the
    last live tensor (a pack ends with its last tensor)."""
    dead = padding = 0
    end = 0
    for offset, nbytes in tensors:
        gap = offset - end
        if gap > 0:
            if gap < _alignment_for(nbytes):
                padding += gap
            else:
                dead += gap
        end = max(end, offset + nbytes)
    dead += max(0, size - end)
    return dead, padding
