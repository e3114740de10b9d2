//! A file opened through the cache: positioned reads over whichever backing the open found.

use std::fs::File;
use std::io::{self, SeekFrom};
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::counters::tier as tier_slot;
use crate::index::SourceId;
use crate::source::{Source, SourceFile};
use crate::tier::Tier;

/// A large file being copied into a tier (from the store, or from the node that owns it). Readers read
/// what is already copied and wait for the rest; if the copy fails they continue from the source at the
/// same offset. A copy from the store that records checksums also records the chaining value of each
/// [`PIECE`](crate::hash::PIECE) as it is written ([`Growing::record_piece`]): the owner's agent sends a
/// peer each piece with it as soon as it is there ([`Growing::piece`]), so the peer's readers start
/// before the copy ends.
pub struct Growing {
    file: File,
    size: u64,
    /// The version of the source file being copied: a reader whose copy fails goes on with it.
    version: SourceId,
    pid: u32,
    progress: Mutex<Progress>,
    advanced: Condvar,
}

#[derive(Clone)]
struct Progress {
    copied: u64,
    failed: bool,
    finished: bool,
    /// Why the source failed the copy, when it did (rather than the tier): readers fail with it.
    source_error: Option<(io::ErrorKind, Arc<str>)>,
    /// The chaining value of each piece written so far, where the copy records them.
    pieces: Vec<crate::hash::ChainingValue>,
    /// The blake3 of the whole copy, once finished, where the copy was hashed as it was written.
    hash: Option<crate::hash::Hash>,
}

/// Where one piece of a [`Growing`] copy stands (see [`Growing::piece`]).
#[derive(Debug)]
pub enum Piece {
    /// Written, with its chaining value.
    Ready(crate::hash::ChainingValue),
    /// Not yet written.
    Pending,
    /// The copy stopped short (why, when the source failed it).
    Failed(Option<io::Error>),
}

/// Where a growing copy stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyState {
    /// Bytes are still being written.
    Copying,
    /// Every byte is written and the source did not change meanwhile: the copy is the file.
    Finished,
    /// The copy stopped short (or belongs to a parent process): read the source.
    Failed,
}

impl Growing {
    /// A copy of the source file version `version` that `file` (a read handle on the copy being written)
    /// will follow.
    pub fn new(file: File, version: SourceId) -> Growing {
        Growing {
            file,
            size: version.size,
            version,
            pid: crate::process::pid(),
            progress: Mutex::new(Progress {
                copied: 0,
                failed: false,
                finished: false,
                source_error: None,
                pieces: Vec::new(),
                hash: None,
            }),
            advanced: Condvar::new(),
        }
    }

    /// The size of the file being copied.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The version of the source file being copied.
    pub fn version(&self) -> &SourceId {
        &self.version
    }

    /// Records that the first `copied` bytes are written.
    pub fn advance(&self, copied: u64) {
        self.progress.lock().expect("progress lock").copied = copied;
        self.advanced.notify_all();
    }

    /// Records the chaining value of the next piece, written already.
    pub fn record_piece(&self, cv: &crate::hash::ChainingValue) {
        self.progress.lock().expect("progress lock").pieces.push(*cv);
        self.advanced.notify_all();
    }

    /// Piece `k`'s chaining value once it is recorded, waiting at most `wait` for it.
    pub fn piece(&self, k: usize, wait: Duration) -> Piece {
        let until = Instant::now() + wait;
        let mut p = self.progress.lock().expect("progress lock");
        loop {
            if let Some(cv) = p.pieces.get(k) {
                return Piece::Ready(*cv);
            }
            if p.failed || p.finished {
                let why = p.source_error.as_ref().map(|(kind, m)| io::Error::new(*kind, m.to_string()));
                return Piece::Failed(why);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Piece::Pending;
            }
            p = self.advanced.wait_timeout(p, left).expect("progress lock").0;
        }
    }

