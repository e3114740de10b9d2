//! The agent's half of write-back staging: it migrates the staged files of every stage it knows to the
//! shared store, oldest first, for as long as it runs (see `tierstore_core::writeback`).
//!
//! The stages are those of the agent's configuration and those writers listed in
//! `tierstore_core::writeback::stages_file` (a writer may run with a configuration the agent was not
//! started with), each with the destinations it serves: the configured ones, and those listed with it.
//! The agent migrates only what a configuration names: a stage that is not the user's own (checked with
//! `private::ensure_dir`) is refused, and an entry whose destination is not beneath its stage's
//! destinations is never written; both are logged and counted ([`Migrations::refused_stages`],
//! [`Migrations::refused_entries`]), and the entry stays in its journal, untouched.
//!
//! Migration runs on its own thread with blocking file I/O: a slow store stalls only it, never the
//! agent's connections. A store that fails is retried with capped exponential back-off and jitter, per
//! stage; the data stays staged and journaled meanwhile. After a crash, a new agent finds the same
//! journals and goes on where the old one stopped (the step it was in is redone).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tierstore_core::private;
use tierstore_core::writeback::{journal::Journal, listed_stages_in, migrate, Entry};

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
/// A buffered close reaches the fsynced journal this long after it returned, at most, while this agent
/// runs (the bound the write-back guide states); sooner once the program has closed nothing for
/// [`QUIET`], so that a checkpoint's closes are folded in one commit after its burst, not one by one.
pub const FOLD_WITHIN: Duration = Duration::from_secs(1);
/// The migration thread's nice value: while the job writes its next checkpoint (or computes on the CPU),
/// its threads come first; a core the job leaves idle still migrates at full speed.
pub const MIGRATION_NICE: libc::c_int = 10;
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
    /// Journal entries refused since start (each once): their destination is not beneath a destination
    /// their stage was configured or listed with. They stay in the journal and are never written.
    pub refused_entries: AtomicU64,
    /// Stages refused since start (each once): not the user's own directory (see `private`).
    pub refused_stages: AtomicU64,
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
                if e.seq == 0 {
                    // A close still in the log of closes (it has no place, nor maybe a hash, yet): the fold
                    // gives it both, and the copy is vouched for by the journal's hash.
                    if let Err(err) = j.fold() {
                        log::warn!("the staged copy of {} cannot be looked up: {err}", path.display());
                        break;
                    }
                    continue;
                }
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
    unsafe { tierstore_core::sys::getrandom(r.as_mut_ptr() as *mut libc::c_void, r.len(), 0) };
    let jitter = u16::from_ne_bytes(r) as f64 / u16::MAX as f64;
    full.mul_f64(0.5 + 0.5 * jitter)
}

struct Stage {
    journal: Arc<Journal>,
    /// The destinations its entries may go to (the configured and the listed ones).
    roots: Vec<PathBuf>,
    /// The entries refused and reported (by sequence number): each is logged and counted once.
    refused: BTreeSet<u64>,
    swept: Instant,
    failures: u32,
    retry_at: Option<Instant>,
    /// Whether the current failure streak was logged.
    logged: bool,
}

/// Starts the migration loop for `configured`, the (stage, destination) pairs of the agent's
/// configuration, and for those writers list.
pub fn start(configured: Vec<(PathBuf, PathBuf)>) -> Arc<Migrations> {
    start_listed_in(configured, tierstore_core::writeback::stages_file())
}

/// [`start`], with the writers' list of stages read from `stages_file`.
fn start_listed_in(configured: Vec<(PathBuf, PathBuf)>, stages_file: PathBuf) -> Arc<Migrations> {
    let m = Arc::new(Migrations::default());
    let shared = m.clone();
    let spawned = std::thread::Builder::new()
        .name("tierstore-writeback".into())
        .spawn(move || run(configured, &stages_file, shared));
    if let Err(e) = spawned {
        log::error!("cannot start the write-back migration thread: {e}");
    }
    m
}

/// The stages this agent knows and what it knows of them, kept between rescans.
#[derive(Default)]
struct Stages {
    open: BTreeMap<PathBuf, Stage>,
    /// Stages that could not be opened or were refused: each is logged once (until it opens).
    failed: BTreeSet<PathBuf>,
    /// Lines of the stages file that were ignored, each logged once.
    bad_lines: BTreeSet<String>,
}

