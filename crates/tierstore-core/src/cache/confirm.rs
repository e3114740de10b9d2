//! Revalidation with bounded staleness (`revalidate = "<duration>"`), as NFS's attribute cache and
//! JuiceFS's `--attr-cache` do it: a copy that the source showed to be current within the duration is
//! used without asking the source; an older one is confirmed together with every other copy of its
//! directory, from one listing with identities (an object store's `LIST`, a POSIX directory read and
//! parallel `stat`s). A warm epoch then costs the store a few requests per directory per duration rather
//! than one per open, and a change on the source is seen within the duration.
//!
//! The duration is the staleness bound, and the confirmation starts at half of it: a copy confirmed
//! within half the duration is used as it is; one confirmed within the duration is used as it is while
//! its directory is confirmed in the background (stale-while-revalidate, as HTTP caches do), so a reader
//! that comes back within the duration never waits for the store; an older one waits for its
//! directory's confirmation. Whenever one directory is found due, every other directory the index holds
//! copies of that are due is confirmed too, several at once, in the background: an epoch's next
//! directories are confirmed before it reaches them, not one after another on the reader's path.
//!
//! While a process reads, its keeper (a thread that wakes every eighth of the duration) confirms in the
//! same way every directory that would fall due before its next round: the reader finds its copies
//! fresh, and a job that pauses for longer than the duration (an evaluation, a checkpoint) comes back to
//! confirmed copies instead of waiting for the store. A duration after the process last served a copy,
//! the keeper stops. The bound is the same either way: no copy is served that the source did not show
//! to be current within the duration.
//!
//! The time of the last confirmation lives in each entry of the tier's index, so every process of the
//! node shares it. One process of the node confirms a directory at a time (the fetch lock of the
//! directory's own key), one thread of it (the in-process flight of that key); the others wait, then find
//! their copies confirmed. A confirmation that finds another version of a file (or none) leaves its entry
//! as it is: the open that asked fetches the version the listing showed, and the next open of another
//! such file, finding its copy older than the directory's last listing, asks about that file alone.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::engine::Inner;
use super::flight::Role;
// `fresh`: the bound is called `within` here, as in the module text.
use crate::clock::{now_ns, within as fresh};
use crate::error::Error;
use crate::index::{key_of, Entry, Key, SourceId};

/// The directory of a source-relative path (`""` for a file at the root).
fn parent(rel: &str) -> &str {
    rel.rsplit_once('/').map_or("", |(dir, _)| dir)
}

/// The key that stands for the confirmation of directory `dir` in the fetch locks and in-process
/// flights: never the key of a file, whose path cannot start with a NUL byte.
fn directory_key(dir: &str) -> Key {
    key_of(&format!("\0confirm\0{dir}"))
}

/// How many directories are confirmed at once in the background (each, on a file system, with parallel
/// `stat`s of its files: see `source/posix.rs`): 8 × 8 requests in flight, what one client of a parallel
/// file system or an object store takes without queueing.
const DIRECTORIES_AT_ONCE: usize = 8;

/// The shortest time the keeper sleeps between its rounds, for a very short duration.
const KEEPER_PERIOD_MIN: Duration = Duration::from_millis(50);

