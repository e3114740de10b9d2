//! The log of buffered closes: how a close with `durability = "buffered"` returns without waiting for a
//! disk, as a close on a local disk does.
//!
//! The close appends one record (the journal entry it would have committed, without the file's hash) to
//! `journal/closes.log` with one `write`, and does not fsync: the record is in the node's page cache, so
//! it outlives the writing process at once, whatever kills it. The next journal operation of any process
//! (the agent's, within a second of the close: see `tierstore-agent`'s write-back loop) hashes the files
//! and folds the records into the fsynced journal in the order they were appended, then empties the log.
//! A crash of the node before the fold may lose the record, as it may lose the file's bytes; an unhashed
//! record that survives such a crash is dropped (its bytes may be torn, and nothing would tell), and a
//! folded entry is still checked against the bytes before migration (`migrate.rs`: its hash and its boot).
//!
//! Each record carries its own checksum and a random id. A record torn by a crash of the node is
//! skipped (the parser finds the next whole one), and the journal keeps the id of the last record it
//! folded: a fold cut short between the journal's commit and the log's truncation is not applied twice.
//!
//! Appenders hold a shared `flock` on the log, a fold an exclusive one (and, within a process, the
//! mutex, since `flock` locks belong to the open file, which a process's threads share).

use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use super::entry::Entry;
use crate::flock::unlock;

/// The log's name in the journal's directory.
pub const LOG: &str = "closes.log";

/// The first bytes of every record.
const MAGIC: [u8; 4] = *b"TSCL";

/// Magic, body length, id, flags.
const HEAD: usize = 4 + 4 + 16 + 1;

/// The flag of a record whose entry carries the file's blake3 (else the fold takes it).
const HASHED: u8 = 1;

/// The checksum after the body.
const CHECK: usize = 16;

/// A record's id: unique among the records of a stage.
pub type RecordId = [u8; 16];

/// One buffered close, as appended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Its id.
    pub id: RecordId,
    /// The journal entry it stands for (`seq` 0: the fold gives it its place).
    pub entry: Entry,
    /// Whether `entry.hash` is the file's blake3; if not, the fold hashes the staged file (in the boot
    /// of the close: after a crash of the node its bytes could be torn, and nothing would tell).
    pub hashed: bool,
}

fn checksum(length_and_id: &[u8], body: &[u8]) -> [u8; CHECK] {
    let mut h = blake3::Hasher::new();
    h.update(length_and_id);
    h.update(body);
    h.finalize().as_bytes()[..CHECK].try_into().expect("16 bytes")
}

fn new_id() -> RecordId {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut h = blake3::Hasher::new();
    h.update(&crate::process::pid().to_be_bytes());
    h.update(&n.to_be_bytes());
    h.update(&crate::clock::now_ns().to_be_bytes());
    h.update(&crate::process::boot_id().unwrap_or_default());
    h.finalize().as_bytes()[..16].try_into().expect("16 bytes")
}

fn encode(id: &RecordId, entry: &Entry, hashed: bool) -> Vec<u8> {
    let body = entry.encode();
    let mut out = Vec::with_capacity(HEAD + body.len() + CHECK);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(id);
    out.push(if hashed { HASHED } else { 0 });
    out.extend_from_slice(&body);
    let check = checksum(&out[4..HEAD], &body);
    out.extend_from_slice(&check);
    out
}

/// The record at the start of `b` and its length, if a whole one is there.
fn decode(b: &[u8]) -> Option<(Record, usize)> {
    if b.get(..4)? != MAGIC {
        return None;
    }
    let len = u32::from_be_bytes(b.get(4..8)?.try_into().ok()?) as usize;
    let id: RecordId = b.get(8..24)?.try_into().ok()?;
    let flags = b[24];
    let body = b.get(HEAD..HEAD + len)?;
    let check = b.get(HEAD + len..HEAD + len + CHECK)?;
    if check != checksum(&b[4..HEAD], body) {
        return None;
    }
    let entry = Entry::decode(0, body)?;
    Some((Record { id, entry, hashed: flags & HASHED != 0 }, HEAD + len + CHECK))
}

/// Every whole record of `log`, in order. Bytes that are not one (a record torn by a crash of the node)
/// are passed over to the next record that checks.
pub fn parse(log: &[u8]) -> Vec<Record> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + HEAD + CHECK <= log.len() {
        match decode(&log[at..]) {
            Some((record, n)) => {
                out.push(record);
                at += n;
            }
            None => at += 1,
        }
    }
    out
}

/// The log of one stage's buffered closes.
pub struct Closes {
    path: PathBuf,
    file: Mutex<File>,
    /// How long to wait for the log ([`LOCK_WITHIN`]; shorter in tests).
    within: Duration,
}

/// The log held for a fold: no process appends meanwhile.
pub struct Folding<'a> {
    file: MutexGuard<'a, File>,
    path: &'a Path,
}

/// How long an append or a fold waits for the log (a process stopped in the middle of its append, say)
/// before it fails with an error that says so, rather than hang.
pub const LOCK_WITHIN: Duration = Duration::from_secs(10);

/// Takes `op` on the log within `within` (see [`crate::flock`]).
fn flock(file: &File, op: libc::c_int, path: &Path, within: Duration) -> io::Result<()> {
    crate::flock::lock_within(file, op, path, within, "an append or a fold")
}