impl Stages {
    /// Opens the stages of `wanted` (stage, destination, configured) not yet open, after checking that
    /// each is the user's own, and adds to open ones the destinations listed with them.
    fn scan(&mut self, wanted: Vec<(PathBuf, PathBuf, bool)>, m: &Migrations) {
        for (dir, dest, configured) in wanted {
            if let Some(s) = self.open.get_mut(&dir) {
                if !s.roots.contains(&dest) {
                    log::info!("stage {}: migrating to {} too", dir.display(), dest.display());
                    s.roots.push(dest);
                }
                continue;
            }
            // A listed stage without a journal has nothing to migrate (yet): nothing is created for it.
            if !configured && !dir.join("journal").exists() {
                continue;
            }
            if let Some(stage) = self.open_stage(&dir, dest, m) {
                self.failed.remove(&dir);
                self.open.insert(dir, stage);
            }
        }
        for (dir, s) in self.open.iter_mut() {
            // Reading the entries folds the log of closes: not in the middle of a checkpoint's burst.
            if !s.journal.closes_settling(QUIET, FOLD_WITHIN) {
                report_refused(dir, s, m);
            }
        }
    }

    /// The stage in `dir` (migrated to `dest`), opened after checking that it is a directory of the user's
    /// own, its orphans swept; None when it cannot be (logged once per stage until it can).
    fn open_stage(&mut self, dir: &Path, dest: PathBuf, m: &Migrations) -> Option<Stage> {
        if let Err(e) = private::ensure_dir(dir) {
            if self.failed.insert(dir.to_path_buf()) {
                if e.kind() == std::io::ErrorKind::PermissionDenied {
                    m.refused_stages.fetch_add(1, Ordering::Relaxed);
                    log::warn!(
                        "refusing to migrate the stage {} (for {}): it is not a directory of yours only you can \
                         write, so its journal could name any file: {e}",
                        dir.display(),
                        dest.display()
                    );
                } else {
                    log::warn!("cannot open the stage {}: {e}", dir.display());
                }
            }
            return None;
        }
        let journal = match Journal::open(dir) {
            Ok(journal) => journal,
            Err(e) => {
                if self.failed.insert(dir.to_path_buf()) {
                    log::warn!("cannot open the stage {}: {e}", dir.display());
                }
                return None;
            }
        };
        match journal.sweep_orphans() {
            Ok(0) => {}
            Ok(n) => log::info!("stage {}: removed {n} staged file(s) no program finished", dir.display()),
            Err(e) => log::warn!("stage {}: {e}", dir.display()),
        }
        let pending = journal.entries().map(|e| e.len()).unwrap_or(0);
        log::info!("migrating the stage {} to {} ({pending} file(s) pending)", dir.display(), dest.display());
        let journal = Arc::new(journal);
        m.journals.lock().unwrap_or_else(|p| p.into_inner()).push(journal.clone());
        Some(Stage {
            journal,
            roots: vec![dest],
            refused: BTreeSet::new(),
            swept: Instant::now(),
            failures: 0,
            retry_at: None,
            logged: false,
        })
    }
}

/// Logs and counts, once each, the entries of `s` whose destination is not beneath its destinations.
fn report_refused(dir: &Path, s: &mut Stage, m: &Migrations) {
    let refused = match migrate::refused(&s.journal, &s.roots) {
        Ok(r) => r,
        Err(e) => {
            log::warn!("stage {}: {e}", dir.display());
            return;
        }
    };
    // Entries gone from the journal (removed by their writer) are forgotten.
    s.refused.retain(|seq| refused.iter().any(|e| e.seq == *seq));
    for e in refused {
        if s.refused.insert(e.seq) {
            m.refused_entries.fetch_add(1, Ordering::Relaxed);
            let roots: Vec<String> = s.roots.iter().map(|r| r.display().to_string()).collect();
            log::warn!(
                "stage {}: refusing to migrate the staged file {} to {}: not beneath the stage's destinations ({}); \
                 it is not written, and stays in the stage's journal",
                dir.display(),
                e.staged,
                e.dest.display(),
                roots.join(", ")
            );
        }
    }
}

