//! Directory listings of a trusted source (`revalidate = "never"`), answered without the store.
//!
//! The first time a source directory is opened as a directory (`opendir`, `fdopendir` of an
//! `open(O_DIRECTORY)`), its listing is read from the store once and recorded in the first tier's index
//! (every entry with its `d_ino` and `d_type`, `.` and `..` included, in the store's order; see
//! `Index::listing`). From then on such an open returns a descriptor of an empty directory of the tier
//! that stands for the source directory (its *shadow*), and:
//! - `readdir`, `readdir64`, `readdir_r`, `telldir`, `seekdir` and `rewinddir` of a stream on a shadow
//!   replay the record, so programs see the store's names, types, inode numbers and order (a shadow's
//!   own order would differ from the store's, and a walker's output with it);
//! - `fstat` and `statx(AT_EMPTY_PATH)` of a shadow descriptor report the source directory (walkers
//!   compare its device and inode with the `stat` of the path they opened), `fstatfs` its file system;
//! - a `*at` call relative to a shadow descriptor is made on the source path it stands for (see
//!   `unshadow` below), and `fchdir` to one changes to the source directory itself, so that every
//!   later relative path, including those of calls the shim does not interpose, names the source.
//!
//! A change through the shim under the source (a create, unlink, rename, mkdir, rmdir, symlink) forgets
//! the listing of the directory it changed; the next open lists the store again. Readers that call
//! `getdents64` themselves on a shadow descriptor see an empty directory: the shim cannot follow them.

use std::collections::HashMap;
use std::ffi::{CStr, CString, OsStr};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use libc::{c_char, c_int, c_long, DIR};
use tierstore_core::index::Listed;
use tierstore_core::Cache;

use crate::{shim, writes, Busy};

/// Set once this process has handed out a shadow descriptor: until then no descriptor can be one, and
/// the `*at` calls skip the check.
pub(crate) static HANDED_OUT: AtomicBool = AtomicBool::new(false);

/// A stream on a shadow directory: the record it replays and where it is.
struct Stream {
    entries: Arc<Vec<Listed>>,
    next: usize,
    /// What the last `readdir` returned points here (valid until the next call on the stream, as POSIX
    /// allows).
    buf: Box<libc::dirent64>,
}

static LIVE: AtomicUsize = AtomicUsize::new(0);

static TABLE: OnceLock<Mutex<HashMap<usize, Stream>>> = OnceLock::new();

/// The table of streams on shadows. A forked child keeps its parent's streams (its `DIR *`s are copies
/// of them); the table's lock is taken before a fork and released after it in both processes, so a fork
/// made while another thread held it cannot leave the child's table locked forever.
fn streams() -> parking_lot::MutexGuard<'static, HashMap<usize, Stream>> {
    TABLE
        .get_or_init(|| {
            // SAFETY: registers handlers that only lock and unlock the table.
            unsafe { libc::pthread_atfork(Some(before_fork), Some(after_fork), Some(after_fork)) };
            Mutex::new(HashMap::new())
        })
        .lock()
}

extern "C" fn before_fork() {
    if let Some(t) = TABLE.get() {
        std::mem::forget(t.lock());
    }
}

extern "C" fn after_fork() {
    if let Some(t) = TABLE.get() {
        // SAFETY: `before_fork` left the table locked by this thread (the one that forked); in the child
        // it is the only thread.
        unsafe { t.force_unlock() };
    }
}

fn register(dirp: *mut DIR, entries: Vec<Listed>) {
    // SAFETY: a plain C struct, all zeros is valid.
    let buf = Box::new(unsafe { std::mem::zeroed::<libc::dirent64>() });
    let stream = Stream { entries: Arc::new(entries), next: 0, buf };
    if streams().insert(dirp as usize, stream).is_none() {
        LIVE.fetch_add(1, Ordering::Relaxed);
    }
}

/// Runs `f` on the stream of `dirp` if it is one on a shadow (one atomic load when none is open).
fn with_stream<R>(dirp: *mut DIR, f: impl FnOnce(&mut Stream) -> R) -> Option<R> {
    if LIVE.load(Ordering::Relaxed) == 0 {
        return None;
    }
    streams().get_mut(&(dirp as usize)).map(f)
}

