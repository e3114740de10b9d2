//! Descriptors of large files still being copied into a tier, and the read calls that follow them.
//!
//! A miss on a large file does not make the program wait for the whole copy (a 16 MiB shard's first
//! byte would come after the last one is copied). The open returns a descriptor of the source file at
//! once, and the cache copies the file in the background. Until the copy is finished, `read` and `pread`
//! on that descriptor are served from the copy as it grows, waiting for bytes not yet copied, so the store
//! is read once, by the copy. When the copy is finished, the next read moves the descriptor to it
//! (MONARCH's swap: a fresh open of the copy at the same offset, `dup3`ed over the program's descriptor)
//! and the descriptor leaves the table; from then on its reads are native.
//!
//! Whatever else the program does with the descriptor (mmap, fstat, readv, stdio's internal reads)
//! reaches the source descriptor itself and gets the source's bytes: never wrong, only not cached.
//!
//! Why the table cannot hand a file's bytes to the wrong descriptor:
//! - each entry keeps a duplicate of the descriptor it was made for, and every use first checks with
//!   `kcmp(KCMP_FILE)` that the number still names that open file, so a descriptor closed where the
//!   shim cannot see it (an `fclose` after `fdopen`) and reused for another file is never served;
//! - `read` (which moves the file offset) and the swap hold the entry's lock, so a swap never loses or
//!   repeats the program's position;
//! - the table belongs to a process: a forked child sees none of its parent's entries, and its inherited
//!   descriptors read the source natively.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

use libc::{c_int, c_void, off_t, size_t, ssize_t};
use tierstore_core::{CopyState, Growing};

use crate::fd_table::FdTable;
use crate::Busy;

/// One descriptor the program reads while its file is copied.
struct Stream {
    copy: Arc<Growing>,
    /// A duplicate of the program's descriptor: the same open file, for `kcmp`.
    witness: OwnedFd,
    /// Held by `read` (get offset, read, set offset) and by the swap.
    position: Mutex<()>,
}

static TABLE: FdTable<Arc<Stream>> = FdTable::new();

/// Whether descriptors `a` and `b` of this process name the same open file.
fn same_file(a: c_int, b: c_int) -> bool {
    const KCMP_FILE: c_int = 0;
    let pid = tierstore_core::pid() as libc::pid_t;
    // SAFETY: kcmp only compares kernel objects.
    unsafe { libc::syscall(libc::SYS_kcmp, pid, pid, KCMP_FILE, a, b) == 0 }
}

/// Starts following `copy` for reads of the program's descriptor `fd` (a descriptor of the source file).
/// Where the kernel cannot compare descriptors (no kcmp), the program reads the source natively.
pub(crate) fn register(fd: c_int, copy: Arc<Growing>) {
    // SAFETY: F_DUPFD_CLOEXEC returns a new descriptor this entry owns. Made through the shim's own
    // `fcntl`, it is the shim's (see `own`): the program's closes leave it be.
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        return;
    }
    // SAFETY: `dup` is a fresh descriptor.
    let witness = unsafe { OwnedFd::from_raw_fd(dup) };
    if !same_file(fd, witness.as_raw_fd()) {
        return;
    }
    TABLE.insert(fd, Arc::new(Stream { copy, witness, position: Mutex::new(()) }));
}

/// Forgets `fd` (closed, replaced, or moved to its copy).
pub(crate) fn forget(fd: c_int) {
    crate::drop_as_shim(TABLE.remove(fd));
}

/// Forgets the descriptors from `first` to `last`, closed together.
pub(crate) fn forget_within(first: c_int, last: c_int) {
    let gone = TABLE.remove_within(first, last);
    crate::drop_as_shim((!gone.is_empty()).then_some(gone));
}

/// The entry of `fd`, if the program's descriptor `fd` is one being followed. Calls the shim itself
/// makes (the engine reading the copy) are never followed.
fn lookup(fd: c_int) -> Option<(Arc<Stream>, Busy)> {
    if !TABLE.holds_any() {
        return None; // the path of every read of a program that follows no copy: one atomic load
    }
    let busy = Busy::enter()?;
    let stream = TABLE.get(fd, Arc::clone)?;
    Some((stream, busy))
}

