//! The stat family. For a cached file every answer is the source's `stat` as recorded when the copy was
//! taken, whichever call asks: `stat`/`lstat`/`statx` of the path (from the index, without asking the source,
//! when copies are trusted: `revalidate = "never"`) and `fstat` of the descriptor an open returned (which is
//! the tier copy's; for the copy the thread just opened, answered without the system call). Programs that
//! compare them (cp, tar, rsync: "file changed as we read it") see one file.
//!
//! `access` and `faccessat` of a cached or staged file are answered the same way, for reading.

use libc::{c_char, c_int, c_uint};

use crate::dirs::{self, at, unshadow};
use crate::{shim, writes, Busy};

/// The cached `stat` of `path` (relative to `dirfd`), when the cache can answer. `nofollow`: `lstat`.
unsafe fn cached_stat(dirfd: c_int, path: *const c_char, nofollow: bool) -> Option<libc::stat> {
    let s = shim()?;
    let abs = s.source_path(dirfd, path)?;
    s.cache()?.trusted().cached_stat(&abs, nofollow).ok().flatten()
}

/// A buffer the stat family fills: `stat` itself, or `statx`.
trait StatForm {
    /// The answer in this form for a `stat` the cache recorded.
    fn answer(st: &libc::stat) -> Self;
    /// What the real call wrote, as a `stat` for the cache's notes.
    fn record(&self) -> libc::stat;
}

impl StatForm for libc::stat {
    fn answer(st: &libc::stat) -> Self {
        *st
    }
    fn record(&self) -> libc::stat {
        *self
    }
}

impl StatForm for libc::statx {
    fn answer(st: &libc::stat) -> Self {
        statx_of(st)
    }
    fn record(&self) -> libc::stat {
        stat_of(self)
    }
}

/// The stat family by path: the cache's answer, or the source's, which the cache takes note of (a
/// trusted source's directories are answered from the cache the next time).
unsafe fn stat_path<T: StatForm>(
    dirfd: c_int,
    path: *const c_char,
    buf: *mut T,
    nofollow: bool,
    real: impl FnOnce() -> c_int,
) -> c_int {
    let Some(_busy) = Busy::enter() else { return real() };
    if let Some(st) = writes::staged_stat(dirfd, path) {
        *buf = T::answer(&st);
        return 0;
    }
    let Some((s, abs)) = shim().and_then(|s| Some((s, s.source_path(dirfd, path)?))) else { return real() };
    let Some(cache) = s.cache() else { return real() };
    if let Ok(Some(st)) = cache.trusted().cached_stat(&abs, nofollow) {
        *buf = T::answer(&st);
        return 0;
    }
    let rc = real();
    if rc == 0 && !buf.is_null() {
        cache.trusted().note_stat(&abs, &(*buf).record(), nofollow);
    }
    rc
}

unsafe fn stat_common(
    dirfd: c_int,
    path: *const c_char,
    buf: *mut libc::stat,
    nofollow: bool,
    real: impl FnOnce() -> c_int,
) -> c_int {
    stat_path(dirfd, path, buf, nofollow, real)
}

/// The answer for `fd` without the system call, when it is the tier copy this thread just opened (see
/// `tierstore_core::cache::copy_stats`).
unsafe fn opened_copy_stat(fd: c_int) -> Option<libc::stat> {
    let _busy = Busy::enter()?;
    shim()?.cache.get()?.as_ref()?.trusted().opened_copy_stat(fd)
}

/// Else, after the real `fstat` of `fd` filled `buf`: a tier copy this process's cache handed out is
/// reported as the source file it copies. The cache is not opened for this: without it, no copy was handed out.
unsafe fn fstat_common(fd: c_int, buf: *mut libc::stat, real: impl FnOnce() -> c_int) -> c_int {
    if let Some(st) = opened_copy_stat(fd).filter(|_| !buf.is_null()) {
        *buf = st;
        return 0;
    }
    let rc = real();
    if rc != 0 || buf.is_null() {
        return rc;
    }
    let Some(_busy) = Busy::enter() else { return rc };
    if let Some(cache) = shim().and_then(|s| s.cache.get()).and_then(Option::as_ref) {
        if let Some(st) = cache.trusted().copy_stat(fd, &*buf) {
            *buf = st;
            return rc;
        }
    }
    if (*buf).st_mode & libc::S_IFMT == libc::S_IFDIR {
        if let Some(st) = dirs::shadow_stat(fd) {
            *buf = st;
        }
    }
    rc
}

