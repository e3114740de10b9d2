"""An fsspec filesystem over the cache: `fsspec.open("tierstore:///data/train/x.jpg")` reads through it.

Listing and metadata go to the local view of the source (a POSIX mount); reads of files under the source
are served by the cache. Writes go through write-back staging under a `[[writeback]]` destination
(`tierstore.writeback`), and are refused elsewhere: the cache serves reads only.

    import fsspec
    fs = fsspec.filesystem("tierstore", source="/lustre/data", tiers=["/dev/shm/ts:32G"])
    with fs.open("/lustre/data/train/0001.npy") as f: ...

Objects of an S3 bucket are read through the cache by chaining, as fsspec users write it for its own
caches (`simplecache::s3://...`); the `s3` options are s3fs's (key, secret, token, endpoint_url,
client_kwargs) and the `tierstore` ones a `tierstore.Cache`'s:

    with fsspec.open("tierstore::s3://bucket/train/0001.npy", s3={"endpoint_url": "http://..."},
                     tierstore={"tiers": ["/dev/shm/ts:32G"]}) as f: ...
"""

from __future__ import annotations

import os
from typing import Any

from fsspec.implementations.chained import ChainedFileSystem
from fsspec.implementations.local import LocalFileSystem

from tierstore.cache import Cache, default_cache


class TierstoreFileSystem(LocalFileSystem, ChainedFileSystem):
    """fsspec filesystem whose reads come from a tierstore cache.

    Args:
        cache: An existing cache; otherwise one is built from the other arguments (see `tierstore.Cache`),
            or the default cache is used when there are none.
    """

    protocol = "tierstore"
    root_marker = "/"

    def __init__(
        self,
        cache: Cache | None = None,
        target_protocol: str | None = None,
        target_options: dict[str, Any] | None = None,
        fo: str | None = None,
        **cache_args: Any,
    ) -> None:
        super().__init__()
        del fo  # the chained path; each open names its own
        # Chained over s3:// (`tierstore::s3://bucket/key`): one cache per bucket, made on first use.
        self.target = target_protocol
        if target_protocol not in (None, "file", "local", "s3", "s3a"):
            raise ValueError(
                f"tierstore:: chains over s3:// only, not {target_protocol}://; for files on a mount use "
                "tierstore:///path"
            )
        self.s3 = _s3_settings(target_options or {})
        self.cache_args = cache_args
        self.buckets: dict[str, Cache] = {}
        if self.target in ("s3", "s3a"):
            # Paths are bucket/key, not local paths to make absolute.
            self._strip_protocol = _strip_s3  # type: ignore[method-assign]
        if cache is None and self.target not in ("s3", "s3a") and cache_args:
            cache = Cache(**cache_args)
        # The default cache is made on the first read it serves: writes under a [[writeback]]
        # destination need no source configured.
        self.cache = cache

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        if path.startswith("tierstore://"):
            path = path[len("tierstore://") :]
        if "://" in path or not path:
            return path
        return LocalFileSystem._strip_protocol(path)

    def _cache_of(self, path: str) -> tuple[Cache, str]:
        """The cache that serves `path`, and the name to open in it."""
        if self.target not in ("s3", "s3a"):
            if self.cache is None:
                self.cache = default_cache()
            return self.cache, path
        url = path if "://" in path else f"s3://{path.lstrip('/')}"
        url = "s3://" + url.split("://", 1)[1]
        if self.cache is not None:
            return self.cache, url
        bucket = url[len("s3://") :].split("/", 1)[0]
        if bucket not in self.buckets:
            args = dict(self.cache_args)
            args["s3"] = {**self.s3, **(args.get("s3") or {})}
            self.buckets[bucket] = Cache(source=f"s3://{bucket}", **args)
        return self.buckets[bucket], url

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        local = self.target not in ("s3", "s3a") and "://" not in str(self._strip_protocol(path))
        if local and _writeback_destination(self._strip_protocol(path)):
            # Under a [[writeback]] destination: writes go through the node's stage, reads see staged
            # files (this node's, or another node's) until they are on the store.
            from tierstore import writeback

            p = self._strip_protocol(path)
            return writeback.open(p, mode) if mode != "rb" else writeback.open_read(p, mode)
        if mode != "rb":
            raise ValueError(
                f"tierstore:// serves reads only outside a [[writeback]] destination (mode {mode!r} for "
                f"{path}); configure one for it, or write with the local path"
            )
        cache, name = self._cache_of(self._strip_protocol(path))
        return cache.open(name)

    def mv(self, path1: Any, path2: Any, recursive: bool = True, **kwargs: Any) -> None:
        p1, p2 = self._strip_protocol(path1), self._strip_protocol(path2)
        if _writeback_destination(p2):
            # A staged file moves in the journal; a commit-by-rename (torch.distributed.checkpoint's
            # `.metadata.tmp`) reaches the store after the files closed before it.
            from tierstore import writeback

            writeback.rename(p1, p2)
            return
        super().mv(path1, path2, recursive=recursive, **kwargs)

    def rm_file(self, path: Any) -> None:
        p = self._strip_protocol(path)
        if _writeback_destination(p):
            from tierstore import writeback

            writeback.remove(p)
            return
        super().rm_file(path)

    def exists(self, path: Any, **kwargs: Any) -> bool:
        p = self._strip_protocol(path)
        if _writeback_destination(p):
            from tierstore import writeback

            if writeback._writeback().lookup(os.path.abspath(p)) is not None:
                return True
        return bool(super().exists(path, **kwargs))

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        if self.target not in ("s3", "s3a") and "://" not in str(path):
            return super().ls(path, detail=detail, **kwargs)
        cache, name = self._cache_of(self._strip_protocol(path))
        names = cache._core.list_files(name)
        return [{"name": n, "type": "file"} for n in names] if detail else names


def _writeback_destination(path: str) -> bool:
    """Whether `path` is under a configured `[[writeback]]` destination."""
    from tierstore import writeback

    return writeback.configured() and writeback.destination(path) is not None


def _strip_s3(path: Any) -> str:
    path = str(path).removeprefix("tierstore://")
    return path.split("://", 1)[1] if "://" in path else path.lstrip("/")


def _s3_settings(options: dict[str, Any]) -> dict[str, str]:
    """s3fs's options (key, secret, token, endpoint_url, client_kwargs) as `tierstore.Cache`'s `s3=`."""
    client = options.get("client_kwargs") or {}
    pairs = {
        "access_key_id": options.get("key") or client.get("aws_access_key_id"),
        "secret_access_key": options.get("secret") or client.get("aws_secret_access_key"),
        "session_token": options.get("token") or client.get("aws_session_token"),
        "endpoint": options.get("endpoint_url") or client.get("endpoint_url"),
        "region": client.get("region_name"),
        "profile": options.get("profile"),
    }
    return {k: str(v) for k, v in pairs.items() if v}
