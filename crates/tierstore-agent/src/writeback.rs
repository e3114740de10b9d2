//! The agent's half of write-back staging: it migrates the staged files of every stage it knows to the
//! shared store, oldest first, for as long as it runs (see `tierstore_core::writeback`).
//!
//! The stages are those of the agent's configuration and those writers listed in
//! `tierstore_core::writeback::stages_file` (a writer may run with a configuration the agent was not
//! started with). Migration runs on its own thread with blocking file I/O: a slow store stalls only it,
//! never the agent's connections. A store that fails is retried with capped exponential back-off and
//! jitter, per stage; the data stays staged and journaled meanwhile. After a crash, a new agent finds
//! the same journals and goes on where the old one stopped (the step it was in is redone).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tierstore_core::writeback::{journal::Journal, listed_stages, migrate, Entry};

/// The first retry comes this long after a failure; each further failure doubles it.
pub const BACKOFF_FIRST: Duration = Duration::from_millis(100);
/// Retries are never further apart than this, so a store that comes back is used again within it.
pub const BACKOFF_CAP: Duration = Duration::from_secs(2);
/// How often an idle loop looks at the journals.
const POLL: Duration = Duration::from_millis(20);
/// How often the list of stages is read again.
const RESCAN: Duration = Duration::from_secs(1);
/// Migration waits until the program has closed no file for this long (a checkpoint's files are written
/// in a burst: copying them meanwhile would take the CPU and the store's attention from the burst)...
pub const QUIET: Duration = Duration::from_millis(150);
/// ...or until the oldest pending file is this old (a program that never pauses still gets its files
/// migrated).
pub const MAX_HOLD: Duration = Duration::from_secs(2);
/// How often the staged files of writers killed before their close are removed (also at start).
const SWEEP: Duration = Duration::from_secs(30);

/// What the migration loop has done, for the agent's status and its idle exit.
#[derive(Default)]
pub struct Migrations {
    /// Whether any journal had files pending at the last look: an agent started on demand stays up.
    pub pending: AtomicBool,
    /// Files migrated since start.
    pub files: AtomicU64,
    /// Bytes migrated since start.
    pub bytes: AtomicU64,
    /// Failed attempts since start.
    pub failures: AtomicU64,
    /// The journals being migrated: the agent also serves their pending files to other nodes (LMDB
    /// allows one handle per environment and process, so the server shares the loop's).
    journals: Mutex<Vec<Arc<Journal>>>,
}

impl Migrations {
    /// Migrations that serve these journals (and migrate nothing): for tests of the serving side.
    #[cfg(test)]
    pub(crate) fn serving(journals: Vec<Arc<Journal>>) -> Migrations {
        Migrations { journals: Mutex::new(journals), ..Default::default() }
    }

    /// The pending entry for `path` in any stage this agent migrates, with its staged copy opened. The
    /// copy is opened after the entry was read: a file migrated or rewritten in between is gone from the
    /// stage (looked up again, a few times), and an open copy keeps its bytes even when its entry goes
    /// meanwhile (the sender checks them against the entry's blake3 before vouching for them).
    pub fn staged(&self, path: &std::path::Path) -> Option<(Entry, std::fs::File)> {
        let journals = self.journals.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for j in journals {
            for _ in 0..3 {
                let Ok(Some(e)) = j.lookup(path) else { break };
                match std::fs::File::open(j.staged_path(&e.staged)) {
                    Ok(f) => return Some((e, f)),
                    Err(err) if err.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(err) => {
                        log::warn!("cannot open the staged copy of {}: {err}", path.display());
                        break;
                    }
                }
            }
        }
        None
    }
}

/// The delay before retry number `failures` (1 for the first): doubled per failure from
/// [`BACKOFF_FIRST`], capped at [`BACKOFF_CAP`], then a random half of it shaved off (jitter, so that the
/// agents of many nodes do not retry a recovering store in lockstep).
pub fn backoff(failures: u32) -> Duration {
    let full = BACKOFF_FIRST.saturating_mul(1u32 << failures.saturating_sub(1).min(16)).min(BACKOFF_CAP);
    let mut r = [0u8; 2];
    // SAFETY: getrandom writes at most `r.len()` bytes into the buffer.
    unsafe { libc::getrandom(r.as_mut_ptr() as *mut libc::c_void, r.len(), 0) };
    let jitter = u16::from_ne_bytes(r) as f64 / u16::MAX as f64;
    full.mul_f64(0.5 + 0.5 * jitter)
}

struct Stage {
    journal: Arc<Journal>,
    swept: Instant,
    failures: u32,
    retry_at: Option<Instant>,
    /// Whether the current failure streak was logged.
    logged: bool,
}

/// Starts the migration loop for `stages` (from the agent's configuration) and those listed by writers.
pub fn start(stages: Vec<PathBuf>) -> Arc<Migrations> {
    let m = Arc::new(Migrations::default());
    let shared = m.clone();
    let spawned = std::thread::Builder::new().name("tierstore-writeback".into()).spawn(move || run(stages, shared));
    if let Err(e) = spawned {
        log::error!("cannot start the write-back migration thread: {e}");
    }
    m
}

