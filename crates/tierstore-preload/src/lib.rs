//! The LD_PRELOAD shim behind `tierstore run -- CMD`: unmodified programs read the source through the
//! cache. It has no Python in it.
//!
//! For paths under the source it intercepts the open family (a read-only open returns a descriptor of
//! the tier copy, so read, pread, mmap and fstat work natively with no further interception; on a miss a
//! small file is fetched whole first, and a large one is opened on the source while it is copied, see
//! `streams`), the stat family (whose every member, `fstat` of a copy's descriptor included, reports the
//! source's file, so programs that compare them see one file), `access`, `realpath` and `readlink`
//! (answered from the cache when the dataset is trusted, `revalidate = "never"`, for symlinks inside the
//! source too), the statfs family (the source's file system, recorded once when trusted), directory
//! listings when trusted (see `dirs`), extended attributes (answered from records when trusted, and a
//! copy's descriptor answering for its source file: see `xattrs`), and the calls that change files
//! (writes, truncation, rename, unlink, mkdir, rmdir, symlink, setxattr, removexattr), which pass
//! through and invalidate what they change.
//! Every other path costs a prefix comparison; `fstat` of a file on another device than the tiers' costs
//! a comparison of device numbers.
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
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::Mutex;

use libc::{c_char, c_int, c_uint, c_void, mode_t, off_t, size_t, ssize_t, FILE};
use tierstore_core::{Cache, Config, Native, Overrides};

mod order;
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

mod dirs;
mod writes;
mod xattrs;

/// The engine of one process. The configuration is read on the first intercepted call; the cache itself
/// is opened on the first path under the source, so processes that never touch the source (compilers,
/// multiprocessing's helpers) hold nothing of it.
struct Shim {
    pid: u32,
    config: Option<Config>,
    cache: std::sync::OnceLock<Option<Cache>>,
    /// The source directory (symlinks resolved) with a trailing slash.
    root: Vec<u8>,
    /// The source as configured, when that spelling goes through a symlink (empty otherwise).
    alias: Vec<u8>,
}

static SHIM: AtomicPtr<Shim> = AtomicPtr::new(std::ptr::null_mut());
/// Set by `tierstore run` when write-back destinations are configured and no source is.
const WRITEBACK_ONLY: &str = "TIERSTORE_WRITEBACK_ONLY";
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
    // `tierstore run` for a job that only stages what it writes has no source to read through: nothing
    // to load, and nothing to warn every process of the job about.
    let config = if std::env::var_os(WRITEBACK_ONLY).is_some() {
        None
    } else {
        match Config::load(&Overrides::default()) {
            Ok(config) => Some(config),
            Err(e) => {
                eprintln!("tierstore run: {e}; running without the cache");
                None
            }
        }
    };
    // The configuration resolved the source's symlinks (once per job: `tierstore run` hands the result to
    // every process it starts), so no process asks the store anything at start.
    let (root, alias) = match &config {
        Some(c) => (with_slash(&c.source), c.source_alias.as_deref().map(with_slash).unwrap_or_default()),
        None => (Vec::new(), Vec::new()),
    };
    let s: &'static Shim = Box::leak(Box::new(Shim { pid, config, cache: std::sync::OnceLock::new(), root, alias }));
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

    /// The path of `b` (absolute, normalized) relative to the source, by either of its names.
    fn relative<'a>(&self, b: &'a [u8]) -> Option<&'a [u8]> {
        [&self.root, &self.alias].into_iter().filter(|d| !d.is_empty()).find_map(|d| b.strip_prefix(d.as_slice()))
    }

    /// Whether `b` (an absolute path) is the source directory or under it, by either of its names.
    fn under(&self, b: &[u8]) -> bool {
        let within = |dir: &[u8]| !dir.is_empty() && (b.starts_with(dir) || b == &dir[..dir.len() - 1]);
        within(&self.root) || within(&self.alias)
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
        if bytes[0] == b'/' && !self.under(bytes) && !contains_dotdot(bytes) {
            return None; // the common case outside the source: no allocation, no system call
        }
        let norm = absolute_at(dirfd, bytes)?;
        self.under(norm.as_os_str().as_bytes()).then_some(norm)
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
        self.under(real.as_os_str().as_bytes()).then_some(real)
    }
}

