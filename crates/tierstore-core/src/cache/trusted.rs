//! What a trusted source's metadata replays without asking the store (`revalidate = "never"`): the
//! `stat`, `lstat`, `readlink`, `realpath`, `statfs`, directory listings and extended attributes that the
//! LD_PRELOAD shim answers from the index, the shadow directories handed out for a source directory, and
//! the `fstat` of a tier copy rewritten as its source file's (see the index's records in `index.rs` and
//! `index/xattrs.rs`).
//!
//! With a duration (`revalidate = "60s"`, the default), the `stat` of a file or a directory and the
//! listing of a directory are answered the same way while their record is younger than the duration
//! (a file's is its copy's last confirmation, see `confirm.rs`); an older one is asked of the store
//! again and recorded anew. Links, `statfs` and extended attributes are recorded and replayed only for
//! `"never"`: under a duration the store answers them.

use std::ffi::OsStr;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use super::engine::{now_ns, CopyIncarnation, Inner};
use crate::config::Revalidate;
use crate::counters::source as src_slot;
use crate::error::Error;
use crate::index::{key_of, Entry, Link, Listed, SourceId, XattrAnswer, XattrQuery};

/// How many copies' rewritten `stat`s a process remembers before it starts over.
const COPY_STATS_KEPT: usize = 1 << 16;

impl Inner {
    /// Whether metadata records (`stat`s of files and directories, listings) are kept and replayed:
    /// not with `revalidate = "always"`, which asks the store every time.
    fn records_metadata(&self) -> bool {
        self.config.revalidate != Revalidate::Always
    }

    /// Whether a metadata record taken at `at_ns` may answer now: always with `"never"`, within the
    /// duration with one.
    fn record_fresh(&self, at_ns: u64) -> bool {
        match self.config.revalidate {
            Revalidate::Never => true,
            Revalidate::Within(d) => at_ns.saturating_add(d.as_nanos() as u64) > now_ns(),
            Revalidate::Always => false,
        }
    }

    /// See [`Cache::cached_stat`](super::Cache::cached_stat).
    pub(super) fn cached_stat(&self, path: &Path, nofollow: bool) -> Result<Option<libc::stat>, Error> {
        if !self.records_metadata() {
            return Ok(None);
        }
        let rel = self.source.relative_or_root(path)?;
        let known = match self.known_path(&rel, nofollow) {
            Some(sid) => Some(sid),
            None if self.config.revalidate != Revalidate::Never => None,
            None => self.link(&rel).and_then(|link| {
                if nofollow {
                    return Some(link.lstat);
                }
                let to = self.source.relative_or_root(Path::new(OsStr::from_bytes(&link.resolved?))).ok()?;
                self.known_path(&to, false)
            }),
        };
        Ok(known.and_then(|sid| sid.to_stat()))
    }

    /// See [`Cache::note_stat`](super::Cache::note_stat).
    pub(super) fn note_stat(&self, path: &Path, st: &libc::stat, nofollow: bool) {
        if !self.records_metadata() {
            return;
        }
        let Some(ix) = self.directories() else { return };
        let Ok(rel) = self.source.relative_or_root(path) else { return };
        let key = key_of(&rel);
        match st.st_mode & libc::S_IFMT {
            libc::S_IFDIR => {}
            libc::S_IFLNK if nofollow && !rel.is_empty() && self.config.revalidate == Revalidate::Never => {
                let lstat = SourceId::of_stat(st);
                if ix.link(&key, &rel).ok().flatten().is_some_and(|l| l.lstat == lstat) {
                    return;
                }
                let own = self.source.path_of(&rel);
                self.source.counters().add(src_slot::STATS, 2);
                let Ok(target) = std::fs::read_link(&own) else { return };
                let resolved = std::fs::canonicalize(&own).ok().map(|p| p.into_os_string().into_vec());
                let _ =
                    ix.record_link(&key, &rel, &Link { lstat, target: target.into_os_string().into_vec(), resolved });
                return;
            }
            _ => return,
        }
        let before = ix.directory(&key, &rel).ok().flatten();
        let canonical = nofollow || before.is_some_and(|(b, _)| b.attrs.is_some_and(|a| a.canonical));
        let mut sid = SourceId::of_stat(st);
        if let Some(a) = sid.attrs.as_mut() {
            a.canonical = canonical;
        }
        // Under a duration the record's time moves on with every answer of the store.
        let again = self.config.revalidate != Revalidate::Never;
        if again || before.is_none_or(|(b, _)| b != sid || b.attrs.map(|a| a.canonical) != Some(canonical)) {
            let _ = ix.record_directory(&key, &rel, sid, now_ns());
        }
    }

