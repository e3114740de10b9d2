//! The `list` request's report of the node's streams (`tierstore stream list`, `tierstore status`), typed:
//! what the agent holds, each stream's versions and subscribers, and how far behind each consumer serves.

use std::path::Path;
use std::sync::atomic::Ordering;

use serde::Serialize;
use serde_json::Value;

use super::consumers::ConsumerReport;
use super::{answer, now, Kept, Streams};

/// What the agent holds of every stream.
#[derive(Serialize)]
struct Report<'a> {
    dir: &'a Path,
    keep: usize,
    /// Bytes of the tensor files held.
    held_bytes: u64,
    tensor_files: usize,
    /// Bytes of the spare files allocated for the next publish (`spares.rs`).
    spare_bytes: u64,
    streams: Vec<StreamReport<'a>>,
    /// Bytes served to other nodes' agents.
    served_bytes: u64,
    /// The job's Redis, when versions are announced to other nodes.
    redis: Option<&'a str>,
}

/// One stream.
#[derive(Serialize)]
struct StreamReport<'a> {
    name: &'a str,
    /// The newest version published on this node.
    latest: u64,
    /// The newest version known here: published on this node or relayed from another.
    newest: u64,
    published: u64,
    subscribers: usize,
    consumers: Vec<ConsumerReport<'a>>,
    versions: Vec<VersionReport<'a>>,
    pulled: u64,
    pulled_bytes: u64,
    relayed: u64,
    errors: u64,
    last_error: Option<&'a str>,
}

/// One version held here.
#[derive(Serialize)]
struct VersionReport<'a> {
    version: u64,
    #[serde(flatten)]
    kept: &'a Kept,
}

impl Streams {
    /// The report of the `list` request (see the module).
    pub(super) fn list(&self) -> Value {
        let at = now();
        let st = self.lock();
        let mut names: Vec<&String> = st.streams.keys().collect();
        names.sort();
        let streams = names
            .into_iter()
            .map(|name| {
                let s = &st.streams[name];
                let versions = s.versions.iter().map(|(&version, kept)| VersionReport { version, kept }).collect();
                let newest = s.latest.max(s.relayed);
                let mut ids: Vec<&u64> = s.subscribers.keys().collect();
                ids.sort();
                let consumers =
                    ids.into_iter().map(|id| s.subscribers[id].report(*id, newest, &s.committed, at)).collect();
                StreamReport {
                    name,
                    latest: s.latest,
                    newest,
                    published: s.published,
                    subscribers: s.subscribers.len(),
                    consumers,
                    versions,
                    pulled: s.pulled,
                    pulled_bytes: s.pulled_bytes,
                    relayed: s.relays,
                    errors: s.errors,
                    last_error: s.last_error.as_deref(),
                }
            })
            .collect();
        let held: u64 = st.blobs.keys().filter_map(|h| std::fs::metadata(self.blob(h)).ok()).map(|m| m.len()).sum();
        let spare_bytes = self.spares.as_ref().map_or(0, |k| k.bytes());
        answer(Report {
            dir: &self.dir,
            keep: self.keep,
            held_bytes: held,
            tensor_files: st.blobs.len(),
            spare_bytes,
            streams,
            served_bytes: self.served_bytes.load(Ordering::Relaxed),
            redis: self.remote.get().map(|(r, _)| r.redis.as_str()),
        })
    }
}