    /// Where the copy stands once it ended, waiting at most `wait` for that; `None` if still copying.
    pub fn ended(&self, wait: Duration) -> Option<CopyState> {
        let until = Instant::now() + wait;
        let mut p = self.progress.lock().expect("progress lock");
        loop {
            match (p.failed, p.finished) {
                (true, _) => return Some(CopyState::Failed),
                (false, true) => return Some(CopyState::Finished),
                (false, false) => {}
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            p = self.advanced.wait_timeout(p, left).expect("progress lock").0;
        }
    }

    /// The chaining values recorded so far.
    pub fn pieces(&self) -> Vec<crate::hash::ChainingValue> {
        self.progress.lock().expect("progress lock").pieces.clone()
    }

    /// Records that the copy stopped short; readers switch to the source.
    pub fn fail(&self) {
        self.progress.lock().expect("progress lock").failed = true;
        self.advanced.notify_all();
    }

    /// Records that the copy stopped because the source failed with `e`: its readers fail with the same
    /// error. Asking the store again would make a reader wait out the store's deadline a second time
    /// (and send it the same requests again) only to fail the same way.
    pub fn fail_source(&self, e: &io::Error) {
        let mut p = self.progress.lock().expect("progress lock");
        p.failed = true;
        p.source_error = Some((e.kind(), e.to_string().into()));
        drop(p);
        self.advanced.notify_all();
    }

    /// Records that the copy is complete and checked against the source, with the blake3 of its bytes
    /// when they were hashed as they were written (from the store) or checked as they arrived (from the
    /// node that owns the file). Its last bytes are readable from now on, not before: a reader that
    /// reached the end finds the copy finished, with its hash.
    pub fn finish(&self, hash: Option<crate::hash::Hash>) {
        let mut p = self.progress.lock().expect("progress lock");
        p.copied = self.size;
        p.finished = true;
        p.hash = hash;
        drop(p);
        self.advanced.notify_all();
    }

    /// The blake3 of the whole copy ([`Growing::finish`]) if it has finished: `None` while it is still
    /// being made, when it failed (its readers read the rest from the source, which nothing hashed), or
    /// when it was not hashed. A reader that has read up to the end finds it finished.
    pub fn hash_if_finished(&self) -> Option<crate::hash::Hash> {
        if self.pid != crate::process::pid() {
            return None; // a forked child: the copy thread is the parent's
        }
        let p = self.progress.lock().expect("progress lock");
        (p.finished && !p.failed).then_some(p.hash).flatten()
    }

    /// Where the copy stands, without waiting.
    pub fn state(&self) -> CopyState {
        if self.pid != crate::process::pid() {
            return CopyState::Failed;
        }
        let p = self.progress.lock().expect("progress lock");
        match (p.failed, p.finished) {
            (true, _) => CopyState::Failed,
            (false, true) => CopyState::Finished,
            (false, false) => CopyState::Copying,
        }
    }

    /// The copy being written (a read handle, locked shared against eviction).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Reads at `offset` once the copy has those bytes (waiting for them); `None` if the copy failed
    /// first for a reason of the tier's, and the caller must read the source instead; the source's error
    /// if the source failed it.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Option<io::Result<usize>> {
        if offset >= self.size || buf.is_empty() {
            return Some(Ok(0));
        }
        let want = buf.len().min((self.size - offset) as usize);
        match self.wait_for(offset + want as u64) {
            Ok(true) => Some(self.file.read_at(&mut buf[..want], offset)),
            Ok(false) => None,
            Err(e) => Some(Err(e)),
        }
    }

    /// Waits until `end` bytes are copied; false if the copy failed for a reason of the tier's (or belongs
    /// to a parent process whose copy thread this forked child does not have), the source's error if the
    /// source failed it.
    fn wait_for(&self, end: u64) -> io::Result<bool> {
        if self.pid != crate::process::pid() {
            return Ok(false);
        }
        let mut p = self.progress.lock().expect("progress lock");
        loop {
            if let Some((kind, message)) = &p.source_error {
                return Err(io::Error::new(*kind, message.to_string()));
            }
            if p.failed {
                return Ok(false);
            }
            if p.copied >= end {
                return Ok(true);
            }
            p = self.advanced.wait(p).expect("progress lock");
        }
    }
}

