//! Write-back capture: under `tierstore run`, files written under a `[[writeback]]` destination go to the
//! node's stage and are journaled at close (see `tierstore_core::writeback`).
//!
//! - An open that writes (`O_WRONLY`/`O_RDWR`, `O_CREAT`, `O_TRUNC`, `O_APPEND`; stdio `w`, `a`, `r+`)
//!   gets a descriptor of a new staged file, filled first with the file's current bytes unless truncated.
//!   `write`, `pwrite`, `ftruncate`, `fsync` and `mmap` then work natively on it.
//! - `close` and `fclose` hash and journal it, fsyncing it first unless durability is "buffered"; with
//!   durability "remote" they return once the agent put it on the store. A descriptor still open at exit is journaled by the exit handler.
//! - A writable shared mapping made from the descriptor holds the journaling back until it is unmapped
//!   (`munmap`) or the process exits: numpy's `memmap` and Python's `mmap` close the file first and write
//!   through the mapping afterwards.
//! - `rename`/`renameat`/`renameat2` of a pending file move its journal entry (the bytes stay staged);
//!   `unlink` and `truncate` of a pending file change the journal; of any other file, the store.
//! - `open` (read-only), the `stat` family and `access` of a pending file see the staged copy; of a file
//!   another node staged and has not yet put on the store, that node's copy (through its agent).
//!
//! Not captured, and passed to the store as they are: `O_DIRECT` and `O_PATH` opens (warned once),
//! exclusive creates of `.tmp*` files (the `tempfile` crate's, renamed with raw system calls; warned once,
//! and written only once the files closed before them in their directory are on the store), `io_uring`, static binaries (no LD_PRELOAD at all), and writes through a descriptor inherited
//! from another process or duplicated and used after the original was closed (and mappings made from such
//! a descriptor). Listings on other nodes than the writer's show only what is on the store. A file's
//! permission bits on the store are the agent's defaults.

use std::ffi::CStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use libc::{c_char, c_int, c_uint, FILE};
use parking_lot::Mutex;
use tierstore_core::writeback::{Begin, Writeback};

use crate::{set_errno, Busy};

/// The write-back of one process: `None` when no destination is configured (the common case, which
/// then costs one atomic load per call).
struct Writes {
    pid: u32,
    wb: Option<Writeback>,
}

static WRITES: AtomicPtr<Writes> = AtomicPtr::new(std::ptr::null_mut());
static INIT: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub(crate) fn writeback() -> Option<&'static Writeback> {
    let pid = tierstore_core::pid();
    // SAFETY: these are leaked, never freed.
    if let Some(w) = unsafe { WRITES.load(Ordering::Acquire).as_ref() } {
        if w.pid == pid {
            return w.wb.as_ref();
        }
    }
    let _g = INIT.lock().unwrap_or_else(|e| e.into_inner());
    let inherited = unsafe { WRITES.load(Ordering::Acquire).as_ref() };
    if let Some(w) = inherited {
        if w.pid == pid {
            return w.wb.as_ref();
        }
    }
    let wb = match inherited {
        // A forked child stages to the destinations its parent read (none, most often), without reading
        // the configuration again; its journal handles are its own.
        Some(parent) => parent.wb.as_ref().map(|wb| Writeback::new(wb.destinations().to_vec())),
        None => match Writeback::load() {
            Ok(wb) if !wb.destinations().is_empty() => Some(wb),
            Ok(_) => None,
            Err(e) => {
                eprintln!("tierstore run: {e}; writes go straight to the store");
                None
            }
        },
    };
    // A forked child leaks its parent's (its journal handles must not be used or closed here).
    let w: &'static Writes = Box::leak(Box::new(Writes { pid, wb }));
    WRITES.store(w as *const Writes as *mut Writes, Ordering::Release);
    w.wb.as_ref()
}

