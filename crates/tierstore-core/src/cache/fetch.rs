//! A miss, fetched: the thread that leads a key's flight takes the node-wide fetch lock (a file is read
//! from the source at most once per node), looks again, reserves room in a tier by policy, reads the
//! source once and publishes the copy (written under a temporary name, then renamed into place). A small
//! file is read whole and handed to every waiter at once while the copy pool writes it; a large one is
//! copied by the pool while its readers follow the copy. Any fault falls back to the source, counted.

use std::fs::File;
use std::io::{self, Write};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock, Weak};

use super::flight::{Flights, Lead, Outcome, Role};
use super::job::{FetchJob, Fetched, Purpose};
use super::lock::{lock_shared, try_lock_exclusive, FetchGuard, FetchLocks};
use super::lookup::Look;
use super::pool::Pool;
use super::storage::{no_descriptor, Storage};
use crate::clock::now_ns;
use crate::counters::{source as src_slot, tier as tier_slot};
use crate::error::Error;
use crate::hash::{Hash, Pieces};
use crate::index::{Claim, Entry, Key, Reservation, Room, SourceId, TryRemove};
use crate::placement::plan;
use crate::reader::{Backing, Growing};
use crate::source::{CopyFault, SourceFile};

/// A fetch under the node-wide lock `guard`, leading the key's flight, with room reserved in tier `t` for
/// version `sid` of `rel`: what each way of copying the file takes.
struct Placed<'a> {
    t: usize,
    rel: &'a str,
    sid: SourceId,
    guard: FetchGuard,
    lead: Lead,
}

/// Where a copy goes: version `sid` of `rel`, as `key`, into tier `t`.
struct Target<'a> {
    t: usize,
    key: &'a Key,
    rel: &'a str,
    sid: SourceId,
}

/// A copy the caller started, which readers follow: its temporary path, its file, and what they follow.
type Started = (PathBuf, File, Arc<Growing>);

/// A copy under way into tier `t`: its temporary file, and what its readers follow, if any.
struct Pending<'a> {
    fetcher: &'a Fetcher,
    t: usize,
    key: &'a Key,
    temp: PathBuf,
    file: File,
    growing: Option<Arc<Growing>>,
}

impl Pending<'_> {
    /// Gives the copy up: its readers go on from the source, the temporary file goes, and the room
    /// reserved is released; `why`, a fault to count.
    fn fail(&self, why: Option<(&str, String)>) {
        if let Some(g) = &self.growing {
            g.fail();
        }
        let _ = std::fs::remove_file(&self.temp);
        self.fetcher.abort(self.t, self.key);
        if let Some((kind, detail)) = why {
            self.fetcher.storage.fault(Some(self.t), kind, &detail);
        }
    }

    /// Gives the copy up because the store failed: its readers fail with the store's error.
    fn fail_source(&self, e: &io::Error) {
        if let Some(g) = &self.growing {
            g.fail_source(e);
        }
        self.fail(None);
    }

    /// Publishes the copy, whole and checked against version `sid` (with its blake3 `hash` when
    /// recorded), and lets its readers reach the end; false (counted) when it could not be.
    fn publish(&self, sid: SourceId, hash: Option<Hash>) -> bool {
        if let Err(e) =
            self.fetcher.storage.lookup().tiers()[self.t].publish_copy(self.key, &self.temp, &self.file, sid, hash)
        {
            let tier_path = self.fetcher.storage.lookup().tiers()[self.t].config.path.display();
            self.fail(Some(("tier-write", format!("cannot publish a copy in {tier_path}: {e}"))));
            return false;
        }
        if let Some(g) = &self.growing {
            g.finish(hash);
        }
        true
    }
}

/// The fetch step of the read path, and what it owns: the node-wide fetch locks, the in-process flights,
/// the copy pool and whether copies record their blake3. It stands on [`Storage`] and calls nothing above
/// it: the engine (and the peers step) hand it a [`FetchJob`], and it hands back what it [`Fetched`].
pub(super) struct Fetcher {
    storage: Arc<Storage>,
    locks: Arc<FetchLocks>,
    flights: Flights,
    pool: OnceLock<Weak<Pool>>,
    /// Whether copies record their blake3: asked for (`verify = "checksum"`), or needed to vouch for
    /// the bytes served to peers.
    record_checksums: bool,
}