/// `stat` of `abs` under the source, from the cache or else from the store (noted); `None` when it cannot
/// be asked.
unsafe fn source_stat(cache: &Cache, abs: &Path, nofollow: bool) -> Option<libc::stat> {
    if let Some(st) = cache.trusted().cached_stat(abs, nofollow).ok().flatten() {
        return Some(st);
    }
    let c = CString::new(abs.as_os_str().as_bytes()).ok()?;
    let mut st: libc::stat = std::mem::zeroed();
    let rc = if nofollow {
        real!("lstat", unsafe extern "C" fn(*const c_char, *mut libc::stat) -> c_int)(c.as_ptr(), &mut st)
    } else {
        real!("stat", unsafe extern "C" fn(*const c_char, *mut libc::stat) -> c_int)(c.as_ptr(), &mut st)
    };
    if rc != 0 {
        return None;
    }
    cache.trusted().note_stat(abs, &st, nofollow);
    Some(st)
}

/// `stat` of the source directory `abs` (see `source_stat`); `None` when it is not a directory.
unsafe fn dir_stat(cache: &Cache, abs: &Path, nofollow: bool) -> Option<libc::stat> {
    source_stat(cache, abs, nofollow).filter(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR)
}

/// The listing of the source directory `abs`: the record, or else the store's, recorded.
unsafe fn listing(cache: &Cache, abs: &Path) -> Option<Vec<Listed>> {
    if let Some(entries) = cache.trusted().cached_listing(abs) {
        return Some(entries);
    }
    let entries = read_listing(abs)?;
    cache.trusted().note_listing(abs, &entries);
    Some(entries)
}

/// The entries of the directory `abs` as the store lists them, `.` and `..` included, in its order.
pub(crate) unsafe fn read_listing(abs: &Path) -> Option<Vec<Listed>> {
    let c = CString::new(abs.as_os_str().as_bytes()).ok()?;
    let dirp = real!("opendir", unsafe extern "C" fn(*const c_char) -> *mut DIR)(c.as_ptr());
    if dirp.is_null() {
        return None;
    }
    let mut entries = Vec::new();
    let failed = loop {
        crate::set_errno(0);
        let e = real!("readdir64", unsafe extern "C" fn(*mut DIR) -> *mut libc::dirent64)(dirp);
        if e.is_null() {
            break *libc::__errno_location() != 0;
        }
        let name = std::ffi::CStr::from_ptr((*e).d_name.as_ptr()).to_bytes().to_vec();
        entries.push(Listed { ino: (*e).d_ino, kind: (*e).d_type, name });
    };
    real!("closedir", unsafe extern "C" fn(*mut DIR) -> c_int)(dirp);
    if failed {
        return None;
    }
    Some(entries)
}

/// A descriptor of the shadow of the source directory `abs`, opened with `flags` (a read-only open
/// with O_DIRECTORY), when the source is trusted and `abs` is a directory whose listing is (now)
/// recorded; -1 with ENOTDIR when `abs` is a file; `None`: the real call must open the source.
pub(crate) unsafe fn open_shadow(cache: &Cache, abs: &Path, flags: c_int) -> Option<c_int> {
    if !cache.trusted().records_metadata() {
        return None;
    }
    match source_stat(cache, abs, flags & libc::O_NOFOLLOW != 0)?.st_mode & libc::S_IFMT {
        libc::S_IFDIR => {}
        // A file is not a directory: ENOTDIR, as the kernel would answer, without a lookup on the store
        // when the file is known (rsync 3.5 probes every path it opens with O_PATH|O_DIRECTORY|O_NOFOLLOW).
        libc::S_IFREG => {
            crate::set_errno(libc::ENOTDIR);
            return Some(-1);
        }
        _ => return None,
    }
    let shadow = cache.trusted().shadow_dir(abs)?;
    listing(cache, abs)?;
    let c = CString::new(shadow.as_os_str().as_bytes()).ok()?;
    // O_NOATIME would need the shadow's owner; O_NOFOLLOW has been checked on the source.
    let flags = (flags & !(libc::O_NOATIME | libc::O_NOFOLLOW)) | libc::O_DIRECTORY;
    let fd = real!("open", unsafe extern "C" fn(*const c_char, c_int, libc::mode_t) -> c_int)(c.as_ptr(), flags, 0);
    if fd < 0 {
        return None;
    }
    HANDED_OUT.store(true, Ordering::Relaxed);
    Some(fd)
}

/// The source directory that descriptor `fd` stands for, if it is a shadow.
pub(crate) unsafe fn shadowed(fd: c_int) -> Option<(&'static Cache, std::path::PathBuf)> {
    if !HANDED_OUT.load(Ordering::Relaxed) || fd < 0 {
        return None;
    }
    let cache = shim()?.cache.get()?.as_ref()?;
    let name = std::fs::read_link(format!("/proc/self/fd/{fd}")).ok()?;
    Some((cache, cache.trusted().shadowed(&name)?))
}