impl Closes {
    /// Opens (creating, 0600, never through a link) the log in the journal's directory `dir` (its
    /// descriptor) at `path`.
    pub fn open(dir: &File, path: PathBuf) -> io::Result<Closes> {
        let file = crate::private::open_file(dir, LOG)?;
        // SAFETY: fcntl on a descriptor just opened: every write goes to the end, whoever else appends.
        let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
        if flags < 0 || unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETFL, flags | libc::O_APPEND) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Closes { path, file: Mutex::new(file), within: LOCK_WITHIN })
    }

    /// The log's path, for errors.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn lock(&self) -> MutexGuard<'_, File> {
        self.file.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends the close of `entry` (whose `hash` is the file's when `hashed`), with no fsync: once this
    /// returns, the record outlives this process.
    pub fn append(&self, entry: &Entry, hashed: bool) -> io::Result<()> {
        let record = encode(&new_id(), entry, hashed);
        let mut file = self.lock();
        flock(&file, libc::LOCK_SH, &self.path, self.within)?;
        // One write: appenders never interleave inside a record (and a short one is torn, and skipped).
        let written = file.write(&record);
        unlock(&file);
        match written? {
            n if n == record.len() => Ok(()),
            n => {
                Err(io::Error::other(format!("{} took {n} of a record's {} bytes", self.path.display(), record.len())))
            }
        }
    }

    /// Whether no close waits to be folded (one `fstat`).
    pub fn is_empty(&self) -> io::Result<bool> {
        Ok(self.lock().metadata()?.len() == 0)
    }

    /// The records now in the log, read without waiting for anyone: what the journal's size and the
    /// agent's pacing count on; a record being appended meanwhile may be missed.
    pub fn peek(&self) -> io::Result<(Vec<Record>, Option<SystemTime>)> {
        let file = self.lock();
        let meta = file.metadata()?;
        let bytes = read_all(&file, meta.len())?;
        Ok((parse(&bytes), meta.modified().ok()))
    }

    /// Holds the log for a fold: waits for the appends under way, and keeps others out until dropped.
    pub fn hold(&self) -> io::Result<Folding<'_>> {
        let file = self.lock();
        flock(&file, libc::LOCK_EX, &self.path, self.within)?;
        Ok(Folding { file, path: &self.path })
    }
}

fn read_all(file: &File, len: u64) -> io::Result<Vec<u8>> {
    let mut bytes = vec![0; len as usize];
    let mut at = 0;
    while at < bytes.len() {
        match file.read_at(&mut bytes[at..], at as u64)? {
            0 => break,
            n => at += n,
        }
    }
    bytes.truncate(at);
    Ok(bytes)
}

impl Folding<'_> {
    /// Every record in the log.
    pub fn records(&self) -> io::Result<Vec<Record>> {
        Ok(parse(&read_all(&self.file, self.file.metadata()?.len())?))
    }

    /// Empties the log, once its records are in the journal.
    pub fn clear(&self) -> io::Result<()> {
        self.file.set_len(0)
    }

    /// The log's path, for errors.
    pub fn path(&self) -> &Path {
        self.path
    }
}

impl Drop for Folding<'_> {
    fn drop(&mut self) {
        unlock(&self.file);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn entry(dest: &str, staged: &str) -> Entry {
        Entry::closed(Path::new(dest), staged, 7, [3; 32], Some([9; 16]))
    }

    #[test]
    fn records_read_back_in_order_and_torn_bytes_are_passed_over() {
        let (a, b, c) = (entry("/s/a", "1.0.1"), entry("/s/b", "1.1.1"), entry("/s/c", "1.2.1"));
        let (ra, rb, rc) = (encode(&new_id(), &a, true), encode(&new_id(), &b, false), encode(&new_id(), &c, false));
        let flags: Vec<bool> = parse(&[ra.clone(), rb.clone()].concat()).into_iter().map(|r| r.hashed).collect();
        assert_eq!(flags, vec![true, false]);
        // b torn in its middle (a crash of the node wrote its first page only), then c whole.
        let mut log = [ra.clone(), rb[..rb.len() / 2].to_vec(), rc.clone()].concat();
        let got: Vec<Entry> = parse(&log).into_iter().map(|r| r.entry).collect();
        assert_eq!(got, vec![a.clone(), c.clone()]);
        // A flipped byte in a record's body: its checksum fails, the others stand.
        let at = ra.len() + rb.len() / 2 + HEAD + 3;
        log[at] ^= 1;
        let got: Vec<Entry> = parse(&log).into_iter().map(|r| r.entry).collect();
        assert_eq!(got, vec![a]);
        // A tail too short for any record.
        assert!(parse(&rc[..HEAD]).is_empty());
    }

    #[test]
    fn a_process_stopped_holding_the_log_fails_an_append_and_a_fold_within_the_deadline() {
        let d = tempfile::tempdir().unwrap();
        let dir = File::open(d.path()).unwrap();
        let mut closes = Closes::open(&dir, d.path().join(LOG)).unwrap();
        closes.within = Duration::from_millis(200);
        // Another process's descriptor, held as a fold holds it (a stopped folder, say).
        let other = crate::private::open_file(&dir, LOG).unwrap();
        flock(&other, libc::LOCK_EX, d.path(), LOCK_WITHIN).unwrap();
        let start = Instant::now();
        let e = closes.append(&entry("/s/a", "1.0.1"), false).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(e.to_string().contains("stayed locked") && e.to_string().contains(LOG), "{e}");
        assert!(closes.hold().is_err());
        assert!(start.elapsed() < Duration::from_secs(2), "{:?}", start.elapsed());
        // Once it goes on, both work.
        unlock(&other);
        closes.append(&entry("/s/a", "1.0.1"), false).unwrap();
        assert_eq!(closes.hold().unwrap().records().unwrap().len(), 1);
    }
}
