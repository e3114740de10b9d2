//! A small file of words that every process of the node maps and changes with atomic instructions: the
//! counters, a tier's usage table and an index's change numbers (`u64` words), and an ordered prefetch's
//! read marks (`u32` words). One mapping, its bounds and its unmapping, in one place.

use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicU32, AtomicU64};

/// A word such a file holds: an atomic integer, for which every bit pattern (a new file's zeros included)
/// is a valid value, and which other processes change only through atomic instructions.
pub(crate) trait Word: Sync + private::Sealed {}
impl Word for AtomicU64 {}
impl Word for AtomicU32 {}

mod private {
    pub trait Sealed {}
    impl Sealed for std::sync::atomic::AtomicU64 {}
    impl Sealed for std::sync::atomic::AtomicU32 {}
}

/// `words` words of a file, mapped shared (see the module).
pub(crate) struct SharedWords<W: Word = AtomicU64> {
    ptr: *mut W,
    words: usize,
}

// SAFETY: the mapping is shared memory accessed only through atomics.
unsafe impl<W: Word> Send for SharedWords<W> {}
unsafe impl<W: Word> Sync for SharedWords<W> {}

impl<W: Word> SharedWords<W> {
    /// Maps the first `words` words of `file`, which is first made that long if it is shorter (a new file
    /// reads all zeros). `file` must have been opened for reading and writing by its owner's checks.
    pub(crate) fn map(file: &File, words: usize) -> io::Result<SharedWords<W>> {
        let len = words * size_of::<W>();
        if file.metadata()?.len() < len as u64 {
            file.set_len(len as u64)?;
        }
        Self::map_words(file, words)
    }

    /// Maps every whole word of `file` as it is (another process made it, and sized it), refusing an
    /// empty one.
    pub(crate) fn map_whole(file: &File) -> io::Result<SharedWords<W>> {
        let words = file.metadata()?.len() as usize / size_of::<W>();
        if words == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "an empty file of shared words"));
        }
        Self::map_words(file, words)
    }

    fn map_words(file: &File, words: usize) -> io::Result<SharedWords<W>> {
        use std::os::fd::AsRawFd;
        // SAFETY: a shared mapping of a file at least `words` words long; unmapped in Drop.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                words * size_of::<W>(),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(SharedWords { ptr: ptr as *mut W, words })
    }

    /// Word `i`.
    #[inline]
    pub(crate) fn word(&self, i: usize) -> &W {
        assert!(i < self.words);
        // SAFETY: `i` is within the mapping, which lives as long as `self`.
        unsafe { &*self.ptr.add(i) }
    }

    /// Word `i`, if the file has it.
    #[inline]
    pub(crate) fn get(&self, i: usize) -> Option<&W> {
        // SAFETY: `i` is within the mapping, which lives as long as `self`.
        (i < self.words).then(|| unsafe { &*self.ptr.add(i) })
    }

    /// How many words are mapped.
    pub(crate) fn len(&self) -> usize {
        self.words
    }
}

impl<W: Word> Drop for SharedWords<W> {
    fn drop(&mut self) {
        // SAFETY: the mapping was made in `map_words` with this length.
        unsafe { libc::munmap(self.ptr as *mut _, self.words * size_of::<W>()) };
    }
}
