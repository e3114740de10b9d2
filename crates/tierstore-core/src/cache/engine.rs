//! The engine behind a [`Cache`](super::Cache): the state that every handle, copy job and prefetch
//! worker of one cache shares ([`Inner`]), and its read path. A read finds the version of the file to
//! serve, asks the lookup for a current copy that a tier holds (`lookup.rs`: a hit, checked by size and
//! mtime, or by checksum), or joins the key's flight: it waits for the leader's bytes, or leads the fetch
//! itself (`fetch.rs`), after asking the owner's agent when nodes share (`peers.rs`). Any fault falls back
//! to the source, counted and said once (`faults.rs`).

use std::fs::File;
use std::io;
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};

use super::faults::Faults;
use super::flight::{Flight, Flights, Outcome, Role};
use super::job::{FetchJob, Purpose};
use super::link::PeerLink;
use super::lock::FetchLocks;
use super::lookup::{Look, Lookup};
use super::pool::Pool;
use crate::clock::now_ns;
use crate::config::{Config, Revalidate};
use crate::error::Error;
use crate::index::{key_of, Entry, Key, SourceId};
use crate::reader::{Backing, Growing, Reader};
use crate::source::{PosixSource, Source, SourceFile};

/// The state that every handle, copy job and prefetch worker of one cache shares.
pub(super) struct Inner {
    pub(super) config: Config,
    pub(super) source: Arc<dyn Source>,
    /// The tiers and their published copies.
    pub(super) lookup: Lookup,
    /// Where a cache fault is counted and said (shared with the lookup).
    pub(super) faults: Arc<Faults>,
    pub(super) locks: Arc<FetchLocks>,
    pub(super) flights: Flights,
    pub(super) pool: OnceLock<Weak<Pool>>,
    /// Prefetches whose workers are still running, for [`Cache::wait_idle`](super::Cache::wait_idle).
    pub(super) prefetches: Mutex<usize>,
    pub(super) prefetch_idle: Condvar,
    /// The process that opened the cache; a forked child must open its own.
    pub(super) pid: u32,
    /// Blocks of the files whose parts this node's agent serves (`blocks.rs`; empty in other processes).
    pub(super) blocks: super::blocks::Blocks,
    /// The line to the job's other members, when nodes share their caches (not in the agent's own cache).
    pub(super) link: Option<Arc<PeerLink>>,
    /// Whether copies record their blake3: asked for (`verify = "checksum"`), or needed to vouch for
    /// the bytes served to peers.
    pub(super) record_checksums: bool,
    /// This process's right to the background confirmation of expired directories (`confirm.rs`).
    pub(super) sweep: super::sweep::Sweep,
}

/// A file opened for a program that reads it with system calls (see [`Cache::open_native`](super::Cache::open_native)).
pub enum Native {
    /// A descriptor holding exactly the file's bytes: a published copy, or the source when no tier has
    /// room or the cache failed.
    Whole(File),
    /// A large file being copied into a tier: `source` is a descriptor of the source file itself, which
    /// the program may read natively; reads can be served from `copy` as it grows, and the descriptor
    /// moved to the copy once it is [`finished`](crate::reader::CopyState::Finished).
    Copying {
        /// The source file, open read-only.
        source: File,
        /// The copy being written.
        copy: Arc<Growing>,
    },
}

/// What a fetch under the lock produced.
pub(super) enum Fetched {
    Reader(Reader),
    /// A large file whose copy has started: a descriptor of the source for the program, and the copy.
    Streaming(File, Arc<Growing>),
    Cached,
    Uncached,
    /// A prefetch found no tier with room.
    NoRoom,
    /// Already cached, or being fetched by another thread or process.
    Skipped,
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

impl Inner {
    /// The source as a POSIX directory, for what only a file system has (descriptors for programs,
    /// directory walks, symlinks); `None` for an object store.
    pub(super) fn posix(&self) -> Option<&PosixSource> {
        self.source.posix()
    }

    pub(super) fn pid_matches(&self) -> bool {
        self.pid == crate::process::pid()
    }

    pub(super) fn prefetch_started(&self) {
        *self.prefetches.lock().unwrap_or_else(|p| p.into_inner()) += 1;
    }

    pub(super) fn prefetch_finished(&self) {
        let mut running = self.prefetches.lock().unwrap_or_else(|p| p.into_inner());
        *running = running.saturating_sub(1);
        if *running == 0 {
            self.prefetch_idle.notify_all();
        }
    }

    pub(super) fn pool(&self) -> Option<Arc<Pool>> {
        self.pool.get().and_then(Weak::upgrade)
    }

    /// Counts a cache fault in tier `tier` and says so once (see `faults.rs`).
    pub(super) fn fault(&self, tier: Option<usize>, kind: &str, detail: &str) {
        self.faults.count(tier.map(|i| &*self.lookup.tiers()[i]), kind, detail);
    }

    pub(super) fn log_once(&self, kind: &str, message: &str) {
        self.faults.log_once(kind, message);
    }

