//! A cache's line to the job's other members, when nodes share their caches: which member owns a file,
//! asking its agent, and what each answer counts. Every request to a peer and every peer read's outcome
//! passes here, so the peer counters (`tierstore status`: peer hits, bytes, faults) and the rule that a
//! failed member is left out for a while are kept in one place. What the engine does with the bytes (a
//! tier copy, a reader following them, the source after a failure) is `peers.rs`'s; serving them is `serve.rs`'s.

use std::sync::Arc;

use super::faults::Faults;
use crate::cluster::remote::{Remote, WINDOW};
use crate::cluster::transfer::{RemoteError, Transfer};
use crate::config::Config;
use crate::counters::{source as src_slot, Counters};
use crate::error::Error;
use crate::index::SourceId;

/// The link to the job's other members (see the module). A cache has one only when it asks peers:
/// sharing is on and it is not the agent's own cache (a request from a peer is never forwarded).
pub(super) struct PeerLink {
    remote: Remote,
    /// The source's counters, where peer hits, bytes and faults are counted.
    counters: Arc<Counters>,
    /// Where a failure is said, once per member.
    faults: Arc<Faults>,
}

impl PeerLink {
    /// The link of a cache of `config`, `None` when it asks no peer. Fails when sharing is on and the
    /// job's token cannot be read.
    pub(super) fn open(
        config: &Config,
        ask_peers: bool,
        counters: Arc<Counters>,
        faults: Arc<Faults>,
    ) -> Result<Option<Arc<PeerLink>>, Error> {
        if !ask_peers || config.cluster.sharing == crate::cluster::Sharing::Off {
            return Ok(None);
        }
        // The configuration checked the token whenever sharing is on; this user's default one is made at
        // its first use.
        let f = config.cluster.token_file.clone().unwrap_or_else(crate::cluster::default_token_file);
        let token = crate::cluster::ensure_token(&f).map_err(|problem| Error::Tier {
            path: f.clone(),
            message: format!("[cluster] token_file: {problem}; {}", crate::cluster::TOKEN_FIX),
        })?;
        let remote = Remote::new(&config.cluster, &config.source.to_string_lossy(), token);
        Ok(Some(Arc::new(PeerLink { remote, counters, faults })))
    }

    /// The member whose agent owns `rel`, when it is another node's and up.
    pub(super) fn owner(&self, rel: &str) -> Option<String> {
        self.remote.owner(rel)
    }

    /// Asks the owner `who` for the whole of `rel`. `None`, counted: the owner failed, or holds another
    /// version than `known` (the one the source showed this process, which is the one served).
    pub(super) fn ask(&self, who: &str, rel: &str, known: Option<SourceId>) -> Option<Transfer> {
        let transfer = self.remote.open(who, rel, WINDOW).map_err(|e| self.failed(who, rel, &e)).ok()?;
        if known.is_some_and(|k| k != transfer.found) {
            let stale = RemoteError::Corrupt { at: who.to_string(), detail: "another version".into() };
            self.failed(who, rel, &stale);
            return None;
        }
        Some(transfer)
    }

    /// Whether the owner `who` holds `rel` (it copies it from the store if it did not): a partitioned
    /// prefetch keeps nothing on this node. `known` learns the version the owner holds.
    pub(super) fn kept_by_owner(&self, who: &str, rel: &str, known: &mut Option<SourceId>) -> bool {
        let confirmed = self.remote.open(who, rel, 0).and_then(|t| {
            *known = Some(t.found);
            t.confirmed()
        });
        confirmed.map_err(|e| self.failed(who, rel, &e)).is_ok()
    }

    /// Asks the member that serves parts of `rel` for `ranges` of it, unhashed (the caller checks every
    /// byte against its own hashes). `None`: no member is up, or the owner failed (counted).
    pub(super) fn ask_ranges(&self, rel: &str, ranges: &[(u64, u64)]) -> Option<(String, Transfer)> {
        let who = self.remote.parts_owner(rel)?;
        match self.remote.open_ranges(&who, rel, ranges, false) {
            Ok(transfer) => Some((who, transfer)),
            Err(e) => {
                self.failed(&who, rel, &e);
                None
            }
        }
    }

    /// Counts a whole answer of `who`, `bytes` long: a peer hit, and the member is up again.
    pub(super) fn served_whole(&self, who: &str, rel: &str, bytes: u64) {
        self.remote.mark_up(who);
        self.counters.add(src_slot::PEER_HITS, 1);
        self.counters.add(src_slot::PEER_BYTES, bytes);
        log::debug!("{rel}: received from peer {who} ({bytes} B)");
    }

    /// Counts the bytes of an answer that stopped part of the way (its failure is counted apart).
    pub(super) fn served_part(&self, bytes: u64) {
        self.counters.add(src_slot::PEER_BYTES, bytes);
    }

    /// Counts a failed peer read, says so once, and leaves a failed member out for a while.
    pub(super) fn failed(&self, who: &str, rel: &str, e: &RemoteError) {
        if e.member_failed() {
            self.remote.mark_down(who);
        }
        self.counters.add(src_slot::PEER_FAULTS, 1);
        self.faults.log_once(
            &format!("peer-{who}"),
            &format!("{e} while reading {rel}; reading from the source instead. Further failures are counted, not logged: see `tierstore status`"),
        );
    }

    /// Counts parts of `rel` from `who` that failed the caller's check (`said`: what telling the owner
    /// gave), and says so once per member.
    pub(super) fn parts_damaged(&self, who: &str, rel: &str, said: &str) {
        self.counters.add(src_slot::PEER_FAULTS, 1);
        self.faults.log_once(
            &format!("parts-{who}"),
            &format!("parts of {rel} from the agent of {who} failed their check ({said}); reading the store instead"),
        );
    }
}
