//! `flock` with a deadline: how a process of the node waits for a lock that another process holds,
//! without waiting forever when that process is stopped (SIGSTOP, a debugger) or stuck in the middle.
//!
//! `flock(2)` has no timeout, so the lock is tried without blocking and retried after naps that grow
//! from 20 µs to 1 ms: a lock held for a moment costs its waiter about that moment, and one held by a
//! stopped process costs its waiter the deadline and an error that says which file and what to do.
//! Locks belong to the open file, which the threads of a process share: callers serialize their own
//! threads with a mutex around the descriptor.

use std::fs::File;
use std::io;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

/// Takes `op` (`LOCK_SH` or `LOCK_EX`) on `file` (at `path`, for the error) within `within`. The error
/// says what the holder was doing (`holder`, as "a process of yours is stopped in the middle of …").
pub fn lock_within(file: &File, op: libc::c_int, path: &Path, within: Duration, holder: &str) -> io::Result<()> {
    let start = Instant::now();
    let mut nap = Duration::from_micros(20);
    loop {
        // SAFETY: flock on a descriptor this process owns.
        if unsafe { libc::flock(file.as_raw_fd(), op | libc::LOCK_NB) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EWOULDBLOCK) if start.elapsed() < within => {
                std::thread::sleep(nap);
                nap = (nap * 2).min(Duration::from_millis(1));
            }
            Some(libc::EWOULDBLOCK) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "{} stayed locked for {within:?}: a process of yours is stopped or stuck in the middle of \
                         {holder} (continue it with kill -CONT, or kill it)",
                        path.display()
                    ),
                ))
            }
            Some(libc::EINTR) => {}
            _ => return Err(e),
        }
    }
}

/// Releases the lock this process's open `file` holds.
pub fn unlock(file: &File) {
    // SAFETY: flock on a descriptor this process owns.
    unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_UN) };
}
