//! The statfs family. Walkers ask it of the directories they open (GNU find's fts, to choose how to walk),
//! so a trusted source answers it from a record taken the first time (see `Cache::cached_statfs`); a tier
//! copy's descriptor reports the source's file system, as its `fstat` reports the source's file. On
//! x86_64 and aarch64 the `*64` structures are the plain ones; the shim reads both as `statfs64`, whose
//! `f_flags` the libc crate names.

use std::os::unix::ffi::OsStrExt;

use libc::{c_char, c_int};
use tierstore_core::Cache;

use crate::{shim, Busy};

const _: () = assert!(std::mem::size_of::<libc::statfs>() == std::mem::size_of::<libc::statfs64>());
const _: () = assert!(std::mem::size_of::<libc::statvfs>() == std::mem::size_of::<libc::statvfs64>());

/// The `statvfs` glibc derives from a `statfs` (sysdeps/unix/sysv/linux/internal_statvfs.c).
fn statvfs_of(f: &libc::statfs64) -> libc::statvfs {
    // SAFETY: plain C structs, all zeros is valid; fsid_t is two ints.
    let mut v: libc::statvfs = unsafe { std::mem::zeroed() };
    let fsid: [u32; 2] = unsafe { std::mem::transmute(f.f_fsid) };
    v.f_bsize = f.f_bsize as _;
    v.f_frsize = if f.f_frsize != 0 { f.f_frsize } else { f.f_bsize } as _;
    v.f_blocks = f.f_blocks;
    v.f_bfree = f.f_bfree;
    v.f_bavail = f.f_bavail;
    v.f_files = f.f_files;
    v.f_ffree = f.f_ffree;
    v.f_favail = f.f_ffree;
    v.f_fsid = u64::from(fsid[0]) | (u64::from(fsid[1]) << 32);
    const ST_VALID: u64 = 0x20; // the kernel sets it: the other flags are the mount's
    v.f_flag = (f.f_flags as u64) ^ ST_VALID;
    v.f_namemax = f.f_namelen as _;
    v
}

/// Which file system a `statfs` call is about, as far as the cache is concerned.
enum Fs {
    /// A path or descriptor under the source.
    Source,
    /// A descriptor of a tier copy: the source's file system is reported.
    Copy,
}

/// The source's `statfs` for a call about `fs`: the record when copies are trusted, else the source's
/// answer (`ask` for a path or descriptor under it, the source directory itself for a copy), noted.
unsafe fn source_statfs(
    cache: &Cache,
    fs: Fs,
    ask: impl FnOnce(*mut libc::statfs64) -> c_int,
) -> (c_int, libc::statfs64) {
    if let Some(st) = cache.trusted().cached_statfs() {
        return (0, st);
    }
    let mut st: libc::statfs64 = std::mem::zeroed();
    let rc = match fs {
        Fs::Source => ask(&mut st),
        Fs::Copy => match std::ffi::CString::new(cache.source_root().as_os_str().as_bytes()) {
            Ok(root) => real!("statfs", unsafe extern "C" fn(*const c_char, *mut libc::statfs64) -> c_int)(
                root.as_ptr(),
                &mut st,
            ),
            Err(_) => -1,
        },
    };
    if rc == 0 {
        cache.trusted().note_statfs(&st);
    }
    (rc, st)
}

/// Whether a `statfs` of `path` or of descriptor `fd` concerns the cache, and its cache.
unsafe fn statfs_target(path: *const c_char, fd: c_int) -> Option<(&'static Cache, Fs)> {
    let s = shim()?;
    if !path.is_null() {
        s.source_path(libc::AT_FDCWD, path)?;
        return Some((s.cache()?, Fs::Source));
    }
    let name = std::fs::read_link(format!("/proc/self/fd/{fd}")).ok()?;
    if s.under(name.as_os_str().as_bytes()) {
        return Some((s.cache()?, Fs::Source));
    }
    // A copy or a shadow is only ever handed out by a cache this process opened.
    let cache = s.cache.get()?.as_ref()?;
    (cache.trusted().is_copy(&name) || cache.trusted().shadowed(&name).is_some()).then_some((cache, Fs::Copy))
}

