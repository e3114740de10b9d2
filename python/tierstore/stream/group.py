"""A version's changed tensors moved inside a torch.distributed process group (the stream's group transport).

Both sides derive the same list from the version's manifest: the tensors whose hash differs from the version
the publisher last sent to the group, in manifest order. Their bytes, end to end, form one stream cut into
buckets of at most `bucket_bytes`; each bucket is one `broadcast` from the publisher's rank. A bucket that lies
within one tensor is sent from (and received into) that tensor's memory; smaller tensors are packed into a
reused flat buffer, so that a model of many small tensors costs a few collectives, not one per tensor. The
buffers live on the tensors' device: with NCCL on GPUs the bytes go GPU to GPU.

Every collective waits at most the process group's timeout (its `timeout=` at `init_process_group`); past it,
or when a peer is gone, torch raises and the caller reports it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# The metadata key a version carries when its changed tensors go through a process group.
META_KEY = "tierstore_group"

# A piece of a bucket: (which tensor of the list, offset in that tensor, offset in the bucket, bytes).
Piece = tuple[int, int, int, int]


def changed(tensors: Sequence[Any], base: Mapping[str, str]) -> list[int]:
    """The indices of the tensors (StreamTensor) whose hash differs from `base` (name -> hash), in order."""
    return [i for i, t in enumerate(tensors) if base.get(t.name) != t.hash]


def buckets(sizes: Sequence[int], bucket_bytes: int) -> list[list[Piece]]:
    """The tensors' bytes, end to end, cut into buckets of at most `bucket_bytes`."""
    out: list[list[Piece]] = []
    current: list[Piece] = []
    fill = 0
    for i, n in enumerate(sizes):
        done = 0
        while done < n:
            take = min(n - done, bucket_bytes - fill)
            current.append((i, done, fill, take))
            done += take
            fill += take
            if fill == bucket_bytes:
                out.append(current)
                current, fill = [], 0
    if current:
        out.append(current)
    return out


def byte_view(x: Any) -> Any:
    """A flat uint8 torch tensor over the memory of a contiguous torch tensor or numpy array (no copy)."""
    import torch

    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise TypeError("the group transport needs contiguous arrays")
        return torch.from_numpy(x.reshape(-1).view(np.uint8))
    t = x.detach()
    if not t.is_contiguous():
        raise TypeError("the group transport needs contiguous tensors; call .contiguous() on the model's")
    return t.reshape(-1).view(torch.uint8)


class Bucket:
    """A reused flat buffer on the tensors' device, grown to at most `bucket_bytes` as needed."""

    def __init__(self, bucket_bytes: int) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes {bucket_bytes}: use a positive size, e.g. 64 << 20")
        self.bucket_bytes = bucket_bytes
        self._buf: Any = None

    @property
    def allocated(self) -> int:
        """The bytes the buffer holds (0 until a bucket packs more than one piece)."""
        return 0 if self._buf is None else int(self._buf.numel())

    def get(self, n: int, device: Any) -> Any:
        import torch

        if self._buf is None or self._buf.numel() < n or self._buf.device != device:
            self._buf = torch.empty(n, dtype=torch.uint8, device=device)
        return self._buf[:n]


def _sync(device: Any) -> None:
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.current_stream(device).synchronize()


def send(views: Sequence[Any], bucket: Bucket, group: Any, src: int) -> int:
    """Broadcasts the bytes of `views` (flat uint8 tensors) from rank `src`; the bytes sent."""
    import torch.distributed as dist

    sizes = [v.numel() for v in views]
    for pieces in buckets(sizes, bucket.bucket_bytes):
        if len(pieces) == 1:
            i, off, _, n = pieces[0]
            dist.broadcast(views[i][off : off + n], src=src, group=group)
            continue
        buf = bucket.get(sum(p[3] for p in pieces), views[pieces[0][0]].device)
        for i, off, at, n in pieces:
            buf[at : at + n].copy_(views[i][off : off + n])
        dist.broadcast(buf, src=src, group=group)
    return sum(sizes)


def receive(
    sizes: Sequence[int], dests: Sequence[Any] | None, device: Any, bucket: Bucket, group: Any, src: int
) -> int:
    """Receives the bytes `send` broadcasts into `dests` (flat uint8 tensors on `device`), or discards them
    when None (a consumer still takes part, so that the group's collectives stay matched); the bytes."""
    import torch.distributed as dist

    for pieces in buckets(sizes, bucket.bucket_bytes):
        if len(pieces) == 1 and dests is not None:
            i, off, _, n = pieces[0]
            dist.broadcast(dests[i][off : off + n], src=src, group=group)
            continue
        buf = bucket.get(sum(p[3] for p in pieces), device)
        dist.broadcast(buf, src=src, group=group)
        if dests is not None:
            for i, off, at, n in pieces:
                dests[i][off : off + n].copy_(buf[at : at + n])
    _sync(device)
    return sum(sizes)


def handshake(group: Any, src: int, device: Any, token: int = 0) -> int:
    """The publisher's session token, known to every rank once every rank has called this: an all-reduce
    completes nowhere before all took part, so a publisher's first version cannot reach the group before
    every consumer subscribed to the stream."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([token], dtype=torch.int64, device=device)
    dist.all_reduce(t, group=group)
    return int(t.item())


def default_device(group: Any) -> Any:
    """Where the group's own small tensors live: the current GPU for NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