    /// See [`Cache::cached_link`](super::Cache::cached_link).
    pub(super) fn cached_link(&self, path: &Path) -> Result<Option<Vec<u8>>, Error> {
        if self.config.revalidate != Revalidate::Never {
            return Ok(None);
        }
        let rel = self.source.relative(path)?;
        Ok(self.link(&rel).map(|l| l.target))
    }

    /// See [`Cache::cached_real_path`](super::Cache::cached_real_path).
    pub(super) fn cached_real_path(&self, path: &Path) -> Result<Option<PathBuf>, Error> {
        let Some((rel, e)) = self.trusted_entry(path)? else {
            if self.config.revalidate != Revalidate::Never {
                return Ok(None);
            }
            let rel = self.source.relative(path)?;
            return Ok(self.link(&rel).and_then(|l| l.resolved).map(|p| PathBuf::from(OsStr::from_bytes(&p))));
        };
        if e.source.attrs.is_some_and(|a| a.canonical) {
            return Ok(Some(self.source.path_of(&rel)));
        }
        Ok(self.link(&rel).and_then(|l| l.resolved).map(|p| PathBuf::from(OsStr::from_bytes(&p))))
    }

    /// See [`Cache::cached_statfs`](super::Cache::cached_statfs).
    pub(super) fn cached_statfs(&self) -> Option<libc::statfs64> {
        if self.config.revalidate != Revalidate::Never {
            return None;
        }
        let raw = self.directories()?.statfs().ok()??;
        if raw.len() != std::mem::size_of::<libc::statfs64>() {
            return None;
        }
        // SAFETY: a plain C struct, written by `note_statfs` on this node with the same layout.
        Some(unsafe { std::ptr::read_unaligned(raw.as_ptr() as *const libc::statfs64) })
    }

    /// See [`Cache::note_statfs`](super::Cache::note_statfs).
    pub(super) fn note_statfs(&self, st: &libc::statfs64) {
        if self.config.revalidate != Revalidate::Never {
            return;
        }
        let Some(ix) = self.directories() else { return };
        // SAFETY: the bytes of a plain C struct.
        let raw = unsafe {
            std::slice::from_raw_parts(st as *const libc::statfs64 as *const u8, std::mem::size_of::<libc::statfs64>())
        };
        let _ = ix.record_statfs(raw);
    }

    /// See [`Cache::cached_listing`](super::Cache::cached_listing).
    pub(super) fn cached_listing(&self, path: &Path) -> Option<Vec<Listed>> {
        if !self.records_metadata() {
            return None;
        }
        let rel = self.source.relative_or_root(path).ok()?;
        let ix = self.directories()?;
        let key = key_of(&rel);
        let (at, entries) = ix.listing(&key).ok()??;
        if self.config.revalidate != Revalidate::Never && !self.record_fresh(ix.listed_at(&key).ok()?) {
            return None;
        }
        (at == rel).then_some(entries)?
    }

    /// See [`Cache::note_listing`](super::Cache::note_listing).
    pub(super) fn note_listing(&self, path: &Path, entries: &[Listed]) {
        if !self.records_metadata() {
            return;
        }
        let (Some(ix), Ok(rel)) = (self.directories(), self.source.relative_or_root(path)) else {
            return;
        };
        self.source.counters().add(src_slot::STATS, 1);
        let _ = ix.record_listing(&key_of(&rel), &rel, Some(entries), now_ns());
    }

    /// See [`Cache::shadow_dir`](super::Cache::shadow_dir).
    pub(super) fn shadow_dir(&self, path: &Path) -> Option<PathBuf> {
        if !self.records_metadata() {
            return None;
        }
        let rel = self.source.relative_or_root(path).ok()?;
        let key = key_of(&rel);
        let tier = self.tiers.iter().find(|t| t.index.is_ok())?;
        let ix = tier.index.as_ref().ok()?;
        if ix.listing(&key).ok()?.is_none_or(|(at, _)| at != rel) {
            ix.record_listing(&key, &rel, None, 0).ok()?;
        }
        tier.shadow_dir(&key).ok()
    }

    /// See [`Cache::shadowed`](super::Cache::shadowed).
    pub(super) fn shadowed(&self, name: &Path) -> Option<PathBuf> {
        let tier = self.tiers.iter().find(|t| t.index.is_ok())?;
        let key = tier.key_of_shadow(name)?;
        let (rel, _) = tier.index.as_ref().ok()?.listing(&key).ok()??;
        Some(self.source.path_of(&rel))
    }

