//! Faults of the cache: a fault is counted (in its tier, and as a fall-back to the source) and said on
//! stderr once per kind and process, since the job goes on from the source and a log line per read would
//! drown it. `tierstore status` shows the counts.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use crate::counters::{source as src_slot, tier as tier_slot, Counters};
use crate::tier::Tier;

/// The faults of one cache (see the module).
pub(super) struct Faults {
    /// The source's counters, where each fall-back is counted.
    source: Arc<Counters>,
    /// The kinds already said in this process.
    logged: Mutex<HashSet<String>>,
}

impl Faults {
    pub(super) fn new(source: Arc<Counters>) -> Faults {
        Faults { source, logged: Mutex::new(HashSet::new()) }
    }

    /// Counts a cache fault in `tier` and says so on stderr once per kind and process.
    pub(super) fn count(&self, tier: Option<&Tier>, kind: &str, detail: &str) {
        if let Some(t) = tier {
            t.counters.add(tier_slot::FAULTS, 1);
        }
        self.source.add(src_slot::FALLBACKS, 1);
        self.log_once(kind, &format!("cache fault ({detail}); served from the source. Further faults of this kind are counted, not logged: see `tierstore status`"));
    }

    /// A warning said once per kind and process (`TIERSTORE_LOG=warn`, the default); at `debug` every
    /// time, since that level is asked for to follow each file.
    pub(super) fn log_once(&self, kind: &str, message: &str) {
        if log::log_enabled!(log::Level::Debug) || self.logged.lock().expect("log lock").insert(kind.to_string()) {
            log::warn!("{message}");
        }
    }
}
