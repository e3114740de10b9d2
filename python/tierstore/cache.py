"""The Python face of the cache: `tierstore.Cache` and the module-level helpers on a default cache."""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

from tierstore import _core
from tierstore._after_import import when_imported
from tierstore._file import CachedFile
from tierstore.learned_order import opened as _opened

if TYPE_CHECKING:
    from tierstore.order import OrderPrefetch
    from tierstore.types import CacheConfig, CacheStats, ClusterConfig, PrefetchProgress, Setting

PathLike = str | bytes | os.PathLike[str] | os.PathLike[bytes]
TierSpec = str | PathLike | tuple[PathLike, int | str | None] | Mapping[str, Any]


def _tier(spec: TierSpec) -> tuple[Any, int | str | None]:
    """Normalizes one tier given as "PATH[:QUOTA]", (path, quota), {"path": ..., "quota": ...} or a path."""
    if isinstance(spec, Mapping):
        if "path" not in spec:
            raise _core.ConfigError(f"tier {dict(spec)!r} has no 'path'; give {{'path': DIR, 'quota': '8G'}}")
        return spec["path"], spec.get("quota")
    if isinstance(spec, tuple):
        if len(spec) != 2:
            raise _core.ConfigError(f"tier {spec!r} is not (path, quota); give ('/dev/shm/tierstore', '8G')")
        return spec[0], spec[1]
    if isinstance(spec, str) and ":" in spec:
        path, _, quota = spec.rpartition(":")
        if "/" not in quota:  # "PATH:QUOTA"; a bad quota is reported by the configuration check
            return path, quota
    return spec, None