/// The absolute, normalized path that `bytes` names (not empty: a path relative to `dirfd`, or absolute);
/// `None` when the working directory or `dirfd` cannot be resolved.
pub(crate) fn absolute_at(dirfd: c_int, bytes: &[u8]) -> Option<PathBuf> {
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
    Some(tierstore_core::source::normalize(&joined))
}

fn contains_dotdot(b: &[u8]) -> bool {
    b.windows(3).any(|w| w == b"/..")
}

/// For a `*at` call relative to a shadow descriptor (see `dirs`): the source path it names, for the call
/// to make with `AT_FDCWD` instead, so that what the shim does not answer is done on the source, never
/// on the shadow.
unsafe fn unshadow(dirfd: c_int, path: *const c_char) -> Option<std::ffi::CString> {
    if !dirs::HANDED_OUT.load(Ordering::Relaxed) || dirfd < 0 || path.is_null() || matches!(*path as u8, 0 | b'/') {
        return None;
    }
    let _busy = Busy::enter()?;
    let (_, dir) = dirs::shadowed(dirfd)?;
    let joined = dir.join(OsStr::from_bytes(CStr::from_ptr(path).to_bytes()));
    std::ffi::CString::new(joined.into_os_string().into_vec()).ok()
}

/// The arguments of a `*at` call after `unshadow`.
fn at(unshadowed: &Option<std::ffi::CString>, dirfd: c_int, path: *const c_char) -> (c_int, *const c_char) {
    match unshadowed {
        Some(p) => (libc::AT_FDCWD, p.as_ptr()),
        None => (dirfd, path),
    }
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
    if writes(flags) {
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
    // A directory opened without O_DIRECTORY (tar opens whatever it meets that way, then reads it as a
    // directory if it is one).
    let nofollow = flags & libc::O_NOFOLLOW != 0;
    if cache.cached_stat(&abs, nofollow).ok().flatten().is_some_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR) {
        return dirs::open_shadow(cache, &abs, flags | libc::O_DIRECTORY);
    }
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
            if let Some(rel) = s.relative(abs.as_os_str().as_bytes()) {
                order::note_open(rel);
            }
            Some(fd)
        }
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
    if let Some(fd) = writes::open(dirfd, path, flags) {
        return fd;
    }
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
        return f;
    }
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

// The stat family. For a cached file every answer is the source's `stat` as recorded when the copy was
// taken, whichever call asks: `stat`/`lstat`/`statx` of the path (from the index, without asking the source,
// when copies are trusted: `revalidate = "never"`) and `fstat` of the descriptor an open returned (which is
// the tier copy's). Programs that compare them (cp, tar, rsync: "file changed as we read it") see one file.

/// The cached `stat` of `path` (relative to `dirfd`), when the cache can answer. `nofollow`: `lstat`.
unsafe fn cached_stat(dirfd: c_int, path: *const c_char, nofollow: bool) -> Option<libc::stat> {
    let s = shim()?;
    let abs = s.source_path(dirfd, path)?;
    s.cache()?.cached_stat(&abs, nofollow).ok().flatten()
}

