//! Read marks: where the readers of an ordered prefetch record what they have read, across processes.
//!
//! An ordered prefetch (see `cache/order.rs`) keeps a byte budget of files fetched but not yet read, so
//! it must learn when a file is read. The readers are often other processes (DataLoader workers, the
//! programs under `tierstore run`), so the record is a small shared memory-mapped file of `u32` slots:
//! a reader stores the epoch's tag into the slot of the file it opened, with one atomic store and no
//! system call, and the prefetch compares slots with its tag. A tag per epoch lets one file serve every
//! epoch of a job without being cleared.
//!
//! Layout: `u32` slots, native endianness, nothing else. Every reader maps the file through this module
//! (a Python worker through `_core.Marks`), which opens it only if it is the user's own and no link.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::shared_words::SharedWords;

/// The high bit of a slot: its sample has been begun, not yet read, in the epoch of the tag in the other
/// bits. A reader that fetches a sample's files itself (a `DataLoader` worker) stores it as it starts the
/// sample, and the tag alone once the sample is read. Tags are below it.
pub const STARTED: u32 = 1 << 31;

/// A shared array of `u32` read marks.
pub struct ReadMarks {
    slots: SharedWords<AtomicU32>,
    path: PathBuf,
    /// Made by this handle: removed (with its names file) when the handle goes.
    owned: bool,
}

impl ReadMarks {
    /// Creates a new marks file of `slots` slots (all zero) in `dir`, with a name no other process uses.
    pub fn create_in(dir: &Path, slots: usize) -> io::Result<ReadMarks> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        crate::private::ensure_dir(dir)?;
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let name = format!("{}-{}-{nanos}.marks", crate::process::pid(), SEQ.fetch_add(1, Ordering::Relaxed));
        let path = dir.join(name);
        let file = crate::private::create_new(&path)?;
        file.set_len((slots.max(1) * 4) as u64)?;
        let mut marks = Self::map(&file, path)?;
        marks.owned = true;
        Ok(marks)
    }

    /// Leaves the file in place when this handle goes (another process will use it and remove it).
    pub fn keep(mut self) -> PathBuf {
        self.owned = false;
        self.path.clone()
    }

    /// The file naming the path of each slot, one per line, for readers that know paths, not slots.
    pub fn names_path(&self) -> PathBuf {
        self.path.with_extension("names")
    }

    /// Writes the path of each slot (slot `i` on line `i`).
    pub fn write_names<S: AsRef<str>>(&self, names: &[S]) -> io::Result<()> {
        let mut text = String::with_capacity(names.iter().map(|n| n.as_ref().len() + 1).sum());
        for n in names {
            text.push_str(n.as_ref());
            text.push('\n');
        }
        std::fs::write(self.names_path(), text)
    }

    /// Maps an existing marks file (made by [`ReadMarks::create_in`] in another process). The path comes
    /// from an environment variable or a dataset's attribute, so it is opened as any private file is: never
    /// through a symbolic link, and only if it is this user's and nobody else can write it (another user's
    /// file could steer this process's prefetch, or be changed under it).
    pub fn open(path: &Path) -> io::Result<ReadMarks> {
        let file = crate::private::open_own_existing(path)?;
        Self::map(&file, path.to_path_buf())
    }

    fn map(file: &std::fs::File, path: PathBuf) -> io::Result<ReadMarks> {
        Ok(ReadMarks { slots: SharedWords::map_whole(file)?, path, owned: false })
    }

    /// The file, for readers in other processes to map.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of slots.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether there are no slots (never: a marks file has at least one).
    pub fn is_empty(&self) -> bool {
        self.slots.len() == 0
    }

    fn slot(&self, i: usize) -> Option<&AtomicU32> {
        self.slots.get(i)
    }

    /// Records that the file of `slot` was read in the epoch tagged `tag` (a slot out of range is ignored:
    /// a reader must never fail because of the prefetch).
    pub fn mark(&self, slot: usize, tag: u32) {
        if let Some(s) = self.slot(slot) {
            s.store(tag, Ordering::Release);
        }
    }

    /// What `slot` holds (0 for a slot out of range).
    pub fn get(&self, slot: usize) -> u32 {
        self.slot(slot).map_or(0, |s| s.load(Ordering::Acquire))
    }

    /// Whether the file of `slot` was read in the epoch tagged `tag`.
    pub fn is_marked(&self, slot: usize, tag: u32) -> bool {
        self.slot(slot).is_some_and(|s| s.load(Ordering::Acquire) == tag)
    }

    /// Whether a reader began the sample of `slot` in the epoch tagged `tag` ([`STARTED`] with the tag), or
    /// read it: either way its reader opens the file itself, and a fetch ahead of it would come second.
    pub fn is_started(&self, slot: usize, tag: u32) -> bool {
        self.slot(slot).is_some_and(|s| s.load(Ordering::Acquire) & !STARTED == tag)
    }
}

