//! Lookup: which tier holds a published copy of a file, and opening it checked. It owns the cache's tiers,
//! the hits not yet written to their indexes (for an evicting policy), and what `fstat` reported for each
//! copy this process opened (for the shim's replay of it, see `trusted.rs`). The open, the fetch, the peers,
//! the prefetches and `Cache::lookup` ask it for published copies. (The shim's `fstat` replay reads the entry
//! of a copy it already holds, and an agent's sibling read a reservation, from the tier's index directly.)

use std::collections::HashMap;
use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rustc_hash::FxHashMap;

use super::copy_stats::CopyStats;
use super::faults::Faults;
use super::lock::lock_shared;
use crate::clock::now_ns;
use crate::config::Verify;
use crate::counters::tier as tier_slot;
use crate::hash::Hash;
use crate::index::{Entry, Index, Key, SourceId};
use crate::placement::Policy;
use crate::reader::Backing;
use crate::seen::Seen;
use crate::tier::Tier;

/// Files whose entries [`Lookup::published_each`] reads in one transaction: a few milliseconds of a
/// reader's hold on the index's pages, however long the order.
const EACH_TXN: usize = 4096;

/// How many files' first-tier entries a process keeps ([`Lookup::published_of`]), each from its second
/// look (`seen.rs`); once full it keeps no more, so that a data set larger than this (whose files each come
/// back once an epoch, after the others) costs one probe of the table per open, never an insert thrown
/// away before its use.
const ENTRIES_KEPT: usize = 1 << 16;

/// Pending hits are written to the indexes once this many copies have some, or this long after the last
/// write: one write transaction per tier, not one per read.
const ACCESS_BATCH: usize = 512;
const ACCESS_FLUSH_MS: u128 = 500;

/// What a look for a published copy counts: `tierstore status`'s hits and misses are the job's first
/// look at each open, so a cold open is one miss, not a miss and then a hit of the copy just fetched. A
/// peer's request for a file's bytes is such an open on the node that owns it: one hit there, or one miss
/// when that node fetches the file from the store for it (the asker counts a miss of its own tiers, and a
/// peer hit), so that a job's first epoch is all misses, on every node.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Look {
    /// The job's first look: a hit or a miss in each tier it reaches, and an access of the copy.
    First,
    /// The job's look at the copy fetched for it after its miss: an access of the copy, no hit.
    AfterFetch,
    /// The cache's own look (under the fetch lock, for a prefetch, or for a peer that only asks this node
    /// to hold a file): counts nothing.
    Quiet,
}

impl Look {
    /// This look, leaving the open's next one in its place: every look after the first is
    /// [`Look::AfterFetch`] (a quiet open stays quiet).
    pub(super) fn take(&mut self) -> Look {
        let this = *self;
        if this == Look::First {
            *self = Look::AfterFetch;
        }
        this
    }
}

/// A published entry, and the index of the tier that holds it.
pub(super) type Found = (usize, Arc<Entry>);

/// A first-tier entry this process looked up, kept while that tier's index reads the same change number.
struct KeptEntry {
    changes: u64,
    key: Key,
    entry: Arc<Entry>,
}

/// The tiers' published copies (see the module).
pub(super) struct Lookup {
    tiers: Vec<Arc<Tier>>,
    policy: Policy,
    verify: Verify,
    faults: Arc<Faults>,
    /// Hits not yet written to the index: (tier, key) -> (hits, last access).
    access: Mutex<FxHashMap<(usize, Key), (u64, u64)>>,
    last_access_flush: Mutex<Instant>,
    /// What `fstat` of each copy this process opened reports, rewritten as its source file's.
    copy_stats: CopyStats,
    /// The first tier's published entries this process found, by source-relative path, each with the
    /// index's change number it was found at (see `index/changes.rs`): a warm open of a file opened
    /// before reads two shared numbers instead of hashing its path and reading the index.
    kept: Mutex<FxHashMap<String, KeptEntry>>,
    /// The paths looked up so far: an entry is kept at a path's second look (see `seen.rs`).
    looked: Seen,
}

impl Lookup {
    pub(super) fn new(tiers: Vec<Arc<Tier>>, policy: Policy, verify: Verify, faults: Arc<Faults>) -> Lookup {
        Lookup {
            tiers,
            policy,
            verify,
            faults,
            access: Mutex::new(FxHashMap::default()),
            last_access_flush: Mutex::new(Instant::now()),
            copy_stats: CopyStats::default(),
            kept: Mutex::new(FxHashMap::default()),
            looked: Seen::default(),
        }
    }

    /// The tiers, fastest first.
    pub(super) fn tiers(&self) -> &[Arc<Tier>] {
        &self.tiers
    }

