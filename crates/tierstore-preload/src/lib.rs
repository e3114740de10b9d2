//! The LD_PRELOAD shim behind `tierstore run -- CMD`: unmodified programs read the source through the
//! cache. It has no Python in it.
//!
//! For paths under the source it intercepts the open family (a read-only open returns a descriptor of
//! the tier copy, so read, pread, mmap and fstat work natively with no further interception; on a miss a
//! small file is fetched whole first, and a large one is opened on the source while it is copied, see
//! `streams`), the stat family and access (answered from the cache when the dataset is
//! trusted, `revalidate = "never"`), and the calls that change files (writes, truncation, rename, unlink),
//! which pass through and invalidate what they change. Every other path costs a prefix comparison.
//!
//! Rules that keep it safe inside any process:
//! - the real functions come from `dlsym(RTLD_NEXT)`; the shim's own file operations (the cache engine
//!   opens, stats and reads files too) are recognised by a thread-local flag and go straight to them;
//! - the engine belongs to a process: a forked child (a DataLoader worker) builds its own on first use
//!   and leaks the inherited one, whose threads and locks stayed with the parent;
//! - a configuration error, or any cache fault, leaves the call to the real function: the job runs on.

#![allow(clippy::missing_safety_doc)]

use std::cell::Cell;
use std::ffi::{CStr, OsStr};
use std::os::fd::IntoRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::Mutex;

use libc::{c_char, c_int, c_uint, c_void, mode_t, off_t, size_t, ssize_t, FILE};
use tierstore_core::{Cache, Config, Native, Overrides};

mod streams;

thread_local! {
    /// Set while this thread runs shim code: calls it makes land in the real functions.
    static BUSY: Cell<bool> = const { Cell::new(false) };
}

struct Busy;

impl Busy {
    fn enter() -> Option<Busy> {
        BUSY.with(|b| {
            if b.get() {
                None
            } else {
                b.set(true);
                Some(Busy)
            }
        })
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        BUSY.with(|b| b.set(false));
    }
}

/// Resolves (once) and calls the next definition of a libc function.
macro_rules! real {
    ($name:literal, $ty:ty) => {{
        static PTR: AtomicUsize = AtomicUsize::new(0);
        let mut p = PTR.load(Ordering::Relaxed);
        if p == 0 {
            p = libc::dlsym(libc::RTLD_NEXT, concat!($name, "\0").as_ptr() as *const c_char) as usize;
            PTR.store(p, Ordering::Relaxed);
        }
        assert!(p != 0, concat!("tierstore preload: no next definition of ", $name));
        std::mem::transmute::<usize, $ty>(p)
    }};
}

/// The engine of one process. The configuration is read on the first intercepted call; the cache itself
/// is opened on the first path under the source, so processes that never touch the source (compilers,
/// multiprocessing's helpers) hold nothing of it.
struct Shim {
    pid: u32,
    config: Option<Config>,
    cache: std::sync::OnceLock<Option<Cache>>,
    root: Vec<u8>,
    canonical: Vec<u8>,
}

static SHIM: AtomicPtr<Shim> = AtomicPtr::new(std::ptr::null_mut());
static INIT: Mutex<()> = Mutex::new(());

fn shim() -> Option<&'static Shim> {
    let pid = tierstore_core::pid();
    let p = SHIM.load(Ordering::Acquire);
    // SAFETY: shims are leaked, never freed.
    if let Some(s) = unsafe { p.as_ref() } {
        if s.pid == pid {
            return s.config.as_ref().map(|_| s);
        }
    }
    let _g = INIT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(s) = unsafe { SHIM.load(Ordering::Acquire).as_ref() } {
        if s.pid == pid {
            return s.config.as_ref().map(|_| s);
        }
    }
    let config = match Config::load(&Overrides::default()) {
        Ok(config) => Some(config),
        Err(e) => {
            eprintln!("tierstore run: {e}; running without the cache");
            None
        }
    };
    let (root, canonical) = match &config {
        Some(c) => {
            let canonical = std::fs::canonicalize(&c.source).unwrap_or_else(|_| c.source.clone());
            (with_slash(&c.source), with_slash(&canonical))
        }
        None => (Vec::new(), Vec::new()),
    };
    let s: &'static Shim =
        Box::leak(Box::new(Shim { pid, config, cache: std::sync::OnceLock::new(), root, canonical }));
    SHIM.store(s as *const Shim as *mut Shim, Ordering::Release);
    s.config.as_ref().map(|_| s)
}

