//! The open family: `open`, `openat`, their fortified and large-file names, `creat`, `fopen` and `freopen`.
//! A read-only open of a file under the source gets a descriptor of its tier copy (or, for a large file on
//! a miss, of the source while it is copied: see `streams`); a directory of a trusted source, one of its
//! shadow (see `dirs`); an open that writes under a write-back destination, a staged file (see `writes`).
//! Any other open is the real one, and an open that writes forgets the cached copies of what it names.
//!
//! The open family. On x86_64 and aarch64 the optional `mode` of these variadic functions arrives in the
//! register a third fixed argument would, so reading it as one is the usual way to interpose them.

use std::ffi::{CStr, OsStr};
use std::os::fd::IntoRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use libc::{c_char, c_int, mode_t, FILE};
use tierstore_core::Native;

use crate::dirs::{self, at, unshadow};
use crate::{invalidate, kept, opens_to_write, order, own, set_errno, shim, shim_calling, streams, writes, Busy, Shim};

/// The heart of the open family: a read-only open of a file under the source gets a descriptor of its
/// tier copy, or with `stream`, of the source while a large file is copied (stdio reads through its own
/// internal calls, which the shim cannot follow, so `fopen` fetches whole). Returns `None` when the real
/// function must do the call.
unsafe fn cached_open(dirfd: c_int, path: *const c_char, flags: c_int, stream: bool) -> Option<c_int> {
    let s = shim()?;
    // A warm open of a name opened warm before: its source-relative path kept (see `names`), so no normal
    // form and no cut. (O_NOFOLLOW asks about the link itself, which the long way below answers.)
    let plain_read = !opens_to_write(flags)
        && flags & (libc::O_DIRECTORY | libc::O_PATH | libc::O_DIRECT | libc::O_NOFOLLOW) == 0
        && !path.is_null();
    let name = if plain_read { CStr::from_ptr(path).to_bytes() } else { &[] };
    let kept = if plain_read { s.names.rel_of(name) } else { None };
    if let Some(rel) = kept {
        if let Ok(Some(native)) = s.cache()?.open_native_cached_rel(&rel) {
            return Some(opened(s, Path::new(OsStr::from_bytes(name)), native, flags));
        }
    }
    let abs = s.source_path(dirfd, path)?;
    if opens_to_write(flags) {
        return None;
    }
    // A directory of a trusted source: a descriptor of its shadow (see `dirs`).
    if flags & libc::O_DIRECTORY != 0 {
        return dirs::open_shadow(s.cache()?, &abs, flags);
    }
    // O_PATH handles and direct I/O (which tmpfs refuses) are the source's business.
    if flags & (libc::O_PATH | libc::O_DIRECT) != 0 {
        return None;
    }
    let cache = s.cache()?;
    // A warm open: the first tier's copy, found with one index read. (O_NOFOLLOW asks about the link
    // itself, which the long way below answers.)
    let nofollow = flags & libc::O_NOFOLLOW != 0;
    if !nofollow {
        if let Ok(rel) = cache.source_relative(&abs) {
            if let Ok(Some(native)) = cache.open_native_cached_rel(&rel) {
                // A name that is its own normal form maps to `rel` whatever the working directory.
                if plain_read && abs.as_os_str().as_bytes() == name {
                    s.names.keep(name, &rel);
                }
                return Some(opened(s, &abs, native, flags));
            }
        }
    }
    // A directory opened without O_DIRECTORY (tar opens whatever it meets that way, then reads it as a
    // directory if it is one).
    if cache
        .trusted()
        .cached_stat(&abs, nofollow)
        .ok()
        .flatten()
        .is_some_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR)
    {
        return dirs::open_shadow(cache, &abs, flags | libc::O_DIRECTORY);
    }
    let native = if stream { cache.open_native(&abs) } else { cache.open_file(&abs).map(Native::Whole) };
    match native {
        Ok(native) => Some(opened(s, &abs, native, flags)),
        Err(tierstore_core::Error::Io { source, .. }) => match source.raw_os_error() {
            Some(libc::EISDIR) => dirs::open_shadow(cache, &abs, flags | libc::O_DIRECTORY),
            None => None,
            Some(e) => {
                set_errno(e);
                Some(-1)
            }
        },
        Err(_) => None,
    }
}

/// The program's descriptor of what was opened for `abs`, its open noted for an order's read marks.
unsafe fn opened(s: &Shim, abs: &Path, native: Native, flags: c_int) -> c_int {
    let fd = descriptor_of(native, flags);
    if let Some(rel) = s.relative(abs.as_os_str().as_bytes()) {
        order::note_open(abs.as_os_str().as_bytes(), rel);
    }
    fd
}

