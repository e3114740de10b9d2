//! What every source's namespace of one user holds in a tier, so that the tier's quota bounds them all
//! together, whatever the number of sources and jobs that share the tier directory.
//!
//! Each namespace keeps its own exact count in its LMDB index (one write transaction per change, so
//! never over quota within the namespace). Across namespaces, `<tier>/<uid>/usage` is a small shared
//! table, mapped by every process as the counters are: one slot per namespace, holding the bytes its index
//! counted when the namespace last placed a copy. A namespace places a copy only within the quota less the
//! other slots. A slot is written with the index's own count (never added to), so it cannot drift; it
//! may lag behind evictions and removals until its namespace places again, which only makes the others
//! see less room, never more. Two namespaces placing at the same instant can together pass the quota by
//! at most the copies they are placing.

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::shared_words::SharedWords;

/// Namespaces one tier directory of one user can share its quota between.
pub const SLOTS: usize = 64;

/// The table: a slot is a namespace's id (0: free) and its bytes.
pub struct TierUsage {
    words: SharedWords,
    /// This namespace's slot, if one was free.
    slot: Option<usize>,
}

/// The id of a namespace directory name (never 0, the free slot's).
fn id_of(namespace: &str) -> u64 {
    let h = blake3::hash(namespace.as_bytes());
    u64::from_le_bytes(h.as_bytes()[..8].try_into().expect("8 bytes")).max(1)
}

impl TierUsage {
    /// Maps `dir/usage` (made 0600 if absent, never through a link; `dir` is the user's private directory
    /// of the tier) and takes the slot of `namespace`. Slots of namespaces no longer in `dir` are freed.
    pub fn open(dir: &Path, namespace: &str) -> io::Result<TierUsage> {
        let file = crate::private::open_file(&crate::private::ensure_dir(dir)?, "usage")?;
        let mut usage = TierUsage { words: SharedWords::map(&file, SLOTS * 2)?, slot: None };
        let present: Vec<u64> = std::fs::read_dir(dir)?
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| id_of(&e.file_name().to_string_lossy()))
            .collect();
        for i in 0..SLOTS {
            let id = usage.id(i).load(Ordering::Acquire);
            if id != 0
                && !present.contains(&id)
                && usage.id(i).compare_exchange(id, 0, Ordering::AcqRel, Ordering::Relaxed).is_ok()
            {
                usage.bytes(i).store(0, Ordering::Release);
            }
        }
        usage.slot = usage.claim(id_of(namespace));
        if usage.slot.is_none() {
            log::warn!(
                "{}: more than {SLOTS} sources share this tier; the newest count against its quota only by itself",
                dir.display()
            );
        }
        Ok(usage)
    }

    fn id(&self, i: usize) -> &AtomicU64 {
        assert!(i < SLOTS);
        self.words.word(2 * i)
    }

    fn bytes(&self, i: usize) -> &AtomicU64 {
        assert!(i < SLOTS);
        self.words.word(2 * i + 1)
    }

    /// The slot of `id`: the one it already has, else the first free one. Two processes claiming at once
    /// may take two; the one that finds a lower slot of its id gives its own back.
    fn claim(&self, id: u64) -> Option<usize> {
        if let Some(i) = (0..SLOTS).find(|&i| self.id(i).load(Ordering::Acquire) == id) {
            return Some(i);
        }
        let mine =
            (0..SLOTS).find(|&i| self.id(i).compare_exchange(0, id, Ordering::AcqRel, Ordering::Relaxed).is_ok())?;
        match (0..mine).find(|&i| self.id(i).load(Ordering::Acquire) == id) {
            Some(lower) => {
                self.id(mine).store(0, Ordering::Release);
                Some(lower)
            }
            None => Some(mine),
        }
    }

    /// Records that this namespace now holds `used` bytes (its index's count).
    pub fn set(&self, used: u64) {
        if let Some(i) = self.slot {
            self.bytes(i).store(used, Ordering::Release);
        }
    }

    /// What the other namespaces of the tier hold, as they last recorded it.
    pub fn others(&self) -> u64 {
        (0..SLOTS)
            .filter(|&i| Some(i) != self.slot && self.id(i).load(Ordering::Acquire) != 0)
            .map(|i| self.bytes(i).load(Ordering::Acquire))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_namespace_sees_what_the_others_hold() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("1000");
        for ns in ["a-1", "b-2"] {
            std::fs::create_dir_all(dir.join(ns)).unwrap();
        }
        let a = TierUsage::open(&dir, "a-1").unwrap();
        let b = TierUsage::open(&dir, "b-2").unwrap();
        a.set(700);
        b.set(200);
        assert_eq!(a.others(), 200);
        assert_eq!(b.others(), 700);
        // A second handle of the same namespace (another process) shares its slot.
        let a2 = TierUsage::open(&dir, "a-1").unwrap();
        a2.set(300);
        assert_eq!(b.others(), 300);
        // A namespace whose directory is gone no longer counts.
        std::fs::remove_dir(dir.join("b-2")).unwrap();
        let a3 = TierUsage::open(&dir, "a-1").unwrap();
        assert_eq!(a3.others(), 0);
    }
}
