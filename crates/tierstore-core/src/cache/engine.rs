//! The engine behind a [`Cache`](super::Cache): the state that every handle, copy job and prefetch
//! worker of one cache shares ([`Inner`]), and its read path, which reads top to bottom here
//! ([`Inner::open_as`]). An open
//!
//! 1. finds the version of the file to serve ([`Inner::known_identity`]; with `revalidate = "<duration>"`,
//!    an old copy's directory is confirmed, `confirm.rs`);
//! 2. asks the lookup for a current copy that a tier holds (`lookup.rs`: a hit, checked by size and mtime,
//!    or by checksum);
//! 3. joins the key's in-process flight: it waits for the leader's bytes, or leads the fetch itself, and
//!    then
//! 4. asks the owner's agent when nodes share (the [`Peers`] step, `peers.rs`), and else
//! 5. fetches from the store under the node-wide fetch lock (the [`Fetcher`] step, `fetch.rs`);
//! 6. reads the source itself when three rounds found nothing to share.
//!
//! Each step is a component that owns its state and hands a [`FetchJob`] down, never back up: the engine
//! holds the [`Storage`] (the source, the tiers, the settings), the [`Fetcher`] and the [`Peers`]. Any fault
//! falls back to the source, counted and said once (`faults.rs`).

use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};

use super::blocks::Blocks;
use super::fetch::{fail_flight, Fetcher};
use super::flight::{Flight, Outcome, Role};
use super::job::{FetchJob, Fetched, Purpose};
use super::lookup::{Found, Look};
use super::peers::Peers;
use super::storage::Storage;
use super::sweep::Sweep;
use crate::clock::now_ns;
use crate::config::Revalidate;
use crate::error::Error;
use crate::index::{key_of, Entry, Key, SourceId};
use crate::reader::{Backing, Growing, Kept, Reader};
use crate::source::SourceFile;

/// The state that every handle, copy job and prefetch worker of one cache shares: its components, and
/// what belongs to the process that opened it.
pub(super) struct Inner {
    /// The source, the tiers and the settings.
    storage: Arc<Storage>,
    /// The fetch step.
    fetcher: Arc<Fetcher>,
    /// The peers step, when nodes share their caches (not in the agent's own cache).
    peers: Option<Arc<Peers>>,
    /// Prefetches whose workers are still running, for [`Cache::wait_idle`](super::Cache::wait_idle).
    prefetches: Mutex<usize>,
    prefetch_idle: Condvar,
    /// The process that opened the cache; a forked child must open its own.
    pid: u32,
    /// Blocks of the files whose parts this node's agent serves (`blocks.rs`; empty in other processes).
    blocks: Blocks,
    /// This process's right to the background confirmation of expired directories (`confirm.rs`).
    sweep: Sweep,
}

/// A file opened for a program that reads it with system calls (see [`Cache::open_native`](super::Cache::open_native)).
pub enum Native {
    /// A descriptor holding exactly the file's bytes: a published copy, or the source when the cache
    /// failed (or no tier had room, and the mark below could not be taken).
    Whole(File),
    /// The source itself, which no tier had room for. `mark` says so to this node's prefetches, which
    /// then leave the file alone rather than read it from the store a second time while the program
    /// reads it: keep it until the program closes the descriptor, and drop it then.
    FromStore {
        /// The source file, open read-only.
        file: File,
        /// The mark that the file is read from the store.
        mark: Kept,
    },
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

/// What an open wants of the read path, and what it makes of each step's answer: a [`Reader`]
/// ([`ForReader`]) or a descriptor for a program ([`ForProgram`]). The one loop of [`Inner::open_as`]
/// takes either.
trait Want {
    type Opened;
    /// What the job is for when it asks a peer, and when it fetches from the store.
    fn purposes(&self) -> (Purpose, Purpose);
    /// A current copy a tier holds, as this open takes it (`None`: not so; the open goes on as a miss).
    fn on_copy(&self, copy: Reader) -> Option<Self::Opened>;
    /// [`Want::on_copy`] of the copy `backing` (of `size` bytes), for an open that may take it without a
    /// reader around it.
    fn on_backing(&self, storage: &Storage, backing: Backing, size: u64, rel: &str) -> Option<Self::Opened> {
        self.on_copy(storage.reader(backing, size, rel))
    }
    /// What a fetch this open led produced.
    fn on_fetch(&self, fetched: Fetched) -> Next<Self::Opened>;
    /// What another thread's flight delivered, of the version this open serves (`None`: look again).
    fn on_flight(&self, storage: &Storage, rel: &str, outcome: Outcome) -> Result<Option<Self::Opened>, Error>;
    /// The source itself: three rounds found nothing to share, or no tier will take the file. `known`:
    /// its version, when found; `pre`: its file, when open.
    fn on_source(
        &self,
        storage: &Storage,
        rel: &str,
        known: Option<SourceId>,
        pre: Option<SourceFile>,
    ) -> Result<Self::Opened, Error>;
}

/// What an open's first look found (see [`Inner::first_look`]).
struct FirstLook {
    /// The link's target, when it followed one: the file to open.
    target: Option<String>,
    /// The key of the file to open, hashed once for the whole open.
    key: Key,
    /// The published copy to serve, with its version, when a tier holds one.
    found: Option<(Found, SourceId)>,
}

/// After a fetch step: the open has its answer, looks again, or reads the source.
enum Next<T> {
    Opened(T),
    Again,
    Source,
}

/// An open through the API: a [`Reader`] of a copy, of the bytes a flight shares, or of the source.
struct ForReader;

impl Want for ForReader {
    type Opened = Reader;

