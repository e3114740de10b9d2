//! A process's background confirmation of due directories (`confirm.rs`): the right to run a sweep (one
//! at a time in each process), and the keeper that renews due confirmations while the process reads,
//! so that a job that pauses for up to the duration comes back to confirmed copies. A forked child,
//! which inherits the flags but not the threads, starts its own. Kept apart so that the engine holds
//! this state without importing the confirmation, which works on the engine.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// The background confirmation of one process.
#[derive(Default)]
pub(super) struct Sweep {
    /// The process whose sweep runs now (0: none).
    running: AtomicU32,
    /// The process whose keeper runs now (0: none).
    keeper: AtomicU32,
    /// When this process last served a copy trusted for a duration (ns since the epoch): the keeper
    /// renews confirmations until a duration has passed since.
    last_use_ns: AtomicU64,
    /// Wakes the keeper as soon as the cache is dropped, rather than at its next period.
    bell: Arc<Bell>,
}

impl Sweep {
    /// Takes the right to sweep; false when this process's sweep is already running.
    pub(super) fn start(&self) -> bool {
        take(&self.running)
    }

    /// Gives the right back.
    pub(super) fn done(&self) {
        self.running.store(0, Ordering::Release);
    }

    /// Notes that this process served a copy at `now_ns`; true when its keeper is not running (the
    /// caller starts one). Two atomic operations: this is on every warm open.
    pub(super) fn used(&self, now_ns: u64) -> bool {
        self.last_use_ns.store(now_ns, Ordering::Relaxed);
        self.keeper.load(Ordering::Relaxed) != crate::process::pid()
    }

    /// When this process last served a copy trusted for a duration (0: never).
    pub(super) fn last_use_ns(&self) -> u64 {
        self.last_use_ns.load(Ordering::Relaxed)
    }

    /// Takes the right to keep confirmations renewed; false when this process's keeper already runs.
    pub(super) fn start_keeper(&self) -> bool {
        take(&self.keeper)
    }

    /// The keeper stops.
    pub(super) fn keeper_done(&self) {
        self.keeper.store(0, Ordering::Release);
    }

    /// What the keeper sleeps on between its rounds.
    pub(super) fn bell(&self) -> Arc<Bell> {
        self.bell.clone()
    }
}

impl Drop for Sweep {
    fn drop(&mut self) {
        self.bell.ring();
    }
}

/// Takes `flag` for this process: false when this process holds it already. A value a forked child
/// inherited names its parent, whose thread the child does not have, so the child takes it over.
fn take(flag: &AtomicU32) -> bool {
    let me = crate::process::pid();
    let now = flag.load(Ordering::Acquire);
    now != me && flag.compare_exchange(now, me, Ordering::AcqRel, Ordering::Acquire).is_ok()
}

/// A sleep that ends early once the cache it serves is dropped.
#[derive(Default)]
pub(super) struct Bell {
    rung: Mutex<bool>,
    wake: Condvar,
}

impl Bell {
    /// Sleeps for `period`; false when the bell rang (the cache is gone) before or during it.
    pub(super) fn sleep(&self, period: Duration) -> bool {
        let rung = self.rung.lock().unwrap_or_else(|p| p.into_inner());
        let (rung, _) = self.wake.wait_timeout_while(rung, period, |rung| !*rung).unwrap_or_else(|p| p.into_inner());
        !*rung
    }

    fn ring(&self) {
        *self.rung.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.wake.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_keeper_is_started_once_and_a_dropped_cache_wakes_it() {
        let s = Sweep::default();
        assert!(s.used(5), "no keeper yet: start one");
        assert!(s.start_keeper());
        assert!(!s.start_keeper(), "one keeper per process");
        assert!(!s.used(7));
        assert_eq!(s.last_use_ns(), 7);
        s.keeper_done();
        assert!(s.used(9));
        let bell = s.bell();
        assert!(bell.sleep(Duration::from_millis(1)), "not rung: the full period");
        let start = std::time::Instant::now();
        let sleeper = std::thread::spawn(move || bell.sleep(Duration::from_secs(60)));
        std::thread::sleep(Duration::from_millis(20));
        drop(s);
        assert!(!sleeper.join().unwrap(), "rung by the drop");
        assert!(start.elapsed() < Duration::from_secs(30));
    }
}