/// A staged file this process is writing: through the descriptor it opened, through writable shared
/// mappings made from that descriptor, or both. It is journaled when the last of them goes.
struct Open {
    /// The descriptor; `None` once closed while a mapping still writes the file.
    fd: Option<c_int>,
    dest: PathBuf,
    /// Its name in the journal (a staged file).
    name: String,
    /// A file written through to the store (the stage was full): its hidden name there, renamed over
    /// `dest` when the last writer goes.
    through: Option<PathBuf>,
    pid: u32,
    /// Unlinked while open (a temporary file a saver dropped): its staged copy goes at close.
    deleted: bool,
    /// The address ranges `[start, end)` of its writable shared mappings still mapped.
    maps: Vec<(usize, usize)>,
}

static OPEN: Mutex<Vec<Open>> = Mutex::new(Vec::new());
/// Staged files being written: `close` of any other descriptor, and `mmap`, cost one load.
static OPEN_COUNT: AtomicUsize = AtomicUsize::new(0);
/// Writable shared mappings of staged files: `munmap` of anything else costs one load.
static MAPPED_COUNT: AtomicUsize = AtomicUsize::new(0);

fn warn_once(flag: &AtomicBool, message: impl FnOnce() -> String) {
    if !flag.swap(true, Ordering::Relaxed) {
        eprintln!("tierstore run: {}", message());
    }
}

/// The absolute, normalized path `path` (relative to `dirfd`) names, if it is under a destination.
unsafe fn dest_path(wb: &Writeback, dirfd: c_int, path: *const c_char) -> Option<PathBuf> {
    if path.is_null() {
        return None;
    }
    let bytes = CStr::from_ptr(path).to_bytes();
    if bytes.is_empty() {
        return None;
    }
    if bytes[0] == b'/' && !bytes.windows(3).any(|w| w == b"/..") {
        let under = wb.destinations().iter().any(|d| bytes.starts_with(d.path.as_os_str().as_bytes()));
        if !under {
            return None; // the common case: no allocation, no system call
        }
    }
    let norm = crate::absolute_at(dirfd, bytes)?;
    wb.destination(&norm).is_some().then_some(norm)
}

/// The staged copy of `abs`: one this process is still writing, else a pending one.
fn staged_copy(wb: &Writeback, abs: &Path) -> Option<PathBuf> {
    if OPEN_COUNT.load(Ordering::Relaxed) > 0 {
        let me = tierstore_core::pid();
        let found = OPEN
            .lock()
            .iter()
            .find(|o| o.dest == abs && o.pid == me && !o.deleted)
            .map(|o| (o.name.clone(), o.through.clone()));
        match found {
            Some((_, Some(temp))) => return Some(temp),
            Some((name, None)) => {
                let d = wb.destination(abs)?;
                return Some(wb.journal(d).ok()?.staged_path(&name));
            }
            None => {}
        }
    }
    wb.lookup(abs).map(|(p, _)| p)
}

fn real_exists(p: &Path) -> Option<std::fs::Metadata> {
    std::fs::symlink_metadata(p).ok()
}

/// How long a directory this process found on the store is taken to be there without asking again.
const KNOWN_DIR_FOR: Duration = Duration::from_secs(5);

/// Directories under a destination this process found on the store within [`KNOWN_DIR_FOR`]: a
/// checkpoint writes tens of files into one directory in a burst, and asking the store for it before
/// each costs a metadata round trip per file (an MDS request on Lustre, 6 ms on the stand-in store).
static KNOWN_DIRS: Mutex<Vec<(PathBuf, Instant)>> = Mutex::new(Vec::new());

/// Whether `dir` is a directory on the store: remembered for [`KNOWN_DIR_FOR`] once found. The lock is
/// only tried: a child forked while another thread held it asks the store instead of waiting forever.
fn dir_on_store(dir: &Path) -> bool {
    let fresh = |(d, t): &(PathBuf, Instant)| d == dir && t.elapsed() < KNOWN_DIR_FOR;
    if KNOWN_DIRS.try_lock().is_some_and(|known| known.iter().any(fresh)) {
        return true;
    }
    let found = dir.is_dir();
    if let (true, Some(mut known)) = (found, KNOWN_DIRS.try_lock()) {
        known.retain(|(d, t)| d != dir && t.elapsed() < KNOWN_DIR_FOR);
        if known.len() < 64 {
            known.push((dir.to_path_buf(), Instant::now()));
        }
    }
    found
}

