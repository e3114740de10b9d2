//! What a cache does with its peers: a miss on a file another node owns is asked of that node's agent
//! before the source (DYAD's lookup order), and the agent of this node serves the files it owns.
//!
//! Never stale and never partial hold across nodes as on one: the owner says which version it sends
//! before the bytes ([`crate::cluster::remote::Transfer::found`]); a reader that already knows the version
//! (`revalidate = "always"`) refuses any other; the bytes are checked against the blake3 recorded when
//! the owner copied them from the source. The owner sends its copy without reading or hashing it (with
//! `sendfile`), so a reader that finds a mismatch tells it, and the owner checks that copy and removes it
//! if it is damaged ([`Cache::check_served`](super::Cache::check_served)). Anything that goes wrong sends
//! the reader to the source, counted, and the job goes on.

use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;

use super::engine::{memory_file, now_ns, Fetched, Inner, Native, Purpose};
use super::flight::{Flight, Outcome, Role};
use super::lock::{lock_shared, FetchGuard};
use crate::cluster::remote::{Dest, RemoteError, Transfer, WINDOW};
use crate::cluster::Sharing;
use crate::counters::source as src_slot;
use crate::error::Error;
use crate::index::{key_of, Key, SourceId};
use crate::reader::{Backing, Growing, Reader};

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

impl Inner {
    /// See [`Cache::open_for_peer`](super::Cache::open_for_peer).
    pub(super) fn open_for_peer(self: &Arc<Self>, rel: &str, follow: bool) -> Result<Served, Error> {
        if follow && self.record_checksums {
            if let Some(served) = self.follow_for_peer(rel)? {
                return Ok(served);
            }
        }
        let Native::Whole(file) = self.open_native_rel(rel, false)? else {
            unreachable!("a whole-file open never streams")
        };
        let path = self.source.path_of(rel);
        let m = file.metadata().map_err(|e| Error::io(&path, e))?;
        let mtime = m.mtime() * 1_000_000_000 + m.mtime_nsec();
        if let Some(e) = self.published(&key_of(rel), rel) {
            if e.source.size == m.size() && e.source.mtime_ns == mtime {
                return Ok(Served { file, identity: e.source, checksum: e.checksum, copy: None });
            }
        }
        // Not cached (no tier had room): the descriptor is the source's own.
        let identity = match self.posix() {
            Some(posix) => posix.identify_file(&file, rel).map_err(|e| Error::io(&path, e))?.0,
            // An object store's bytes in a memory file: its identity is the object's.
            None => self.source.identify(rel).map_err(|e| Error::io(&path, e))?,
        };
        Ok(Served { file, identity, checksum: None, copy: None })
    }