fn run(configured: Vec<PathBuf>, m: Arc<Migrations>) {
    let mut stages: BTreeMap<PathBuf, Stage> = BTreeMap::new();
    let mut scanned: Option<Instant> = None;
    let mut failed_open: std::collections::BTreeSet<PathBuf> = Default::default();
    loop {
        if scanned.is_none_or(|t| t.elapsed() >= RESCAN) {
            scanned = Some(Instant::now());
            for dir in configured.iter().cloned().chain(listed_stages()) {
                if stages.contains_key(&dir) || !dir.join("journal").exists() && !configured.contains(&dir) {
                    continue;
                }
                match Journal::open(&dir) {
                    Ok(journal) => {
                        match journal.sweep_orphans() {
                            Ok(0) => {}
                            Ok(n) => {
                                log::info!("stage {}: removed {n} staged file(s) no program finished", dir.display())
                            }
                            Err(e) => log::warn!("stage {}: {e}", dir.display()),
                        }
                        let pending = journal.entries().map(|e| e.len()).unwrap_or(0);
                        log::info!("migrating the stage {} ({pending} file(s) pending)", dir.display());
                        failed_open.remove(&dir);
                        let journal = Arc::new(journal);
                        m.journals.lock().unwrap_or_else(|p| p.into_inner()).push(journal.clone());
                        stages.insert(
                            dir,
                            Stage { journal, swept: Instant::now(), failures: 0, retry_at: None, logged: false },
                        );
                    }
                    Err(e) => {
                        if failed_open.insert(dir.clone()) {
                            log::warn!("cannot open the stage {}: {e}", dir.display());
                        }
                    }
                }
            }
        }
        let mut worked = false;
        let mut pending = false;
        for (dir, s) in stages.iter_mut() {
            if s.swept.elapsed() >= SWEEP {
                s.swept = Instant::now();
                if let Ok(n @ 1..) = s.journal.sweep_orphans() {
                    log::info!("stage {}: removed {n} staged file(s) no program finished", dir.display());
                }
            }
            if s.retry_at.is_some_and(|t| Instant::now() < t) {
                pending = true;
                continue;
            }
            if held(&s.journal) {
                pending = true;
                continue;
            }
            match migrate::step(&s.journal) {
                Ok(migrate::Step::Idle) => {}
                Ok(migrate::Step::Migrated(e)) => {
                    worked = true;
                    m.files.fetch_add(1, Ordering::Relaxed);
                    m.bytes.fetch_add(e.size, Ordering::Relaxed);
                    if s.failures > 0 {
                        log::info!("stage {}: the store answers again after {} failure(s)", dir.display(), s.failures);
                    }
                    s.failures = 0;
                    s.retry_at = None;
                    s.logged = false;
                }
                Ok(migrate::Step::Superseded) => worked = true,
                Ok(migrate::Step::Failed(_, msg)) => {
                    m.failures.fetch_add(1, Ordering::Relaxed);
                    s.failures += 1;
                    let wait = backoff(s.failures);
                    s.retry_at = Some(Instant::now() + wait);
                    if !s.logged {
                        log::warn!(
                            "stage {}: {msg}; retrying with back-off (at most {BACKOFF_CAP:?} apart)",
                            dir.display()
                        );
                        s.logged = true;
                    }
                }
                Err(e) => {
                    m.failures.fetch_add(1, Ordering::Relaxed);
                    s.failures += 1;
                    s.retry_at = Some(Instant::now() + backoff(s.failures));
                    if !s.logged {
                        log::warn!("stage {}: {e}", dir.display());
                        s.logged = true;
                    }
                }
            }
            pending |= s.journal.first().map(|e| e.is_some()).unwrap_or(true);
        }
        m.pending.store(pending, Ordering::Release);
        if !worked {
            std::thread::sleep(POLL);
        }
    }
}

/// Whether the oldest pending file waits for the program to pause (see [`QUIET`], [`MAX_HOLD`]).
fn held(j: &Journal) -> bool {
    let now = tierstore_core::writeback::journal::now_ns();
    let since = |ns: u64| Duration::from_nanos(now.saturating_sub(ns));
    let busy = j.last_change_ns().map(|t| since(t) < QUIET).unwrap_or(false);
    busy && j.first().ok().flatten().is_some_and(|e| since(e.created_ns) < MAX_HOLD)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_cap_with_jitter() {
        for n in 1..30 {
            let d = backoff(n);
            let full = BACKOFF_FIRST.saturating_mul(1 << (n - 1).min(16)).min(BACKOFF_CAP);
            assert!(d >= full / 2 && d <= full, "retry {n}: {d:?} outside [{:?}, {full:?}]", full / 2);
        }
        assert!(backoff(30) <= BACKOFF_CAP);
        let spread: std::collections::BTreeSet<_> = (0..20).map(|_| backoff(5)).collect();
        assert!(spread.len() > 1, "jitter makes retries differ");
    }
}