/// The open family: `Some(fd)` (or `Some(-1)` with errno set) when the open was for a file under a
/// destination and was handled here; `None` leaves it to the real function.
pub unsafe fn open(dirfd: c_int, path: *const c_char, flags: c_int) -> Option<c_int> {
    let wb = writeback()?;
    let abs = dest_path(wb, dirfd, path)?;
    if flags & (libc::O_DIRECTORY | libc::O_PATH) != 0 {
        return None;
    }
    if !crate::opens_to_write(flags) {
        return open_to_read(wb, &abs, flags);
    }
    if flags & libc::O_DIRECT != 0 {
        static WARNED: AtomicBool = AtomicBool::new(false);
        warn_once(&WARNED, || {
            format!("O_DIRECT writes are not staged: {} (and others) go straight to the store", abs.display())
        });
        return None;
    }
    let excl = flags & (libc::O_CREAT | libc::O_EXCL) == libc::O_CREAT | libc::O_EXCL;
    if excl && abs.file_name().is_some_and(|n| n.as_bytes().starts_with(b".tmp")) {
        return write_temporary_to_store(wb, &abs);
    }
    open_to_stage(wb, abs, flags, excl)
}

/// A read of a file under a destination. Read-your-writes: a pending file reads from the stage; a file
/// another node staged and has not yet put on the store is received whole from its agent; anything else
/// is the store's (`None`).
unsafe fn open_to_read(wb: &Writeback, abs: &Path, flags: c_int) -> Option<c_int> {
    if let Some(staged) = staged_copy(wb, abs) {
        let c = std::ffi::CString::new(staged.as_os_str().as_bytes()).ok()?;
        let fd = libc::open(c.as_ptr(), flags);
        if fd >= 0 {
            return Some(fd);
        } // gone meanwhile: migrated, the store has it
    }
    match wb.peer_copy(abs) {
        Ok(Some(copy)) => {
            let c = std::ffi::CString::new(copy.as_os_str().as_bytes()).ok()?;
            let fd = libc::open(c.as_ptr(), flags);
            let _ = std::fs::remove_file(&copy); // the open descriptor keeps the bytes
            Some(fd)
        }
        Ok(None) => None,
        Err(e) => {
            eprintln!("tierstore run: {e}");
            set_errno(e.errno());
            Some(-1)
        }
    }
}

/// The temporary file of Rust's `tempfile` crate (safetensors' `save_file`, Hugging Face tools): it is
/// renamed into place by a raw system call (rustix), which no LD_PRELOAD shim sees, so it goes to the store
/// itself (`None`), once the files closed before it in its directory are there (order holds).
fn write_temporary_to_store(wb: &Writeback, abs: &Path) -> Option<c_int> {
    static WARNED: AtomicBool = AtomicBool::new(false);
    warn_once(&WARNED, || {
        format!(
            "{} looks like a `tempfile` crate temporary (renamed by raw system calls the shim cannot follow): \
             such files are written straight to the store",
            abs.display()
        )
    });
    let timeout = wb.destination(abs).map(|d| d.timeout)?;
    if let Err(e) = wb.wait(abs.parent(), timeout) {
        eprintln!("tierstore run: {e}");
    }
    None
}