    /// The first published entry of `key` in tier order, with the tier's index.
    pub(super) fn published_in(&self, key: &Key, rel: &str) -> Option<Found> {
        self.tiers.iter().enumerate().find_map(|(i, t)| {
            let e = t.index.as_ref().ok()?.lookup(key).ok()??;
            (e.ready && e.rel == rel).then(|| (i, Arc::new(e)))
        })
    }

    /// The key of `rel` and [`Lookup::published_in`] of it; a first-tier entry this process found before
    /// is taken as it was found while the first tier's index has not changed since (`index/changes.rs`).
    pub(super) fn published_of(&self, rel: &str) -> (Key, Option<Found>) {
        // Read before the look: a look kept under this number saw at least every change up to it.
        let Some(changes) = self.first_tier_changes() else {
            let key = crate::index::key_of(rel);
            let found = self.published_in(&key, rel);
            return (key, found);
        };
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(k) = kept.get(rel).filter(|k| k.changes == changes) {
            return (k.key, Some((0, k.entry.clone())));
        }
        drop(kept);
        let key = crate::index::key_of(rel);
        let found = self.published_in(&key, rel);
        if let Some((0, entry)) = found.as_ref().filter(|_| self.looked.again(rel.as_bytes())) {
            kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
            let fresh = KeptEntry { changes, key, entry: entry.clone() };
            let room = kept.len() < ENTRIES_KEPT;
            match kept.get_mut(rel) {
                Some(k) => *k = fresh,
                None if room => {
                    kept.insert(rel.to_owned(), fresh);
                }
                None => {}
            }
        }
        (key, found)
    }

    /// [`Lookup::published`] of each of `files` (key and path), a tier's index read in one
    /// transaction per [`EACH_TXN`] files instead of one per file: an ordered prefetch looks at its whole
    /// epoch as it starts.
    pub(super) fn published_each(&self, files: &[(&Key, &str)]) -> Vec<Option<Entry>> {
        let mut found: Vec<Option<Entry>> = files.iter().map(|_| None).collect();
        for t in &self.tiers {
            let Ok(ix) = t.index.as_ref() else { continue };
            let wanted: Vec<usize> = (0..files.len()).filter(|&i| found[i].is_none()).collect();
            if wanted.is_empty() {
                break;
            }
            for part in wanted.chunks(EACH_TXN) {
                let Ok(entries) = ix.lookup_each(part.iter().map(|&i| files[i].0)) else { continue };
                for (&i, e) in part.iter().zip(entries) {
                    found[i] = e.filter(|e| e.ready && e.rel == files[i].1);
                }
            }
        }
        found
    }

    /// The first tier's change number (`index/changes.rs`); `None` while it changes, or without an index.
    fn first_tier_changes(&self) -> Option<u64> {
        self.tiers.first().and_then(|t| t.index.as_ref().ok()).and_then(Index::changes)
    }

    /// A number that moves whenever any tier's index changes: the sum of their change numbers, each of
    /// which only grows. `None` while one of them changes.
    pub(super) fn changes(&self) -> Option<u64> {
        self.tiers
            .iter()
            .filter_map(|t| t.index.as_ref().ok())
            .try_fold(0u64, |sum, ix| Some(sum.wrapping_add(ix.changes()?)))
    }

    /// [`Lookup::hit`] for the entry [`Lookup::published_in`] just found, `found`: the same copy and the
    /// same counts, without reading the index again when that entry is in the first tier and of version
    /// `sid` (a warm open's second index read). Anything else takes `hit`'s own way.
    pub(super) fn hit_found(&self, found: &Found, key: &Key, rel: &str, sid: &SourceId, look: Look) -> Option<Backing> {
        self.first_tier_copy(found, key, rel, sid, look).or_else(|| self.hit(key, rel, sid, look))
    }

    /// The copy of `found` when it is the first tier's entry, of version `sid`, and opens and checks
    /// cleanly: counted as `hit` counts a hit. `None`, counting nothing, in every other case (another
    /// tier, another version, evicted or damaged meanwhile), which `hit` then looks into and counts.
    pub(super) fn first_tier_copy(
        &self,
        found: &Found,
        key: &Key,
        rel: &str,
        sid: &SourceId,
        look: Look,
    ) -> Option<Backing> {
        let (i, e) = found;
        if *i != 0 || e.source != *sid || e.rel != rel {
            return None;
        }
        let tier = &self.tiers[0];
        let backing = self.open_copy(tier, key, e).ok()??;
        if look == Look::First {
            tier.counters.add(tier_slot::HITS, 1);
            log::debug!("{rel}: hit in {}", tier.config.path.display());
        }
        if look != Look::Quiet {
            self.note_access(0, key);
        }
        Some(backing)
    }

