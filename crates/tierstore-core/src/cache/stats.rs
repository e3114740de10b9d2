//! The counters of a cache, as `tierstore status` and the Python API show them: every tier counts hits,
//! misses, bytes and faults; the source counts what it was asked (how the project proves its claims). The
//! counters themselves are node-wide (`counters.rs`); this is their snapshot.

use std::path::PathBuf;

use super::storage::Storage;
use crate::counters::{source as src_slot, tier as tier_slot};
use crate::index::Usage;

/// Counters and usage of one tier, as `tierstore status` shows them.
#[derive(Clone, Debug)]
pub struct TierStats {
    /// The tier's directory as configured.
    pub path: PathBuf,
    /// `"memory"` or `"local"`.
    pub kind: &'static str,
    /// The quota in bytes.
    pub quota: u64,
    /// Opens served from the tier.
    pub hits: u64,
    /// Lookups that did not find a valid copy in the tier.
    pub misses: u64,
    /// Bytes read by jobs from the tier.
    pub bytes_served: u64,
    /// Entries evicted.
    pub evictions: u64,
    /// Cache faults.
    pub faults: u64,
    /// Entries published.
    pub inserts: u64,
    /// Bytes written into the tier.
    pub bytes_written: u64,
    /// Entries, bytes used, fetches in flight.
    pub usage: Usage,
    /// Why the tier is unavailable, if it is.
    pub error: Option<String>,
}

/// Counters of the source.
#[derive(Clone, Copy, Debug, Default)]
pub struct SourceStats {
    /// Files opened on the source.
    pub opens: u64,
    /// `stat` calls.
    pub stats: u64,
    /// `read` calls.
    pub reads: u64,
    /// Bytes read.
    pub bytes_read: u64,
    /// Reads that fell back to the source after a cache fault.
    pub fallbacks: u64,
    /// Opens served from the source because no tier had room.
    pub uncached: u64,
    /// Files received from a peer's agent instead of the source.
    pub peer_hits: u64,
    /// Bytes received from peers.
    pub peer_bytes: u64,
    /// Reads from a peer that failed and went to the source.
    pub peer_faults: u64,
    /// Files this node's agent served to peers.
    pub served_files: u64,
    /// Bytes this node's agent served to peers.
    pub served_bytes: u64,
    /// Listing requests sent to an object store.
    pub lists: u64,
}

/// A snapshot of every counter of a cache.
#[derive(Clone, Debug)]
pub struct Stats {
    /// The source.
    pub source: SourceStats,
    /// Each tier, fastest first.
    pub tiers: Vec<TierStats>,
}

impl Storage {
    /// See [`Cache::stats`](super::Cache::stats).
    pub(super) fn stats(&self) -> Stats {
        let c = self.source().counters();
        let source = SourceStats {
            opens: c.get(src_slot::OPENS),
            stats: c.get(src_slot::STATS),
            reads: c.get(src_slot::READS),
            bytes_read: c.get(src_slot::BYTES_READ),
            fallbacks: c.get(src_slot::FALLBACKS),
            uncached: c.get(src_slot::UNCACHED),
            peer_hits: c.get(src_slot::PEER_HITS),
            peer_bytes: c.get(src_slot::PEER_BYTES),
            peer_faults: c.get(src_slot::PEER_FAULTS),
            served_files: c.get(src_slot::SERVED_FILES),
            served_bytes: c.get(src_slot::SERVED_BYTES),
            lists: c.get(src_slot::LISTS),
        };
        let tiers = self
            .lookup()
            .tiers()
            .iter()
            .map(|t| {
                let (usage, error) = match &t.index {
                    Ok(ix) => match ix.usage() {
                        Ok(u) => (u, None),
                        Err(e) => (Usage::default(), Some(e.to_string())),
                    },
                    Err(e) => (Usage::default(), Some(e.clone())),
                };
                TierStats {
                    path: t.config.path.clone(),
                    kind: t.config.kind.name(),
                    quota: t.config.quota,
                    hits: t.counters.get(tier_slot::HITS),
                    misses: t.counters.get(tier_slot::MISSES),
                    bytes_served: t.counters.get(tier_slot::BYTES_SERVED),
                    evictions: t.counters.get(tier_slot::EVICTIONS),
                    faults: t.counters.get(tier_slot::FAULTS),
                    inserts: t.counters.get(tier_slot::INSERTS),
                    bytes_written: t.counters.get(tier_slot::BYTES_WRITTEN),
                    usage,
                    error,
                }
            })
            .collect();
        Stats { source, tiers }
    }

    /// See [`Cache::reset_counters`](super::Cache::reset_counters).
    pub(super) fn reset_counters(&self) {
        self.source().counters().reset();
        for t in self.lookup().tiers() {
            t.counters.reset();
        }
    }
}