/// Lowers the calling thread's priority to [`MIGRATION_NICE`] (a thread's own nice value on Linux).
fn yield_to_the_job() {
    let tid = tierstore_core::sys::gettid() as libc::id_t;
    // SAFETY: setpriority of this thread alone; it only lowers the priority, which needs no privilege.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, MIGRATION_NICE) } != 0 {
        log::debug!("cannot lower the migration thread's priority: {}", std::io::Error::last_os_error());
    }
}

fn run(configured: Vec<(PathBuf, PathBuf)>, stages_file: &Path, m: Arc<Migrations>) {
    yield_to_the_job();
    let mut stages = Stages::default();
    let mut scanned: Option<Instant> = None;
    loop {
        if scanned.is_none_or(|t| t.elapsed() >= RESCAN) {
            scanned = Some(Instant::now());
            rescan(&configured, stages_file, &mut stages, &m);
        }
        let (mut worked, mut pending) = (false, false);
        for (dir, s) in stages.open.iter_mut() {
            let (w, p) = tend(dir, s, &m);
            worked |= w;
            pending |= p;
        }
        m.pending.store(pending, Ordering::Release);
        if !worked {
            std::thread::sleep(POLL);
        }
    }
}

/// Opens the stages of the configuration and of the writers' list (`stages_file`) not open yet, closes
/// those gone; a bad line of the list is logged once.
fn rescan(configured: &[(PathBuf, PathBuf)], stages_file: &Path, stages: &mut Stages, m: &Migrations) {
    let mut wanted: Vec<(PathBuf, PathBuf, bool)> =
        configured.iter().map(|(s, d)| (s.clone(), d.clone(), true)).collect();
    for line in listed_stages_in(stages_file) {
        match line {
            Ok((s, d)) => wanted.push((s, d, false)),
            Err(e) => {
                if stages.bad_lines.insert(e.clone()) {
                    log::warn!("{}: {e}", stages_file.display());
                }
            }
        }
    }
    stages.scan(wanted, m);
}

/// One look at the stage in `dir`: sweeps its orphans now and then, folds its log of closes into the
/// journal once the program paused its closes, and migrates its oldest file unless it is held or backing
/// off. Returns (whether a file was migrated or let go, whether any file is still pending).
fn tend(dir: &Path, s: &mut Stage, m: &Migrations) -> (bool, bool) {
    if s.swept.elapsed() >= SWEEP {
        s.swept = Instant::now();
        if let Ok(n @ 1..) = s.journal.sweep_orphans() {
            log::info!("stage {}: removed {n} staged file(s) no program finished", dir.display());
        }
    }
    // The log of buffered closes is folded into the journal (an fsync) once the program paused its
    // closes, or its oldest nears the bound; every look at the journal below folds it too, so none is
    // taken while the program is still closing a checkpoint's files.
    let settling = s.journal.closes_settling(QUIET, FOLD_WITHIN - POLL);
    if !settling {
        if let Err(e) = s.journal.fold() {
            s.warn_once(dir, &e.to_string());
        }
    }
    if settling || s.retry_at.is_some_and(|t| Instant::now() < t) || held(&s.journal, &s.roots) {
        return (false, true);
    }
    let worked = match migrate::step(&s.journal, &s.roots) {
        Ok(migrate::Step::Idle) => false,
        Ok(migrate::Step::Migrated(e)) => {
            m.files.fetch_add(1, Ordering::Relaxed);
            m.bytes.fetch_add(e.size, Ordering::Relaxed);
            if s.failures > 0 {
                log::info!("stage {}: the store answers again after {} failure(s)", dir.display(), s.failures);
            }
            s.failures = 0;
            s.retry_at = None;
            s.logged = false;
            true
        }
        Ok(migrate::Step::Superseded) => true,
        Ok(migrate::Step::Torn(_, msg)) => {
            m.failures.fetch_add(1, Ordering::Relaxed);
            log::error!("stage {}: {msg}", dir.display());
            true
        }
        Ok(migrate::Step::Failed(_, msg)) => {
            s.back_off(m);
            s.warn_once(dir, &format!("{msg}; retrying with back-off (at most {BACKOFF_CAP:?} apart)"));
            false
        }
        Err(e) => {
            s.back_off(m);
            s.warn_once(dir, &e.to_string());
            false
        }
    };
    // Refused entries are not pending: nothing will migrate them, and they keep no agent up.
    let roots = &s.roots;
    let pending = s.journal.first_where(|e| migrate::beneath(&e.dest, roots)).map(|e| e.is_some()).unwrap_or(true);
    (worked, pending)
}