impl Drop for ReadMarks {
    fn drop(&mut self) {
        // The mapping goes with `slots`; a file made here goes with it.
        if self.owned {
            let _ = std::fs::remove_file(&self.path);
            let _ = std::fs::remove_file(self.names_path());
        }
    }
}

/// The slot of each position of an order: the first position of each distinct path gets the next slot,
/// and a path that comes again gets its earlier slot (a reader that opens it cannot tell which of its
/// positions it is reading, and after the first read it is cached anyway).
pub fn slots_of<T: Eq + std::hash::Hash>(order: &[T]) -> (Vec<u32>, usize) {
    let mut seen = std::collections::HashMap::with_capacity(order.len());
    let slots = order
        .iter()
        .map(|p| {
            let next = seen.len() as u32;
            *seen.entry(p).or_insert(next)
        })
        .collect();
    (slots, seen.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_are_shared_between_mappings() {
        let dir = tempfile::tempdir().unwrap();
        let a = ReadMarks::create_in(dir.path(), 10).unwrap();
        let b = ReadMarks::open(a.path()).unwrap();
        assert!(!a.is_marked(3, 1));
        b.mark(3, 1);
        assert!(a.is_marked(3, 1));
        assert!(!a.is_marked(3, 2));
        b.mark(99, 1); // out of range: ignored
        assert_eq!(a.len(), 10);
        let path = a.path().to_path_buf();
        drop(b);
        drop(a);
        assert!(!path.exists(), "the maker removes the file");
    }

    #[test]
    fn a_sample_begun_is_started_but_not_read_until_its_tag_alone_is_stored() {
        let dir = tempfile::tempdir().unwrap();
        let m = ReadMarks::create_in(dir.path(), 4).unwrap();
        m.mark(1, 7 | STARTED);
        assert!(m.is_started(1, 7) && !m.is_marked(1, 7));
        assert!(!m.is_started(1, 6) && !m.is_started(2, 7)); // another epoch's, another slot
        m.mark(1, 7);
        assert!(m.is_started(1, 7) && m.is_marked(1, 7)); // read: started as well
        m.mark(2, 7);
        assert!(m.is_started(2, 7)); // a reader that marks only reads (the shim) is never behind
    }

    #[test]
    fn a_marks_file_through_a_link_or_writable_by_others_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let m = ReadMarks::create_in(dir.path(), 4).unwrap();
        let link = dir.path().join("planted.marks");
        std::os::unix::fs::symlink(m.path(), &link).unwrap();
        let e = ReadMarks::open(&link).err().expect("a link is never followed");
        assert!(e.to_string().contains("symbolic link"), "{e}");
        std::fs::set_permissions(m.path(), std::fs::Permissions::from_mode(0o666)).unwrap();
        let e = ReadMarks::open(m.path()).err().expect("a file others can write is refused");
        assert!(e.to_string().contains("writable by other users"), "{e}");
        let missing = dir.path().join("missing.marks");
        assert_eq!(ReadMarks::open(&missing).err().map(|e| e.kind()), Some(io::ErrorKind::NotFound));
        assert!(!missing.exists(), "opening never creates one");
    }

    #[test]
    fn repeated_paths_share_a_slot() {
        let (slots, n) = slots_of(&["a", "b", "a", "c"]);
        assert_eq!(slots, vec![0, 1, 0, 2]);
        assert_eq!(n, 3);
    }
}