    /// A large file that no tier holds whole yet, served while this process copies it from the store (it
    /// starts the copy, or follows the one it is making already); a copy a tier holds whole is served
    /// whole. `None` when the file is small (copied whole now) or no copy could be made, and the caller
    /// serves it whole.
    fn follow_for_peer(self: &Arc<Self>, rel: &str) -> Result<Option<Served>, Error> {
        let key = key_of(rel);
        let mut known = self.known_identity(&key, rel)?;
        if let Some(sid) = known {
            // Whole in a tier: served as it is (asking the store for the version again is for the
            // whole-file path alone, not both).
            if let Some(file) = self.hit(&key, rel, &sid, false).and_then(Reader::into_file) {
                let checksum = self.published(&key, rel).filter(|e| e.source == sid).and_then(|e| e.checksum);
                return Ok(Some(Served { file, identity: sid, checksum, copy: None }));
            }
        }
        let copy = match self.flights.join(&key) {
            Role::Leader(flight) => {
                // Another process of this node may be copying it already (this node's own load of it).
                if let Some(served) = self.follow_sibling(&key, rel, &flight)? {
                    return Ok(Some(served));
                }
                let mut pre = None;
                match self.lead_flight(&key, rel, &mut known, flight, Purpose::Peer, &mut pre, now_ns())? {
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
                Outcome::Growing(g) => g,
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
        let Some((i, e)) = self.published_in(&key, rel) else { return Ok(false) };
        let Some(recorded) = e.checksum else { return Ok(false) };
        let copy = match self.tiers[i].open_copy(&key) {
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

    /// Serves a miss from the agent of the node that owns the file. `None`: this node owns it, no peer
    /// could serve it, or the peer sent another version than `known`; the caller goes on to the source
    /// (the flight is still the caller's). `Some`: the flight has landed, or (a large file a reader
    /// follows as it arrives) it lands when the transfer ends.
    pub(super) fn from_peer(
        self: &Arc<Self>,
        key: &Key,
        rel: &str,
        known: &mut Option<SourceId>,
        flight: &Arc<Flight>,
        purpose: Purpose,
    ) -> Option<Fetched> {
        let remote = self.remote.as_ref()?;
        let who = remote.owner(rel)?;
        // Node-wide single flight: one process of this node asks the owner, the others find its copy.
        let guard = self.locks.lock(key).ok()?;
        let published = known.or_else(|| self.published(key, rel).map(|e| e.source));
        if let Some(sid) = published {
            if let Some(r) = self.hit(key, rel, &sid, false) {
                drop(guard);
                self.flights.land(key, flight);
                return Some(match purpose {
                    Purpose::Prefetch | Purpose::Peer => Fetched::Cached,
                    Purpose::Read | Purpose::Native => Fetched::Reader(r),
                });
            }
        }
        let keep = self.config.cluster.sharing == Sharing::Inclusive;
        if purpose == Purpose::Prefetch && !keep {
            // Partitioned: the owner keeps it; make sure it does, and keep nothing here.
            let done = remote.open(&who, rel, 0).and_then(|t| {
                *known = Some(t.found);
                t.confirmed()
            });
            drop(guard);
            return match done {
                Ok(()) => {
                    self.flights.land(key, flight);
                    Some(Fetched::Cached)
                }
                Err(e) => {
                    self.peer_failed(&who, rel, &e);
                    None
                }
            };
        }
        let transfer = match remote.open(&who, rel, WINDOW) {
            Ok(t) => t,
            Err(e) => {
                self.peer_failed(&who, rel, &e);
                return None;
            }
        };
        let sid = transfer.found;
        if known.is_some_and(|k| k != sid) {
            // The owner has another version than the source showed this process: take the source's.
            let stale = RemoteError::Corrupt { at: who.clone(), detail: "another version".into() };
            self.peer_failed(&who, rel, &stale);
            return None;
        }
        // The owner vouches for the version, not for when the source last showed it: a copy kept here is
        // confirmed against the source before `revalidate = "<duration>"` trusts it.
        let tier = if keep { self.place(key, rel, sid, 0) } else { None };
        // A large file is followed as it arrives: the reader reads each chunk once it is checked, while the
        // rest comes. (Not a program's descriptor: following a copy, it would need one of the store's file
        // as well, and the job opens each file on the store once.)
        let large = sid.size > self.config.inline_max.max(crate::hash::PIECE as u64);
        if large && purpose == Purpose::Read {
            return self.follow_peer(key, rel, sid, tier, transfer, guard, flight.clone(), who);
        }
        let result = match tier {
            Some(t) => self.receive_into_tier(t, key, rel, sid, transfer),
            None => self.receive_private(rel, sid, transfer, purpose),
        };
        drop(guard);
        match result {
            Ok(fetched) => {
                remote.mark_up(&who);
                let c = self.source.counters();
                c.add(src_slot::PEER_HITS, 1);
                c.add(src_slot::PEER_BYTES, sid.size);
                *known = Some(sid);
                if let Fetched::Reader(r) = &fetched {
                    if let Backing::Memory(bytes) = r.backing() {
                        flight.deliver(Outcome::Bytes(bytes.clone()));
                    }
                }
                self.flights.land(key, flight);
                Some(fetched)
            }
            Err(e) => {
                self.peer_failed(&who, rel, &e);
                None
            }
        }
    }

    /// Receives a large file from its owner `who` in the background, into a copy in tier `t` (published at
    /// the end) or into private memory, while the caller reads it as it grows ([`Growing`]): each chunk
    /// once it is written and checked. If the transfer fails, the copy fails, and its readers go on from
    /// the source at the same offset (of the same version). The fetch lock and the flight are held until
    /// the transfer ends.
    #[allow(clippy::too_many_arguments)]
    fn follow_peer(
        self: &Arc<Self>,
        key: &Key,
        rel: &str,
        sid: SourceId,
        tier: Option<usize>,
        transfer: Transfer,
        guard: FetchGuard,
        flight: Arc<Flight>,
        who: String,
    ) -> Option<Fetched> {
        let dest = match tier {
            Some(t) => self.tiers[t].create_temp(key).and_then(|(path, f)| {
                let follower = File::open(&path)?;
                lock_shared(&follower)?;
                Ok((Some(path), f, follower))
            }),
            None => memory_file(rel).and_then(|f| {
                let follower = f.try_clone()?;
                Ok((None, f, follower))
            }),
        };
        let (temp, file, follower) = match dest {
            Ok(d) => d,
            Err(e) => {
                if let Some(t) = tier {
                    self.abort(t, key);
                }
                self.peer_failed(&who, rel, &RemoteError::Sink(e));
                return None;
            }
        };
        let growing = Arc::new(Growing::new(follower, sid));
        flight.deliver(Outcome::Growing(growing.clone()));
        let fetched =
            Fetched::Reader(Reader::new(Backing::Growing(growing.clone()), sid.size, rel.into(), self.source.clone()));
        let inner = self.clone();
        let (key, rel) = (*key, rel.to_string());
        let job = move || {
            let mut usable = |end: u64| growing.advance(end);
            let received = transfer.receive_into(Dest::Growing(&file, &mut usable));
            let kept = received.and_then(|hash| match (tier, &temp) {
                (Some(t), Some(path)) => {
                    inner.finish_publish(t, &key, path, &file, sid, Some(hash)).map_err(RemoteError::Sink)
                }
                _ => Ok(()),
            });
            match kept {
                Ok(()) => {
                    if let Some(remote) = inner.remote.as_ref() {
                        remote.mark_up(&who);
                    }
                    let c = inner.source.counters();
                    c.add(src_slot::PEER_HITS, 1);
                    c.add(src_slot::PEER_BYTES, sid.size);
                    // The last chunk only now: a reader that reached the end finds the whole file checked,
                    // published and counted.
                    growing.advance(sid.size);
                    growing.finish();
                }
                Err(e) => {
                    growing.fail();
                    if let Some(path) = &temp {
                        let _ = std::fs::remove_file(path);
                    }
                    if let Some(t) = tier {
                        inner.abort(t, &key);
                    }
                    inner.peer_failed(&who, &rel, &e);
                }
            }
            drop(guard);
            inner.flights.land(&key, &flight);
        };
        match self.pool() {
            Some(pool) => pool.urgent(job),
            None => job(),
        }
        Some(fetched)
    }

    /// Counts a failed peer read, says so once, and leaves a failed member out for a while.
    pub(super) fn peer_failed(&self, who: &str, rel: &str, e: &RemoteError) {
        let Some(remote) = self.remote.as_ref() else { return };
        if e.member_failed() {
            remote.mark_down(who);
        }
        self.source.counters().add(src_slot::PEER_FAULTS, 1);
        self.log_once(
            &format!("peer-{who}"),
            &format!("{e} while reading {rel}; reading from the source instead. Further failures are counted, not logged: see `tierstore status`"),
        );
    }

    /// Receives the file into a copy in tier `t` and publishes it there (inclusive sharing).
    fn receive_into_tier(
        &self,
        t: usize,
        key: &Key,
        rel: &str,
        sid: SourceId,
        transfer: Transfer,
    ) -> Result<Fetched, RemoteError> {
        let tier = &self.tiers[t];
        let (temp, file) = match tier.create_temp(key) {
            Ok(x) => x,
            Err(e) => {
                self.abort(t, key);
                return Err(RemoteError::Sink(e));
            }
        };
        let received = transfer.receive_into(Dest::File(&file));
        let published = received
            .and_then(|hash| self.finish_publish(t, key, &temp, &file, sid, Some(hash)).map_err(RemoteError::Sink));
        if let Err(e) = published {
            let _ = std::fs::remove_file(&temp);
            self.abort(t, key);
            return Err(e);
        }
        match self.hit(key, rel, &sid, false) {
            Some(r) => Ok(Fetched::Reader(r)),
            None => Err(RemoteError::Sink(io::Error::other("the copy received vanished before it was opened"))),
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