class Cache:
    """A tiered, node-local cache in front of one source: a directory, or a prefix of an object store (S3 or
    an S3-compatible server, Google Cloud Storage, Azure Blob Storage, or an HTTP server with WebDAV).

    Args:
        source: The directory on the shared store to cache, or an object store prefix
            ("s3://bucket/prefix", "gs://bucket/prefix", "az://container/prefix",
            "https://host/prefix"). Overrides `source` of the config file and `$TIERSTORE_SOURCE`.
        tiers: Cache tiers, fastest first: "PATH:QUOTA" strings, (path, quota) pairs or
            {"path": ..., "quota": ...} mappings. A quota is a size ("64G", "512MiB", "50000B"), a
            number of bytes (1 MiB at least: a smaller one is taken for a forgotten unit) or a share of
            the tier's file system ("50%"); leave it out to use half of the free space.
        policy: "fill" (fill tiers in order, never evict: the default, right for datasets read every
            epoch), "lru", "lfu" or "fifo".
        threads: Threads of the background copy pool.
        inline_max: Files up to this size are read whole on a miss and handed to the reader at once.
        verify: "metadata" (size and mtime of the copy, free) or "checksum" (blake3 of every copy opened).
        revalidate: A duration, "60s" by default (a copy confirmed within it is used as it is; older copies
            are confirmed a directory at a time, so a change on the source is seen within the duration),
            "always" (one `stat` or HEAD of the source per open of a cached file: never stale), or
            "never" (a read-only dataset: after the first epoch nothing at all is asked of the source).
        config: A TOML file to read instead of `$TIERSTORE_CONFIG` or `./tierstore.toml`.
        object_store: Settings of an object store source, over the config file's `[object_store]` table
            and the store's environment (AWS_*, GOOGLE_*, AZURE_*): tierstore's "timeout",
            "connect_timeout", "retries", "range_size", "ranges_in_flight", and any option key of the
            `object_store` crate for the store ("aws_region", "google_service_account",
            "azure_storage_account_name", "allow_http", ...). An S3 source also takes the short names
            "endpoint", "region", "profile", "access_key_id", "secret_access_key", "session_token".
        s3: The older name of `object_store`, still accepted.
        start_agent: With `[cluster] sharing` on, start this node's agent if none runs (the default):
            the node's files must be served to its peers while the job reads. False for a cache that
            only inspects (`tierstore status`, `config show`).

    Raises:
        ConfigError: A value is invalid; the message names the key, the value, where it came from and the fix.
    """

    def __init__(
        self,
        source: PathLike | None = None,
        tiers: Sequence[TierSpec] | None = None,
        *,
        policy: str | None = None,
        threads: int | None = None,
        inline_max: int | str | None = None,
        verify: str | None = None,
        revalidate: str | None = None,
        config: PathLike | None = None,
        s3: Mapping[str, Any] | None = None,
        object_store: Mapping[str, Any] | None = None,
        start_agent: bool = True,
    ) -> None:
        if isinstance(tiers, (str, bytes, os.PathLike)):
            # A string is a sequence too: its characters would each be taken for a tier.
            raise _core.ConfigError(
                f"tiers={tiers!r} is one tier, not a list of them; give tiers=[{os.fsdecode(tiers)!r}]"
            )
        # The keywords of one value each (source, policy, threads, ...), by the settings table: the engine
        # reads each by its type and key, so a new one is its table entry, its parameter and its use.
        given = locals()
        values = {k: given[k] for k in _core.VALUE_KEYWORDS if given[k] is not None}
        # Kept to rebuild the cache in a spawned worker (see __reduce__); a forked one inherits it.
        self._args = (
            source,
            tiers,
            {
                **{k: v for k, v in values.items() if k != "source"},
                "config": config,
                "s3": None if s3 is None else dict(s3),
                "object_store": None if object_store is None else dict(object_store),
            },
        )
        self._core = _core.Cache(**_core_arguments(tiers, values, config, s3, object_store))
        _live.add(self)
        cluster = self._sharing()
        if start_agent and cluster is not None:
            from tierstore import agent

            # The node's files must be served to its peers while the job runs.
            agent.ensure(cluster, env=_agent_env(self._args))

    def _sharing(self) -> ClusterConfig | None:
        """The `[cluster]` table when this cache is shared with other nodes (the node's agent must run to
        serve them), else None."""
        cluster = self._core.config().get("cluster")
        if cluster is None or cluster[0].get("sharing", "off") == "off":
            return None
        return cluster[0]

    def __reduce__(self) -> tuple[Any, ...]:
        # A spawned DataLoader worker gets the same configuration and opens the same node-wide cache.
        source, tiers, kwargs = self._args
        return (_rebuild, (source, tiers, kwargs))

    @property
    def source(self) -> str:
        """The source: a directory, or an object store URL ("s3://bucket/prefix", "gs://...", ...)."""
        return self._core.source

    def open(
        self, path: PathLike, mode: str = "rb", *, encoding: str | None = None
    ) -> CachedFile | io.TextIOWrapper:
        """Opens a file under the source for reading through the cache.

        Args:
            path: A file under the source: a path (absolute, or relative to the current directory); for an
                object store, "s3://bucket/prefix/key" or a key relative to the prefix.
            mode: "rb" for a binary file (`CachedFile`), "r" for text decoded with `encoding`.
            encoding: Text encoding for mode "r".

        Returns:
            A binary file object, or a text wrapper around one.

        Raises:
            OutsideSourceError: The path is not under the source.
            FileNotFoundError, PermissionError, IsADirectoryError: As `open()` raises them.
            ValueError: A mode that writes.
        """
        if mode != "rb" and mode not in ("br", "r", "rt", "tr"):
            raise ValueError(
                f"tierstore.open({os.fsdecode(path)!r}, mode={mode!r}): the cache serves reads only; "
                "use mode 'rb' or 'r', and open files you write with the built-in open()"
            )
        raw = self._core.open(path)
        learning = _opened.paths
        if learning is not None:  # a DataLoader worker learning its samples' files (learned_order)
            learning.append(self._absolute(raw.name))
        if "b" in mode:
            return raw
        return io.TextIOWrapper(io.BufferedReader(raw), encoding=encoding)

    def _absolute(self, name: str) -> str:
        """`name` as `open` took it, spelled as the source's paths are: absolute, or a full object URL."""
        if "://" in name:
            return name
        source = self.source
        if "://" in source:
            return source.rstrip("/") + "/" + name.lstrip("/")
        return os.path.abspath(name)

    def lookup(self, path: PathLike, *, validate: bool = True) -> str | None:
        """The path of a current cached copy of `path`, or None if no tier holds one.

        Args:
            path: A file under the source.
            validate: Check the copy against the source's current version (one `stat` of the source).
        """
        return self._core.lookup(path, validate)

    def prefetch(
        self,
        paths: PathLike | Iterable[PathLike],
        *,
        progress: bool | None = None,
        wait: bool = True,
        jobs: int | None = None,
    ) -> PrefetchProgress:
        """Warms the cache with files and directories (walked recursively), many at a time.

        Directories are listed concurrently and up to `jobs` files are fetched at once, so a store's
        latency is paid in parallel. A file the cache already holds costs the store nothing when
        `revalidate="never"` (it is confirmed from the index) and one `stat` with "always". A file that
        fails is reported and the others still land.

        Args:
            paths: Files or directories under the source.
            progress: Show files, bytes and rate on stderr; by default only on a terminal.
            wait: Wait until every file is cached. With False, returns at once with the counts so far.
            jobs: Files (and directory listings) in flight at once, 1 to 1024; default 32.

        Returns:
            Counts (`tierstore.types.PrefetchProgress`): files_total, files_done, files_copied,
            files_failed, files_no_room (0 here: no size is expected), bytes_total, bytes_done, first_error
            (None if none) and errors (every problem, up to 1000, each naming its file).

        Raises:
            ValueError: `jobs` is not a whole number from 1 to 1024.
            OutsideSourceError, FileNotFoundError: A path named is outside the source or missing.
        """
        check_jobs(jobs)
        if isinstance(paths, (str, bytes, os.PathLike)):
            paths = [paths]
        handle = self._core.prefetch(list(paths), jobs)
        if not wait:
            return handle.progress()
        if progress is None:
            progress = sys.stderr.isatty()
        if progress:
            _show_progress(handle)
        else:
            while not handle.done:
                time.sleep(0.02)
        self._core.wait_idle()
        return handle.progress()

    def prefetch_order(
        self,
        paths: Sequence[PathLike],
        *,
        budget: int | str = "2G",
        jobs: int | None = None,
    ) -> OrderPrefetch:
        """Fetches files in the order they will be read, ahead of the readers, within a byte budget.

        Up to `jobs` files are fetched at once, in the order given, while the bytes fetched and not yet
        read stay within `budget` (a single file larger than the budget is fetched alone). Readers record
        what they have read on the handle (`mark_read`, `advance`) or, from other processes, in its
        read-marks file (`tierstore.order.ReadMarker`); a file read before the prefetch reached it is
        skipped. Reads of a file being prefetched wait for that one fetch, never a second one.
        `tierstore.torch.prefetching` wires this to a DataLoader's sampler.

        Args:
            paths: Files under the source, in reading order (a path may come more than once).
            budget: Bytes fetched ahead of the readers at most: a size like "2G" or a number of bytes.
            jobs: Files fetched at once, 1 to 1024; default 32.

        Returns:
            The running prefetch; it stops when the handle is stopped or dropped.

        Raises:
            ValueError: `budget` is not a size, or `jobs` is out of range.
            OutsideSourceError: A path is not under the source (nothing is started).
        """
        from tierstore.order import OrderPrefetch, parse_budget

        n = parse_budget(budget)
        check_jobs(jobs)
        return OrderPrefetch(self._core.prefetch_order(list(paths), n, jobs))

    def stats(self) -> CacheStats:
        """Every counter, node-wide: `source` (opens, stats, reads, bytes_read, fallbacks, uncached) and
        `tiers` (hits, misses, bytes_served, entries, bytes_used, evictions, faults, … per tier); every key
        is in `tierstore.types.CacheStats`."""
        return self._core.stats()

    def reset_counters(self) -> None:
        """Sets every counter to zero, for all processes of the node."""
        self._core.reset_counters()

    def wait(self) -> None:
        """Blocks until every background copy is published."""
        self._core.wait_idle()

    def clear(self) -> None:
        """Removes every cached copy of this source from every tier."""
        self._core.clear()

    def config(self) -> CacheConfig:
        """The effective configuration: {key: (value, where it came from)} (`tierstore.types.CacheConfig`)."""
        return self._core.config()

    def __repr__(self) -> str:
        return f"tierstore.Cache(source={self.source!r})"