/// A write of a file under a destination: the open's checks against what is pending and what the store
/// has (the errno the store would give), then a file in the stage (or, the stage full, a hidden one on the
/// store) with the current bytes first unless truncated, opened and remembered until its close.
unsafe fn open_to_stage(wb: &Writeback, abs: PathBuf, flags: c_int, excl: bool) -> Option<c_int> {
    let pending = wb.lookup(&abs);
    let on_store = if pending.is_none() { real_exists(&abs) } else { None };
    let exists = pending.is_some() || on_store.is_some();
    if on_store.as_ref().is_some_and(|m| m.is_dir()) {
        return None; // EISDIR from the store itself
    }
    if excl && exists {
        set_errno(libc::EEXIST);
        return Some(-1);
    }
    if flags & libc::O_CREAT == 0 && !exists {
        set_errno(libc::ENOENT);
        return Some(-1);
    }
    // A file on the store has its directory; a new one asks for it once per burst (see `dir_on_store`).
    if on_store.is_none() && !abs.parent().is_some_and(dir_on_store) {
        set_errno(libc::ENOENT);
        return Some(-1);
    }
    let (name, staged, through) = match wb.begin(&abs) {
        Ok(Begin::Staged { name, path }) => (name, path, None),
        // The stage is full: the store, under a hidden name until the file is whole.
        Ok(Begin::WriteThrough { temp }) => (String::new(), temp.clone(), Some(temp)),
        Err(e) => {
            eprintln!("tierstore run: cannot stage {} ({e}); writing it straight to the store", abs.display());
            return None;
        }
    };
    if flags & libc::O_TRUNC == 0 && exists {
        // The file's current bytes come first (an append, or an update in place).
        let from = pending.as_ref().map(|(p, _)| p.clone()).unwrap_or_else(|| abs.clone());
        if let Err(e) = copy_current_bytes(&from, &staged, through.is_some()) {
            let _ = std::fs::remove_file(&staged);
            set_errno(e.raw_os_error().unwrap_or(libc::EIO));
            return Some(-1);
        }
    }
    let c = std::ffi::CString::new(staged.as_os_str().as_bytes()).ok()?;
    let fd = libc::open(c.as_ptr(), flags & !(libc::O_CREAT | libc::O_EXCL | libc::O_TRUNC));
    if fd < 0 {
        return Some(-1);
    }
    let mut open = OPEN.lock();
    open.retain(|o| o.fd != Some(fd)); // closed behind the shim's back (a raw system call) and reused
    open.push(Open {
        fd: Some(fd),
        dest: abs,
        name,
        through,
        pid: tierstore_core::pid(),
        deleted: false,
        maps: Vec::new(),
    });
    OPEN_COUNT.store(open.len(), Ordering::Relaxed);
    Some(fd)
}

/// Copies a file's current bytes (`from`: its pending copy, or the store's) into the new `staged` one. A
/// staged file keeps the mode it was created with (0600: the stage is the user's alone), where
/// `std::fs::copy` would give it the source's; a file written through takes the source's, as before.
fn copy_current_bytes(from: &Path, staged: &Path, through: bool) -> std::io::Result<u64> {
    if through {
        return std::fs::copy(from, staged);
    }
    let mut src = std::fs::File::open(from)?;
    let mut dst = std::fs::OpenOptions::new().write(true).truncate(true).open(staged)?;
    std::io::copy(&mut src, &mut dst)
}

/// The `open` flags of a stdio mode.
unsafe fn fopen_flags(mode: *const c_char) -> c_int {
    let m = CStr::from_ptr(mode).to_bytes();
    let plus = m.contains(&b'+');
    let mut flags = match (m.first(), plus) {
        (Some(b'r'), false) => libc::O_RDONLY,
        (Some(b'r'), true) => libc::O_RDWR,
        (Some(b'w'), p) => (if p { libc::O_RDWR } else { libc::O_WRONLY }) | libc::O_CREAT | libc::O_TRUNC,
        (Some(b'a'), p) => (if p { libc::O_RDWR } else { libc::O_WRONLY }) | libc::O_CREAT | libc::O_APPEND,
        _ => libc::O_RDONLY,
    };
    if m.contains(&b'x') {
        flags |= libc::O_EXCL;
    }
    if m.contains(&b'e') {
        flags |= libc::O_CLOEXEC;
    }
    flags
}

/// `fopen` of a file under a destination: `Some(stream)` (null with errno set on failure) when handled.
pub unsafe fn fopen(path: *const c_char, mode: *const c_char) -> Option<*mut FILE> {
    writeback()?;
    let fd = open(libc::AT_FDCWD, path, fopen_flags(mode))?;
    if fd < 0 {
        return Some(std::ptr::null_mut());
    }
    let f = libc::fdopen(fd, mode);
    if f.is_null() {
        forget(fd); // no mapping yet: the entry goes, and nothing is journaled
        libc::close(fd);
    }
    Some(f)
}

/// What closing `fd` means for the staged file it writes.
enum Closed {
    /// Not a staged descriptor.
    NotStaged,
    /// A mapping still writes the file: it is journaled when the last mapping goes (`munmap`, or exit).
    StillMapped,
    /// The file is complete: journal it.
    Complete(Open),
}

