//! Write-back staging (docs/design/architecture.md, "Write-back staging"): files written under a `[[writeback]]`
//! destination land on a node-local stage, are recorded in an fsynced journal when the program closes
//! them, and reach the shared store in the background, in the order they were closed and renamed.
//!
//! This module is the writers' side (the Python API and the LD_PRELOAD shim): [`Writeback::begin`] gives
//! a staged file to write, [`Writeback::commit`] journals it at close, [`Writeback::lookup`] answers
//! reads of a file not yet migrated (and [`Writeback::peer_copy`] reads of one another node staged, see
//! [`peers`]), [`Writeback::wait`] waits until files are on the store. The agent
//! migrates ([`migrate::step`]); the journal ([`journal`]) is the only thing the two share, so a writer
//! never waits for the agent unless it asked for remote durability, and either can be killed at any time.

pub mod closes;
pub mod config;
pub mod entry;
pub mod journal;
pub mod migrate;
pub mod peers;

use std::os::unix::fs::OpenOptionsExt;
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
        source: crate::cluster::transfer::RemoteError,
    },
    /// The path is under no destination this configuration names: nothing can be said of it.
    #[error(
        "{} is under no [[writeback]] destination of this configuration ({configured}){staged}: tierstore cannot \
         tell whether it is on the shared store; run this with the job's configuration (its TIERSTORE_CONFIG \
         or tierstore.toml)",
        path.display()
    )]
    Unconfigured {
        /// What was asked about.
        path: PathBuf,
        /// The destinations this configuration names, or "it names none".
        configured: String,
        /// Where a stage of this node serves it, as the agent's stages list says (", but ..."), or "".
        staged: String,
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

/// The file, beside the agent's socket (in the user's private runtime directory), where writers list
/// the stages they use, one line per destination: `STAGE<TAB>DESTINATION`. An agent migrates those too,
/// also when it was started with another configuration, and each stage's files only to beneath the
/// destinations listed (or configured) with it.
pub fn stages_file() -> PathBuf {
    crate::cluster::default_socket().with_file_name("writeback-stages")
}

/// A path a stages-file line may carry: absolute, with no `..` or `.` component (lexically normal), and
/// no tab or newline (which separate the fields and the lines).
fn plain_absolute(p: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    use std::path::Component;
    p.is_absolute()
        && p.components().all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
        && !p.as_os_str().as_bytes().iter().any(|b| *b == b'\t' || *b == b'\n')
}

/// The (stage, destination) pairs in the text of a stages file; a line that is not one (a stage listed
/// alone by an older tierstore, a relative path, `..`, the root as destination) is an error naming it.
pub fn parse_stages(text: &[u8]) -> Vec<Result<(PathBuf, PathBuf), String>> {
    use std::os::unix::ffi::OsStrExt;
    text.split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|line| {
            let shown = String::from_utf8_lossy(line);
            let mut fields = line.splitn(2, |b| *b == b'\t');
            let stage = Path::new(std::ffi::OsStr::from_bytes(fields.next().unwrap_or_default()));
            let Some(dest) = fields.next().map(|d| Path::new(std::ffi::OsStr::from_bytes(d))) else {
                return Err(format!(
                    "the line {shown:?} names a stage without its destination (written by an older tierstore): \
                     it is not migrated until a writer lists it again"
                ));
            };
            if !plain_absolute(stage) || !plain_absolute(dest) || dest == Path::new("/") {
                return Err(format!(
                    "the line {shown:?} is not STAGE<TAB>DESTINATION with two absolute paths (no `..`, and not \
                     / as destination): it is ignored"
                ));
            }
            Ok((stage.to_path_buf(), dest.to_path_buf()))
        })
        .collect()
}

