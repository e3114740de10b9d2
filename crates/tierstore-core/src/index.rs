//! The index of one tier: which files the tier holds, for which version of the source, how many bytes it
//! uses against its quota, and the eviction order. One LMDB environment per tier, shared by every process
//! of the node; every change of quota accounting happens inside LMDB's single write transaction, so
//! concurrent writers from many processes can never push a tier over its quota.

use std::path::Path;

use crate::lmdb::{Db, Env, LmdbError};
use crate::placement::{AccessStats, Policy};

mod xattrs;
pub use xattrs::{XattrAnswer, XattrQuery};

/// A 16-byte key: blake3 of the file's path relative to the source (LMDB keys are at most 511 bytes;
/// paths are not).
pub type Key = [u8; 16];

/// Hashes a source-relative path into its index key.
pub fn key_of(rel: &str) -> Key {
    let h = blake3::hash(rel.as_bytes());
    h.as_bytes()[..16].try_into().expect("16 bytes")
}

/// The identity of a source file version, and the rest of what `stat` said of it. A cached copy is valid
/// only for the identity it was taken from.
///
/// Identity is size, mtime, ctime, inode and device: a file rewritten in place with its old mtime put back
/// has a new ctime, and chmod, chown and link change ctime too. `attrs` are not compared (atime moves on
/// every read); they are what the shim reports for a cached file without asking the source.
#[derive(Clone, Copy, Debug, Default)]
pub struct SourceId {
    /// Size in bytes.
    pub size: u64,
    /// Modification time in nanoseconds since the epoch.
    pub mtime_ns: i64,
    /// Status change time in nanoseconds since the epoch (0 when an older index did not record it).
    pub ctime_ns: i64,
    /// Inode number (a file replaced by rename has a new one).
    pub ino: u64,
    /// Device number.
    pub dev: u64,
    /// The rest of the source's `stat`, when it was recorded.
    pub attrs: Option<SourceAttrs>,
}

impl PartialEq for SourceId {
    fn eq(&self, other: &SourceId) -> bool {
        (self.size, self.mtime_ns, self.ctime_ns, self.ino, self.dev)
            == (other.size, other.mtime_ns, other.ctime_ns, other.ino, other.dev)
    }
}

impl Eq for SourceId {}

/// What `stat` reported of a source file besides its identity, so that `stat`, `lstat` and `fstat` of a
/// cached file can be answered exactly as the source would answer them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SourceAttrs {
    /// Type and permission bits.
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Hard links.
    pub nlink: u64,
    /// Access time in nanoseconds since the epoch, as it was when the file was identified.
    pub atime_ns: i64,
    /// Preferred I/O size.
    pub blksize: u64,
    /// 512-byte blocks allocated.
    pub blocks: u64,
    /// The path names the file itself, with no symlink at or below the source root: its `lstat` is its
    /// `stat` and its real path is the source's real path joined with it. Known only when the file was
    /// identified through an open descriptor; false otherwise, and then those calls ask the source.
    pub canonical: bool,
}

fn ns(sec: i64, nsec: i64) -> i64 {
    sec * 1_000_000_000 + nsec
}

impl SourceId {
    /// The identity of a file from its metadata.
    pub fn of(m: &std::fs::Metadata) -> SourceId {
        use std::os::unix::fs::MetadataExt;
        SourceId {
            size: m.size(),
            mtime_ns: ns(m.mtime(), m.mtime_nsec()),
            ctime_ns: ns(m.ctime(), m.ctime_nsec()),
            ino: m.ino(),
            dev: m.dev(),
            attrs: Some(SourceAttrs {
                mode: m.mode(),
                uid: m.uid(),
                gid: m.gid(),
                nlink: m.nlink(),
                atime_ns: ns(m.atime(), m.atime_nsec()),
                blksize: m.blksize(),
                blocks: m.blocks(),
                canonical: false,
            }),
        }
    }

    /// The identity of a file from a `stat` buffer.
    pub fn of_stat(st: &libc::stat) -> SourceId {
        SourceId {
            size: st.st_size as u64,
            mtime_ns: ns(st.st_mtime, st.st_mtime_nsec),
            ctime_ns: ns(st.st_ctime, st.st_ctime_nsec),
            ino: st.st_ino,
            dev: st.st_dev,
            attrs: Some(SourceAttrs {
                mode: st.st_mode,
                uid: st.st_uid,
                gid: st.st_gid,
                nlink: st.st_nlink,
                atime_ns: ns(st.st_atime, st.st_atime_nsec),
                blksize: st.st_blksize as u64,
                blocks: st.st_blocks as u64,
                canonical: false,
            }),
        }
    }