# The settings a keyword of Cache and a variable both set, one value each, as (keyword, variable): handed
# to an agent as they are. `source`, `tiers`, `config` and the object store's table are handed over by
# _agent_env's own rules.
_ARGUMENT_VARIABLES = tuple(
    (s["argument"], s["env"])
    # The stub gives the rows as plain dicts (see _core.pyi); each is a Setting.
    for s in cast("tuple[Setting, ...]", _core.SETTINGS)
    if s["argument"] and s["env"] and s["type"] not in ("section", "json", "path")
)


def _agent_env(args: tuple[Any, Any, dict[str, Any]]) -> dict[str, str]:
    """The environment an agent started for this cache reads the same configuration from."""
    source, tiers, kwargs = args
    env = dict(os.environ)
    if source is not None:
        text = os.fsdecode(source)
        env["TIERSTORE_SOURCE"] = text if "://" in text else os.path.abspath(text)
    if tiers is not None:
        specs = [_tier(t) for t in tiers]
        env["TIERSTORE_TIERS"] = ",".join(
            os.path.abspath(os.fspath(p)) + (f":{q}" if q is not None else "") for p, q in specs
        )
    # Each other keyword of one value that a variable also sets (policy, threads, ...), as the settings
    # table pairs them.
    for keyword, variable in _ARGUMENT_VARIABLES:
        if kwargs.get(keyword) is not None:
            env[variable] = str(kwargs[keyword])
    if kwargs.get("config") is not None:
        env["TIERSTORE_CONFIG"] = os.path.abspath(os.fspath(kwargs["config"]))
    # The object store's settings given here, over any the environment gives (the agent reads them as a
    # JSON object, the values as the cache got them). The engine has checked that one already: this
    # cache was built from the same environment.
    store = {k: str(v) for table in ("s3", "object_store") for k, v in (kwargs.get(table) or {}).items()}
    if store:
        env["TIERSTORE_OBJECT_STORE"] = json.dumps(
            {**json.loads(env.get("TIERSTORE_OBJECT_STORE", "{}")), **store}
        )
    return env