impl Fetcher {
    pub(super) fn new(storage: Arc<Storage>, locks: Arc<FetchLocks>, record_checksums: bool) -> Fetcher {
        Fetcher { storage, locks, flights: Flights::default(), pool: OnceLock::new(), record_checksums }
    }

    /// Gives the fetcher the copy pool its background copies run in (held weakly: the cache owns it).
    pub(super) fn set_pool(&self, pool: &Arc<Pool>) {
        let _ = self.pool.set(Arc::downgrade(pool));
    }

    fn pool(&self) -> Option<Arc<Pool>> {
        self.pool.get().and_then(Weak::upgrade)
    }

    /// Whether copies record their blake3 (see [`Fetcher::checksum`]).
    pub(super) fn records_checksums(&self) -> bool {
        self.record_checksums
    }

    /// Joins the in-process flight of `key`: leads it, or follows the thread that does.
    pub(super) fn join(&self, key: &Key) -> Role {
        self.flights.join(key)
    }

    /// The node-wide fetch lock of `key`, waited for.
    pub(super) fn lock(&self, key: &Key) -> io::Result<FetchGuard> {
        self.locks.lock(key)
    }

    /// The node-wide fetch lock of `key` if nobody holds it (`None` when another process does).
    pub(super) fn try_lock(&self, key: &Key) -> io::Result<Option<FetchGuard>> {
        self.locks.try_lock(key)
    }

    /// The node-wide fetch lock of `key` for a prefetch, without waiting: `None` when another process
    /// holds it, or when a reader reads the key from the store (its fetch found no room), which a prefetch
    /// would read a second time. The reader marked it under this lock, so the mark is seen here.
    pub(super) fn lock_to_prefetch(&self, key: &Key) -> io::Result<Option<FetchGuard>> {
        let Some(guard) = self.locks.try_lock(key)? else { return Ok(None) };
        Ok((!self.read_from_store(key)).then_some(guard))
    }

    /// [`Fetcher::lock`], with a failure counted as a fault (the caller then reads the source uncached).
    pub(super) fn lock_or_fault(&self, key: &Key) -> Option<FetchGuard> {
        match self.locks.lock(key) {
            Ok(g) => Some(g),
            Err(e) => {
                self.storage.fault(None, "fetch-lock", &format!("fetch lock failed: {e}"));
                None
            }
        }
    }