    /// The `stat` the source gave for this version, rebuilt from the record; `None` when an older index
    /// recorded only the identity.
    pub fn to_stat(&self) -> Option<libc::stat> {
        let a = self.attrs?;
        // SAFETY: a plain C struct, all zeros is valid.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        st.st_dev = self.dev;
        st.st_ino = self.ino;
        st.st_mode = a.mode;
        st.st_nlink = a.nlink as _;
        st.st_uid = a.uid;
        st.st_gid = a.gid;
        st.st_size = self.size as i64;
        st.st_blksize = a.blksize as _;
        st.st_blocks = a.blocks as i64;
        (st.st_atime, st.st_atime_nsec) = (a.atime_ns.div_euclid(1_000_000_000), a.atime_ns.rem_euclid(1_000_000_000));
        (st.st_mtime, st.st_mtime_nsec) =
            (self.mtime_ns.div_euclid(1_000_000_000), self.mtime_ns.rem_euclid(1_000_000_000));
        (st.st_ctime, st.st_ctime_nsec) =
            (self.ctime_ns.div_euclid(1_000_000_000), self.ctime_ns.rem_euclid(1_000_000_000));
        Some(st)
    }
}

/// One record of the index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// True once the copy is published; false while a fetch holds the reservation.
    pub ready: bool,
    /// The process that reserved the entry (meaningful while not ready).
    pub pid: u32,
    /// The source version the copy was taken from; also the bytes it uses in the tier.
    pub source: SourceId,
    /// What the eviction policy ranks by.
    pub stats: AccessStats,
    /// blake3 of the copy, when known.
    pub checksum: Option<[u8; 32]>,
    /// The source-relative path (for listings, and to check key collisions).
    pub rel: String,
    /// When the source last showed this version (nanoseconds since the epoch; 0: not known): taken before
    /// the request that identified it, so never later than the truth. `revalidate = "<duration>"` uses
    /// the copy without asking the source while this is recent enough.
    pub confirmed_ns: u64,
}

/// Layout of a record: a format byte (`FORMAT` | ready), the pid, seven u64s (size, mtime, inode, device,
/// and the three access statistics), the checksum flag and checksum, then (format 2) ctime and the
/// recorded attributes, then (format 3) the confirmation time, then the path. Older records still
/// decode: format 1 (no format bits, no ctime) with a ctime of 0, so that with revalidation they no longer
/// match the source and are fetched again; formats 1 and 2 with no confirmation time (0: confirm first).
const HEADER_V1: usize = 1 + 4 + 8 * 7 + 1 + 32;
const ATTRS: usize = 8 + 1 + 4 * 3 + 8 * 4 + 1;
const HEADER_V2: usize = HEADER_V1 + ATTRS;
const HEADER: usize = HEADER_V2 + 8;
const FORMAT_V2: u8 = 0x20;
const FORMAT: u8 = 0x30;

