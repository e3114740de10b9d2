//! A directory of a POSIX file system as the source (Lustre, GPFS, NFS, a local disk): files are read
//! through descriptors, so a program under `tierstore run` can be handed one, and identified by `stat`.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, OnceLock};

mod descriptors;

use descriptors::{c_path, open_at_flags, openat2_beneath, stat_at_c, walk_nofollow, Walked};
pub use descriptors::{inode_of, list_dir, open_at, open_at_c, open_dir, stat_at};

use super::{CopyFault, ListedEntry, OutsideSource, Source, SourceFile};
use crate::counters::{source as slot, Counters};
use crate::index::SourceId;

/// A POSIX source directory with its counters.
pub struct PosixSource {
    /// The directory with symlinks resolved (the configuration resolves it once).
    root: PathBuf,
    /// The directory as it was configured, when that spelling goes through a symlink; paths under either
    /// are accepted.
    alias: Option<PathBuf>,
    /// A descriptor of the root: `stat` and `open` resolve paths from it, so the kernel walks only the
    /// part of the path below the source on every call. Opened on the first miss, so that a process
    /// served wholly from the cache never asks the store anything, not even to open its root.
    dir: OnceLock<File>,
    counters: Arc<Counters>,
}

/// Lexically normalizes an absolute path (`.` and `..` removed) without touching the file system.
pub fn normalize(path: &Path) -> PathBuf {
    normalized(path.to_path_buf())
}

/// [`normalize`] of a path the caller owns. Every open under the source by a program under `tierstore
/// run` comes here: a path spelled plainly is its own normal form, handed back as it is, not rebuilt
/// component by component (6% of a warm open's CPU, `perf`) nor copied.
pub fn normalized(path: PathBuf) -> PathBuf {
    use std::os::unix::ffi::OsStrExt;
    if plain_absolute(path.as_os_str().as_bytes()) {
        return path;
    }
    rebuilt(&path)
}

/// `path` rebuilt component by component, `.` dropped and `..` taken back: [`normalize`] of any path.
fn rebuilt(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(part) => out.push(part),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// Whether `path` is `/` and names with no empty, `.` or `..` among them and no `/` at the end: what
/// [`normalize`] would give back unchanged. The slashes are found with `memchr` (a word at a time): every
/// open under the source by a program under `tierstore run` asks this twice, and a byte-by-byte split
/// cost 70 more instructions a warm open (callgrind, docs/benchmarks/shim-open.md).
fn plain_absolute(path: &[u8]) -> bool {
    let Some(rest) = path.strip_prefix(b"/") else { return false };
    let plain = |name: &[u8]| !matches!(name, b"" | b"." | b"..");
    let mut start = 0;
    for slash in memchr::memchr_iter(b'/', rest) {
        if !plain(&rest[start..slash]) {
            return false;
        }
        start = slash + 1;
    }
    plain(&rest[start..])
}

/// The part of `path` below `root` (normalized), when `path` spells it plainly: `root`, a `/`, then
/// names with no empty, `.` or `..` among them and no `/` at the end. That is what normalizing `path` and
/// stripping `root` gives for such a path; `None` for any other, which takes that way.
fn plain_relative<'a>(path: &'a [u8], root: &[u8]) -> Option<&'a [u8]> {
    let rest = path.strip_prefix(root)?;
    plain_absolute(rest).then(|| &rest[1..])
}

impl PosixSource {
    /// A source rooted at `root` (an existing directory with symlinks resolved) that may also be named
    /// `alias`, counting into `counters`. Nothing is asked of the store until a file is.
    pub fn new(root: &Path, alias: Option<&Path>, counters: Arc<Counters>) -> PosixSource {
        let root = normalize(root);
        let alias = alias.map(normalize).filter(|a| *a != root);
        PosixSource { root, alias, dir: OnceLock::new(), counters }
    }

    /// The descriptor of the root, opened on first use.
    fn dir(&self) -> io::Result<&File> {
        if let Some(d) = self.dir.get() {
            return Ok(d);
        }
        let d = crate::interposer::lasting(|| open_dir(&self.root))?;
        Ok(self.dir.get_or_init(|| d))
    }