def effective_config(
    source: PathLike | None = None,
    tiers: Sequence[TierSpec] | None = None,
    *,
    config: PathLike | None = None,
    s3: Mapping[str, Any] | None = None,
    object_store: Mapping[str, Any] | None = None,
    **values: Any,
) -> CacheConfig:
    """The configuration `Cache(source, tiers, ...)` would open with, as `{key: (value, origin)}`, without
    opening the cache: no store is asked, no credential printed, no job token made (`tierstore config show`)."""
    given = {"source": source, **values}
    settings = {k: v for k, v in given.items() if v is not None}
    return _core.effective_config(**_core_arguments(tiers, settings, config, s3, object_store))


def _core_arguments(
    tiers: Sequence[TierSpec] | None,
    values: dict[str, Any],
    config: PathLike | None,
    s3: Mapping[str, Any] | None,
    object_store: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The keywords of `_core.Cache` and `_core.effective_config` for `Cache`'s arguments."""
    return {
        "config_file": config,
        "tiers": None if tiers is None else [_tier(t) for t in tiers],
        "settings": values,
        "s3": None if s3 is None else {k: str(v) for k, v in s3.items()},
        "object_store": None if object_store is None else {k: str(v) for k, v in object_store.items()},
    }


def _rebuild(source: Any, tiers: Any, kwargs: dict[str, Any]) -> Cache:
    return Cache(source, tiers, **kwargs)


def check_jobs(jobs: object) -> None:
    """Raises ValueError unless `jobs` is None or a whole number of files to fetch at once (1 to 1024)."""
    if jobs is None:
        return
    if isinstance(jobs, bool) or not isinstance(jobs, int) or not 1 <= jobs <= _core.MAX_PREFETCH_JOBS:
        raise ValueError(
            f"prefetch jobs={jobs!r}: give the number of files to fetch at once, a whole number from 1 to "
            f"{_core.MAX_PREFETCH_JOBS} (default {_core.DEFAULT_PREFETCH_JOBS}; more hides more of a slow "
            "store's latency)"
        )


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.0f} B"