    /// Opens and identifies the job's file, keeping the open file in `pre`; on failure the job's flight
    /// lands with the error, so that its followers stop waiting and fail alike.
    pub(super) fn open_for_flight<'a>(
        &self,
        job: FetchJob<'a>,
        pre: &mut Option<SourceFile>,
    ) -> Result<(SourceId, FetchJob<'a>), Error> {
        match self.storage.open_identified(job.rel) {
            Ok((sid, f)) => {
                *pre = Some(f);
                Ok((sid, job))
            }
            Err(e) => {
                fail_flight(job.lead, &e);
                Err(e)
            }
        }
    }

    /// Fetches version `sid` under the node-wide fetch lock, which it takes (the job leads the in-process
    /// flight).
    pub(super) fn lead(
        self: &Arc<Self>,
        job: FetchJob<'_>,
        sid: SourceId,
        pre: &mut Option<SourceFile>,
    ) -> Result<Fetched, Error> {
        let Some(guard) = self.lock_or_fault(job.key()) else {
            let rel = job.rel;
            drop(job);
            return Ok(Fetched::Reader(self.storage.direct(rel, sid, pre)?));
        };
        self.fetch_locked(job, sid, guard, pre)
    }

    /// Fetches version `sid` under the node-wide fetch lock `guard`: a copy another process published
    /// meanwhile is used; otherwise room is reserved in a tier, and the file is read into it (a small one
    /// whole, in this thread for a prefetch; a large one by the copy pool, followed by its readers). `pre`:
    /// the source's file, when open already.
    pub(super) fn fetch_locked(
        self: &Arc<Self>,
        job: FetchJob<'_>,
        sid: SourceId,
        guard: FetchGuard,
        pre: &mut Option<SourceFile>,
    ) -> Result<Fetched, Error> {
        self.fetch_locked_then(job, sid, guard, pre, || {})
    }

    /// [`Fetcher::fetch_locked`], calling `placed` once a tier's room is reserved for the file or found
    /// missing, before the file is copied: an ordered prefetch stops counting the room it saw for the
    /// file there, since the index counts the reservation from then on (counted twice for the length of
    /// a copy, the room made other workers let go of copies that the epoch's end left unused).
    pub(super) fn fetch_locked_then(
        self: &Arc<Self>,
        job: FetchJob<'_>,
        sid: SourceId,
        guard: FetchGuard,
        pre: &mut Option<SourceFile>,
        placed: impl FnOnce(),
    ) -> Result<Fetched, Error> {
        let FetchJob { rel, purpose, seen, lead } = job;
        let key = *lead.key();
        let key = &key;
        // Another process may have published while this one waited for the lock.
        if let Some(r) = self.storage.hit(key, rel, &sid, Look::Quiet) {
            return Ok(match purpose {
                Purpose::Read => Fetched::Reader(r),
                Purpose::Prefetch | Purpose::Native | Purpose::Peer => Fetched::Cached,
            });
        }
        // Under the lock, any entry of this key is stale, damaged, or left by a dead fetcher; but room this
        // fetch held before its open stays held until the reservation below takes its place.
        self.remove_entries_but_held(key);
        let place = self.place(key, rel, sid, seen);
        placed();
        let Some(t) = place else {
            self.storage.source().counters().add(src_slot::UNCACHED, 1);
            log::debug!("{rel}: no tier has room for {} B; read from the store, not cached", sid.size);
            if matches!(purpose, Purpose::Prefetch | Purpose::Peer) {
                return Ok(Fetched::NoRoom);
            }
            // Marked before the lock goes: a prefetch that claims the file next, once room is let go of,
            // finds it read from the store and does not read it a second time.
            let mark = self.locks.mark_store_read(key);
            drop(guard);
            drop(lead);
            let reader = self.storage.direct(rel, sid, pre)?;
            return Ok(Fetched::Reader(match mark {
                Ok(mark) => reader.keeping(mark),
                Err(e) => {
                    log::debug!("{rel}: cannot mark it read from the store ({e}); a prefetch may read it again");
                    reader
                }
            }));
        };
        log::debug!(
            "{rel}: fetching {} B from the store into {}{}",
            sid.size,
            self.storage.lookup().tiers()[t].config.path.display(),
            if purpose == Purpose::Prefetch { " (prefetch)" } else { "" }
        );
        let small = sid.size <= self.storage.config().inline_max;
        let placed = Placed { t, rel, sid, guard, lead };
        match purpose {
            // A small file for a program or a peer is fetched whole in this thread, as a prefetch is.
            Purpose::Prefetch => self.copy_now(placed, pre),
            Purpose::Native | Purpose::Peer if small => self.copy_now(placed, pre),
            Purpose::Read if small => self.read_small(placed, pre),
            Purpose::Read | Purpose::Peer => self.copy_followed(placed, None, pre),
            Purpose::Native => self.copy_for_program(placed, pre),
        }
    }

    /// Copies the file whole in this thread (a prefetch, or a small file for a program or a peer).
    fn copy_now(&self, placed: Placed<'_>, pre: &mut Option<SourceFile>) -> Result<Fetched, Error> {
        let Placed { t, rel, sid, guard, lead } = placed;
        let r = self.copy_into(Target { t, key: lead.key(), rel, sid }, None, pre.take());
        drop(guard);
        drop(lead);
        r.map(|ok| if ok { Fetched::Cached } else { Fetched::Uncached })
    }

    /// Reads a small file whole, hands it to the reader and every waiter at once, and leaves the copy's
    /// writing to the pool.
    fn read_small(self: &Arc<Self>, placed: Placed<'_>, pre: &mut Option<SourceFile>) -> Result<Fetched, Error> {
        let Placed { t, rel, sid, guard, lead } = placed;
        let key = *lead.key();
        let (bytes, after) = match self.storage.source().read_whole(rel, sid.size, pre.take()) {
            Ok(x) => x,
            Err(e) => {
                self.abort(t, &key);
                drop(guard);
                lead.fail(&e);
                return Err(self.storage.error(rel, e));
            }
        };
        let bytes = Arc::new(bytes);
        lead.deliver(Outcome::Bytes(bytes.clone(), sid));
        let reader = self.storage.reader(Backing::Memory(bytes.clone()), bytes.len() as u64, rel);
        let inner = self.clone();
        self.in_pool(move || {
            if after == sid && bytes.len() as u64 == sid.size {
                inner.publish_bytes(t, &key, &bytes, sid);
            } else {
                inner.abort(t, &key);
            }
            drop(guard);
            drop(lead);
        });
        Ok(Fetched::Reader(reader))
    }

    /// A large file for a program: its descriptor shares the copy's open file (a dup: no second open on
    /// the store); the copy reads with pread, so the program's file offset is its own.
    fn copy_for_program(self: &Arc<Self>, placed: Placed<'_>, pre: &mut Option<SourceFile>) -> Result<Fetched, Error> {
        let opened = pre.take().map_or_else(|| self.storage.source().open(placed.rel), Ok).and_then(|f| {
            let program = f.as_file().ok_or_else(no_descriptor)?.try_clone()?;
            Ok((f, program))
        });
        match opened {
            Ok((f, program)) => {
                *pre = Some(f);
                self.copy_followed(placed, Some(program), pre)
            }
            Err(e) => {
                let Placed { t, rel, guard, lead, .. } = placed;
                self.abort(t, lead.key());
                drop(guard);
                drop(lead);
                Err(self.storage.error(rel, e))
            }
        }
    }

    /// Copies a large file in the pool into a temporary copy that its readers follow as it grows: the
    /// open's reader, or the `program`'s descriptor. A copy that cannot be created sends the open to the
    /// source.
    fn copy_followed(
        self: &Arc<Self>,
        placed: Placed<'_>,
        program: Option<File>,
        pre: &mut Option<SourceFile>,
    ) -> Result<Fetched, Error> {
        let Placed { t, rel, sid, guard, lead } = placed;
        let key = *lead.key();
        let tier = &self.storage.lookup().tiers()[t];
        let temp = tier.create_temp(&key).and_then(|(path, f)| {
            let reader = File::open(&path)?;
            lock_shared(&reader)?;
            Ok((path, f, reader))
        });
        let (path, file, read_handle) = match temp {
            Ok(x) => x,
            Err(e) => {
                self.storage.fault(
                    Some(t),
                    "tier-write",
                    &format!("cannot create a copy in {}: {e}", tier.config.path.display()),
                );
                self.abort(t, &key);
                drop(guard);
                drop(lead);
                return Ok(Fetched::Reader(self.storage.direct(rel, sid, pre)?));
            }
        };
        let growing = Arc::new(Growing::new(read_handle, sid));
        lead.deliver(Outcome::Growing(growing.clone()));
        let fetched = match program {
            Some(f) => Fetched::Streaming(f, growing.clone()),
            None => Fetched::Reader(self.storage.reader(Backing::Growing(growing.clone()), sid.size, rel)),
        };
        let inner = self.clone();
        let (rel, src) = (rel.to_string(), pre.take());
        self.in_pool(move || {
            let _ = inner.copy_into(Target { t, key: &key, rel: &rel, sid }, Some((path, file, growing)), src);
            drop(guard);
            drop(lead);
        });
        Ok(fetched)
    }

    /// Runs `job` in the copy pool, as urgent work, or here when there is no pool.
    pub(super) fn in_pool(&self, job: impl FnOnce() + Send + 'static) {
        match self.pool() {
            Some(pool) => pool.urgent(job),
            None => job(),
        }
    }

    /// Removes every entry of `key` and its copy (the caller holds the key's fetch lock).
    pub(super) fn remove_entries(&self, key: &Key) {
        self.remove_entries_if(key, |_| true);
    }

    /// [`Fetcher::remove_entries`], but for the room this process holds for the key ([`Fetcher::hold_room`]).
    fn remove_entries_but_held(&self, key: &Key) {
        self.remove_entries_if(key, |e| !is_held(e));
    }

    fn remove_entries_if(&self, key: &Key, remove: impl Fn(&Entry) -> bool) {
        for tier in self.storage.lookup().tiers() {
            if let Ok(ix) = &tier.index {
                if let Ok(Some(old)) = ix.remove_if(key, &remove) {
                    if old.ready {
                        let _ = std::fs::remove_file(tier.data_path(key));
                    }
                }
            }
        }
    }

    /// Reserves room for the entry by policy; returns the tier that took it. `seen`: when the source showed
    /// the version `sid` (0: not known, the copy is confirmed before it is trusted for a while).
    pub(super) fn place(&self, key: &Key, rel: &str, sid: SourceId, seen: u64) -> Option<usize> {
        let tiers = self.storage.lookup().tiers();
        let (free, quotas) = self.room(Some(key));
        for (i, evict) in plan(self.storage.config().policy, sid.size, &free, &quotas) {
            let tier = &tiers[i];
            let Ok(ix) = &tier.index else { continue };
            let mut try_remove = |victim: &Key, _: &Entry| {
                let path = tier.data_path(victim);
                match File::open(&path) {
                    Ok(f) if try_lock_exclusive(&f) => std::fs::remove_file(&path).is_ok(),
                    Ok(_) => false,
                    Err(e) => e.kind() == io::ErrorKind::NotFound,
                }
            };
            let claim = Claim { key, rel, source: sid, confirmed_ns: seen };
            let room = Room { quota: quotas[i], evict: evict.then_some(&mut try_remove as TryRemove<'_>) };
            match ix.reserve(claim, room) {
                Ok(Reservation::Reserved { evicted }) => {
                    tier.counters.add(tier_slot::EVICTIONS, evicted);
                    if let Ok(used) = ix.usage_bytes() {
                        tier.record_usage(used);
                    }
                    return Some(i);
                }
                Ok(Reservation::NoRoom { evicted }) => tier.counters.add(tier_slot::EVICTIONS, evicted),
                Err(e) => self.storage.fault(
                    Some(i),
                    "index-write",
                    &format!("index of {} not writable: {e}", tier.config.path.display()),
                ),
            }
        }
        None
    }

    /// Lets go of the published copy of `rel` (key `key`) for room, when no fetch holds its lock; returns
    /// the bytes freed. For copies a reader has passed (read this epoch, by an ordered prefetch's marks or
    /// a shard read-ahead's log), which a placement that keeps what it placed would otherwise hold until
    /// the tiers are emptied; a reader that holds the copy open keeps reading it.
    pub(super) fn let_go(&self, key: &Key, rel: &str) -> u64 {
        let Some((tier, held)) = self.storage.lookup().published_in(key, rel) else { return 0 };
        let Ok(Some(_guard)) = self.try_lock(key) else { return 0 };
        self.remove_entries(key);
        self.storage.lookup().tiers()[tier].counters.add(crate::counters::tier::EVICTIONS, 1);
        held.source.size
    }

    /// Whether [`Fetcher::place`] would find room for `size` bytes now (free room, or an evicting policy
    /// whose quota holds it), without reserving any: a prefetch asks before it opens a file, so that a
    /// file it cannot copy is not opened only to be opened again by its reader.
    pub(super) fn has_room(&self, size: u64) -> bool {
        let (free, quotas) = self.room(None);
        !plan(self.storage.config().policy, size, &free, &quotas).is_empty()
    }

    /// Holds room in a tier for about `size` bytes of `rel` (key `key`, claimed: its fetch lock held),
    /// before it is opened, as a pending entry of this process with no version yet. A prefetch that saw
    /// room and then opened the file could find the room taken meanwhile (by a reader's own fetch, in
    /// any process) and leave the file to its reader, which opens it a second time: on an object store a
    /// second `GET`. Held, the room is there when the copy reserves it ([`Fetcher::place`] counts the
    /// hold as free for its key; the reservation replaces it in one write). The hold is let go when the
    /// [`Hold`] is dropped, if the copy did not take its place.
    pub(super) fn hold_room(&self, key: &Key, rel: &str, size: u64) -> Held<'_> {
        let tiers = self.storage.lookup().tiers();
        // An entry of the key (a stale copy) is replaced by the copy itself, which removes its bytes too.
        let entry = |t: &crate::tier::Tier| t.index.as_ref().ok().and_then(|ix| ix.lookup(key).ok().flatten());
        if tiers.iter().any(|t| entry(t).is_some()) {
            return Held::Stale;
        }
        let sid = SourceId { size, mtime_ns: HELD, ctime_ns: HELD, ino: 0, dev: 0, attrs: None };
        match self.place(key, rel, sid, 0) {
            Some(tier) => Held::Room(Hold { fetcher: self, tier, key: *key }),
            None => Held::NoRoom,
        }
    }

    /// Each tier's free room (None: its index is unusable) and this source's quota in it. Each tier's
    /// quota bounds every source of the user in it together: this source's share is the quota less what
    /// the others hold (see `usage`). For a reservation of `key`, an entry of the key counts as free: the
    /// reservation replaces it (a hold, or a copy left by a dead fetcher) in the same write.
    fn room(&self, key: Option<&Key>) -> (Vec<Option<u64>>, Vec<u64>) {
        let tiers = self.storage.lookup().tiers();
        let used: Vec<Option<u64>> = tiers
            .iter()
            .map(|t| {
                let ix = t.index.as_ref().ok()?;
                let replaced = key.and_then(|k| ix.lookup(k).ok().flatten()).map_or(0, |e| e.source.size);
                ix.usage_bytes().ok().map(|used| used.saturating_sub(replaced))
            })
            .collect();
        let quotas: Vec<u64> = tiers
            .iter()
            .zip(&used)
            .map(|(t, used)| used.map_or(t.config.quota, |used| t.quota_left_by_others(used)))
            .collect();
        let free = used.iter().zip(&quotas).map(|(used, quota)| used.map(|u| quota.saturating_sub(u))).collect();
        (free, quotas)
    }

    pub(super) fn abort(&self, t: usize, key: &Key) {
        if let Ok(ix) = &self.storage.lookup().tiers()[t].index {
            let pid = crate::process::pid();
            let _ = ix.remove_if(key, |e| !e.ready && e.pid == pid);
        }
    }

    /// The blake3 of a copy, computed only when copies are verified by checksum (hashing costs a few
    /// percent of a first epoch that nothing else would use).
    pub(super) fn checksum(&self, bytes: &[u8]) -> Option<[u8; 32]> {
        self.record_checksums.then(|| crate::hash::hash_serial(bytes))
    }

    /// Writes fetched bytes into tier `t` and publishes them.
    pub(super) fn publish_bytes(&self, t: usize, key: &Key, bytes: &[u8], sid: SourceId) {
        let tier = &self.storage.lookup().tiers()[t];
        let r = tier.create_temp(key).and_then(|(path, mut f)| {
            let result = f.write_all(bytes).and_then(|_| tier.publish_copy(key, &path, &f, sid, self.checksum(bytes)));
            if result.is_err() {
                let _ = std::fs::remove_file(&path);
            }
            result
        });
        if let Err(e) = r {
            self.storage.fault(
                Some(t),
                "tier-write",
                &format!("cannot write a copy into {}: {e}", tier.config.path.display()),
            );
            self.abort(t, key);
        }
    }

    /// Streams version `to.sid` of the source's file into tier `to.t` and publishes it; the readers of a
    /// copy `started` by the caller follow it as it grows. `source_file`: the file, when open already.
    /// Returns whether the copy was published.
    fn copy_into(
        &self,
        to: Target<'_>,
        started: Option<Started>,
        source_file: Option<SourceFile>,
    ) -> Result<bool, Error> {
        let Target { t, key, rel, sid } = to;
        let Some(pending) = self.pending_copy(t, key, started) else { return Ok(false) };
        let src = match self.open_to_copy(rel, sid, source_file) {
            Ok(Some(f)) => f,
            Ok(None) => {
                pending.fail(None);
                return Ok(false);
            }
            Err(e) => {
                pending.fail_source(&e);
                return Err(self.storage.error(rel, e));
            }
        };
        // A copy that others follow records each piece's chaining value as it is written: the agent sends a
        // peer those pieces before the copy ends, each checked on arrival.
        let growing = pending.growing.clone();
        let mut hasher = self.record_checksums.then(|| match growing {
            Some(g) => Pieces::reporting(sid.size, move |cv| g.record_piece(cv)),
            None => Pieces::new(sid.size),
        });
        let mut progress = |copied: u64| {
            if let Some(g) = &pending.growing {
                // The end only once the copy is checked against the source and published (below): a
                // reader that reached it finds the file whole in its tier.
                if copied < sid.size {
                    g.advance(copied);
                }
            }
        };
        let (copied, after) =
            match self.storage.source().copy(&src, &pending.file, sid.size, hasher.as_mut(), &mut progress) {
                Ok(x) => x,
                Err(CopyFault::Source(e)) => {
                    // The store failed (timed out, went away): its readers fail with it now, rather than ask
                    // the store again and wait as long a second time. A tier fault, below, sends them to the
                    // source instead.
                    pending.fail_source(&e);
                    return Err(self.storage.error(rel, e));
                }
                Err(CopyFault::Tier(e)) => {
                    let tier_path = self.storage.lookup().tiers()[t].config.path.display();
                    pending.fail(Some(("tier-write", format!("cannot write a copy into {tier_path}: {e}"))));
                    return Ok(false);
                }
            };
        // A file rewritten during the copy is never published.
        if copied != sid.size || after != Some(sid) {
            pending.fail(None);
            return Ok(false);
        }
        Ok(pending.publish(sid, hasher.map(|h| h.finalize())))
    }

    /// The temporary copy of `key` in tier `t`: the one the caller `started`, or a new one (None, counted
    /// as a tier fault, when it cannot be created).
    fn pending_copy<'a>(&'a self, t: usize, key: &'a Key, started: Option<Started>) -> Option<Pending<'a>> {
        let (temp, file, growing) = match started {
            Some((p, f, g)) => (p, f, Some(g)),
            None => match self.storage.lookup().tiers()[t].create_temp(key) {
                Ok((p, f)) => (p, f, None),
                Err(e) => {
                    let tier_path = self.storage.lookup().tiers()[t].config.path.display();
                    self.storage.fault(Some(t), "tier-write", &format!("cannot create a copy in {tier_path}: {e}"));
                    self.abort(t, key);
                    return None;
                }
            },
        };
        Some(Pending { fetcher: self, t, key, temp, file, growing })
    }

    /// The source's file to copy version `sid` of `rel` from (`given`, or opened now); None when it is not
    /// the file the version names. A copy is read from a descriptor of the very file its version names,
    /// checked before the first byte (the device and inode, which the kernel knows without asking the
    /// store), not only at the end: this node's agent sends a copy to peers while it grows, and vouches for
    /// it by its version (`serve.rs`), so it must never hold the bytes of another file, such as the one a
    /// symlink was switched to between reading the version and opening the path here.
    fn open_to_copy(&self, rel: &str, sid: SourceId, given: Option<SourceFile>) -> io::Result<Option<SourceFile>> {
        let src = given.map(Ok).unwrap_or_else(|| self.storage.source().open(rel))?;
        if let Some(f) = src.as_file() {
            if crate::source::posix::inode_of(f).ok() != Some((sid.dev, sid.ino)) {
                return Ok(None);
            }
        }
        Ok(Some(src))
    }

    /// A prefetch's claim on `rel` before the store is asked: its in-process flight and its node-wide
    /// fetch lock, both taken without waiting. `None` when it is being fetched (in this process or
    /// another), read from the store by a reader that found no room for it, or is cached and current, so
    /// that a prefetch racing a reader's fetch never opens the file (on an object store, opening it is a
    /// `GET`) and never reads it a second time.
    pub(super) fn claim(&self, key: &Key, rel: &str) -> Result<Option<Claimed>, Error> {
        let Role::Leader(lead) = self.flights.join(key) else { return Ok(None) };
        let guard = match self.lock_to_prefetch(key) {
            Ok(Some(guard)) => guard,
            Ok(None) => return Ok(None),
            Err(e) => return Err(self.storage.error(rel, e)),
        };
        if let Some(e) = self.storage.lookup().published(key, rel) {
            if self.storage.trusted_now(&e) && self.storage.hit(key, rel, &e.source, Look::Quiet).is_some() {
                return Ok(None);
            }
        }
        Ok(Some(Claimed { lead, guard }))
    }

    /// Whether a reader (in any process) reads `key` from the store now, its fetch having found no room.
    /// A mark that cannot be asked is taken as none (counted as a fault).
    fn read_from_store(&self, key: &Key) -> bool {
        self.locks.read_from_store(key).unwrap_or_else(|e| {
            self.storage.fault(None, "fetch-lock", &format!("cannot ask the store-read marks: {e}"));
            false
        })
    }

    /// One object of a prefetch, claimed (`claim`) before it was opened.
    pub(super) fn prefetch_object(self: &Arc<Self>, claimed: Claimed, rel: &str) -> Result<(SourceId, Fetched), Error> {
        let seen = now_ns();
        let mut pre = None;
        let job = FetchJob { rel, purpose: Purpose::Prefetch, seen, lead: claimed.lead };
        let (sid, job) = self.open_for_flight(job, &mut pre)?;
        let fetched = self.fetch_locked(job, sid, claimed.guard, &mut pre)?;
        Ok((sid, fetched))
    }

    /// One file of a prefetch, claimed (`claim`) before the caller opened and identified it (at `seen` or
    /// after): copied unless that version is cached.
    pub(super) fn prefetch_file(
        self: &Arc<Self>,
        claimed: Claimed,
        rel: &str,
        sid: SourceId,
        file: SourceFile,
        seen: u64,
    ) -> Result<Fetched, Error> {
        let key = *claimed.lead.key();
        if self.storage.hit(&key, rel, &sid, Look::Quiet).is_some() {
            return Ok(Fetched::Skipped);
        }
        let job = FetchJob { rel, purpose: Purpose::Prefetch, seen, lead: claimed.lead };
        self.fetch_locked(job, sid, claimed.guard, &mut Some(file))
    }
}

