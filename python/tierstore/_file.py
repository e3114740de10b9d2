"""The file object returned by `tierstore.open`."""

from __future__ import annotations

import io
from typing import Any

from tierstore import _core


class CachedFile(io.RawIOBase):
    """A read-only binary file served by the cache.

    It behaves like the object `open(path, "rb")` returns: `read`, `readinto` (straight into the caller's
    buffer, no intermediate copy), `readline`, iteration, `seek`, `tell`, and use as a context manager, so
    numpy.load, PIL.Image.open, pickle, torch.load and h5py.File take it unchanged. `fileno()` works when a
    real file holds the bytes (a cached copy, or the source); a file fetched into memory by this very open
    has no descriptor and raises `io.UnsupportedOperation`, as `io.BytesIO` does.
    """

    mode = "rb"

    def __init__(self, reader: _core.Reader, name: str) -> None:
        # Nothing of IOBase's own state is used: the reader says whether the file is closed. A warm open
        # and read costs a few microseconds in all, so the calls it skips count.
        self._reader = reader
        self.name = name

    @property
    def closed(self) -> bool:
        return self._reader.closed

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def read(self, size: int | None = -1) -> bytes:
        return self._reader.read(-1 if size is None else size)

    def readall(self) -> bytes:
        return self._reader.read(-1)

    def readinto(self, buffer: Any) -> int:
        return self._reader.readinto(buffer)

    def readline(self, size: int | None = -1) -> bytes:
        return self._reader.readline(-1 if size is None else size)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._reader.seek(offset, whence)

    def tell(self) -> int:
        return self._reader.tell()

    def write(self, b: Any) -> int:
        raise self._read_only("write")

    def truncate(self, size: int | None = None) -> int:
        raise self._read_only("truncate")

    def _read_only(self, what: str) -> Exception:
        """The error `open(path, "rb")` gives a write (`writelines` comes here through `write`)."""
        if self.closed:
            return ValueError("I/O operation on closed file.")
        return io.UnsupportedOperation(
            f"{what}: {self.name} is open for reading only (a cache serves it); write the file with "
            "tierstore.open(path, 'wb') under a [[writeback]] destination, or with the built-in open()"
        )

    def fileno(self) -> int:
        fd = self._reader.fileno()
        if fd is None:
            raise io.UnsupportedOperation(
                f"{self.name} is held in memory by tierstore and has no file descriptor"
            )
        return fd

    @property
    def size(self) -> int:
        """Size of the file in bytes."""
        return self._reader.size

    @property
    def backing(self) -> str:
        """Where the bytes come from: "tier" (a cached copy), "memory" (fetched by this open),
        "copying" (a large file being copied) or "source"."""
        return self._reader.backing

    def close(self) -> None:
        # Nothing to flush; closing twice is allowed, as for any file.
        self._reader.close()

    def __repr__(self) -> str:
        return f"<tierstore.CachedFile name={self.name!r} backing={self._reader.backing if not self.closed else 'closed'}>"