fn forget(fd: c_int) -> Closed {
    let mut open = OPEN.lock();
    let Some(i) = open.iter().position(|o| o.fd == Some(fd)) else { return Closed::NotStaged };
    if !open[i].maps.is_empty() {
        open[i].fd = None;
        return Closed::StillMapped;
    }
    let o = open.swap_remove(i);
    OPEN_COUNT.store(open.len(), Ordering::Relaxed);
    Closed::Complete(o)
}

/// Journals a staged file after its descriptor was closed; false (errno set) when it could not be.
fn commit(o: Open) -> bool {
    if o.pid != tierstore_core::pid() {
        return true; // a forked child closing what it inherited: the parent journals the file
    }
    let Some(wb) = writeback() else { return true };
    if let Some(temp) = &o.through {
        if o.deleted {
            let _ = std::fs::remove_file(temp);
            return true;
        }
        return match wb.finish_through(temp, &o.dest) {
            Ok(()) => true,
            Err(e) => {
                eprintln!("tierstore run: closing {}: {e}", o.dest.display());
                set_errno(e.errno());
                false
            }
        };
    }
    if o.deleted {
        if let Some(d) = wb.destination(&o.dest) {
            if let Ok(j) = wb.journal(d) {
                let _ = std::fs::remove_file(j.staged_path(&o.name));
            }
        }
        return true;
    }
    match wb.commit(&o.dest, &o.name) {
        Ok(()) => true,
        Err(e) => {
            eprintln!("tierstore run: closing {}: {e}", o.dest.display());
            set_errno(e.errno());
            false
        }
    }
}

/// `close(fd)`: the real close, then the journal for a staged descriptor.
pub unsafe fn close(fd: c_int, real: impl FnOnce() -> c_int) -> c_int {
    if OPEN_COUNT.load(Ordering::Relaxed) == 0 {
        return real();
    }
    let Some(_busy) = Busy::enter() else { return real() };
    let Closed::Complete(o) = forget(fd) else { return real() };
    let rc = real();
    if rc != 0 {
        return rc;
    }
    if commit(o) {
        0
    } else {
        -1
    }
}

/// `fclose(f)` (`real` closes it): the journal for a staged stream, as [`close`] for a descriptor.
pub unsafe fn fclose(f: *mut FILE, real: impl FnOnce() -> c_int) -> c_int {
    if OPEN_COUNT.load(Ordering::Relaxed) == 0 || f.is_null() {
        return real();
    }
    let Some(_busy) = Busy::enter() else { return real() };
    let Closed::Complete(o) = forget(libc::fileno(f)) else { return real() };
    let rc = real();
    if rc != 0 {
        return rc;
    }
    if commit(o) {
        0
    } else {
        libc::EOF
    }
}

/// After `mmap` of `fd` returned `p`: a writable shared mapping of a staged descriptor is remembered, so
/// that the file is journaled only once the mapping is gone too (a program may close the descriptor and
/// go on writing through the mapping, as numpy's `memmap` and Python's `mmap` do).
pub unsafe fn mapped(p: *mut libc::c_void, len: libc::size_t, prot: c_int, flags: c_int, fd: c_int) {
    let shared_write = flags & libc::MAP_SHARED != 0 && prot & libc::PROT_WRITE != 0;
    if p == libc::MAP_FAILED || fd < 0 || !shared_write || OPEN_COUNT.load(Ordering::Relaxed) == 0 {
        return;
    }
    let Some(_busy) = Busy::enter() else { return };
    let mut open = OPEN.lock();
    if let Some(o) = open.iter_mut().find(|o| o.fd == Some(fd)) {
        o.maps.push((p as usize, p as usize + len));
        MAPPED_COUNT.fetch_add(1, Ordering::Relaxed);
    }
}

/// Removes `[start, end)` from the ranges `maps`, keeping what lies outside it.
fn unmap_range(maps: &mut Vec<(usize, usize)>, start: usize, end: usize) {
    let mut kept = Vec::with_capacity(maps.len() + 1);
    for &(s, e) in maps.iter() {
        if e <= start || end <= s {
            kept.push((s, e));
            continue;
        }
        if s < start {
            kept.push((s, start));
        }
        if end < e {
            kept.push((end, e));
        }
    }
    *maps = kept;
}

