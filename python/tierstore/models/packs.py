"""Where a load reads a pack from: the repository directory itself, or the node's cache in front of it.

A repository kept on the shared store is read by every node that loads a version: 64 replicas starting
from one checkpoint read it 64 times. When the repository lives under a cache's source, a load reads each
pack through that cache instead: the first reader of the node fetches it (from the peer that owns it when
the cache is shared across the job's nodes, else from the store), and every later load of the node reads
the fast tier's copy. A pack is written once, under a random name no other pack gets, and never changes,
so a copy found in a tier is used without asking the store again. The bytes are checked against each
tensor's hash as always: a damaged copy is dropped from the cache and fetched once more, and the store's
own pack is read if that fails too.

A partial load of a pack that no tier holds never has the whole pack fetched for a few of its tensors.
When the cache is shared across the job's nodes, it asks the agent of the node that owns the pack for
just those tensors: that agent reads their blocks from the store once and serves every node from them
(its own included), so N nodes loading the same 15% read it from the store once. Without a cluster, or
when the owner fails, the load reads its blocks from the store directly.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

from tierstore import _core

if TYPE_CHECKING:
    from tierstore.cache import Cache

T = TypeVar("T")

# A load reading at least this share of a pack has the whole pack fetched into the cache; a smaller one
# reads its blocks from the store (unless a tier already holds the pack).
WHOLE_PACK_SHARE = 0.5


def cache_for(root: Path, cache: Cache | Literal[False] | None) -> Cache | None:
    """The cache a repository at `root` reads through: `cache` itself when given (the repository must lie
    under its source), none for False, and for None the default cache when one is configured
    (`tierstore.toml`, `TIERSTORE_SOURCE`, `tierstore.configure`) and `root` lies under its source."""
    from tierstore import cache as cache_module

    if cache is False:
        return None
    if cache is None:
        try:
            default = cache_module.default_cache()
        except _core.ConfigError as e:
            if e.key == "source" and e.value == "(unset)":
                return None  # no cache configured: read the repository directly
            raise
        return default if _under(root, default.source) else None
    if not _under(root, cache.source):
        raise ValueError(
            f"repository {root} is not under the cache's source {cache.source}: give the cache whose "
            "source holds the repository, or cache=False to read it directly"
        )
    return cache


def _under(root: Path, source: str) -> bool:
    if "://" in source:
        return False  # an object store: the repository is a directory, never under it
    return root == Path(source) or Path(source) in root.parents


class NotServed:
    """What a `parts` read returns when no owner could serve the parts (see `Packs.read`)."""


NOT_SERVED = NotServed()


class Packs:
    """Reads of the packs of the repository at `root`, through `cache` when there is one."""

    def __init__(self, root: Path, cache: Cache | None) -> None:
        self.dir = root / "packs"
        self.cache = cache
        # Copies found damaged and dropped from the cache (counted for tests and `stats`).
        self.refetched = 0
        # Reads of a pack whose copy the cache hashed whole as it made it for the load, matching the pack's
        # own hash: its tensors were not hashed a second time (counted for tests and benchmarks).
        self.vouched = 0

    def path(self, pack: str) -> Path:
        """The pack's own file in the repository."""
        return self.dir / pack

    def read(
        self,
        pack: str,
        share: float,
        fn: Callable[[Path, bool], T],
        arriving: Callable[[_core.Cache, Path], T] | None = None,
        parts: Callable[[_core.Cache, Path], T | NotServed] | None = None,
        pack_hash: bytes | None = None,
    ) -> T:
        """`fn(path, vouched)` over a file holding the pack's bytes, which `fn` checks against the tensors'
        hashes (raising IntegrityError when they do not match) unless `vouched`. `share`: the part of the
        pack the load reads. `pack_hash`: the blake3 of the whole pack, as its writer recorded it in the
        manifest (None where it did not).

        Through the cache, a copy whose bytes fail the check is dropped and fetched again; if that copy
        fails too, the repository's own pack is read, and its error is the one raised. A pack that no
        tier of this node holds is read with `arriving(cache, path)` when given (a load that copies the
        tensors out): it reads each tensor as soon as its bytes arrive, from the store or from the node
        that owns the pack, rather than after the whole pack. A partial load of such a pack is read with
        `parts(cache, path)` when given: the tensors alone, from the agent of the node that owns the pack;
        it returns NOT_SERVED when no owner could serve them, and the store's pack is read.

        `vouched` is True for a copy that the cache made during this call, hashing it whole as it landed,
        when that hash is `pack_hash`: every byte of the pack is its writer's, checked once, and `fn` need
        not hash each tensor a second time. A copy made before the call may have been damaged in its tier
        since, and is checked tensor by tensor as ever."""
        own = self.path(pack)
        if self.cache is None:
            return fn(own, False)
        since = time.time_ns()
        copy = self.cache.lookup(own, validate=False)
        core = self.cache._core
        if share < WHOLE_PACK_SHARE and copy is None:
            # A few tensors of an uncached pack: no whole-pack fetch for them. A damaged part was told to
            # its owner, which drops its blocks; the store's pack is read.
            if parts is not None and not isinstance(
                got := self._attempt(lambda: parts(core, own)), NotServed
            ):
                return got
            return fn(own, False)
        if copy is None and arriving is not None:
            # A damaged copy is dropped; the whole-file reads below end at the store's pack.
            got = self._attempt(lambda: arriving(core, own), damaged=lambda: core.invalidate(own))
            if not isinstance(got, NotServed):
                return got
        for _ in range(2):
            with self._opened(own, copy) as fd:
                if fd is None:
                    break  # the cache could not serve it: read the store's pack
                made = None
                if pack_hash is not None:
                    # A cache fault here only means the tensors are hashed.
                    with contextlib.suppress(OSError, _core.TierstoreError):
                        made = core.hash_of_new_copy(own, fd, since)
                vouched = made is not None and made == pack_hash
                self.vouched += vouched
                try:
                    # The descriptor's own file, whatever holds it (a memory file has no other name);
                    # reopening it through /proc gives the engine's path-taking reads the very same bytes.
                    return fn(Path(f"/proc/self/fd/{fd}"), vouched)
                except _core.IntegrityError:
                    self.refetched += 1
                    self.cache._core.invalidate(own)
                    copy = None
        return fn(own, False)

    def _attempt(
        self, read: Callable[[], T | NotServed], damaged: Callable[[], None] = lambda: None
    ) -> T | NotServed:
        """`read()` through the cache, or NOT_SERVED when the cache failed it (a cache fault never stops a
        load) or its bytes failed their hashes (counted in `refetched`, and `damaged()` called)."""
        try:
            return read()
        except _core.IntegrityError:
            self.refetched += 1
            damaged()
        except FileNotFoundError:
            raise
        except (OSError, _core.TierstoreError):
            pass
        return NOT_SERVED

    @contextlib.contextmanager
    def _opened(self, own: Path, copy: str | None) -> Iterator[int | None]:
        """A descriptor holding exactly the pack's bytes, open for the block: the tier copy `copy` when it
        is still there (a pack never changes, so the store is not asked), else what the cache opens (the
        copy it fetches, one a peer sent, or the store's file when no tier has room); None when the cache
        failed (the caller reads the store: a cache fault never stops a load)."""
        assert self.cache is not None
        fd = -1
        if copy is not None:
            with contextlib.suppress(OSError):  # evicted since the lookup
                fd = os.open(copy, os.O_RDONLY | os.O_CLOEXEC)
        if fd < 0:
            try:
                fd = self.cache._core.open_file(own)
            except FileNotFoundError:
                raise
            except (OSError, _core.TierstoreError):
                yield None
                return
        try:
            yield fd
        finally:
            os.close(fd)
