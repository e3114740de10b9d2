//! The peers step of the read path: a miss on a file another node owns is asked of that node's agent
//! before the source (DYAD's lookup order). [`Peers`] owns the line to the job's other members; it stands
//! on [`Storage`] and on the [`Fetcher`] (whose locks single-flight the ask across this node's processes,
//! and whose placement reserves the copy's room), and calls nothing above them. The other half, this
//! node's agent serving the files it owns, is `serve.rs`.
//!
//! Never stale and never partial hold across nodes as on one: the owner says which version it sends
//! before the bytes ([`crate::cluster::transfer::Transfer::found`]); a reader that already knows the version
//! (`revalidate = "always"`) refuses any other; the bytes are checked against the blake3 recorded when
//! the owner copied them from the source. The owner sends its copy without reading or hashing it (with
//! `sendfile`), so a reader that finds a mismatch tells it, and the owner checks that copy and removes it
//! if it is damaged ([`Cache::check_served`](super::Cache::check_served)). Anything that goes wrong sends
//! the reader to the source, counted, and the job goes on.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::fetch::Fetcher;
use super::flight::Outcome;
use super::job::{FetchJob, Fetched, Purpose};
use super::link::PeerLink;
use super::lock::{lock_shared, FetchGuard};
use super::lookup::Look;
use super::parts::Parts;
use super::storage::{memory_file, Storage};
use crate::cluster::transfer::{Dest, RemoteError, Transfer};
use crate::cluster::Sharing;
use crate::hash::Hash;
use crate::index::{Key, SourceId};
use crate::reader::{Backing, Growing};

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

/// The peers step (see the module): the line to the job's other members, and what a received file needs.
pub(super) struct Peers {
    storage: Arc<Storage>,
    fetcher: Arc<Fetcher>,
    link: Arc<PeerLink>,
}

impl Peers {
    pub(super) fn new(storage: Arc<Storage>, fetcher: Arc<Fetcher>, link: Arc<PeerLink>) -> Peers {
        Peers { storage, fetcher, link }
    }

    /// Asks the owner of `rel` for the byte `ranges` of it (see [`PeerLink::ask_ranges`]); `None` when
    /// this node owns it, there are too many ranges for one request, or no peer could serve them.
    pub(super) fn ask_parts(&self, rel: &str, ranges: &[(u64, u64)]) -> Option<Parts> {
        if ranges.len() > crate::cluster::wire::MAX_RANGES {
            return None;
        }
        let (who, transfer) = self.link.ask_ranges(rel, ranges)?;
        Some(Parts::new(transfer, who, rel.to_string(), self.link.clone()))
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
        let link = &self.link;
        let Some(who) = link.owner(rel) else { return Err(job) };
        // Node-wide single flight: one process of this node asks the owner, the others find its copy.
        let Ok(guard) = self.fetcher.lock(&key) else { return Err(job) };
        if let Some(fetched) = self.published_meanwhile(&key, rel, *known, purpose) {
            return Ok(fetched);
        }
        if purpose == Purpose::Prefetch && self.storage.config().cluster.sharing != Sharing::Inclusive {
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
        let large = sid.size > self.storage.config().inline_max.max(crate::hash::PIECE as u64);
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
        let sid = known.or_else(|| self.storage.lookup().published(key, rel).map(|e| e.source))?;
        let r = self.storage.hit(key, rel, &sid, Look::Quiet)?;
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
        let keep = self.storage.config().cluster.sharing == Sharing::Inclusive;
        let tier = if keep { self.fetcher.place(key, rel, sid, 0) } else { None };
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
                    self.fetcher.abort(t, &key);
                }
                link.failed(&who, &rel, &RemoteError::Sink(e));
                return Err(job);
            }
        };
        let growing = Arc::new(Growing::new(follower, sid));
        let lead = job.lead;
        lead.deliver(Outcome::Growing(growing.clone()));
        let backing = Backing::Growing(growing.clone());
        let fetched = Fetched::Reader(self.storage.reader(backing, sid.size, &rel));
        let copy = Followed { key, rel, link, who, sid, tier, temp, file, growing };
        let peers = self.clone();
        self.fetcher.in_pool(move || {
            peers.receive_followed(copy, transfer);
            drop(guard);
            drop(lead);
        });
        Ok(fetched)
    }

    /// The background half of [`Peers::follow_peer`]: receives the chunks into the copy its readers
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
            (Some(t), Some(path)) => self.storage.lookup().tiers()[t]
                .publish_copy(&c.key, path, &c.file, c.sid, Some(hash))
                .map(|()| hash)
                .map_err(RemoteError::Sink),
            _ => Ok(hash),
        });
        match kept {
            Ok(hash) => {
                link.served_whole(&c.who, &c.rel, c.sid.size);
                // The last chunk only now (`finish`): a reader that reached the end finds the whole file
                // checked, published and counted.
                growing.finish(Some(hash));
            }
            Err(e) => {
                // Its readers go on from the source after the bytes checked: those came from the peer.
                link.served_part(checked);
                growing.fail();
                if let Some(path) = &c.temp {
                    let _ = std::fs::remove_file(path);
                }
                if let Some(t) = c.tier {
                    self.fetcher.abort(t, &c.key);
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
            Some(t) => self.storage.lookup().tiers()[t].create_temp(key).and_then(|(path, f)| {
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
        let tier = &self.storage.lookup().tiers()[t];
        let (temp, file) = match tier.create_temp(key) {
            Ok(x) => x,
            Err(e) => {
                self.fetcher.abort(t, key);
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
            self.storage.lookup().tiers()[t].publish_copy(key, &temp, &file, sid, Some(hash)).map_err(RemoteError::Sink)
        });
        if let Err(e) = published {
            let _ = std::fs::remove_file(&temp);
            self.fetcher.abort(t, key);
            return Err(e);
        }
        match self.storage.hit(key, rel, &sid, Look::Quiet) {
            Some(r) => Ok(Received { fetched: Fetched::Reader(r), from_peer, fault }),
            None => Err(RemoteError::Sink(io::Error::other("the copy received vanished before it was opened"))),
        }
    }

    /// Copies `[from, size)` of version `sid` of `rel` from the source into `file` (at `path`), whose first
    /// `from` bytes a peer sent and vouched for chunk by chunk; returns the whole copy's hash, read back.
    /// An error when the source holds another version now (the caller then fetches it whole).
    fn resume_from_source(&self, rel: &str, sid: SourceId, file: &File, path: &Path, from: u64) -> io::Result<Hash> {
        use std::os::unix::fs::FileExt;
        let (now, source) = self.storage.open_identified(rel).map_err(io::Error::other)?;
        if now != sid {
            return Err(io::Error::other("the store holds another version than the peer sent"));
        }
        let mut buf = vec![0u8; RESUME_READ.min(sid.size.saturating_sub(from) as usize).max(1)];
        let mut at = from;
        while at < sid.size {
            let want = buf.len().min((sid.size - at) as usize);
            match self.storage.source().read_at(&source, &mut buf[..want], at)? {
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
        if sid.size <= self.storage.config().inline_max && purpose == Purpose::Read {
            let mut bytes = Vec::with_capacity(sid.size as usize);
            transfer.receive_into(Dest::Bytes(&mut bytes))?;
            let backing = Backing::Memory(Arc::new(bytes));
            return Ok(Fetched::Reader(self.storage.reader(backing, sid.size, rel)));
        }
        let file = memory_file(rel).map_err(RemoteError::Sink)?;
        transfer.receive_into(Dest::File(&file))?;
        Ok(Fetched::Reader(self.storage.reader(Backing::Private(file), sid.size, rel)))
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