def _show_progress(handle: _core.Prefetch) -> None:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    # Files are the bar: their total is known as soon as the directories are listed, while sizes are
    # learnt file by file as each is opened.
    columns = (
        TextColumn("prefetch"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("files"),
        TextColumn("{task.fields[bytes]}"),
        TextColumn("{task.fields[rate]}"),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    start = time.monotonic()
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task("prefetch", total=None, bytes="0 B", rate="")
        while True:
            done = handle.done
            p = handle.progress()
            elapsed = max(time.monotonic() - start, 1e-3)
            bar.update(
                task,
                total=p["files_total"] or (1 if done else None),
                completed=p["files_done"] if p["files_total"] else (1 if done else 0),
                bytes=_human(p["bytes_done"]),
                rate=f"{_human(p['bytes_done'] / elapsed)}/s",
            )
            if done:
                break
            time.sleep(0.1)


# Copies still queued when a process exits must be published, or the next epoch reads the source again.
# multiprocessing children (DataLoader workers) leave through os._exit, which skips atexit and destructors
# but runs multiprocessing's own finalizers; a plain interpreter exit runs atexit.
_live: weakref.WeakSet[Cache] = weakref.WeakSet()


def _publish_pending_copies() -> None:
    for cache in list(_live):
        with contextlib.suppress(Exception):  # an exit hook must never turn a clean exit into a crash
            cache.wait()


class _ExitHook:
    """Registers the flush with multiprocessing (`util`, its module), again in every forked child (which
    clears the registry)."""

    def __init__(self, util: ModuleType) -> None:
        self.util = util

    def __call__(self, _: object = None) -> None:
        self.util.Finalize(None, _publish_pending_copies, exitpriority=10)


def _hook_multiprocessing(util: ModuleType) -> None:
    global _exit_hook
    _exit_hook = _ExitHook(util)
    _exit_hook()
    util.register_after_fork(_exit_hook, _ExitHook.__call__)


_exit_hook: _ExitHook | None = None  # held here: multiprocessing keeps only a weak reference to it
# A process has no multiprocessing children before it imports multiprocessing, whose import costs more than
# all of tierstore's own modules (38M instructions against 8M, callgrind): so the flush is registered with
# it as it is imported, not by importing it.
when_imported("multiprocessing.util", _hook_multiprocessing)
atexit.register(_publish_pending_copies)

_default: Cache | None = None
_default_pid = 0
_default_lock = threading.Lock()


def default_cache() -> Cache:
    """The cache the module-level helpers use, configured from `tierstore.toml` and `TIERSTORE_*`
    variables on first use (or by `configure`)."""
    global _default, _default_pid
    with _default_lock:
        if _default is None:
            _default = Cache()
            _default_pid = os.getpid()
        return _default


def configure(
    source: PathLike | None = None, tiers: Sequence[TierSpec] | None = None, **kwargs: Any
) -> Cache:
    """Replaces the default cache with one built from these arguments (see `Cache`)."""
    global _default
    cache = Cache(source, tiers, **kwargs)
    with _default_lock:
        _default = cache
    return cache


def open(path: PathLike, mode: str = "rb", *, encoding: str | None = None) -> Any:
    """Opens a file through the default cache (see `Cache.open`). Under a `[[writeback]]` destination, a
    write goes to the node's stage and reaches the store in the background, and a read of a file written
    there and not yet on the store reads the staged copy (see `tierstore.writeback`)."""
    from tierstore import writeback

    if any(c in mode for c in "wxa+"):
        return writeback.open(os.fsdecode(path), mode, encoding=encoding)
    if writeback.configured() and writeback.destination(os.fsdecode(path)) is not None:
        return writeback.open_read(os.fsdecode(path), mode, encoding=encoding)
    return default_cache().open(path, mode, encoding=encoding)


def prefetch(
    paths: PathLike | Iterable[PathLike],
    *,
    progress: bool | None = None,
    wait: bool = True,
    jobs: int | None = None,
) -> PrefetchProgress:
    """Warms the default cache (see `Cache.prefetch`)."""
    return default_cache().prefetch(paths, progress=progress, wait=wait, jobs=jobs)


def stats() -> CacheStats:
    """Counters of the default cache (see `Cache.stats`)."""
    return default_cache().stats()