/// After a `munmap` of `[addr, addr + len)` succeeded: a staged file whose descriptor was closed is
/// journaled when its last mapping goes.
pub unsafe fn unmapped(addr: *mut libc::c_void, len: libc::size_t) {
    if MAPPED_COUNT.load(Ordering::Relaxed) == 0 {
        return;
    }
    // Inside the shim (its own allocations free memory too) nothing of the program's is unmapped.
    let Some(_busy) = Busy::enter() else { return };
    let (start, end) = (addr as usize, (addr as usize).saturating_add(len));
    let complete: Vec<Open> = {
        let mut open = OPEN.lock();
        let mut touched = false;
        for o in open.iter_mut() {
            if o.maps.iter().any(|&(s, e)| s < end && start < e) {
                unmap_range(&mut o.maps, start, end);
                touched = true;
            }
        }
        if !touched {
            return; // memory of the program's own (malloc's): no staged file's mapping
        }
        MAPPED_COUNT.store(open.iter().map(|o| o.maps.len()).sum(), Ordering::Relaxed);
        let (done, kept): (Vec<Open>, Vec<Open>) =
            std::mem::take(&mut *open).into_iter().partition(|o| o.fd.is_none() && o.maps.is_empty());
        *open = kept;
        OPEN_COUNT.store(open.len(), Ordering::Relaxed);
        done
    };
    // munmap has no way to report that the journal failed: the error is printed, and the file stays
    // staged (unjournaled) as a crash would leave it.
    for o in complete {
        commit(o);
    }
}

/// At exit: files still open (a program that relies on exit to close them) are flushed and journaled.
extern "C" fn at_exit() {
    if OPEN_COUNT.load(Ordering::Relaxed) == 0 {
        return;
    }
    let Some(_busy) = Busy::enter() else { return };
    // SAFETY: flushes every stdio stream; a null argument is documented to mean all of them.
    unsafe { libc::fflush(std::ptr::null_mut()) };
    // A mapping still alive at exit has put its bytes in the file's pages: the commit's hash reads them there
    // (and its fsync, unless durability is "buffered", writes them).
    let open: Vec<Open> = std::mem::take(&mut *OPEN.lock());
    OPEN_COUNT.store(0, Ordering::Relaxed);
    MAPPED_COUNT.store(0, Ordering::Relaxed);
    for o in open {
        commit(o);
    }
}

#[used]
#[link_section = ".fini_array"]
static AT_EXIT: extern "C" fn() = at_exit;

/// The stat family of a pending file: the staged copy's `stat`, this node's or another node's.
pub unsafe fn staged_stat(dirfd: c_int, path: *const c_char) -> Option<libc::stat> {
    let wb = writeback()?;
    let abs = dest_path(wb, dirfd, path)?;
    let mut st: libc::stat = std::mem::zeroed();
    if let Some(staged) = staged_copy(wb, &abs) {
        let c = std::ffi::CString::new(staged.as_os_str().as_bytes()).ok()?;
        return (libc::stat(c.as_ptr(), &mut st) == 0).then_some(st);
    }
    peer_stat(wb, &abs)
}

/// A file another node staged and has not yet put on the store, as `stat` shows it here: the size and
/// close time of its staged copy, over the store's older copy if it has one (else over the directory's
/// owner, with a regular file's mode), so that `stat` agrees with what `open` reads.
unsafe fn peer_stat(wb: &Writeback, abs: &Path) -> Option<libc::stat> {
    let held = wb.peer_stat(abs)?;
    let mut st: libc::stat = std::mem::zeroed();
    let c = std::ffi::CString::new(abs.as_os_str().as_bytes()).ok()?;
    if libc::stat(c.as_ptr(), &mut st) != 0 {
        let dir = std::ffi::CString::new(abs.parent()?.as_os_str().as_bytes()).ok()?;
        if libc::stat(dir.as_ptr(), &mut st) != 0 {
            return None;
        }
        st.st_mode = libc::S_IFREG | 0o644;
        st.st_nlink = 1;
        // An inode number of its own, stable for the path (a program may compare them).
        st.st_ino = {
            use std::hash::{Hash, Hasher};
            let mut h = std::hash::DefaultHasher::new();
            abs.hash(&mut h);
            h.finish()
        };
    }
    st.st_size = held.size as libc::off_t;
    st.st_blocks = held.size.div_ceil(512) as libc::blkcnt_t;
    let (secs, nanos) = (held.closed_ns.div_euclid(1_000_000_000), held.closed_ns.rem_euclid(1_000_000_000));
    st.st_mtime = secs;
    st.st_mtime_nsec = nanos;
    st.st_ctime = secs;
    st.st_ctime_nsec = nanos;
    Some(st)
}

