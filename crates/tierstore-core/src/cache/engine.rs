//! The engine behind a [`Cache`](super::Cache): the state that every handle, copy job and prefetch
//! worker of one cache shares ([`Inner`]), and its read path. A read finds the version of the file to
//! serve, opens a current copy that a tier holds (a hit, checked by size and mtime, or by checksum), or
//! joins the key's flight: it waits for the leader's bytes, or leads the fetch itself (`fetch.rs`), after
//! asking the owner's agent when nodes share (`peers.rs`). Any fault falls back to the source, counted and
//! said once.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io;
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use super::flight::{Flights, Outcome, Role};
use super::job::{FetchJob, Purpose};
use super::lock::{lock_shared, FetchLocks};
use super::pool::Pool;
use crate::cluster::remote::Remote;
use crate::config::{Config, Revalidate, Verify};
use crate::counters::{source as src_slot, tier as tier_slot};
use crate::error::Error;
use crate::index::{key_of, Entry, Key, SourceId};
use crate::reader::{Backing, Growing, Reader};
use crate::source::{PosixSource, Source, SourceFile};
use crate::tier::Tier;

/// A copy file as one version of it: device, inode and change time (seconds, nanoseconds).
pub(super) type CopyIncarnation = (u64, u64, i64, i64);

/// Nanoseconds since the epoch.
pub(super) fn now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

/// The state that every handle, copy job and prefetch worker of one cache shares.
pub(super) struct Inner {
    pub(super) config: Config,
    pub(super) source: Arc<dyn Source>,
    pub(super) tiers: Vec<Arc<Tier>>,
    pub(super) locks: Arc<FetchLocks>,
    pub(super) flights: Flights,
    /// Hits not yet written to the index: (tier, key) -> (hits, last access).
    pub(super) access: Mutex<HashMap<(usize, Key), (u64, u64)>>,
    pub(super) last_access_flush: Mutex<Instant>,
    pub(super) logged: Mutex<HashSet<String>>,
    pub(super) pool: OnceLock<Weak<Pool>>,
    /// Prefetches whose workers are still running, for [`Cache::wait_idle`](super::Cache::wait_idle).
    pub(super) prefetches: Mutex<usize>,
    pub(super) prefetch_idle: Condvar,
    /// The process that opened the cache; a forked child must open its own.
    pub(super) pid: u32,
    /// The job's other members, when nodes share their caches (not in the agent's own cache).
    /// Blocks of the files whose parts this node's agent serves (`blocks.rs`; empty in other processes).
    pub(super) blocks: super::blocks::Blocks,
    pub(super) remote: Option<Remote>,
    /// What `copy_stat` found for each copy incarnation this process has seen (see there).
    pub(super) copy_stats: Mutex<HashMap<CopyIncarnation, libc::stat>>,
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

/// What a look for a published copy counts: `tierstore status`'s hits and misses are the job's first
/// look at each open, so a cold open is one miss, not a miss and then a hit of the copy just fetched.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Look {
    /// The job's first look: a hit or a miss in each tier it reaches, and an access of the copy.
    First,
    /// The job's look at the copy fetched for it after its miss: an access of the copy, no hit.
    AfterFetch,
    /// The cache's own look (under the fetch lock, for a prefetch or a peer): counts nothing.
    Quiet,
}

impl Look {
    /// The job's look on its `attempt`th pass (0 first) through an open's loop.
    pub(super) fn on_attempt(attempt: usize) -> Look {
        if attempt == 0 {
            Look::First
        } else {
            Look::AfterFetch
        }
    }
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

    /// Counts a cache fault in `tier` and says so on stderr once per kind and process.
    pub(super) fn fault(&self, tier: Option<usize>, kind: &str, detail: &str) {
        if let Some(i) = tier {
            self.tiers[i].counters.add(tier_slot::FAULTS, 1);
        }
        self.source.counters().add(src_slot::FALLBACKS, 1);
        self.log_once(kind, &format!("cache fault ({detail}); served from the source. Further faults of this kind are counted, not logged: see `tierstore status`"));
    }

    /// A warning said once per kind and process (`TIERSTORE_LOG=warn`, the default); at `debug` every
    /// time, since that level is asked for to follow each file.
    pub(super) fn log_once(&self, kind: &str, message: &str) {
        if log::log_enabled!(log::Level::Debug) || self.logged.lock().expect("log lock").insert(kind.to_string()) {
            log::warn!("{message}");
        }
    }