/// What `fstat` of shadow descriptor `fd` reports: its source directory's `stat`.
pub(crate) unsafe fn shadow_stat(fd: c_int) -> Option<libc::stat> {
    let (cache, abs) = shadowed(fd)?;
    dir_stat(cache, &abs, false)
}

/// For a `*at` call relative to a shadow descriptor (see `dirs`): the source path it names, for the call
/// to make with `AT_FDCWD` instead, so that what the shim does not answer is done on the source, never
/// on the shadow.
pub(crate) unsafe fn unshadow(dirfd: c_int, path: *const c_char) -> Option<std::ffi::CString> {
    if !HANDED_OUT.load(Ordering::Relaxed) || dirfd < 0 || path.is_null() || matches!(*path as u8, 0 | b'/') {
        return None;
    }
    let _busy = Busy::enter()?;
    let (_, dir) = shadowed(dirfd)?;
    let joined = dir.join(OsStr::from_bytes(CStr::from_ptr(path).to_bytes()));
    std::ffi::CString::new(joined.into_os_string().into_vec()).ok()
}

/// The arguments of a `*at` call after `unshadow`.
pub(crate) fn at(unshadowed: &Option<std::ffi::CString>, dirfd: c_int, path: *const c_char) -> (c_int, *const c_char) {
    match unshadowed {
        Some(p) => (libc::AT_FDCWD, p.as_ptr()),
        None => (dirfd, path),
    }
}

/// The listing of the directory `path` names when it is a destination (or under one) and files are
/// staged in it: the store's entries, then each staged file the store does not list yet (a regular file,
/// with its staged copy's inode number). `None` when nothing is staged there: the real listing is right.
/// The journal is read before the store, so a file migrated in between is listed once, by either.
pub(crate) unsafe fn staged_listing(path: *const c_char) -> Option<Vec<Listed>> {
    let wb = writes::writeback()?;
    if path.is_null() {
        return None;
    }
    let bytes = CStr::from_ptr(path).to_bytes();
    if bytes.first() == Some(&b'/') && !bytes.windows(3).any(|w| w == b"/..") {
        let under = wb.destinations().iter().any(|d| bytes.starts_with(d.path.as_os_str().as_bytes()));
        if !under {
            return None; // the common case: no allocation, no system call
        }
    }
    let dir = crate::absolute_at(libc::AT_FDCWD, bytes)?;
    let staged = wb.pending_in(&dir);
    if staged.is_empty() {
        return None;
    }
    let mut entries = read_listing(&dir)?;
    let listed: std::collections::HashSet<Vec<u8>> = entries.iter().map(|e| e.name.clone()).collect();
    for (name, copy) in staged {
        let name = name.as_bytes().to_vec();
        if listed.contains(&name) {
            continue; // an older copy is on the store: listed once
        }
        // Pending when the store was listed after: listed even if it was migrated since (its staged copy
        // gone), as the store listed too late would not show it.
        let ino = std::fs::metadata(&copy).map_or(1, |m| std::os::unix::fs::MetadataExt::ino(&m));
        entries.push(Listed { ino, kind: libc::DT_REG, name });
    }
    Some(entries)
}

#[no_mangle]
pub unsafe extern "C" fn opendir(path: *const c_char) -> *mut DIR {
    let real = || real!("opendir", unsafe extern "C" fn(*const c_char) -> *mut DIR)(path);
    let Some(_busy) = Busy::enter() else { return real() };
    if let Some(entries) = staged_listing(path) {
        // A write-back destination's directory with files staged in it: the store's stream, with the
        // staged files added to what it lists.
        let dirp = real();
        if !dirp.is_null() {
            register(dirp, entries);
        }
        return dirp;
    }
    let Some((s, abs)) = shim().and_then(|s| Some((s, s.source_path(libc::AT_FDCWD, path)?))) else {
        return real();
    };
    let Some(cache) = s.cache() else { return real() };
    let Some(fd) = open_shadow(cache, &abs, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC) else {
        return real();
    };
    let dirp = real!("fdopendir", unsafe extern "C" fn(c_int) -> *mut DIR)(fd);
    if dirp.is_null() {
        real!("close", unsafe extern "C" fn(c_int) -> c_int)(fd);
        return real();
    }
    match listing(cache, &abs) {
        Some(entries) => register(dirp, entries),
        None => {
            real!("closedir", unsafe extern "C" fn(*mut DIR) -> c_int)(dirp);
            return real();
        }
    }
    dirp
}

