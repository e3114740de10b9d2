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

use super::storage::Storage;
use crate::clock::now_ns;
use crate::config::Revalidate;
use crate::counters::source as src_slot;
use crate::error::Error;
use crate::index::{key_of, Entry, Link, Listed, SourceId, XattrAnswer, XattrQuery};

impl Storage {
    /// The record of the symlink `rel`, if one was made.
    pub(super) fn symlink(&self, rel: &str) -> Option<Link> {
        self.lookup().directories()?.link(&key_of(rel), rel).ok().flatten()
    }
}

/// The shim's face of the cache: what a trusted source's metadata replays (see the module). Had from
/// [`Cache::trusted`](super::Cache::trusted); it borrows the engine for the call.
pub struct Trusted<'a> {
    storage: &'a Storage,
}

impl<'a> Trusted<'a> {
    pub(super) fn of(storage: &'a Storage) -> Trusted<'a> {
        Trusted { storage }
    }

    /// Whether metadata records (`stat`s of files and directories, listings) are kept and replayed:
    /// not with `revalidate = "always"`, which asks the store every time.
    pub fn records_metadata(&self) -> bool {
        self.storage.config().revalidate != Revalidate::Always
    }

    /// Whether a metadata record taken at `at_ns` may answer now: always with `"never"`, within the
    /// duration with one.
    fn record_fresh(&self, at_ns: u64) -> bool {
        self.storage.trusts(at_ns)
    }

    /// `stat` of a cached file, of a source directory or of a symlink under the source, as the source gave
    /// it, without asking the source; `None` when the answer must come from the source (not known,
    /// recorded by an older index, or copies are revalidated on every open anyway). With `nofollow`
    /// (`lstat`), only for a path known to name the file itself, with no symlink on the way, or a
    /// recorded symlink; without it, a recorded symlink is answered by what it leads to, when that is
    /// known under the source.
    pub fn cached_stat(&self, path: &Path, nofollow: bool) -> Result<Option<libc::stat>, Error> {
        if !self.records_metadata() {
            return Ok(None);
        }
        let rel = self.storage.source().relative_or_root(path)?;
        let known = match self.known_path(&rel, nofollow) {
            Some(sid) => Some(sid),
            None if self.storage.config().revalidate != Revalidate::Never => None,
            None => self.storage.symlink(&rel).and_then(|link| {
                if nofollow {
                    return Some(link.lstat);
                }
                let to = self.storage.source().relative_or_root(Path::new(OsStr::from_bytes(&link.resolved?))).ok()?;
                self.known_path(&to, false)
            }),
        };
        Ok(known.and_then(|sid| sid.to_stat()))
    }

    /// Takes note of what the source answered to a `stat` (`lstat` with `nofollow`) of `path`, so that
    /// the next one of a directory is answered from the cache (only when the source is trusted). A symlink
    /// met by `lstat` is recorded the first time with its target and where it resolves to (asking the
    /// store those two once), so that `lstat`, `readlink`, `realpath`, `stat` and opens through it are
    /// answered from the cache from then on.
    pub fn note_stat(&self, path: &Path, st: &libc::stat, nofollow: bool) {
        if !self.records_metadata() {
            return;
        }
        let Some(ix) = self.storage.lookup().directories() else { return };
        let Ok(rel) = self.storage.source().relative_or_root(path) else { return };
        let key = key_of(&rel);
        match st.st_mode & libc::S_IFMT {
            libc::S_IFDIR => {}
            libc::S_IFLNK if nofollow && !rel.is_empty() && self.storage.config().revalidate == Revalidate::Never => {
                let lstat = SourceId::of_stat(st);
                if ix.link(&key, &rel).ok().flatten().is_some_and(|l| l.lstat == lstat) {
                    return;
                }
                let own = self.storage.source().path_of(&rel);
                self.storage.source().counters().add(src_slot::STATS, 2);
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
        let again = self.storage.config().revalidate != Revalidate::Never;
        if again || before.is_none_or(|(b, _)| b != sid || b.attrs.map(|a| a.canonical) != Some(canonical)) {
            let _ = ix.record_directory(&key, &rel, sid, now_ns());
        }
    }

    /// What `readlink` of `path` returns, when it is a symlink under a trusted source that was recorded.
    pub fn cached_link(&self, path: &Path) -> Result<Option<Vec<u8>>, Error> {
        if self.storage.config().revalidate != Revalidate::Never {
            return Ok(None);
        }
        let rel = self.storage.source().relative(path)?;
        Ok(self.storage.symlink(&rel).map(|l| l.target))
    }

    /// The path of a cached file, or of a recorded symlink, with every symlink resolved (`realpath`),
    /// without asking the source; `None` when only the source can tell.
    pub fn cached_real_path(&self, path: &Path) -> Result<Option<PathBuf>, Error> {
        let Some((rel, e)) = self.trusted_entry(path)? else {
            if self.storage.config().revalidate != Revalidate::Never {
                return Ok(None);
            }
            let rel = self.storage.source().relative(path)?;
            return Ok(self
                .storage
                .symlink(&rel)
                .and_then(|l| l.resolved)
                .map(|p| PathBuf::from(OsStr::from_bytes(&p))));
        };
        if e.source.attrs.is_some_and(|a| a.canonical) {
            return Ok(Some(self.storage.source().path_of(&rel)));
        }
        Ok(self.storage.symlink(&rel).and_then(|l| l.resolved).map(|p| PathBuf::from(OsStr::from_bytes(&p))))
    }

    /// What `statfs` said of the source's file system, recorded the first time it was asked, when the
    /// source is trusted (`revalidate = "never"`); `None` otherwise. One record stands for the whole
    /// source, so a file system mounted inside the source would be reported as the source's.
    pub fn cached_statfs(&self) -> Option<libc::statfs64> {
        if self.storage.config().revalidate != Revalidate::Never {
            return None;
        }
        let raw = self.storage.lookup().directories()?.statfs().ok()??;
        if raw.len() != std::mem::size_of::<libc::statfs64>() {
            return None;
        }
        // SAFETY: a plain C struct, written by `note_statfs` on this node with the same layout.
        Some(unsafe { std::ptr::read_unaligned(raw.as_ptr() as *const libc::statfs64) })
    }

    /// Takes note of what the source answered to `statfs` (only when the source is trusted).
    pub fn note_statfs(&self, st: &libc::statfs64) {
        if self.storage.config().revalidate != Revalidate::Never {
            return;
        }
        let Some(ix) = self.storage.lookup().directories() else { return };
        // SAFETY: the bytes of a plain C struct.
        let raw = unsafe {
            std::slice::from_raw_parts(st as *const libc::statfs64 as *const u8, std::mem::size_of::<libc::statfs64>())
        };
        let _ = ix.record_statfs(raw);
    }

    /// The listing of the source directory `path` as it was recorded, when the source is trusted and
    /// nothing changed it through tierstore since; `None` otherwise.
    pub fn cached_listing(&self, path: &Path) -> Option<Vec<Listed>> {
        if !self.records_metadata() {
            return None;
        }
        let rel = self.storage.source().relative_or_root(path).ok()?;
        let ix = self.storage.lookup().directories()?;
        let key = key_of(&rel);
        let (at, entries) = ix.listing(&key).ok()??;
        if self.storage.config().revalidate != Revalidate::Never && !self.record_fresh(ix.listed_at(&key).ok()?) {
            return None;
        }
        (at == rel).then_some(entries)?
    }

    /// Records what `readdir` listed of the source directory `path` (only when the source is trusted).
    pub fn note_listing(&self, path: &Path, entries: &[Listed]) {
        if !self.records_metadata() {
            return;
        }
        let (Some(ix), Ok(rel)) = (self.storage.lookup().directories(), self.storage.source().relative_or_root(path))
        else {
            return;
        };
        self.storage.source().counters().add(src_slot::STATS, 1);
        let _ = ix.record_listing(&key_of(&rel), &rel, Some(entries), now_ns());
    }

    /// The empty directory of the first tier that stands for the source directory `path` when the source
    /// is trusted (a descriptor of it is handed out in place of one of the source directory, and
    /// [`Trusted::shadowed`] maps it back); `None` otherwise.
    pub fn shadow_dir(&self, path: &Path) -> Option<PathBuf> {
        if !self.records_metadata() {
            return None;
        }
        let rel = self.storage.source().relative_or_root(path).ok()?;
        let key = key_of(&rel);
        let tier = self.storage.lookup().tiers().iter().find(|t| t.index.is_ok())?;
        let ix = tier.index.as_ref().ok()?;
        if ix.listing(&key).ok()?.is_none_or(|(at, _)| at != rel) {
            ix.record_listing(&key, &rel, None, 0).ok()?;
        }
        tier.shadow_dir(&key).ok()
    }

    /// The source directory that the shadow directory `name` (as /proc names an open descriptor) stands
    /// for, if it is one.
    pub fn shadowed(&self, name: &Path) -> Option<PathBuf> {
        let tier = self.storage.lookup().tiers().iter().find(|t| t.index.is_ok())?;
        let key = tier.key_of_shadow(name)?;
        let (rel, _) = tier.index.as_ref().ok()?.listing(&key).ok()??;
        Some(self.storage.source().path_of(&rel))
    }

    /// What `fstat` of descriptor `fd` should say, without asking the kernel: the source's `stat` when
    /// `fd` is the tier copy this thread opened last and no descriptor of the process was ended since
    /// (see `copy_stats.rs`, which says what a caller must report). `None`: ask the kernel, then
    /// [`Trusted::copy_stat`].
    pub fn opened_copy_stat(&self, fd: i32) -> Option<libc::stat> {
        self.storage.lookup().copy_stats().of_descriptor(fd)
    }

    /// What `fstat` should say of descriptor `fd`, whose own `fstat` gave `st`: for a tier copy handed out
    /// by this cache, the `stat` of the source file it is a copy of (so `stat` of the path and `fstat` of
    /// the descriptor agree, as programs such as cp and tar check); `None` for any other descriptor. Costs
    /// nothing for files on other devices than the tiers' or with no name left, a lookup in this
    /// process's memo for a copy it opened, and one `readlink` in /proc for the rest.
    pub fn copy_stat(&self, fd: i32, st: &libc::stat) -> Option<libc::stat> {
        // A file with no name left is no published copy: an evicted copy's /proc name ends in
        // " (deleted)", which no key matches. Said here without that `readlink`, because such files are
        // common on a tier's device: a DataLoader's batches arrive in unlinked files of /dev/shm.
        if st.st_ino != 0 && st.st_nlink == 0 {
            return None;
        }
        let tier = self.storage.lookup().tiers().iter().find(|t| t.holds_device(st.st_dev))?;
        // A copy is never changed in place: one incarnation (device, inode, ctime) always stands for the
        // same source version, and a removed copy (evicted, invalidated) has no link left. So what was
        // found for it once is remembered in this process: Python's `open` calls `fstat` on every file.
        // (Callers that know less of the descriptor, with no inode or link count, take the long way.)
        let incarnation = (st.st_dev, st.st_ino, st.st_ctime, st.st_ctime_nsec);
        let remembered = st.st_nlink > 0 && st.st_ino != 0;
        if remembered {
            if let Some(known) = self.storage.lookup().copy_stats().remembered(&incarnation) {
                return (known.st_size == st.st_size).then_some(known);
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
            self.storage.lookup().copy_stats().remember(incarnation, rewritten);
        }
        Some(rewritten)
    }

    /// The published entry of `path` when its copy is trusted now (`revalidate = "never"`, or confirmed
    /// within the duration).
    fn trusted_entry(&self, path: &Path) -> Result<Option<(String, Entry)>, Error> {
        if !self.records_metadata() {
            return Ok(None);
        }
        let rel = self.storage.source().relative(path)?;
        let key = key_of(&rel);
        Ok(self.storage.lookup().published(&key, &rel).filter(|e| self.record_fresh(e.confirmed_ns)).map(|e| (rel, e)))
    }

    /// What a published entry or a directory record says of `rel`, when it may answer now (see
    /// [`Trusted::record_fresh`]); with `nofollow`, only one recorded as the path's own (`lstat`).
    fn known_path(&self, rel: &str, nofollow: bool) -> Option<SourceId> {
        let key = key_of(rel);
        let (known, at) = match self.storage.lookup().published(&key, rel) {
            Some(e) => (e.source, e.confirmed_ns),
            None => self.storage.lookup().directories().and_then(|ix| ix.directory(&key, rel).ok().flatten())?,
        };
        (self.record_fresh(at) && (!nofollow || known.attrs.is_some_and(|a| a.canonical))).then_some(known)
    }

    /// The store's recorded answer to `query` about `path`, when the source is trusted
    /// (`revalidate = "never"`) and the question was asked since the path last changed through tierstore.
    pub fn cached_xattr(&self, path: &Path, query: &XattrQuery) -> Option<XattrAnswer> {
        if self.storage.config().revalidate != Revalidate::Never {
            return None;
        }
        let rel = self.storage.source().relative_or_root(path).ok()?;
        self.storage.lookup().directories()?.xattr(&key_of(&rel), &rel, query).ok()?
    }

    /// Records the store's answer to `query` about `path` (only when the source is trusted). An answer
    /// asked without following a symlink at `path` also answers the following question whenever `path`
    /// is no symlink: the caller asks that way once it knows.
    pub fn note_xattr(&self, path: &Path, query: &XattrQuery, answer: &XattrAnswer) {
        if self.storage.config().revalidate != Revalidate::Never {
            return;
        }
        let (Some(ix), Ok(rel)) = (self.storage.lookup().directories(), self.storage.source().relative_or_root(path))
        else {
            return;
        };
        let _ = ix.record_xattr(&key_of(&rel), &rel, query, answer);
    }

    /// The source file that `name` (a tier copy, as /proc names an open descriptor) is a copy of.
    pub fn copy_source(&self, name: &Path) -> Option<PathBuf> {
        self.storage.lookup().tiers().iter().find_map(|t| {
            let e = t.index.as_ref().ok()?.lookup(&t.key_of_copy(name)?).ok()??;
            e.ready.then(|| self.storage.source().path_of(&e.rel))
        })
    }

    /// Whether `path` (the name of an open descriptor) is a copy in one of the tiers.
    pub fn is_copy(&self, path: &Path) -> bool {
        self.storage.lookup().tiers().iter().any(|t| t.key_of_copy(path).is_some())
    }
}
