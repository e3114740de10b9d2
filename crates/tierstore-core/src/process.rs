//! The process: its id, read without a system call, and forgotten by a forked child.
//!
//! Everything that belongs to one process (an LMDB environment, a copy pool, a temporary file's name)
//! compares this id with the one it was made under, so that a forked child (a DataLoader worker) never
//! uses what its parent opened.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Once;

static PID: AtomicU32 = AtomicU32::new(0);

extern "C" fn forget_pid() {
    PID.store(0, Ordering::Relaxed);
}

/// The current process id, without a system call on the hot path (glibc no longer caches `getpid`). A
/// fork handler clears the cached value in the child, which then reads its own.
pub fn pid() -> u32 {
    static HANDLER: Once = Once::new();
    HANDLER.call_once(|| {
        // SAFETY: registers a handler that only stores to an atomic, which is async-signal-safe.
        unsafe { libc::pthread_atfork(None, None, Some(forget_pid)) };
    });
    match PID.load(Ordering::Relaxed) {
        0 => {
            let pid = std::process::id();
            PID.store(pid, Ordering::Relaxed);
            pid
        }
        pid => pid,
    }
}
