//! What one fetch is, as it goes down the read path: why it is fetched ([`Purpose`]), the job its leader
//! carries ([`FetchJob`]) and what a step hands back ([`Fetched`]). Below the engine, the peers step and the
//! fetch step, which all take them, so that none imports another for them.

use std::fs::File;
use std::sync::Arc;

use super::flight::Lead;
use crate::index::Key;
use crate::reader::{Growing, Reader};

/// What a fetch step (the peers', or the fetch under the lock) produced.
pub(super) enum Fetched {
    Reader(Reader),
    /// A large file whose copy has started: a descriptor of the source for the program, and the copy.
    Streaming(File, Arc<Growing>),
    Cached,
    Uncached,
    /// A prefetch found no tier with room.
    NoRoom,
    /// Already cached, or being fetched by another thread or process.
    Skipped,
}

/// What the fetch under the lock is for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Purpose {
    /// A reader waits for the bytes.
    Read,
    /// Warm the cache; nobody waits.
    Prefetch,
    /// A program wants a real descriptor: a small file is fetched whole first, a large one is copied in
    /// the background while the program holds a descriptor of the source.
    Native,
    /// This node's agent serves the file to a peer: a small file is fetched whole first (as a prefetch), a
    /// large one is copied in the background and sent as it grows.
    Peer,
}

/// One fetch as its leader carries it down the read path: the file, why it is fetched, when the source
/// last showed its version, and the lead of its flight. Whoever holds the job fetches; the flight lands
/// when the job (its lead) is dropped, on return or when the background copy it was handed to ends.
pub(super) struct FetchJob<'a> {
    /// The file, relative to the source.
    pub rel: &'a str,
    /// Who asked, which decides what a fetch hands back.
    pub purpose: Purpose,
    /// A time at or before which the source showed the version fetched (or will show the one the leader
    /// opens): its copy records it as confirmed.
    pub seen: u64,
    /// The lead of the file's in-process flight.
    pub lead: Lead,
}

impl FetchJob<'_> {
    /// The index key of the file.
    pub fn key(&self) -> &Key {
        self.lead.key()
    }
}
