//! Reading a file another node staged: until a staged file is on the shared store, a reader on another
//! node gets it from the agent of the node that wrote it (docs/design/architecture.md, "Write-back staging").
//!
//! No registry is consulted: the reader asks every other member's agent at once whether it holds `path`
//! staged (a small request, answered from the agent's journal), each under the job's deadlines, and takes
//! the bytes from the one whose copy was closed last. A staged copy is a closed, journaled file: the agent
//! sends it only when its bytes still hash to what the journal recorded at close, and the reader checks
//! that hash before a byte is used, so a partial or changed file is never served. A member that does not
//! answer in time is left out (and marked down, as the cluster cache does) and the reader goes on to the
//! store: a dead node never hangs a reader, though its staged files cannot be read until it is back and
//! has migrated them.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::cluster::remote::{Remote, WINDOW};
use crate::cluster::transfer::RemoteError;
use crate::cluster::wire::ErrorCode;
use crate::cluster::{ClusterConfig, Sharing};

/// The other nodes' agents, asked for files they staged.
pub struct PeerReads {
    remote: Remote,
}

/// A staged copy another node holds.
#[derive(Debug, Clone)]
pub struct Held {
    /// The member that holds it.
    pub from: String,
    /// Its size.
    pub size: u64,
    /// When the program that wrote it closed it (ns since the epoch).
    pub closed_ns: i64,
}

/// A staged file of another node, received whole and checked.
#[derive(Debug)]
pub struct Received {
    /// The member that sent it.
    pub from: String,
    /// Its size.
    pub size: u64,
    /// When the program that wrote it closed it (ns since the epoch).
    pub closed_ns: i64,
}

impl PeerReads {
    /// The members of `cluster` (none when sharing is off: the nodes then know nothing of each other).
    pub fn new(cluster: &ClusterConfig) -> Option<PeerReads> {
        if cluster.sharing == Sharing::Off {
            return None;
        }
        let f = cluster.token_file.clone().unwrap_or_else(crate::cluster::default_token_file);
        let token = match crate::cluster::ensure_token(&f) {
            Ok(t) => t,
            Err(problem) => {
                log::warn!("the token file {} {problem}; staged files of other nodes are not read", f.display());
                return None;
            }
        };
        Some(PeerReads { remote: Remote::new(cluster, "", token) })
    }

    /// The members from the configuration (`[cluster]`, `TIERSTORE_PEERS`, ...), if sharing is on.
    pub fn load() -> Option<PeerReads> {
        match crate::config::load_cluster(&crate::config::Overrides::default()) {
            Ok(c) => PeerReads::new(&c),
            Err(e) => {
                log::warn!("{e}; staged files of other nodes are not read");
                None
            }
        }
    }

    /// The newest staged copy of `path` another node holds (its size and the time it was closed), if
    /// any: what `stat` on this node shows until the file is on the store. One small request to each
    /// member, all at once, each under the job's deadlines.
    pub fn stat(&self, path: &Path) -> Option<Held> {
        self.holders(path).into_iter().max_by_key(|h| h.closed_ns)
    }

    /// Writes the staged copy of `path` held by another node into `into` (a new file, created 0600), if one
    /// holds it. `Ok(None)`: no member that answered holds it staged (read the store). `into` holds
    /// the whole file, checked, only when `Ok(Some)` is returned.
    pub fn fetch(&self, path: &Path, into: &Path) -> Result<Option<Received>, RemoteError> {
        let Some(text) = path.to_str() else { return Ok(None) };
        // The copy closed last is the one the store will hold once every node has migrated.
        let Some(Held { from: who, .. }) = self.stat(path) else { return Ok(None) };
        let transfer = match self.remote.open_staged(&who, text, WINDOW) {
            Ok(t) => t,
            // Migrated between the two requests: the store has it now.
            Err(RemoteError::Refused { code: ErrorCode::NotFound, .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        let (size, closed_ns) = (transfer.found.size, transfer.found.mtime_ns);
        // A new file of the private stage, 0600, never through a link (see `private`).
        let mut f = crate::private::create_new(into).map_err(RemoteError::Sink)?;
        transfer.receive(|_, bytes| f.write_all(bytes))?;
        Ok(Some(Received { from: who, size, closed_ns }))
    }

    /// Every other member that holds `path` staged, asked all at once: the caller waits for the slowest
    /// answer, never for the sum. A member that does not answer in time is left out and marked down.
    fn holders(&self, path: &Path) -> Vec<Held> {
        let Some(text) = path.to_str() else { return Vec::new() };
        let others = self.remote.others();
        if others.is_empty() {
            return Vec::new();
        }
        std::thread::scope(|s| {
            let asks: Vec<_> = others
                .iter()
                .map(|who| {
                    let who = who.clone();
                    s.spawn(move || {
                        let r = self.remote.open_staged(&who, text, 0).and_then(|t| {
                            let (size, closed_ns) = (t.found.size, t.found.mtime_ns);
                            t.confirmed().map(|()| (size, closed_ns))
                        });
                        (who, r)
                    })
                })
                .collect();
            asks.into_iter()
                .filter_map(|h| h.join().ok())
                .filter_map(|(who, r)| match r {
                    Ok((size, closed_ns)) => {
                        self.remote.mark_up(&who);
                        Some(Held { from: who, size, closed_ns })
                    }
                    Err(RemoteError::Refused { code: ErrorCode::NotFound, .. }) => None,
                    Err(e) => {
                        if e.member_failed() {
                            self.remote.mark_down(&who);
                        }
                        log::warn!("asking for the staged file {}: {e}; reading the store", path.display());
                        None
                    }
                })
                .collect()
        })
    }
}

/// A new file for bytes received from a peer, in the stage's data directory (named as staged files are,
/// so that the stage's sweep removes it if this process dies before it is done with it).
pub fn received_path(data_dir: &Path) -> PathBuf {
    data_dir.join(format!("{}.peer", super::journal::new_staged_name()))
}
