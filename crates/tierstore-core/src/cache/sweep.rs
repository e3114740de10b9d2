//! A process's right to run the background confirmation of expired directories (`confirm.rs`): one sweep
//! at a time in each process, and a forked child, which inherits the flag but not the thread, starts its
//! own. Kept apart so that the engine holds it without importing the confirmation, which works on the
//! engine.

use std::sync::atomic::{AtomicU32, Ordering};

/// The background confirmation of one process: at most one sweep at a time.
#[derive(Default)]
pub(super) struct Sweep {
    /// The process whose sweep runs now (0: none). A forked child, which inherits the value but not the
    /// thread, starts its own.
    running: AtomicU32,
}

impl Sweep {
    /// Takes the right to sweep; false when this process's sweep is already running.
    pub(super) fn start(&self) -> bool {
        let me = crate::process::pid();
        let now = self.running.load(Ordering::Acquire);
        now != me && self.running.compare_exchange(now, me, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// Gives the right back.
    pub(super) fn done(&self) {
        self.running.store(0, Ordering::Release);
    }
}