    fn purposes(&self) -> (Purpose, Purpose) {
        (Purpose::Read, Purpose::Read)
    }

    fn on_copy(&self, copy: Reader) -> Option<Reader> {
        Some(copy)
    }

    fn on_fetch(&self, fetched: Fetched) -> Next<Reader> {
        match fetched {
            Fetched::Reader(r) => Next::Opened(r),
            Fetched::Cached | Fetched::Uncached | Fetched::NoRoom | Fetched::Skipped | Fetched::Streaming(..) => {
                Next::Again
            }
        }
    }

    fn on_flight(&self, storage: &Storage, rel: &str, outcome: Outcome) -> Result<Option<Reader>, Error> {
        Ok(match outcome {
            Outcome::Bytes(b, _) => {
                let size = b.len() as u64;
                Some(storage.reader(Backing::Memory(b), size, rel))
            }
            Outcome::Growing(g) => {
                let size = g.size();
                Some(storage.reader(Backing::Growing(g), size, rel))
            }
            Outcome::Retry | Outcome::Failed(..) => None,
        })
    }

    fn on_source(
        &self,
        storage: &Storage,
        rel: &str,
        known: Option<SourceId>,
        mut pre: Option<SourceFile>,
    ) -> Result<Reader, Error> {
        let sid = match known {
            Some(sid) => sid,
            None => {
                let (sid, f) = storage.open_identified(rel)?;
                pre = Some(f);
                sid
            }
        };
        storage.direct(rel, sid, &mut pre)
    }
}

/// An open for a program that reads with system calls ([`Native`]): a descriptor of a whole copy, or
/// (`stream`, on a POSIX source) of the source beside a large copy being made.
struct ForProgram {
    stream: bool,
}

impl Want for ForProgram {
    type Opened = Native;

    fn purposes(&self) -> (Purpose, Purpose) {
        // A peer is asked for the file whole (a program's descriptor), whatever `stream` says; small files
        // (and every file without `stream`) are fetched whole in this thread, so the caller gets a
        // complete copy.
        (Purpose::Native, if self.stream { Purpose::Native } else { Purpose::Prefetch })
    }

    fn on_copy(&self, copy: Reader) -> Option<Native> {
        if let Backing::Memory(bytes) = copy.backing() {
            return checked_bytes_file(copy.rel(), bytes).map(Native::Whole);
        }
        copy.into_served_file().map(Native::Whole)
    }

    fn on_backing(&self, _: &Storage, backing: Backing, size: u64, rel: &str) -> Option<Native> {
        // The shim's warm open: the descriptor, without a reader's name and handle of the source to drop.
        if let Backing::Memory(bytes) = &backing {
            return checked_bytes_file(rel, bytes).map(Native::Whole);
        }
        backing.into_served_file(size).map(Native::Whole)
    }

    fn on_fetch(&self, fetched: Fetched) -> Next<Native> {
        match fetched {
            Fetched::Uncached | Fetched::NoRoom => Next::Source,
            Fetched::Reader(r) => r.into_file_kept().map_or(Next::Again, |(file, mark)| {
                Next::Opened(match mark {
                    Some(mark) => Native::FromStore { file, mark },
                    None => Native::Whole(file),
                })
            }),
            Fetched::Streaming(source, copy) => Next::Opened(Native::Copying { source, copy }),
            Fetched::Cached | Fetched::Skipped => Next::Again,
        }
    }

