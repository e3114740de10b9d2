//! Which names a process has met before, so that what it keeps per name (the shim's normal forms, the
//! entries `Lookup` keeps) is kept only for a name it meets a second time.
//!
//! A DataLoader worker that does not persist across epochs opens each file of its share once: keeping
//! each (an allocation and an insert) made its first opens 1,560 instructions dearer (callgrind), for no
//! later use. Remembering a fingerprint costs a hash and a store, and a name met twice is likely to come
//! back (the next epoch's).
//!
//! A direct-mapped table of 64-bit fingerprints: a name whose slot another took since is only kept one
//! meeting later, and two names with one fingerprint only make the second kept a meeting early. Neither
//! changes what is read, only when something is kept.

use std::hash::Hasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use rustc_hash::FxHasher;

/// Slots of the table: 256 KiB per process, taken on the first meeting. A share of 2,000 files an epoch
/// finds 94% of its names still remembered in the next; 20,000, 54% (each epoch keeps more of them).
const SLOTS: usize = 1 << 15;

/// See the module.
#[derive(Default)]
pub struct Seen {
    slots: OnceLock<Box<[AtomicU64]>>,
}

impl Seen {
    /// Whether `name` was met before (as far as the table remembers); it is remembered now either way.
    pub fn again(&self, name: &[u8]) -> bool {
        let mut h = FxHasher::default();
        h.write(name);
        // 0 marks an empty slot, so no fingerprint is 0.
        let fingerprint = h.finish() | 1;
        let slots = self.slots.get_or_init(|| {
            // Zeroed by the allocator (a fresh mapping at this size), so only the slots used are touched:
            // a process that meets a few names pays for a few pages, not 256 KiB.
            // SAFETY: an `AtomicU64` of all zero bytes is a valid 0.
            unsafe { Box::<[AtomicU64]>::new_zeroed_slice(SLOTS).assume_init() }
        });
        // The top bits of a multiplicative mix: FxHash's low bits alone spread short names poorly.
        let slot = &slots[(fingerprint.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - SLOTS.trailing_zeros())) as usize];
        slot.swap(fingerprint, Ordering::Relaxed) == fingerprint
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_met_again_only_after_it_was_met_once() {
        let seen = Seen::default();
        assert!(!seen.again(b"a/1.npy"));
        assert!(seen.again(b"a/1.npy"));
        assert!(!seen.again(b"a/2.npy"));
        assert!(seen.again(b"a/1.npy"));
        // Most of a share of names fitting the table are still remembered after all were met once.
        let names: Vec<String> = (0..SLOTS / 4).map(|i| format!("train/{i}.npy")).collect();
        for n in &names {
            seen.again(n.as_bytes());
        }
        let again = names.iter().filter(|n| seen.again(n.as_bytes())).count();
        assert!(again > names.len() * 3 / 4, "{again} of {}", names.len());
    }
}
