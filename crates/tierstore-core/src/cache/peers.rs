//! What a cache does with its peers: a miss on a file another node owns is asked of that node's agent
//! before the source (DYAD's lookup order), and the agent of this node serves the files it owns.
//!
//! Never stale and never partial hold across nodes as on one: the owner says which version it sends
//! before the bytes ([`crate::cluster::transfer::Transfer::found`]); a reader that already knows the version
//! (`revalidate = "always"`) refuses any other; the bytes are checked against the blake3 recorded when
//! the owner copied them from the source. The owner sends its copy without reading or hashing it (with
//! `sendfile`), so a reader that finds a mismatch tells it, and the owner checks that copy and removes it
//! if it is damaged ([`Cache::check_served`](super::Cache::check_served)). Anything that goes wrong sends
//! the reader to the source, counted, and the job goes on.
//!
//! # Requests stay beneath the source
//!
//! A path that another node names (a `Fetch`, `FetchRanges` or `Damaged` to this node's agent) is
//! served only as it resolves beneath the source directory ([`Beneath`]): a symlink in the source may
//! lead to another file of the source, never out of it, whoever planted it. A local open (a program of
//! this node, through `tierstore.open`, the shim or `tierstore run`) follows the file system's own rules,
//! symlinks and all, as before: it reads with its own rights, and nothing crosses a node.
//!
//! The rule is on the bytes, not on a path checked before another open: on a POSIX source, bytes go to a
//! peer only from
//! - the descriptor opened beneath the source for the request (`openat2` with `RESOLVE_BENEATH`, see
//!   [`PosixSource::open_beneath`](crate::source::PosixSource::open_beneath)), or a copy made from it, or
//! - a copy (whole, or still being made) of a version ([`SourceId`]: device, inode, size, times) equal to
//!   that descriptor's: the descriptor pins its inode, and every copy is read from a descriptor of
//!   exactly its version (checked before its first byte, and again at its end), so an equal version is
//!   the same file; or
//! - a copy of a version recorded as *canonical*: identified from a descriptor whose own path was the
//!   one asked (no symlink on the way, so inside the source). This is how a cached file is served with no
//!   request to the store, as before.
//!
//! So a file a local open copied through a symlink that leaves the source is never sent to a peer, and a
//! symlink switched between a check and an open changes nothing: the version would not match. An object
//! store has no symlinks: its keys are served as they are.

use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::engine::{memory_file, Fetched, Inner, Native};
use super::fetch::fail_flight;
use super::flight::{Outcome, Role};
use super::job::{FetchJob, Purpose};
use super::link::PeerLink;
use super::lock::{lock_shared, FetchGuard};
use super::lookup::Look;
use crate::clock::now_ns;
use crate::cluster::transfer::{Dest, RemoteError, Transfer};
use crate::cluster::Sharing;
use crate::counters::source as src_slot;
use crate::error::Error;
use crate::hash::Hash;
use crate::index::{key_of, Key, SourceId};
use crate::reader::{Backing, Growing, Reader};
use crate::source::SourceFile;

/// The reads of the rest of a file a peer stopped sending, from the source.
const RESUME_READ: usize = 4 << 20;

/// A file received from its owner: what the open gets, how many of its bytes came from the owner (all
/// of them, unless the owner failed part of the way and the rest came from the source), and that
/// failure, to be counted.
struct Received {
    fetched: Fetched,
    from_peer: u64,
    fault: Option<RemoteError>,
}

/// A file its owner has begun to send: which version, from whom (and the link it came by, where what it
/// gives is counted), and the tier its copy goes to (none: private memory).
struct Incoming {
    key: Key,
    rel: String,
    link: Arc<PeerLink>,
    who: String,
    sid: SourceId,
    transfer: Transfer,
    tier: Option<usize>,
}

/// A large file received in the background while its readers follow it: where its bytes go.
struct Followed {
    key: Key,
    rel: String,
    /// The link it comes by.
    link: Arc<PeerLink>,
    who: String,
    sid: SourceId,
    tier: Option<usize>,
    /// Its temporary path in the tier, if it goes to one.
    temp: Option<PathBuf>,
    /// The file written.
    file: File,
    /// What its readers follow.
    growing: Arc<Growing>,
}