    fn on_flight(&self, storage: &Storage, rel: &str, outcome: Outcome) -> Result<Option<Native>, Error> {
        match outcome {
            Outcome::Growing(copy) if self.stream => {
                let source = storage.source_descriptor(rel, None)?;
                Ok(Some(Native::Copying { source, copy }))
            }
            Outcome::Growing(_) | Outcome::Bytes(..) | Outcome::Retry | Outcome::Failed(..) => Ok(None),
        }
    }

    fn on_source(
        &self,
        storage: &Storage,
        rel: &str,
        _known: Option<SourceId>,
        pre: Option<SourceFile>,
    ) -> Result<Native, Error> {
        storage.source_descriptor(rel, pre).map(Native::Whole)
    }
}

/// A program's descriptor for a copy whose bytes the open checked into memory (`verify = "checksum"`): a
/// memory file holding exactly those bytes. The copy's own descriptor could change after the check; the
/// store's, which a program got before, sent every open of the copy to the store. `None` (the open goes
/// on to the store) when the memory file cannot be made.
fn checked_bytes_file(rel: &str, bytes: &[u8]) -> Option<File> {
    use std::os::unix::fs::FileExt;
    let file = super::storage::memory_file(rel).ok()?;
    file.write_all_at(bytes, 0).ok()?;
    Some(file)
}

impl Inner {
    pub(super) fn new(
        storage: Arc<Storage>,
        fetcher: Arc<Fetcher>,
        peers: Option<Arc<Peers>>,
        blocks: Blocks,
    ) -> Inner {
        Inner {
            storage,
            fetcher,
            peers,
            prefetches: Mutex::new(0),
            prefetch_idle: Condvar::new(),
            pid: crate::process::pid(),
            blocks,
            sweep: Sweep::default(),
        }
    }

    /// The source, the tiers and the settings.
    pub(super) fn storage(&self) -> &Arc<Storage> {
        &self.storage
    }

    /// The fetch step (for the prefetches, which claim and fetch files themselves).
    pub(super) fn fetcher(&self) -> &Arc<Fetcher> {
        &self.fetcher
    }

    /// The peers step, when nodes share their caches.
    pub(super) fn peers(&self) -> Option<&Arc<Peers>> {
        self.peers.as_ref()
    }

    /// The blocks this node's agent serves parts from.
    pub(super) fn blocks(&self) -> &Blocks {
        &self.blocks
    }

