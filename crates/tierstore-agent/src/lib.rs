//! tierstore-agent: one long-lived process per node that moves bytes between nodes.
//!
//! Local clients (the cache engine in every process of the node, `tierstore agent status|stop`) talk to
//! it over a Unix socket; agents of other nodes over TCP, authenticated by a shared token. This build
//! has the agent's lifecycle, its wire protocol, membership and owner hashing; serving cached files to
//! peers is built on them next (see ARCHITECTURE.md, "The node agent").
#![deny(missing_docs)]

pub mod client;
pub mod members;
pub mod peers;
pub mod protocol;
pub mod server;
