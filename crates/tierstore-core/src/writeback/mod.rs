//! Write-back staging (ARCHITECTURE.md, "Write-back staging"): files written under a `[[writeback]]`
//! destination land on a node-local stage, are recorded in an fsynced journal when the program closes
//! them, and reach the shared store in the background, in the order they were closed and renamed.
//!
//! This module is the writers' side (the Python API and the LD_PRELOAD shim): [`Writeback::begin`] gives
//! a staged file to write, [`Writeback::commit`] journals it at close, [`Writeback::lookup`] answers
//! reads of a file not yet migrated (and [`Writeback::peer_copy`] reads of one another node staged, see
//! [`peers`]), [`Writeback::wait`] waits until files are on the store. The agent
//! migrates ([`migrate::step`]); the journal ([`journal`]) is the only thing the two share, so a writer
//! never waits for the agent unless it asked for remote durability, and either can be killed at any time.

pub mod config;
pub mod journal;
pub mod migrate;
pub mod peers;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

pub use config::{Destination, Durability};
pub use journal::{Entry, Journal, JournalError, Pending};

use crate::config::values::ConfigError;

/// Why a write-back operation failed.
#[derive(Debug, thiserror::Error)]
pub enum WritebackError {
    /// The `[[writeback]]` configuration is invalid.
    #[error(transparent)]
    Config(Box<ConfigError>),
    /// The journal failed.
    #[error(transparent)]
    Journal(#[from] JournalError),
    /// A staged file could not be written or read.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// Files did not reach the store in time.
    #[error(
        "{files} file(s), {bytes} bytes under {} are not on the shared store after {waited:.0} s{errors}; they \
         stay staged and journaled on this node and migrate once the store answers: see `tierstore status`",
        path.display()
    )]
    Timeout {
        /// What was waited for.
        path: PathBuf,
        /// Files still pending.
        files: u64,
        /// Their bytes.
        bytes: u64,
        /// Seconds waited.
        waited: f64,
        /// The last migration errors, formatted.
        errors: String,
    },
    /// Another node holds the file staged (newer than the store's copy, if any) but its bytes could not
    /// be had; the store is not read instead, as it would give an older file or none.
    #[error(
        "{} is staged on another node and not yet on the shared store, and reading it from there failed: \
         {source}; retry, or wait until that node has migrated it (`tierstore sync` there)",
        path.display()
    )]
    Peer {
        /// The file.
        path: PathBuf,
        /// Why the transfer failed.
        source: crate::cluster::remote::RemoteError,
    },
    /// Files are pending but no agent runs to migrate them.
    #[error(
        "{files} file(s) under {} wait for migration but no agent answers on {}: start it with `tierstore agent \
         start` (the staged files are safe in the journal and migrate once it runs)",
        path.display(),
        socket.display()
    )]
    NoAgent {
        /// What was waited for.
        path: PathBuf,
        /// Files pending.
        files: u64,
        /// The agent's socket.
        socket: PathBuf,
    },
}

impl From<ConfigError> for WritebackError {
    fn from(e: ConfigError) -> Self {
        WritebackError::Config(Box::new(e))
    }
}

impl WritebackError {
    /// The `errno` to give a program whose call failed for this reason.
    pub fn errno(&self) -> i32 {
        match self {
            WritebackError::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            WritebackError::Journal(j) => j.errno(),
            _ => libc::EIO,
        }
    }
}

/// What a write under a destination goes to.
#[derive(Debug)]
pub enum Begin {
    /// A new staged file (created, empty): write it, then [`Writeback::commit`] it at close.
    Staged {
        /// Its name in the journal.
        name: String,
        /// Its path.
        path: PathBuf,
    },
    /// The stage is full: write to the store directly (every earlier file of the directory is on the
    /// store already, so the order holds), under `temp`, a hidden name beside the destination, which
    /// [`Writeback::finish_through`] renames into place at close: no reader of the store ever sees part
    /// of the file under its name.
    WriteThrough {
        /// The temporary name (created, empty).
        temp: PathBuf,
    },
}

/// Bytes a stage keeps free on its file system at least, whatever its quota says: 64 MiB, or an eighth
/// of the file system when that is smaller (a small tmpfs stage).
pub const STAGE_RESERVE: u64 = 64 << 20;

/// What a stage of `total` bytes keeps free (see [`STAGE_RESERVE`]).
pub fn stage_reserve(total: u64) -> u64 {
    STAGE_RESERVE.min(total / 8)
}

/// The hidden name a file written through to `dest` is written under until it is whole:
/// `.NAME.tierstore-through-PID-N`, unique in the process.
fn through_name(dest: &Path) -> PathBuf {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = dest.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    dest.with_file_name(format!(".{name}.tierstore-through-{}-{n}", crate::process::pid()))
}

