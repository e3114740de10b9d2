//! The blocks a node's agent keeps of files it serves parts of (see `parts.rs`): read from the store once,
//! in runs of up to [`RUN`] blocks, and kept in memory, least recently used out first, within a budget
//! (`TIERSTORE_PART_BLOCKS_MIB`, 1 GiB unless set). Several nodes asking for the same tensors at once are
//! served from one read of the store: the first asker of a block reads it, the others wait for it.
//! Blocks are kept per version (size and modification time), so a file changed on the store is never
//! served from the blocks of the old one.

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// The unit kept: a part is served from the blocks it overlaps.
pub const BLOCK: u64 = 1 << 20;

/// Blocks read from the store in one request at most (16 MiB): few requests for a large tensor, not
/// much read past a small one.
pub const RUN: u64 = 16;

/// How long an asker waits for a block another asker is reading from the store.
const WAIT: Duration = Duration::from_secs(120);

/// A version of a file, as blocks are kept by.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct Version {
    /// The file, relative to the source.
    pub rel: String,
    /// Its size.
    pub size: u64,
    /// Its modification time.
    pub mtime_ns: i64,
}

struct Block {
    /// `None` while an asker reads it from the store.
    data: Option<Arc<Vec<u8>>>,
    /// When it was last used (a tick of the cache's clock).
    used: u64,
}

#[derive(Default)]
struct State {
    blocks: HashMap<(Version, u64), Block>,
    /// Bytes held.
    bytes: u64,
    tick: u64,
}

/// Blocks kept in memory; see the module's documentation.
pub struct Blocks {
    state: Mutex<State>,
    arrived: Condvar,
    budget: u64,
}

impl Blocks {
    /// Blocks within `budget` bytes.
    pub fn new(budget: u64) -> Blocks {
        Blocks { state: Mutex::new(State::default()), arrived: Condvar::new(), budget }
    }

    /// Blocks within the budget `TIERSTORE_PART_BLOCKS_MIB` sets (1 GiB when unset, or when it is not a
    /// number of MiB: said in the log, with the fix).
    pub fn from_env() -> Blocks {
        Blocks::new(crate::config::settings::tuning("TIERSTORE_PART_BLOCKS_MIB").saturating_mul(1 << 20))
    }

