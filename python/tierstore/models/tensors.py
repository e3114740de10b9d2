"""Tensors as the repository sees them: a dtype name, a shape, and a contiguous byte view.

torch tensors of every dtype torch has (bfloat16 and the float8 types included) and numpy arrays are
turned into uint8 views of their memory without a copy (non-contiguous tensors and views of shared storage
are made contiguous one at a time), empty destinations are made to read into, and tensors are laid over a
mapped pack's bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


def _torch() -> Any:
    import torch

    return torch


@dataclass(frozen=True)
class TensorSpec:
    """What the manifest records of a tensor besides its bytes."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def is_torch_tensor(x: Any) -> bool:
    t = type(x)
    return t.__module__.startswith("torch") and t.__name__ in ("Tensor", "Parameter")


def torch_dtype(name: str) -> Any:
    torch = _torch()
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype in torch {torch.__version__}")
    return dtype


def itemsize(dtype: str) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return torch_dtype(dtype).itemsize


def spec_and_bytes(value: Any, key: str) -> tuple[TensorSpec, np.ndarray, str]:
    """The spec, a contiguous uint8 view of the bytes, and the framework ("torch" or "numpy")."""
    if is_torch_tensor(value):
        torch = _torch()
        t = value.detach()
        if t.is_quantized or t.layout != torch.strided:
            raise TypeError(
                f"tensor {key!r}: {t.layout} / quantized tensors are not supported; dequantize or densify it"
            )
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.resolve_conj().resolve_neg()
        if not t.is_contiguous():
            t = t.contiguous()
        spec = TensorSpec(str(t.dtype).removeprefix("torch."), tuple(t.shape))
        return spec, t.reshape(-1).view(torch.uint8).numpy(), "torch"
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject or value.dtype.fields is not None:
            raise TypeError(
                f"array {key!r}: dtype {value.dtype} holds Python objects or fields; store plain numbers"
            )
        # ascontiguousarray gives at least one dimension: put a 0-d array's shape back.
        a = np.ascontiguousarray(value).reshape(value.shape)
        return TensorSpec(a.dtype.name, tuple(a.shape)), a.reshape(-1).view(np.uint8), "numpy"
    raise TypeError(
        f"{key!r} is a {type(value).__name__}, not a tensor: give an nn.Module, a state_dict or a dict of numpy arrays"
    )


def empty(spec: TensorSpec, framework: str, device: str = "cpu") -> Any:
    """A new, uninitialized tensor or array for `spec`."""
    if framework == "numpy":
        return np.empty(spec.shape, dtype=np.dtype(spec.dtype))
    torch = _torch()
    return torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device=device)


def writable_bytes(x: Any) -> np.ndarray | None:
    """A uint8 view of a destination's memory if bytes can be read straight into it, else None."""
    if isinstance(x, np.ndarray):
        if x.flags.c_contiguous and x.flags.writeable:
            return x.reshape(-1).view(np.uint8)
        return None
    if is_torch_tensor(x):
        torch = _torch()
        if x.device.type == "cpu" and x.is_contiguous() and x.layout == torch.strided:
            # detach() shares the memory: the bytes land in the tensor (or parameter) itself.
            return x.detach().reshape(-1).view(torch.uint8).numpy()
    return None


def mapped(buffer: Any, offset: int, spec: TensorSpec, framework: str) -> Any:
    """A tensor or array over `spec`'s bytes at `offset` of a writable buffer (a mapped pack), no copy.
    It keeps the buffer alive."""
    nbytes = spec.numel * itemsize(spec.dtype)
    if nbytes == 0:
        return empty(spec, framework)  # nothing to view; frombuffer refuses zero bytes
    if framework == "numpy":
        flat = np.frombuffer(buffer, dtype=np.uint8, count=nbytes, offset=offset)
        return flat.view(np.dtype(spec.dtype)).reshape(spec.shape)
    torch = _torch()
    flat = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)
    return flat.view(torch_dtype(spec.dtype)).reshape(spec.shape)
