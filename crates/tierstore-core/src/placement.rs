//! Placement and eviction policy: which tier takes a new entry, and which entries leave when it is full.
//!
//! `fill` is MONARCH's policy for training data: fill the first tier, then the next, and never evict,
//! because every file is read once per epoch and evicting one to make room for another only moves the miss.
//! `lru`, `lfu` and `fifo` (HDF5 Cache VOL) suit caches shared by jobs with changing working sets.

/// A placement policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Fill tiers in order; never evict.
    Fill,
    /// Evict the least recently used entry.
    Lru,
    /// Evict the least frequently used entry (ties: least recently used).
    Lfu,
    /// Evict the oldest entry.
    Fifo,
}

impl Policy {
    /// Parses a policy name as written in configuration.
    pub fn parse(name: &str) -> Option<Policy> {
        match name.trim().to_ascii_lowercase().as_str() {
            "fill" => Some(Policy::Fill),
            "lru" => Some(Policy::Lru),
            "lfu" => Some(Policy::Lfu),
            "fifo" => Some(Policy::Fifo),
            _ => None,
        }
    }

    /// The name used in configuration.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Fill => "fill",
            Policy::Lru => "lru",
            Policy::Lfu => "lfu",
            Policy::Fifo => "fifo",
        }
    }

    /// Whether the policy makes room by evicting.
    pub fn evicts(self) -> bool {
        self != Policy::Fill
    }

    /// Whether the policy needs access statistics (hits, last access) written back to the index.
    pub fn tracks_access(self) -> bool {
        matches!(self, Policy::Lru | Policy::Lfu)
    }

    /// The eviction rank of an entry: the index keeps entries sorted by it and evicts the smallest first.
    pub fn rank(self, stats: &AccessStats) -> [u8; 16] {
        let (major, minor) = match self {
            Policy::Fill | Policy::Fifo => (stats.inserted_seq, 0),
            Policy::Lru => (stats.last_access_ns, stats.inserted_seq),
            Policy::Lfu => (stats.hits, stats.last_access_ns),
        };
        let mut r = [0u8; 16];
        r[..8].copy_from_slice(&major.to_be_bytes());
        r[8..].copy_from_slice(&minor.to_be_bytes());
        r
    }
}

/// What the policies rank entries by.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AccessStats {
    /// Order of insertion into the tier (a counter shared by all processes).
    pub inserted_seq: u64,
    /// Wall-clock time of the last open, in nanoseconds since the epoch.
    pub last_access_ns: u64,
    /// Opens served from this entry.
    pub hits: u64,
}

/// Picks the tier for a new entry of `size` bytes.
///
/// Tiers are tried fastest first for free room. Only when none has room does an evicting policy make
/// room, in the fastest tier whose quota can hold the entry at all; `fill` then leaves the file uncached.
pub fn plan(policy: Policy, size: u64, free: &[Option<u64>], quotas: &[u64]) -> Vec<(usize, bool)> {
    let mut plan: Vec<(usize, bool)> =
        free.iter().enumerate().filter(|(_, f)| matches!(f, Some(f) if *f >= size)).map(|(i, _)| (i, false)).collect();
    if policy.evicts() {
        plan.extend(
            quotas.iter().enumerate().filter(|(i, q)| free[*i].is_some() && **q >= size).map(|(i, _)| (i, true)),
        );
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_never_plans_eviction() {
        let p = plan(Policy::Fill, 10, &[Some(5), Some(20)], &[100, 100]);
        assert_eq!(p, vec![(1, false)]);
        assert!(plan(Policy::Fill, 30, &[Some(5), Some(20)], &[100, 100]).is_empty());
    }

    #[test]
    fn evicting_policies_fall_back_to_eviction_in_the_fastest_tier_that_fits() {
        let p = plan(Policy::Lru, 30, &[Some(5), Some(20)], &[100, 100]);
        assert_eq!(p, vec![(0, true), (1, true)]);
        let p = plan(Policy::Lru, 150, &[Some(5), Some(20)], &[100, 200]);
        assert_eq!(p, vec![(1, true)]);
        // An unavailable tier (None) is never chosen.
        assert_eq!(plan(Policy::Fifo, 10, &[None, Some(20)], &[100, 100]), vec![(1, false), (1, true)]);
    }

    #[test]
    fn ranks_order_victims() {
        let old = AccessStats { inserted_seq: 1, last_access_ns: 50, hits: 9 };
        let new = AccessStats { inserted_seq: 2, last_access_ns: 10, hits: 1 };
        assert!(Policy::Fifo.rank(&old) < Policy::Fifo.rank(&new));
        assert!(Policy::Lru.rank(&new) < Policy::Lru.rank(&old));
        assert!(Policy::Lfu.rank(&new) < Policy::Lfu.rank(&old));
    }
}