    /// The version of the source file to serve, when a tier holds a copy of it to check: see
    /// [`Inner::current_identity`]. `None` when no tier holds one: there is nothing to check, so the
    /// thread that leads the fetch opens the file under the node's fetch lock and identifies it from the
    /// open (`fstat`, or the `GET`'s own response). A miss costs the store that one open in every
    /// `revalidate` mode, and the threads and processes that wait for the fetch send the store nothing.
    pub(super) fn known_identity(self: &Arc<Self>, key: &Key, rel: &str) -> Result<Option<SourceId>, Error> {
        match self.published(key, rel) {
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

    /// The first published entry of `key` in tier order, with the tier's index.
    pub(super) fn published_in(&self, key: &Key, rel: &str) -> Option<(usize, Entry)> {
        self.tiers.iter().enumerate().find_map(|(i, t)| {
            let e = t.index.as_ref().ok()?.lookup(key).ok()??;
            (e.ready && e.rel == rel).then_some((i, e))
        })
    }

    /// The index that records the source's directories: the first tier's that is available.
    pub(super) fn directories(&self) -> Option<&crate::index::Index> {
        self.tiers.iter().find_map(|t| t.index.as_ref().ok())
    }

    pub(super) fn published(&self, key: &Key, rel: &str) -> Option<Entry> {
        self.published_in(key, rel).map(|(_, e)| e)
    }

    pub(super) fn open_rel(self: &Arc<Self>, rel: &str) -> Result<Reader, Error> {
        let seen = now_ns();
        let key = key_of(rel);
        let mut known = self.known_identity(&key, rel)?;
        let mut pre = None;
        for attempt in 0..3 {
            match known {
                Some(sid) => {
                    if let Some(r) = self.hit(&key, rel, &sid, Look::on_attempt(attempt)) {
                        return Ok(r);
                    }
                }
                None if attempt == 0 => self.count_misses(rel),
                None => {}
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
                Role::Follower(flight) => match flight.wait() {
                    Outcome::Bytes(b) => {
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

    /// Counts a miss in every available tier (a trusted file that no tier holds).
    pub(super) fn count_misses(&self, rel: &str) {
        log::debug!("{rel}: miss, no tier holds a copy");
        for t in &self.tiers {
            if t.index.is_ok() {
                t.counters.add(tier_slot::MISSES, 1);
            }
        }
    }

    /// A reader of the source itself (through `pre` when the source is already open).
    pub(super) fn direct(&self, rel: &str, sid: SourceId, pre: &mut Option<SourceFile>) -> Result<Reader, Error> {
        let f = match pre.take() {
            Some(f) => f,
            None => self.source.open(rel).map_err(|e| Error::io(&self.source.path_of(rel), e))?,
        };
        Ok(Reader::new(Backing::Source(f), sid.size, rel.into(), self.source.clone()))
    }

    /// Opens a valid published copy of `key`, if a tier has one.
    pub(super) fn hit(&self, key: &Key, rel: &str, sid: &SourceId, look: Look) -> Option<Reader> {
        let count = look == Look::First;
        for (i, tier) in self.tiers.iter().enumerate() {
            let Ok(index) = &tier.index else { continue };
            let entry = match index.lookup(key) {
                Ok(Some(e)) if e.ready && e.rel == rel && e.source == *sid => e,
                Ok(found) => {
                    if count {
                        tier.counters.add(tier_slot::MISSES, 1);
                        let why = if found.is_some() { "holds another version" } else { "holds no copy" };
                        log::debug!("{rel}: miss in {}, which {why}", tier.config.path.display());
                    }
                    continue;
                }
                Err(e) => {
                    self.fault(
                        Some(i),
                        "index-read",
                        &format!("index of {} unreadable: {e}", tier.config.path.display()),
                    );
                    continue;
                }
            };
            match self.open_copy(i, key, &entry) {
                Ok(Some(backing)) => {
                    if count {
                        tier.counters.add(tier_slot::HITS, 1);
                        log::debug!("{rel}: hit in {}", tier.config.path.display());
                    }
                    if look != Look::Quiet {
                        self.note_access(i, key);
                    }
                    return Some(Reader::new(backing, sid.size, rel.into(), self.source.clone()));
                }
                Ok(None) => {
                    if count {
                        tier.counters.add(tier_slot::MISSES, 1);
                    }
                }
                Err(detail) => {
                    // A later look (under the fetch lock, or after the fetch) sees the same damage again: once is a fault.
                    if count {
                        tier.counters.add(tier_slot::MISSES, 1);
                        self.fault(
                            Some(i),
                            "bad-copy",
                            &format!("{detail} for {rel} in {}; it will be fetched again", tier.config.path.display()),
                        );
                    }
                }
            }
        }
        None
    }

    /// Opens and checks the copy of a ready entry. `Ok(None)`: evicted meanwhile (not a fault).
    pub(super) fn open_copy(&self, i: usize, key: &Key, e: &Entry) -> Result<Option<Backing>, String> {
        let tier = &self.tiers[i];
        let file = match tier.open_copy(key) {
            Ok(f) => f,
            // Under an evicting policy another thread or process may have evicted the copy since the
            // lookup: if its entry is gone or changed too, that is a miss, not damage.
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                let still = tier.index.as_ref().ok().and_then(|ix| ix.lookup_settled(key).ok().flatten());
                return match still {
                    Some(now)
                        if now.ready && now.source == e.source && now.stats.inserted_seq == e.stats.inserted_seq =>
                    {
                        Err("missing copy".into())
                    }
                    _ => Ok(None),
                };
            }
            Err(err) => return Err(format!("copy unreadable ({err})")),
        };
        // Only an evicting policy deletes copies readers may hold; `fill` never does, so skip the syscall.
        if self.config.policy.evicts() {
            lock_shared(&file).map_err(|err| format!("copy cannot be locked ({err})"))?;
        }
        let m = file.metadata().map_err(|err| format!("copy cannot be inspected ({err})"))?;
        use std::os::unix::fs::MetadataExt;
        if m.nlink() == 0 {
            return Ok(None);
        }
        let mtime = m.mtime() * 1_000_000_000 + m.mtime_nsec();
        if m.size() != e.source.size {
            return Err(format!("truncated copy ({} of {} bytes)", m.size(), e.source.size));
        }
        if mtime != e.source.mtime_ns {
            return Err("modified copy (its mtime changed)".into());
        }
        // The reader's `fstat` of the copy comes next (Python's `open` asks it of every file): remember
        // its answer from what was just read, rather than find the entry again through /proc then.
        if let Some(st) = e.source.to_stat() {
            self.remember_copy((m.dev(), m.ino(), m.ctime(), m.ctime_nsec()), st);
        }
        if self.config.verify == Verify::Checksum {
            // A copy published without a checksum (while verification was by metadata) cannot be
            // vouched for: fetch it again, which records one. Not a fault.
            if e.checksum.is_none() {
                return Ok(None);
            }
            let mut bytes = Vec::with_capacity(m.size() as usize);
            use std::io::Read;
            (&file).read_to_end(&mut bytes).map_err(|err| format!("copy unreadable ({err})"))?;
            if Some(crate::hash::hash_serial(&bytes)) != e.checksum {
                return Err("corrupted copy (checksum mismatch)".into());
            }
            tier.counters.add(tier_slot::BYTES_SERVED, bytes.len() as u64);
            return Ok(Some(Backing::Memory(Arc::new(bytes))));
        }
        Ok(Some(Backing::Copy(file, tier.clone())))
    }

    pub(super) fn note_access(&self, tier: usize, key: &Key) {
        if !self.config.policy.tracks_access() {
            return;
        }
        let n = {
            let mut a = self.access.lock().expect("access lock");
            let slot = a.entry((tier, *key)).or_insert((0, 0));
            slot.0 += 1;
            slot.1 = now_ns();
            a.len()
        };
        let due = n >= 512 || self.last_access_flush.lock().expect("flush lock").elapsed().as_millis() >= 500;
        if due {
            self.flush_access();
        }
    }

    /// Writes pending hit statistics into the indexes (batched: one write transaction per tier).
    pub(super) fn flush_access(&self) {
        let batch = std::mem::take(&mut *self.access.lock().expect("access lock"));
        *self.last_access_flush.lock().expect("flush lock") = Instant::now();
        let mut per_tier: HashMap<usize, Vec<(Key, u64, u64)>> = HashMap::new();
        for ((t, k), (hits, last)) in batch {
            per_tier.entry(t).or_default().push((k, hits, last));
        }
        for (t, list) in per_tier {
            if let Ok(ix) = &self.tiers[t].index {
                if let Err(e) = ix.record_access(&list) {
                    self.fault(Some(t), "access-stats", &format!("access statistics not written: {e}"));
                }
            }
        }
    }

    /// See [`Cache::open_file`] (`stream` false) and [`Cache::open_native`] (`stream` true).
    pub(super) fn open_native_rel(self: &Arc<Self>, rel: &str, stream: bool) -> Result<Native, Error> {
        // A program can follow a growing copy only beside a descriptor of the source itself.
        let stream = stream && self.posix().is_some();
        let seen = now_ns();
        let key = key_of(rel);
        let mut known = self.known_identity(&key, rel)?;
        let mut pre = None;
        let purpose = if stream { Purpose::Native } else { Purpose::Prefetch };
        for attempt in 0..3 {
            match known {
                Some(sid) => {
                    if let Some(f) =
                        self.hit(&key, rel, &sid, Look::on_attempt(attempt)).and_then(Reader::into_served_file)
                    {
                        return Ok(Native::Whole(f));
                    }
                }
                None if attempt == 0 => self.count_misses(rel),
                None => {}
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
                Role::Follower(flight) => match flight.wait() {
                    Outcome::Growing(copy) if stream => {
                        let source = self.source_descriptor(rel, None)?;
                        return Ok(Native::Copying { source, copy });
                    }
                    Outcome::Failed(kind, message) => return Err(self.flight_failed(rel, kind, &message)),
                    Outcome::Growing(_) | Outcome::Bytes(_) | Outcome::Retry => {}
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
