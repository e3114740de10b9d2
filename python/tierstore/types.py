"""The shapes of the dicts tierstore's engine hands to Python: `Cache.stats()`, `Cache.config()`, a
prefetch's counts, write-back's destinations and what waits in them, the settings table, and the manifests
of model versions (a repository's and a stream's).

Each is a `TypedDict`, so code that reads them can be type-checked; annotate with them:

    from tierstore.types import CacheStats

    def hit_rate(stats: CacheStats) -> float:
        tier = stats["tiers"][0]
        return tier["hits"] / max(1, tier["hits"] + tier["misses"])

The dicts are built in Rust (`crates/tierstore-py/src/lib.rs` and `writeback.rs`);
`tests/cache/test_types.py` checks each one returned at runtime against its type here, key for key. The
manifests are JSON whose one schema is `crates/tierstore-core/src/models/manifest.rs`;
`tests/models/test_manifest_types.py` checks a saved one and a published one.
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias, TypedDict, TypeVar

__all__ = [
    "CacheConfig",
    "CacheStats",
    "ClusterConfig",
    "ClusterOrigins",
    "ManifestTensor",
    "OrderProgress",
    "PrefetchProgress",
    "RepositoryManifest",
    "Setting",
    "SourceStats",
    "Sourced",
    "StoredTensor",
    "StreamManifest",
    "TierConfig",
    "TierKind",
    "TierStats",
    "WritebackDestination",
    "WritebackPending",
]

_T = TypeVar("_T")

TierKind: TypeAlias = Literal["memory", "local"]


class Setting(TypedDict):
    """One entry of `_core.SETTINGS`: a setting as `crates/tierstore-core/src/config/settings.rs` declares
    it, from which the keywords, variables, options and reference pages are derived."""

    # "" for the top of the file and for the variables only the environment sets.
    table: Literal["", "tiers", "cluster", "object_store", "s3", "writeback", "stream"]
    key: str  # the key in its table; for a setting only the environment sets, the variable
    name: str  # as errors and `config show` write it: "policy", "cluster.port"
    type: Literal["text", "path", "url", "size", "duration", "bool", "count", "choice", "section", "json"]
    choices: list[str] | None  # the words of a "choice"
    bounds: tuple[int, int] | None  # the least and greatest value of a "count"
    default: str | None  # as the file would write it; None when derived at start or unset
    default_text: str | None  # the default, or how it is derived, in words; None when unset
    env: str | None  # the TIERSTORE_* variable that sets it
    argument: str | None  # the keyword of `tierstore.Cache(...)` that sets it
    flag: str | None  # the option of the `tierstore` command that sets it
    doc: str


class PrefetchProgress(TypedDict):
    """What `Cache.prefetch` returns (and `_core.Prefetch.progress()`): counts so far."""

    files_total: int
    files_done: int  # copied, already cached, or failed
    bytes_total: int
    bytes_done: int
    files_copied: int  # copied from the source by this prefetch
    files_failed: int
    files_no_room: int  # left unopened: no room for the size expected (`prefetch_files`), not a failure
    first_error: str | None
    errors: list[str]  # every problem (up to 1000), each naming its file


class OrderProgress(TypedDict):
    """What `OrderPrefetch.progress()` returns: counts of an ordered prefetch so far."""

    files_total: int  # positions in the order
    files_done: int
    files_fetched: int  # fetched from the source by this prefetch
    bytes_fetched: int
    files_cached: int  # already cached, or being fetched by another process
    files_read_first: int  # opened by a reader before the prefetch reached them
    files_failed: int
    files_no_room: int  # left to their readers: the tiers had no room (not an error)
    bytes_ahead: int  # fetched and not read yet
    max_bytes_ahead: int
    position: int  # every position before it has been read
    errors: list[str]


class SourceStats(TypedDict):
    """The source's counters in `CacheStats`, node-wide."""

    opens: int
    stats: int  # `stat` calls
    reads: int  # `read` calls
    bytes_read: int
    fallbacks: int  # reads that went to the source after a cache fault
    uncached: int  # opens served from the source because no tier had room
    peer_hits: int  # files received from a peer's agent instead of the source
    peer_bytes: int
    peer_faults: int  # reads from a peer that failed and went to the source
    served_files: int  # files this node's agent served to peers
    served_bytes: int
    lists: int  # listing requests sent to an object store
    path: str


class TierStats(TypedDict):
    """One tier's counters in `CacheStats`, node-wide."""

    path: str
    kind: TierKind
    quota: int
    hits: int
    misses: int
    bytes_served: int  # read by jobs from the tier
    entries: int
    bytes_used: int  # counted against the quota, reservations of fetches in flight included
    in_flight: int  # fetches reserved and not yet published
    evictions: int
    faults: int
    inserts: int
    bytes_written: int
    error: str | None  # why the tier is unavailable, if it is