    /// The first published entry of `key` in tier order.
    pub(super) fn published(&self, key: &Key, rel: &str) -> Option<Entry> {
        self.published_in(key, rel).map(|(_, e)| Arc::unwrap_or_clone(e))
    }

    /// The path of the first published copy of `key` in tier order, of version `version` when given (a
    /// tier holding another version is passed over for the next).
    pub(super) fn copy_path(&self, key: &Key, rel: &str, version: Option<&SourceId>) -> Option<PathBuf> {
        self.tiers.iter().find_map(|t| {
            let e = t.index.as_ref().ok()?.lookup(key).ok()??;
            (e.ready && e.rel == rel && version.is_none_or(|v| *v == e.source)).then(|| t.data_path(key))
        })
    }

    /// The index that records the source's directories: the first tier's that is available.
    pub(super) fn directories(&self) -> Option<&Index> {
        self.tiers.iter().find_map(|t| t.index.as_ref().ok())
    }

    /// Counts a miss in every available tier (a trusted file that no tier holds), when `look` is the
    /// open's first (see [`Look::take`]).
    pub(super) fn count_misses(&self, look: Look, rel: &str) {
        if look != Look::First {
            return;
        }
        log::debug!("{rel}: miss, no tier holds a copy");
        for t in &self.tiers {
            if t.index.is_ok() {
                t.counters.add(tier_slot::MISSES, 1);
            }
        }
    }

    /// The bytes of a valid published copy of version `sid` of `key`, from the first tier that has one.
    pub(super) fn hit(&self, key: &Key, rel: &str, sid: &SourceId, look: Look) -> Option<Backing> {
        let count = look == Look::First;
        for (i, tier) in self.tiers.iter().enumerate() {
            let Ok(index) = &tier.index else { continue };
            let entry = match index.lookup(key) {
                Ok(Some(e)) if e.ready && e.rel == rel && e.source == *sid => e,
                Ok(found) => {
                    if count {
                        tier.counters.add(tier_slot::MISSES, 1);
                        let why = if found.is_some() { "holds another version" } else { "holds no copy" };
                        log::debug!("{rel}: miss in {}, which {why}", tier.config.path.display());
                    }
                    continue;
                }
                Err(e) => {
                    let detail = format!("index of {} unreadable: {e}", tier.config.path.display());
                    self.faults.count(Some(tier), "index-read", &detail);
                    continue;
                }
            };
            match self.open_copy(tier, key, &entry) {
                Ok(Some(backing)) => {
                    if count {
                        tier.counters.add(tier_slot::HITS, 1);
                        log::debug!("{rel}: hit in {}", tier.config.path.display());
                    }
                    if look != Look::Quiet {
                        self.note_access(i, key);
                    }
                    return Some(backing);
                }
                Ok(None) => {
                    if count {
                        tier.counters.add(tier_slot::MISSES, 1);
                    }
                }
                Err(detail) => {
                    // A later look (under the fetch lock, or after the fetch) sees the same damage again: once is a fault.
                    if count {
                        tier.counters.add(tier_slot::MISSES, 1);
                        let detail =
                            format!("{detail} for {rel} in {}; it will be fetched again", tier.config.path.display());
                        self.faults.count(Some(tier), "bad-copy", &detail);
                    }
                }
            }
        }
        None
    }

    /// The blake3 recorded for the published copy of `rel` (key `key`) when it was made, if `file` is that
    /// copy and its inode last changed at `since_ns` or later (see [`crate::Cache::hash_of_new_copy`]).
    pub(super) fn hash_of_new_copy(&self, key: &Key, rel: &str, file: &std::fs::File, since_ns: u64) -> Option<Hash> {
        // Raw `fstat` and `lstat` (rustix), as `open_copy` explains.
        let held = rustix::fs::fstat(file).ok()?;
        let changed = held.st_ctime as i128 * 1_000_000_000 + held.st_ctime_nsec as i128;
        if changed < since_ns as i128 {
            return None;
        }
        // The tier's file is the one held before and after the entry is read: its entry is that copy's,
        // not one of a copy that replaced it meanwhile (a new copy is a new file renamed into place).
        let (t, e) = self.published_in(key, rel)?;
        let is_held = || {
            let at = rustix::fs::lstat(self.tiers[t].data_path(key)).ok()?;
            ((at.st_dev, at.st_ino) == (held.st_dev, held.st_ino)).then_some(())
        };
        is_held()?;
        let hash = e.checksum?;
        (e.source.size == held.st_size as u64).then_some(())?;
        is_held().map(|()| hash)
    }