impl Stage {
    /// A failed migration: counted, and the next try waits longer.
    fn back_off(&mut self, m: &Migrations) {
        m.failures.fetch_add(1, Ordering::Relaxed);
        self.failures += 1;
        self.retry_at = Some(Instant::now() + backoff(self.failures));
    }

    /// Logs a problem of the stage in `dir` once, until a migration succeeds again.
    fn warn_once(&mut self, dir: &Path, message: &str) {
        if !self.logged {
            log::warn!("stage {}: {message}", dir.display());
            self.logged = true;
        }
    }
}

/// Whether the oldest pending file (of those migrated to `roots`) waits for the program to pause (see
/// [`QUIET`], [`MAX_HOLD`]).
fn held(j: &Journal, roots: &[PathBuf]) -> bool {
    let now = tierstore_core::clock::now_ns();
    let since = |ns: u64| Duration::from_nanos(now.saturating_sub(ns));
    let busy = j.last_change_ns().map(|t| since(t) < QUIET).unwrap_or(false);
    busy && j
        .first_where(|e| migrate::beneath(&e.dest, roots))
        .ok()
        .flatten()
        .is_some_and(|e| since(e.created_ns) < MAX_HOLD)
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::os::unix::fs::MetadataExt;
    use tierstore_core::writeback::journal::new_staged_name;

    fn commit(j: &Journal, dest: &Path, bytes: &[u8]) {
        let s = new_staged_name();
        std::fs::write(j.staged_path(&s), bytes).unwrap();
        let (size, hash) = tierstore_core::hash::hash_file(&j.staged_path(&s)).unwrap();
        j.commit(dest, &s, size, hash).unwrap();
    }

    fn wait_for(what: &str, ok: impl Fn() -> bool) {
        let start = Instant::now();
        while !ok() {
            assert!(start.elapsed() < Duration::from_secs(20), "timed out waiting until {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The nice value of this process's thread named `name`, from `/proc/self/task/*/stat`.
    fn nice_of_thread(name: &str) -> Option<i64> {
        std::fs::read_dir("/proc/self/task").ok()?.flatten().find_map(|task| {
            let comm = std::fs::read_to_string(task.path().join("comm")).ok()?;
            if !name.starts_with(comm.trim_end()) {
                return None;
            }
            let stat = std::fs::read_to_string(task.path().join("stat")).ok()?;
            // After the command's closing parenthesis: state is field 3, nice field 19.
            stat.rsplit_once(')')?.1.split_whitespace().nth(16)?.parse().ok()
        })
    }

    #[test]
    fn migration_runs_at_a_lower_priority_than_the_job() {
        let t = tempfile::tempdir().unwrap();
        let _m = start_listed_in(Vec::new(), t.path().join("writeback-stages"));
        // The kernel keeps 15 bytes of a thread's name: "tierstore-write".
        wait_for("the migration thread lowered its priority", || {
            nice_of_thread("tierstore-writeback") == Some(MIGRATION_NICE.into())
        });
    }

    #[test]
    fn the_agent_migrates_only_beneath_the_destinations_of_its_own_stages() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path();
        let (store, other_store, victim) = (root.join("store"), root.join("other"), root.join("victim"));
        for d in [&store, &other_store] {
            std::fs::create_dir(d).unwrap();
        }
        std::fs::write(&victim, b"the user's own").unwrap();
        // A configured stage whose journal also names a file outside its destination.
        let mine = root.join("stage/0");
        let j = Journal::open(&mine).unwrap();
        commit(&j, &victim, b"planted");
        commit(&j, &store.join("ok.bin"), b"weights");
        // A listed stage of another user's (uid 65534), with an entry inside the listed destination.
        let theirs = root.join("theirs/0");
        let jt = Journal::open(&theirs).unwrap();
        commit(&jt, &other_store.join("planted.bin"), b"planted");
        drop(jt);
        let as_root = tierstore_core::private::euid() == 0;
        if as_root {
            std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
        }
        // A listed stage of this user's, for a destination its configuration does not name.
        let listed = root.join("listed/0");
        let jl = Journal::open(&listed).unwrap();
        commit(&jl, &other_store.join("listed.bin"), b"listed");
        drop(jl);
        drop(j);
        let file = root.join("run/writeback-stages");
        std::fs::create_dir(file.parent().unwrap()).unwrap();
        let lines = format!(
            "{}\t{}\n{}\t{}\n{}\n",
            theirs.display(),
            other_store.display(),
            listed.display(),
            other_store.display(),
            root.join("old-format").display()
        );
        std::fs::write(&file, lines).unwrap();
        let m = start_listed_in(vec![(mine.clone(), store.clone())], file);
        wait_for("the good files are migrated", || {
            store.join("ok.bin").exists() && other_store.join("listed.bin").exists()
        });
        wait_for("the refused entry is counted", || m.refused_entries.load(Ordering::Relaxed) == 1);
        assert_eq!(std::fs::read(&victim).unwrap(), b"the user's own", "the target is untouched");
        assert_eq!(std::fs::read(store.join("ok.bin")).unwrap(), b"weights");
        if as_root {
            assert_eq!(m.refused_stages.load(Ordering::Relaxed), 1);
            assert!(!other_store.join("planted.bin").exists(), "another user's stage is never migrated");
            assert_eq!(std::fs::metadata(&theirs).unwrap().uid(), 65534);
        }
        // The refused entry stays in the journal with its staged bytes; nothing keeps the agent busy.
        std::thread::sleep(RESCAN + Duration::from_millis(200));
        assert_eq!(m.refused_entries.load(Ordering::Relaxed), 1, "each refused entry is counted once");
        wait_for("nothing is pending", || !m.pending.load(Ordering::Acquire));
        let journals = m.journals.lock().unwrap().clone();
        let j = journals.iter().find(|j| j.data_dir().starts_with(&mine)).unwrap();
        let left = j.entries().unwrap();
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].dest, victim);
        assert!(j.staged_path(&left[0].staged).exists());
    }

    #[test]
    fn buffered_closes_reach_the_journal_within_the_bound_while_the_program_never_pauses() {
        let t = tempfile::tempdir().unwrap();
        let (stage, store) = (t.path().join("stage/0"), t.path().join("store"));
        std::fs::create_dir(&store).unwrap();
        let j = Journal::open(&stage).unwrap();
        let log = stage.join("journal").join(tierstore_core::writeback::closes::LOG);
        let _m = start_listed_in(vec![(stage.clone(), store.clone())], t.path().join("writeback-stages"));
        // A close every 50 ms for 3 s: the program never pauses for QUIET, so only the bound folds.
        let mut oldest_seen = Duration::ZERO;
        let mut names = Vec::new();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(3) {
            let name = new_staged_name();
            std::fs::write(j.staged_path(&name), name.as_bytes()).unwrap();
            // Unhashed, as the shim closes it: the fold hashes it.
            j.close_buffered(&store.join(format!("{:03}", names.len())), &name, name.len() as u64, None).unwrap();
            names.push(name);
            let now = tierstore_core::clock::now_ns();
            let waiting = tierstore_core::writeback::closes::parse(&std::fs::read(&log).unwrap());
            if let Some(first) = waiting.first() {
                oldest_seen = oldest_seen.max(Duration::from_nanos(now.saturating_sub(first.entry.created_ns)));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(
            oldest_seen < FOLD_WITHIN + Duration::from_millis(500),
            "a buffered close waited {oldest_seen:?} in the log (bound {FOLD_WITHIN:?})"
        );
        wait_for("every file is on the store", || store.join(format!("{:03}", names.len() - 1)).exists());
        for (i, name) in names.iter().enumerate() {
            assert_eq!(std::fs::read(store.join(format!("{i:03}"))).unwrap(), name.as_bytes());
        }
    }

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