fn with_slash(p: &Path) -> Vec<u8> {
    let mut v = p.as_os_str().as_bytes().to_vec();
    if !v.ends_with(b"/") {
        v.push(b'/');
    }
    v
}

impl Shim {
    /// The cache, opened on first use; `None` if it cannot start (the job then runs without it).
    fn cache(&self) -> Option<&Cache> {
        self.cache
            .get_or_init(|| {
                let config = self.config.clone().expect("only configured shims are handed out");
                Cache::new(config)
                    .map_err(|e| eprintln!("tierstore run: the cache cannot start ({e}); running without it"))
                    .ok()
            })
            .as_ref()
    }

    /// The absolute, normalized path if `path` (relative to `dirfd`) names something under the source.
    unsafe fn source_path(&self, dirfd: c_int, path: *const c_char) -> Option<PathBuf> {
        if path.is_null() {
            return None;
        }
        let bytes = CStr::from_ptr(path).to_bytes();
        if bytes.is_empty() {
            return None;
        }
        let under = |b: &[u8]| b.starts_with(&self.root) || b.starts_with(&self.canonical);
        if bytes[0] == b'/' && !under(bytes) && !contains_dotdot(bytes) {
            return None; // the common case outside the source: no allocation, no system call
        }
        let joined = if bytes[0] == b'/' {
            PathBuf::from(OsStr::from_bytes(bytes))
        } else {
            let base = if dirfd == libc::AT_FDCWD {
                std::env::current_dir().ok()?
            } else {
                std::fs::read_link(format!("/proc/self/fd/{dirfd}")).ok()?
            };
            base.join(OsStr::from_bytes(bytes))
        };
        let norm = tierstore_core::source::normalize(&joined);
        under(norm.as_os_str().as_bytes()).then_some(norm)
    }

    /// Like `source_path`, and also through symlinks (for calls that change files: rare, and a missed
    /// invalidation would serve stale bytes).
    unsafe fn source_path_resolved(&self, dirfd: c_int, path: *const c_char) -> Option<PathBuf> {
        if let Some(p) = self.source_path(dirfd, path) {
            return Some(p);
        }
        let raw = PathBuf::from(OsStr::from_bytes(CStr::from_ptr(path).to_bytes()));
        let full = if raw.is_absolute() || dirfd == libc::AT_FDCWD {
            std::path::absolute(&raw).ok()?
        } else {
            std::fs::read_link(format!("/proc/self/fd/{dirfd}")).ok()?.join(raw)
        };
        // The file may be gone (unlink, rename): resolve its directory.
        let (dir, name) = (full.parent()?, full.file_name()?);
        let real = std::fs::canonicalize(dir).ok()?.join(name);
        let b = real.as_os_str().as_bytes();
        (b.starts_with(&self.root) || b.starts_with(&self.canonical)).then_some(real)
    }
}

fn contains_dotdot(b: &[u8]) -> bool {
    b.windows(3).any(|w| w == b"/..")
}

fn set_errno(e: c_int) {
    // SAFETY: errno is thread-local.
    unsafe { *libc::__errno_location() = e };
}

fn writes(flags: c_int) -> bool {
    flags & libc::O_ACCMODE != libc::O_RDONLY || flags & (libc::O_CREAT | libc::O_TRUNC | libc::O_APPEND) != 0
}

