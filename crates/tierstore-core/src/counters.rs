//! Node-wide counters in a small shared memory-mapped file.
//!
//! Every process of the node maps the same file and adds to it with atomic instructions, so a `tierstore
//! status` run from another shell sees what all DataLoader workers did, at the cost of one atomic add
//! (nanoseconds) per event, far below what an index write per hit would cost.

use std::io;
use std::path::Path;
use std::sync::atomic::Ordering;

use crate::shared_words::SharedWords;

const MAGIC: u64 = 0x7469_6572_636e_7431; // "tiercnt1"
const SLOTS: usize = 32;

/// A fixed array of shared `u64` counters.
pub struct Counters {
    words: SharedWords,
}

impl Counters {
    /// Maps (creating if needed, mode 0600) the counter file at `path`, never through a symbolic link: the
    /// file is written, and a link planted in its place must not make this process write elsewhere.
    pub fn open(path: &Path) -> io::Result<Counters> {
        let file = crate::private::open_nofollow(path, false, true)?;
        let c = Counters { words: SharedWords::map(&file, SLOTS + 1)? };
        // A new file is all zeros; stamping it lets a future layout change recognise old files.
        let _ = c.words.word(SLOTS).compare_exchange(0, MAGIC, Ordering::Relaxed, Ordering::Relaxed);
        Ok(c)
    }

    /// Adds `n` to counter `i`.
    #[inline]
    pub fn add(&self, i: usize, n: u64) {
        self.words.word(i).fetch_add(n, Ordering::Relaxed);
    }

    /// Reads counter `i`.
    pub fn get(&self, i: usize) -> u64 {
        self.words.word(i).load(Ordering::Relaxed)
    }

    /// Sets every counter back to zero.
    pub fn reset(&self) {
        for i in 0..SLOTS {
            self.words.word(i).store(0, Ordering::Relaxed);
        }
    }
}

/// Counter slots of a tier.
pub mod tier {
    /// Opens served from the tier.
    pub const HITS: usize = 0;
    /// Lookups that reached the tier and did not find a valid entry.
    pub const MISSES: usize = 1;
    /// Bytes read by jobs from the tier's copies.
    pub const BYTES_SERVED: usize = 2;
    /// Entries evicted to make room.
    pub const EVICTIONS: usize = 3;
    /// Cache faults in this tier (I/O errors, corrupt or truncated copies, full disk).
    pub const FAULTS: usize = 4;
    /// Entries published into the tier.
    pub const INSERTS: usize = 5;
    /// Bytes written into the tier.
    pub const BYTES_WRITTEN: usize = 6;
}

/// Counter slots of the source.
pub mod source {
    /// Files opened on the source.
    pub const OPENS: usize = 0;
    /// `stat` calls sent to the source.
    pub const STATS: usize = 1;
    /// `read` calls sent to the source.
    pub const READS: usize = 2;
    /// Bytes read from the source.
    pub const BYTES_READ: usize = 3;
    /// Reads that fell back to the source because of a cache fault.
    pub const FALLBACKS: usize = 4;
    /// Opens served straight from the source because no tier had room.
    pub const UNCACHED: usize = 5;
    /// Files this node's processes received from a peer's agent instead of the source.
    pub const PEER_HITS: usize = 6;
    /// Bytes received from peers.
    pub const PEER_BYTES: usize = 7;
    /// Reads from a peer that failed (dead, slow, refusing, damaged bytes) and went to the source.
    pub const PEER_FAULTS: usize = 8;
    /// Files this node's agent served to peers.
    pub const SERVED_FILES: usize = 9;
    /// Bytes this node's agent served to peers.
    pub const SERVED_BYTES: usize = 10;
    /// Listing requests sent to an object store (one per thousand keys).
    pub const LISTS: usize = 11;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_mappings_share_counts() {
        let dir = tempfile::tempdir().unwrap();
        let a = Counters::open(&dir.path().join("c")).unwrap();
        let b = Counters::open(&dir.path().join("c")).unwrap();
        a.add(3, 5);
        b.add(3, 2);
        assert_eq!(a.get(3), 7);
        a.reset();
        assert_eq!(b.get(3), 0);
    }
}