    /// This process's right to the background confirmation of expired directories.
    pub(super) fn sweep(&self) -> &Sweep {
        &self.sweep
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

    /// Blocks until no prefetch's workers run.
    pub(super) fn wait_prefetches(&self) {
        let mut running = self.prefetches.lock().unwrap_or_else(|p| p.into_inner());
        while *running > 0 {
            running = self.prefetch_idle.wait(running).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// The version of the source file to serve, when a tier holds a copy of it to check: see
    /// [`Inner::current_identity`]. `None` when no tier holds one: there is nothing to check, so the
    /// thread that leads the fetch opens the file under the node's fetch lock and identifies it from the
    /// open (`fstat`, or the `GET`'s own response). A miss costs the store that one open in every
    /// `revalidate` mode, and the threads and processes that wait for the fetch send the store nothing.
    pub(super) fn known_identity(self: &Arc<Self>, key: &Key, rel: &str) -> Result<Option<SourceId>, Error> {
        Ok(self.published_identity(key, rel)?.map(|(_, sid)| sid))
    }

    /// Step 1 of every open of `rel`: the version to serve of its own copy, when a tier holds one. With
    /// none, and copies trusted (`revalidate = "never"`), that of the file a recorded symlink `rel` leads
    /// to inside the source, whose path comes back too: a file reached by its link and by its own name is
    /// one cached copy, and an open through the link asks the store nothing.
    ///
    /// The path's own copy is looked for first because the link's record is a second index read: only a
    /// path without a copy pays it, and a warm open of a file reads the index once. A link with a copy of
    /// its own (made while copies were revalidated, when links are not followed) is served that copy: its
    /// target's bytes as they were when it was copied, which is what `never` promises of every copy.
    fn first_look(self: &Arc<Self>, rel: &str) -> Result<FirstLook, Error> {
        let (key, found) = self.storage.lookup().published_of(rel);
        if let Some(found) = found {
            let sid = self.current_identity(&key, rel, &found.1)?;
            return Ok(FirstLook { target: None, key, found: Some((found, sid)) });
        }
        let Some(target) = self.link_target(rel) else { return Ok(FirstLook { target: None, key, found: None }) };
        let key = key_of(&target);
        let found = self.published_identity(&key, &target)?;
        Ok(FirstLook { target: Some(target), key, found })
    }

    /// The source-relative path a recorded symlink `rel` leads to, when copies are trusted and it leads
    /// into the source.
    fn link_target(&self, rel: &str) -> Option<String> {
        if self.storage.config().revalidate != Revalidate::Never {
            return None;
        }
        let to = self.storage.symlink(rel)?.resolved?;
        self.storage.source().relative(Path::new(OsStr::from_bytes(&to))).ok()
    }

    /// [`Inner::known_identity`], with the published entry it was read from and that entry's tier, for a
    /// look at the copy that need not read the index again ([`Lookup::hit_found`]).
    fn published_identity(self: &Arc<Self>, key: &Key, rel: &str) -> Result<Option<(Found, SourceId)>, Error> {
        let Some(found) = self.storage.lookup().published_in(key, rel) else { return Ok(None) };
        let sid = self.current_identity(key, rel, &found.1)?;
        Ok(Some((found, sid)))
    }

    /// The version of `rel` to serve when a tier holds the copy `e`: the copy's own when the dataset is
    /// trusted (`revalidate = "never"`) or the copy was confirmed recently enough (`"<duration>"`; else its
    /// directory is confirmed now, see `cache/confirm.rs`), or the source's current one, asked with one
    /// `stat` or `HEAD` (`"always"`).
    pub(super) fn current_identity(self: &Arc<Self>, key: &Key, rel: &str, e: &Entry) -> Result<SourceId, Error> {
        match self.storage.config().revalidate {
            Revalidate::Never => Ok(e.source),
            Revalidate::Within(d) => self.confirmed_identity(key, rel, e, d),
            Revalidate::Always => self.storage.identify(rel),
        }
    }

    /// See [`Cache::open`](super::Cache::open).
    pub(super) fn open_rel(self: &Arc<Self>, rel: &str) -> Result<Reader, Error> {
        self.open_as(rel, ForReader, Look::First)
    }

    /// See [`Cache::open_file`](super::Cache::open_file) (`stream` false) and
    /// [`Cache::open_native`](super::Cache::open_native) (`stream` true).
    pub(super) fn open_native_rel(self: &Arc<Self>, rel: &str, stream: bool) -> Result<Native, Error> {
        self.open_native_looked(rel, stream, Look::First)
    }

    /// Step 2 alone, for the shim's warm opens: the first tier's current copy of `rel` opened for a
    /// program, or `None` (nothing counted) for [`Inner::open_native_rel`] to take the whole way.
    pub(super) fn open_native_hit(self: &Arc<Self>, rel: &str) -> Result<Option<Native>, Error> {
        self.open_hit(rel, ForProgram { stream: false })
    }

    fn open_hit<W: Want>(self: &Arc<Self>, rel: &str, want: W) -> Result<Option<W::Opened>, Error> {
        if self.storage.config().revalidate == Revalidate::Always {
            return Ok(None); // its `stat` of the source would be asked again by the whole way
        }
        let FirstLook { target, key, found } = self.first_look(rel)?;
        let Some((found, sid)) = found else { return Ok(None) };
        let rel = target.as_deref().unwrap_or(rel);
        let Some(backing) = self.storage.lookup().first_tier_copy(&found, &key, rel, &sid, Look::First) else {
            return Ok(None);
        };
        Ok(want.on_backing(&self.storage, backing, sid.size, rel))
    }

    /// [`Inner::open_native_rel`] whose first look at the tiers is `look` (one already counted by the
    /// caller, a peer's request, counts nothing more).
    pub(super) fn open_native_looked(self: &Arc<Self>, rel: &str, stream: bool, look: Look) -> Result<Native, Error> {
        // A program can follow a growing copy only beside a descriptor of the source itself.
        let stream = stream && self.storage.posix().is_some();
        self.open_as(rel, ForProgram { stream }, look)
    }

    /// The read path (see the module), for what `want` wants; `look` is its first look at the tiers.
    fn open_as<W: Want>(self: &Arc<Self>, rel: &str, want: W, mut look: Look) -> Result<W::Opened, Error> {
        let seen = now_ns();
        // 1. The version to serve, when a tier holds a copy to check; the file to open (a link's target).
        let FirstLook { target, key, found } = self.first_look(rel)?;
        let rel = target.as_deref().unwrap_or(rel);
        let (asks_peer_for, fetches_for) = want.purposes();
        let (mut found, mut known) = found.unzip();
        let mut pre = None;
        for _ in 0..3 {
            // 2. A current copy in a tier (the first time, the entry step 1 read).
            match known {
                Some(sid) => {
                    let copy = match found.take() {
                        Some(f) => self.storage.hit_found(&f, &key, rel, &sid, look.take()),
                        None => self.storage.hit(&key, rel, &sid, look.take()),
                    };
                    if let Some(opened) = copy.and_then(|r| want.on_copy(r)) {
                        return Ok(opened);
                    }
                }
                None => self.storage.lookup().count_misses(look.take(), rel),
            }
            // 3. The key's flight: lead the fetch, or wait for the thread that does.
            match self.fetcher.join(&key) {
                Role::Leader(lead) => {
                    let job = FetchJob { rel, purpose: asks_peer_for, seen, lead };
                    // 4. The owner's agent; 5. the store, under the node's fetch lock.
                    let fetched = match self.ask_peers(job, &mut known) {
                        Ok(fetched) => fetched,
                        Err(job) => self.lead_flight(FetchJob { purpose: fetches_for, ..job }, &mut known, &mut pre)?,
                    };
                    match want.on_fetch(fetched) {
                        Next::Opened(opened) => return Ok(opened),
                        Next::Again => {}
                        Next::Source => break,
                    }
                }
                Role::Follower(flight) => match self.follow(&flight, rel, seen, &mut known)? {
                    // The flight fetched another version than this open confirmed: never its bytes.
                    ref other if other.of_another_version(known.as_ref()) => {}
                    Outcome::Failed(kind, message) => return Err(self.storage.flight_failed(rel, kind, &message)),
                    outcome => {
                        if let Some(opened) = want.on_flight(&self.storage, rel, outcome)? {
                            return Ok(opened);
                        }
                    }
                },
            }
            if known.is_none() {
                known = self.known_identity(&key, rel)?;
            }
        }
        // 6. The source itself.
        want.on_source(&self.storage, rel, known, pre)
    }

    /// Step 4: a miss served by the agent of the node that owns the file, when nodes share (see
    /// [`Peers::from_peer`]); `Err` hands the job back for the store.
    pub(super) fn ask_peers<'a>(
        &self,
        job: FetchJob<'a>,
        known: &mut Option<SourceId>,
    ) -> Result<Fetched, FetchJob<'a>> {
        match &self.peers {
            Some(peers) => peers.from_peer(job, known),
            None => Err(job),
        }
    }

    /// Step 5: leads a fetch from the store. A `known` version is fetched under the node's fetch lock
    /// ([`Fetcher::lead`]). Otherwise the lock is taken before the source is opened: processes racing
    /// for the same cold file then send the store one open (one `GET`) between them, whatever the
    /// `revalidate` mode, and the ones that waited find it published and check it as any copy. The leader
    /// alone opens the file and records its version in `known`; the open file is kept in `pre`.
    pub(super) fn lead_flight(
        self: &Arc<Self>,
        job: FetchJob<'_>,
        known: &mut Option<SourceId>,
        pre: &mut Option<SourceFile>,
    ) -> Result<Fetched, Error> {
        if let Some(sid) = *known {
            return self.fetcher.lead(job, sid, pre);
        }
        let (key, rel) = (*job.key(), job.rel);
        let guard = self.fetcher.lock_or_fault(&key);
        let published = self.storage.lookup().published(&key, rel).map(|e| self.current_identity(&key, rel, &e));
        let (sid, job) = match published {
            Some(Ok(sid)) => (sid, job),
            Some(Err(e)) => {
                fail_flight(job.lead, &e);
                return Err(e);
            }
            None => self.fetcher.open_for_flight(job, pre)?,
        };
        *known = Some(sid);
        match guard {
            Some(guard) => self.fetcher.fetch_locked(job, sid, guard, pre),
            None => {
                drop(job);
                Ok(Fetched::Reader(self.storage.direct(rel, sid, pre)?))
            }
        }
    }

    /// What another thread's flight of `rel` delivers to an open that began at `seen`. With `revalidate =
    /// "always"` every open asks the source: one that began after the flight had read the source (the
    /// flight lives on while its copy is published) asks it now, into `known`, as it would have asked
    /// of a published copy, and the caller takes the flight's bytes only if they are that version.
    fn follow(&self, flight: &Flight, rel: &str, seen: u64, known: &mut Option<SourceId>) -> Result<Outcome, Error> {
        let outcome = flight.wait();
        if known.is_none() && self.storage.config().revalidate == Revalidate::Always && flight.delivered_before(seen) {
            *known = Some(self.storage.identify(rel)?);
        }
        Ok(outcome)
    }
}