/// The heart of the open family: a read-only open of a file under the source gets a descriptor of its
/// tier copy, or with `stream`, of the source while a large file is copied (stdio reads through its own
/// internal calls, which the shim cannot follow, so `fopen` fetches whole). Returns `None` when the real
/// function must do the call.
unsafe fn cached_open(dirfd: c_int, path: *const c_char, flags: c_int, stream: bool) -> Option<c_int> {
    let s = shim()?;
    let abs = s.source_path(dirfd, path)?;
    // Directories, O_PATH handles and direct I/O (which tmpfs refuses) are the source's business.
    if writes(flags) || flags & (libc::O_DIRECTORY | libc::O_PATH | libc::O_DIRECT) != 0 {
        return None;
    }
    let cache = s.cache()?;
    let opened = if stream { cache.open_native(&abs) } else { cache.open_file(&abs).map(Native::Whole) };
    match opened {
        Ok(native) => {
            let (f, copy) = match native {
                Native::Whole(f) => (f, None),
                Native::Copying { source, copy } => (source, Some(copy)),
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
            Some(fd)
        }
        Err(tierstore_core::Error::Io { source, .. }) => match source.raw_os_error() {
            Some(libc::EISDIR) | None => None,
            Some(e) => {
                set_errno(e);
                Some(-1)
            }
        },
        Err(_) => None,
    }
}

/// After a call that changed `path` succeeded: forget cached copies of it.
unsafe fn invalidate(dirfd: c_int, path: *const c_char) {
    if let Some(s) = shim() {
        if let Some(abs) = s.source_path_resolved(dirfd, path) {
            if let Some(cache) = s.cache() {
                let _ = cache.invalidate(&abs);
            }
        }
    }
}

unsafe fn open_common(dirfd: c_int, path: *const c_char, flags: c_int, real: impl FnOnce() -> c_int) -> c_int {
    let Some(_busy) = Busy::enter() else { return real() };
    if let Some(fd) = cached_open(dirfd, path, flags, true) {
        return fd;
    }
    let fd = real();
    if fd >= 0 && writes(flags) {
        invalidate(dirfd, path);
    }
    fd
}

// The open family. On x86_64 and aarch64 the optional `mode` of these variadic functions arrives in the
// register a third fixed argument would, so reading it as one is the usual way to interpose them.

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
    open_common(dirfd, path, flags, || {
        real!("openat", unsafe extern "C" fn(c_int, *const c_char, c_int, mode_t) -> c_int)(dirfd, path, flags, mode)
    })
}

#[no_mangle]
pub unsafe extern "C" fn openat64(dirfd: c_int, path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
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
    open_common(dirfd, path, flags, || {
        real!("__openat_2", unsafe extern "C" fn(c_int, *const c_char, c_int) -> c_int)(dirfd, path, flags)
    })
}

