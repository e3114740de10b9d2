"""An fsspec filesystem over the cache: `fsspec.open("tierstore:///data/train/x.jpg")` reads through it.

Listing and metadata go to the local view of the source (a POSIX mount); reads of files under the source
are served by the cache. Writes go through write-back staging under a `[[writeback]]` destination
(`tierstore.writeback`), and are refused elsewhere: the cache serves reads only. Under a destination,
listings, metadata, reads and copies see the files staged on this node and not yet on the store, and
`rm` removes them from the stage too, so that they do not reach the store afterwards.

    import fsspec
    fs = fsspec.filesystem("tierstore", source="/lustre/data", tiers=["/dev/shm/ts:50%"])
    with fs.open("/lustre/data/train/0001.npy") as f: ...

Objects of every store the engine reads are read through the cache by chaining, as fsspec users write it
for its own caches (`simplecache::gs://...`): `tierstore::s3://` (or `s3a`), `tierstore::gs://` (or
`gcs`), `tierstore::az://` (or `abfs`, `abfss`) and `tierstore::http(s)://` (a WebDAV server). One cache
is made per bucket, container or server, on first use; the `tierstore` options are a `tierstore.Cache`'s,
and the target's options are its fsspec implementation's, translated into the store's settings where
they have an equivalent: s3fs's `key`, `secret`, `token`, `endpoint_url`, `client_kwargs`, `profile`,
`anon`, `requester_pays`; gcsfs's `token` (a key file, a key as a dict, "anon") and `endpoint_url`;
adlfs's `account_name`, `account_key`, `sas_token`, `connection_string`, `client_id`, `client_secret`,
`tenant_id`, `anon`, `account_host`; none of HTTP's. An option without one is refused, naming it: give
the store's own settings as `tierstore={"object_store": {...}}` instead.

    with fsspec.open("tierstore::gs://bucket/train/0001.npy", gs={"token": "/etc/gcs/reader.json"},
                     tierstore={"tiers": ["/dev/shm/ts:50%"]}) as f: ...

fsspec resolves a chain by importing every protocol's own filesystem class, so `tierstore::gs://` needs
gcsfs installed and `tierstore::az://` adlfs (which also registers `abfss`), though neither is used to
read; `http(s)` is fsspec's own (with aiohttp). The S3, GCS and HTTP chains are tested against real
servers; no Azure one is (no Azure Blob server installs here: docs/guide/object-stores.md), so only the
translation of adlfs's options is.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from typing import Any

from fsspec.callbacks import DEFAULT_CALLBACK
from fsspec.implementations.chained import ChainedFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem

from tierstore import writeback
from tierstore._fsspec_stores import chained_store
from tierstore.cache import Cache, default_cache


class TierstoreFileSystem(LocalFileSystem, ChainedFileSystem):
    """fsspec filesystem whose reads come from a tierstore cache.

    Under a `[[writeback]]` destination it shows what a program of the node sees: a file written and not
    yet on the store is listed, sized, read, copied and removed as the `file` filesystem does with files
    on disk, and a file removed stays removed once the stage has drained.

    Args:
        cache: An existing cache; otherwise one is built from the other arguments (see `tierstore.Cache`),
            or the default cache is used when there are none.
        target_protocol: The store a chain reads (`tierstore::gs://...` sets it): s3, s3a, gs, gcs, az,
            abfs, abfss, http or https. Its caches are then made from the other arguments, one per
            bucket, container or server.
        target_options: The target's options, its fsspec implementation's, translated into the store's
            settings (see the module's docstring).
        fo: The path a chain opened first; unused, as each open names its own.
        auto_mkdir: Whether a write creates the directories it needs (as for fsspec's `file` filesystem).

    Attributes:
        caches: The caches made so far for a chained store, by source URL ("gs://bucket",
            "http://host:port"): their `stats()` tell what the store was asked.

    Raises:
        ValueError: A target protocol of no store tierstore reads, or an option of the target that has no
            equivalent in the store's settings; the message says what to write instead.
    """

    protocol = "tierstore"
    root_marker = "/"
    # A chain hands the path it opens as `fo`; left out of the instance's token (as fsspec's own caches
    # leave it), every path of a chain with the same options gets the same filesystem, and so the same
    # cache per bucket, rather than a new one per file opened.
    _strip_tokenize_options = ("fo",)

    def __init__(
        self,
        cache: Cache | None = None,
        target_protocol: str | None = None,
        target_options: dict[str, Any] | None = None,
        fo: str | None = None,
        auto_mkdir: bool = False,
        **cache_args: Any,
    ) -> None:
        super().__init__(auto_mkdir=auto_mkdir)
        del fo  # the chained path; each open names its own
        # Chained over an object store (`tierstore::gs://bucket/key`): one cache per bucket, container or
        # server, made on first use, with the target's options translated into the store's settings.
        self.target = target_protocol
        self.store = chained_store(target_protocol)
        self.store_settings = (
            {} if self.store is None else self.store.settings(str(target_protocol), target_options or {})
        )
        self.cache_args = cache_args
        self.caches: dict[str, Cache] = {}
        if self.store is not None:
            # Paths are as the target's implementation strips them (bucket/key, or a whole http URL), not
            # local paths to make absolute.
            self._strip_protocol = self.store.strip  # type: ignore[method-assign]
        if cache is None and self.store is None and cache_args:
            cache = Cache(**cache_args)
        # The default cache is made on the first read it serves: writes under a [[writeback]]
        # destination need no source configured.
        self.cache = cache

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        if type(path) is not str:  # a str, what a data loader opens per sample, takes no call here
            path = str(path.path if isinstance(path, os.DirEntry) else path)
        if path.startswith("tierstore://"):
            path = path[len("tierstore://") :]
        if "://" in path or not path:
            return path
        if path[0] == "/" and path[-1] != "/":
            return path  # what LocalFileSystem makes of an absolute path, without its ~3 µs per open
        return LocalFileSystem._strip_protocol(path)

    def _objects(self, path: str) -> bool:
        """Whether `path` (protocol stripped) names objects of a store rather than files of a mount."""
        return self.store is not None or "://" in path

    def _staging(self, path: str) -> bool:
        """Whether `path` (protocol stripped) is under a `[[writeback]]` destination: its files may be
        staged on this node and not on the store yet."""
        return not self._objects(path) and writeback.destination(path) is not None

    def _staged_info(self, path: str) -> dict[str, Any] | None:
        """`info` of the staged copy of `path` (protocol stripped, under a destination), named `path`;
        None once the file is on the store, or when it was never staged."""
        from tierstore import writeback

        copy = writeback._writeback().lookup(path)
        if copy is None:
            return None
        try:
            out: dict[str, Any] = super().info(copy)
        except FileNotFoundError:
            return None  # migrated meanwhile: the store has it
        out["name"] = path
        return out

    def _cache_of(self, path: str) -> tuple[Cache, str]:
        """The cache that serves `path`, and the name to open in it."""
        if self.store is None:
            if self.cache is None:
                self.cache = default_cache()
            return self.cache, path
        url = self.store.url(path, str(self.target))
        if self.cache is not None:
            return self.cache, url
        scheme, rest = url.split("://", 1)
        source = f"{scheme}://{rest.split('/', 1)[0]}"  # the bucket, container or server
        if source not in self.caches:
            args = dict(self.cache_args)
            # The cache's own settings of the store, if given, over those translated from the target's.
            settings = {**self.store_settings, **(args.get(self.store.keyword) or {})}
            if settings:
                args[self.store.keyword] = settings
            self.caches[source] = Cache(source=source, **args)
        return self.caches[source], url

    def open(
        self,
        path: Any,
        mode: str = "rb",
        block_size: int | None = None,
        cache_options: dict[str, Any] | None = None,
        compression: str | None = None,
        **kwargs: Any,
    ) -> Any:
        # A plain read, the call a data loader makes per sample: straight to `_open`, without the steps
        # of fsspec's `open` that only text, compression or a write's transaction need (~2 us an open).
        if mode == "rb" and compression is None and not kwargs:
            if (
                self.store is None
                and self.cache is not None
                and type(path) is str
                and path[:1] == "/"
                and path[-1:] != "/"
                and "://" not in path
                and writeback.destination(path) is None
            ):
                # An absolute path of the mount, outside every [[writeback]] destination: what `_open`
                # opens once its steps (strip, staging, which cache) find nothing to do. Their calls were
                # half of what fsspec added to `Cache.open` (0.5 of 1.1 us, timeit).
                return self.cache.open(path)
            return self._open(path, mode)  # which strips the path, once
        return super().open(path, mode, block_size, cache_options, compression, **kwargs)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        p = self._strip_protocol(path)
        if self._staging(p):
            # Under a [[writeback]] destination: writes go through the node's stage, reads see staged
            # files (this node's, or another node's) until they are on the store.
            from tierstore import writeback

            if mode == "rb":
                return writeback.open_read(p, mode)
            if self.auto_mkdir:
                self.makedirs(self._parent(p), exist_ok=True)
            return writeback.open(p, mode)
        if mode != "rb":
            raise ValueError(
                f"tierstore:// serves reads only outside a [[writeback]] destination (mode {mode!r} for "
                f"{path}); configure one for it, or write with the local path"
            )
        cache, name = self._cache_of(p)
        return cache.open(name)

    def info(self, path: Any, **kwargs: Any) -> dict[str, Any]:
        # An entry of a listing is the store's: `ls` puts the staged files' details in itself, so that a
        # listing of the source costs no look at the journal per entry.
        if not isinstance(path, os.DirEntry):
            p = self._strip_protocol(path)
            staged = self._staged_info(p) if self._staging(p) else None
            if staged is not None:
                return staged
        out: dict[str, Any] = super().info(path, **kwargs)
        return out

    def exists(self, path: Any, **kwargs: Any) -> bool:
        p = self._strip_protocol(path)
        if self._staging(p):
            return self._staged_info(p) is not None or os.path.exists(p)
        return bool(super().exists(path, **kwargs))

    def lexists(self, path: Any, **kwargs: Any) -> bool:
        p = self._strip_protocol(path)
        if self._staging(p) and self._staged_info(p) is not None:
            return True
        return bool(super().lexists(p, **kwargs))

    def isfile(self, path: Any) -> bool:
        p = self._strip_protocol(path)
        if self._staging(p) and self._staged_info(p) is not None:
            return True
        return bool(super().isfile(p))

    def isdir(self, path: Any) -> bool:
        p = self._strip_protocol(path)
        if self._staging(p) and self._staged_info(p) is not None:
            return False
        return bool(super().isdir(p))

    def ls(self, path: Any, detail: bool = True, **kwargs: Any) -> Any:
        p = self._strip_protocol(path)
        if self._objects(p):
            cache, name = self._cache_of(p)
            names = cache._core.list_files(name)
            return [{"name": n, "type": "file"} for n in names] if detail else names
        if not self._staging(p):
            return super().ls(p, detail=detail, **kwargs)
        from tierstore import writeback

        # The journal before the store: a file migrated in between is then listed by the store.
        staged = dict(writeback.staged_in(p)) if super().isdir(p) else {}
        infos = []
        for info in super().ls(p, detail=True, **kwargs):
            name = info["name"].rsplit("/", 1)[-1]
            if writeback.migrating(name):
                continue
            if staged.pop(name, None) is not None:
                # An older copy is on the store: listed once, with the staged copy's details.
                info = self._staged_info(info["name"]) or info
            infos.append(info)
        for name in staged:
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                infos.append(self.info(f"{p.rstrip('/')}/{name}"))
        return infos if detail else [i["name"] for i in infos]

    def cat_file(self, path: Any, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        # Through `open`, so through the cache or the stage; `start` and `end` as in a slice of the bytes.
        with self.open(path, "rb", **kwargs) as f:
            size = f.seek(0, os.SEEK_END)
            first, stop, _ = slice(start, end).indices(size)
            f.seek(first)
            out: bytes = f.read(max(0, stop - first))
            return out

    def get_file(self, rpath: Any, lpath: Any, callback: Any = DEFAULT_CALLBACK, **kwargs: Any) -> None:
        # fsspec's: the bytes come through `open` (the cache, or the staged copy), where the `file`
        # filesystem copies the path itself.
        AbstractFileSystem.get_file(self, rpath, lpath, callback=callback, **kwargs)

    def put_file(
        self, lpath: Any, rpath: Any, callback: Any = DEFAULT_CALLBACK, mode: str = "overwrite", **kwargs: Any
    ) -> None:
        r = self._strip_protocol(rpath)
        if not self._staging(r):
            return super().put_file(lpath, rpath, callback=callback, mode=mode, **kwargs)
        if os.path.isdir(lpath):
            self.makedirs(r, exist_ok=True)
            return None
        if self.auto_mkdir:
            self.makedirs(self._parent(r), exist_ok=True)
        callback.set_size(os.path.getsize(lpath))
        # Written through `open`, so staged; "xb" refuses a name taken, staged or on the store.
        with open(lpath, "rb") as src, self.open(r, "xb" if mode == "create" else "wb") as dst:
            while chunk := src.read(self.blocksize):
                dst.write(chunk)
                callback.relative_update(len(chunk))
        return None

    def cp_file(self, path1: Any, path2: Any, **kwargs: Any) -> None:
        """Copies `path1` to `path2`; under a destination, the copy is staged and the source read from its
        staged copy while it has one.

        Raises:
            FileNotFoundError: `path1` is neither a file nor a directory (staged or on the store).
            ValueError: `path1` is under a destination and `path2` is not: tierstore:// writes only under
                a destination (copy out with `get`).
        """
        p1, p2 = self._strip_protocol(path1), self._strip_protocol(path2)
        if not self._staging(p1) and not self._staging(p2):
            return super().cp_file(p1, p2, **kwargs)
        if self.isfile(p1):
            if self.auto_mkdir:
                self.makedirs(self._parent(p2), exist_ok=True)
            with self.open(p1, "rb") as src, self.open(p2, "wb") as dst:
                shutil.copyfileobj(src, dst)
        elif self.isdir(p1):
            self.makedirs(p2, exist_ok=True)
        else:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory (staged or on the store)", p1)
        return None

    def pipe_file(self, path: Any, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        # "xb" rather than fsspec's look first: the stage refuses a name taken, staged or on the store,
        # and the error names the file.
        with self.open(path, "xb" if mode == "create" else "wb", **kwargs) as f:
            f.write(value)

    def touch(self, path: Any, truncate: bool = True, **kwargs: Any) -> None:
        p = self._strip_protocol(path)
        if not self._staging(p):
            return super().touch(p, truncate=truncate, **kwargs)
        if truncate or not self.exists(p):
            with self.open(p, "wb"):
                pass  # an empty file, staged as any other write
            return None
        from tierstore import writeback

        # A staged file's times are its staged copy's (the journal checks bytes, not times).
        copy = writeback._writeback().lookup(p)
        try:
            os.utime(copy or p)
        except FileNotFoundError:
            if copy is None:
                raise
            os.utime(p)  # on the store meanwhile
        return None

    def mv(self, path1: Any, path2: Any, recursive: bool = True, **kwargs: Any) -> None:
        p1, p2 = self._strip_protocol(path1), self._strip_protocol(path2)
        if self._staging(p1) and not self._staging(p2):
            from tierstore import writeback

            # Out of the destination: what is staged under `path1` reaches the store first, so that the
            # store's copy moves, not an older one, and nothing staged lands at `path1` afterwards.
            writeback.sync(p1)
        elif self._staging(p2):
            # A staged file moves in the journal; a commit-by-rename (torch.distributed.checkpoint's
            # `.metadata.tmp`) reaches the store after the files closed before it.
            from tierstore import writeback

            if self.auto_mkdir:
                self.makedirs(self._parent(p2), exist_ok=True)
            writeback.rename(p1, p2)
            return
        super().mv(path1, path2, recursive=recursive, **kwargs)

    def rm_file(self, path: Any) -> None:
        p = self._strip_protocol(path)
        if self._staging(p):
            from tierstore import writeback

            writeback.remove(p)
            return
        super().rm_file(path)

    def rmdir(self, path: Any) -> None:
        p = self._strip_protocol(path)
        if self._staging(p):
            from tierstore import writeback

            writeback.rmdir(p)
            return
        super().rmdir(p)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        for one in path if isinstance(path, list) else [path]:
            p = self._strip_protocol(one)
            if not self._staging(p):
                super().rm(p, recursive=recursive, maxdepth=maxdepth)
            elif super().isdir(p) and not self.islink(p):
                if not recursive:
                    raise ValueError(f"Cannot delete directory {p}: set recursive=True")
                if os.path.abspath(p) == os.getcwd():
                    raise ValueError(f"Cannot delete the current working directory {p}")
                from tierstore import writeback

                # The files staged under it go too: migrated afterwards, they would bring it back.
                writeback.rmtree(p)
            else:
                self.rm_file(p)
