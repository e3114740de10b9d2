//! The plain absolute names under the source that this process opened warm, each with its path relative
//! to the source as the cache spells it: a name the program opens again (every epoch, the same files) is
//! looked up here, instead of being checked for its normal form and cut at the source's root again.
//!
//! A name is kept only when it is its own normal form (absolute, no `.`, `..` or doubled `/`), so that what
//! it maps to depends on its bytes and the source alone, which a process never changes. A name is kept
//! the second time it is opened warm (`tierstore_core::seen`: a worker that opens each file once keeps
//! nothing), up to [`NAMES_KEPT`]; once full it keeps no more, so that a data set larger than that costs
//! a probe per open, never an insert thrown away before its use.

use std::sync::Arc;

use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use tierstore_core::seen::Seen;

/// How many names a process keeps.
const NAMES_KEPT: usize = 1 << 16;

/// See the module.
#[derive(Default)]
pub(crate) struct KnownNames {
    // parking_lot's lock: a child forked while another thread held it starts with a shim of its own, but
    // this one must not be left poisoned or locked for the parent either.
    rels: Mutex<FxHashMap<Box<[u8]>, Arc<str>>>,
    opened: Seen,
}

impl KnownNames {
    /// The source-relative path of `name`, if this process kept it.
    pub(crate) fn rel_of(&self, name: &[u8]) -> Option<Arc<str>> {
        self.rels.lock().get(name).cloned()
    }

    /// Keeps `name` (its own normal form, under the source) as naming `rel`, if it was opened warm before.
    pub(crate) fn keep(&self, name: &[u8], rel: &str) {
        if !self.opened.again(name) {
            return;
        }
        let mut rels = self.rels.lock();
        if rels.len() < NAMES_KEPT {
            rels.entry(name.into()).or_insert_with(|| rel.into());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_kept_at_its_second_warm_open_and_no_more_are_kept_once_full() {
        let names = KnownNames::default();
        assert!(names.rel_of(b"/data/a").is_none());
        names.keep(b"/data/a", "a");
        assert!(names.rel_of(b"/data/a").is_none(), "kept at its second warm open, not its first");
        names.keep(b"/data/a", "a");
        assert_eq!(names.rel_of(b"/data/a").as_deref(), Some("a"));
        for i in 1..NAMES_KEPT {
            let name = format!("/data/{i}");
            while names.rel_of(name.as_bytes()).is_none() {
                names.keep(name.as_bytes(), &i.to_string());
            }
        }
        names.keep(b"/data/one-too-many", "one-too-many");
        names.keep(b"/data/one-too-many", "one-too-many");
        assert!(names.rel_of(b"/data/one-too-many").is_none());
        assert_eq!(names.rel_of(b"/data/a").as_deref(), Some("a"));
    }
}