#[no_mangle]
pub unsafe extern "C" fn stat(path: *const c_char, buf: *mut libc::stat) -> c_int {
    stat_common(libc::AT_FDCWD, path, buf, false, || {
        real!("stat", unsafe extern "C" fn(*const c_char, *mut libc::stat) -> c_int)(path, buf)
    })
}

#[no_mangle]
pub unsafe extern "C" fn stat64(path: *const c_char, buf: *mut libc::stat) -> c_int {
    stat_common(libc::AT_FDCWD, path, buf, false, || {
        real!("stat64", unsafe extern "C" fn(*const c_char, *mut libc::stat) -> c_int)(path, buf)
    })
}

#[no_mangle]
pub unsafe extern "C" fn __xstat(ver: c_int, path: *const c_char, buf: *mut libc::stat) -> c_int {
    stat_common(libc::AT_FDCWD, path, buf, false, || {
        real!("__xstat", unsafe extern "C" fn(c_int, *const c_char, *mut libc::stat) -> c_int)(ver, path, buf)
    })
}

#[no_mangle]
pub unsafe extern "C" fn __xstat64(ver: c_int, path: *const c_char, buf: *mut libc::stat) -> c_int {
    stat_common(libc::AT_FDCWD, path, buf, false, || {
        real!("__xstat64", unsafe extern "C" fn(c_int, *const c_char, *mut libc::stat) -> c_int)(ver, path, buf)
    })
}

#[no_mangle]
pub unsafe extern "C" fn lstat(path: *const c_char, buf: *mut libc::stat) -> c_int {
    stat_common(libc::AT_FDCWD, path, buf, true, || {
        real!("lstat", unsafe extern "C" fn(*const c_char, *mut libc::stat) -> c_int)(path, buf)
    })
}

#[no_mangle]
pub unsafe extern "C" fn lstat64(path: *const c_char, buf: *mut libc::stat) -> c_int {
    stat_common(libc::AT_FDCWD, path, buf, true, || {
        real!("lstat64", unsafe extern "C" fn(*const c_char, *mut libc::stat) -> c_int)(path, buf)
    })
}

#[no_mangle]
pub unsafe extern "C" fn __lxstat(ver: c_int, path: *const c_char, buf: *mut libc::stat) -> c_int {
    stat_common(libc::AT_FDCWD, path, buf, true, || {
        real!("__lxstat", unsafe extern "C" fn(c_int, *const c_char, *mut libc::stat) -> c_int)(ver, path, buf)
    })
}

#[no_mangle]
pub unsafe extern "C" fn __lxstat64(ver: c_int, path: *const c_char, buf: *mut libc::stat) -> c_int {
    stat_common(libc::AT_FDCWD, path, buf, true, || {
        real!("__lxstat64", unsafe extern "C" fn(c_int, *const c_char, *mut libc::stat) -> c_int)(ver, path, buf)
    })
}

#[no_mangle]
pub unsafe extern "C" fn fstat(fd: c_int, buf: *mut libc::stat) -> c_int {
    fstat_common(fd, buf, || real!("fstat", unsafe extern "C" fn(c_int, *mut libc::stat) -> c_int)(fd, buf))
}

#[no_mangle]
pub unsafe extern "C" fn fstat64(fd: c_int, buf: *mut libc::stat) -> c_int {
    fstat_common(fd, buf, || real!("fstat64", unsafe extern "C" fn(c_int, *mut libc::stat) -> c_int)(fd, buf))
}

#[no_mangle]
pub unsafe extern "C" fn __fxstat(ver: c_int, fd: c_int, buf: *mut libc::stat) -> c_int {
    fstat_common(fd, buf, || {
        real!("__fxstat", unsafe extern "C" fn(c_int, c_int, *mut libc::stat) -> c_int)(ver, fd, buf)
    })
}

#[no_mangle]
pub unsafe extern "C" fn __fxstat64(ver: c_int, fd: c_int, buf: *mut libc::stat) -> c_int {
    fstat_common(fd, buf, || {
        real!("__fxstat64", unsafe extern "C" fn(c_int, c_int, *mut libc::stat) -> c_int)(ver, fd, buf)
    })
}

/// Whether a `*at` call with `flags` names the descriptor itself (`fstat` through AT_EMPTY_PATH).
unsafe fn names_descriptor(path: *const c_char, flags: c_int) -> bool {
    flags & libc::AT_EMPTY_PATH != 0 && (path.is_null() || *path == 0)
}

