//! The LD_PRELOAD shim of `tierstore run`, seen from an engine that may share its process.
//!
//! Under `tierstore run` every process of the job has the shim loaded, and a Python job that imports
//! tierstore opens a second engine (the binding's) beside it. The shim serves that process's file calls
//! under the source from the cache, so without care it would also serve the second engine's own calls:
//! an ordered prefetch opening a file of the source would be handed the shim's tier copy instead, see an
//! identity that is not the source's, and drop the copy ("it changed while it was copied"). And the
//! engine's threads would reach the shim's engine through every `stat` and listing.
//!
//! The shim exports `tierstore_preload_exempt`, which sets the thread-local flag it uses to recognise its
//! own calls. The engine raises that flag for the length of each public call ([`calls`]) and for the
//! life of each thread it starts ([`spawn`]); in a process without the shim both cost one atomic load.
//! The shim's own engine registers the function directly ([`register`]); the Python binding looks it up
//! once at import ([`find`]).

use std::sync::atomic::{AtomicUsize, Ordering};

/// `tierstore_preload_exempt(on)`: sets the calling thread's flag, returns its previous value.
pub type ExemptFn = extern "C" fn(libc::c_int) -> libc::c_int;

/// The name the shim exports its function under.
pub const SYMBOL: &std::ffi::CStr = c"tierstore_preload_exempt";

static EXEMPT: AtomicUsize = AtomicUsize::new(0);

/// Uses `f` to exempt the engine's calls (the shim registers its own).
pub fn register(f: ExemptFn) {
    EXEMPT.store(f as usize, Ordering::Release);
}

/// Looks the shim's function up in the process (`dlsym(RTLD_DEFAULT)`) and registers it when found;
/// returns whether it was. Call once, outside any path the shim intercepts.
pub fn find() -> bool {
    // SAFETY: dlsym with a NUL-terminated name; a found symbol is the shim's function of this type.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, SYMBOL.as_ptr()) };
    if !p.is_null() {
        register(unsafe { std::mem::transmute::<*mut libc::c_void, ExemptFn>(p) });
    }
    !p.is_null()
}

/// Told of each descriptor the engine makes by a system call of its own, which the shim does not see.
pub type MadeFn = extern "C" fn(libc::c_int);

static MADE: AtomicUsize = AtomicUsize::new(0);

/// Has `f` told of the descriptors the engine makes by its own system calls (the shim's own engine: it
/// keeps its descriptors open through the program's closes, and must know them all).
pub fn register_made(f: MadeFn) {
    MADE.store(f as usize, Ordering::Release);
}

/// The engine just made descriptor `fd` by a system call of its own (`openat2`, rustix's `openat`,
/// `memfd_create`): tells the shim, if this is its engine. One atomic load otherwise.
pub fn made(fd: std::os::fd::RawFd) {
    let p = MADE.load(Ordering::Acquire);
    if p != 0 {
        // SAFETY: only `register_made` stores here, and only a `MadeFn`.
        let f = unsafe { std::mem::transmute::<usize, MadeFn>(p) };
        f(fd);
    }
}

thread_local! {
    static LASTING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f`, whose opens make descriptors the engine keeps for its life and writes or opens files under
/// (its index, its tier and source directories, the copies it writes). Under the shim these are moved out
/// of the low numbers a program names itself, where a program's `dup2` would replace them (see the shim's
/// `own.rs`); everything else keeps the number the kernel gave it.
pub fn lasting<T>(f: impl FnOnce() -> T) -> T {
    let was = LASTING.with(|l| l.replace(true));
    let out = f();
    LASTING.with(|l| l.set(was));
    out
}

/// Whether the calling thread is inside [`lasting`].
pub fn opening_lasting() -> bool {
    LASTING.with(|l| l.get())
}

/// Whether `path` names a file the engine takes POSIX record locks on: the fetch locks' file and LMDB's
/// lock file. Closing any descriptor of such a file drops every record lock the process holds on it, so
/// the shim never closes a second descriptor of one (it leaves them where they were opened).
pub fn holds_record_locks(path: &[u8]) -> bool {
    path.ends_with(b"/fetch.lock") || path.ends_with(b"/lock.mdb")
}

fn exempt_fn() -> Option<ExemptFn> {
    let p = EXEMPT.load(Ordering::Acquire);
    // SAFETY: only `register` stores here, and only an `ExemptFn`.
    (p != 0).then(|| unsafe { std::mem::transmute::<usize, ExemptFn>(p) })
}

/// Raised for as long as it lives: the shim passes this thread's calls to the file system. Restores the
/// flag it found on drop, so nested calls (and the shim's own, already flagged) are left as they were.
pub struct Exempt {
    restore: Option<ExemptFn>,
}

/// Exempts the calling thread until the guard is dropped.
pub fn calls() -> Exempt {
    match exempt_fn() {
        Some(f) if f(1) == 0 => Exempt { restore: Some(f) },
        _ => Exempt { restore: None },
    }
}

impl Drop for Exempt {
    fn drop(&mut self) {
        if let Some(f) = self.restore {
            f(0);
        }
    }
}

/// Starts a thread of the engine named `name`, exempt for its whole life.
pub fn spawn<F, T>(name: String, f: F) -> std::io::Result<std::thread::JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    std::thread::Builder::new().name(name).spawn(move || {
        let _exempt = calls();
        f()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    thread_local! {
        static FLAG: Cell<libc::c_int> = const { Cell::new(0) };
    }

    extern "C" fn flag(on: libc::c_int) -> libc::c_int {
        FLAG.with(|f| f.replace(on))
    }

    #[test]
    fn a_guard_raises_the_flag_and_restores_what_it_found() {
        register(flag);
        {
            let _outer = calls();
            assert_eq!(FLAG.with(Cell::get), 1);
            {
                let _inner = calls();
                assert_eq!(FLAG.with(Cell::get), 1);
            }
            assert_eq!(FLAG.with(Cell::get), 1, "a nested guard leaves the outer one's flag up");
        }
        assert_eq!(FLAG.with(Cell::get), 0);
        let seen = spawn("t".into(), || FLAG.with(Cell::get)).unwrap().join().unwrap();
        assert_eq!(seen, 1, "an engine thread is exempt for its life");
    }
}