impl Entry {
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(HEADER + self.rel.len());
        v.push(FORMAT | self.ready as u8);
        v.extend_from_slice(&self.pid.to_le_bytes());
        for x in [
            self.source.size,
            self.source.mtime_ns as u64,
            self.source.ino,
            self.source.dev,
            self.stats.inserted_seq,
            self.stats.last_access_ns,
            self.stats.hits,
        ] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        v.push(self.checksum.is_some() as u8);
        v.extend_from_slice(&self.checksum.unwrap_or([0; 32]));
        v.extend_from_slice(&self.source.ctime_ns.to_le_bytes());
        let a = self.source.attrs.unwrap_or_default();
        v.push(self.source.attrs.is_some() as u8);
        for x in [a.mode, a.uid, a.gid] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        for x in [a.nlink, a.atime_ns as u64, a.blksize, a.blocks] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        v.push(a.canonical as u8);
        v.extend_from_slice(&self.confirmed_ns.to_le_bytes());
        v.extend_from_slice(self.rel.as_bytes());
        v
    }

    /// Whether an encoded record is published, read without decoding it.
    fn ready_in(b: &[u8]) -> bool {
        b.first().is_some_and(|f| f & 1 == 1)
    }

    fn decode(b: &[u8]) -> Option<Entry> {
        let format = b.first()? & 0xf0;
        let (v2, v3) = (format == FORMAT_V2 || format == FORMAT, format == FORMAT);
        if b.len()
            < if v3 {
                HEADER
            } else if v2 {
                HEADER_V2
            } else {
                HEADER_V1
            }
        {
            return None;
        }
        let u = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        let w = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        let field = |i: usize| u(5 + 8 * i);
        let has_sum = b[5 + 56] == 1;
        let sum: [u8; 32] = b[62..94].try_into().expect("32 bytes");
        let (ctime_ns, attrs, rel_at) = if v2 {
            let at = HEADER_V1;
            let attrs = (b[at + 8] == 1).then(|| SourceAttrs {
                mode: w(at + 9),
                uid: w(at + 13),
                gid: w(at + 17),
                nlink: u(at + 21),
                atime_ns: u(at + 29) as i64,
                blksize: u(at + 37),
                blocks: u(at + 45),
                canonical: b[at + 53] == 1,
            });
            (u(at) as i64, attrs, if v3 { HEADER } else { HEADER_V2 })
        } else {
            (0, None, HEADER_V1)
        };
        let confirmed_ns = if v3 { u(HEADER_V2) } else { 0 };
        Some(Entry {
            ready: b[0] & 1 == 1,
            pid: w(1),
            source: SourceId {
                size: field(0),
                mtime_ns: field(1) as i64,
                ctime_ns,
                ino: field(2),
                dev: field(3),
                attrs,
            },
            stats: AccessStats { inserted_seq: field(4), last_access_ns: field(5), hits: field(6) },
            checksum: has_sum.then_some(sum),
            rel: String::from_utf8_lossy(&b[rel_at..]).into_owned(),
            confirmed_ns,
        })
    }
}

/// Failures of the index.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    /// LMDB failed.
    #[error(transparent)]
    Lmdb(#[from] LmdbError),
    /// A record could not be decoded: the index is damaged.
    #[error("damaged index record")]
    Damaged,
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
}

const USED: &[u8] = b"used";
const SEQ: &[u8] = b"seq";
/// The meta key of the source's `statfs` record (see [`Index::statfs`]).
const STATFS: &[u8] = b"statfs";

/// A symlink under a trusted source, recorded the first time it is seen (see [`Index::link`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    /// What `lstat` said of the link itself.
    pub lstat: SourceId,
    /// Its contents, as `readlink` returns them.
    pub target: Vec<u8>,
    /// The absolute path it resolves to with every symlink followed (`realpath`); `None` when it led
    /// nowhere when it was recorded (dangling, a loop): then only the source can answer what follows it.
    pub resolved: Option<Vec<u8>>,
}

impl Link {
    /// The lstat record (an [`Entry`] naming `rel`), the target's length and the target, then the
    /// resolved path (absent when empty: a resolved path is absolute, never empty).
    fn encode(&self, rel: &str) -> Vec<u8> {
        let e = Entry {
            ready: true,
            pid: 0,
            source: self.lstat,
            stats: AccessStats::default(),
            checksum: None,
            rel: rel.into(),
            confirmed_ns: 0,
        };
        let entry = e.encode();
        let mut v = Vec::with_capacity(8 + entry.len() + self.target.len());
        v.extend_from_slice(&(entry.len() as u32).to_le_bytes());
        v.extend_from_slice(&entry);
        v.extend_from_slice(&(self.target.len() as u32).to_le_bytes());
        v.extend_from_slice(&self.target);
        v.extend_from_slice(self.resolved.as_deref().unwrap_or_default());
        v
    }

    fn decode(b: &[u8]) -> Option<(String, Link)> {
        let len = |at: usize| Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?) as usize);
        let n = len(0)?;
        let e = Entry::decode(b.get(4..4 + n)?)?;
        let t = len(4 + n)?;
        let target = b.get(8 + n..8 + n + t)?.to_vec();
        let rest = &b[8 + n + t..];
        let resolved = (!rest.is_empty()).then(|| rest.to_vec());
        Some((e.rel, Link { lstat: e.source, target, resolved }))
    }
}

/// A recorded listing: the directory's source-relative path, and its entries unless they were forgotten.
pub type Listing = (String, Option<Vec<Listed>>);

/// One entry of a directory listing, as `readdir` returned it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listed {
    /// `d_ino`.
    pub ino: u64,
    /// `d_type` (`DT_UNKNOWN` when the file system does not say).
    pub kind: u8,
    /// `d_name`, without its NUL.
    pub name: Vec<u8>,
}