/// A file this node's agent serves to a peer: an open descriptor of exactly the version `identity`.
pub struct Served {
    /// The tier copy (or the source file, when no tier had room).
    pub file: File,
    /// The version.
    pub identity: SourceId,
    /// The blake3 recorded when the copy was made from the source, if one was.
    pub checksum: Option<[u8; 32]>,
    /// The copy, when it is still being made from the source (`file` is then the copy being written):
    /// each piece is sent once written, with the chaining value recorded for it.
    pub copy: Option<Arc<Growing>>,
}

/// The file a peer's request names, as it resolves beneath the source: what vouches that bytes sent to
/// another node are of a file inside the source (see the module's documentation). The file is opened
/// beneath the source at most once per request, and only when no record vouches for the version to
/// serve: a cached file costs the store nothing, a miss the one open it costs anyway (the copy is made
/// from that descriptor).
pub(super) struct Beneath<'a> {
    inner: &'a Inner,
    rel: &'a str,
    /// The file opened beneath the source and its version, once opened.
    opened: Option<(SourceId, File)>,
}

impl<'a> Beneath<'a> {
    /// The request for `rel` (a checked relative path).
    pub(super) fn new(inner: &'a Inner, rel: &'a str) -> Beneath<'a> {
        Beneath { inner, rel, opened: None }
    }

    /// Whether the source has paths to check: a POSIX directory (an object store has no symlinks).
    pub(super) fn applies(&self) -> bool {
        self.inner.posix().is_some()
    }

    /// The file opened beneath the source, and its version (identified from the open descriptor): opened
    /// now if it is not yet. A path that leaves the source is an error that says so.
    pub(super) fn open(&mut self) -> Result<&(SourceId, File), Error> {
        if self.opened.is_none() {
            let path = self.inner.source.path_of(self.rel);
            let posix = self.inner.posix().ok_or_else(|| Error::io(&path, super::engine::no_descriptor()))?;
            let file = posix.open_beneath(self.rel).map_err(|e| Error::io(&path, e))?;
            let (sid, is_dir) = posix.identify_file(&file, self.rel).map_err(|e| Error::io(&path, e))?;
            if is_dir {
                return Err(Error::io(&path, io::Error::from_raw_os_error(libc::EISDIR)));
            }
            self.opened = Some((sid, file));
        }
        Ok(self.opened.as_ref().expect("opened above"))
    }

    /// [`Beneath::open`], and a descriptor of the file of the caller's own (for a copy to read from).
    pub(super) fn opened(&mut self) -> Result<(SourceId, File), Error> {
        let path = self.inner.source.path_of(self.rel);
        let (sid, file) = self.open()?;
        Ok((*sid, file.try_clone().map_err(|e| Error::io(&path, e))?))
    }

    /// Whether bytes of version `sid` may go to the peer without asking the store: always for an object
    /// store; on a POSIX source, when `sid` is the version of the file already opened beneath, or was
    /// recorded canonical (identified from a descriptor whose own path was `rel`), itself or as the
    /// published entry of `rel` of equal version.
    pub(super) fn vouched(&self, sid: &SourceId) -> bool {
        if !self.applies() || self.opened.as_ref().is_some_and(|(o, _)| o == sid) {
            return true;
        }
        let canonical = |s: &SourceId| s.attrs.is_some_and(|a| a.canonical);
        canonical(sid)
            || self
                .inner
                .lookup
                .published(&key_of(self.rel), self.rel)
                .is_some_and(|e| e.source == *sid && canonical(&e.source))
    }

    /// Whether bytes of version `sid` may go to the peer: [`Beneath::vouched`], or else the file opened
    /// beneath the source (now, if it is not yet) is that version. `Err`: the path leaves the source, or
    /// the file cannot be opened.
    pub(super) fn vouches(&mut self, sid: &SourceId) -> Result<bool, Error> {
        if self.vouched(sid) {
            return Ok(true);
        }
        Ok(self.open()?.0 == *sid)
    }
}

