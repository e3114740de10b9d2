//! Every call into the engine that may block gives up the GIL, and a daemon thread can be inside one when
//! the interpreter exits (a `HotModel`'s reader in the middle of a version, a subscriber waiting on the
//! agent's socket). Taking the GIL back once the interpreter is finalizing ends the thread with
//! `pthread_exit`, a forced unwind that cannot cross Rust frames: the process aborts (SIGABRT) or, with
//! the unwinder the wheel links, crashes (SIGSEGV). So a thread other than the main one that comes back
//! from the engine once the interpreter is exiting never takes the GIL again: it waits, parked, for the
//! process to end.
//!
//! "Exiting" is set by the last `atexit` hook to run ([`interpreter_exiting`], registered first, when
//! `tierstore` is imported): the interpreter's own finalizing flag is in neither pyo3's bindings nor the
//! stable ABI before Python 3.13. A thread can have looked at the flag just before it was set and be
//! waiting for the GIL that the main thread holds through its last hooks: it would take the GIL only once
//! the interpreter is finalizing. So each returning thread counts itself before it looks ([`RETURNING`]),
//! and the hook, having set the flag, gives up the GIL until every thread counted has taken it back and
//! left the engine's frames (two sequentially consistent steps on each side: a thread either sees the
//! flag, or is seen by the hook).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use pyo3::prelude::*;

static EXITING: AtomicBool = AtomicBool::new(false);

/// Threads that came back from the engine before the interpreter was exiting and are taking the GIL back.
static RETURNING: AtomicUsize = AtomicUsize::new(0);

/// How long the last hook waits for the threads coming back: each needs only to take the GIL, which the
/// hook has given up; a thread stuck past this is left to the interpreter.
const RETURN_WAIT: Duration = Duration::from_secs(2);

/// Called by `atexit`, after every other hook (tierstore's closes included) has run.
#[pyfunction]
pub fn interpreter_exiting(py: Python<'_>) {
    EXITING.store(true, Ordering::SeqCst);
    if RETURNING.load(Ordering::SeqCst) == 0 {
        return;
    }
    py.allow_threads(|| {
        let end = Instant::now() + RETURN_WAIT;
        while RETURNING.load(Ordering::SeqCst) > 0 && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(1));
        }
    });
}

/// `py.allow_threads(f)`, safe at exit (see the module's doc).
pub fn without_gil<T: Send, F: Send + FnOnce() -> T>(py: Python<'_>, f: F) -> T {
    let out = py.allow_threads(move || {
        let out = f();
        RETURNING.fetch_add(1, Ordering::SeqCst);
        park_if_exiting();
        out
    });
    RETURNING.fetch_sub(1, Ordering::SeqCst);
    out
}

/// Parks this thread for good if the interpreter is exiting and it is not the main thread (which runs
/// the finalization itself, and takes the GIL safely).
fn park_if_exiting() {
    if !EXITING.load(Ordering::SeqCst) {
        return;
    }
    // Asked only once exiting: two system calls, which a warm open and its read (each through here)
    // would otherwise pay every time.
    // SAFETY: getpid takes no arguments and cannot fail.
    let main = tierstore_core::sys::gettid() == unsafe { libc::getpid() };
    if !main {
        RETURNING.fetch_sub(1, Ordering::SeqCst);
        log::debug!("a thread came back from the engine while the interpreter exits: it waits for the end");
        loop {
            std::thread::park();
        }
    }
}
