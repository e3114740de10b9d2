//! The cross-node read path, shared by every process of a job: how the nodes share their caches and who
//! the members are ([`config`], the `[cluster]` table), which member owns a file ([`owners`]), the frames
//! every byte that crosses a process or a node travels in ([`wire`]), the handshake that opens every
//! connection ([`session`]) and the job's token it proves ([`token`]), and the client that reads a file
//! from its owner's agent ([`remote`]), connecting there with [`dial`]. The agent serves the other end
//! (`tierstore_agent::transfer`).

pub mod config;
pub mod dial;
pub mod owners;
pub mod remote;
pub mod seal;
pub mod session;
pub mod token;
pub mod transfer;
pub mod wire;

pub use config::{
    default_socket, expand_hostlist, find_member, hostname, members_of, ClusterConfig, HostlistError, Member, Sharing,
    DEFAULT_PORT, MAX_HOSTS,
};
pub use token::{default_token_file, ensure_token, read_token, MIN_TOKEN_LEN, TOKEN_FIX};
