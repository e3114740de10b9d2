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

use super::engine::{memory_file, Fetched, Inner, Native, Purpose};
use super::flight::{Flight, Outcome};
use crate::cluster::remote::{Dest, RemoteError, Transfer, WINDOW};
use crate::cluster::Sharing;
use crate::counters::source as src_slot;
use crate::error::Error;
use crate::index::{key_of, Key, SourceId};
use crate::reader::{Backing, Reader};

/// A file this node's agent serves to a peer: an open descriptor of exactly the version `identity`.
pub struct Served {
    /// The tier copy (or the source file, when no tier had room).
    pub file: File,
    /// The version.
    pub identity: SourceId,
    /// The blake3 recorded when the copy was made from the source, if one was.
    pub checksum: Option<[u8; 32]>,
}

impl Inner {
    /// See [`Cache::open_for_peer`](super::Cache::open_for_peer).
    pub(super) fn open_for_peer(self: &Arc<Self>, rel: &str) -> Result<Served, Error> {
        let Native::Whole(file) = self.open_native_rel(rel, false)? else {
            unreachable!("a whole-file open never streams")
        };
        let path = self.source.path_of(rel);
        let m = file.metadata().map_err(|e| Error::io(&path, e))?;
        let mtime = m.mtime() * 1_000_000_000 + m.mtime_nsec();
        if let Some(e) = self.published(&key_of(rel), rel) {
            if e.source.size == m.size() && e.source.mtime_ns == mtime {
                return Ok(Served { file, identity: e.source, checksum: e.checksum });
            }
        }
        // Not cached (no tier had room): the descriptor is the source's own.
        let identity = match self.posix() {
            Some(posix) => posix.identify_file(&file, rel).map_err(|e| Error::io(&path, e))?.0,
            // An object store's bytes in a memory file: its identity is the object's.
            None => self.source.identify(rel).map_err(|e| Error::io(&path, e))?,
        };
        Ok(Served { file, identity, checksum: None })
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
    /// (the flight is still the caller's). `Some`: the flight has landed.
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
                    Purpose::Prefetch => Fetched::Cached,
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

    /// Counts a failed peer read, says so once, and leaves a failed member out for a while.
    fn peer_failed(&self, who: &str, rel: &str, e: &RemoteError) {
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
