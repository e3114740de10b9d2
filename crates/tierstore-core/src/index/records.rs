//! The records of the index and how they are laid out in LMDB: a file's entry (which version of the
//! source a copy holds, its access statistics and checksum), and, under a trusted source, a symlink and a
//! directory listing as the source answered them. Older formats still decode (see [`Entry`]'s layout),
//! so an index written by an older tierstore is read, never misread.

use crate::placement::AccessStats;

/// A 16-byte key: blake3 of the file's path relative to the source (LMDB keys are at most 511 bytes;
/// paths are not).
pub type Key = [u8; 16];

/// A source-relative path's bytes as the text the engine names it by: valid UTF-8 nearly always, checked
/// by the fast validator (a word at a time), and made lossy only when it is not.
pub fn rel_text(bytes: &[u8]) -> String {
    std::str::from_utf8(bytes).map_or_else(|_| String::from_utf8_lossy(bytes).into_owned(), str::to_owned)
}

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
    pub(super) fn encode(&self) -> Vec<u8> {
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
    pub(super) fn ready_in(b: &[u8]) -> bool {
        b.first().is_some_and(|f| f & 1 == 1)
    }

    pub(super) fn decode(b: &[u8]) -> Option<Entry> {
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
            rel: rel_text(&b[rel_at..]),
            confirmed_ns,
        })
    }
}

/// A symlink under a trusted source, recorded the first time it is seen (see [`Index::link`](super::Index::link)).
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
    pub(super) fn encode(&self, rel: &str) -> Vec<u8> {
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

    pub(super) fn decode(b: &[u8]) -> Option<(String, Link)> {
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
    pub(super) fn encode(rel: &str, entries: Option<&[Listed]>) -> Vec<u8> {
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

    pub(super) fn decode(b: &[u8]) -> Option<Listing> {
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
}