impl Inner {
    /// See [`Cache::open_for_peer`](super::Cache::open_for_peer). On a POSIX source, whatever is served is
    /// vouched for by [`Beneath`]: a path that leaves the source is refused before anything is read.
    pub(super) fn open_for_peer(self: &Arc<Self>, rel: &str, follow: bool) -> Result<Served, Error> {
        let mut beneath = Beneath::new(self, rel);
        // The asker's read is an open of this node's: its first look counts here, a hit or (fetched from
        // the store for it) a miss. Asked only to hold the file, this node prefetches it: nothing counts.
        let mut look = if follow { Look::First } else { Look::Quiet };
        if follow && self.record_checksums {
            if let Some(served) = self.follow_for_peer(rel, &mut beneath, &mut look)? {
                return Ok(served);
            }
        }
        if beneath.applies() {
            return self.whole_for_peer(rel, &mut beneath, look);
        }
        let Native::Whole(file) = self.open_native_looked(rel, false, look)? else {
            unreachable!("a whole-file open never streams")
        };
        let path = self.source.path_of(rel);
        let m = file.metadata().map_err(|e| Error::io(&path, e))?;
        let mtime = m.mtime() * 1_000_000_000 + m.mtime_nsec();
        if let Some(e) = self.lookup.published(&key_of(rel), rel) {
            if e.source.size == m.size() && e.source.mtime_ns == mtime {
                return Ok(Served { file, identity: e.source, checksum: e.checksum, copy: None });
            }
        }
        // Not cached (no tier had room): an object store's bytes in a memory file; its identity is the
        // object's.
        let identity = self.source.identify(rel).map_err(|e| Error::io(&path, e))?;
        Ok(Served { file, identity, checksum: None, copy: None })
    }

    /// A whole copy of `rel` for a peer, from a POSIX source: a current copy a tier holds, when its version
    /// is vouched for, else the copy fetched under the node's fetch lock ([`Inner::lead_for_peer`]: from
    /// the file opened beneath the source, unless another process published a vouched copy meanwhile),
    /// else the file opened beneath the source itself (no tier had room).
    fn whole_for_peer(self: &Arc<Self>, rel: &str, beneath: &mut Beneath<'_>, mut look: Look) -> Result<Served, Error> {
        let key = key_of(rel);
        let mut known = self.known_identity(&key, rel)?;
        for _ in 0..3 {
            match known.filter(|sid| beneath.vouched(sid)) {
                Some(sid) => {
                    if let Some(file) = self.hit(&key, rel, &sid, look.take()).and_then(Reader::into_file) {
                        return Ok(self.served_copy(&key, rel, file, sid));
                    }
                }
                None => self.lookup.count_misses(look.take(), rel),
            }
            match self.flights.join(&key) {
                Role::Leader(lead) => {
                    let mut pre = None;
                    let job = FetchJob { rel, purpose: Purpose::Prefetch, seen: now_ns(), lead };
                    match self.lead_for_peer(job, &mut known, &mut pre, beneath)? {
                        Fetched::Cached | Fetched::Skipped => {}
                        // No tier took it: the file opened beneath the source.
                        _ => break,
                    }
                }
                Role::Follower(flight) => {
                    if let Outcome::Failed(kind, message) = flight.wait() {
                        return Err(self.flight_failed(rel, kind, &message));
                    }
                }
            }
            if known.is_none() {
                known = self.known_identity(&key, rel)?;
            }
        }
        let (sid, file) = beneath.opened()?;
        Ok(Served { file, identity: sid, checksum: None, copy: None })
    }