/// Serves `read` (`at` = None) or `pread` (`at` = the offset) of `fd` from its copy. `None`: the real
/// function must do the call (not followed, no longer followed, or just moved to the finished copy).
pub(crate) unsafe fn serve(fd: c_int, buf: *mut c_void, count: size_t, at: Option<off_t>) -> Option<ssize_t> {
    let (stream, _busy) = lookup(fd)?;
    if !same_file(fd, stream.witness.as_raw_fd()) {
        forget(fd); // closed behind the shim's back and reused: not ours any more
        return None;
    }
    match stream.copy.state() {
        CopyState::Failed => {
            forget(fd); // the source descriptor reads on natively
            return None;
        }
        CopyState::Finished => {
            stream.swap(fd);
            return None;
        }
        CopyState::Copying => {}
    }
    if buf.is_null() {
        return None;
    }
    let buf = std::slice::from_raw_parts_mut(buf as *mut u8, count);
    let served = match at {
        Some(offset) if offset < 0 => return None, // EINVAL is the real function's to give
        Some(offset) => stream.copy.read_at(buf, offset as u64),
        None => {
            let _position = stream.position.lock().unwrap_or_else(|e| e.into_inner());
            let offset = libc::lseek(fd, 0, libc::SEEK_CUR);
            if offset < 0 {
                return None;
            }
            let served = stream.copy.read_at(buf, offset as u64);
            if let Some(Ok(n)) = served {
                libc::lseek(fd, offset + n as off_t, libc::SEEK_SET);
            }
            served
        }
    };
    match served {
        Some(Ok(n)) => Some(n as ssize_t),
        // The copy failed (the tier, or the store under the copy): the program's own descriptor of the
        // source reads on natively, with whatever the store answers it.
        Some(Err(_)) | None => {
            forget(fd);
            None
        }
    }
}

impl Stream {
    /// Moves the program's descriptor `fd` to the finished copy, at the same offset and with the same
    /// flags, then forgets it. On any failure the descriptor stays on the source, which is just as right.
    unsafe fn swap(&self, fd: c_int) {
        let _position = self.position.lock().unwrap_or_else(|e| e.into_inner());
        if !same_file(fd, self.witness.as_raw_fd()) {
            forget(fd); // another thread swapped it already
            return;
        }
        // Moved or not, the descriptor reads right bytes from here on without the table.
        self.move_to_copy(fd);
        forget(fd);
    }

    /// `dup3`s a fresh open of the copy over `fd`, at `fd`'s offset and with its flags.
    unsafe fn move_to_copy(&self, fd: c_int) {
        let offset = libc::lseek(fd, 0, libc::SEEK_CUR);
        let fd_flags = libc::fcntl(fd, libc::F_GETFD);
        let status = libc::fcntl(fd, libc::F_GETFL);
        if offset < 0 || fd_flags < 0 || status < 0 {
            return;
        }
        // A new open file of the copy (not a dup of the engine's handle, whose offset is shared).
        let path = format!("/proc/self/fd/{}\0", self.copy.file().as_raw_fd());
        let copy = libc::open(path.as_ptr() as *const libc::c_char, libc::O_RDONLY | libc::O_CLOEXEC);
        if copy < 0 {
            return;
        }
        let copy = OwnedFd::from_raw_fd(copy);
        let c = copy.as_raw_fd();
        // The shared lock keeps an evicting policy from deleting the copy while it is read.
        if libc::flock(c, libc::LOCK_SH | libc::LOCK_NB) != 0
            || libc::lseek(c, offset, libc::SEEK_SET) != offset
            || libc::fcntl(c, libc::F_SETFL, status & libc::O_NONBLOCK) != 0
        {
            return;
        }
        let cloexec = if fd_flags & libc::FD_CLOEXEC != 0 { libc::O_CLOEXEC } else { 0 };
        libc::dup3(c, fd, cloexec);
    }
}
