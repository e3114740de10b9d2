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
//!
//! This file is the plumbing every family shares: the thread-local flag (`Busy`), `real!`, the engine of
//! the process (`shim`), the paths under the source, `set_errno`, and the invalidation after a change.
//! The interposed functions live one family per file: `open`, `stat` (and `access`), `paths` (`realpath`,
//! `readlink`, `fchdir`), `statfs`, `changes` (the calls that change the store), `io` (reads, `close`,
//! `dup`, `mmap`), `dirs` (listings, of a trusted source and of write-back destinations), `xattrs`; the
//! write-back capture is `writes`, the copies followed while they grow `streams`, the readers' marks of
//! an ordered prefetch `order`.

#![allow(clippy::missing_safety_doc)]

use std::cell::Cell;
use std::ffi::{CStr, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Mutex;

use libc::{c_char, c_int};
use tierstore_core::{Cache, Config, Overrides};

thread_local! {
    /// Set while this thread runs shim code, or an engine's: calls it makes land in the real functions.
    static BUSY: Cell<bool> = const { Cell::new(false) };
    /// Set while the code this thread runs is this shim's own (its calls, its engine's threads), not
    /// another engine's in the process: the descriptors it opens are the shim's (see `own`).
    static OURS: Cell<bool> = const { Cell::new(false) };
}

struct Busy;

impl Busy {
    fn enter() -> Option<Busy> {
        BUSY.with(|b| {
            if b.get() {
                None
            } else {
                b.set(true);
                OURS.with(|o| o.set(true));
                Some(Busy)
            }
        })
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        BUSY.with(|b| b.set(false));
        OURS.with(|o| o.set(false));
    }
}

/// Whether the calling thread runs an engine's code (this shim's or another's), not the program's.
fn engine_calling() -> bool {
    BUSY.with(|b| b.get())
}

/// Whether the calling thread runs this shim's own engine.
fn shim_calling() -> bool {
    BUSY.with(|b| b.get()) && OURS.with(|o| o.get())
}

/// Told by the shim's engine of a descriptor it made by a system call of its own (see `own`).
extern "C" fn shim_made(fd: c_int) {
    own::made(fd);
}

/// Drops what the shim kept for a descriptor of the program's as the shim: a descriptor it closes (a
/// stream's duplicate, a fetch's lock) is its own, which a close from the program would leave open.
fn drop_as_shim<T>(kept: Option<T>) {
    if kept.is_some() {
        let _busy = Busy::enter();
        drop(kept);
    }
}

/// Sets the calling thread's flag (`on` nonzero: its calls go straight to the real functions) and returns
/// its previous value. A second engine in this process (the Python binding's, when a job under
/// `tierstore run` imports tierstore) finds it by name and exempts its own file calls with it, see
/// `tierstore_core::interposer`.
#[no_mangle]
pub extern "C" fn tierstore_preload_exempt(on: c_int) -> c_int {
    BUSY.with(|b| b.replace(on != 0) as c_int)
}

/// [`tierstore_preload_exempt`] for the shim's own engine, whose threads' descriptors are the shim's.
extern "C" fn shim_exempt(on: c_int) -> c_int {
    let was = tierstore_preload_exempt(on);
    if was == 0 || on == 0 {
        OURS.with(|o| o.set(on != 0)); // raised from nothing, or put back: a nested call leaves it be
    }
    was
}

/// The next definition of a libc function (resolved once), or `None` where this C library has none: the
/// functions of newer releases than the oldest the shim runs on (`close_range`, glibc 2.34).
macro_rules! next {
    ($name:literal, $ty:ty) => {{
        static PTR: ::std::sync::atomic::AtomicUsize = ::std::sync::atomic::AtomicUsize::new(0);
        let mut p = PTR.load(::std::sync::atomic::Ordering::Relaxed);
        if p == 0 {
            p = ::libc::dlsym(::libc::RTLD_NEXT, concat!($name, "\0").as_ptr() as *const ::libc::c_char) as usize;
            PTR.store(p, ::std::sync::atomic::Ordering::Relaxed);
        }
        (p != 0).then(|| ::std::mem::transmute::<usize, $ty>(p))
    }};
}

/// The next definition of a libc function that every C library the shim runs on has.
macro_rules! real {
    ($name:literal, $ty:ty) => {
        match next!($name, $ty) {
            Some(f) => f,
            None => panic!(concat!("tierstore preload: no next definition of ", $name)),
        }
    };
}

mod changes;
mod dirs;
mod fd_table;
mod io;
mod kept;
mod names;
mod open;
mod order;
mod own;
mod paths;
mod stat;
mod statfs;
mod streams;
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
    /// Names this process opened warm, and their source-relative paths.
    names: names::KnownNames,
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
    let inherited = unsafe { SHIM.load(Ordering::Acquire).as_ref() };
    if let Some(s) = inherited {
        if s.pid == pid {
            return s.config.as_ref().map(|_| s);
        }
        // A forked child (a DataLoader worker) keeps its parent's configuration: the same environment
        // and files gave it, and reading them again costs each worker about half a millisecond. Only the
        // engine, whose threads, locks and LMDB handles stayed with the parent, is built anew.
        return install(pid, s.config.clone(), s.root.clone(), s.alias.clone());
    }
    tierstore_core::logging::init();
    // The engine's own threads (copies, prefetches, sweeps) are exempt for their whole life.
    tierstore_core::interposer::register(shim_exempt);
    tierstore_core::interposer::register_made(shim_made);
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
    install(pid, config, root, alias)
}

/// Makes a shim of this configuration process `pid`'s engine, its cache not yet opened (leaked: a forked
/// child may still hold the one before), and returns it if it is configured.
fn install(pid: u32, config: Option<Config>, root: Vec<u8>, alias: Vec<u8>) -> Option<&'static Shim> {
    let shim = Shim { pid, config, cache: std::sync::OnceLock::new(), root, alias, names: Default::default() };
    let s: &'static Shim = Box::leak(Box::new(shim));
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
    Some(tierstore_core::source::normalized(joined))
}

/// Whether `b` may climb out of a directory (`/..`). Asked of every absolute path a program names outside
/// the source (Python's start `stat`s thousands), so it looks only where a dot is, found with memchr's
/// vectorised search, not at every window of three bytes.
fn contains_dotdot(b: &[u8]) -> bool {
    memchr::memchr_iter(b'.', b).any(|i| i > 0 && b[i - 1] == b'/' && b.get(i + 1) == Some(&b'.'))
}

fn set_errno(e: c_int) {
    // SAFETY: errno is thread-local.
    unsafe { *libc::__errno_location() = e };
}

fn opens_to_write(flags: c_int) -> bool {
    flags & libc::O_ACCMODE != libc::O_RDONLY || flags & (libc::O_CREAT | libc::O_TRUNC | libc::O_APPEND) != 0
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
