//! The consumers of a node's streams as its agent sees them: one per subscription, with what it was last
//! told and, where the consumer reports it, the version it serves. A `HotModel` reports each swap with a
//! `serving` request (one small frame, no answer), so that `tierstore stream show|watch` can say how far
//! behind the newest version each consumer is, in versions and in seconds, without asking the consumers.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Serialize;
use tokio::sync::mpsc;

/// Commit times kept per stream for the lag in seconds: a consumer further behind is reported as behind
/// since the oldest of them.
pub(super) const COMMITS_KEPT: usize = 1024;

/// A notice pushed to subscribers.
#[derive(Clone, Debug)]
pub(super) struct Notice {
    pub(super) name: String,
    pub(super) version: u64,
    /// The version is held here (its notice is a lease), not only relayed from another node.
    pub(super) held: bool,
    pub(super) json: Arc<String>,
}

/// One subscription of a stream.
pub(super) struct Consumer {
    /// Where its notices go (its connection's task sends them).
    pub tx: mpsc::UnboundedSender<Notice>,
    /// Told of versions only, held here or not: the agent relays notices of versions another node holds
    /// without pulling them (a consumer that receives the tensors by other means, a process group).
    pub notices_only: bool,
    /// The consumer's process, as it said (informational: the agent trusts no identity of a local client).
    pub pid: Option<u32>,
    /// What the consumer calls itself (`HotModel`, `Subscriber`, a name the application gave).
    pub label: Option<String>,
    /// The newest version it was told of: no notice goes out twice, or out of order.
    pub noticed: u64,
    /// The version it reported serving, and when it swapped to it (seconds since the epoch).
    pub serving: Option<(u64, f64)>,
}

/// What [`Consumer::tell`] did.
pub(super) enum Told {
    /// The notice was queued: for a version held here, a lease.
    Sent,
    /// The consumer had been told of it, or a newer one, or takes no notice of this kind.
    Skipped,
    /// The consumer's connection is gone.
    Gone,
}

impl Consumer {
    /// Queues `notice` unless this consumer was told of that version or a newer one; a version this
    /// agent does not hold (relayed) goes to notices-only consumers alone.
    pub fn tell(&mut self, notice: &Notice) -> Told {
        if notice.version <= self.noticed || (!notice.held && !self.notices_only) {
            return Told::Skipped;
        }
        if self.tx.send(notice.clone()).is_err() {
            return Told::Gone;
        }
        self.noticed = notice.version;
        Told::Sent
    }

    /// The consumer for `tierstore stream show|watch`: what it serves, and how far behind `newest` that
    /// is, in versions and in seconds since the first version it lacks was committed (`committed`: commit
    /// times by version; `now`: seconds since the epoch).
    pub fn report(&self, id: u64, newest: u64, committed: &BTreeMap<u64, f64>, now: f64) -> ConsumerReport<'_> {
        let (serving, swapped_at) = match self.serving {
            Some((v, at)) => (Some(v), Some(at)),
            None => (None, None),
        };
        let behind = serving.map(|v| newest.saturating_sub(v));
        let behind_s = match serving {
            Some(v) if v < newest => committed.range(v + 1..).next().map(|(_, at)| (now - at).max(0.0)),
            Some(_) => Some(0.0),
            None => None,
        };
        ConsumerReport {
            id,
            pid: self.pid,
            label: self.label.as_deref(),
            notices_only: self.notices_only,
            noticed: self.noticed,
            serving,
            swapped_at,
            behind,
            behind_s,
        }
    }
}

/// One consumer in the `list` report (see [`Consumer::report`]).
#[derive(Debug, Serialize)]
pub(super) struct ConsumerReport<'a> {
    pub id: u64,
    pub pid: Option<u32>,
    pub label: Option<&'a str>,
    pub notices_only: bool,
    /// The newest version it was told of.
    pub noticed: u64,
    /// The version it serves, and since when (seconds since the epoch), as it reported.
    pub serving: Option<u64>,
    pub swapped_at: Option<f64>,
    /// Versions, and seconds since the first version it lacks was committed.
    pub behind: Option<u64>,
    pub behind_s: Option<f64>,
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn notice(version: u64, held: bool) -> Notice {
        Notice { name: "m".into(), version, held, json: Arc::new(String::new()) }
    }

    #[test]
    fn a_consumer_is_told_each_version_once_in_order_and_relays_only_if_it_asked() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut full = Consumer { tx, notices_only: false, pid: None, label: None, noticed: 0, serving: None };
        assert!(matches!(full.tell(&notice(2, true)), Told::Sent));
        assert!(matches!(full.tell(&notice(2, true)), Told::Skipped), "twice");
        assert!(matches!(full.tell(&notice(1, true)), Told::Skipped), "out of order");
        assert!(matches!(full.tell(&notice(3, false)), Told::Skipped), "a relayed version to a full consumer");
        assert_eq!(rx.try_recv().unwrap().version, 2);
        assert!(rx.try_recv().is_err());
        let (tx, rx) = mpsc::unbounded_channel();
        let mut relayed = Consumer { tx, notices_only: true, pid: None, label: None, noticed: 0, serving: None };
        assert!(matches!(relayed.tell(&notice(3, false)), Told::Sent));
        drop(rx);
        assert!(matches!(relayed.tell(&notice(4, true)), Told::Gone));
    }

    #[test]
    fn the_lag_counts_versions_and_the_time_since_the_first_version_missing() {
        let (tx, _rx) = mpsc::unbounded_channel();
        let mut c =
            Consumer { tx, notices_only: false, pid: Some(7), label: None, noticed: 5, serving: Some((3, 90.0)) };
        let committed: BTreeMap<u64, f64> = [(3, 90.0), (4, 100.0), (5, 110.0)].into_iter().collect();
        let r = c.report(1, 5, &committed, 112.5);
        assert_eq!((r.behind, r.behind_s), (Some(2), Some(12.5)));
        c.serving = Some((5, 111.0));
        let r = c.report(1, 5, &committed, 112.5);
        assert_eq!((r.behind, r.behind_s), (Some(0), Some(0.0)));
        c.serving = None;
        let r = serde_json::to_value(c.report(1, 5, &committed, 112.5)).unwrap();
        assert!(r["behind"].is_null(), "a consumer that reports nothing: {r}");
        assert_eq!(r["pid"], 7);
    }
}
