"""Interoperability with the safetensors format: export a version as a file any safetensors reader opens,
and import a safetensors file as a new version. The format is simple enough to write and parse here, so
neither direction needs the safetensors package."""

from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from tierstore import _core
from tierstore.models.integrity import named_damage
from tierstore.types import RepositoryManifest

TO_SAFETENSORS = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "complex64": "C64",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
}  # fmt: skip
FROM_SAFETENSORS = {v: k for k, v in TO_SAFETENSORS.items()}


def export(m: RepositoryManifest, packs: Path, path: str | os.PathLike[str]) -> Path:
    """Writes the version whose manifest is `m` (its tensors in the packs of directory `packs`) as a
    safetensors file, each tensor verified as it is read."""
    name = m["name"]
    header: dict[str, Any] = {}
    offset = 0
    for t in m["tensors"]:
        st = TO_SAFETENSORS.get(t["dtype"])
        if st is None:
            raise ValueError(f"tensor {t['name']!r} is {t['dtype']}, which safetensors cannot represent")
        header[t["name"]] = {"dtype": st, "shape": t["shape"], "data_offsets": [offset, offset + t["nbytes"]]}
        offset += t["nbytes"]
    meta = {"tierstore.model": name, "tierstore.version": str(m["version"])}
    meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in m["metadata"].items()})
    header["__metadata__"] = meta
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    out = Path(path)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for t in m["tensors"]:
                buf = np.empty(t["nbytes"], dtype=np.uint8)
                pack = packs / t["pack"]
                with named_damage(m, pack, [t]):  # a damaged tensor is named, not "tensor #0"
                    _core.read_into(pack, [(t["offset"], buf, bytes.fromhex(t["hash"]))])
                f.write(buf.data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed export leaves nothing beside its target
        raise
    return out


def read_header(path: Path) -> tuple[int, dict[str, Any]]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 << 20:
            raise ValueError(f"{path}: not a safetensors file (header of {n} bytes)")
        return 8 + n, json.loads(f.read(n))


def read_file(
    path: str | os.PathLike[str],
) -> tuple[dict[str, tuple[str, tuple[int, ...], np.ndarray]], dict[str, Any]]:
    """The tensors of a safetensors file, as zero-copy views of the mapped file (name -> dtype, shape, bytes),
    and its metadata."""
    path = Path(path)
    start, header = read_header(path)
    meta = header.pop("__metadata__", {}) or {}
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    data = np.frombuffer(mm, dtype=np.uint8)
    raw: dict[str, tuple[str, tuple[int, ...], np.ndarray]] = {}
    for key, t in header.items():
        dtype = FROM_SAFETENSORS.get(t["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {key!r} has dtype {t['dtype']}, which tierstore does not know")
        b, e = t["data_offsets"]
        raw[key] = (dtype, tuple(t["shape"]), data[start + b : start + e])
    return raw, {"imported_from": str(path), **meta}