    /// [`Inner::lead_flight`] for a peer's request on a POSIX source: the version fetched is one
    /// `beneath` vouches for. A known version vouched for without asking the store is fetched as usual
    /// (its copy is read from a descriptor checked to be that very file). Otherwise the node's fetch lock
    /// is taken first, and the index looked at again: a copy another process of the node published
    /// meanwhile, if vouched for, is used as it is, and only then is the file opened beneath the source
    /// (the one open a miss costs), the copy made from that descriptor (left in `pre`, and its version in
    /// `known`). Processes racing for the same cold file thus still send the store one open between them.
    fn lead_for_peer(
        self: &Arc<Self>,
        job: FetchJob<'_>,
        known: &mut Option<SourceId>,
        pre: &mut Option<SourceFile>,
        beneath: &mut Beneath<'_>,
    ) -> Result<Fetched, Error> {
        if !beneath.applies() {
            return self.lead_flight(job, known, pre);
        }
        if let Some(sid) = known.filter(|sid| beneath.vouched(sid)) {
            return self.lead(job, sid, pre);
        }
        let (key, rel) = (*job.key(), job.rel);
        let key = &key;
        let guard = match self.locks.lock(key) {
            Ok(g) => g,
            Err(e) => {
                // Served from the file opened beneath the source, uncached.
                self.fault(None, "fetch-lock", &format!("fetch lock failed: {e}"));
                return Ok(Fetched::Uncached);
            }
        };
        let sid = match self.lookup.published(key, rel).map(|e| self.current_identity(key, rel, &e)) {
            Some(Err(e)) => {
                drop(guard);
                fail_flight(job.lead, &e);
                return Err(e);
            }
            Some(Ok(sid)) if beneath.vouched(&sid) => sid,
            _ => match beneath.opened() {
                Ok((sid, file)) => {
                    *pre = Some(SourceFile::Posix(file));
                    sid
                }
                Err(e) => return Err(e),
            },
        };
        *known = Some(sid);
        self.fetch_locked(job, sid, guard, pre)
    }

    /// A whole copy of version `sid` as served: with the version and blake3 its entry records.
    fn served_copy(&self, key: &Key, rel: &str, file: File, sid: SourceId) -> Served {
        match self.lookup.published(key, rel).filter(|e| e.source == sid) {
            Some(e) => Served { file, identity: e.source, checksum: e.checksum, copy: None },
            None => Served { file, identity: sid, checksum: None, copy: None },
        }
    }

    /// A large file that no tier holds whole yet, served while this process copies it from the store (it
    /// starts the copy, or follows the one it is making already); a copy a tier holds whole is served
    /// whole. `None` when the file is small (copied whole now) or no copy could be made, and the caller
    /// serves it whole. Every version served is vouched for by `beneath`; a copy this request starts is
    /// made from the file opened beneath the source.
    /// `look` is the request's first look at the tiers, taken here (see [`Look::take`]).
    fn follow_for_peer(
        self: &Arc<Self>,
        rel: &str,
        beneath: &mut Beneath<'_>,
        look: &mut Look,
    ) -> Result<Option<Served>, Error> {
        let key = key_of(rel);
        let mut known = self.known_identity(&key, rel)?;
        match known {
            Some(sid) => {
                // Whole in a tier: served as it is (asking the store for the version again is for the
                // whole-file path alone, not both).
                if let Some(file) = self.hit(&key, rel, &sid, look.take()).and_then(Reader::into_file) {
                    if beneath.vouches(&sid)? {
                        let checksum =
                            self.lookup.published(&key, rel).filter(|e| e.source == sid).and_then(|e| e.checksum);
                        return Ok(Some(Served { file, identity: sid, checksum, copy: None }));
                    }
                }
            }
            None => self.lookup.count_misses(look.take(), rel),
        }
        let copy = match self.flights.join(&key) {
            Role::Leader(lead) => {
                // Another process of this node may be copying it already (this node's own load of it).
                let lead = match self.follow_sibling(rel, lead, beneath)? {
                    Ok(served) => return Ok(Some(served)),
                    Err(lead) => lead,
                };
                let mut pre = None;
                let job = FetchJob { rel, purpose: Purpose::Peer, seen: now_ns(), lead };
                match self.lead_for_peer(job, &mut known, &mut pre, beneath)? {
                    Fetched::Reader(r) => match r.backing() {
                        Backing::Growing(g) => g.clone(),
                        _ => return Ok(None),
                    },
                    // No tier has room: the store's own file, opened once already.
                    Fetched::NoRoom => {
                        let (Some(sid), Some(f)) = (known, pre.take()) else { return Ok(None) };
                        let file = self.source_descriptor(rel, Some(f))?;
                        return Ok(Some(Served { file, identity: sid, checksum: None, copy: None }));
                    }
                    // Small, and copied whole now: served as any whole copy.
                    _ => return Ok(None),
                }
            }
            Role::Follower(flight) => match flight.wait() {
                Outcome::Growing(g) if beneath.vouches(g.version())? => g,
                _ => return Ok(None),
            },
        };
        if copy.size() <= crate::hash::PIECE as u64 {
            return Ok(None);
        }
        let file = copy.file().try_clone().map_err(|e| Error::io(&self.source.path_of(rel), e))?;
        Ok(Some(Served { file, identity: *copy.version(), checksum: None, copy: Some(copy) }))
    }

