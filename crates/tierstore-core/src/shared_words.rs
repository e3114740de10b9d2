//! A small file of `u64` words that every process of the node maps and changes with atomic instructions:
//! the counters, a tier's usage table and an index's change numbers. One mapping, its bounds and its
//! unmapping, in one place.

use std::fs::File;
use std::io;
use std::sync::atomic::AtomicU64;

/// `words` words of a file, mapped shared (see the module).
pub(crate) struct SharedWords {
    ptr: *mut AtomicU64,
    words: usize,
}

// SAFETY: the mapping is shared memory accessed only through atomics.
unsafe impl Send for SharedWords {}
unsafe impl Sync for SharedWords {}

impl SharedWords {
    /// Maps the first `words` words of `file`, which is first made that long if it is shorter (a new file
    /// reads all zeros). `file` must have been opened for reading and writing by its owner's checks.
    pub(crate) fn map(file: &File, words: usize) -> io::Result<SharedWords> {
        let len = words * 8;
        if file.metadata()?.len() < len as u64 {
            file.set_len(len as u64)?;
        }
        use std::os::fd::AsRawFd;
        // SAFETY: a shared mapping of a file at least `len` bytes long; unmapped in Drop.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(SharedWords { ptr: ptr as *mut AtomicU64, words })
    }

    /// Word `i`.
    #[inline]
    pub(crate) fn word(&self, i: usize) -> &AtomicU64 {
        assert!(i < self.words);
        // SAFETY: `i` is within the mapping, which lives as long as `self`.
        unsafe { &*self.ptr.add(i) }
    }
}

impl Drop for SharedWords {
    fn drop(&mut self) {
        // SAFETY: the mapping was made in `map` with this length.
        unsafe { libc::munmap(self.ptr as *mut _, self.words * 8) };
    }
}