/// The file, beside the agent's socket, where writers list the stages they use: an agent migrates
/// those too, also when it was started with another configuration.
pub fn stages_file() -> PathBuf {
    crate::cluster::default_socket().with_file_name("writeback-stages")
}

/// The stages listed in [`stages_file`].
pub fn listed_stages() -> Vec<PathBuf> {
    std::fs::read_to_string(stages_file()).map(|t| t.lines().map(PathBuf::from).collect()).unwrap_or_default()
}

fn list_stage(stage: &Path) {
    if listed_stages().iter().any(|s| s == stage) {
        return;
    }
    let file = stages_file();
    if let Some(d) = file.parent() {
        use std::os::unix::fs::DirBuilderExt;
        let _ = std::fs::DirBuilder::new().recursive(true).mode(0o700).create(d);
    }
    // One short append: lines of concurrent writers do not interleave.
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(&file) {
        use std::io::Write;
        let _ = f.write_all(format!("{}\n", stage.display()).as_bytes());
    }
}

/// Whether an agent accepts connections on this user's socket.
pub fn agent_answers() -> bool {
    std::os::unix::net::UnixStream::connect(crate::cluster::default_socket()).is_ok()
}

/// The writers' side of write-back staging in one process.
pub struct Writeback {
    dests: Vec<Destination>,
    journals: Mutex<Vec<(PathBuf, Arc<Journal>)>>,
    /// The other nodes' agents, for files they staged (read from the configuration on first need).
    peers: OnceLock<Option<peers::PeerReads>>,
}

impl Writeback {
    /// Write-back for these destinations.
    pub fn new(dests: Vec<Destination>) -> Writeback {
        Writeback { dests, journals: Mutex::new(Vec::new()), peers: OnceLock::new() }
    }

    /// Write-back as the configuration (`tierstore.toml`, `$TIERSTORE_CONFIG`, `$TIERSTORE_WRITEBACK`)
    /// describes it; no source is needed.
    // Configuration errors are rare and carry everything the user needs to fix them (as in `config`).
    #[allow(clippy::result_large_err)]
    pub fn load() -> Result<Writeback, ConfigError> {
        Ok(Self::new(crate::config::load_writeback(&crate::config::Overrides::default())?))
    }

    /// The configured destinations.
    pub fn destinations(&self) -> &[Destination] {
        &self.dests
    }

    /// The destination holding `abs` (absolute, normalized), if any.
    pub fn destination(&self, abs: &Path) -> Option<&Destination> {
        self.dests.iter().find(|d| d.holds(abs))
    }

    /// The destination holding `dest`, or the error a write outside every destination is (EINVAL).
    fn destination_of(&self, dest: &Path) -> Result<&Destination, WritebackError> {
        self.destination(dest).ok_or_else(|| WritebackError::Io {
            what: "not under a write-back destination:",
            path: dest.to_path_buf(),
            source: std::io::Error::from_raw_os_error(libc::EINVAL),
        })
    }