    /// Opens and checks the copy of a ready entry. `Ok(None)`: evicted meanwhile (not a fault).
    fn open_copy(&self, tier: &Arc<Tier>, key: &Key, e: &Entry) -> Result<Option<Backing>, String> {
        let file = match tier.open_copy(key) {
            Ok(f) => f,
            // Under an evicting policy another thread or process may have evicted the copy since the
            // lookup: if its entry is gone or changed too, that is a miss, not damage.
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                let still = tier.index.as_ref().ok().and_then(|ix| ix.lookup_settled(key).ok().flatten());
                return match still {
                    Some(now)
                        if now.ready && now.source == e.source && now.stats.inserted_seq == e.stats.inserted_seq =>
                    {
                        Err("missing copy".into())
                    }
                    _ => Ok(None),
                };
            }
            Err(err) => return Err(format!("copy unreadable ({err})")),
        };
        // Only an evicting policy deletes copies readers may hold; `fill` never does, so skip the syscall.
        if self.policy.evicts() {
            lock_shared(&file).map_err(|err| format!("copy cannot be locked ({err})"))?;
        }
        // A raw `fstat` (rustix): std's `metadata` goes through libc's `statx`, which the shim, loaded
        // into the same process, interposes, and builds more than these fields.
        let m = rustix::fs::fstat(&file).map_err(|err| format!("copy cannot be inspected ({err})"))?;
        if m.st_nlink == 0 {
            return Ok(None);
        }
        if m.st_size as u64 != e.source.size {
            return Err(format!("truncated copy ({} of {} bytes)", m.st_size, e.source.size));
        }
        if m.st_mtime as i64 * 1_000_000_000 + m.st_mtime_nsec as i64 != e.source.mtime_ns {
            return Err("modified copy (its mtime changed)".into());
        }
        // The reader's `fstat` of the copy comes next under the shim (Python's `open` asks it of every
        // file): keep its answer and the descriptor in this thread's slot (`copy_stats.rs`), which answers
        // it without the kernel, rather than find the entry again through /proc then. Only once the shim
        // has asked for one: nothing else reads them.
        if self.copy_stats.wanted() {
            use std::os::fd::AsRawFd;
            if let Some(st) = e.source.to_stat() {
                let incarnation = (m.st_dev as u64, m.st_ino as u64, m.st_ctime as i64, m.st_ctime_nsec as i64);
                self.copy_stats.opened(incarnation, file.as_raw_fd(), st);
            }
        }
        if self.verify == Verify::Checksum {
            // A copy published without a checksum (while verification was by metadata) cannot be
            // vouched for: fetch it again, which records one. Not a fault.
            if e.checksum.is_none() {
                return Ok(None);
            }
            let mut bytes = Vec::with_capacity(m.st_size as usize);
            use std::io::Read;
            (&file).read_to_end(&mut bytes).map_err(|err| format!("copy unreadable ({err})"))?;
            if Some(crate::hash::hash_serial(&bytes)) != e.checksum {
                return Err("corrupted copy (checksum mismatch)".into());
            }
            tier.counters.add(tier_slot::BYTES_SERVED, bytes.len() as u64);
            return Ok(Some(Backing::Memory(Arc::new(bytes))));
        }
        Ok(Some(Backing::Copy(file, tier.clone())))
    }

    /// Counts a hit of the copy in `tier` for the evicting policy, written to the index in batches.
    fn note_access(&self, tier: usize, key: &Key) {
        if !self.policy.tracks_access() {
            return;
        }
        let n = {
            let mut a = self.access.lock().expect("access lock");
            let slot = a.entry((tier, *key)).or_insert((0, 0));
            slot.0 += 1;
            slot.1 = now_ns();
            a.len()
        };
        let due = n >= ACCESS_BATCH
            || self.last_access_flush.lock().expect("flush lock").elapsed().as_millis() >= ACCESS_FLUSH_MS;
        if due {
            self.flush_access();
        }
    }

    /// Writes pending hit statistics into the indexes (batched: one write transaction per tier).
    pub(super) fn flush_access(&self) {
        let batch = std::mem::take(&mut *self.access.lock().expect("access lock"));
        *self.last_access_flush.lock().expect("flush lock") = Instant::now();
        let mut per_tier: HashMap<usize, Vec<(Key, u64, u64)>> = HashMap::new();
        for ((t, k), (hits, last)) in batch {
            per_tier.entry(t).or_default().push((k, hits, last));
        }
        for (t, list) in per_tier {
            let tier = &self.tiers[t];
            if let Ok(ix) = &tier.index {
                if let Err(e) = ix.record_access(&list) {
                    self.faults.count(Some(tier), "access-stats", &format!("access statistics not written: {e}"));
                }
            }
        }
    }

    /// What `fstat` of the copies this process opened reports (see `copy_stats.rs`).
    pub(super) fn copy_stats(&self) -> &CopyStats {
        &self.copy_stats
    }
}