/// `statfs` and `fstatfs` (`path` null), answered in `T` (`statfs` or `statvfs`); `ask` is the real
/// `statfs`/`fstatfs` of the same argument, `real` the function the program called.
unsafe fn statfs_common<T>(
    path: *const c_char,
    fd: c_int,
    buf: *mut T,
    answer: impl FnOnce(&libc::statfs64) -> T,
    ask: impl FnOnce(*mut libc::statfs64) -> c_int,
    real: impl FnOnce() -> c_int,
) -> c_int {
    let Some(_busy) = Busy::enter() else { return real() };
    if buf.is_null() {
        return real();
    }
    let Some((cache, fs)) = statfs_target(path, fd) else { return real() };
    match source_statfs(cache, fs, ask) {
        (0, st) => {
            *buf = answer(&st);
            0
        }
        (rc, _) => rc,
    }
}

unsafe fn real_statfs(path: *const c_char) -> impl FnOnce(*mut libc::statfs64) -> c_int {
    move |st| real!("statfs", unsafe extern "C" fn(*const c_char, *mut libc::statfs64) -> c_int)(path, st)
}

unsafe fn real_fstatfs(fd: c_int) -> impl FnOnce(*mut libc::statfs64) -> c_int {
    move |st| real!("fstatfs", unsafe extern "C" fn(c_int, *mut libc::statfs64) -> c_int)(fd, st)
}

#[no_mangle]
pub unsafe extern "C" fn statfs(path: *const c_char, buf: *mut libc::statfs64) -> c_int {
    statfs_common(
        path,
        -1,
        buf,
        |st| *st,
        real_statfs(path),
        || real!("statfs", unsafe extern "C" fn(*const c_char, *mut libc::statfs64) -> c_int)(path, buf),
    )
}

#[no_mangle]
pub unsafe extern "C" fn statfs64(path: *const c_char, buf: *mut libc::statfs64) -> c_int {
    statfs_common(
        path,
        -1,
        buf,
        |st| *st,
        real_statfs(path),
        || real!("statfs64", unsafe extern "C" fn(*const c_char, *mut libc::statfs64) -> c_int)(path, buf),
    )
}

#[no_mangle]
pub unsafe extern "C" fn fstatfs(fd: c_int, buf: *mut libc::statfs64) -> c_int {
    statfs_common(
        std::ptr::null(),
        fd,
        buf,
        |st| *st,
        real_fstatfs(fd),
        || real!("fstatfs", unsafe extern "C" fn(c_int, *mut libc::statfs64) -> c_int)(fd, buf),
    )
}

#[no_mangle]
pub unsafe extern "C" fn fstatfs64(fd: c_int, buf: *mut libc::statfs64) -> c_int {
    statfs_common(
        std::ptr::null(),
        fd,
        buf,
        |st| *st,
        real_fstatfs(fd),
        || real!("fstatfs64", unsafe extern "C" fn(c_int, *mut libc::statfs64) -> c_int)(fd, buf),
    )
}

#[no_mangle]
pub unsafe extern "C" fn statvfs(path: *const c_char, buf: *mut libc::statvfs) -> c_int {
    statfs_common(path, -1, buf, statvfs_of, real_statfs(path), || {
        real!("statvfs", unsafe extern "C" fn(*const c_char, *mut libc::statvfs) -> c_int)(path, buf)
    })
}

#[no_mangle]
pub unsafe extern "C" fn statvfs64(path: *const c_char, buf: *mut libc::statvfs) -> c_int {
    statfs_common(path, -1, buf, statvfs_of, real_statfs(path), || {
        real!("statvfs64", unsafe extern "C" fn(*const c_char, *mut libc::statvfs) -> c_int)(path, buf)
    })
}

#[no_mangle]
pub unsafe extern "C" fn fstatvfs(fd: c_int, buf: *mut libc::statvfs) -> c_int {
    statfs_common(std::ptr::null(), fd, buf, statvfs_of, real_fstatfs(fd), || {
        real!("fstatvfs", unsafe extern "C" fn(c_int, *mut libc::statvfs) -> c_int)(fd, buf)
    })
}

#[no_mangle]
pub unsafe extern "C" fn fstatvfs64(fd: c_int, buf: *mut libc::statvfs) -> c_int {
    statfs_common(std::ptr::null(), fd, buf, statvfs_of, real_fstatfs(fd), || {
        real!("fstatvfs64", unsafe extern "C" fn(c_int, *mut libc::statvfs) -> c_int)(fd, buf)
    })
}