impl Inner {
    /// The version of `rel` to serve when a tier holds the copy `e` of it and copies are trusted for
    /// `bound`: `e`'s own when it was confirmed within half that long, or within that long (its
    /// directory is then confirmed in the background), or once its directory is confirmed now; the
    /// version the source holds when that is another one (the caller then fetches it).
    pub(super) fn confirmed_identity(
        self: &Arc<Self>,
        key: &Key,
        rel: &str,
        e: &Entry,
        bound: Duration,
    ) -> Result<SourceId, Error> {
        // Confirmations are due at half the bound, so that there is time to make them in the background.
        let within = bound / 2;
        let now = now_ns();
        if self.sweep().used(now) {
            self.keep_confirmed(bound);
        }
        if fresh(e.confirmed_ns, within, now) {
            log::trace!("{rel}: trusted (confirmed {} ms ago)", now.saturating_sub(e.confirmed_ns) / 1_000_000);
            return Ok(e.source);
        }
        let dir = parent(rel);
        let dkey = directory_key(dir);
        let index = self.storage().lookup().directories();
        let listed_at = index.and_then(|ix| ix.directory_confirmed(&dkey).ok()).unwrap_or(0);
        if fresh(listed_at, within, now) && listed_at > e.confirmed_ns {
            // The directory was listed since this copy was confirmed, and the listing did not confirm it:
            // the file changed (the listing said to what) or went (asking about it alone says how).
            if let Some((at, sid)) = index.and_then(|ix| ix.superseded(key).ok().flatten()) {
                if at == listed_at {
                    return Ok(sid);
                }
            }
            return self.storage().identify(rel);
        }
        self.confirm_in_background(dir, within);
        if fresh(e.confirmed_ns, bound, now) {
            log::debug!("{rel}: served while its directory is confirmed in the background");
            return Ok(e.source);
        }
        log::debug!("{rel}: confirmed more than {bound:?} ago: waits for its directory's confirmation");
        let listed = match self.fetcher().join(&dkey) {
            Role::Follower(flight) => {
                // Another thread of this process (the background sweep, say) confirmed (or failed to
                // confirm) the directory.
                flight.wait();
                None
            }
            Role::Leader(_lead) => self.confirm_directory(dir, &dkey, within),
        };
        let name = rel.rsplit_once('/').map_or(rel, |(_, name)| name);
        if let Some(Ok(found)) = &listed {
            if let Some((_, sid)) = found.iter().find(|(n, _)| n == name) {
                return Ok(*sid);
            }
        }
        // Confirmed by another thread or process meanwhile, or the listing left the file out (created or
        // replaced since, or not a file any more) or failed: ask about this file alone.
        if let Some(now) = self.storage().lookup().published(key, rel) {
            if now.source == e.source && fresh(now.confirmed_ns, within, now_ns()) {
                return Ok(now.source);
            }
        }
        self.storage().identify(rel)
    }

    /// Confirms `dir` and every directory whose copies the index last confirmed more than `within` ago
    /// (half the bound: those due), on a thread of its own; nothing when this process's sweep already
    /// runs.
    fn confirm_in_background(self: &Arc<Self>, dir: &str, within: Duration) {
        if !self.sweep().start() {
            return;
        }
        let inner = self.clone();
        let first = dir.to_string();
        let sweep = move || {
            inner.sweep_due(Some(first), within);
            inner.sweep().done();
        };
        if crate::interposer::spawn("tierstore-confirm".into(), sweep).is_err() {
            self.sweep().done();
        }
    }

    /// Renews, on a thread of its own, the confirmations of this process's copies before they fall due:
    /// every eighth of `bound` it confirms each directory that would be due (half `bound` old) before its
    /// next round, so that a reader finds its copies fresh and no open starts a confirmation of its own.
    /// It stops once `bound` has passed since this process last served a copy (the next such open starts
    /// it again), so a job that stops reading costs the store at most two more confirmations of each
    /// directory; a dropped cache stops its keeper at once.
    fn keep_confirmed(self: &Arc<Self>, bound: Duration) {
        if !self.sweep().start_keeper() {
            return;
        }
        let cache = Arc::downgrade(self);
        let bell = self.sweep().bell();
        let period = (bound / 8).max(KEEPER_PERIOD_MIN);
        // Renewed a round ahead of falling due: each directory every 3/8 to 1/2 of `bound`, at most a third
        // more confirmations than an open finding them due would make (never more often than every
        // quarter, for a duration so short that the period is at its minimum).
        let ahead = (bound / 2).saturating_sub(period).max(bound / 4);
        let idle_limit = bound.as_nanos() as u64;
        let keeper = move || {
            while bell.sleep(period) {
                let Some(inner) = cache.upgrade() else { return };
                let sweep = inner.sweep();
                if now_ns().saturating_sub(sweep.last_use_ns()) >= idle_limit {
                    sweep.keeper_done();
                    // An open between the look and the stop found the keeper running and left it to it.
                    if now_ns().saturating_sub(sweep.last_use_ns()) >= idle_limit || !sweep.start_keeper() {
                        return;
                    }
                }
                if sweep.start() {
                    inner.sweep_due(None, ahead);
                    inner.sweep().done();
                }
            }
        };
        if crate::interposer::spawn("tierstore-keeper".into(), keeper).is_err() {
            self.sweep().keeper_done();
        }
    }