#[no_mangle]
pub unsafe extern "C" fn fdopendir(fd: c_int) -> *mut DIR {
    let dirp = real!("fdopendir", unsafe extern "C" fn(c_int) -> *mut DIR)(fd);
    if dirp.is_null() || !HANDED_OUT.load(Ordering::Relaxed) {
        return dirp;
    }
    let Some(_busy) = Busy::enter() else { return dirp };
    if let Some((cache, abs)) = shadowed(fd) {
        // A listing forgotten since the open is read again; one that cannot be read leaves an empty
        // stream, as a directory removed since its open reads.
        register(dirp, listing(cache, &abs).unwrap_or_default());
    }
    dirp
}

/// The next entry of a shadow stream, in `buf`.
fn next(stream: &mut Stream) -> *mut libc::dirent64 {
    let Some(e) = stream.entries.get(stream.next) else { return std::ptr::null_mut() };
    stream.next += 1;
    let d = &mut *stream.buf;
    let n = e.name.len().min(d.d_name.len() - 1);
    d.d_ino = e.ino;
    d.d_off = stream.next as i64;
    d.d_type = e.kind;
    for (dst, src) in d.d_name.iter_mut().zip(&e.name[..n]) {
        *dst = *src as c_char;
    }
    d.d_name[n] = 0;
    d.d_reclen = std::mem::size_of::<libc::dirent64>() as u16;
    d
}

#[no_mangle]
pub unsafe extern "C" fn readdir64(dirp: *mut DIR) -> *mut libc::dirent64 {
    if let Some(e) = with_stream(dirp, next) {
        return e;
    }
    real!("readdir64", unsafe extern "C" fn(*mut DIR) -> *mut libc::dirent64)(dirp)
}

// On x86_64 and aarch64 `struct dirent` is `struct dirent64`.
const _: () = assert!(std::mem::size_of::<libc::dirent>() == std::mem::size_of::<libc::dirent64>());

#[no_mangle]
pub unsafe extern "C" fn readdir(dirp: *mut DIR) -> *mut libc::dirent64 {
    if let Some(e) = with_stream(dirp, next) {
        return e;
    }
    real!("readdir", unsafe extern "C" fn(*mut DIR) -> *mut libc::dirent64)(dirp)
}

unsafe fn readdir_r_common(
    dirp: *mut DIR,
    entry: *mut libc::dirent64,
    result: *mut *mut libc::dirent64,
    real: impl FnOnce() -> c_int,
) -> c_int {
    match with_stream(dirp, |s| {
        let e = next(s);
        if e.is_null() {
            std::ptr::null_mut()
        } else {
            std::ptr::copy_nonoverlapping(e, entry, 1);
            entry
        }
    }) {
        Some(e) => {
            *result = e;
            0
        }
        None => real(),
    }
}

#[no_mangle]
pub unsafe extern "C" fn readdir_r(
    dirp: *mut DIR,
    entry: *mut libc::dirent64,
    result: *mut *mut libc::dirent64,
) -> c_int {
    readdir_r_common(dirp, entry, result, || {
        real!("readdir_r", unsafe extern "C" fn(*mut DIR, *mut libc::dirent64, *mut *mut libc::dirent64) -> c_int)(
            dirp, entry, result,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn readdir64_r(
    dirp: *mut DIR,
    entry: *mut libc::dirent64,
    result: *mut *mut libc::dirent64,
) -> c_int {
    readdir_r_common(dirp, entry, result, || {
        real!("readdir64_r", unsafe extern "C" fn(*mut DIR, *mut libc::dirent64, *mut *mut libc::dirent64) -> c_int)(
            dirp, entry, result,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn rewinddir(dirp: *mut DIR) {
    if with_stream(dirp, |s| s.next = 0).is_none() {
        real!("rewinddir", unsafe extern "C" fn(*mut DIR))(dirp)
    }
}

#[no_mangle]
pub unsafe extern "C" fn telldir(dirp: *mut DIR) -> c_long {
    match with_stream(dirp, |s| s.next as c_long) {
        Some(at) => at,
        None => real!("telldir", unsafe extern "C" fn(*mut DIR) -> c_long)(dirp),
    }
}

#[no_mangle]
pub unsafe extern "C" fn seekdir(dirp: *mut DIR, at: c_long) {
    if with_stream(dirp, |s| s.next = at.max(0) as usize).is_none() {
        real!("seekdir", unsafe extern "C" fn(*mut DIR, c_long))(dirp, at)
    }
}

#[no_mangle]
pub unsafe extern "C" fn closedir(dirp: *mut DIR) -> c_int {
    tierstore_core::cache::descriptor_ended();
    if LIVE.load(Ordering::Relaxed) != 0 && streams().remove(&(dirp as usize)).is_some() {
        LIVE.fetch_sub(1, Ordering::Relaxed);
    }
    real!("closedir", unsafe extern "C" fn(*mut DIR) -> c_int)(dirp)
}