/// The program's descriptor of an opened copy (or of the source while it is copied, registered with its
/// copy), with the descriptor flags the program asked for rather than Rust's.
unsafe fn descriptor_of(native: Native, flags: c_int) -> c_int {
    let (f, copy, mark) = match native {
        Native::Whole(f) => (f, None, None),
        Native::FromStore { file, mark } => (file, None, Some(mark)),
        Native::Copying { source, copy } => (source, Some(copy), None),
    };
    let fd = f.into_raw_fd();
    if flags & libc::O_CLOEXEC == 0 {
        // Rust opens with O_CLOEXEC; the program did not ask for it and may exec with this fd.
        libc::fcntl(fd, libc::F_SETFD, 0);
    }
    if flags & libc::O_NONBLOCK != 0 {
        libc::fcntl(fd, libc::F_SETFL, libc::O_NONBLOCK);
    }
    if let Some(copy) = copy {
        streams::register(fd, copy);
    }
    if let Some(mark) = mark {
        kept::mark_store_read(fd, mark);
    }
    fd
}

unsafe fn open_common(dirfd: c_int, path: *const c_char, flags: c_int, real: impl FnOnce() -> c_int) -> c_int {
    let Some(_busy) = Busy::enter() else {
        // An engine's own open: this shim's keeps its descriptor through the program's closes, and what it
        // keeps for its life out of the numbers the program names itself (see `own`).
        let fd = real();
        if !shim_calling() {
            return fd;
        }
        let movable = tierstore_core::interposer::opening_lasting()
            && !path.is_null()
            && !tierstore_core::interposer::holds_record_locks(CStr::from_ptr(path).to_bytes());
        if movable {
            return own::keep_high(fd);
        }
        own::keep(fd);
        return fd;
    };
    // What the engine opened for the program (a copy, a shadow, a staged file) is the program's, and so
    // is any number the kernel just handed out.
    let given = |fd: c_int| {
        own::release(fd);
        fd
    };
    if let Some(fd) = writes::open(dirfd, path, flags) {
        return given(fd);
    }
    if let Some(fd) = cached_open(dirfd, path, flags, true) {
        return given(fd);
    }
    let fd = real();
    if fd >= 0 && opens_to_write(flags) {
        invalidate(dirfd, path);
    }
    given(fd)
}

#[no_mangle]
pub unsafe extern "C" fn open(path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
    open_common(libc::AT_FDCWD, path, flags, || {
        real!("open", unsafe extern "C" fn(*const c_char, c_int, mode_t) -> c_int)(path, flags, mode)
    })
}

#[no_mangle]
pub unsafe extern "C" fn open64(path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
    open_common(libc::AT_FDCWD, path, flags, || {
        real!("open64", unsafe extern "C" fn(*const c_char, c_int, mode_t) -> c_int)(path, flags, mode)
    })
}

#[no_mangle]
pub unsafe extern "C" fn openat(dirfd: c_int, path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
    let u = unshadow(dirfd, path);
    let (dirfd, path) = at(&u, dirfd, path);
    open_common(dirfd, path, flags, || {
        real!("openat", unsafe extern "C" fn(c_int, *const c_char, c_int, mode_t) -> c_int)(dirfd, path, flags, mode)
    })
}

#[no_mangle]
pub unsafe extern "C" fn openat64(dirfd: c_int, path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
    let u = unshadow(dirfd, path);
    let (dirfd, path) = at(&u, dirfd, path);
    open_common(dirfd, path, flags, || {
        real!("openat64", unsafe extern "C" fn(c_int, *const c_char, c_int, mode_t) -> c_int)(dirfd, path, flags, mode)
    })
}

#[no_mangle]
pub unsafe extern "C" fn __open_2(path: *const c_char, flags: c_int) -> c_int {
    open_common(libc::AT_FDCWD, path, flags, || {
        real!("__open_2", unsafe extern "C" fn(*const c_char, c_int) -> c_int)(path, flags)
    })
}

#[no_mangle]
pub unsafe extern "C" fn __open64_2(path: *const c_char, flags: c_int) -> c_int {
    open_common(libc::AT_FDCWD, path, flags, || {
        real!("__open64_2", unsafe extern "C" fn(*const c_char, c_int) -> c_int)(path, flags)
    })
}