/// The stat family by path: the cache's answer, or the source's, which the cache takes note of (a
/// trusted source's directories are answered from the cache the next time). `record` turns what the
/// real call wrote into a `stat`.
unsafe fn stat_path<T>(
    dirfd: c_int,
    path: *const c_char,
    buf: *mut T,
    nofollow: bool,
    answer: impl FnOnce(&libc::stat) -> T,
    record: impl FnOnce(&T) -> libc::stat,
    real: impl FnOnce() -> c_int,
) -> c_int {
    let Some(_busy) = Busy::enter() else { return real() };
    if let Some(st) = writes::staged_stat(dirfd, path) {
        *buf = answer(&st);
        return 0;
    }
    let Some((s, abs)) = shim().and_then(|s| Some((s, s.source_path(dirfd, path)?))) else { return real() };
    let Some(cache) = s.cache() else { return real() };
    if let Ok(Some(st)) = cache.cached_stat(&abs, nofollow) {
        *buf = answer(&st);
        return 0;
    }
    let rc = real();
    if rc == 0 && !buf.is_null() {
        cache.note_stat(&abs, &record(&*buf), nofollow);
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
    stat_path(dirfd, path, buf, nofollow, |st| *st, |st| *st, real)
}

/// After the real `fstat` of `fd` filled `buf`: a tier copy this process's cache handed out is reported
/// as the source file it copies. The cache is not opened for this: without it, no copy was handed out.
unsafe fn fstat_common(fd: c_int, buf: *mut libc::stat, real: impl FnOnce() -> c_int) -> c_int {
    let rc = real();
    if rc != 0 || buf.is_null() {
        return rc;
    }
    let Some(_busy) = Busy::enter() else { return rc };
    if let Some(cache) = shim().and_then(|s| s.cache.get()).and_then(Option::as_ref) {
        if let Some(st) = cache.copy_stat(fd, &*buf) {
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
        if let Some(st) = cache.copy_stat(dirfd, &own) {
            *buf = statx_of(&st);
        }
        return rc;
    }
    stat_path(dirfd, path, buf, flags & libc::AT_SYMLINK_NOFOLLOW != 0, statx_of, stat_of, real)
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

// Path resolution of cached files, answered without the source when copies are trusted and the file's
// path is known to have no symlink on the way (libhdf5 asks `realpath` and `readlink` of every file it
// opens; Python's `os.path.realpath` asks `lstat` of each part).

/// `realpath` of a cached file: the source's resolved path joined with the file's.
unsafe fn cached_real_path(path: *const c_char) -> Option<std::ffi::CString> {
    let s = shim()?;
    let abs = s.source_path(libc::AT_FDCWD, path)?;
    let real = s.cache()?.cached_real_path(&abs).ok().flatten()?;
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
    if let Ok(Some(target)) = cache.cached_link(&abs) {
        // As readlink(2): the first `size` bytes, no terminating NUL.
        let n = target.len().min(size);
        std::ptr::copy_nonoverlapping(target.as_ptr() as *const c_char, buf, n);
        return n as ssize_t;
    }
    if cache.cached_stat(&abs, true).ok().flatten().is_some_and(|st| st.st_mode & libc::S_IFMT != libc::S_IFLNK) {
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

// The statfs family. Walkers ask it of the directories they open (GNU find's fts, to choose how to walk),
// so a trusted source answers it from a record taken the first time (see `Cache::cached_statfs`); a tier
// copy's descriptor reports the source's file system, as its `fstat` reports the source's file. On
// x86_64 and aarch64 the `*64` structures are the plain ones; the shim reads both as `statfs64`, whose
// `f_flags` the libc crate names.

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
    if let Some(st) = cache.cached_statfs() {
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
        cache.note_statfs(&st);
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
    (cache.is_copy(&name) || cache.shadowed(&name).is_some()).then_some((cache, Fs::Copy))
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
    if let Some(rc) =
        writes::unlink(libc::AT_FDCWD, path, || real!("unlink", unsafe extern "C" fn(*const c_char) -> c_int)(path))
    {
        return rc;
    }
    let rc = real!("unlink", unsafe extern "C" fn(*const c_char) -> c_int)(path);
    changed(rc, &[(libc::AT_FDCWD, path)])
}

#[no_mangle]
pub unsafe extern "C" fn unlinkat(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int {
    let u = unshadow(dirfd, path);
    let (dirfd, path) = at(&u, dirfd, path);
    if flags & libc::AT_REMOVEDIR == 0 {
        let real = || real!("unlinkat", unsafe extern "C" fn(c_int, *const c_char, c_int) -> c_int)(dirfd, path, flags);
        if let Some(rc) = writes::unlink(dirfd, path, real) {
            return rc;
        }
    }
    let rc = real!("unlinkat", unsafe extern "C" fn(c_int, *const c_char, c_int) -> c_int)(dirfd, path, flags);
    changed(rc, &[(dirfd, path)])
}

#[no_mangle]
pub unsafe extern "C" fn mkdir(path: *const c_char, mode: mode_t) -> c_int {
    let rc = real!("mkdir", unsafe extern "C" fn(*const c_char, mode_t) -> c_int)(path, mode);
    changed(rc, &[(libc::AT_FDCWD, path)])
}

#[no_mangle]
pub unsafe extern "C" fn mkdirat(dirfd: c_int, path: *const c_char, mode: mode_t) -> c_int {
    let u = unshadow(dirfd, path);
    let (dirfd, path) = at(&u, dirfd, path);
    let rc = real!("mkdirat", unsafe extern "C" fn(c_int, *const c_char, mode_t) -> c_int)(dirfd, path, mode);
    changed(rc, &[(dirfd, path)])
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

#[no_mangle]
pub unsafe extern "C" fn rmdir(path: *const c_char) -> c_int {
    let rc = real!("rmdir", unsafe extern "C" fn(*const c_char) -> c_int)(path);
    changed(rc, &[(libc::AT_FDCWD, path)])
}

#[no_mangle]
pub unsafe extern "C" fn symlink(target: *const c_char, path: *const c_char) -> c_int {
    let rc = real!("symlink", unsafe extern "C" fn(*const c_char, *const c_char) -> c_int)(target, path);
    changed(rc, &[(libc::AT_FDCWD, path)])
}

#[no_mangle]
pub unsafe extern "C" fn symlinkat(target: *const c_char, dirfd: c_int, path: *const c_char) -> c_int {
    let u = unshadow(dirfd, path);
    let (dirfd, path) = at(&u, dirfd, path);
    let rc =
        real!("symlinkat", unsafe extern "C" fn(*const c_char, c_int, *const c_char) -> c_int)(target, dirfd, path);
    changed(rc, &[(dirfd, path)])
}

#[no_mangle]
pub unsafe extern "C" fn rename(old: *const c_char, new: *const c_char) -> c_int {
    if let Some(rc) = writes::rename(libc::AT_FDCWD, old, libc::AT_FDCWD, new, 0) {
        return rc;
    }
    let rc = real!("rename", unsafe extern "C" fn(*const c_char, *const c_char) -> c_int)(old, new);
    changed(rc, &[(libc::AT_FDCWD, old), (libc::AT_FDCWD, new)])
}

#[no_mangle]
pub unsafe extern "C" fn renameat(olddir: c_int, old: *const c_char, newdir: c_int, new: *const c_char) -> c_int {
    let (uo, un) = (unshadow(olddir, old), unshadow(newdir, new));
    let ((olddir, old), (newdir, new)) = (at(&uo, olddir, old), at(&un, newdir, new));
    if let Some(rc) = writes::rename(olddir, old, newdir, new, 0) {
        return rc;
    }
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
    let (uo, un) = (unshadow(olddir, old), unshadow(newdir, new));
    let ((olddir, old), (newdir, new)) = (at(&uo, olddir, old), at(&un, newdir, new));
    if let Some(rc) = writes::rename(olddir, old, newdir, new, flags) {
        return rc;
    }
    let rc = real!("renameat2", unsafe extern "C" fn(c_int, *const c_char, c_int, *const c_char, c_uint) -> c_int)(
        olddir, old, newdir, new, flags,
    );
    changed(rc, &[(olddir, old), (newdir, new)])
}

#[no_mangle]
pub unsafe extern "C" fn truncate(path: *const c_char, len: libc::off_t) -> c_int {
    if let Some(rc) = writes::truncate(path, len) {
        return rc;
    }
    let rc = real!("truncate", unsafe extern "C" fn(*const c_char, libc::off_t) -> c_int)(path, len);
    changed(rc, &[(libc::AT_FDCWD, path)])
}

#[no_mangle]
pub unsafe extern "C" fn truncate64(path: *const c_char, len: libc::off_t) -> c_int {
    if let Some(rc) = writes::truncate(path, len) {
        return rc;
    }
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
    writes::close(fd, || real!("close", unsafe extern "C" fn(c_int) -> c_int)(fd))
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
