//! The two ends of every copy a cache makes: the source it reads and the tiers it writes (with their
//! lookup), its settings, and where its faults are counted. Every step of the read path below the engine
//! (`peers.rs`, `fetch.rs`) and the engine itself stand on it; it calls nothing above it. What it does is
//! what each of them needs of either end: a reader of a copy or of the source, a file opened and
//! identified, a descriptor holding a source file's bytes, a fault counted, an error that names the file.

use std::fs::File;
use std::io;
use std::sync::Arc;

use super::faults::Faults;
use super::lookup::{Found, Look, Lookup};
use crate::clock::now_ns;
use crate::config::{Config, Revalidate};
use crate::error::Error;
use crate::index::{Entry, Key, SourceId};
use crate::reader::{Backing, Reader};
use crate::source::{PosixSource, Source, SourceFile};

/// The source, the tiers and the settings of one cache (see the module).
pub(super) struct Storage {
    config: Config,
    source: Arc<dyn Source>,
    lookup: Lookup,
    faults: Arc<Faults>,
}

impl Storage {
    pub(super) fn new(config: Config, source: Arc<dyn Source>, lookup: Lookup, faults: Arc<Faults>) -> Storage {
        Storage { config, source, lookup, faults }
    }

    /// The effective configuration.
    pub(super) fn config(&self) -> &Config {
        &self.config
    }

    /// The source.
    pub(super) fn source(&self) -> &Arc<dyn Source> {
        &self.source
    }

    /// The tiers and their published copies.
    pub(super) fn lookup(&self) -> &Lookup {
        &self.lookup
    }

    /// The source as a POSIX directory, for what only a file system has (descriptors for programs,
    /// directory walks, symlinks); `None` for an object store.
    pub(super) fn posix(&self) -> Option<&PosixSource> {
        self.source.posix()
    }

    /// The error `e` of an operation on the source's file `rel`, naming its full path.
    pub(super) fn error(&self, rel: &str, e: io::Error) -> Error {
        Error::io(&self.source.path_of(rel), e)
    }

    /// Counts a cache fault in tier `tier` and says so once (see `faults.rs`).
    pub(super) fn fault(&self, tier: Option<usize>, kind: &str, detail: &str) {
        self.faults.count(tier.map(|i| &*self.lookup.tiers()[i]), kind, detail);
    }

    /// A warning said once per `kind` and process.
    pub(super) fn log_once(&self, kind: &str, message: &str) {
        self.faults.log_once(kind, message);
    }

    /// Whether the copy `e` may be served now without asking the source (see [`Storage::trusts`]).
    pub(super) fn trusted_now(&self, e: &Entry) -> bool {
        self.trusts(e.confirmed_ns)
    }

    /// Whether what the source showed at `at_ns` may answer now without asking it again: always when the
    /// dataset is trusted (`revalidate = "never"`), within the duration with one, never with `"always"`.
    pub(super) fn trusts(&self, at_ns: u64) -> bool {
        match self.config.revalidate {
            Revalidate::Never => true,
            Revalidate::Within(d) => crate::clock::within(at_ns, d, now_ns()),
            Revalidate::Always => false,
        }
    }

    /// A reader of `size` bytes of `rel` from `backing`, which goes on from the source if the backing fails.
    pub(super) fn reader(&self, backing: Backing, size: u64, rel: &str) -> Reader {
        Reader::new(backing, size, rel.into(), self.source.clone())
    }

    /// A reader of a valid published copy of version `sid` of `key`, if a tier has one.
    pub(super) fn hit(&self, key: &Key, rel: &str, sid: &SourceId, look: Look) -> Option<Reader> {
        let backing = self.lookup.hit(key, rel, sid, look)?;
        Some(self.reader(backing, sid.size, rel))
    }

    /// [`Storage::hit`] for the entry just found published (see [`Lookup::hit_found`]).
    pub(super) fn hit_found(&self, found: &Found, key: &Key, rel: &str, sid: &SourceId, look: Look) -> Option<Reader> {
        let backing = self.lookup.hit_found(found, key, rel, sid, look)?;
        Some(self.reader(backing, sid.size, rel))
    }

    /// Opens a source file and identifies it from the open descriptor (one open, and the attributes the
    /// open fetched).
    pub(super) fn open_identified(&self, rel: &str) -> Result<(SourceId, SourceFile), Error> {
        let f = self.source.open(rel).map_err(|e| self.error(rel, e))?;
        let (sid, is_dir) = self.source.identify_opened(&f, rel).map_err(|e| self.error(rel, e))?;
        if is_dir {
            return Err(self.error(rel, io::Error::from_raw_os_error(libc::EISDIR)));
        }
        Ok((sid, f))
    }

    /// The source's current version of `rel`, asked with one `stat` or `HEAD`.
    pub(super) fn identify(&self, rel: &str) -> Result<SourceId, Error> {
        self.source.identify(rel).map_err(|e| self.error(rel, e))
    }

    /// A reader of the source itself (through `pre` when the source is already open).
    pub(super) fn direct(&self, rel: &str, sid: SourceId, pre: &mut Option<SourceFile>) -> Result<Reader, Error> {
        let f = match pre.take() {
            Some(f) => f,
            None => self.source.open(rel).map_err(|e| self.error(rel, e))?,
        };
        Ok(self.reader(Backing::Source(f), sid.size, rel))
    }

    /// A descriptor holding a source file's bytes for a program: the file's own on a POSIX source (`pre`
    /// when already open); for an object store, which has no descriptors, its bytes in a memory file.
    pub(super) fn source_descriptor(&self, rel: &str, pre: Option<SourceFile>) -> Result<File, Error> {
        if self.posix().is_some() {
            let f = match pre {
                Some(f) => f,
                None => self.source.open(rel).map_err(|e| self.error(rel, e))?,
            };
            return f.into_file().ok_or_else(|| self.error(rel, no_descriptor()));
        }
        let (bytes, _) = self.source.read_whole(rel, 0, pre).map_err(|e| self.error(rel, e))?;
        let file = memory_file(rel).map_err(|e| self.error(rel, e))?;
        use std::os::unix::fs::FileExt;
        file.write_all_at(&bytes, 0).map_err(|e| self.error(rel, e))?;
        Ok(file)
    }

    /// The error a waiter on a flight gets when the leader's source request failed (see
    /// [`fail_flight`](super::fetch::fail_flight)).
    pub(super) fn flight_failed(&self, rel: &str, kind: io::ErrorKind, message: &str) -> Error {
        self.error(rel, io::Error::new(kind, message.to_string()))
    }
}

/// The error of asking a descriptor of a source that has none (an object store).
pub(super) fn no_descriptor() -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        "an object store has no file descriptors; read it through tierstore.open",
    )
}

/// An anonymous file in memory, read-only once written is up to its user (a program gets a descriptor).
pub(super) fn memory_file(rel: &str) -> io::Result<File> {
    use std::os::fd::FromRawFd;
    let name = std::ffi::CString::new(format!("tierstore:{}", rel.rsplit('/').next().unwrap_or(rel)))
        .unwrap_or_else(|_| c"tierstore".to_owned());
    // SAFETY: memfd_create takes a NUL-terminated name and flags; a valid descriptor is owned by the File.
    let fd = unsafe { crate::sys::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    Ok(unsafe { File::from_raw_fd(fd) })
}