class CacheStats(TypedDict):
    """What `Cache.stats()` returns."""

    source: SourceStats
    tiers: list[TierStats]  # fastest first


# A configured value and where it came from: "default", the configuration file's path, "$VARIABLE" or
# "argument".
Sourced: TypeAlias = tuple[_T, str]


class TierConfig(TypedDict):
    """One tier of `CacheConfig`."""

    path: str
    quota: int
    kind: TierKind


class ClusterOrigins(TypedDict):
    """Where each `[cluster]` key of `ClusterConfig` came from (see `Sourced`)."""

    peers: str
    node: str
    registry: str
    job: str
    token_file: str
    encrypt: str
    port: str
    listen: str


class ClusterConfig(TypedDict):
    """The `[cluster]` part of `CacheConfig`."""

    sharing: Literal["off", "inclusive", "partitioned"]
    members: list[str]  # each agent's "host:port", sorted; empty when sharing is off or members register
    port: int
    listen: str
    token_file: str | None
    encrypt: bool
    registry: str | None  # "redis://...": the members are whoever registered there
    job: str
    node: str  # the address this node's agent is reached at
    origins: ClusterOrigins


class _ConfigOfEverySource(TypedDict):
    source: Sourced[str]
    tiers: Sourced[list[TierConfig]]
    policy: Sourced[str]
    threads: Sourced[int]
    inline_max: Sourced[int]
    verify: Sourced[Literal["metadata", "checksum"]]
    revalidate: Sourced[str]  # "always", "never", or how long a confirmed copy is trusted ("60s")
    cluster: Sourced[ClusterConfig]


class CacheConfig(_ConfigOfEverySource, total=False):
    """What `Cache.config()` and `tierstore.cache.effective_config` return: each key with its origin."""

    # Only for an object store source: each setting it is reached with (a secret as "set" or "not set"; a
    # count as a number, anything else as text) and, under "origins", where each came from; with where
    # the store's table came from.
    object_store: Sourced[dict[str, Any]]


class WritebackDestination(TypedDict):
    """One `[[writeback]]` destination, as `_core.Writeback.destinations()` gives it."""

    path: str  # the directory on the shared store whose writes are staged
    stage: str  # this user's stage directory on the node
    quota: int  # bytes staged at most; a file opened past it is written through
    durability: Literal["buffered", "local", "remote"]
    timeout: float  # seconds a remote close or a sync waits for the store


class WritebackPending(TypedDict):
    """What waits for migration in one destination (`tierstore.writeback.pending`)."""

    path: str
    stage: str
    files: int
    bytes: int
    oldest_ns: int | None  # when the oldest pending file was closed, ns since the epoch
    errors: list[tuple[str, int, str]]  # (file, failed attempts, last error)


class ManifestTensor(TypedDict):
    """One tensor of a stream's version (`StreamManifest`): `Tensor` of `manifest.rs`, which a repository's
    tensor (`StoredTensor`) extends."""

    name: str  # the state-dict key
    dtype: str  # torch's or numpy's name
    shape: list[int]
    hash: str  # blake3 of the bytes, lowercase hex: the name of its file
    nbytes: int


class StoredTensor(ManifestTensor):
    """One tensor of a repository's version (`RepositoryManifest`): where its bytes are kept."""

    pack: str  # a file name in the repository's packs/
    offset: int  # where the bytes start in the pack


class _RepositoryManifestOptional(TypedDict, total=False):
    """The keys of a `RepositoryManifest` that older manifests lack (`NotRequired` is Python 3.11's)."""

    # blake3 of each pack file whole (lowercase hex, by pack name), where its writer recorded it: a load
    # whose copy of the pack the cache hashed as it arrived need not hash each tensor again
    pack_hashes: dict[str, str]


class RepositoryManifest(_RepositoryManifestOptional):
    """A version of a model in the repository (`models/<name>/v<N>.json`), as `_core.model_manifest_read`
    gives it and `_core.model_manifest_write` takes it."""

    format: int  # `_core.REPOSITORY_FORMAT`
    name: str
    version: int  # from 1
    created: float  # seconds since the epoch when it was saved
    framework: str  # what the state dict was made of ("torch", "numpy"): what a load builds by default
    metadata: Any  # the user's metadata, as JSON holds it
    graph: Any  # the layer graph (`tierstore.models.layers.describe`); None when saved without one
    tensors: list[StoredTensor]  # in the state dict's order
    written_bytes: int  # bytes this save wrote to packs (what deduplication did not spare)


class StreamManifest(TypedDict):
    """A version of a model stream, as `_core.stream_manifest_read` gives it: what the publisher wrote,
    completed by the agent at commit (name, version, created)."""

    name: str
    version: int
    created: float  # seconds since the epoch at commit
    step: int | None  # the trainer's step, if it gave one
    metadata: Any  # the publisher's metadata, as JSON holds it
    tensors: list[ManifestTensor]  # in the publisher's order
