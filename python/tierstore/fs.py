"""An fsspec filesystem over the cache: `fsspec.open("tierstore:///data/train/x.jpg")` reads through it.

Listing and metadata go to the local view of the source (a POSIX mount); reads of files under the source
are served by the cache. Writes are refused: the cache serves reads only.

    import fsspec
    fs = fsspec.filesystem("tierstore", source="/lustre/data", tiers=["/dev/shm/ts:32G"])
    with fs.open("/lustre/data/train/0001.npy") as f: ...
"""

from __future__ import annotations

from typing import Any

from fsspec.implementations.local import LocalFileSystem

from tierstore.cache import Cache, default_cache


class TierstoreFileSystem(LocalFileSystem):
    """fsspec filesystem whose reads come from a tierstore cache.

    Args:
        cache: An existing cache; otherwise one is built from the other arguments (see `tierstore.Cache`),
            or the default cache is used when there are none.
    """

    protocol = "tierstore"
    root_marker = "/"

    def __init__(self, cache: Cache | None = None, **cache_args: Any) -> None:
        super().__init__()
        if cache is None:
            cache = Cache(**cache_args) if cache_args else default_cache()
        self.cache = cache

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        if path.startswith("tierstore://"):
            path = path[len("tierstore://") :]
        return LocalFileSystem._strip_protocol(path)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if mode != "rb":
            raise ValueError(
                f"tierstore:// serves reads only (mode {mode!r} for {path}); write with the local path"
            )
        return self.cache.open(self._strip_protocol(path))