/// Opens `path` for reading and appending (creating it 0600), never through a symbolic link, and checks
/// that it is a file of this user's that nobody else can write (narrowing one others can read to 0600).
fn open_stages_file(path: &Path, create: bool) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let f = crate::private::open_nofollow(path, true, create)?;
    let meta = f.metadata()?;
    if !meta.is_file() || meta.uid() != crate::private::euid() || meta.mode() & 0o022 != 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "{} is not a file of yours only you can write (uid {}, mode {:04o}): it is not used; remove it",
                path.display(),
                meta.uid(),
                meta.mode() & 0o7777
            ),
        ));
    }
    if meta.mode() & 0o077 != 0 {
        f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    }
    Ok(f)
}

/// The (stage, destination) pairs listed in [`stages_file`], each checked as [`parse_stages`] does; a file
/// that is not this user's own (or a link) is one error, and lists nothing.
pub fn listed_stages() -> Vec<Result<(PathBuf, PathBuf), String>> {
    listed_stages_in(&stages_file())
}

/// The (stage, destination) pairs listed in the stages file `path` (see [`listed_stages`]).
pub fn listed_stages_in(path: &Path) -> Vec<Result<(PathBuf, PathBuf), String>> {
    use std::io::Read;
    let mut text = Vec::new();
    match open_stages_file(path, false).and_then(|mut f| f.read_to_end(&mut text)) {
        Ok(_) => parse_stages(&text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => vec![Err(format!("the list of stages {}: {e}", path.display()))],
    }
}

/// Lists `stage` with the destination `dest` it serves in the stages file `file` ([`stages_file`]) once,
/// so that the agent migrates it: written in the user's private runtime directory (checked, see
/// `private`), 0600, never through a link.
fn list_stage(file: &Path, stage: &Path, dest: &Path) {
    if !plain_absolute(stage) || !plain_absolute(dest) {
        log::warn!(
            "the stage {} of {} cannot be listed for the agent (a tab or newline in a path): an agent started \
             without this configuration does not migrate it",
            stage.display(),
            dest.display()
        );
        return;
    }
    if listed_stages_in(file).iter().any(|l| matches!(l, Ok((s, d)) if s == stage && d == dest)) {
        return;
    }
    let listed = file
        .parent()
        .map_or(Ok(()), |dir| crate::private::ensure_dir(dir).map(drop))
        .and_then(|()| open_stages_file(file, true))
        .and_then(|mut f| {
            use std::io::Write;
            use std::os::unix::ffi::OsStrExt;
            // One short append: lines of concurrent writers do not interleave.
            let mut line = stage.as_os_str().as_bytes().to_vec();
            line.push(b'\t');
            line.extend_from_slice(dest.as_os_str().as_bytes());
            line.push(b'\n');
            f.write_all(&line)
        });
    if let Err(e) = listed {
        log::warn!(
            "cannot list the stage {} for the agent in {}: {e}; an agent started without this configuration does \
             not migrate it",
            stage.display(),
            file.display()
        );
    }
}

/// Whether an agent accepts connections on this user's socket (within a second: one whose queue stays
/// full that long does not count).
pub fn agent_answers() -> bool {
    crate::cluster::dial::dial_local(&crate::cluster::default_socket(), Duration::from_secs(1)).is_ok()
}

/// The writers' side of write-back staging in one process.
pub struct Writeback {
    dests: Vec<Destination>,
    journals: Mutex<Vec<(PathBuf, Arc<Journal>)>>,
    /// The destinations this process listed for the agent, and where (see [`stages_file`]).
    listed: Mutex<Vec<PathBuf>>,
    stages_file: PathBuf,
    /// The other nodes' agents, for files they staged (read from the configuration on first need).
    peers: OnceLock<Option<peers::PeerReads>>,
}

impl Writeback {
    /// Write-back for these destinations.
    pub fn new(dests: Vec<Destination>) -> Writeback {
        Writeback {
            dests,
            journals: Mutex::new(Vec::new()),
            listed: Mutex::new(Vec::new()),
            stages_file: stages_file(),
            peers: OnceLock::new(),
        }
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
        match self.destination(dest) {
            // The destination is a directory: no file is written in its place.
            Some(d) if d.path == dest => Err(WritebackError::Io {
                what: "is the write-back destination itself, a directory:",
                path: dest.to_path_buf(),
                source: std::io::Error::from_raw_os_error(libc::EISDIR),
            }),
            Some(d) => Ok(d),
            None => Err(WritebackError::Io {
                what: "not under a write-back destination:",
                path: dest.to_path_buf(),
                source: std::io::Error::from_raw_os_error(libc::EINVAL),
            }),
        }
    }

    /// The journal of `d`'s stage (opened once per process), with the stage listed for the agent as the
    /// stage of `d` (once per destination and process).
    pub fn journal(&self, d: &Destination) -> Result<Arc<Journal>, WritebackError> {
        let j = {
            let mut g = self.journals.lock().unwrap_or_else(|p| p.into_inner());
            match g.iter().find(|(s, _)| *s == d.stage) {
                Some((_, j)) => j.clone(),
                None => {
                    let j = Arc::new(Journal::open(&d.stage)?);
                    g.push((d.stage.clone(), j.clone()));
                    j
                }
            }
        };
        let mut listed = self.listed.lock().unwrap_or_else(|p| p.into_inner());
        if !listed.contains(&d.path) {
            list_stage(&self.stages_file, &d.stage, &d.path);
            listed.push(d.path.clone());
        }
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
            // A new name (never one a link planted on the store points from): the store's usual mode.
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&temp)
                .map_err(|source| WritebackError::Io {
                    what: "cannot create the file written through to the store",
                    path: temp.clone(),
                    source,
                })?;
            return Ok(Begin::WriteThrough { temp });
        }
        let name = journal::new_staged_name();
        let path = j.staged_path(&name);
        // 0600, a new name, never through a link (the stage is private besides: see `private`).
        crate::private::create_new(&path).map_err(|source| WritebackError::Io {
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
    /// hashed and recorded. With `buffered` durability the record is appended to the log of buffered
    /// closes and nothing waits for the disk ([`closes`]); otherwise the bytes are fsynced and the entry
    /// committed, and with remote durability the close also waits until the agent put the file on the
    /// store. A file that cannot be journaled (the stage's disk filled up under the fsync, say) is
    /// removed at once: its close fails, nothing was acknowledged, and its space is the next file's.
    pub fn commit(&self, dest: &Path, name: &str) -> Result<(), WritebackError> {
        let d = self.destination_of(dest)?;
        let j = self.journal(d)?;
        let path = j.staged_path(name);
        let io = |what: &'static str| {
            let path = path.clone();
            move |source| WritebackError::Io { what, path, source }
        };
        let journaled = if d.durability == Durability::Buffered {
            // As a local disk's close: the bytes and the record stay in the page cache for the kernel to
            // write back, and nothing waits for the disk or hashes the bytes. The fold (the agent's, once
            // the program pauses its closes) hashes them, in this boot of the node, so that bytes a later
            // crash of the node tears are known (see `migrate`).
            std::fs::symlink_metadata(&path)
                .map_err(io("cannot read the staged file"))
                .and_then(|m| Ok(j.close_buffered(dest, name, m.len(), None)?))
        } else {
            // The fsync waits for the disk and the hash for the CPU: both at once, the close costs the
            // longer.
            let (synced, hashed) = std::thread::scope(|s| {
                let sync = s.spawn(|| std::fs::File::open(&path).and_then(|f| f.sync_all()));
                let hashed = crate::hash::hash_file_now(&path);
                (sync.join().unwrap_or_else(|_| Err(std::io::Error::other("the fsync thread panicked"))), hashed)
            });
            synced
                .map_err(io("cannot fsync the staged file"))
                .and_then(|()| hashed.map_err(io("cannot read the staged file")))
                .and_then(|(size, hash)| Ok(j.commit(dest, name, size, hash).map(|_| ())?))
        };
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

    /// Refuses to answer for `under` (or, with `None`, for this node's stages) where this configuration
    /// names no destination that covers it: a shell without the job's configuration must not be told
    /// that files staged under another destination are on the store.
    fn check_configured(&self, under: Option<&Path>) -> Result<(), WritebackError> {
        let covers = |dest: &Path| under.is_none_or(|u| u.starts_with(dest) || dest.starts_with(u));
        if self.dests.iter().any(|d| covers(&d.path)) {
            return Ok(());
        }
        let listed: Vec<(PathBuf, PathBuf)> = listed_stages().into_iter().flatten().collect();
        let theirs = listed.iter().find(|(_, dest)| covers(dest));
        if under.is_none() && theirs.is_none() {
            return Ok(()); // nothing configured, nothing staged on this node: nothing to wait for
        }
        let configured = if self.dests.is_empty() {
            "it names none".to_string()
        } else {
            self.dests.iter().map(|d| d.path.display().to_string()).collect::<Vec<_>>().join(", ")
        };
        let staged = theirs.map_or(String::new(), |(stage, dest)| {
            format!(", but this node stages files for {} in {}", dest.display(), stage.display())
        });
        let path = under.map_or_else(|| PathBuf::from("(every destination)"), Path::to_path_buf);
        Err(WritebackError::Unconfigured { path, configured, staged })
    }

    /// `tierstore sync`: [`Writeback::wait`], once this configuration is known to cover `under` (or, with
    /// `None`, this node's stages); an error says why it cannot answer otherwise, where `wait` would find
    /// nothing pending and return at once.
    pub fn sync(&self, under: Option<&Path>, timeout: Duration) -> Result<(), WritebackError> {
        self.check_configured(under)?;
        self.wait(under, timeout)
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
    }

    /// A destination with its stage configured under `root`, as `validate` makes it.
    fn destination(root: &Path) -> Destination {
        let (dest, stage) = (root.join("store"), root.join("stage"));
        std::fs::create_dir(&dest).unwrap();
        let text = format!("[[writeback]]\npath = {:?}\nstage = {:?}\nquota = \"1G\"", dest.display(), stage.display());
        let t: toml::Table = text.parse().unwrap();
        let v = (t["writeback"].clone(), crate::config::values::Origin::Default);
        config::validate(Some(&v)).unwrap().remove(0)
    }

    fn writeback(root: &Path, d: Destination) -> Writeback {
        let mut wb = Writeback::new(vec![d]);
        wb.stages_file = root.join("run/tierstore/writeback-stages");
        wb
    }

    #[test]
    fn the_stage_its_directories_and_files_are_private() {
        let t = tempfile::tempdir().unwrap();
        let d = destination(t.path());
        let wb = writeback(t.path(), d.clone());
        let Begin::Staged { name, path } = wb.begin(&d.path.join("ckpt.bin")).unwrap() else { panic!("not staged") };
        std::fs::write(&path, b"secret weights").unwrap();
        wb.commit(&d.path.join("ckpt.bin"), &name).unwrap();
        assert_eq!(d.stage, t.path().join("stage").join(crate::private::euid().to_string()));
        for dir in [d.stage.clone(), d.stage.join("journal"), d.stage.join("data")] {
            assert_eq!(mode(&dir), 0o700, "{}", dir.display());
        }
        assert_eq!(mode(&path), 0o600, "the staged file");
        for f in ["data.mdb", "lock.mdb", crate::lmdb::WRITER_LOCK] {
            assert_eq!(mode(&d.stage.join("journal").join(f)), 0o600, "the journal's {f}");
        }
        let (staged, _) = wb.lookup(&d.path.join("ckpt.bin")).unwrap();
        assert_eq!(std::fs::read(staged).unwrap(), b"secret weights");
    }

    #[test]
    fn a_close_is_buffered_by_default_and_fsynced_with_local_durability() {
        let t = tempfile::tempdir().unwrap();
        let d = destination(t.path());
        assert_eq!(d.durability, Durability::Buffered, "the default, as a local disk's close");
        let local = Destination { durability: Durability::Local, ..d.clone() };
        for (d, unflushed) in [(d, crate::process::boot_id()), (local, None)] {
            let wb = writeback(t.path(), d.clone());
            let dest = d.path.join(format!("{}.pt", d.durability.name()));
            let Begin::Staged { name, path } = wb.begin(&dest).unwrap() else { panic!("not staged") };
            std::fs::write(&path, b"weights").unwrap();
            wb.commit(&dest, &name).unwrap();
            let (_, e) = wb.lookup(&dest).unwrap();
            assert_eq!(e.unflushed_in, unflushed, "{}", d.durability.name());
            // Hashed at close when fsynced, by the fold (which reading the journal's order does) when
            // buffered.
            let e = wb.journal(&d).unwrap().entries().unwrap().into_iter().find(|e| e.dest == dest).unwrap();
            assert_eq!(e.hash, *blake3::hash(b"weights").as_bytes(), "{}", d.durability.name());
        }
    }

    #[test]
    fn writers_list_each_stage_with_its_destination_in_a_private_file() {
        let t = tempfile::tempdir().unwrap();
        let d = destination(t.path());
        let wb = writeback(t.path(), d.clone());
        wb.journal(&d).unwrap();
        wb.journal(&d).unwrap();
        let file = t.path().join("run/tierstore/writeback-stages");
        // Another process of the same configuration lists nothing twice.
        list_stage(&file, &d.stage, &d.path);
        let text = std::fs::read(&file).unwrap();
        assert_eq!(text, format!("{}\t{}\n", d.stage.display(), d.path.display()).into_bytes());
        assert_eq!(mode(&file), 0o600);
        assert_eq!(mode(file.parent().unwrap()), 0o700);
        assert_eq!(
            listed_stages_in(&file).into_iter().map(Result::unwrap).collect::<Vec<_>>(),
            [(d.stage.clone(), d.path.clone())]
        );
    }

    #[test]
    fn a_stages_file_through_a_link_or_of_another_user_lists_nothing() {
        let t = tempfile::tempdir().unwrap();
        let target = t.path().join("notes.txt");
        std::fs::write(&target, b"keep").unwrap();
        let file = t.path().join("writeback-stages");
        std::os::unix::fs::symlink(&target, &file).unwrap();
        list_stage(&file, Path::new("/stage/0"), Path::new("/store"));
        assert_eq!(std::fs::read(&target).unwrap(), b"keep", "a link is never written through");
        let listed = listed_stages_in(&file);
        assert!(matches!(&listed[..], [Err(e)] if e.contains("symbolic link")), "{listed:?}");
        std::fs::remove_file(&file).unwrap();
        std::fs::write(&file, b"/stage/0\t/store\n").unwrap();
        if crate::private::euid() == 0 {
            std::os::unix::fs::chown(&file, Some(65534), None).unwrap();
            let listed = listed_stages_in(&file);
            assert!(matches!(&listed[..], [Err(e)] if e.contains("uid 65534")), "{listed:?}");
        }
    }

    #[test]
    fn stage_lines_need_a_destination_and_plain_absolute_paths() {
        let parsed = parse_stages(b"/s/0\t/store\n/old-stage\n/s/0\t/\nrel\t/store\n/s/0\t/store/../home\n\n");
        assert_eq!(parsed[0], Ok((PathBuf::from("/s/0"), PathBuf::from("/store"))));
        assert!(parsed[1].as_ref().unwrap_err().contains("without its destination"));
        assert!(parsed[2..].iter().all(Result::is_err), "{parsed:?}");
        assert_eq!(parsed.len(), 5);
    }
}
