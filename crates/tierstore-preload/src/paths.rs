//! Path resolution of cached files, answered without the source when copies are trusted and the file's
//! path is known to have no symlink on the way (libhdf5 asks `realpath` and `readlink` of every file it
//! opens; Python's `os.path.realpath` asks `lstat` of each part).
//!
//! `fchdir` to a shadow descriptor (see `dirs`) changes to the source directory it stands for.

use std::os::unix::ffi::OsStringExt;
use std::sync::atomic::Ordering;

use libc::{c_char, c_int, size_t, ssize_t};

use crate::dirs::{self, at, unshadow};
use crate::{set_errno, shim, Busy};

/// `realpath` of a cached file: the source's resolved path joined with the file's.
unsafe fn cached_real_path(path: *const c_char) -> Option<std::ffi::CString> {
    let s = shim()?;
    let abs = s.source_path(libc::AT_FDCWD, path)?;
    let real = s.cache()?.trusted().cached_real_path(&abs).ok().flatten()?;
    std::ffi::CString::new(real.into_os_string().into_vec()).ok()
}

/// Writes `resolved` as `realpath` returns it: into `out` when given (PATH_MAX bytes), else into memory
/// from `malloc` that the caller frees.
unsafe fn return_path(resolved: &std::ffi::CStr, out: *mut c_char) -> *mut c_char {
    let bytes = resolved.to_bytes_with_nul();
    let dst = if out.is_null() { libc::malloc(bytes.len()) as *mut c_char } else { out };
    if dst.is_null() {
        set_errno(libc::ENOMEM);
        return std::ptr::null_mut();
    }
    std::ptr::copy_nonoverlapping(bytes.as_ptr() as *const c_char, dst, bytes.len());
    dst
}

unsafe fn realpath_common(path: *const c_char, out: *mut c_char, real: impl FnOnce() -> *mut c_char) -> *mut c_char {
    let Some(_busy) = Busy::enter() else { return real() };
    match cached_real_path(path) {
        Some(resolved) if resolved.as_bytes().len() < libc::PATH_MAX as usize => return_path(&resolved, out),
        _ => real(),
    }
}

#[no_mangle]
pub unsafe extern "C" fn realpath(path: *const c_char, out: *mut c_char) -> *mut c_char {
    realpath_common(path, out, || {
        real!("realpath", unsafe extern "C" fn(*const c_char, *mut c_char) -> *mut c_char)(path, out)
    })
}

#[no_mangle]
pub unsafe extern "C" fn __realpath_chk(path: *const c_char, out: *mut c_char, outlen: size_t) -> *mut c_char {
    let real = || {
        real!("__realpath_chk", unsafe extern "C" fn(*const c_char, *mut c_char, size_t) -> *mut c_char)(
            path, out, outlen,
        )
    };
    // The fortified variant aborts when the buffer is short of PATH_MAX: let it.
    if !out.is_null() && outlen < libc::PATH_MAX as size_t {
        return real();
    }
    realpath_common(path, out, real)
}

#[no_mangle]
pub unsafe extern "C" fn canonicalize_file_name(path: *const c_char) -> *mut c_char {
    realpath_common(path, std::ptr::null_mut(), || {
        real!("canonicalize_file_name", unsafe extern "C" fn(*const c_char) -> *mut c_char)(path)
    })
}

/// `readlink` when copies are trusted: a recorded symlink's target, and EINVAL for a cached file or a
/// recorded directory (not symlinks), as the source would answer.
unsafe fn readlink_common(
    dirfd: c_int,
    path: *const c_char,
    buf: *mut c_char,
    size: size_t,
    real: impl FnOnce() -> ssize_t,
) -> ssize_t {
    let Some(_busy) = Busy::enter() else { return real() };
    if size == 0 || buf.is_null() {
        return real(); // the kernel's EINVAL or EFAULT
    }
    let Some((s, abs)) = shim().and_then(|s| Some((s, s.source_path(dirfd, path)?))) else { return real() };
    let Some(cache) = s.cache() else { return real() };
    if let Ok(Some(target)) = cache.trusted().cached_link(&abs) {
        // As readlink(2): the first `size` bytes, no terminating NUL.
        let n = target.len().min(size);
        std::ptr::copy_nonoverlapping(target.as_ptr() as *const c_char, buf, n);
        return n as ssize_t;
    }
    if cache
        .trusted()
        .cached_stat(&abs, true)
        .ok()
        .flatten()
        .is_some_and(|st| st.st_mode & libc::S_IFMT != libc::S_IFLNK)
    {
        set_errno(libc::EINVAL);
        return -1;
    }
    real()
}

#[no_mangle]
pub unsafe extern "C" fn readlink(path: *const c_char, buf: *mut c_char, size: size_t) -> ssize_t {
    readlink_common(libc::AT_FDCWD, path, buf, size, || {
        real!("readlink", unsafe extern "C" fn(*const c_char, *mut c_char, size_t) -> ssize_t)(path, buf, size)
    })
}

#[no_mangle]
pub unsafe extern "C" fn readlinkat(dirfd: c_int, path: *const c_char, buf: *mut c_char, size: size_t) -> ssize_t {
    let u = unshadow(dirfd, path);
    let (dirfd, path) = at(&u, dirfd, path);
    readlink_common(dirfd, path, buf, size, || {
        real!("readlinkat", unsafe extern "C" fn(c_int, *const c_char, *mut c_char, size_t) -> ssize_t)(
            dirfd, path, buf, size,
        )
    })
}

/// `fchdir` to a shadow descriptor changes to the source directory it stands for, so that later relative
/// paths (of calls the shim does not interpose too) name the source, never the shadow.
#[no_mangle]
pub unsafe extern "C" fn fchdir(fd: c_int) -> c_int {
    if dirs::HANDED_OUT.load(Ordering::Relaxed) {
        if let Some(_busy) = Busy::enter() {
            if let Some(dir) =
                dirs::shadowed(fd).and_then(|(_, d)| std::ffi::CString::new(d.into_os_string().into_vec()).ok())
            {
                return real!("chdir", unsafe extern "C" fn(*const c_char) -> c_int)(dir.as_ptr());
            }
        }
    }
    real!("fchdir", unsafe extern "C" fn(c_int) -> c_int)(fd)
}
