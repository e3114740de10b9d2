//! tierstore-agent: one long-lived process per node that moves bytes between nodes.
//!
//! Local clients (the cache engine in every process of the node, `tierstore agent status|stop`) talk to
//! it over a Unix socket; agents of other nodes over TCP, authenticated by a shared token. The agent
//! serves the files of its node's cache to the processes of other nodes ([`transfer`]); the wire
//! protocol and the owner hashing live in `tierstore_core::cluster` (`wire`, `owners`), because the read path of
//! every process speaks them too (see docs/design/architecture.md, "The node agent").
#![deny(missing_docs)]

pub mod client;
pub mod members;
pub mod metrics;
pub mod options;
pub mod protocol;
pub mod registry;
pub mod sendfile;
pub mod server;
pub mod status;
pub mod stream;
pub mod transfer;
pub mod writeback;