    /// See [`Cache::count_served`](super::Cache::count_served).
    pub(super) fn count_served(&self, bytes: u64) {
        let c = self.source.counters();
        c.add(src_slot::SERVED_FILES, 1);
        c.add(src_slot::SERVED_BYTES, bytes);
    }

    /// See [`Cache::drop_damaged`](super::Cache::drop_damaged).
    pub(super) fn drop_damaged(&self, rel: &str) {
        let key = key_of(rel);
        if let Ok(_guard) = self.locks.lock(&key) {
            self.remove_entries(&key);
        }
        self.fault(None, "peer-damaged-copy", &format!("the copy of {rel} served to a peer was damaged; removed"));
    }

    /// See [`Cache::check_served`](super::Cache::check_served).
    pub(super) fn check_served(&self, rel: &str) -> Result<bool, Error> {
        // Parts may have been served from blocks read from the store: read them again for the next asker.
        self.blocks.forget(rel);
        let key = key_of(rel);
        let Some((i, e)) = self.lookup.published_in(&key, rel) else { return Ok(false) };
        let Some(recorded) = e.checksum else { return Ok(false) };
        // Only a copy of the file the path names beneath the source is the asker's to report (a copy a
        // local open made through a symlink that leaves the source was never sent to it).
        if !Beneath::new(self, rel).vouches(&e.source).unwrap_or(false) {
            return Ok(false);
        }
        let copy = match self.lookup.tiers()[i].open_copy(&key) {
            Ok(f) => f,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(err) => return Err(Error::io(&self.source.path_of(rel), err)),
        };
        let (size, hash) = crate::hash::hash_reader(&copy).map_err(|err| Error::io(&self.source.path_of(rel), err))?;
        if size == e.source.size && hash == recorded {
            return Ok(false);
        }
        self.drop_damaged(rel);
        Ok(true)
    }