    /// Confirms `first` (when given) and every directory whose copies the index last confirmed more than
    /// `within` ago, `DIRECTORIES_AT_ONCE` at a time. A directory another thread confirms meanwhile is left
    /// to it. The caller holds this process's right to sweep.
    fn sweep_due(&self, first: Option<String>, within: Duration) {
        let before = now_ns().saturating_sub(within.as_nanos() as u64);
        let mut dirs = self
            .storage()
            .lookup()
            .directories()
            .and_then(|ix| ix.directories_confirmed_before(before).ok())
            .unwrap_or_default();
        if let Some(first) = first {
            dirs.retain(|d| *d != first);
            dirs.insert(0, first);
        }
        let next = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..DIRECTORIES_AT_ONCE.min(dirs.len()) {
                s.spawn(|| {
                    while let Some(dir) = dirs.get(next.fetch_add(1, Ordering::Relaxed)) {
                        let dkey = directory_key(dir);
                        if let Role::Leader(_lead) = self.fetcher().join(&dkey) {
                            let _ = self.confirm_directory(dir, &dkey, within);
                        }
                    }
                });
            }
        });
    }

    /// Lists the identities of the files of `dir` and confirms every copy of the listed version, under the
    /// node-wide lock of the directory. `None`: another process confirmed the directory while this one
    /// waited for the lock (or the lock failed); `Some(Err)`: the listing failed.
    fn confirm_directory(
        &self,
        dir: &str,
        dkey: &Key,
        within: Duration,
    ) -> Option<std::io::Result<Vec<(String, SourceId)>>> {
        let _guard = match self.fetcher().lock(dkey) {
            Ok(g) => g,
            Err(e) => {
                self.storage().fault(None, "fetch-lock", &format!("confirmation lock failed: {e}"));
                return None;
            }
        };
        let listed_at =
            self.storage().lookup().directories().and_then(|ix| ix.directory_confirmed(dkey).ok()).unwrap_or(0);
        if fresh(listed_at, within, now_ns()) {
            return None;
        }
        // The time before the request: what it shows was true at least then.
        let seen = now_ns();
        let listed = match self.storage().source().identities(dir) {
            Ok(l) => l,
            Err(e) => {
                log::debug!("directory {dir:?}: confirmation failed ({e}); its files are asked about one by one");
                return Some(Err(e));
            }
        };
        log::debug!("directory {dir:?}: confirmed with the store ({} entries listed)", listed.len());
        let prefix = if dir.is_empty() { String::new() } else { format!("{dir}/") };
        let keys: Vec<(Key, SourceId)> =
            listed.iter().map(|(name, sid)| (key_of(&format!("{prefix}{name}")), *sid)).collect();
        for (i, tier) in self.storage().lookup().tiers().iter().enumerate() {
            let Ok(ix) = &tier.index else { continue };
            if let Err(e) = ix.confirm(dkey, dir, &keys, seen) {
                self.storage().fault(
                    Some(i),
                    "index-write",
                    &format!("index of {} not writable: {e}", tier.config.path.display()),
                );
            }
        }
        Some(Ok(listed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parents_and_freshness() {
        assert_eq!(parent("a/b/c.bin"), "a/b");
        assert_eq!(parent("c.bin"), "");
        assert_ne!(directory_key("a"), key_of("a"));
        let d = Duration::from_secs(30);
        assert!(fresh(100, d, 100 + 29_000_000_000));
        assert!(!fresh(100, d, 100 + 30_000_000_000));
        assert!(!fresh(0, d, 31_000_000_000), "never confirmed: confirm first");
    }
}