    /// The identity of a source file (one counted `stat`). A directory is an `IsADirectory` error.
    pub fn identify(&self, rel: &str) -> io::Result<SourceId> {
        self.counters.add(slot::STATS, 1);
        let st = stat_at(self.dir()?, rel)?;
        if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
            return Err(io::Error::from_raw_os_error(libc::EISDIR));
        }
        Ok(SourceId::of_stat(&st))
    }

    /// The identity of `rel`, which this process has just opened on the source as `file` (one counted
    /// `stat`, with no directory check). The attributes come from the client's cache when it has them
    /// (`statx` with `AT_STATX_DONT_SYNC`): the open has just looked the file up, so they are as fresh as
    /// a round trip to the store would make them, and the store is spared one metadata operation per
    /// miss. Whether `rel` is the file's own path (no symlink on the way) is read from the descriptor's
    /// name in /proc, which the kernel knows without asking the store.
    pub fn identify_file(&self, file: &File, rel: &str) -> io::Result<(SourceId, bool)> {
        use std::os::fd::AsRawFd;
        self.counters.add(slot::STATS, 1);
        let mut x = std::mem::MaybeUninit::<libc::statx>::zeroed();
        let flags = libc::AT_EMPTY_PATH | libc::AT_STATX_DONT_SYNC;
        // SAFETY: statx writes into `x` on success; the path is the empty C string.
        let rc = unsafe {
            crate::sys::statx(file.as_raw_fd(), c"".as_ptr(), flags, libc::STATX_BASIC_STATS, x.as_mut_ptr())
        };
        let (mut id, is_dir) = if rc == 0 {
            // SAFETY: statx succeeded.
            let x = unsafe { x.assume_init() };
            (from_statx(&x), u32::from(x.stx_mode) & libc::S_IFMT == libc::S_IFDIR)
        } else {
            let m = file.metadata()?;
            (SourceId::of(&m), m.is_dir())
        };
        if let Some(a) = id.attrs.as_mut() {
            let named = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()));
            a.canonical = named.is_ok_and(|p| p == self.root.join(rel));
        }
        Ok((id, is_dir))
    }

    /// The source directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The counters of the source.
    pub fn counters(&self) -> &Arc<Counters> {
        &self.counters
    }

    /// The path of `path` relative to the source. Relative paths are taken from the current directory,
    /// as `open()` takes them.
    pub fn relative(&self, path: &Path) -> Result<String, OutsideSource> {
        use std::os::unix::ffi::OsStrExt;
        // Every open of a program under `tierstore run` comes here: a path spelled plainly under the root
        // is cut, not rebuilt component by component (a few percent of a warm open's CPU, `perf`).
        if let Some(rel) = plain_relative(path.as_os_str().as_bytes(), self.root.as_os_str().as_bytes()) {
            return Ok(crate::index::rel_text(rel));
        }
        let abs = if path.is_absolute() {
            normalize(path)
        } else {
            normalized(std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/")).join(path))
        };
        let rel = abs.strip_prefix(&self.root).or_else(|e| self.alias.as_ref().map_or(Err(e), |a| abs.strip_prefix(a)));
        match rel {
            Ok(r) if !r.as_os_str().is_empty() => Ok(r.to_string_lossy().into_owned()),
            _ => Err(OutsideSource { path: path.to_path_buf(), source_root: self.root.clone() }),
        }
    }

    /// Like [`PosixSource::relative`], with the source directory itself as `""`.
    pub fn relative_or_root(&self, path: &Path) -> Result<String, OutsideSource> {
        let abs = normalize(path);
        if abs == self.root || self.alias.as_ref() == Some(&abs) {
            return Ok(String::new());
        }
        self.relative(path)
    }

    /// The absolute path of a source-relative path.
    pub fn path_of(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }

    /// `stat` of a source file (counted).
    pub fn stat(&self, rel: &str) -> io::Result<std::fs::Metadata> {
        self.counters.add(slot::STATS, 1);
        std::fs::metadata(self.path_of(rel))
    }

    /// `stat` of an absolute path under the source (counted).
    pub fn stat_path(&self, path: &Path) -> io::Result<std::fs::Metadata> {
        self.counters.add(slot::STATS, 1);
        std::fs::metadata(path)
    }

    /// Opens `name` in the source directory `dir` for reading (counted): one lookup of the last
    /// component only, where a path from the root would look every directory on the way up again (a store
    /// without client caching, FUSE with zero timeouts among them, answers each lookup with a round trip).
    /// Directories open too, and a FIFO does not block (`O_NONBLOCK`, which regular files ignore), so that
    /// an entry of unknown type is identified by opening it.
    pub fn open_in(&self, dir: &File, name: &std::ffi::OsStr) -> io::Result<File> {
        use std::os::unix::ffi::OsStrExt;
        self.counters.add(slot::OPENS, 1);
        let c = std::ffi::CString::new(name.as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "name with a NUL byte"))?;
        open_at_flags(dir, &c, libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NONBLOCK)
    }

    /// `stat` of `name` in the source directory `dir`, following symlinks (counted).
    pub fn stat_in(&self, dir: &File, name: &std::ffi::OsStr) -> io::Result<libc::stat> {
        use std::os::unix::ffi::OsStrExt;
        self.counters.add(slot::STATS, 1);
        let c = std::ffi::CString::new(name.as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "name with a NUL byte"))?;
        stat_at_c(dir, &c)
    }

    /// Opens a source file for reading (counted), as the file system resolves its path: a symlink is
    /// followed wherever it leads, as for any program of this node. Every local open goes this way.
    pub fn open_file(&self, rel: &str) -> io::Result<File> {
        self.counters.add(slot::OPENS, 1);
        open_at(self.dir()?, rel)
    }

    /// Opens a source file for reading strictly beneath the source directory (counted as an open): the
    /// open for a path that another node named (the agent's `Fetch`, `FetchRanges` and `Damaged`). The
    /// kernel resolves `rel` from the root's descriptor with `openat2(RESOLVE_BENEATH |
    /// RESOLVE_NO_MAGICLINKS)`: a symlink inside the source may lead to another file inside it, never out
    /// of it (an absolute target, or `..` past the root, fails with `EXDEV`), and `/proc` magic links are
    /// not followed. The descriptor returned is the file that was resolved beneath, so what is read from
    /// it (or what is checked against its identity) cannot be another file swapped in after a check.
    ///
    /// On a kernel without `openat2` (before Linux 5.6, or a seccomp filter that refuses it with `ENOSYS`
    /// or `EPERM`) the path is walked one component at a time with `O_NOFOLLOW`, and a symlink anywhere on
    /// it is refused: stricter, never looser.
    ///
    /// A path that leaves the source is a `PermissionDenied` error that says so ("… resolves outside the
    /// source …"); the reader then reads the file from the store itself, as its own file system resolves
    /// it. Local opens ([`PosixSource::open_file`]) keep following the file system's own rules.
    pub fn open_beneath(&self, rel: &str) -> io::Result<File> {
        self.counters.add(slot::OPENS, 1);
        let dir = self.dir()?;
        let c = c_path(rel)?;
        match openat2_beneath(dir, &c) {
            Ok(f) => Ok(f),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSYS | libc::EPERM)) => {
                walk_nofollow(dir, rel).map_err(|e| match e {
                    Walked::Symlink(at) => self.outside(
                        rel,
                        &format!("{at} is a symlink, which this kernel (no openat2) cannot follow beneath the source"),
                    ),
                    Walked::Failed(e) => e,
                })
            }
            Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
                Err(self.outside(rel, "a symlink on its path leads out of the source directory"))
            }
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                Err(self.outside(rel, &format!("its path goes through a /proc magic link or too many symlinks ({e})")))
            }
            Err(e) => Err(e),
        }
    }

    /// The error of a request from another node whose path `rel` leaves the source (`why`). The caller
    /// names the path (`Error::io`).
    fn outside(&self, rel: &str, why: &str) -> io::Error {
        io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{rel} resolves outside the source {} ({why}): a request from another node is served only \
                 from files beneath the source; that node reads it from the store itself",
                self.root.display()
            ),
        )
    }

    /// Counts a read of `n` bytes done on a source descriptor.
    #[inline]
    pub fn count_read(&self, n: usize) {
        self.counters.add(slot::READS, 1);
        self.counters.add(slot::BYTES_READ, n as u64);
    }

    /// Reads a whole source file into memory with as few reads as its size allows. Returns the bytes and
    /// the identity of the file as it was after the read; the caller publishes only if that identity is
    /// the one it reserved for (a file rewritten during the read is served but never cached).
    /// `pre` is the file when the caller already opened it.
    fn read_whole_file(&self, rel: &str, expect: u64, pre: Option<File>) -> io::Result<(Vec<u8>, SourceId)> {
        use std::os::fd::AsRawFd;
        let f = match pre {
            Some(f) => f,
            None => self.open_file(rel)?,
        };
        // Room for one byte more than expected, to notice a file that grew. Reads go straight into the
        // spare capacity: zeroing the buffer first would cost a pass over every byte.
        let mut buf: Vec<u8> = Vec::with_capacity(expect as usize + 1);
        loop {
            if buf.len() == buf.capacity() {
                buf.reserve(64 << 10);
            }
            let spare = buf.capacity() - buf.len();
            // SAFETY: read(2) writes at most `spare` bytes into the vector's unused capacity.
            let n = unsafe { libc::read(f.as_raw_fd(), buf.as_mut_ptr().add(buf.len()) as *mut _, spare) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            self.count_read(n as usize);
            if n == 0 {
                break;
            }
            // SAFETY: the kernel initialized the `n` bytes after the old length.
            unsafe { buf.set_len(buf.len() + n as usize) };
        }
        let id = SourceId::of(&f.metadata()?);
        Ok((buf, id))
    }

    /// Tells the kernel a source file will be read from start to end (larger readahead for copies).
    pub fn advise_sequential(f: &File) {
        use std::os::fd::AsRawFd;
        // SAFETY: advice on an open descriptor; failure only loses the hint.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_SEQUENTIAL) };
    }

    /// Copies up to `len` bytes at `offset` of the source file `from` to the current position of `to`
    /// inside the kernel (`sendfile`), without a pass through a buffer of ours and without moving `from`'s
    /// file offset (a program may share that open file). Counted as a read.
    pub fn send_at(&self, from: &File, to: &File, offset: u64, len: usize) -> io::Result<usize> {
        use std::os::fd::AsRawFd;
        let mut off = offset as libc::off_t;
        // SAFETY: two open descriptors and an offset variable the call updates.
        let n = unsafe { libc::sendfile(to.as_raw_fd(), from.as_raw_fd(), &mut off, len) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        self.count_read(n as usize);
        Ok(n as usize)
    }

    /// Reads at `offset` from an open source descriptor (counted).
    pub fn read_file_at(&self, f: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let n = f.read_at(buf, offset)?;
        self.count_read(n);
        Ok(n)
    }
}

/// A copy step of full size; the first is smaller (see [`FIRST_COPY_CHUNK`]).
const COPY_CHUNK: usize = 4 << 20;
/// The first step of a copy: readers of a growing copy wait for it, so it is as small as a read of the
/// source would be; steps then double up to [`COPY_CHUNK`].
const FIRST_COPY_CHUNK: usize = 256 << 10;

/// Files at least this large are copied from a POSIX store by [`copy_streams`] readers at once.
pub const PARALLEL_COPY_MIN: u64 = 64 << 20;

/// The number of ranged readers for a large file: `TIERSTORE_COPY_STREAMS` (1 to 64; 1 copies with one
/// sequential reader), else the settings table's default. Read once per process.
pub fn copy_streams() -> usize {
    static STREAMS: OnceLock<usize> = OnceLock::new();
    *STREAMS.get_or_init(|| crate::config::settings::tuning("TIERSTORE_COPY_STREAMS") as usize)
}

/// Copies the first `size` bytes of `src` to `to` with `streams` readers, each reading every
/// `streams`-th chunk of `COPY_CHUNK` bytes into buffers of its own, while this thread writes the
/// chunks in order, hashes them once and reports progress, so that readers following the growing copy
/// see it grow from the start as they would with one reader. At most two chunks per reader are in
/// memory. Returns the bytes copied: `size`, or one more when the file has grown (the caller then
/// compares identities and does not publish).
fn copy_ranged(
    source: &PosixSource,
    src: &File,
    size: u64,
    streams: usize,
    out: &mut CopyOut<'_, '_>,
) -> Result<u64, CopyFault> {
    use std::sync::mpsc;
    let chunks = size.div_ceil(COPY_CHUNK as u64);
    let streams = streams.min(chunks as usize).max(1);
    std::thread::scope(|scope| {
        let mut filled = Vec::with_capacity(streams);
        let mut spare = Vec::with_capacity(streams);
        for r in 0..streams {
            let (full_tx, full_rx) = mpsc::sync_channel::<io::Result<(Vec<u8>, usize)>>(2);
            let (free_tx, free_rx) = mpsc::channel::<Vec<u8>>();
            for _ in 0..2 {
                let _ = free_tx.send(vec![0u8; COPY_CHUNK]);
            }
            scope.spawn(move || {
                let mut chunk = r as u64;
                while chunk < chunks {
                    let Ok(mut buf) = free_rx.recv() else { return };
                    let offset = chunk * COPY_CHUNK as u64;
                    let want = (size - offset).min(COPY_CHUNK as u64) as usize;
                    let read = read_fully(source, src, &mut buf[..want], offset).map(|n| (buf, n));
                    let failed = read.is_err();
                    if full_tx.send(read).is_err() || failed {
                        return;
                    }
                    chunk += streams as u64;
                }
            });
            filled.push(full_rx);
            spare.push(free_tx);
        }
        for chunk in 0..chunks {
            let r = (chunk % streams as u64) as usize;
            let (buf, n) = match filled[r].recv() {
                Ok(Ok(got)) => got,
                Ok(Err(e)) => return Err(CopyFault::Source(e)),
                Err(_) => return Err(CopyFault::Source(io::Error::other("a copy reader stopped"))),
            };
            out.take(&buf[..n])?;
            let _ = spare[r].send(buf);
            if n < COPY_CHUNK && out.written < size {
                // Shorter than asked before the end: the file shrank. Stop; the identity says so.
                return Ok(out.written);
            }
        }
        // One byte past the end tells a file that grew meanwhile.
        let mut probe = [0u8; 1];
        let grown = source.read_file_at(src, &mut probe, size).map_err(CopyFault::Source)?;
        Ok(out.written + grown as u64)
    })
}

/// Where a copy's bytes go, in order: the tier's file, the hash of the copy (when recorded), and the
/// progress its readers follow.
struct CopyOut<'a, 'h> {
    to: &'a File,
    hasher: Option<&'a mut crate::hash::Pieces<'h>>,
    progress: &'a mut dyn FnMut(u64),
    written: u64,
}

impl CopyOut<'_, '_> {
    /// Writes the next bytes of the copy, hashes them and reports the bytes written so far.
    fn take(&mut self, bytes: &[u8]) -> Result<(), CopyFault> {
        use std::io::Write;
        let mut to = self.to;
        to.write_all(bytes).map_err(CopyFault::Tier)?;
        if let Some(h) = self.hasher.as_mut() {
            h.update(bytes);
        }
        self.written += bytes.len() as u64;
        (self.progress)(self.written);
        Ok(())
    }
}

/// Reads `buf.len()` bytes at `offset`, fewer only at the end of the file.
fn read_fully(source: &PosixSource, src: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match source.read_file_at(src, &mut buf[n..], offset + n as u64)? {
            0 => break,
            got => n += got,
        }
    }
    Ok(n)
}