    /// See [`Cache::copy_stat`](super::Cache::copy_stat).
    pub(super) fn copy_stat(&self, fd: i32, st: &libc::stat) -> Option<libc::stat> {
        let tier = self.tiers.iter().find(|t| t.holds_device(st.st_dev))?;
        // A copy is never changed in place: one incarnation (device, inode, ctime) always stands for the
        // same source version, and a removed copy (evicted, invalidated) has no link left. So what was
        // found for it once is remembered in this process: Python's `open` calls `fstat` on every file.
        // (Callers that know less of the descriptor, with no inode or link count, take the long way.)
        let incarnation = (st.st_dev, st.st_ino, st.st_ctime, st.st_ctime_nsec);
        let remembered = st.st_nlink > 0 && st.st_ino != 0;
        if remembered {
            if let Some(known) = self.copy_stats.lock().expect("copy stats lock").get(&incarnation) {
                return (known.st_size == st.st_size).then_some(*known);
            }
        }
        let name = std::fs::read_link(format!("/proc/self/fd/{fd}")).ok()?;
        let key = tier.key_of_copy(&name)?;
        let e = tier.index.as_ref().ok()?.lookup(&key).ok()??;
        if !e.ready || e.source.size != st.st_size as u64 {
            return None;
        }
        let rewritten = e.source.to_stat()?;
        if remembered {
            self.remember_copy(incarnation, rewritten);
        }
        Some(rewritten)
    }

    /// The published entry of `path` when its copy is trusted now (`revalidate = "never"`, or confirmed
    /// within the duration).
    pub(super) fn trusted_entry(&self, path: &Path) -> Result<Option<(String, Entry)>, Error> {
        if !self.records_metadata() {
            return Ok(None);
        }
        let rel = self.source.relative(path)?;
        let key = key_of(&rel);
        Ok(self.published(&key, &rel).filter(|e| self.record_fresh(e.confirmed_ns)).map(|e| (rel, e)))
    }

    /// What a published entry or a directory record says of `rel`, when it may answer now (see
    /// [`Inner::record_fresh`]); with `nofollow`, only one recorded as the path's own (`lstat`).
    pub(super) fn known_path(&self, rel: &str, nofollow: bool) -> Option<SourceId> {
        let key = key_of(rel);
        let (known, at) = match self.published(&key, rel) {
            Some(e) => (e.source, e.confirmed_ns),
            None => self.directories().and_then(|ix| ix.directory(&key, rel).ok().flatten())?,
        };
        (self.record_fresh(at) && (!nofollow || known.attrs.is_some_and(|a| a.canonical))).then_some(known)
    }

    /// The record of the symlink `rel`, if one was made.
    pub(super) fn link(&self, rel: &str) -> Option<Link> {
        self.directories()?.link(&key_of(rel), rel).ok().flatten()
    }

    /// Remembers what `fstat` reports for a copy's incarnation (see [`Cache::copy_stat`]).
    pub(super) fn remember_copy(&self, incarnation: CopyIncarnation, st: libc::stat) {
        let mut memo = self.copy_stats.lock().expect("copy stats lock");
        if memo.len() >= COPY_STATS_KEPT {
            memo.clear();
        }
        memo.insert(incarnation, st);
    }

    /// See [`Cache::cached_xattr`](super::Cache::cached_xattr).
    pub(super) fn cached_xattr(&self, path: &Path, query: &XattrQuery) -> Option<XattrAnswer> {
        if self.config.revalidate != Revalidate::Never {
            return None;
        }
        let rel = self.source.relative_or_root(path).ok()?;
        self.directories()?.xattr(&key_of(&rel), &rel, query).ok()?
    }

    /// See [`Cache::note_xattr`](super::Cache::note_xattr).
    pub(super) fn note_xattr(&self, path: &Path, query: &XattrQuery, answer: &XattrAnswer) {
        if self.config.revalidate != Revalidate::Never {
            return;
        }
        let (Some(ix), Ok(rel)) = (self.directories(), self.source.relative_or_root(path)) else {
            return;
        };
        let _ = ix.record_xattr(&key_of(&rel), &rel, query, answer);
    }

    /// See [`Cache::copy_source`](super::Cache::copy_source).
    pub(super) fn copy_source(&self, name: &Path) -> Option<PathBuf> {
        self.tiers.iter().find_map(|t| {
            let e = t.index.as_ref().ok()?.lookup(&t.key_of_copy(name)?).ok()??;
            e.ready.then(|| self.source.path_of(&e.rel))
        })
    }
}
