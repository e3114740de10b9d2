//! Wall-clock time as the indexes and the write-back journal record it: nanoseconds since the Unix epoch.

use std::time::{SystemTime, UNIX_EPOCH};

/// Nanoseconds since the epoch (0 for a clock set before it).
pub fn now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

/// Whether something the source showed at `at_ns` is still younger than `within` at `now` (a record never
/// taken, at 0, is not).
pub fn within(at_ns: u64, within: std::time::Duration, now: u64) -> bool {
    at_ns.saturating_add(within.as_nanos() as u64) > now
}
