//! The index of one tier: which files the tier holds, for which version of the source, how many bytes it
//! uses against its quota, and the eviction order. One LMDB environment per tier, shared by every process
//! of the node; every change of quota accounting happens inside LMDB's single write transaction, so
//! concurrent writers from many processes can never push a tier over its quota.
//!
//! How each record is laid out (entries, symlinks, listings, and their older formats) is in
//! `index/records.rs`; what the store answered about extended attributes, in `index/xattrs.rs`.

mod changes;
mod records;
mod xattrs;

use std::ops::{Deref, DerefMut};
use std::path::Path;

use crate::lmdb::{Db, Env, LmdbError, Txn};
use crate::placement::{AccessStats, Policy};

pub use records::{key_of, rel_text, Entry, Key, Link, Listed, Listing, SourceAttrs, SourceId};
pub use xattrs::{XattrAnswer, XattrQuery};

/// Failures of the index.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    /// LMDB failed.
    #[error(transparent)]
    Lmdb(#[from] LmdbError),
    /// A record could not be decoded: the index is damaged.
    #[error("damaged index record")]
    Damaged,
    /// The index's change numbers (see `index/changes.rs`) could not be opened.
    #[error("{}: {source}", path.display())]
    Changes {
        /// The file of the change numbers.
        path: std::path::PathBuf,
        /// Why it could not be opened.
        source: std::io::Error,
    },
}

/// Outcome of [`Index::reserve`].
#[derive(Debug, PartialEq, Eq)]
pub enum Reservation {
    /// The bytes are reserved and a pending entry is in the index.
    Reserved {
        /// Entries evicted to make room.
        evicted: u64,
    },
    /// The tier cannot take the entry.
    NoRoom {
        /// Entries evicted while trying (they stay evicted).
        evicted: u64,
    },
}

/// Usage of a tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Published entries.
    pub entries: u64,
    /// Bytes counted against the quota (published entries and reservations of fetches in flight).
    pub used: u64,
    /// Fetches in flight (reserved, not yet published).
    pub pending: u64,
}

/// The index of one tier.
pub struct Index {
    env: Env,
    entries: Db,
    ranks: Db,
    meta: Db,
    /// Directories under a trusted source, as `stat` described them (see [`Index::directory`]).
    dirs: Db,
    /// Symlinks under a trusted source: their `lstat` and where they lead (see [`Index::link`]).
    links: Db,
    /// Listings of source directories under a trusted source (see [`Index::listing`]).
    listings: Db,
    /// Extended attributes of paths under a trusted source, as the store answered (see [`Index::xattr`]).
    xattrs: Db,
    policy: Policy,
    /// The number of changes made to the index, for processes that keep what they looked up.
    changes: changes::Changes,
}

/// A write transaction that changes the index: numbered in its change numbers when it begins, and ended
/// there when it is committed or dropped (see `index/changes.rs`).
struct Changing<'i> {
    txn: Option<Txn<'i>>,
    number: u64,
    changes: &'i changes::Changes,
}

impl<'i> Changing<'i> {
    fn commit(mut self) -> Result<(), LmdbError> {
        self.txn.take().expect("a live transaction").commit()
    }
}

impl Drop for Changing<'_> {
    fn drop(&mut self) {
        drop(self.txn.take()); // aborted, unless committed: either way it has ended
        self.changes.end(self.number);
    }
}

impl<'i> Deref for Changing<'i> {
    type Target = Txn<'i>;
    fn deref(&self) -> &Txn<'i> {
        self.txn.as_ref().expect("a live transaction")
    }
}

impl DerefMut for Changing<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.txn.as_mut().expect("a live transaction")
    }
}

const USED: &[u8] = b"used";
const SEQ: &[u8] = b"seq";
/// The meta key of the source's `statfs` record (see [`Index::statfs`]).
const STATFS: &[u8] = b"statfs";

fn get_u64(txn: &crate::lmdb::Txn<'_>, db: Db, key: &[u8]) -> Result<u64, LmdbError> {
    Ok(txn.get(db, key)?.and_then(|b| b.try_into().ok()).map(u64::from_le_bytes).unwrap_or(0))
}

/// The meta key of the version a listing found in place of a cached one (see [`Index::superseded`]).
fn superseded_key(key: &Key) -> [u8; 27] {
    let mut k = [0u8; 27];
    k[..11].copy_from_slice(b"superseded:");
    k[11..].copy_from_slice(key);
    k
}

/// The time in a directory's confirmation record: its first 8 bytes (the directory's path follows since
/// issue #36; older records hold the time alone).
fn confirmed_at(record: Option<&[u8]>) -> u64 {
    record.and_then(|b| b.get(..8)).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes).unwrap_or(0)
}

