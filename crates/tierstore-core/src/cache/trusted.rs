//! Extended attributes of a trusted source's paths, answered from the index (see `index::xattrs`).

use std::path::{Path, PathBuf};

use super::Cache;
use crate::config::Revalidate;
use crate::index::{key_of, XattrAnswer, XattrQuery};

impl Cache {
    /// The store's recorded answer to `query` about `path`, when the source is trusted
    /// (`revalidate = "never"`) and the question was asked since the path last changed through tierstore.
    pub fn cached_xattr(&self, path: &Path, query: &XattrQuery) -> Option<XattrAnswer> {
        if self.inner.config.revalidate != Revalidate::Never {
            return None;
        }
        let rel = self.inner.source.relative_or_root(path).ok()?;
        self.inner.directories()?.xattr(&key_of(&rel), &rel, query).ok()?
    }

    /// Records the store's answer to `query` about `path` (only when the source is trusted). An answer
    /// asked without following a symlink at `path` also answers the following question whenever `path`
    /// is no symlink: the caller asks that way once it knows.
    pub fn note_xattr(&self, path: &Path, query: &XattrQuery, answer: &XattrAnswer) {
        if self.inner.config.revalidate != Revalidate::Never {
            return;
        }
        let (Some(ix), Ok(rel)) = (self.inner.directories(), self.inner.source.relative_or_root(path)) else {
            return;
        };
        let _ = ix.record_xattr(&key_of(&rel), &rel, query, answer);
    }

    /// The source file that `name` (a tier copy, as /proc names an open descriptor) is a copy of.
    pub fn copy_source(&self, name: &Path) -> Option<PathBuf> {
        self.inner.tiers.iter().find_map(|t| {
            let e = t.index.as_ref().ok()?.lookup(&t.key_of_copy(name)?).ok()??;
            e.ready.then(|| self.inner.source.path_of(&e.rel))
        })
    }
}