    /// The version of the source file to serve, when a tier holds a copy of it to check: see
    /// [`Inner::current_identity`]. `None` when no tier holds one: there is nothing to check, so the
    /// thread that leads the fetch opens the file under the node's fetch lock and identifies it from the
    /// open (`fstat`, or the `GET`'s own response). A miss costs the store that one open in every
    /// `revalidate` mode, and the threads and processes that wait for the fetch send the store nothing.
    pub(super) fn known_identity(self: &Arc<Self>, key: &Key, rel: &str) -> Result<Option<SourceId>, Error> {
        match self.lookup.published(key, rel) {
            Some(e) => self.current_identity(key, rel, &e).map(Some),
            None => Ok(None),
        }
    }

    /// The version of `rel` to serve when a tier holds the copy `e`: the copy's own when the dataset is
    /// trusted (`revalidate = "never"`) or the copy was confirmed recently enough (`"<duration>"`; else its
    /// directory is confirmed now, see `cache/confirm.rs`), or the source's current one, asked with one
    /// `stat` or `HEAD` (`"always"`).
    pub(super) fn current_identity(self: &Arc<Self>, key: &Key, rel: &str, e: &Entry) -> Result<SourceId, Error> {
        match self.config.revalidate {
            Revalidate::Never => Ok(e.source),
            Revalidate::Within(d) => self.confirmed_identity(key, rel, e, d),
            Revalidate::Always => self.source.identify(rel).map_err(|err| Error::io(&self.source.path_of(rel), err)),
        }
    }

    /// Opens a source file and identifies it from the open descriptor (one open, and the attributes the
    /// open fetched).
    pub(super) fn open_identified(&self, rel: &str) -> Result<(SourceId, SourceFile), Error> {
        let path = self.source.path_of(rel);
        let f = self.source.open(rel).map_err(|e| Error::io(&path, e))?;
        let (sid, is_dir) = self.source.identify_opened(&f, rel).map_err(|e| Error::io(&path, e))?;
        if is_dir {
            return Err(Error::io(&path, io::Error::from_raw_os_error(libc::EISDIR)));
        }
        Ok((sid, f))
    }

    pub(super) fn open_rel(self: &Arc<Self>, rel: &str) -> Result<Reader, Error> {
        let seen = now_ns();
        let key = key_of(rel);
        let mut known = self.known_identity(&key, rel)?;
        let mut pre = None;
        let mut look = Look::First;
        for _ in 0..3 {
            match known {
                Some(sid) => {
                    if let Some(r) = self.hit(&key, rel, &sid, look.take()) {
                        return Ok(r);
                    }
                }
                None => self.lookup.count_misses(look.take(), rel),
            }
            match self.flights.join(&key) {
                Role::Leader(lead) => {
                    let job = FetchJob { rel, purpose: Purpose::Read, seen, lead };
                    let fetched = match self.from_peer(job, &mut known) {
                        Ok(fetched) => fetched,
                        Err(job) => self.lead_flight(job, &mut known, &mut pre)?,
                    };
                    match fetched {
                        Fetched::Reader(r) => return Ok(r),
                        Fetched::Cached
                        | Fetched::Uncached
                        | Fetched::NoRoom
                        | Fetched::Skipped
                        | Fetched::Streaming(..) => {}
                    }
                }
                Role::Follower(flight) => match self.follow(&flight, rel, seen, &mut known)? {
                    // The flight fetched another version than this open confirmed: never its bytes.
                    ref other if other.of_another_version(known.as_ref()) => {}
                    Outcome::Bytes(b, _) => {
                        let size = b.len() as u64;
                        return Ok(Reader::new(Backing::Memory(b), size, rel.into(), self.source.clone()));
                    }
                    Outcome::Growing(g) => {
                        let size = g.size();
                        return Ok(Reader::new(Backing::Growing(g), size, rel.into(), self.source.clone()));
                    }
                    Outcome::Retry => {}
                    Outcome::Failed(kind, message) => return Err(self.flight_failed(rel, kind, &message)),
                },
            }
            if known.is_none() {
                known = self.known_identity(&key, rel)?;
            }
        }
        let sid = match known {
            Some(sid) => sid,
            None => {
                let (sid, f) = self.open_identified(rel)?;
                pre = Some(f);
                sid
            }
        };
        self.direct(rel, sid, &mut pre)
    }

    /// What another thread's flight of `rel` delivers to an open that began at `seen`. With `revalidate =
    /// "always"` every open asks the source: one that began after the flight had read the source (the
    /// flight lives on while its copy is published) asks it now, into `known`, as it would have asked
    /// of a published copy, and the caller takes the flight's bytes only if they are that version.
    fn follow(&self, flight: &Flight, rel: &str, seen: u64, known: &mut Option<SourceId>) -> Result<Outcome, Error> {
        let outcome = flight.wait();
        if known.is_none() && self.config.revalidate == Revalidate::Always && flight.delivered_before(seen) {
            let current = self.source.identify(rel).map_err(|e| Error::io(&self.source.path_of(rel), e))?;
            *known = Some(current);
        }
        Ok(outcome)
    }