#[no_mangle]
pub unsafe extern "C" fn __openat64_2(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int {
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
    let flags = fopen_flags(mode);
    match cached_open(libc::AT_FDCWD, path, flags, false) {
        Some(-1) => std::ptr::null_mut(),
        Some(fd) => {
            let f = libc::fdopen(fd, mode);
            if f.is_null() {
                libc::close(fd);
            }
            f
        }
        None => {
            let f = real();
            if !f.is_null() && writes(flags) {
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
            if !f.is_null() && writes(flags) {
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

// The stat family: for a cached file, the answer comes from its copy (size and mtime are the source's,
// inode and device are reported as the source's), so later epochs send no metadata operation to the
// source. Only when copies are trusted (`revalidate = "never"`); otherwise every open asks the source anyway.

/// The cached `stat` of `path` (relative to `dirfd`), when the cache can answer.
unsafe fn cached_stat(dirfd: c_int, path: *const c_char) -> Option<libc::stat> {
    let s = shim()?;
    let abs = s.source_path(dirfd, path)?;
    s.cache()?.cached_stat(&abs).ok().flatten()
}

unsafe fn stat_common(dirfd: c_int, path: *const c_char, buf: *mut libc::stat, real: impl FnOnce() -> c_int) -> c_int {
    let Some(_busy) = Busy::enter() else { return real() };
    match cached_stat(dirfd, path) {
        Some(st) => {
            *buf = st;
            0
        }
        None => real(),
    }
}

#[no_mangle]
pub unsafe extern "C" fn stat(path: *const c_char, buf: *mut libc::stat) -> c_int {
    stat_common(libc::AT_FDCWD, path, buf, || {
        real!("stat", unsafe extern "C" fn(*const c_char, *mut libc::stat) -> c_int)(path, buf)
    })
}

#[no_mangle]
pub unsafe extern "C" fn stat64(path: *const c_char, buf: *mut libc::stat) -> c_int {
    stat_common(libc::AT_FDCWD, path, buf, || {
        real!("stat64", unsafe extern "C" fn(*const c_char, *mut libc::stat) -> c_int)(path, buf)
    })
}

#[no_mangle]
pub unsafe extern "C" fn __xstat(ver: c_int, path: *const c_char, buf: *mut libc::stat) -> c_int {
    stat_common(libc::AT_FDCWD, path, buf, || {
        real!("__xstat", unsafe extern "C" fn(c_int, *const c_char, *mut libc::stat) -> c_int)(ver, path, buf)
    })
}

#[no_mangle]
pub unsafe extern "C" fn __xstat64(ver: c_int, path: *const c_char, buf: *mut libc::stat) -> c_int {
    stat_common(libc::AT_FDCWD, path, buf, || {
        real!("__xstat64", unsafe extern "C" fn(c_int, *const c_char, *mut libc::stat) -> c_int)(ver, path, buf)
    })
}

/// `fstatat` answers from the cache only when it follows symlinks and names a path: `lstat` semantics
/// (AT_SYMLINK_NOFOLLOW) and `fstat` through AT_EMPTY_PATH are the source's to answer.
unsafe fn fstatat_common(
    dirfd: c_int,
    path: *const c_char,
    buf: *mut libc::stat,
    flags: c_int,
    real: impl FnOnce() -> c_int,
) -> c_int {
    if flags & (libc::AT_SYMLINK_NOFOLLOW | libc::AT_EMPTY_PATH) != 0 {
        return real();
    }
    stat_common(dirfd, path, buf, real)
}

#[no_mangle]
pub unsafe extern "C" fn fstatat(dirfd: c_int, path: *const c_char, buf: *mut libc::stat, flags: c_int) -> c_int {
    fstatat_common(dirfd, path, buf, flags, || {
        real!("fstatat", unsafe extern "C" fn(c_int, *const c_char, *mut libc::stat, c_int) -> c_int)(
            dirfd, path, buf, flags,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn fstatat64(dirfd: c_int, path: *const c_char, buf: *mut libc::stat, flags: c_int) -> c_int {
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
    fstatat_common(dirfd, path, buf, flags, || {
        real!("__fxstatat64", unsafe extern "C" fn(c_int, c_int, *const c_char, *mut libc::stat, c_int) -> c_int)(
            ver, dirfd, path, buf, flags,
        )
    })
}

fn statx_time(sec: i64, nsec: i64) -> libc::statx_timestamp {
    // SAFETY: a plain C struct, all zeros is valid.
    let mut t: libc::statx_timestamp = unsafe { std::mem::zeroed() };
    t.tv_sec = sec;
    t.tv_nsec = nsec as u32;
    t
}

#[no_mangle]
pub unsafe extern "C" fn statx(
    dirfd: c_int,
    path: *const c_char,
    flags: c_int,
    mask: c_uint,
    buf: *mut libc::statx,
) -> c_int {
    let real = || {
        real!("statx", unsafe extern "C" fn(c_int, *const c_char, c_int, c_uint, *mut libc::statx) -> c_int)(
            dirfd, path, flags, mask, buf,
        )
    };
    if flags & (libc::AT_SYMLINK_NOFOLLOW | libc::AT_EMPTY_PATH) != 0 {
        return real();
    }
    let Some(_busy) = Busy::enter() else { return real() };
    let Some(st) = cached_stat(dirfd, path) else { return real() };
    let mut x: libc::statx = std::mem::zeroed();
    x.stx_mask = libc::STATX_BASIC_STATS;
    x.stx_blksize = st.st_blksize as u32;
    x.stx_nlink = st.st_nlink as u32;
    x.stx_uid = st.st_uid;
    x.stx_gid = st.st_gid;
    x.stx_mode = st.st_mode as u16;
    x.stx_ino = st.st_ino;
    x.stx_size = st.st_size as u64;
    x.stx_blocks = st.st_blocks as u64;
    x.stx_atime = statx_time(st.st_atime, st.st_atime_nsec);
    x.stx_mtime = statx_time(st.st_mtime, st.st_mtime_nsec);
    x.stx_ctime = statx_time(st.st_ctime, st.st_ctime_nsec);
    x.stx_dev_major = libc::major(st.st_dev);
    x.stx_dev_minor = libc::minor(st.st_dev);
    *buf = x;
    0
}

unsafe fn access_common(dirfd: c_int, path: *const c_char, mode: c_int, real: impl FnOnce() -> c_int) -> c_int {
    let Some(_busy) = Busy::enter() else { return real() };
    if mode & (libc::W_OK | libc::X_OK) == 0 && cached_stat(dirfd, path).is_some() {
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
    access_common(dirfd, path, mode, || {
        real!("faccessat", unsafe extern "C" fn(c_int, *const c_char, c_int, c_int) -> c_int)(dirfd, path, mode, flags)
    })
}

// Calls that change files pass through untouched, then invalidate what they changed.

unsafe fn changed(rc: c_int, targets: &[(c_int, *const c_char)]) -> c_int {
    if rc == 0 {
        if let Some(_busy) = Busy::enter() {
            for &(dirfd, path) in targets {
                invalidate(dirfd, path);
            }
        }
    }
    rc
}

#[no_mangle]
pub unsafe extern "C" fn unlink(path: *const c_char) -> c_int {
    let rc = real!("unlink", unsafe extern "C" fn(*const c_char) -> c_int)(path);
    changed(rc, &[(libc::AT_FDCWD, path)])
}

#[no_mangle]
pub unsafe extern "C" fn unlinkat(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int {
    let rc = real!("unlinkat", unsafe extern "C" fn(c_int, *const c_char, c_int) -> c_int)(dirfd, path, flags);
    changed(rc, &[(dirfd, path)])
}

#[no_mangle]
pub unsafe extern "C" fn rename(old: *const c_char, new: *const c_char) -> c_int {
    let rc = real!("rename", unsafe extern "C" fn(*const c_char, *const c_char) -> c_int)(old, new);
    changed(rc, &[(libc::AT_FDCWD, old), (libc::AT_FDCWD, new)])
}

#[no_mangle]
pub unsafe extern "C" fn renameat(olddir: c_int, old: *const c_char, newdir: c_int, new: *const c_char) -> c_int {
    let rc = real!("renameat", unsafe extern "C" fn(c_int, *const c_char, c_int, *const c_char) -> c_int)(
        olddir, old, newdir, new,
    );
    changed(rc, &[(olddir, old), (newdir, new)])
}

#[no_mangle]
pub unsafe extern "C" fn renameat2(
    olddir: c_int,
    old: *const c_char,
    newdir: c_int,
    new: *const c_char,
    flags: c_uint,
) -> c_int {
    let rc = real!("renameat2", unsafe extern "C" fn(c_int, *const c_char, c_int, *const c_char, c_uint) -> c_int)(
        olddir, old, newdir, new, flags,
    );
    changed(rc, &[(olddir, old), (newdir, new)])
}

#[no_mangle]
pub unsafe extern "C" fn truncate(path: *const c_char, len: libc::off_t) -> c_int {
    let rc = real!("truncate", unsafe extern "C" fn(*const c_char, libc::off_t) -> c_int)(path, len);
    changed(rc, &[(libc::AT_FDCWD, path)])
}

#[no_mangle]
pub unsafe extern "C" fn truncate64(path: *const c_char, len: libc::off_t) -> c_int {
    let rc = real!("truncate64", unsafe extern "C" fn(*const c_char, libc::off_t) -> c_int)(path, len);
    changed(rc, &[(libc::AT_FDCWD, path)])
}

// Reads of descriptors whose file is still being copied (see `streams`). For every other descriptor
// these cost one atomic load before the real call.

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, count: size_t) -> ssize_t {
    if let Some(n) = streams::serve(fd, buf, count, None) {
        return n;
    }
    real!("read", unsafe extern "C" fn(c_int, *mut c_void, size_t) -> ssize_t)(fd, buf, count)
}

#[no_mangle]
pub unsafe extern "C" fn pread(fd: c_int, buf: *mut c_void, count: size_t, offset: off_t) -> ssize_t {
    if let Some(n) = streams::serve(fd, buf, count, Some(offset)) {
        return n;
    }
    real!("pread", unsafe extern "C" fn(c_int, *mut c_void, size_t, off_t) -> ssize_t)(fd, buf, count, offset)
}

#[no_mangle]
pub unsafe extern "C" fn pread64(fd: c_int, buf: *mut c_void, count: size_t, offset: off_t) -> ssize_t {
    if let Some(n) = streams::serve(fd, buf, count, Some(offset)) {
        return n;
    }
    real!("pread64", unsafe extern "C" fn(c_int, *mut c_void, size_t, off_t) -> ssize_t)(fd, buf, count, offset)
}

// Calls that end a descriptor's life drop it from the table (a missed one is caught by `kcmp`).

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    streams::forget(fd);
    real!("close", unsafe extern "C" fn(c_int) -> c_int)(fd)
}

#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    let rc = real!("dup2", unsafe extern "C" fn(c_int, c_int) -> c_int)(old, new);
    if rc >= 0 && old != new {
        streams::forget(new);
    }
    rc
}

#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    let rc = real!("dup3", unsafe extern "C" fn(c_int, c_int, c_int) -> c_int)(old, new, flags);
    if rc >= 0 {
        streams::forget(new);
    }
    rc
}