    /// Block `index` of `version`. When no asker has it or is reading it, this one reads it from the
    /// store with `read(first, count)` (the bytes of blocks `first..first + count`, the last one short at
    /// the end of the file), together with the blocks after it up to `last` that nobody has either, at
    /// most [`RUN`] of them.
    pub fn get(
        &self,
        version: &Version,
        index: u64,
        last: u64,
        read: impl FnOnce(u64, u64) -> io::Result<Vec<u8>>,
    ) -> io::Result<Arc<Vec<u8>>> {
        let key = |i: u64| (version.clone(), i);
        let last = last.max(index);
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            st.tick += 1;
            let tick = st.tick;
            match st.blocks.get_mut(&key(index)) {
                Some(Block { data: Some(d), used }) => {
                    *used = tick;
                    return Ok(d.clone());
                }
                Some(Block { data: None, .. }) => {
                    let (next, waited) = self.arrived.wait_timeout(st, WAIT).unwrap_or_else(|p| p.into_inner());
                    if waited.timed_out() {
                        let what =
                            format!("block {index} of {} was not read from the store within {WAIT:?}", version.rel);
                        return Err(io::Error::new(io::ErrorKind::TimedOut, what));
                    }
                    st = next;
                    continue;
                }
                None => {}
            }
            let mut count = 0;
            while count < RUN && index + count <= last && !st.blocks.contains_key(&key(index + count)) {
                st.blocks.insert(key(index + count), Block { data: None, used: tick });
                count += 1;
            }
            drop(st);
            return self.keep_run(version, index..index + count, tick, read(index, count));
        }
    }

    /// Keeps the blocks of `run`, which this asker claimed and read from the store (`read`: their bytes,
    /// the last block short at the end of the file), wakes the askers waiting for them, and returns the
    /// first. A failed read releases the claims (a waiter then reads them itself).
    fn keep_run(
        &self,
        version: &Version,
        run: std::ops::Range<u64>,
        tick: u64,
        read: io::Result<Vec<u8>>,
    ) -> io::Result<Arc<Vec<u8>>> {
        let key = |i: u64| (version.clone(), i);
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let bytes = match read {
            Ok(bytes) => bytes,
            Err(e) => {
                for i in run {
                    st.blocks.remove(&key(i));
                }
                self.arrived.notify_all();
                return Err(e);
            }
        };
        let mut first = None;
        for (n, piece) in bytes.chunks(BLOCK as usize).enumerate().take((run.end - run.start) as usize) {
            let data = Arc::new(piece.to_vec());
            first.get_or_insert_with(|| data.clone());
            st.bytes += data.len() as u64;
            st.blocks.insert(key(run.start + n as u64), Block { data: Some(data), used: tick });
        }
        // A read shorter than the run (the file ended) leaves no claim behind.
        for i in run.start + (bytes.len() as u64).div_ceil(BLOCK)..run.end {
            st.blocks.remove(&key(i));
        }
        self.evict(&mut st);
        self.arrived.notify_all();
        first.ok_or_else(|| {
            io::Error::new(io::ErrorKind::UnexpectedEof, format!("{} ends before block {}", version.rel, run.start))
        })
    }

    /// Forgets every block of `rel` (an asker found bytes served from them wrong).
    pub fn forget(&self, rel: &str) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let mut freed = 0;
        st.blocks.retain(|(v, _), b| {
            let keep = v.rel != rel || b.data.is_none();
            if !keep {
                freed += b.data.as_ref().map_or(0, |d| d.len() as u64);
            }
            keep
        });
        st.bytes -= freed;
    }

    /// Bytes held now.
    #[cfg(test)]
    fn held(&self) -> u64 {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).bytes
    }

    /// Drops the least recently used blocks until the rest fit the budget.
    fn evict(&self, st: &mut State) {
        while st.bytes > self.budget {
            let oldest = st.blocks.iter().filter(|(_, b)| b.data.is_some()).min_by_key(|(_, b)| b.used);
            let Some((k, _)) = oldest else { break };
            let k = k.clone();
            if let Some(Block { data: Some(d), .. }) = st.blocks.remove(&k) {
                st.bytes -= d.len() as u64;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;

    fn version() -> Version {
        Version { rel: "packs/a".into(), size: 5 * BLOCK + 7, mtime_ns: 1 }
    }

    /// The bytes of blocks `first..first + count` of a file of `size` whose byte at `i` is `i % 251`,
    /// counting the bytes read.
    fn store(size: u64, read: &AtomicU64) -> impl Fn(u64, u64) -> io::Result<Vec<u8>> + '_ {
        move |first, count| {
            let (start, end) = (first * BLOCK, ((first + count) * BLOCK).min(size));
            read.fetch_add(end - start, Ordering::Relaxed);
            Ok((start..end).map(|i| (i % 251) as u8).collect())
        }
    }

    #[test]
    fn a_block_is_read_from_the_store_once_with_the_run_after_it() {
        let (b, read, v) = (Blocks::new(64 * BLOCK), AtomicU64::new(0), version());
        let got = b.get(&v, 1, 5, store(v.size, &read)).unwrap();
        assert_eq!(got.len() as u64, BLOCK);
        assert_eq!(got[0], (BLOCK % 251) as u8);
        assert_eq!(read.load(Ordering::Relaxed), 4 * BLOCK + 7, "blocks 1 to 5 in one read");
        let last = b.get(&v, 5, 5, store(v.size, &read)).unwrap();
        assert_eq!(last.len(), 7, "the file's last block is short");
        assert_eq!(read.load(Ordering::Relaxed), 4 * BLOCK + 7, "no second read");
        // Another version of the file never shares the blocks of this one.
        let changed = Version { mtime_ns: 2, ..v.clone() };
        b.get(&changed, 1, 1, store(v.size, &read)).unwrap();
        assert_eq!(read.load(Ordering::Relaxed), 5 * BLOCK + 7);
    }

    #[test]
    fn askers_at_once_share_one_read_and_a_failed_read_leaves_no_claim() {
        let (b, read, v) = (Arc::new(Blocks::new(64 * BLOCK)), Arc::new(AtomicU64::new(0)), version());
        let slow = |read: &AtomicU64, first: u64, count: u64| {
            std::thread::sleep(Duration::from_millis(50));
            store(5 * BLOCK + 7, read)(first, count)
        };
        let askers: Vec<_> = (0..4)
            .map(|_| {
                let (b, read, v) = (b.clone(), read.clone(), v.clone());
                std::thread::spawn(move || b.get(&v, 0, 2, |f, c| slow(&read, f, c)).unwrap())
            })
            .collect();
        for a in askers {
            assert_eq!(a.join().unwrap().len() as u64, BLOCK);
        }
        assert_eq!(read.load(Ordering::Relaxed), 3 * BLOCK, "four askers, one read");
        let failed = b.get(&v, 3, 3, |_, _| Err(io::Error::other("the store failed")));
        assert!(failed.is_err());
        assert_eq!(b.get(&v, 3, 3, store(v.size, &read)).unwrap().len() as u64, BLOCK, "read again");
    }

    #[test]
    fn the_least_recently_used_blocks_go_first_and_forget_drops_a_file() {
        let (b, read, v) = (Blocks::new(2 * BLOCK), AtomicU64::new(0), version());
        b.get(&v, 0, 0, store(v.size, &read)).unwrap();
        b.get(&v, 1, 1, store(v.size, &read)).unwrap();
        b.get(&v, 0, 0, store(v.size, &read)).unwrap();
        b.get(&v, 2, 2, store(v.size, &read)).unwrap();
        assert_eq!(b.held(), 2 * BLOCK);
        assert_eq!(read.load(Ordering::Relaxed), 3 * BLOCK);
        b.get(&v, 0, 0, store(v.size, &read)).unwrap();
        assert_eq!(read.load(Ordering::Relaxed), 3 * BLOCK, "block 0 was used last and stayed");
        b.get(&v, 1, 1, store(v.size, &read)).unwrap();
        assert_eq!(read.load(Ordering::Relaxed), 4 * BLOCK, "block 1 had gone");
        b.forget("packs/a");
        assert_eq!(b.held(), 0);
    }
}