    /// A reader of the source itself (through `pre` when the source is already open).
    pub(super) fn direct(&self, rel: &str, sid: SourceId, pre: &mut Option<SourceFile>) -> Result<Reader, Error> {
        let f = match pre.take() {
            Some(f) => f,
            None => self.source.open(rel).map_err(|e| Error::io(&self.source.path_of(rel), e))?,
        };
        Ok(Reader::new(Backing::Source(f), sid.size, rel.into(), self.source.clone()))
    }

    /// A reader of a valid published copy of version `sid` of `key`, if a tier has one.
    pub(super) fn hit(&self, key: &Key, rel: &str, sid: &SourceId, look: Look) -> Option<Reader> {
        let backing = self.lookup.hit(key, rel, sid, look)?;
        Some(Reader::new(backing, sid.size, rel.into(), self.source.clone()))
    }

    /// See [`Cache::open_file`] (`stream` false) and [`Cache::open_native`] (`stream` true).
    pub(super) fn open_native_rel(self: &Arc<Self>, rel: &str, stream: bool) -> Result<Native, Error> {
        self.open_native_looked(rel, stream, Look::First)
    }

    /// [`Inner::open_native_rel`] whose first look at the tiers is `look` (one already counted by the
    /// caller, a peer's request, counts nothing more).
    pub(super) fn open_native_looked(
        self: &Arc<Self>,
        rel: &str,
        stream: bool,
        mut look: Look,
    ) -> Result<Native, Error> {
        // A program can follow a growing copy only beside a descriptor of the source itself.
        let stream = stream && self.posix().is_some();
        let seen = now_ns();
        let key = key_of(rel);
        let mut known = self.known_identity(&key, rel)?;
        let mut pre = None;
        let purpose = if stream { Purpose::Native } else { Purpose::Prefetch };
        for _ in 0..3 {
            match known {
                Some(sid) => {
                    if let Some(f) = self.hit(&key, rel, &sid, look.take()).and_then(Reader::into_served_file) {
                        return Ok(Native::Whole(f));
                    }
                }
                None => self.lookup.count_misses(look.take(), rel),
            }
            match self.flights.join(&key) {
                // Small files (and every file without `stream`) are fetched whole in this thread, so the
                // caller gets a complete copy.
                Role::Leader(lead) => {
                    // A peer is asked for the file whole (a program's descriptor), whatever `stream` says.
                    let job = FetchJob { rel, purpose: Purpose::Native, seen, lead };
                    let fetched = match self.from_peer(job, &mut known) {
                        Ok(fetched) => fetched,
                        Err(job) => self.lead_flight(FetchJob { purpose, ..job }, &mut known, &mut pre)?,
                    };
                    match fetched {
                        Fetched::Uncached | Fetched::NoRoom => break,
                        Fetched::Reader(r) => {
                            if let Some(f) = r.into_file() {
                                return Ok(Native::Whole(f));
                            }
                        }
                        Fetched::Streaming(source, copy) => return Ok(Native::Copying { source, copy }),
                        Fetched::Cached | Fetched::Skipped => {}
                    }
                }
                Role::Follower(flight) => match self.follow(&flight, rel, seen, &mut known)? {
                    ref other if other.of_another_version(known.as_ref()) => {}
                    Outcome::Growing(copy) if stream => {
                        let source = self.source_descriptor(rel, None)?;
                        return Ok(Native::Copying { source, copy });
                    }
                    Outcome::Failed(kind, message) => return Err(self.flight_failed(rel, kind, &message)),
                    Outcome::Growing(_) | Outcome::Bytes(..) | Outcome::Retry => {}
                },
            }
            if known.is_none() {
                known = self.known_identity(&key, rel)?;
            }
        }
        self.source_descriptor(rel, pre.take()).map(Native::Whole)
    }

    /// A descriptor holding a source file's bytes for a program: the file's own on a POSIX source (`pre`
    /// when already open); for an object store, which has no descriptors, its bytes in a memory file.
    pub(super) fn source_descriptor(&self, rel: &str, pre: Option<SourceFile>) -> Result<File, Error> {
        let path = self.source.path_of(rel);
        if self.posix().is_some() {
            return match pre {
                Some(f) => f.into_file().ok_or_else(|| Error::io(&path, no_descriptor())),
                None => self
                    .source
                    .open(rel)
                    .map_err(|e| Error::io(&path, e))?
                    .into_file()
                    .ok_or_else(|| Error::io(&path, no_descriptor())),
            };
        }
        let (bytes, _) = self.source.read_whole(rel, 0, pre).map_err(|e| Error::io(&path, e))?;
        let file = memory_file(rel).map_err(|e| Error::io(&path, e))?;
        use std::os::unix::fs::FileExt;
        file.write_all_at(&bytes, 0).map_err(|e| Error::io(&path, e))?;
        Ok(file)
    }
}