unsafe fn fstatat_common(
    dirfd: c_int,
    path: *const c_char,
    buf: *mut libc::stat,
    flags: c_int,
    real: impl FnOnce() -> c_int,
) -> c_int {
    if names_descriptor(path, flags) {
        return fstat_common(dirfd, buf, real);
    }
    stat_common(dirfd, path, buf, flags & libc::AT_SYMLINK_NOFOLLOW != 0, real)
}

#[no_mangle]
pub unsafe extern "C" fn fstatat(dirfd: c_int, path: *const c_char, buf: *mut libc::stat, flags: c_int) -> c_int {
    let u = unshadow(dirfd, path);
    let (dirfd, path) = at(&u, dirfd, path);
    fstatat_common(dirfd, path, buf, flags, || {
        real!("fstatat", unsafe extern "C" fn(c_int, *const c_char, *mut libc::stat, c_int) -> c_int)(
            dirfd, path, buf, flags,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn fstatat64(dirfd: c_int, path: *const c_char, buf: *mut libc::stat, flags: c_int) -> c_int {
    let u = unshadow(dirfd, path);
    let (dirfd, path) = at(&u, dirfd, path);
    fstatat_common(dirfd, path, buf, flags, || {
        real!("fstatat64", unsafe extern "C" fn(c_int, *const c_char, *mut libc::stat, c_int) -> c_int)(
            dirfd, path, buf, flags,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn __fxstatat(
    ver: c_int,
    dirfd: c_int,
    path: *const c_char,
    buf: *mut libc::stat,
    flags: c_int,
) -> c_int {
    let u = unshadow(dirfd, path);
    let (dirfd, path) = at(&u, dirfd, path);
    fstatat_common(dirfd, path, buf, flags, || {
        real!("__fxstatat", unsafe extern "C" fn(c_int, c_int, *const c_char, *mut libc::stat, c_int) -> c_int)(
            ver, dirfd, path, buf, flags,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn __fxstatat64(
    ver: c_int,
    dirfd: c_int,
    path: *const c_char,
    buf: *mut libc::stat,
    flags: c_int,
) -> c_int {
    let u = unshadow(dirfd, path);
    let (dirfd, path) = at(&u, dirfd, path);
    fstatat_common(dirfd, path, buf, flags, || {
        real!("__fxstatat64", unsafe extern "C" fn(c_int, c_int, *const c_char, *mut libc::stat, c_int) -> c_int)(
            ver, dirfd, path, buf, flags,
        )
    })
}

fn statx_time(ns: (i64, i64)) -> libc::statx_timestamp {
    // SAFETY: a plain C struct, all zeros is valid.
    let mut t: libc::statx_timestamp = unsafe { std::mem::zeroed() };
    t.tv_sec = ns.0;
    t.tv_nsec = ns.1 as u32;
    t
}

/// The `statx` answer that carries what `st` says.
fn statx_of(st: &libc::stat) -> libc::statx {
    // SAFETY: a plain C struct, all zeros is valid.
    let mut x: libc::statx = unsafe { std::mem::zeroed() };
    x.stx_mask = libc::STATX_BASIC_STATS;
    x.stx_blksize = st.st_blksize as u32;
    x.stx_nlink = st.st_nlink as u32;
    x.stx_uid = st.st_uid;
    x.stx_gid = st.st_gid;
    x.stx_mode = st.st_mode as u16;
    x.stx_ino = st.st_ino;
    x.stx_size = st.st_size as u64;
    x.stx_blocks = st.st_blocks as u64;
    x.stx_atime = statx_time((st.st_atime, st.st_atime_nsec));
    x.stx_mtime = statx_time((st.st_mtime, st.st_mtime_nsec));
    x.stx_ctime = statx_time((st.st_ctime, st.st_ctime_nsec));
    x.stx_dev_major = libc::major(st.st_dev);
    x.stx_dev_minor = libc::minor(st.st_dev);
    x
}

#[no_mangle]
pub unsafe extern "C" fn statx(
    dirfd: c_int,
    path: *const c_char,
    flags: c_int,
    mask: c_uint,
    buf: *mut libc::statx,
) -> c_int {
    let u = unshadow(dirfd, path);
    let (dirfd, path) = at(&u, dirfd, path);
    let real = || {
        real!("statx", unsafe extern "C" fn(c_int, *const c_char, c_int, c_uint, *mut libc::statx) -> c_int)(
            dirfd, path, flags, mask, buf,
        )
    };
    if names_descriptor(path, flags) {
        if let Some(st) = opened_copy_stat(dirfd).filter(|_| !buf.is_null()) {
            *buf = statx_of(&st);
            return 0;
        }
        let rc = real();
        if rc != 0 || buf.is_null() {
            return rc;
        }
        let Some(_busy) = Busy::enter() else { return rc };
        if u32::from((*buf).stx_mode) & libc::S_IFMT == libc::S_IFDIR {
            if let Some(st) = dirs::shadow_stat(dirfd) {
                *buf = statx_of(&st);
            }
            return rc;
        }
        let Some(cache) = shim().and_then(|s| s.cache.get()).and_then(Option::as_ref) else { return rc };
        // The device and the size recognise a copy; the inode, links and change time let the cache
        // remember it (see `Cache::copy_stat`).
        let mut own: libc::stat = std::mem::zeroed();
        own.st_dev = libc::makedev((*buf).stx_dev_major, (*buf).stx_dev_minor);
        own.st_size = (*buf).stx_size as i64;
        let basic = libc::STATX_INO | libc::STATX_NLINK | libc::STATX_CTIME;
        if (*buf).stx_mask & basic == basic {
            own.st_ino = (*buf).stx_ino;
            own.st_nlink = (*buf).stx_nlink as _;
            own.st_ctime = (*buf).stx_ctime.tv_sec;
            own.st_ctime_nsec = (*buf).stx_ctime.tv_nsec as _;
        }
        if let Some(st) = cache.trusted().copy_stat(dirfd, &own) {
            *buf = statx_of(&st);
        }
        return rc;
    }
    stat_path(dirfd, path, buf, flags & libc::AT_SYMLINK_NOFOLLOW != 0, real)
}

/// The `stat` that carries what `statx` answered (for the cache's notes). An answer without every basic
/// field (the program asked for fewer) gives a `stat` of no type, which the cache does not note.
fn stat_of(x: &libc::statx) -> libc::stat {
    // SAFETY: a plain C struct, all zeros is valid.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if x.stx_mask & libc::STATX_BASIC_STATS != libc::STATX_BASIC_STATS {
        return st;
    }
    st.st_dev = libc::makedev(x.stx_dev_major, x.stx_dev_minor);
    st.st_ino = x.stx_ino;
    st.st_mode = u32::from(x.stx_mode);
    st.st_nlink = x.stx_nlink as _;
    st.st_uid = x.stx_uid;
    st.st_gid = x.stx_gid;
    st.st_size = x.stx_size as i64;
    st.st_blksize = x.stx_blksize as _;
    st.st_blocks = x.stx_blocks as i64;
    (st.st_atime, st.st_atime_nsec) = (x.stx_atime.tv_sec, i64::from(x.stx_atime.tv_nsec));
    (st.st_mtime, st.st_mtime_nsec) = (x.stx_mtime.tv_sec, i64::from(x.stx_mtime.tv_nsec));
    (st.st_ctime, st.st_ctime_nsec) = (x.stx_ctime.tv_sec, i64::from(x.stx_ctime.tv_nsec));
    st
}

unsafe fn access_common(dirfd: c_int, path: *const c_char, mode: c_int, real: impl FnOnce() -> c_int) -> c_int {
    let Some(_busy) = Busy::enter() else { return real() };
    if writes::staged_stat(dirfd, path).is_some() {
        return 0;
    }
    if mode & (libc::W_OK | libc::X_OK) == 0 && cached_stat(dirfd, path, false).is_some() {
        return 0;
    }
    real()
}

#[no_mangle]
pub unsafe extern "C" fn access(path: *const c_char, mode: c_int) -> c_int {
    access_common(libc::AT_FDCWD, path, mode, || {
        real!("access", unsafe extern "C" fn(*const c_char, c_int) -> c_int)(path, mode)
    })
}

#[no_mangle]
pub unsafe extern "C" fn faccessat(dirfd: c_int, path: *const c_char, mode: c_int, flags: c_int) -> c_int {
    let u = unshadow(dirfd, path);
    let (dirfd, path) = at(&u, dirfd, path);
    access_common(dirfd, path, mode, || {
        real!("faccessat", unsafe extern "C" fn(c_int, *const c_char, c_int, c_int) -> c_int)(dirfd, path, mode, flags)
    })
}