impl Listed {
    /// The path's length and the path, then a flag (1: the entries follow), then per entry its inode,
    /// type, name length and name.
    fn encode(rel: &str, entries: Option<&[Listed]>) -> Vec<u8> {
        let mut v = Vec::with_capacity(5 + rel.len() + entries.map_or(0, |e| e.len() * 24));
        v.extend_from_slice(&(rel.len() as u32).to_le_bytes());
        v.extend_from_slice(rel.as_bytes());
        v.push(u8::from(entries.is_some()));
        for e in entries.unwrap_or_default() {
            v.extend_from_slice(&e.ino.to_le_bytes());
            v.push(e.kind);
            v.extend_from_slice(&(e.name.len() as u16).to_le_bytes());
            v.extend_from_slice(&e.name);
        }
        v
    }

    fn decode(b: &[u8]) -> Option<Listing> {
        let n = u32::from_le_bytes(b.get(..4)?.try_into().ok()?) as usize;
        let rel = std::str::from_utf8(b.get(4..4 + n)?).ok()?.to_string();
        let mut at = 4 + n;
        if *b.get(at)? == 0 {
            return Some((rel, None));
        }
        at += 1;
        let mut entries = Vec::new();
        while at < b.len() {
            let ino = u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?);
            let kind = *b.get(at + 8)?;
            let len = u16::from_le_bytes(b.get(at + 9..at + 11)?.try_into().ok()?) as usize;
            let name = b.get(at + 11..at + 11 + len)?.to_vec();
            at += 11 + len;
            entries.push(Listed { ino, kind, name });
        }
        Some((rel, Some(entries)))
    }
}

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