fn posix_file(file: &SourceFile) -> io::Result<&File> {
    file.as_file().ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "not a file of a POSIX source"))
}

impl Source for PosixSource {
    fn root(&self) -> &Path {
        PosixSource::root(self)
    }

    fn relative(&self, path: &Path) -> Result<String, OutsideSource> {
        PosixSource::relative(self, path)
    }

    fn relative_or_root(&self, path: &Path) -> Result<String, OutsideSource> {
        PosixSource::relative_or_root(self, path)
    }

    fn path_of(&self, rel: &str) -> PathBuf {
        PosixSource::path_of(self, rel)
    }

    fn counters(&self) -> &Arc<Counters> {
        PosixSource::counters(self)
    }

    fn identify(&self, rel: &str) -> io::Result<SourceId> {
        PosixSource::identify(self, rel)
    }

    fn open(&self, rel: &str) -> io::Result<SourceFile> {
        self.open_file(rel).map(SourceFile::Posix)
    }

    fn reopen(&self, rel: &str, sid: &SourceId) -> io::Result<SourceFile> {
        // A reader whose copy failed half way goes on from the same offset: only in the same version.
        let f = self.open_file(rel)?;
        let now = f.metadata().map(|m| SourceId::of(&m))?;
        if now != *sid {
            return Err(io::Error::other(format!(
                "{}: the file changed while being read; open it again to read the new version",
                self.path_of(rel).display()
            )));
        }
        Ok(SourceFile::Posix(f))
    }