    /// Serves a miss from the agent of the node that owns the file. `Err` hands the job back: this node
    /// owns the file, no peer could serve it, or the peer sent another version than `known`, and the
    /// caller goes on to the source. `Ok`: served; the flight has landed, or (a large file a reader
    /// follows as it arrives) lands when the transfer ends.
    pub(super) fn from_peer<'a>(
        self: &Arc<Self>,
        job: FetchJob<'a>,
        known: &mut Option<SourceId>,
    ) -> Result<Fetched, FetchJob<'a>> {
        let (key, rel, purpose) = (*job.key(), job.rel, job.purpose);
        let Some(link) = self.link.as_ref() else { return Err(job) };
        let Some(who) = link.owner(rel) else { return Err(job) };
        // Node-wide single flight: one process of this node asks the owner, the others find its copy.
        let Ok(guard) = self.locks.lock(&key) else { return Err(job) };
        if let Some(fetched) = self.published_meanwhile(&key, rel, *known, purpose) {
            return Ok(fetched);
        }
        if purpose == Purpose::Prefetch && self.config.cluster.sharing != Sharing::Inclusive {
            // Partitioned: the owner keeps it; make sure it does, and keep nothing here.
            let kept = link.kept_by_owner(&who, rel, known);
            drop(guard);
            return if kept { Ok(Fetched::Cached) } else { Err(job) };
        }
        let Some(incoming) = self.ask_owner(link, who, &key, rel, *known) else { return Err(job) };
        let sid = incoming.sid;
        // A large file is followed as it arrives: the reader reads each chunk once it is checked, while the
        // rest comes. (Not a program's descriptor: following a copy, it would need one of the store's file
        // as well, and the job opens each file on the store once.)
        let large = sid.size > self.config.inline_max.max(crate::hash::PIECE as u64);
        if large && purpose == Purpose::Read {
            return self.follow_peer(job, incoming, guard);
        }
        let who = incoming.who.clone();
        let result = match incoming.tier {
            Some(t) => self.receive_into_tier(t, incoming),
            None => self.receive_private(rel, sid, incoming.transfer, purpose).map(|fetched| Received {
                fetched,
                from_peer: sid.size,
                fault: None,
            }),
        };
        drop(guard);
        let Some(fetched) = count_received(link, &who, rel, sid, result) else { return Err(job) };
        *known = Some(sid);
        if let Fetched::Reader(r) = &fetched {
            if let Backing::Memory(bytes) = r.backing() {
                job.lead.deliver(Outcome::Bytes(bytes.clone(), sid));
            }
        }
        Ok(fetched)
    }

    /// The copy of `rel` another process of this node published while this one waited for the fetch lock.
    fn published_meanwhile(&self, key: &Key, rel: &str, known: Option<SourceId>, purpose: Purpose) -> Option<Fetched> {
        let sid = known.or_else(|| self.lookup.published(key, rel).map(|e| e.source))?;
        let r = self.hit(key, rel, &sid, Look::Quiet)?;
        Some(match purpose {
            Purpose::Prefetch | Purpose::Peer => Fetched::Cached,
            Purpose::Read | Purpose::Native => Fetched::Reader(r),
        })
    }

    /// Asks the owner `who` for `rel` (see [`PeerLink::ask`]), and places the copy (in a tier, with
    /// inclusive sharing). `None`, counted: the owner failed, or has another version than `known`.
    fn ask_owner(
        &self,
        link: &Arc<PeerLink>,
        who: String,
        key: &Key,
        rel: &str,
        known: Option<SourceId>,
    ) -> Option<Incoming> {
        let transfer = link.ask(&who, rel, known)?;
        let sid = transfer.found;
        // The owner vouches for the version, not for when the source last showed it: a copy kept here is
        // confirmed against the source before `revalidate = "<duration>"` trusts it.
        let keep = self.config.cluster.sharing == Sharing::Inclusive;
        let tier = if keep { self.place(key, rel, sid, 0) } else { None };
        Some(Incoming { key: *key, rel: rel.to_string(), link: link.clone(), who, sid, transfer, tier })
    }

    /// Receives a large file from its owner in the background, into a copy in its tier (published at
    /// the end) or into private memory, while the caller reads it as it grows ([`Growing`]): each chunk
    /// once it is written and checked. If the transfer fails, the copy fails, and its readers go on from
    /// the source at the same offset (of the same version). The fetch lock and the flight are held until
    /// the transfer ends.
    fn follow_peer<'a>(
        self: &Arc<Self>,
        job: FetchJob<'a>,
        incoming: Incoming,
        guard: FetchGuard,
    ) -> Result<Fetched, FetchJob<'a>> {
        let Incoming { key, rel, link, who, sid, transfer, tier } = incoming;
        let (temp, file, follower) = match self.follow_target(tier, &key, &rel) {
            Ok(d) => d,
            Err(e) => {
                if let Some(t) = tier {
                    self.abort(t, &key);
                }
                link.failed(&who, &rel, &RemoteError::Sink(e));
                return Err(job);
            }
        };
        let growing = Arc::new(Growing::new(follower, sid));
        let lead = job.lead;
        lead.deliver(Outcome::Growing(growing.clone()));
        let backing = Backing::Growing(growing.clone());
        let fetched = Fetched::Reader(Reader::new(backing, sid.size, rel.as_str().into(), self.source.clone()));
        let copy = Followed { key, rel, link, who, sid, tier, temp, file, growing };
        let inner = self.clone();
        self.in_pool(move || {
            inner.receive_followed(copy, transfer);
            drop(guard);
            drop(lead);
        });
        Ok(fetched)
    }

    /// The background half of [`Inner::follow_peer`]: receives the chunks into the copy its readers
    /// follow, then publishes it (in a tier) and counts the peer's hit, or fails it and counts the fault.
    fn receive_followed(&self, c: Followed, transfer: Transfer) {
        let link = &c.link;
        let mut checked = 0;
        let growing = &c.growing;
        let mut usable = |end: u64| {
            checked = end;
            growing.advance(end);
        };
        let received = transfer.receive_into(Dest::Growing(&c.file, &mut usable));
        let kept = received.and_then(|hash| match (c.tier, &c.temp) {
            (Some(t), Some(path)) => {
                self.lookup.tiers()[t].publish_copy(&c.key, path, &c.file, c.sid, Some(hash)).map_err(RemoteError::Sink)
            }
            _ => Ok(()),
        });
        match kept {
            Ok(()) => {
                link.served_whole(&c.who, &c.rel, c.sid.size);
                // The last chunk only now: a reader that reached the end finds the whole file checked,
                // published and counted.
                growing.advance(c.sid.size);
                growing.finish();
            }
            Err(e) => {
                // Its readers go on from the source after the bytes checked: those came from the peer.
                link.served_part(checked);
                growing.fail();
                if let Some(path) = &c.temp {
                    let _ = std::fs::remove_file(path);
                }
                if let Some(t) = c.tier {
                    self.abort(t, &c.key);
                }
                link.failed(&c.who, &c.rel, &e);
            }
        }
    }

    /// Where a followed copy is written (its temporary path in tier `tier`, or none in private memory), the
    /// file written, and the descriptor its readers follow it through (shared-locked in a tier, as the
    /// readers of every growing copy hold it).
    fn follow_target(&self, tier: Option<usize>, key: &Key, rel: &str) -> io::Result<(Option<PathBuf>, File, File)> {
        match tier {
            Some(t) => self.lookup.tiers()[t].create_temp(key).and_then(|(path, f)| {
                let follower = File::open(&path)?;
                lock_shared(&follower)?;
                Ok((Some(path), f, follower))
            }),
            None => memory_file(rel).and_then(|f| {
                let follower = f.try_clone()?;
                Ok((None, f, follower))
            }),
        }
    }

    /// Receives the file into a copy in tier `t` and publishes it there (inclusive sharing). When the owner
    /// `who` fails part of the way, the copy goes on from the source where the checked bytes end, rather
    /// than the whole file being read from the source again. The caller counts the peer's failure once:
    /// the error when the copy failed (the peer's own, when going on from the source failed too), else the
    /// `fault` of the copy finished from the source.
    fn receive_into_tier(&self, t: usize, incoming: Incoming) -> Result<Received, RemoteError> {
        let Incoming { key, rel, who, sid, transfer, .. } = incoming;
        let (key, rel, who) = (&key, rel.as_str(), who.as_str());
        let tier = &self.lookup.tiers()[t];
        let (temp, file) = match tier.create_temp(key) {
            Ok(x) => x,
            Err(e) => {
                self.abort(t, key);
                return Err(RemoteError::Sink(e));
            }
        };
        let mut checked = 0;
        let mut from_peer = sid.size;
        let mut fault = None;
        let received = transfer.receive_into(Dest::Growing(&file, &mut |end| checked = end));
        let received = match received {
            Err(e) if e.member_failed() && checked > 0 => {
                log::debug!("{rel}: peer {who} failed after {checked} B; the rest comes from the store");
                match self.resume_from_source(rel, sid, &file, &temp, checked) {
                    Ok(hash) => {
                        from_peer = checked;
                        fault = Some(e);
                        Ok(hash)
                    }
                    Err(resume) => {
                        log::debug!("{rel}: going on from the store failed too ({resume})");
                        Err(e)
                    }
                }
            }
            other => other,
        };
        let published = received.and_then(|hash| {
            self.lookup.tiers()[t].publish_copy(key, &temp, &file, sid, Some(hash)).map_err(RemoteError::Sink)
        });
        if let Err(e) = published {
            let _ = std::fs::remove_file(&temp);
            self.abort(t, key);
            return Err(e);
        }
        match self.hit(key, rel, &sid, Look::Quiet) {
            Some(r) => Ok(Received { fetched: Fetched::Reader(r), from_peer, fault }),
            None => Err(RemoteError::Sink(io::Error::other("the copy received vanished before it was opened"))),
        }
    }

    /// Copies `[from, size)` of version `sid` of `rel` from the source into `file` (at `path`), whose first
    /// `from` bytes a peer sent and vouched for chunk by chunk; returns the whole copy's hash, read back.
    /// An error when the source holds another version now (the caller then fetches it whole).
    fn resume_from_source(&self, rel: &str, sid: SourceId, file: &File, path: &Path, from: u64) -> io::Result<Hash> {
        use std::os::unix::fs::FileExt;
        let (now, source) = self.open_identified(rel).map_err(io::Error::other)?;
        if now != sid {
            return Err(io::Error::other("the store holds another version than the peer sent"));
        }
        let mut buf = vec![0u8; RESUME_READ.min(sid.size.saturating_sub(from) as usize).max(1)];
        let mut at = from;
        while at < sid.size {
            let want = buf.len().min((sid.size - at) as usize);
            match self.source.read_at(&source, &mut buf[..want], at)? {
                0 => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the store's file ended early")),
                n => {
                    file.write_all_at(&buf[..n], at)?;
                    at += n as u64;
                }
            }
        }
        match crate::hash::hash_file(path)? {
            (len, hash) if len == sid.size => Ok(hash),
            (len, _) => Err(io::Error::other(format!("the copy holds {len} bytes, not {}", sid.size))),
        }
    }

    /// Receives the file into this open's private memory (partitioned sharing, or no tier with room):
    /// a small file into a buffer, a large one into an anonymous memory file.
    fn receive_private(
        &self,
        rel: &str,
        sid: SourceId,
        transfer: Transfer,
        purpose: Purpose,
    ) -> Result<Fetched, RemoteError> {
        if sid.size <= self.config.inline_max && purpose == Purpose::Read {
            let mut bytes = Vec::with_capacity(sid.size as usize);
            transfer.receive_into(Dest::Bytes(&mut bytes))?;
            let backing = Backing::Memory(Arc::new(bytes));
            return Ok(Fetched::Reader(Reader::new(backing, sid.size, rel.into(), self.source.clone())));
        }
        let file = memory_file(rel).map_err(RemoteError::Sink)?;
        transfer.receive_into(Dest::File(&file))?;
        Ok(Fetched::Reader(Reader::new(Backing::Private(file), sid.size, rel.into(), self.source.clone())))
    }
}

/// Counts what a receive of `rel` (`sid`) from `who` gave: the peer's bytes; a hit when the owner sent
/// all of them; a fault once, whether the owner failed or going on from the store did. `None` when
/// nothing usable came.
fn count_received(
    link: &PeerLink,
    who: &str,
    rel: &str,
    sid: SourceId,
    result: Result<Received, RemoteError>,
) -> Option<Fetched> {
    let Received { fetched, from_peer, fault } = result.map_err(|e| link.failed(who, rel, &e)).ok()?;
    if let Some(e) = fault {
        link.failed(who, rel, &e);
    }
    if from_peer == sid.size {
        link.served_whole(who, rel, from_peer);
    } else {
        link.served_part(from_peer);
    }
    Some(fetched)
}