impl Index {
    /// Opens (creating if needed) the index in directory `dir`.
    pub fn open(dir: &Path, policy: Policy) -> Result<Index, IndexError> {
        // 16 GiB of address space, not of memory or disk: LMDB's file grows only as records are added.
        let env = Env::open(dir, 16 << 30, &["entries", "ranks", "meta", "dirs", "links", "listings", "xattrs"])?;
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
        })
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

    /// Reserves room for `rel` (a fetch of `source`, which the source showed at `confirmed_ns`) as a
    /// pending entry of this process, evicting by the policy if `evict` is set and the tier is full. An
    /// existing entry of the key is replaced (the caller holds the key's fetch lock, so it is stale or
    /// left by a dead fetcher).
    // The arguments are one reservation's (what, which version, since when, where, how) and the eviction
    // callback; bundling them would only rename them.
    #[allow(clippy::too_many_arguments)]
    pub fn reserve(
        &self,
        key: &Key,
        rel: &str,
        source: SourceId,
        confirmed_ns: u64,
        quota: u64,
        evict: bool,
        try_remove: TryRemove<'_>,
    ) -> Result<Reservation, IndexError> {
        let mut txn = self.env.write()?;
        if let Some(old) = txn.get(self.entries, key)?.map(|b| Entry::decode(b).ok_or(IndexError::Damaged)) {
            self.delete(&mut txn, key, &old?)?;
        }
        let size = source.size;
        let mut used = get_u64(&txn, self.meta, USED)?;
        let mut evicted = 0;
        if used + size > quota && evict && size <= quota {
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
        let mut txn = self.env.write()?;
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

    /// What `stat` said of the source directory `rel` (key `key`), if it was recorded. Only a trusted
    /// source (`revalidate = "never"`) records directories: programs `stat` and `lstat` the directories
    /// of the files they open (Python's `os.path.realpath` asks each part of the path), and a warm cache
    /// must not send those to the store either. `attrs.canonical` says the record also answers `lstat`.
    pub fn directory(&self, key: &Key, rel: &str) -> Result<Option<SourceId>, IndexError> {
        let txn = self.env.read()?;
        match txn.get(self.dirs, key)? {
            None => Ok(None),
            Some(b) => {
                let e = Entry::decode(b).ok_or(IndexError::Damaged)?;
                Ok((e.rel == rel).then_some(e.source))
            }
        }
    }

    /// Records what `stat` (or with `attrs.canonical`, `lstat`) said of the source directory `rel`.
    pub fn record_directory(&self, key: &Key, rel: &str, source: SourceId) -> Result<(), IndexError> {
        let e = Entry {
            ready: true,
            pid: 0,
            source,
            stats: AccessStats::default(),
            checksum: None,
            rel: rel.into(),
            confirmed_ns: 0,
        };
        let mut txn = self.env.write()?;
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
        let mut txn = self.env.write()?;
        txn.put(self.links, key, &link.encode(rel))?;
        txn.commit()?;
        Ok(())
    }

    /// Forgets what was recorded of the directory or symlink of `key` and of its extended attributes, and
    /// the `statfs` record (a change through tierstore changes the file system's free counts).
    pub fn forget_path(&self, key: &Key) -> Result<(), IndexError> {
        let mut txn = self.env.write()?;
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

    /// Records the listing of the source directory `rel` (key `key`); `None`: only its path.
    pub fn record_listing(&self, key: &Key, rel: &str, entries: Option<&[Listed]>) -> Result<(), IndexError> {
        let mut txn = self.env.write()?;
        txn.put(self.listings, key, &Listed::encode(rel, entries))?;
        txn.commit()?;
        Ok(())
    }

    /// Forgets the entries of the listing of `key` (the directory changed), keeping its path.
    pub fn forget_listing(&self, key: &Key) -> Result<(), IndexError> {
        let mut txn = self.env.write()?;
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
        let mut txn = self.env.write()?;
        txn.put(self.meta, STATFS, raw)?;
        txn.commit()?;
        Ok(())
    }

    /// Records that the source showed each `(key, version)` at `at_ns`, in one listing of the directory
    /// whose confirmation key is `dir`: every published entry of such a key whose version is that one is
    /// confirmed then; an entry of another version, or of a file the listing did not show, is left as it
    /// is, and the directory's own record says that it was not confirmed with the others (see
    /// [`Index::directory_confirmed`]). One write for all of them. Returns how many entries were confirmed.
    pub fn confirm(&self, dir: &Key, seen: &[(Key, SourceId)], at_ns: u64) -> Result<usize, IndexError> {
        let mut txn = self.env.write()?;
        if get_u64(&txn, self.meta, &confirmed_key(dir))? < at_ns {
            txn.put(self.meta, &confirmed_key(dir), &at_ns.to_le_bytes())?;
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
        Ok(get_u64(&txn, self.meta, &confirmed_key(dir))?)
    }

    /// Removes the entry of `key` if `matches` approves of it; returns the removed entry.
    pub fn remove_if(&self, key: &Key, matches: impl Fn(&Entry) -> bool) -> Result<Option<Entry>, IndexError> {
        let mut txn = self.env.write()?;
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
        let mut txn = self.env.write()?;
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sid(size: u64) -> SourceId {
        SourceId { size, mtime_ns: 1, ctime_ns: 4, ino: 2, dev: 3, attrs: None }
    }

    #[test]
    fn entry_round_trips() {
        let e = Entry {
            ready: true,
            pid: 42,
            source: SourceId {
                size: 9,
                mtime_ns: -5,
                ctime_ns: 11,
                ino: 7,
                dev: 8,
                attrs: Some(SourceAttrs {
                    mode: 0o100644,
                    uid: 1000,
                    gid: 100,
                    nlink: 2,
                    atime_ns: -3,
                    blksize: 4096,
                    blocks: 8,
                    canonical: true,
                }),
            },
            stats: AccessStats { inserted_seq: 1, last_access_ns: 2, hits: 3 },
            checksum: Some([9; 32]),
            rel: "a/b.jpg".into(),
            confirmed_ns: 1_700_000_000_000_000_000,
        };
        let back = Entry::decode(&e.encode()).unwrap();
        assert_eq!(back, e);
        assert_eq!(back.source.attrs, e.source.attrs);
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
        ix.record_listing(&key, "a/b", Some(&entries)).unwrap();
        assert_eq!(ix.listing(&key).unwrap(), Some(("a/b".into(), Some(entries))));
        ix.forget_listing(&key).unwrap();
        assert_eq!(ix.listing(&key).unwrap(), Some(("a/b".into(), None)));
        ix.record_listing(&key, "a/b", Some(&[])).unwrap();
        assert_eq!(ix.listing(&key).unwrap(), Some(("a/b".into(), Some(vec![]))));
        ix.clear().unwrap();
        assert_eq!(ix.listing(&key).unwrap(), None);
    }

    #[test]
    fn format_1_records_decode_without_ctime_or_attributes() {
        let e = Entry {
            ready: true,
            pid: 42,
            source: SourceId { size: 9, mtime_ns: 5, ctime_ns: 6, ino: 7, dev: 8, attrs: None },
            stats: AccessStats { inserted_seq: 1, last_access_ns: 2, hits: 3 },
            checksum: None,
            rel: "a/b.jpg".into(),
            confirmed_ns: 12,
        };
        // A format-1 record: the format-3 one without its ctime, attributes and confirmation, and no
        // format bits.
        let mut old = e.encode();
        old.drain(HEADER_V1..HEADER);
        old[0] = 1;
        let back = Entry::decode(&old).unwrap();
        assert_eq!((back.rel.as_str(), back.source.size, back.source.ctime_ns), ("a/b.jpg", 9, 0));
        assert!(back.source.attrs.is_none() && back.ready);
        assert_ne!(back.source, e.source, "without its ctime an old record never matches the source");
    }

    #[test]
    fn format_2_records_decode_as_never_confirmed() {
        let e = Entry {
            ready: true,
            pid: 42,
            source: sid(9),
            stats: AccessStats { inserted_seq: 1, last_access_ns: 2, hits: 3 },
            checksum: None,
            rel: "a/b.jpg".into(),
            confirmed_ns: 12,
        };
        let mut old = e.encode();
        old.drain(HEADER_V2..HEADER);
        old[0] = FORMAT_V2 | 1;
        let back = Entry::decode(&old).unwrap();
        assert_eq!(back, Entry { confirmed_ns: 0, ..e });
    }

    #[test]
    fn confirming_a_listing_touches_only_published_entries_of_the_listed_version() {
        let dir = tempfile::tempdir().unwrap();
        let idx = Index::open(dir.path(), Policy::Fill).unwrap();
        let mut yes = |_: &Key, _: &Entry| true;
        for (name, size) in [("d/same", 10), ("d/changed", 20), ("d/pending", 30)] {
            idx.reserve(&key_of(name), name, sid(size), 5, 1000, false, &mut yes).unwrap();
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
        assert_eq!(idx.confirm(&dir, &seen, 100).unwrap(), 1);
        let at = |name: &str| idx.lookup(&key_of(name)).unwrap().unwrap().confirmed_ns;
        assert_eq!((at("d/same"), at("d/changed"), at("d/pending")), (100, 5, 5));
        assert_eq!(idx.directory_confirmed(&dir).unwrap(), 100);
        assert_eq!(idx.superseded(&key_of("d/changed")).unwrap(), Some((100, sid(21))));
        assert_eq!(idx.superseded(&key_of("d/same")).unwrap(), None);
        assert_eq!(idx.confirm(&dir, &seen, 50).unwrap(), 0, "an older confirmation never goes back in time");
        assert_eq!((at("d/same"), idx.directory_confirmed(&dir).unwrap()), (100, 100));
    }

    #[test]
    fn quota_is_never_exceeded_and_eviction_follows_the_policy() {
        let dir = tempfile::tempdir().unwrap();
        let idx = Index::open(dir.path(), Policy::Fifo).unwrap();
        let mut keep_all = |_: &Key, _: &Entry| true;
        for i in 0..3 {
            let k = key_of(&format!("f{i}"));
            let r = idx.reserve(&k, &format!("f{i}"), sid(40), 0, 100, false, &mut keep_all).unwrap();
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
            idx.reserve(&k, "f2", sid(40), 0, 100, true, &mut remove).unwrap(),
            Reservation::Reserved { evicted: 1 }
        );
        assert_eq!(removed, vec!["f0".to_string()]);
        assert_eq!(idx.usage().unwrap(), Usage { entries: 1, used: 80, pending: 1 });
    }

    #[test]
    fn locked_victims_are_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let idx = Index::open(dir.path(), Policy::Lru).unwrap();
        let mut yes = |_: &Key, _: &Entry| true;
        for i in 0..2 {
            let k = key_of(&format!("f{i}"));
            idx.reserve(&k, &format!("f{i}"), sid(50), 0, 100, false, &mut yes).unwrap();
            idx.publish(&k, None, 10 + i).unwrap();
        }
        // f0 is older, but a reader holds it: f1 goes instead.
        let mut busy_f0 = |_: &Key, e: &Entry| e.rel != "f0";
        let r = idx.reserve(&key_of("n"), "n", sid(50), 0, 100, true, &mut busy_f0).unwrap();
        assert_eq!(r, Reservation::Reserved { evicted: 1 });
        assert!(idx.lookup(&key_of("f0")).unwrap().is_some());
        assert!(idx.lookup(&key_of("f1")).unwrap().is_none());
    }
}