    fn identify_opened(&self, file: &SourceFile, rel: &str) -> io::Result<(SourceId, bool)> {
        self.identify_file(posix_file(file)?, rel)
    }

    fn read_at(&self, file: &SourceFile, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        self.read_file_at(posix_file(file)?, buf, offset)
    }

    fn read_whole(&self, rel: &str, expect: u64, pre: Option<SourceFile>) -> io::Result<(Vec<u8>, SourceId)> {
        self.read_whole_file(rel, expect, pre.and_then(SourceFile::into_file))
    }

    fn copy(
        &self,
        from: &SourceFile,
        to: &File,
        size: u64,
        mut hasher: Option<&mut crate::hash::Pieces<'_>>,
        progress: &mut dyn FnMut(u64),
    ) -> Result<(u64, Option<SourceId>), CopyFault> {
        use std::io::Write;
        let src = posix_file(from).map_err(CopyFault::Source)?;
        if size >= PARALLEL_COPY_MIN && copy_streams() > 1 {
            let mut out = CopyOut { to, hasher, progress, written: 0 };
            let copied = copy_ranged(self, src, size, copy_streams(), &mut out)?;
            let after = src.metadata().map(|m| SourceId::of(&m)).ok();
            return Ok((copied, after));
        }
        PosixSource::advise_sequential(src);
        let mut buf = Vec::new();
        let full = COPY_CHUNK.min(size as usize + 1).max(1);
        let mut want = FIRST_COPY_CHUNK.min(full);
        let mut copied = 0u64;
        // Without a checksum to compute, the kernel copies from the source to the tier directly: one
        // memory copy per byte instead of two, which is CPU a first epoch shares with the job.
        let mut in_kernel = hasher.is_none();
        let mut out = to;
        loop {
            let step = if in_kernel {
                self.send_at(src, to, copied, want).map_err(|e| match e.raw_os_error() {
                    Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG) => CopyFault::Tier(e),
                    _ => CopyFault::Source(e),
                })
            } else {
                if buf.len() < full {
                    buf.resize(full, 0);
                }
                self.read_file_at(src, &mut buf[..want], copied).map_err(CopyFault::Source).and_then(|n| {
                    out.write_all(&buf[..n]).map_err(CopyFault::Tier)?;
                    if let Some(h) = hasher.as_mut() {
                        h.update(&buf[..n]);
                    }
                    Ok(n)
                })
            };
            let n = match step {
                Ok(n) => n,
                Err(CopyFault::Source(e))
                    if in_kernel
                        && matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP)) =>
                {
                    in_kernel = false; // a file system that cannot: copy through a buffer
                    continue;
                }
                Err(fault) => return Err(fault),
            };
            if n == 0 {
                break;
            }
            copied += n as u64;
            want = (want * 2).min(full);
            progress(copied.min(size));
            if copied > size {
                break;
            }
        }
        // A file rewritten during the copy is never published: the caller compares this identity.
        let after = src.metadata().map(|m| SourceId::of(&m)).ok();
        Ok((copied, after))
    }

    fn list(&self, rel: &str) -> io::Result<Vec<ListedEntry>> {
        let dir = if rel.is_empty() { open_dir(&self.root)? } else { open_dir(&self.path_of(rel))? };
        Ok(list_dir(&dir)?
            .into_iter()
            .map(|(name, kind)| ListedEntry {
                name,
                is_dir: match kind {
                    libc::DT_DIR => Some(true),
                    libc::DT_UNKNOWN => None,
                    _ => Some(false),
                },
            })
            .collect())
    }

    fn identities(&self, dir: &str) -> io::Result<Vec<(String, SourceId)>> {
        let handle = if dir.is_empty() { open_dir(&self.root)? } else { open_dir(&self.path_of(dir))? };
        self.counters.add(slot::LISTS, 1);
        let names: Vec<String> = list_dir(&handle)?
            .into_iter()
            .filter(|(_, kind)| *kind != libc::DT_DIR)
            .filter_map(|(name, _)| name.into_string().ok())
            .collect();
        self.counters.add(slot::STATS, names.len() as u64);
        // A store answers each `stat` with a round trip: a few at once keep a directory of thousands from
        // paying them one after another.
        let per_thread = names.len().div_ceil(CONFIRM_THREADS).max(1);
        let stat_all = |chunk: &[String]| -> Vec<(String, SourceId)> {
            chunk
                .iter()
                .filter_map(|name| {
                    // Gone since the listing, or unreadable: not confirmed, which sends its next open to the
                    // store to say what it is.
                    let st = stat_at(&handle, name).ok()?;
                    (st.st_mode & libc::S_IFMT == libc::S_IFREG).then(|| (name.clone(), SourceId::of_stat(&st)))
                })
                .collect()
        };
        let out = std::thread::scope(|scope| {
            let workers: Vec<_> = names.chunks(per_thread).map(|chunk| scope.spawn(move || stat_all(chunk))).collect();
            workers.into_iter().flat_map(|w| w.join().unwrap_or_default()).collect()
        });
        Ok(out)
    }

    fn posix(&self) -> Option<&PosixSource> {
        Some(self)
    }
}