/// What a [`Reader`] reads from.
pub enum Backing {
    /// A published copy in a tier (a hit). The reader holds a shared lock on it against eviction.
    Copy(File, Arc<Tier>),
    /// The whole file in memory, fetched by this open (or a concurrent one) from the source.
    Memory(Arc<Vec<u8>>),
    /// A copy being written, followed as it grows.
    Growing(Arc<Growing>),
    /// The source itself: no tier had room, or a cache fault.
    Source(SourceFile),
    /// A file a peer served that no tier of this node keeps (partitioned sharing): private to this open.
    Private(File),
}

impl Backing {
    /// The descriptor of the cached copy or source file this backing is, if it is one.
    pub fn into_file(self) -> Option<File> {
        match self {
            Backing::Copy(f, _) | Backing::Private(f) => Some(f),
            Backing::Source(f) => f.into_file(),
            Backing::Memory(_) | Backing::Growing(_) => None,
        }
    }

    /// [`Backing::into_file`] for a program that reads the descriptor itself: the `size` bytes of a
    /// cached copy count as served when it is handed over (its reads are no longer seen).
    pub fn into_served_file(self, size: u64) -> Option<File> {
        self.count_served(size as usize);
        self.into_file()
    }

    fn count_served(&self, n: usize) {
        if let Backing::Copy(_, tier) = self {
            tier.counters.add(tier_slot::BYTES_SERVED, n as u64);
        }
    }
}