/// The meta key of when a listing's entries were recorded (see [`Index::listed_at`]).
fn listed_key(key: &Key) -> [u8; 23] {
    let mut k = [0u8; 23];
    k[..7].copy_from_slice(b"listed:");
    k[7..].copy_from_slice(key);
    k
}

/// The meta key of a directory's last confirmation (see [`Index::confirm`]).
fn confirmed_key(dir: &Key) -> [u8; 26] {
    let mut k = [0u8; 26];
    k[..10].copy_from_slice(b"confirmed:");
    k[10..].copy_from_slice(dir);
    k
}

fn rank_key(rank: &[u8; 16], key: &Key) -> [u8; 32] {
    let mut k = [0u8; 32];
    k[..16].copy_from_slice(rank);
    k[16..].copy_from_slice(key);
    k
}

/// Called by eviction for each candidate: remove its copy if no reader holds it, and say whether it did.
pub type TryRemove<'a> = &'a mut dyn FnMut(&Key, &Entry) -> bool;

/// What a reservation is for: one version of one file, as the source showed it.
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    /// The file's key (see [`key_of`]).
    pub key: &'a Key,
    /// The file's path under the source.
    pub rel: &'a str,
    /// The version being fetched.
    pub source: SourceId,
    /// When the source showed that version (the copy's revalidation clock starts there).
    pub confirmed_ns: u64,
}

/// How a reservation may make room: the quota it must stay within, and, when it may evict, how to
/// remove a victim's copy.
pub struct Room<'a> {
    /// The bytes this source may hold in the tier.
    pub quota: u64,
    /// Whether to evict by the policy when the tier is full, and how; `None` takes only free room.
    pub evict: Option<TryRemove<'a>>,
}

impl Index {
    /// Opens (creating if needed) the index in directory `dir`.
    pub fn open(dir: &Path, policy: Policy) -> Result<Index, IndexError> {
        // 16 GiB of address space, not of memory or disk: LMDB's file grows only as records are added.
        let env = Env::open(dir, 16 << 30, &["entries", "ranks", "meta", "dirs", "links", "listings", "xattrs"])?;
        let path = dir.join("changes");
        let changes = changes::Changes::open(&path).map_err(|source| IndexError::Changes { path, source })?;
        Ok(Index {
            entries: env.db(0),
            ranks: env.db(1),
            meta: env.db(2),
            dirs: env.db(3),
            links: env.db(4),
            listings: env.db(5),
            xattrs: env.db(6),
            env,
            policy,
            changes,
        })
    }

    /// The index's change number now, `None` while a change is under way: a look at the index made after
    /// reading `Some(n)` is still current while this reads `Some(n)` (see `index/changes.rs`).
    pub fn changes(&self) -> Option<u64> {
        self.changes.now()
    }

