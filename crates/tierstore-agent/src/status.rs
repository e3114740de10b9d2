//! The agent's report of itself (`tierstore agent status`, and the Prometheus metrics rendered from it):
//! its connections, how it sees the other members, what its node's cache holds and moved, and its model
//! streams' settings. Serialized as JSON on the wire: the Python side reads these names.

use serde::Serialize;

use tierstore_core::Cache;

use crate::members::PeerView;

/// The agent's report of itself (`tierstore agent status`).
#[derive(Clone, Debug, Serialize)]
pub struct Status {
    /// This node's name.
    pub node: String,
    /// The agent's process.
    pub pid: u32,
    /// The wire protocol version.
    pub protocol: u8,
    /// Seconds since start.
    pub uptime_s: f64,
    /// The Unix socket.
    pub socket: String,
    /// The peer listener, if any.
    pub listen: Option<String>,
    /// Connections open now.
    pub connections: u64,
    /// Connections accepted since start.
    pub connections_total: u64,
    /// Connections refused for a wrong or missing token or another protocol version, and connections
    /// closed before their handshake to make room for newer ones (a flood's; see `server/budget.rs`).
    pub refused: u64,
    /// Connections closed for missing a deadline.
    pub timeouts: u64,
    /// Exits after this many seconds without a connection (started on demand), if set.
    pub idle_exit_s: Option<f64>,
    /// How this agent sees the other members.
    pub members: Vec<PeerView>,
    /// What this node's cache holds and moved, when the agent serves one.
    pub cache: Option<CacheView>,
    /// The job's name in the registry, if the members register in one.
    pub registry_job: Option<String>,
    /// Registry calls that failed, and entries found in the registry and refused (each once: not written
    /// with the job's token, or claiming an end they cannot have; see [`crate::registry::Registry::refused`]).
    pub registry_errors: u64,
    /// Where model stream versions are kept.
    pub stream_dir: String,
    /// Versions kept per stream besides the leased ones.
    pub stream_keep: usize,
    /// The Redis that stream versions are announced in, if any.
    pub stream_redis: Option<String>,
    /// What write-back migration did, when the agent migrates.
    pub writeback: Option<WritebackView>,
}

/// The agent's write-back migration in its status: what it moved, and what it refused.
#[derive(Clone, Debug, Serialize)]
pub struct WritebackView {
    /// Files migrated to the shared store since start.
    pub migrated_files: u64,
    /// Their bytes.
    pub migrated_bytes: u64,
    /// Failed migration attempts since start.
    pub failures: u64,
    /// Journal entries refused (each once): their destination is not beneath a destination configured
    /// (or listed) with their stage. They are never written and stay in the journal.
    pub refused_entries: u64,
    /// Stages refused (each once): not a directory of the agent's user only that user can write.
    pub refused_stages: u64,
}

impl WritebackView {
    /// What `m` did so far.
    pub fn of(m: &crate::writeback::Migrations) -> WritebackView {
        use std::sync::atomic::Ordering::Relaxed;
        WritebackView {
            migrated_files: m.files.load(Relaxed),
            migrated_bytes: m.bytes.load(Relaxed),
            failures: m.failures.load(Relaxed),
            refused_entries: m.refused_entries.load(Relaxed),
            refused_stages: m.refused_stages.load(Relaxed),
        }
    }
}

/// A node's cache in the agent's status: what `tierstore status` shows for each member.
#[derive(Clone, Debug, Serialize)]
pub struct CacheView {
    /// The source directory.
    pub source: String,
    /// Bytes held in the node's tiers.
    pub cached_bytes: u64,
    /// The tiers' quotas, summed.
    pub quota: u64,
    /// Bytes the node read from the store.
    pub store_bytes: u64,
    /// Files and bytes the node's processes received from peers.
    pub peer_hits: u64,
    /// Bytes received from peers.
    pub peer_bytes: u64,
    /// Peer reads that failed and went to the store.
    pub peer_faults: u64,
    /// Files the node's agent served to peers.
    pub served_files: u64,
    /// Bytes served to peers.
    pub served_bytes: u64,
}

impl CacheView {
    /// What `cache` holds and moved now.
    pub fn of(cache: &Cache) -> CacheView {
        let s = cache.stats();
        CacheView {
            source: cache.config().source.display().to_string(),
            cached_bytes: s.tiers.iter().map(|t| t.usage.used).sum(),
            quota: s.tiers.iter().map(|t| t.quota).sum(),
            store_bytes: s.source.bytes_read,
            peer_hits: s.source.peer_hits,
            peer_bytes: s.source.peer_bytes,
            peer_faults: s.source.peer_faults,
            served_files: s.source.served_files,
            served_bytes: s.source.served_bytes,
        }
    }
}