/// How many `stat`s of one directory's files are in flight at once when it is confirmed.
const CONFIRM_THREADS: usize = 8;

/// A source identity from `statx`'s answer.
fn from_statx(x: &libc::statx) -> SourceId {
    use crate::index::SourceAttrs;
    let ns = |t: libc::statx_timestamp| t.tv_sec * 1_000_000_000 + i64::from(t.tv_nsec);
    SourceId {
        size: x.stx_size,
        mtime_ns: ns(x.stx_mtime),
        ctime_ns: ns(x.stx_ctime),
        ino: x.stx_ino,
        dev: libc::makedev(x.stx_dev_major, x.stx_dev_minor),
        attrs: Some(SourceAttrs {
            mode: u32::from(x.stx_mode),
            uid: x.stx_uid,
            gid: x.stx_gid,
            nlink: u64::from(x.stx_nlink),
            atime_ns: ns(x.stx_atime),
            blksize: u64::from(x.stx_blksize),
            blocks: x.stx_blocks,
            canonical: false,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plainly_spelled_path_is_cut_as_normalizing_it_would() {
        let c = Arc::new(Counters::open(&tempfile::tempdir().unwrap().path().join("c")).unwrap());
        let s = PosixSource::new(Path::new("/data/set"), Some(Path::new("/alias/set")), c);
        for (path, plain) in [
            ("/data/set/a.bin", true),
            ("/data/set/d/e/f.bin", true),
            ("/data/set/.hidden/..x", true),
            ("/data/set", false),
            ("/data/set/", false),
            ("/data/settle/a.bin", false),
            ("/data/set//a.bin", false),
            ("/data/set/./a.bin", false),
            ("/data/set/d/../a.bin", false),
            ("/data/set/d/", false),
            ("/data/set/d/..", false),
            ("/alias/set/a.bin", false),
            ("/other/a.bin", false),
        ] {
            assert_eq!(plain_relative(path.as_bytes(), b"/data/set").is_some(), plain, "{path}");
            // Cut or normalized, the answer is the same.
            let slow = {
                let abs = normalize(Path::new(path));
                let rel = abs.strip_prefix("/data/set").or_else(|_| abs.strip_prefix("/alias/set"));
                rel.ok().filter(|r| !r.as_os_str().is_empty()).map(|r| r.to_string_lossy().into_owned())
            };
            assert_eq!(s.relative(Path::new(path)).ok(), slow, "{path}");
        }
    }

    #[test]
    fn the_check_of_a_plain_path_agrees_with_its_definition_on_every_short_path() {
        // Every path of up to 8 bytes of `/`, `.` and `a`, against the definition: `/`, then names split
        // on `/`, none of them empty, `.` or `..`.
        let by_names = |p: &[u8]| match p.strip_prefix(b"/") {
            Some(rest) => !rest.is_empty() && rest.split(|&b| b == b'/').all(|n| !matches!(n, b"" | b"." | b"..")),
            None => false,
        };
        let mut paths: Vec<Vec<u8>> = vec![Vec::new()];
        for _ in 0..8 {
            paths = paths.iter().flat_map(|p| [b'/', b'.', b'a'].map(|b| [p.as_slice(), &[b]].concat())).collect();
            for p in &paths {
                assert_eq!(plain_absolute(p), by_names(p), "{}", String::from_utf8_lossy(p));
            }
        }
    }

    #[test]
    fn a_plain_path_is_its_own_normal_form_and_any_other_is_rebuilt() {
        for (path, plain) in [
            ("/a", true),
            ("/data/set/d/e/f.bin", true),
            ("/data/.hidden/..x/...", true),
            ("/", false),
            ("//a", false),
            ("/a//b", false),
            ("/a/./b", false),
            ("/a/b/../c", false),
            ("/a/b/", false),
            ("/a/b/.", false),
            ("/a/..", false),
            ("/../a", false),
        ] {
            assert_eq!(plain_absolute(path.as_bytes()), plain, "{path}");
            // Returned as it is or rebuilt, the answer is the one rebuilding gives (the way every path took
            // before plain ones were returned as they are).
            assert_eq!(normalize(Path::new(path)), rebuilt(Path::new(path)), "{path}");
            assert_eq!(normalized(PathBuf::from(path)), rebuilt(Path::new(path)), "{path}");
        }
    }

    #[test]
    fn a_large_file_copied_by_ranged_readers_arrives_whole_in_order_and_hashed_once() {
        use std::io::{Seek, SeekFrom};
        let dir = tempfile::tempdir().unwrap();
        let c = Arc::new(Counters::open(&dir.path().join("c")).unwrap());
        let root = dir.path().join("src");
        std::fs::create_dir(&root).unwrap();
        let s = PosixSource::new(&root, None, c);
        // 7.5 chunks: the last one short, three readers taking turns.
        let bytes: Vec<u8> = (0..(COPY_CHUNK * 15 / 2)).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(root.join("big"), &bytes).unwrap();
        let src = File::open(root.join("big")).unwrap();
        for (size, grown) in [(bytes.len() as u64, 0), (bytes.len() as u64 - 10, 1)] {
            let mut to = tempfile::tempfile().unwrap();
            let mut hasher = crate::hash::Pieces::new(size);
            let mut seen = Vec::new();
            let mut report = |n| seen.push(n);
            let mut out = CopyOut { to: &to, hasher: Some(&mut hasher), progress: &mut report, written: 0 };
            let copied = copy_ranged(&s, &src, size, 3, &mut out).unwrap_or_else(|_| panic!("the copy failed"));
            assert_eq!(copied, size + grown, "one byte more tells a file longer than asked");
            assert!(seen.windows(2).all(|w| w[0] < w[1]) && seen.last() == Some(&size), "progress in order");
            to.seek(SeekFrom::Start(0)).unwrap();
            let mut got = Vec::new();
            std::io::Read::read_to_end(&mut to, &mut got).unwrap();
            assert_eq!(got, &bytes[..size as usize]);
            assert_eq!(hasher.finalize(), *blake3::hash(&got).as_bytes());
        }
    }

    #[test]
    fn relative_paths_and_escapes() {
        let dir = tempfile::tempdir().unwrap();
        let c = Arc::new(Counters::open(&dir.path().join("c")).unwrap());
        let root = dir.path().join("src");
        std::fs::create_dir(&root).unwrap();
        let s = PosixSource::new(&root, None, c);
        assert_eq!(s.relative(&root.join("a/./b/../c.txt")).unwrap(), "a/c.txt");
        assert!(s.relative(&root.join("../etc/passwd")).is_err());
        assert!(s.relative(&root).is_err());
        assert!(s.relative(Path::new("/etc/passwd")).unwrap_err().to_string().contains("outside the cached source"));
    }

    #[test]
    fn a_request_from_another_node_opens_only_beneath_the_source() {
        use std::io::Read;
        use std::os::unix::fs::symlink;
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().canonicalize().unwrap();
        let c = Arc::new(Counters::open(&base.join("c")).unwrap());
        let root = base.join("src");
        std::fs::create_dir_all(root.join("d/e")).unwrap();
        std::fs::write(base.join("secret"), b"secret").unwrap();
        std::fs::write(root.join("inside.txt"), b"inside").unwrap();
        std::fs::write(root.join("d/e/deep.txt"), b"deep").unwrap();
        symlink("inside.txt", root.join("link_in")).unwrap();
        symlink("../../inside.txt", root.join("d/e/up_in")).unwrap();
        symlink(root.join("inside.txt"), root.join("abs_in")).unwrap();
        symlink("d", root.join("dir_in")).unwrap();
        symlink(base.join("secret"), root.join("escape")).unwrap();
        symlink("../secret", root.join("up")).unwrap();
        symlink("..", root.join("parent")).unwrap();
        symlink("/proc/self/root", root.join("magic")).unwrap();
        let s = PosixSource::new(&root, None, c);
        let read = |f: File| {
            let mut out = Vec::new();
            (&f).read_to_end(&mut out).unwrap();
            out
        };
        // Beneath the source, through relative symlinks too.
        for (rel, want) in [
            ("inside.txt", &b"inside"[..]),
            ("link_in", b"inside"),
            ("d/e/deep.txt", b"deep"),
            ("d/e/up_in", b"inside"),
            ("dir_in/e/deep.txt", b"deep"),
        ] {
            assert_eq!(read(s.open_beneath(rel).unwrap()), want, "{rel}");
        }
        // Out of it: refused, and said so. (An absolute symlink is outside even when it names a file of
        // the source: RESOLVE_BENEATH does not resolve absolute targets.)
        for rel in ["escape", "up", "parent/secret", "magic/etc/passwd", "abs_in"] {
            let e = s.open_beneath(rel).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{rel}: {e}");
            assert!(e.to_string().contains("resolves outside the source"), "{rel}: {e}");
        }
        assert_eq!(s.open_beneath("missing").unwrap_err().kind(), io::ErrorKind::NotFound);
        // A local open follows the file system's rules.
        assert_eq!(read(s.open_file("escape").unwrap()), b"secret");

        // The walk of a kernel without openat2: no symlink at all, in any component.
        let d = s.dir().unwrap();
        assert_eq!(read(walk_nofollow(d, "d/e/deep.txt").ok().unwrap()), b"deep");
        for (rel, at) in [("link_in", "link_in"), ("dir_in/e/deep.txt", "dir_in"), ("escape", "escape")] {
            match walk_nofollow(d, rel) {
                Err(Walked::Symlink(named)) => assert_eq!(named, at),
                _ => panic!("{rel}: a symlink was followed"),
            }
        }
        assert!(matches!(walk_nofollow(d, "d/../inside.txt"), Err(Walked::Failed(_))));
        assert!(matches!(walk_nofollow(d, "missing"), Err(Walked::Failed(e)) if e.kind() == io::ErrorKind::NotFound));
        // The device and inode of an open file, as its identity records them.
        let f = s.open_beneath("inside.txt").unwrap();
        let id = SourceId::of(&f.metadata().unwrap());
        assert_eq!(inode_of(&f).unwrap(), (id.dev, id.ino));
    }
}