/// `rename` of or into a destination: `Some(rc)` when handled here.
pub unsafe fn rename(
    olddir: c_int,
    old: *const c_char,
    newdir: c_int,
    new: *const c_char,
    flags: c_uint,
) -> Option<c_int> {
    let _busy = Busy::enter()?;
    let wb = writeback()?;
    let from = dest_path(wb, olddir, old);
    let to = dest_path(wb, newdir, new)?;
    let Some(from) = from else {
        // Into a destination from elsewhere: the store's business (EXDEV from a local disk).
        return None;
    };
    if flags != 0 {
        // RENAME_NOREPLACE / RENAME_EXCHANGE of a pending file are not followed: only the store's files.
        return None;
    }
    // A file this process still has open (a temporary file persisted before it is closed, as the
    // `tempfile` crate does): it is journaled under its new name at close.
    {
        let mut open = OPEN.lock();
        let me = tierstore_core::pid();
        if let Some(o) = open.iter_mut().find(|o| o.dest == from && o.pid == me && !o.deleted) {
            o.dest = to.clone();
            if let Err(e) = wb.remove(&to) {
                set_errno(e.errno());
                return Some(-1);
            }
            return Some(0);
        }
    }
    match wb.rename(&from, &to) {
        Ok(true) => return Some(0),
        Ok(false) => {}
        Err(e) => {
            eprintln!("tierstore run: renaming {} to {}: {e}", from.display(), to.display());
            set_errno(e.errno());
            return Some(-1);
        }
    }
    // A file or directory of the store: what was closed before this rename reaches the store first, so
    // the rename (a checkpoint's commit) never shows before the files it publishes.
    let scope = if real_exists(&from).is_some_and(|m| m.is_dir()) { from.clone() } else { to.parent()?.to_path_buf() };
    let timeout = wb.destination(&to).map(|d| d.timeout)?;
    if let Err(e) = wb.wait(Some(&scope), timeout) {
        eprintln!("tierstore run: renaming {} to {}: {e}", from.display(), to.display());
        set_errno(libc::EIO);
        return Some(-1);
    }
    None
}

/// `unlink` under a destination: a pending file leaves the journal, then the store's copy (if any) goes.
pub unsafe fn unlink(dirfd: c_int, path: *const c_char, real: impl FnOnce() -> c_int) -> Option<c_int> {
    let _busy = Busy::enter()?;
    let wb = writeback()?;
    let abs = dest_path(wb, dirfd, path)?;
    {
        let mut open = OPEN.lock();
        let me = tierstore_core::pid();
        if let Some(o) = open.iter_mut().find(|o| o.dest == abs && o.pid == me && !o.deleted) {
            o.deleted = true;
            return Some(0);
        }
    }
    match wb.remove(&abs) {
        Ok(true) => {
            let rc = real();
            Some(if rc != 0 && *libc::__errno_location() == libc::ENOENT { 0 } else { rc })
        }
        Ok(false) => None,
        Err(e) => {
            set_errno(e.errno());
            Some(-1)
        }
    }
}

/// `truncate` of a pending file: its staged copy is cut.
pub unsafe fn truncate(path: *const c_char, len: libc::off_t) -> Option<c_int> {
    let _busy = Busy::enter()?;
    let wb = writeback()?;
    let abs = dest_path(wb, libc::AT_FDCWD, path)?;
    match wb.truncate(&abs, len.max(0) as u64) {
        Ok(true) => Some(0),
        Ok(false) => None,
        Err(e) => {
            set_errno(e.errno());
            Some(-1)
        }
    }
}
