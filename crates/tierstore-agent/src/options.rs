//! What an agent is started with: its node, sockets and deadlines, the members and the registry, the
//! cache it serves, and where its model streams keep their versions. `tierstore-agent` fills them from
//! its flags and the configuration; tests build them with [`Options::new`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tierstore_core::Cache;

use crate::registry::Registry;
use crate::writeback::Migrations;

/// What the agent is started with.
#[derive(Clone)]
pub struct Options {
    /// This node's name, as peers know it.
    pub node: String,
    /// The Unix socket of local clients.
    pub socket: PathBuf,
    /// Where to listen for peers (none: this node serves no peer).
    pub listen: Option<SocketAddr>,
    /// The job's shared secret; required to listen anywhere but loopback.
    pub token: Option<Vec<u8>>,
    /// Every TCP connection is encrypted (`[cluster] encrypt`): the welcome demands it, and a peer that
    /// sends anything before its key share is refused.
    pub encrypt: bool,
    /// Exit after this long with no connection (an agent started on demand); `None`: run until stopped.
    pub idle_exit: Option<Duration>,
    /// The longest a connection may take to send its hello, or a request's remaining bytes.
    pub deadline: Duration,
    /// The longest a connection may stay silent between requests before it is closed.
    pub idle_connection: Duration,
    /// Connections that proved the token (or, on the node's socket, finished their handshake) served at once;
    /// one more gets an error after its handshake, and its client reads from the store.
    pub max_connections: usize,
    /// The other members' agents (`host:port`), pinged every `heartbeat`.
    pub peers: Vec<String>,
    /// How often peers are pinged; a peer that misses `deadline` is down until it answers again.
    pub heartbeat: Duration,
    /// The node's cache, whose files this agent serves to peers (none: it serves no file).
    pub cache: Option<Arc<Cache>>,
    /// Where to serve Prometheus metrics over HTTP (none: not served).
    pub metrics: Option<SocketAddr>,
    /// This node's agent as the members name it (`host:port`).
    pub me: String,
    /// The job's members, this node included, when they are a fixed list.
    pub job_members: Vec<String>,
    /// Where members register, for an elastic job: this agent registers `me` and heartbeats; the
    /// members are whoever is registered.
    pub registry: Option<Arc<dyn Registry>>,
    /// The job's name in the registry.
    pub job: String,
    /// Where model streams keep their versions (see [`crate::stream`]).
    pub stream: StreamOptions,
    /// Work that keeps an agent started on demand from exiting when idle (files staged for write-back
    /// and not yet on the store).
    pub busy: Option<Arc<dyn Fn() -> bool + Send + Sync>>,
    /// The write-back migration of this node, whose staged files other nodes may read until they are
    /// on the store (none: no staged file is served).
    pub writeback: Option<Arc<Migrations>>,
}

impl Options {
    /// Options with the usual deadlines for `node` on `socket`.
    pub fn new(node: impl Into<String>, socket: impl Into<PathBuf>) -> Options {
        Options {
            node: node.into(),
            socket: socket.into(),
            listen: None,
            token: None,
            encrypt: false,
            idle_exit: None,
            deadline: Duration::from_secs(5),
            idle_connection: Duration::from_secs(300),
            max_connections: 1024,
            peers: Vec::new(),
            heartbeat: Duration::from_millis(500),
            cache: None,
            metrics: None,
            me: String::new(),
            job_members: Vec::new(),
            registry: None,
            job: String::new(),
            stream: StreamOptions::default(),
            busy: None,
            writeback: None,
        }
    }
}

/// Versions kept per stream when none is configured: the one consumers serve and the one before it.
pub const DEFAULT_KEEP: usize = 2;

/// Where streams keep their versions, and how many.
#[derive(Clone, Debug)]
pub struct StreamOptions {
    /// The stream directory (none: on /dev/shm, named after the agent's socket).
    pub dir: Option<PathBuf>,
    /// Versions kept per stream besides leased ones (at least 1).
    pub keep: usize,
    /// The job's Redis (`redis://host:port`), where versions are announced to other nodes and followed
    /// from them (none: streams stay on this node).
    pub redis: Option<String>,
    /// Whether spare files are allocated for the next publish (`stream/spares.rs`).
    pub spares: bool,
}

impl Default for StreamOptions {
    fn default() -> Self {
        StreamOptions { dir: None, keep: DEFAULT_KEEP, redis: None, spares: true }
    }
}
