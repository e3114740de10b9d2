//! The cross-node read path, shared by every process of a job: how the nodes share their caches and who
//! the members are ([`config`], the `[cluster]` table), which member owns a file ([`owners`]), the frames
//! every byte that crosses a process or a node travels in ([`wire`]), and the client that reads a file
//! from its owner's agent ([`remote`]). The agent serves the other end (`tierstore_agent::transfer`).

pub mod config;
pub mod owners;
pub mod remote;
pub mod wire;

pub use config::{
    default_socket, expand_hostlist, find_member, hostname, members_of, read_token, ClusterConfig, HostlistError,
    Member, Sharing, DEFAULT_PORT, KEYS, MAX_HOSTS, MIN_TOKEN_LEN, TOKEN_FIX,
};