#[no_mangle]
pub unsafe extern "C" fn __openat_2(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int {
    let u = unshadow(dirfd, path);
    let (dirfd, path) = at(&u, dirfd, path);
    open_common(dirfd, path, flags, || {
        real!("__openat_2", unsafe extern "C" fn(c_int, *const c_char, c_int) -> c_int)(dirfd, path, flags)
    })
}

#[no_mangle]
pub unsafe extern "C" fn __openat64_2(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int {
    let u = unshadow(dirfd, path);
    let (dirfd, path) = at(&u, dirfd, path);
    open_common(dirfd, path, flags, || {
        real!("__openat64_2", unsafe extern "C" fn(c_int, *const c_char, c_int) -> c_int)(dirfd, path, flags)
    })
}

/// The open(2) flags of an fopen(3) mode string.
unsafe fn fopen_flags(mode: *const c_char) -> c_int {
    let m = CStr::from_ptr(mode).to_bytes();
    let mut flags = match m.first() {
        Some(b'r') if !m.contains(&b'+') => libc::O_RDONLY,
        _ => libc::O_RDWR | libc::O_CREAT, // anything else writes
    };
    if m.contains(&b'e') {
        flags |= libc::O_CLOEXEC;
    }
    flags
}

unsafe fn fopen_common(path: *const c_char, mode: *const c_char, real: impl FnOnce() -> *mut FILE) -> *mut FILE {
    let Some(_busy) = Busy::enter() else { return real() };
    if let Some(f) = writes::fopen(path, mode) {
        if !f.is_null() {
            own::release(libc::fileno(f)); // the program's stream's
        }
        return f;
    }
    let flags = fopen_flags(mode);
    match cached_open(libc::AT_FDCWD, path, flags, false) {
        Some(-1) => std::ptr::null_mut(),
        Some(fd) => {
            own::release(fd); // the program's, as its stream's
            let f = libc::fdopen(fd, mode);
            if f.is_null() {
                libc::close(fd);
            }
            f
        }
        None => {
            let f = real();
            if !f.is_null() && opens_to_write(flags) {
                invalidate(libc::AT_FDCWD, path);
            }
            f
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn fopen(path: *const c_char, mode: *const c_char) -> *mut FILE {
    fopen_common(path, mode, || {
        real!("fopen", unsafe extern "C" fn(*const c_char, *const c_char) -> *mut FILE)(path, mode)
    })
}

#[no_mangle]
pub unsafe extern "C" fn fopen64(path: *const c_char, mode: *const c_char) -> *mut FILE {
    fopen_common(path, mode, || {
        real!("fopen64", unsafe extern "C" fn(*const c_char, *const c_char) -> *mut FILE)(path, mode)
    })
}

unsafe fn freopen_common(
    path: *const c_char,
    mode: *const c_char,
    stream: *mut FILE,
    real: unsafe extern "C" fn(*const c_char, *const c_char, *mut FILE) -> *mut FILE,
) -> *mut FILE {
    // glibc's freopen closes the stream's descriptor by its own `close`.
    tierstore_core::cache::descriptor_ended();
    if !stream.is_null() {
        kept::forget(libc::fileno(stream));
    }
    let Some(_busy) = Busy::enter() else { return real(path, mode, stream) };
    if path.is_null() {
        return real(path, mode, stream);
    }
    let flags = fopen_flags(mode);
    match cached_open(libc::AT_FDCWD, path, flags, false) {
        Some(-1) => std::ptr::null_mut(),
        Some(fd) => {
            // freopen keeps the FILE object: point it at the copy through /proc, then drop our descriptor.
            let proc_path = format!("/proc/self/fd/{fd}\0");
            let f = real(proc_path.as_ptr() as *const c_char, mode, stream);
            libc::close(fd);
            f
        }
        None => {
            let f = real(path, mode, stream);
            if !f.is_null() && opens_to_write(flags) {
                invalidate(libc::AT_FDCWD, path);
            }
            f
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn freopen(path: *const c_char, mode: *const c_char, stream: *mut FILE) -> *mut FILE {
    freopen_common(
        path,
        mode,
        stream,
        real!("freopen", unsafe extern "C" fn(*const c_char, *const c_char, *mut FILE) -> *mut FILE),
    )
}

#[no_mangle]
pub unsafe extern "C" fn freopen64(path: *const c_char, mode: *const c_char, stream: *mut FILE) -> *mut FILE {
    freopen_common(
        path,
        mode,
        stream,
        real!("freopen64", unsafe extern "C" fn(*const c_char, *const c_char, *mut FILE) -> *mut FILE),
    )
}

/// `creat` is `open` with `O_CREAT | O_WRONLY | O_TRUNC`: the same capture (and, through the shim's `open`,
/// the same invalidation of the read cache).
#[no_mangle]
pub unsafe extern "C" fn creat(path: *const c_char, mode: libc::mode_t) -> c_int {
    open(path, libc::O_CREAT | libc::O_WRONLY | libc::O_TRUNC, mode)
}

/// See [`creat`].
#[no_mangle]
pub unsafe extern "C" fn creat64(path: *const c_char, mode: libc::mode_t) -> c_int {
    open64(path, libc::O_CREAT | libc::O_WRONLY | libc::O_TRUNC, mode)
}
