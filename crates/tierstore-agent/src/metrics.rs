//! The agent's counters in Prometheus' text format, served over HTTP on an opt-in port
//! (`tierstore agent run --metrics 127.0.0.1:9478`), for the cluster's monitoring to scrape.

use std::fmt::Write;

use crate::status::Status;

/// The exposition text of `status` (format 0.0.4).
// Long on purpose: one call per metric, the list a scrape returns, in the order it returns them.
pub fn render(status: &Status) -> String {
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, samples: &[(String, f64)]| {
        let _ = writeln!(out, "# HELP tierstore_{name} {help}");
        let _ = writeln!(out, "# TYPE tierstore_{name} {kind}");
        for (labels, value) in samples {
            let _ = writeln!(out, "tierstore_{name}{labels} {value}");
        }
    };
    let plain = |v: f64| vec![(String::new(), v)];
    metric("agent_uptime_seconds", "gauge", "Seconds since the agent started.", &plain(status.uptime_s));
    metric("agent_connections", "gauge", "Connections open now.", &plain(status.connections as f64));
    metric("agent_connections_total", "counter", "Connections accepted.", &plain(status.connections_total as f64));
    metric(
        "agent_refused_total",
        "counter",
        "Connections refused (wrong token or protocol version), or closed before their handshake for newer ones.",
        &plain(status.refused as f64),
    );
    metric(
        "agent_timeouts_total",
        "counter",
        "Connections closed for missing a deadline.",
        &plain(status.timeouts as f64),
    );
    let label = |address: &str| format!("{{peer=\"{}\"}}", address.replace(['\\', '"', '\n'], "_"));
    let up: Vec<(String, f64)> =
        status.members.iter().map(|m| (label(&m.address), if m.up { 1.0 } else { 0.0 })).collect();
    metric("peer_up", "gauge", "Whether the peer's agent answered its last ping in time.", &up);
    let rtt: Vec<(String, f64)> =
        status.members.iter().filter_map(|m| m.rtt_ms.map(|r| (label(&m.address), r / 1000.0))).collect();
    metric("peer_rtt_seconds", "gauge", "Round trip of the last ping.", &rtt);
    let downs: Vec<(String, f64)> = status.members.iter().map(|m| (label(&m.address), m.downs as f64)).collect();
    metric("peer_downs_total", "counter", "Times the peer went from up to down.", &downs);
    if let Some(c) = &status.cache {
        metric("cache_bytes", "gauge", "Bytes held in this node's tiers.", &plain(c.cached_bytes as f64));
        metric("cache_quota_bytes", "gauge", "The tiers' quotas, summed.", &plain(c.quota as f64));
        metric(
            "store_read_bytes_total",
            "counter",
            "Bytes this node read from the shared store.",
            &plain(c.store_bytes as f64),
        );
        metric(
            "peer_received_files_total",
            "counter",
            "Files this node's processes received from peers.",
            &plain(c.peer_hits as f64),
        );
        metric("peer_received_bytes_total", "counter", "Bytes received from peers.", &plain(c.peer_bytes as f64));
        metric(
            "peer_faults_total",
            "counter",
            "Peer reads that failed and went to the store.",
            &plain(c.peer_faults as f64),
        );
        metric("served_files_total", "counter", "Files served to peers.", &plain(c.served_files as f64));
        metric("served_bytes_total", "counter", "Bytes served to peers.", &plain(c.served_bytes as f64));
    }
    if let Some(w) = &status.writeback {
        metric(
            "writeback_migrated_files_total",
            "counter",
            "Staged files migrated to the shared store.",
            &plain(w.migrated_files as f64),
        );
        metric("writeback_migrated_bytes_total", "counter", "Bytes migrated.", &plain(w.migrated_bytes as f64));
        metric("writeback_failures_total", "counter", "Failed migration attempts.", &plain(w.failures as f64));
        metric(
            "writeback_refused_entries_total",
            "counter",
            "Journal entries refused: their destination is not beneath their stage's destinations.",
            &plain(w.refused_entries as f64),
        );
        metric(
            "writeback_refused_stages_total",
            "counter",
            "Stages refused: not a directory of the agent's user only that user can write.",
            &plain(w.refused_stages as f64),
        );
    }
    out
}
