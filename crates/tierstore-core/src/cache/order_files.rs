//! The files an ordered prefetch draws its order from: each file's source-relative path and key, made
//! once (a loader's, when its first epoch starts) instead of at every epoch, and which of them a look at
//! the tiers found cached, kept while the indexes have not changed since.
//!
//! An epoch of a warm loader used to make each of its paths relative, hash it and read its entry again as
//! it started: 6,600 instructions a sample in the loader's process (docs/benchmarks/sample-attribution.md),
//! for the answer the last epoch already had. With the files kept, an epoch is a list of file numbers, and
//! a file found cached under the tiers' change number (`index/changes.rs`, summed over the tiers, so that
//! a change in any moves it) is not looked up again while that number holds. Only where being cached does
//! not wear off with time: with `revalidate = "<duration>"` a copy's trust ends at a time, so every epoch
//! looks again.

use std::sync::atomic::{AtomicU64, Ordering};

use super::engine::Inner;
use crate::config::Revalidate;
use crate::index::{key_of, Key};

/// See the module.
pub struct OrderFiles {
    rels: Vec<String>,
    keys: Vec<Key>,
    /// Per file, 1 + the tiers' change number at which a look found it cached; 0 when none did.
    cached_at: Vec<AtomicU64>,
}

impl OrderFiles {
    /// The files of `rels` (source-relative paths), numbered in that order.
    pub(super) fn new(rels: Vec<String>) -> OrderFiles {
        let keys = rels.iter().map(|rel| key_of(rel)).collect();
        let cached_at = rels.iter().map(|_| AtomicU64::new(0)).collect();
        OrderFiles { rels, keys, cached_at }
    }

    /// How many files there are.
    pub fn len(&self) -> usize {
        self.rels.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.rels.is_empty()
    }

    /// The source-relative path of file `i`.
    pub(super) fn rel(&self, i: u32) -> &str {
        &self.rels[i as usize]
    }

    /// The key of file `i`.
    pub(super) fn key(&self, i: u32) -> &Key {
        &self.keys[i as usize]
    }

    /// Which positions of `order` (file numbers) need no fetch: published in a tier and trusted now, or left
    /// to the reader's open (see `order.rs`'s `left_to_reader`). Files found so under the tiers' current
    /// change number are not looked up again.
    pub(super) fn cached(&self, inner: &Inner, order: &[u32], left_to_reader: bool) -> Vec<bool> {
        let storage = inner.storage();
        let lookup = storage.lookup();
        // Read before the look: a file found cached under it was cached at least as late as it.
        let timeless = !matches!(storage.config().revalidate, Revalidate::Within(_));
        let mark = lookup.changes().filter(|_| timeless).map(|n| n + 1);
        let known = |f: u32| mark.is_some_and(|m| self.cached_at[f as usize].load(Ordering::Relaxed) == m);
        let mut cached: Vec<bool> = order.iter().map(|&f| known(f)).collect();
        let unknown: Vec<usize> = (0..order.len()).filter(|&p| !cached[p]).collect();
        let files: Vec<(&Key, &str)> = unknown.iter().map(|&p| (self.key(order[p]), self.rel(order[p]))).collect();
        for (&p, e) in unknown.iter().zip(lookup.published_each(&files)) {
            cached[p] = e.is_some_and(|e| left_to_reader || storage.trusted_now(&e));
            if let Some(m) = mark.filter(|_| cached[p]) {
                self.cached_at[order[p] as usize].store(m, Ordering::Relaxed);
            }
        }
        cached
    }
}
