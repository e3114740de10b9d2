//! This node's agent serving the files it owns to its peers (the other half of `peers.rs`): a whole copy,
//! or a large one sent as it grows, fetched from the store for the asker when this node has none. It sits
//! above the engine's read path, which it uses as any open does.
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
use std::sync::Arc;

use super::engine::{Inner, Native};
use super::fetch::fail_flight;
use super::flight::{Outcome, Role};
use super::job::{FetchJob, Fetched, Purpose};
use super::lookup::Look;
use crate::clock::now_ns;
use crate::counters::source as src_slot;
use crate::error::Error;
use crate::index::{key_of, Key, SourceId};
use crate::reader::{Backing, Growing, Reader};
use crate::source::SourceFile;

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
        self.inner.storage().posix().is_some()
    }

    /// The file opened beneath the source, and its version (identified from the open descriptor): opened
    /// now if it is not yet. A path that leaves the source is an error that says so.
    pub(super) fn open(&mut self) -> Result<&(SourceId, File), Error> {
        if self.opened.is_none() {
            let path = self.inner.storage().source().path_of(self.rel);
            let posix =
                self.inner.storage().posix().ok_or_else(|| Error::io(&path, super::storage::no_descriptor()))?;
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
        let path = self.inner.storage().source().path_of(self.rel);
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
                .storage()
                .lookup()
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
        if follow && self.fetcher().records_checksums() {
            if let Some(served) = self.follow_for_peer(rel, &mut beneath, &mut look)? {
                return Ok(served);
            }
        }
        if beneath.applies() {
            return self.whole_for_peer(rel, &mut beneath, look);
        }
        let file = match self.open_native_looked(rel, false, look)? {
            Native::Whole(file) | Native::FromStore { file, .. } => file,
            Native::Copying { .. } => unreachable!("a whole-file open never streams"),
        };
        let m = file.metadata().map_err(|e| self.storage().error(rel, e))?;
        let mtime = m.mtime() * 1_000_000_000 + m.mtime_nsec();
        if let Some(e) = self.storage().lookup().published(&key_of(rel), rel) {
            if e.source.size == m.size() && e.source.mtime_ns == mtime {
                return Ok(Served { file, identity: e.source, checksum: e.checksum, copy: None });
            }
        }
        // Not cached (no tier had room): an object store's bytes in a memory file; its identity is the
        // object's.
        let identity = self.storage().identify(rel)?;
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
                    if let Some(file) = self.storage().hit(&key, rel, &sid, look.take()).and_then(Reader::into_file) {
                        return Ok(self.served_copy(&key, rel, file, sid));
                    }
                }
                None => self.storage().lookup().count_misses(look.take(), rel),
            }
            match self.fetcher().join(&key) {
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
                        return Err(self.storage().flight_failed(rel, kind, &message));
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
            return self.fetcher().lead(job, sid, pre);
        }
        let (key, rel) = (*job.key(), job.rel);
        let key = &key;
        // Without the lock: served from the file opened beneath the source, uncached.
        let Some(guard) = self.fetcher().lock_or_fault(key) else { return Ok(Fetched::Uncached) };
        let sid = match self.storage().lookup().published(key, rel).map(|e| self.current_identity(key, rel, &e)) {
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
        self.fetcher().fetch_locked(job, sid, guard, pre)
    }

    /// A whole copy of version `sid` as served: with the version and blake3 its entry records.
    fn served_copy(&self, key: &Key, rel: &str, file: File, sid: SourceId) -> Served {
        match self.storage().lookup().published(key, rel).filter(|e| e.source == sid) {
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
                if let Some(file) = self.storage().hit(&key, rel, &sid, look.take()).and_then(Reader::into_file) {
                    if beneath.vouches(&sid)? {
                        let checksum = self
                            .storage()
                            .lookup()
                            .published(&key, rel)
                            .filter(|e| e.source == sid)
                            .and_then(|e| e.checksum);
                        return Ok(Some(Served { file, identity: sid, checksum, copy: None }));
                    }
                }
            }
            None => self.storage().lookup().count_misses(look.take(), rel),
        }
        let copy = match self.fetcher().join(&key) {
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
                        let file = self.storage().source_descriptor(rel, Some(f))?;
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
        let file = copy.file().try_clone().map_err(|e| self.storage().error(rel, e))?;
        Ok(Some(Served { file, identity: *copy.version(), checksum: None, copy: Some(copy) }))
    }

    /// See [`Cache::count_served`](super::Cache::count_served).
    pub(super) fn count_served(&self, bytes: u64) {
        let c = self.storage().source().counters();
        c.add(src_slot::SERVED_FILES, 1);
        c.add(src_slot::SERVED_BYTES, bytes);
    }

    /// See [`Cache::drop_damaged`](super::Cache::drop_damaged).
    pub(super) fn drop_damaged(&self, rel: &str) {
        let key = key_of(rel);
        if let Ok(_guard) = self.fetcher().lock(&key) {
            self.fetcher().remove_entries(&key);
        }
        self.storage().fault(
            None,
            "peer-damaged-copy",
            &format!("the copy of {rel} served to a peer was damaged; removed"),
        );
    }

    /// See [`Cache::check_served`](super::Cache::check_served).
    pub(super) fn check_served(&self, rel: &str) -> Result<bool, Error> {
        // Parts may have been served from blocks read from the store: read them again for the next asker.
        self.blocks().forget(rel);
        let key = key_of(rel);
        let Some((i, e)) = self.storage().lookup().published_in(&key, rel) else { return Ok(false) };
        let Some(recorded) = e.checksum else { return Ok(false) };
        // Only a copy of the file the path names beneath the source is the asker's to report (a copy a
        // local open made through a symlink that leaves the source was never sent to it).
        if !Beneath::new(self, rel).vouches(&e.source).unwrap_or(false) {
            return Ok(false);
        }
        let copy = match self.storage().lookup().tiers()[i].open_copy(&key) {
            Ok(f) => f,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(err) => return Err(self.storage().error(rel, err)),
        };
        let (size, hash) = crate::hash::hash_reader(&copy).map_err(|err| self.storage().error(rel, err))?;
        if size == e.source.size && hash == recorded {
            return Ok(false);
        }
        self.drop_damaged(rel);
        Ok(true)
    }
}