/// Reads `file` from `offset` into `buf` until it is full or the file ends (retrying a short or interrupted
/// read), without forming a reference to the unwritten memory; returns the bytes written.
fn pread_uninit(file: &File, buf: &mut [MaybeUninit<u8>], offset: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        let at = offset + done as u64;
        // SAFETY: the kernel writes at most `buf.len() - done` bytes at the pointer, inside `buf`.
        let n = unsafe {
            libc::pread(file.as_raw_fd(), buf[done..].as_mut_ptr().cast(), buf.len() - done, at as libc::off_t)
        };
        match n {
            0 => break,
            n if n > 0 => done += n as usize,
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(done)
}

/// What a reader keeps as long as it reads ([`Reader::keeping`]), handed over with its descriptor: it
/// does its work when dropped.
pub type Kept = Box<dyn Send + Sync>;

/// A read-only file opened through the cache.
pub struct Reader {
    backing: Backing,
    size: u64,
    pos: u64,
    rel: String,
    source: Arc<dyn Source>,
    /// The source file, opened when a growing copy fails.
    fallback: Option<SourceFile>,
    /// What lives as long as this reader reads (see [`Reader::keeping`]).
    kept: Option<Kept>,
}

impl Reader {
    /// A reader of `size` bytes of the source file `rel` over `backing`.
    pub fn new(backing: Backing, size: u64, rel: String, source: Arc<dyn Source>) -> Reader {
        Reader { backing, size, pos: 0, rel, source, fallback: None, kept: None }
    }

    /// This reader, keeping `kept` until it is dropped or its descriptor handed over: a mark that the
    /// file is read from the store, which a prefetch respects while the reader lives.
    pub(crate) fn keeping(mut self, kept: impl Send + Sync + 'static) -> Reader {
        self.kept = Some(Box::new(kept));
        self
    }

    /// The descriptor of the cached copy or source file this reader reads, if it reads one directly.
    pub fn into_file(self) -> Option<File> {
        self.backing.into_file()
    }

    /// [`into_file`](Self::into_file), with what the reader kept ([`Reader::keeping`]), for the holder of
    /// the descriptor to keep as long.
    pub fn into_file_kept(self) -> Option<(File, Option<Kept>)> {
        let kept = self.kept;
        self.backing.into_file().map(|f| (f, kept))
    }

    /// [`into_file`](Self::into_file) for a program that reads the descriptor itself: the job's reads of
    /// a cached copy are no longer seen, so the whole copy counts as served when it is handed over.
    pub fn into_served_file(self) -> Option<File> {
        self.backing.into_served_file(self.size)
    }

    /// The file's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The blake3 of the whole file as its copy was made, when this reader follows a copy being made
    /// (from the store, or from the node that owns the file) that hashes what it writes, and the copy has
    /// finished (as it has once the reader read up to the end). Those are the very bytes the reader
    /// reads. `None` for any other backing (a copy found in a tier may have been damaged since it was
    /// made), and while the copy goes on, when it failed (the rest was read from the source) or when it
    /// was not hashed.
    pub fn hash_of_arriving_copy(&self) -> Option<crate::hash::Hash> {
        match &self.backing {
            Backing::Growing(g) => g.hash_if_finished(),
            _ => None,
        }
    }

    /// The source-relative path.
    pub fn rel(&self) -> &str {
        &self.rel
    }

    /// What serves this reader's bytes.
    pub fn backing(&self) -> &Backing {
        &self.backing
    }

    /// What serves this reader's bytes: "tier", "memory", "copying", "source" or "peer".
    pub fn backing_kind(&self) -> &'static str {
        match self.backing {
            Backing::Copy(..) => "tier",
            Backing::Memory(_) => "memory",
            Backing::Growing(_) => "copying",
            Backing::Source(_) => "source",
            Backing::Private(_) => "peer",
        }
    }

    /// The descriptor of a real file holding exactly the file's bytes, if there is one.
    pub fn fd(&self) -> Option<RawFd> {
        match &self.backing {
            Backing::Copy(f, _) | Backing::Private(f) => Some(f.as_raw_fd()),
            Backing::Source(f) => f.as_file().map(|f| f.as_raw_fd()),
            Backing::Memory(_) | Backing::Growing(_) => None,
        }
    }

    /// The current position.
    pub fn tell(&self) -> u64 {
        self.pos
    }

    /// Moves the position; positions past the end are allowed (reads there return 0 bytes).
    pub fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let new = match to {
            SeekFrom::Start(n) => Some(n),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
            SeekFrom::End(d) => self.size.checked_add_signed(d),
        };
        match new {
            Some(n) => {
                self.pos = n;
                Ok(n)
            }
            None => Err(io::Error::new(io::ErrorKind::InvalidInput, "seek to a negative position")),
        }
    }

    /// Reads at the current position and advances it.
    pub fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.read_at(buf, self.pos)?;
        self.pos += n as u64;
        Ok(n)
    }

    /// Fills as much of `buf` as the file has from the current position (loops over short reads).
    pub fn read_full(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            let n = self.read(&mut buf[done..])?;
            if n == 0 {
                break;
            }
            done += n;
        }
        Ok(done)
    }

    /// [`Reader::read_full`] into memory nobody has written yet (a Python `bytes` being made), without
    /// zeroing it first: the kernel reads a tier copy (or a private file) straight into it, and a copy
    /// in memory is copied in; any other backing (a growing copy, the source) is zeroed first and read
    /// as usual. Returns how many bytes, from the start of `buf`, are now written.
    pub fn read_full_uninit(&mut self, buf: &mut [MaybeUninit<u8>]) -> io::Result<usize> {
        let want = buf.len().min(self.size.saturating_sub(self.pos) as usize);
        let buf = &mut buf[..want];
        let done = match &self.backing {
            Backing::Copy(f, _) | Backing::Private(f) => pread_uninit(f, buf, self.pos)?,
            Backing::Memory(bytes) => {
                let start = (self.pos as usize).min(bytes.len());
                let n = want.min(bytes.len() - start);
                // SAFETY: `n` bytes from `bytes[start..]` into the first `n` of `buf`, which does not
                // overlap it (a fresh buffer of the caller's).
                unsafe { std::ptr::copy_nonoverlapping(bytes[start..].as_ptr(), buf.as_mut_ptr().cast::<u8>(), n) };
                n
            }
            Backing::Growing(_) | Backing::Source(_) => {
                buf.fill(MaybeUninit::new(0));
                // SAFETY: every byte of `buf` was written just above.
                let buf = unsafe { &mut *(buf as *mut [MaybeUninit<u8>] as *mut [u8]) };
                return self.read_full(buf);
            }
        };
        self.count_served(done);
        self.pos += done as u64;
        Ok(done)
    }

    /// Reads at `offset` without moving the position.
    pub fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        if offset >= self.size || buf.is_empty() {
            return Ok(0);
        }
        let want = buf.len().min((self.size - offset) as usize);
        let buf = &mut buf[..want];
        let n = self.fetch_at(buf, offset)?;
        self.count_served(n);
        Ok(n)
    }

    /// Counts bytes handed to the job from a cached copy.
    fn count_served(&self, n: usize) {
        self.backing.count_served(n);
    }

    /// Reads at `offset` (within the file) from the backing, without counting bytes served.
    fn fetch_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let want = buf.len();
        match &self.backing {
            Backing::Copy(f, _) | Backing::Private(f) => f.read_at(buf, offset),
            Backing::Memory(bytes) => {
                let start = offset as usize;
                let n = want.min(bytes.len().saturating_sub(start));
                buf[..n].copy_from_slice(&bytes[start..start + n]);
                Ok(n)
            }
            Backing::Growing(g) => {
                if self.fallback.is_none() {
                    if let Some(r) = g.read_at(buf, offset) {
                        return r;
                    }
                }
                if self.fallback.is_none() {
                    self.fallback = Some(self.source.reopen(&self.rel, g.version())?);
                }
                self.source.read_at(self.fallback.as_ref().expect("opened above"), buf, offset)
            }
            Backing::Source(f) => self.source.read_at(f, buf, offset),
        }
    }

    /// Reads up to and including the next `\n`, at most `limit` bytes (all if `None`).
    pub fn read_line(&mut self, limit: Option<usize>) -> io::Result<Vec<u8>> {
        let limit = limit.unwrap_or(usize::MAX);
        let mut line = Vec::new();
        let mut chunk = [0u8; 8192];
        while line.len() < limit {
            let want = chunk.len().min(limit - line.len());
            if self.pos >= self.size {
                break;
            }
            let want = want.min((self.size - self.pos) as usize);
            let n = self.fetch_at(&mut chunk[..want], self.pos)?;
            if n == 0 {
                break;
            }
            let take = chunk[..n].iter().position(|&b| b == b'\n').map(|i| i + 1).unwrap_or(n);
            self.count_served(take);
            line.extend_from_slice(&chunk[..take]);
            self.pos += take as u64;
            if take < n || chunk[take - 1] == b'\n' {
                break;
            }
        }
        Ok(line)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::counters::Counters;
    use crate::source::PosixSource;

    /// A reader of `bytes` over `backing`, whose source is a directory that is never read.
    fn reader(dir: &std::path::Path, backing: Backing, size: u64) -> Reader {
        let counters = Arc::new(Counters::open(&dir.join("counters")).unwrap());
        Reader::new(backing, size, "f".into(), Arc::new(PosixSource::new(dir, None, counters)))
    }

    #[test]
    fn an_unzeroed_read_gives_what_a_zeroed_one_gives() {
        let dir = tempfile::tempdir().unwrap();
        let bytes: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let path = dir.path().join("copy");
        std::fs::write(&path, &bytes).unwrap();
        let backings = || [Backing::Private(File::open(&path).unwrap()), Backing::Memory(Arc::new(bytes.clone()))];
        for backing in backings() {
            let mut r = reader(dir.path(), backing, bytes.len() as u64);
            r.seek(SeekFrom::Start(1000)).unwrap();
            let mut buf = vec![MaybeUninit::<u8>::uninit(); 200_000];
            assert_eq!(r.read_full_uninit(&mut buf).unwrap(), 200_000);
            // SAFETY: all 200,000 bytes were written, as the call said.
            let got = unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), 200_000) };
            assert_eq!(got, &bytes[1000..201_000]);
            assert_eq!(r.tell(), 201_000);
            // Past what is left: only the rest is written, and the position reaches the end.
            let mut rest = vec![MaybeUninit::<u8>::uninit(); 200_000];
            assert_eq!(r.read_full_uninit(&mut rest).unwrap(), bytes.len() - 201_000);
            assert_eq!(r.read_full_uninit(&mut rest).unwrap(), 0);
            assert_eq!(r.tell(), bytes.len() as u64);
        }
    }
}
