//! Every call into the engine that may block gives up the GIL, and a daemon thread can be inside one when
//! the interpreter exits (a `HotModel`'s reader in the middle of a version, a subscriber waiting on the
//! agent's socket). Taking the GIL back once the interpreter is finalizing ends the thread with
//! `pthread_exit`, a forced unwind that cannot cross Rust frames: the process aborts (SIGABRT, exit 134).
//! So a thread other than the main one that comes back from the engine once the interpreter is exiting
//! never takes the GIL again: it waits, parked, for the process to end.
//!
//! "Exiting" is set by the last `atexit` hook to run ([`interpreter_exiting`], registered first, when
//! `tierstore` is imported): the interpreter's own finalizing flag is in neither pyo3's bindings nor the
//! stable ABI before Python 3.13.

use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::prelude::*;

static EXITING: AtomicBool = AtomicBool::new(false);

/// Called by `atexit`, after every other hook (tierstore's closes included) has run.
#[pyfunction]
pub fn interpreter_exiting() {
    EXITING.store(true, Ordering::Release);
}

/// `py.allow_threads(f)`, safe at exit (see the module's doc).
pub fn without_gil<T: Send, F: Send + FnOnce() -> T>(py: Python<'_>, f: F) -> T {
    py.allow_threads(move || {
        let out = f();
        park_if_exiting();
        out
    })
}

/// Parks this thread for good if the interpreter is exiting and it is not the main thread (which runs
/// the finalization itself, and takes the GIL safely).
fn park_if_exiting() {
    // SAFETY: getpid takes no arguments and cannot fail.
    let main = tierstore_core::sys::gettid() == unsafe { libc::getpid() };
    if EXITING.load(Ordering::Acquire) && !main {
        log::debug!("a thread came back from the engine while the interpreter exits: it waits for the end");
        loop {
            std::thread::park();
        }
    }
}