/// The times a hold's pending entry records in place of a version: no source file has them, so a hold is
/// never taken for a copy of one.
const HELD: i64 = i64::MIN;

/// Whether `e` is room this process holds for a file it has not opened yet ([`Fetcher::hold_room`]).
fn is_held(e: &Entry) -> bool {
    !e.ready && e.pid == crate::process::pid() && e.source.mtime_ns == HELD && e.source.ctime_ns == HELD
}

/// What [`Fetcher::hold_room`] found.
pub(super) enum Held<'a> {
    /// Room is held until the hold is dropped.
    Room(Hold<'a>),
    /// No tier has room for the size asked.
    NoRoom,
    /// The key has an entry already (a stale copy): nothing was held, the copy replaces the entry.
    Stale,
}

/// Room held in tier `tier` for the file of `key` until the copy reserves it; let go of when dropped.
pub(super) struct Hold<'a> {
    fetcher: &'a Fetcher,
    tier: usize,
    key: Key,
}

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        // Gone already where the copy's reservation took its place (in this tier) or it was removed.
        if let Ok(ix) = &self.fetcher.storage.lookup().tiers()[self.tier].index {
            let _ = ix.remove_if(&self.key, is_held);
        }
    }
}

/// A file a prefetch may fetch: it leads the file's flight and holds its fetch lock.
pub(super) struct Claimed {
    lead: Lead,
    guard: FetchGuard,
}

/// Lands a flight whose source request failed with `e`, handing the error to its waiters (an error that is
/// not the source's, such as a path that leaves it, only lands the flight: each waiter finds it alone).
pub(super) fn fail_flight(lead: Lead, e: &Error) {
    if let Error::Io { source, .. } = e {
        lead.fail(source);
    }
}
