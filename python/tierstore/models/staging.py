"""One reusable host buffer for tensors whose memory bytes cannot be read into directly (on a GPU, or
non-contiguous): they are read into it, then copied to their place. Pinned when CUDA is available, so the
host-to-device copy runs at full speed; grown (doubling) rather than allocated per tensor."""

from __future__ import annotations

import threading
from typing import Any


class StagingPool:
    def __init__(self) -> None:
        self._buffer: Any = None
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> Any:
        """A uint8 torch tensor of exactly `nbytes`, viewing the shared buffer. Hold `lock` while using it."""
        import torch

        if self._buffer is None or self._buffer.numel() < nbytes:
            size = max(nbytes, 2 * (0 if self._buffer is None else self._buffer.numel()), 1 << 20)
            self._buffer = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return self._buffer[:nbytes]

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    @property
    def capacity(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()


POOL = StagingPool()
