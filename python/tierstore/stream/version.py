"""What a version of a model stream is, as the agent announces it: its tensors (name, dtype, shape, blake3,
size) and where their bytes are."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tierstore import _core
from tierstore.models.tensors import TensorSpec, mapped
from tierstore.stream.connection import StreamError
from tierstore.types import StreamManifest


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
    m: StreamManifest = json.loads(_core.stream_manifest_read(path))
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