    /// The write transaction of a change, numbered.
    fn change(&self) -> Result<Changing<'_>, LmdbError> {
        let txn = self.env.write()?;
        let number = self.changes.begin();
        Ok(Changing { txn: Some(txn), number, changes: &self.changes })
    }

    /// Leaks the environment (after `fork()`; see [`Env::forget`]).
    pub fn forget(self) {
        self.env.forget();
    }

    /// The entry of `key`, if any.
    pub fn lookup(&self, key: &Key) -> Result<Option<Entry>, IndexError> {
        let txn = self.env.read()?;
        match txn.get(self.entries, key)? {
            None => Ok(None),
            Some(b) => Entry::decode(b).map(Some).ok_or(IndexError::Damaged),
        }
    }

    /// The entries of `keys`, read in one transaction (a prefetch's look at a whole epoch's files); a
    /// damaged entry reads as none, as [`Index::lookup`]'s error makes the readers take it.
    pub fn lookup_each<'k>(&self, keys: impl IntoIterator<Item = &'k Key>) -> Result<Vec<Option<Entry>>, IndexError> {
        let txn = self.env.read()?;
        let mut found = Vec::new();
        for key in keys {
            found.push(txn.get(self.entries, key)?.and_then(Entry::decode));
        }
        Ok(found)
    }

    /// The entry of `key` once every write in progress has committed. Eviction removes a copy inside
    /// the write that deletes its entry, so a reader that found an entry and then no copy asks again
    /// here: an entry gone by then was evicted under it (a miss); one still there lost its copy (damage).
    pub fn lookup_settled(&self, key: &Key) -> Result<Option<Entry>, IndexError> {
        let txn = self.env.write()?; // waits for the writer in progress; dropped without committing
        match txn.get(self.entries, key)? {
            None => Ok(None),
            Some(b) => Entry::decode(b).map(Some).ok_or(IndexError::Damaged),
        }
    }

    fn delete(&self, txn: &mut crate::lmdb::Txn<'_>, key: &Key, e: &Entry) -> Result<(), LmdbError> {
        txn.del(self.entries, key)?;
        txn.del(self.ranks, &rank_key(&self.policy.rank(&e.stats), key))?;
        let used = get_u64(txn, self.meta, USED)?.saturating_sub(e.source.size);
        txn.put(self.meta, USED, &used.to_le_bytes())
    }

    /// Reserves room for the claimed file as a pending entry of this process, evicting by the policy when
    /// `room` allows it and the tier is full. An existing entry of the key is replaced (the caller holds
    /// the key's fetch lock, so it is stale or left by a dead fetcher).
    pub fn reserve(&self, claim: Claim<'_>, room: Room<'_>) -> Result<Reservation, IndexError> {
        let Claim { key, rel, source, confirmed_ns } = claim;
        let Room { quota, evict } = room;
        let mut txn = self.change()?;
        if let Some(old) = txn.get(self.entries, key)?.map(|b| Entry::decode(b).ok_or(IndexError::Damaged)) {
            self.delete(&mut txn, key, &old?)?;
        }
        let size = source.size;
        let mut used = get_u64(&txn, self.meta, USED)?;
        let mut evicted = 0;
        if let Some(try_remove) = evict.filter(|_| used + size > quota && size <= quota) {
            let mut from = Vec::new();
            'outer: loop {
                let mut batch: Vec<(Vec<u8>, Key)> = Vec::new();
                txn.scan(self.ranks, &from, |k, _| {
                    if k != from.as_slice() {
                        batch.push((k.to_vec(), k[16..32].try_into().expect("16 bytes")));
                    }
                    batch.len() < 64
                })?;
                if batch.is_empty() {
                    break;
                }
                from = batch.last().expect("non-empty").0.clone();
                for (_, victim) in batch {
                    if &victim == key {
                        continue;
                    }
                    let Some(e) = txn.get(self.entries, &victim)?.and_then(Entry::decode) else { continue };
                    if !e.ready || !try_remove(&victim, &e) {
                        continue;
                    }
                    self.delete(&mut txn, &victim, &e)?;
                    used = used.saturating_sub(e.source.size);
                    evicted += 1;
                    if used + size <= quota {
                        break 'outer;
                    }
                }
            }
        }
        if used + size > quota {
            txn.commit()?;
            return Ok(Reservation::NoRoom { evicted });
        }
        let entry = Entry {
            ready: false,
            pid: crate::process::pid(),
            source,
            stats: AccessStats::default(),
            checksum: None,
            rel: rel.to_string(),
            confirmed_ns,
        };
        txn.put(self.entries, key, &entry.encode())?;
        txn.del(self.meta, &superseded_key(key))?;
        txn.put(self.meta, USED, &(used + size).to_le_bytes())?;
        txn.commit()?;
        Ok(Reservation::Reserved { evicted })
    }

    /// Turns this process's pending entry of `key` into a published one. Returns false (and changes
    /// nothing) if the reservation is gone, for instance cleared by `tierstore clear`.
    pub fn publish(&self, key: &Key, checksum: Option<[u8; 32]>, now_ns: u64) -> Result<bool, IndexError> {
        let mut txn = self.change()?;
        let Some(mut e) = txn.get(self.entries, key)?.and_then(Entry::decode) else { return Ok(false) };
        if e.ready || e.pid != crate::process::pid() {
            return Ok(false);
        }
        let seq = get_u64(&txn, self.meta, SEQ)? + 1;
        txn.put(self.meta, SEQ, &seq.to_le_bytes())?;
        e.ready = true;
        e.checksum = checksum;
        e.stats = AccessStats { inserted_seq: seq, last_access_ns: now_ns, hits: 0 };
        txn.put(self.entries, key, &e.encode())?;
        txn.put(self.ranks, &rank_key(&self.policy.rank(&e.stats), key), &[])?;
        txn.commit()?;
        Ok(true)
    }

    /// What `stat` said of the source directory `rel` (key `key`), if it was recorded, and when (ns since
    /// the epoch; 0 for a record older than issue #36). Only a source whose copies are trusted
    /// (`revalidate = "never"`, or a duration) records directories: programs `stat` and `lstat` the
    /// directories of the files they open (Python's `os.path.realpath` asks each part of the path), and
    /// a warm cache must not send those to the store either. `attrs.canonical` says the record also
    /// answers `lstat`.
    pub fn directory(&self, key: &Key, rel: &str) -> Result<Option<(SourceId, u64)>, IndexError> {
        let txn = self.env.read()?;
        match txn.get(self.dirs, key)? {
            None => Ok(None),
            Some(b) => {
                let e = Entry::decode(b).ok_or(IndexError::Damaged)?;
                Ok((e.rel == rel).then_some((e.source, e.confirmed_ns)))
            }
        }
    }

    /// Records what `stat` (or with `attrs.canonical`, `lstat`) said of the source directory `rel` at
    /// `at_ns`.
    pub fn record_directory(&self, key: &Key, rel: &str, source: SourceId, at_ns: u64) -> Result<(), IndexError> {
        let e = Entry {
            ready: true,
            pid: 0,
            source,
            stats: AccessStats::default(),
            checksum: None,
            rel: rel.into(),
            confirmed_ns: at_ns,
        };
        let mut txn = self.change()?;
        txn.put(self.dirs, key, &e.encode())?;
        txn.commit()?;
        Ok(())
    }

    /// The symlink `rel` (key `key`) as it was recorded, if it was. Only a trusted source records links:
    /// walkers (`cp -a`, `tar`, `rsync`, `find`) `lstat` and `readlink` every link they meet, and
    /// `realpath` resolves them, so a warm cache answers all of these, and opens through the link reach
    /// the copy of the file it leads to.
    pub fn link(&self, key: &Key, rel: &str) -> Result<Option<Link>, IndexError> {
        let txn = self.env.read()?;
        match txn.get(self.links, key)? {
            None => Ok(None),
            Some(b) => {
                let (at, link) = Link::decode(b).ok_or(IndexError::Damaged)?;
                Ok((at == rel).then_some(link))
            }
        }
    }

    /// Records the symlink `rel`.
    pub fn record_link(&self, key: &Key, rel: &str, link: &Link) -> Result<(), IndexError> {
        let mut txn = self.change()?;
        txn.put(self.links, key, &link.encode(rel))?;
        txn.commit()?;
        Ok(())
    }

    /// Forgets what was recorded of the directory or symlink of `key` and of its extended attributes, and
    /// the `statfs` record (a change through tierstore changes the file system's free counts).
    pub fn forget_path(&self, key: &Key) -> Result<(), IndexError> {
        let mut txn = self.change()?;
        txn.del(self.dirs, key)?;
        txn.del(self.links, key)?;
        txn.del(self.xattrs, key)?;
        txn.del(self.meta, STATFS)?;
        txn.commit()?;
        Ok(())
    }

    /// The listing of the source directory of `key`: the directory's source-relative path, and its entries
    /// as `readdir` returned them, in order, unless a change through tierstore made them stale. Only a
    /// trusted source records listings: walkers (find, cp -r, tar, rsync) list every directory they meet,
    /// and a warm cache answers those listings from here (the shim hands out a descriptor of an empty
    /// directory of the tier that stands for the source's, and replays this record to `readdir`). The
    /// path stays when the entries are forgotten, so that a descriptor handed out before still names its
    /// directory.
    pub fn listing(&self, key: &Key) -> Result<Option<Listing>, IndexError> {
        let txn = self.env.read()?;
        match txn.get(self.listings, key)? {
            None => Ok(None),
            Some(b) => Listed::decode(b).map(Some).ok_or(IndexError::Damaged),
        }
    }

    /// When the entries of the listing of `key` were recorded (ns since the epoch; 0: not known, for a
    /// record older than issue #36).
    pub fn listed_at(&self, key: &Key) -> Result<u64, IndexError> {
        let txn = self.env.read()?;
        Ok(get_u64(&txn, self.meta, &listed_key(key))?)
    }

    /// Records the listing of the source directory `rel` (key `key`) as the store gave it at `at_ns`;
    /// `None`: only its path.
    pub fn record_listing(
        &self,
        key: &Key,
        rel: &str,
        entries: Option<&[Listed]>,
        at_ns: u64,
    ) -> Result<(), IndexError> {
        let mut txn = self.change()?;
        txn.put(self.listings, key, &Listed::encode(rel, entries))?;
        if entries.is_some() {
            txn.put(self.meta, &listed_key(key), &at_ns.to_le_bytes())?;
        }
        txn.commit()?;
        Ok(())
    }

    /// Forgets the entries of the listing of `key` (the directory changed), keeping its path.
    pub fn forget_listing(&self, key: &Key) -> Result<(), IndexError> {
        let mut txn = self.change()?;
        let rel = match txn.get(self.listings, key)? {
            Some(b) => match Listed::decode(b) {
                Some((_, None)) => return Ok(()),
                Some((rel, Some(_))) => rel,
                None => return Ok(()),
            },
            None => return Ok(()),
        };
        txn.put(self.listings, key, &Listed::encode(&rel, None))?;
        txn.commit()?;
        Ok(())
    }

    /// What `statfs` said of the source's file system, if it was recorded: programs that walk a tree
    /// (GNU find, through fts) ask it of every directory they open, to choose how to walk. Only a trusted
    /// source records it, once; a change through tierstore forgets it, since it changes the free counts.
    pub fn statfs(&self) -> Result<Option<Vec<u8>>, IndexError> {
        let txn = self.env.read()?;
        Ok(txn.get(self.meta, STATFS)?.map(<[u8]>::to_vec))
    }

    /// Records the source's `statfs` answer (its bytes; the index never leaves the node).
    pub fn record_statfs(&self, raw: &[u8]) -> Result<(), IndexError> {
        let mut txn = self.change()?;
        txn.put(self.meta, STATFS, raw)?;
        txn.commit()?;
        Ok(())
    }

    /// Records that the source showed each `(key, version)` at `at_ns`, in one listing of the directory
    /// whose confirmation key is `dir`: every published entry of such a key whose version is that one is
    /// confirmed then; an entry of another version, or of a file the listing did not show, is left as it
    /// is, and the directory's own record says that it was not confirmed with the others (see
    /// [`Index::directory_confirmed`]). One write for all of them. Returns how many entries were confirmed.
    /// `dir_rel` is the directory's source-relative path, kept with the time so that
    /// [`Index::directories_confirmed_before`] can name the directories to confirm again.
    pub fn confirm(&self, dir: &Key, dir_rel: &str, seen: &[(Key, SourceId)], at_ns: u64) -> Result<usize, IndexError> {
        let mut txn = self.change()?;
        if confirmed_at(txn.get(self.meta, &confirmed_key(dir))?) < at_ns {
            let mut record = at_ns.to_le_bytes().to_vec();
            record.extend_from_slice(dir_rel.as_bytes());
            txn.put(self.meta, &confirmed_key(dir), &record)?;
        }
        let mut confirmed = 0;
        for (key, sid) in seen {
            let Some(mut e) = txn.get(self.entries, key)?.and_then(Entry::decode) else { continue };
            if !e.ready || e.confirmed_ns >= at_ns {
                continue;
            }
            if e.source != *sid {
                // Another version is on the source now: remembered, so that the open of this file does not
                // ask the source again what the listing just said.
                let listed =
                    Entry { source: *sid, ready: false, pid: 0, checksum: None, stats: AccessStats::default(), ..e };
                let mut v = at_ns.to_le_bytes().to_vec();
                v.extend_from_slice(&listed.encode());
                txn.put(self.meta, &superseded_key(key), &v)?;
                continue;
            }
            e.confirmed_ns = at_ns;
            txn.put(self.entries, key, &e.encode())?;
            confirmed += 1;
        }
        txn.commit()?;
        Ok(confirmed)
    }

    /// The version of `key`'s file that a listing found on the source in place of the cached one, and when
    /// (see [`Index::confirm`]); forgotten once the file is fetched again.
    pub fn superseded(&self, key: &Key) -> Result<Option<(u64, SourceId)>, IndexError> {
        let txn = self.env.read()?;
        let Some(b) = txn.get(self.meta, &superseded_key(key))? else { return Ok(None) };
        let at = b.get(..8).and_then(|a| a.try_into().ok()).map(u64::from_le_bytes).ok_or(IndexError::Damaged)?;
        let e = Entry::decode(&b[8..]).ok_or(IndexError::Damaged)?;
        Ok(Some((at, e.source)))
    }

    /// When the directory whose confirmation key is `dir` was last listed to confirm its copies (0: never).
    /// A copy older than that listing was not confirmed by it: its file changed or went.
    pub fn directory_confirmed(&self, dir: &Key) -> Result<u64, IndexError> {
        let txn = self.env.read()?;
        Ok(confirmed_at(txn.get(self.meta, &confirmed_key(dir))?))
    }

    /// The source-relative paths of the directories last confirmed before `before_ns`: those whose
    /// copies need confirming again. A record written before paths were kept names none.
    pub fn directories_confirmed_before(&self, before_ns: u64) -> Result<Vec<String>, IndexError> {
        let txn = self.env.read()?;
        let mut out = Vec::new();
        txn.scan(self.meta, b"confirmed:", |k, v| {
            if !k.starts_with(b"confirmed:") {
                return false;
            }
            if v.len() > 8 && confirmed_at(Some(v)) < before_ns {
                if let Ok(dir) = std::str::from_utf8(&v[8..]) {
                    out.push(dir.to_string());
                }
            }
            true
        })?;
        Ok(out)
    }

    /// Removes the entry of `key` if `matches` approves of it; returns the removed entry.
    pub fn remove_if(&self, key: &Key, matches: impl Fn(&Entry) -> bool) -> Result<Option<Entry>, IndexError> {
        let mut txn = self.change()?;
        let Some(e) = txn.get(self.entries, key)?.and_then(Entry::decode) else { return Ok(None) };
        if !matches(&e) {
            return Ok(None);
        }
        self.delete(&mut txn, key, &e)?;
        txn.commit()?;
        Ok(Some(e))
    }

    /// Writes a batch of access statistics (hits since the last batch, last access time) and re-ranks.
    pub fn record_access(&self, batch: &[(Key, u64, u64)]) -> Result<(), IndexError> {
        let mut txn = self.env.write()?;
        for (key, hits, last_ns) in batch {
            let Some(mut e) = txn.get(self.entries, key)?.and_then(Entry::decode) else { continue };
            if !e.ready {
                continue;
            }
            txn.del(self.ranks, &rank_key(&self.policy.rank(&e.stats), key))?;
            e.stats.hits += hits;
            e.stats.last_access_ns = e.stats.last_access_ns.max(*last_ns);
            txn.put(self.ranks, &rank_key(&self.policy.rank(&e.stats), key), &[])?;
            txn.put(self.entries, key, &e.encode())?;
        }
        txn.commit()?;
        Ok(())
    }

    /// Every entry, in key order.
    pub fn entries(&self) -> Result<Vec<(Key, Entry)>, IndexError> {
        let txn = self.env.read()?;
        let mut out = Vec::new();
        txn.scan(self.entries, &[], |k, v| {
            if let (Ok(k), Some(e)) = (k.try_into(), Entry::decode(v)) {
                out.push((k, e));
            }
            true
        })?;
        Ok(out)
    }

    /// Entries, bytes used and fetches in flight.
    pub fn usage(&self) -> Result<Usage, IndexError> {
        let txn = self.env.read()?;
        let used = get_u64(&txn, self.meta, USED)?;
        let mut u = Usage { used, ..Usage::default() };
        txn.scan(self.entries, &[], |_, v| {
            if Entry::ready_in(v) {
                u.entries += 1;
            } else {
                u.pending += 1;
            }
            true
        })?;
        Ok(u)
    }

    /// Bytes counted against the quota (the hot part of [`Index::usage`]).
    pub fn usage_bytes(&self) -> Result<u64, IndexError> {
        let txn = self.env.read()?;
        Ok(get_u64(&txn, self.meta, USED)?)
    }

    /// Forgets every entry (the caller removes the copies).
    pub fn clear(&self) -> Result<(), IndexError> {
        let mut txn = self.change()?;
        txn.clear(self.dirs)?;
        txn.clear(self.links)?;
        txn.clear(self.listings)?;
        txn.clear(self.xattrs)?;
        txn.del(self.meta, STATFS)?;
        txn.clear(self.entries)?;
        txn.clear(self.ranks)?;
        txn.put(self.meta, USED, &0u64.to_le_bytes())?;
        txn.commit()?;
        Ok(())
    }

    /// The store's recorded answer to `query` about the source path `rel` (key `key`), if it was asked
    /// since the path last changed through tierstore.
    pub fn xattr(&self, key: &Key, rel: &str, query: &XattrQuery) -> Result<Option<XattrAnswer>, IndexError> {
        let txn = self.env.read()?;
        let Some(b) = txn.get(self.xattrs, key)? else { return Ok(None) };
        let r = xattrs::Record::decode(b).ok_or(IndexError::Damaged)?;
        if r.rel != rel {
            return Ok(None); // a key collision: not this path's record
        }
        Ok(r.answers.into_iter().find(|(q, _)| q == query).map(|(_, a)| a))
    }

    /// Records the store's answer to `query` about the source path `rel`, beside the answers already
    /// recorded for it.
    pub fn record_xattr(
        &self,
        key: &Key,
        rel: &str,
        query: &XattrQuery,
        answer: &XattrAnswer,
    ) -> Result<(), IndexError> {
        let mut txn = self.change()?;
        let mut r = match txn.get(self.xattrs, key)?.and_then(xattrs::Record::decode) {
            Some(r) if r.rel == rel => r,
            _ => xattrs::Record { rel: rel.into(), answers: Vec::new() },
        };
        r.answers.retain(|(q, _)| q != query);
        r.answers.push((query.clone(), answer.clone()));
        txn.put(self.xattrs, key, &r.encode())?;
        txn.commit()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sid(size: u64) -> SourceId {
        SourceId { size, mtime_ns: 1, ctime_ns: 4, ino: 2, dev: 3, attrs: None }
    }

    #[test]
    fn links_round_trip_and_are_forgotten_with_the_statfs_record() {
        let dir = tempfile::tempdir().unwrap();
        let idx = Index::open(dir.path(), Policy::Fill).unwrap();
        let k = key_of("a/link");
        let link = Link { lstat: sid(10), target: b"../b".to_vec(), resolved: Some(b"/src/b".to_vec()) };
        idx.record_link(&k, "a/link", &link).unwrap();
        idx.record_statfs(&[1, 2, 3]).unwrap();
        assert_eq!(idx.link(&k, "a/link").unwrap(), Some(link.clone()));
        assert_eq!(idx.link(&k, "other").unwrap(), None, "a key collision is not the link");
        let dangling = Link { resolved: None, ..link };
        idx.record_link(&k, "a/link", &dangling).unwrap();
        assert_eq!(idx.link(&k, "a/link").unwrap(), Some(dangling));
        assert_eq!(idx.statfs().unwrap(), Some(vec![1, 2, 3]));
        idx.forget_path(&k).unwrap();
        assert_eq!(idx.link(&k, "a/link").unwrap(), None);
        assert_eq!(idx.statfs().unwrap(), None);
    }

    #[test]
    fn listings_round_trip_and_forgetting_keeps_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let ix = Index::open(dir.path(), Policy::Fill).unwrap();
        let key = key_of("a/b");
        assert_eq!(ix.listing(&key).unwrap(), None);
        let entries = vec![
            Listed { ino: 1, kind: libc::DT_DIR, name: b".".to_vec() },
            Listed { ino: u64::MAX, kind: libc::DT_UNKNOWN, name: "é x".as_bytes().to_vec() },
        ];
        assert_eq!(ix.listed_at(&key).unwrap(), 0);
        ix.record_listing(&key, "a/b", Some(&entries), 77).unwrap();
        assert_eq!(ix.listed_at(&key).unwrap(), 77);
        assert_eq!(ix.listing(&key).unwrap(), Some(("a/b".into(), Some(entries))));
        ix.forget_listing(&key).unwrap();
        assert_eq!(ix.listing(&key).unwrap(), Some(("a/b".into(), None)));
        ix.record_listing(&key, "a/b", Some(&[]), 78).unwrap();
        assert_eq!(ix.listed_at(&key).unwrap(), 78);
        assert_eq!(ix.listing(&key).unwrap(), Some(("a/b".into(), Some(vec![]))));
        ix.clear().unwrap();
        assert_eq!(ix.listing(&key).unwrap(), None);
    }

    #[test]
    fn confirming_a_listing_touches_only_published_entries_of_the_listed_version() {
        let dir = tempfile::tempdir().unwrap();
        let idx = Index::open(dir.path(), Policy::Fill).unwrap();
        for (name, size) in [("d/same", 10), ("d/changed", 20), ("d/pending", 30)] {
            idx.reserve(
                Claim { key: &key_of(name), rel: name, source: sid(size), confirmed_ns: 5 },
                Room { quota: 1000, evict: None },
            )
            .unwrap();
        }
        idx.publish(&key_of("d/same"), None, 1).unwrap();
        idx.publish(&key_of("d/changed"), None, 1).unwrap();
        let seen = [
            (key_of("d/same"), sid(10)),
            (key_of("d/changed"), sid(21)),
            (key_of("d/pending"), sid(30)),
            (key_of("d/unknown"), sid(1)),
        ];
        let dir = key_of("\0d");
        assert_eq!(idx.directory_confirmed(&dir).unwrap(), 0);
        assert_eq!(idx.confirm(&dir, "d", &seen, 100).unwrap(), 1);
        let at = |name: &str| idx.lookup(&key_of(name)).unwrap().unwrap().confirmed_ns;
        assert_eq!((at("d/same"), at("d/changed"), at("d/pending")), (100, 5, 5));
        assert_eq!(idx.directory_confirmed(&dir).unwrap(), 100);
        assert_eq!(idx.superseded(&key_of("d/changed")).unwrap(), Some((100, sid(21))));
        assert_eq!(idx.superseded(&key_of("d/same")).unwrap(), None);
        assert_eq!(idx.confirm(&dir, "d", &seen, 50).unwrap(), 0, "an older confirmation never goes back in time");
        assert_eq!((at("d/same"), idx.directory_confirmed(&dir).unwrap()), (100, 100));
        // The directories to confirm again, by path: "d" once its record is older than asked.
        idx.confirm(&key_of("\0e"), "e/f", &[], 300).unwrap();
        assert_eq!(idx.directories_confirmed_before(100).unwrap(), Vec::<String>::new());
        assert_eq!(idx.directories_confirmed_before(101).unwrap(), ["d"]);
        let mut both = idx.directories_confirmed_before(301).unwrap();
        both.sort();
        assert_eq!(both, ["d", "e/f"]);
    }

    #[test]
    fn quota_is_never_exceeded_and_eviction_follows_the_policy() {
        let dir = tempfile::tempdir().unwrap();
        let idx = Index::open(dir.path(), Policy::Fifo).unwrap();
        for i in 0..3 {
            let k = key_of(&format!("f{i}"));
            let r = idx
                .reserve(
                    Claim { key: &k, rel: &format!("f{i}"), source: sid(40), confirmed_ns: 0 },
                    Room { quota: 100, evict: None },
                )
                .unwrap();
            if i < 2 {
                assert_eq!(r, Reservation::Reserved { evicted: 0 });
                assert!(idx.publish(&k, None, i).unwrap());
            } else {
                assert_eq!(r, Reservation::NoRoom { evicted: 0 });
            }
        }
        assert_eq!(idx.usage().unwrap(), Usage { entries: 2, used: 80, pending: 0 });
        let mut removed = Vec::new();
        let mut remove = |_: &Key, e: &Entry| {
            removed.push(e.rel.clone());
            true
        };
        let k = key_of("f2");
        assert_eq!(
            idx.reserve(
                Claim { key: &k, rel: "f2", source: sid(40), confirmed_ns: 0 },
                Room { quota: 100, evict: Some(&mut remove) }
            )
            .unwrap(),
            Reservation::Reserved { evicted: 1 }
        );
        assert_eq!(removed, vec!["f0".to_string()]);
        assert_eq!(idx.usage().unwrap(), Usage { entries: 1, used: 80, pending: 1 });
    }

    #[test]
    fn locked_victims_are_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let idx = Index::open(dir.path(), Policy::Lru).unwrap();
        for i in 0..2 {
            let k = key_of(&format!("f{i}"));
            idx.reserve(
                Claim { key: &k, rel: &format!("f{i}"), source: sid(50), confirmed_ns: 0 },
                Room { quota: 100, evict: None },
            )
            .unwrap();
            idx.publish(&k, None, 10 + i).unwrap();
        }
        // f0 is older, but a reader holds it: f1 goes instead.
        let mut busy_f0 = |_: &Key, e: &Entry| e.rel != "f0";
        let r = idx
            .reserve(
                Claim { key: &key_of("n"), rel: "n", source: sid(50), confirmed_ns: 0 },
                Room { quota: 100, evict: Some(&mut busy_f0) },
            )
            .unwrap();
        assert_eq!(r, Reservation::Reserved { evicted: 1 });
        assert!(idx.lookup(&key_of("f0")).unwrap().is_some());
        assert!(idx.lookup(&key_of("f1")).unwrap().is_none());
    }

    #[test]
    fn answers_round_trip_per_question_and_are_forgotten_with_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let ix = Index::open(dir.path(), Policy::Fill).unwrap();
        let key = key_of("a/b");
        let get = |name: &[u8], follow| XattrQuery { name: Some(name.to_vec()), follow };
        let list = XattrQuery { name: None, follow: false };
        let acl = get(b"system.posix_acl_access", false);
        assert_eq!(ix.xattr(&key, "a/b", &list).unwrap(), None);
        ix.record_xattr(&key, "a/b", &list, &XattrAnswer::Value(b"user.x\0".to_vec())).unwrap();
        ix.record_xattr(&key, "a/b", &acl, &XattrAnswer::Errno(libc::ENODATA)).unwrap();
        ix.record_xattr(&key, "a/b", &get(b"user.x", false), &XattrAnswer::Value(vec![])).unwrap();
        assert_eq!(ix.xattr(&key, "a/b", &list).unwrap(), Some(XattrAnswer::Value(b"user.x\0".to_vec())));
        assert_eq!(ix.xattr(&key, "a/b", &acl).unwrap(), Some(XattrAnswer::Errno(libc::ENODATA)));
        assert_eq!(ix.xattr(&key, "a/b", &get(b"user.x", false)).unwrap(), Some(XattrAnswer::Value(vec![])));
        assert_eq!(ix.xattr(&key, "a/b", &get(b"user.y", false)).unwrap(), None, "never asked");
        assert_eq!(ix.xattr(&key, "a/b", &get(b"user.x", true)).unwrap(), None, "asked without following only");
        assert_eq!(ix.xattr(&key, "other", &list).unwrap(), None, "a key collision is not the path");
        // A new answer to the same question replaces the old one.
        ix.record_xattr(&key, "a/b", &list, &XattrAnswer::Value(vec![])).unwrap();
        assert_eq!(ix.xattr(&key, "a/b", &list).unwrap(), Some(XattrAnswer::Value(vec![])));
        ix.forget_path(&key).unwrap();
        assert_eq!(ix.xattr(&key, "a/b", &acl).unwrap(), None);
        ix.record_xattr(&key, "a/b", &acl, &XattrAnswer::Errno(libc::EOPNOTSUPP)).unwrap();
        ix.clear().unwrap();
        assert_eq!(ix.xattr(&key, "a/b", &acl).unwrap(), None);
    }
}