    /// The journal of `d`'s stage (opened once per process, and listed for the agent).
    pub fn journal(&self, d: &Destination) -> Result<Arc<Journal>, WritebackError> {
        let mut g = self.journals.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, j)) = g.iter().find(|(s, _)| *s == d.stage) {
            return Ok(j.clone());
        }
        let j = Arc::new(Journal::open(&d.stage)?);
        list_stage(&d.stage);
        g.push((d.stage.clone(), j.clone()));
        Ok(j)
    }

    /// Leaks the journals: what a forked child does with the ones it inherited.
    pub fn forget(self) {
        let journals = std::mem::take(&mut *self.journals.lock().unwrap_or_else(|p| p.into_inner()));
        for (_, j) in journals {
            std::mem::forget(j);
        }
        std::mem::forget(self);
    }

    fn full(&self, d: &Destination, j: &Journal) -> Result<bool, WritebackError> {
        let staged = j.staged_bytes()?;
        let (free, reserve) =
            crate::config::values::fs_info(&d.stage).map(|f| (f.free, stage_reserve(f.total))).unwrap_or((u64::MAX, 0));
        Ok(staged >= d.quota || free < reserve)
    }

    /// Starts a write of `dest` (under a destination): a new staged file, or write-through when the stage
    /// is full (after the directory's earlier files reached the store, so that order holds).
    pub fn begin(&self, dest: &Path) -> Result<Begin, WritebackError> {
        let d = self.destination_of(dest)?;
        let j = self.journal(d)?;
        if self.full(d, &j)? {
            let dir = dest.parent().unwrap_or(&d.path);
            if let Err(e) = self.wait(Some(dir), d.timeout) {
                log::warn!(
                    "the stage {} is full and {e}; writing {} through anyway",
                    d.stage.display(),
                    dest.display()
                );
            }
            let temp = through_name(dest);
            std::fs::File::create(&temp).map_err(|source| WritebackError::Io {
                what: "cannot create the file written through to the store",
                path: temp.clone(),
                source,
            })?;
            return Ok(Begin::WriteThrough { temp });
        }
        let name = journal::new_staged_name();
        let path = j.staged_path(&name);
        std::fs::File::create(&path).map_err(|source| WritebackError::Io {
            what: "cannot create the staged file",
            path: path.clone(),
            source,
        })?;
        Ok(Begin::Staged { name, path })
    }

    /// Puts a file written through (see [`Begin::WriteThrough`]) into place once the program closed it:
    /// fsynced, then renamed over `dest`. On failure the temporary file is removed: the close fails, and
    /// the store keeps what `dest` held before.
    pub fn finish_through(&self, temp: &Path, dest: &Path) -> Result<(), WritebackError> {
        let placed = std::fs::File::open(temp)
            .and_then(|f| f.sync_all())
            .map_err(|source| WritebackError::Io { what: "cannot fsync", path: temp.to_path_buf(), source })
            .and_then(|()| {
                std::fs::rename(temp, dest).map_err(|source| WritebackError::Io {
                    what: "cannot rename into place",
                    path: temp.to_path_buf(),
                    source,
                })
            });
        if placed.is_err() {
            let _ = std::fs::remove_file(temp);
        }
        placed
    }

    /// Journals the staged file `name`, written for `dest`, once the program closed it: its bytes are
    /// fsynced, hashed and recorded (durable on the node); with remote durability, also waits until the
    /// agent put it on the store. A file that cannot be journaled (the stage's disk filled up under the
    /// fsync, say) is removed at once: its close fails, nothing was acknowledged, and its space is the
    /// next file's.
    pub fn commit(&self, dest: &Path, name: &str) -> Result<(), WritebackError> {
        let d = self.destination_of(dest)?;
        let j = self.journal(d)?;
        let path = j.staged_path(name);
        let io = |what: &'static str| {
            let path = path.clone();
            move |source| WritebackError::Io { what, path, source }
        };
        // The fsync waits for the disk and the hash for the CPU: both at once, the close costs the longer.
        let (synced, hashed) = std::thread::scope(|s| {
            let sync = s.spawn(|| std::fs::File::open(&path).and_then(|f| f.sync_all()));
            let hashed = crate::hash::hash_file(&path);
            (sync.join().unwrap_or_else(|_| Err(std::io::Error::other("the fsync thread panicked"))), hashed)
        });
        let journaled = synced
            .map_err(io("cannot fsync the staged file"))
            .and_then(|()| hashed.map_err(io("cannot read the staged file")))
            .and_then(|(size, hash)| Ok(j.commit(dest, name, size, hash)?));
        if let Err(e) = journaled {
            let _ = std::fs::remove_file(&path);
            return Err(e);
        }
        if d.durability == Durability::Remote {
            self.wait(Some(dest), d.timeout)?;
        }
        Ok(())
    }

    /// The staged copy of `abs` when it is not on the store yet (read-your-writes), with its entry.
    pub fn lookup(&self, abs: &Path) -> Option<(PathBuf, Entry)> {
        let d = self.destination(abs)?;
        let j = self.journal(d).ok()?;
        let e = j.lookup(abs).ok()??;
        Some((j.staged_path(&e.staged), e))
    }

    /// The newest staged copy of `abs` another node holds (written there, not yet on the store): its size
    /// and close time, which `stat` on this node reports. `None` when no other node holds it staged (or no
    /// `[cluster]` is configured): the store's `stat` is right.
    pub fn peer_stat(&self, abs: &Path) -> Option<peers::Held> {
        self.destination(abs)?;
        self.peers.get_or_init(peers::PeerReads::load).as_ref()?.stat(abs)
    }

    /// The staged copy of `abs` that another node holds (written there, not yet on the store), received
    /// whole and checked into a new file of this node's stage: the caller opens it, then deletes it.
    /// `Ok(None)` when no other node holds it staged (or no `[cluster]` is configured): read the store.
    pub fn peer_copy(&self, abs: &Path) -> Result<Option<PathBuf>, WritebackError> {
        let Some(d) = self.destination(abs) else { return Ok(None) };
        let Some(peers) = self.peers.get_or_init(peers::PeerReads::load) else { return Ok(None) };
        let into = peers::received_path(self.journal(d)?.data_dir());
        match peers.fetch(abs, &into) {
            Ok(Some(r)) => {
                log::debug!("{} ({} bytes) read from the stage of {}", abs.display(), r.size, r.from);
                Ok(Some(into))
            }
            Ok(None) => {
                let _ = std::fs::remove_file(&into);
                Ok(None)
            }
            Err(source) => {
                let _ = std::fs::remove_file(&into);
                Err(WritebackError::Peer { path: abs.to_path_buf(), source })
            }
        }
    }

    /// The files pending (journaled, not yet on the store) directly in the directory `dir` (absolute,
    /// normalized; a destination or a directory under one), with their staged copies: what a listing of
    /// `dir` adds to the store's.
    pub fn pending_in(&self, dir: &Path) -> Vec<(std::ffi::OsString, PathBuf)> {
        let Some(d) = self.dests.iter().find(|d| dir.starts_with(&d.path)) else { return Vec::new() };
        let Ok(j) = self.journal(d) else { return Vec::new() };
        let Ok(entries) = j.entries() else { return Vec::new() };
        entries
            .into_iter()
            .filter(|e| e.dest.parent() == Some(dir))
            .filter_map(|e| Some((e.dest.file_name()?.to_os_string(), j.staged_path(&e.staged))))
            .collect()
    }

    /// The program renamed `from` to `to`: a pending `from` moves in the journal (its bytes need not
    /// move). Returns whether it was pending; when it was not, the rename is the store's to do.
    pub fn rename(&self, from: &Path, to: &Path) -> Result<bool, WritebackError> {
        let (Some(df), Some(dt)) = (self.destination(from), self.destination(to)) else { return Ok(false) };
        if df.stage != dt.stage {
            return Ok(false);
        }
        Ok(self.journal(df)?.rename(from, to)?)
    }

    /// The program deleted `abs`: its pending entry (if any) and staged copy go.
    pub fn remove(&self, abs: &Path) -> Result<bool, WritebackError> {
        let Some(d) = self.destination(abs) else { return Ok(false) };
        Ok(self.journal(d)?.remove(abs)?)
    }

    /// The program truncated `abs`: a pending file is cut in the stage.
    pub fn truncate(&self, abs: &Path, len: u64) -> Result<bool, WritebackError> {
        let Some(d) = self.destination(abs) else { return Ok(false) };
        Ok(self.journal(d)?.truncate(abs, len)?)
    }

    /// What is pending at or under `under` (every destination when `None`), per destination.
    pub fn pending(&self, under: Option<&Path>) -> Result<Vec<(Destination, Pending)>, WritebackError> {
        let mut out = Vec::new();
        for d in &self.dests {
            let scope = match under {
                None => d.path.clone(),
                Some(u) if u.starts_with(&d.path) => u.to_path_buf(),
                Some(u) if d.path.starts_with(u) => d.path.clone(),
                Some(_) => continue,
            };
            out.push((d.clone(), self.journal(d)?.pending(&scope)?));
        }
        Ok(out)
    }

    /// Waits until nothing is pending at or under `under` (every destination when `None`): every file
    /// closed before the call is then fsynced and checked on the shared store. Fails after `timeout`, or
    /// after 5 s with no agent to migrate.
    pub fn wait(&self, under: Option<&Path>, timeout: Duration) -> Result<(), WritebackError> {
        let start = Instant::now();
        let mut no_agent_since: Option<Instant> = None;
        let mut last_probe: Option<Instant> = None;
        let mut pause = Duration::from_millis(2);
        let path = under.map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("(every destination)"));
        loop {
            let pending = self.pending(under)?;
            let files: u64 = pending.iter().map(|(_, p)| p.files).sum();
            if files == 0 {
                return Ok(());
            }
            if last_probe.is_none_or(|t| t.elapsed() >= Duration::from_millis(500)) {
                last_probe = Some(Instant::now());
                if agent_answers() {
                    no_agent_since = None;
                } else if no_agent_since.get_or_insert_with(Instant::now).elapsed() >= Duration::from_secs(5) {
                    return Err(WritebackError::NoAgent { path, files, socket: crate::cluster::default_socket() });
                }
            }
            if start.elapsed() >= timeout {
                let bytes = pending.iter().map(|(_, p)| p.bytes).sum();
                let errors: Vec<String> = pending
                    .iter()
                    .flat_map(|(_, p)| p.errors.iter())
                    .take(3)
                    .map(|(dest, n, e)| format!("{} ({n} attempts): {e}", dest.display()))
                    .collect();
                let errors =
                    if errors.is_empty() { String::new() } else { format!("; last errors: {}", errors.join("; ")) };
                return Err(WritebackError::Timeout {
                    path,
                    files,
                    bytes,
                    waited: start.elapsed().as_secs_f64(),
                    errors,
                });
            }
            std::thread::sleep(pause.min(timeout.saturating_sub(start.elapsed())).max(Duration::from_millis(1)));
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }
}
