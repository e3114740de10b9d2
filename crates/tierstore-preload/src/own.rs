//! The shim's own descriptors (its engine's index, lock files, directories and copies), which the program
//! does not know it has, and so must not close.
//!
//! A program that closes descriptors it never opened, as a daemon does (`os.closerange(3, N)`, a loop of
//! `close` over every number, `closefrom`), would otherwise close the engine's, and the numbers would be
//! handed to the program's next opens: the engine's next write to its index would land in the program's
//! file, and its next open under a directory descriptor would fail (`ENOTDIR`). Without the shim those
//! numbers would not be open at all, so the program loses nothing when the shim keeps them:
//! - `close` of one of them fails with `EBADF`, as a close of a number that is not open does;
//! - `close_range` and `closefrom` close the rest of the range around them.
//!
//! What counts as the shim's: every descriptor this shim's engine makes through the shim's own calls (the
//! open family, `fcntl` and `dup` duplicates, `socket`, `accept`) or reports from a raw system call
//! (`tierstore_core::interposer::made`), the duplicates `streams` keeps among them; the descriptor an open
//! hands the program is the program's. A number leaves the set when the engine closes it, or when the program
//! takes it with `dup2`/`dup3`.
//!
//! The descriptors the engine keeps for its life and writes or opens files under (its index's data file,
//! its tier and source directories, the copies it writes: opened inside
//! `tierstore_core::interposer::lasting`) are also moved above a floor ([`keep_high`]), out of the low
//! numbers a program names itself: a shell's `exec 5>log` is a `dup2` onto 5, which closes whatever is
//! there, and the engine's next index write went into the log. Left where they were opened: the files
//! the engine holds POSIX record locks on (a second descriptor of one cannot be closed without dropping
//! them; a `dup2` onto one costs the locks, not the program's bytes), and everything else, so that what
//! an open hands the program has the number it would have without the shim.
//!
//! A bitmap, not a table: lock-free, so a `fork` in any state leaves the child a coherent copy, and it
//! inherits the descriptors it describes. Descriptors from [`LIMIT`] up are not kept.

use std::sync::atomic::{AtomicU64, Ordering};

use libc::{c_int, c_uint};

/// The descriptors below this number are the ones kept.
const LIMIT: usize = 1 << 16;

static OWN: [AtomicU64; LIMIT / 64] = [const { AtomicU64::new(0) }; LIMIT / 64];

fn slot(fd: c_int) -> Option<(&'static AtomicU64, u64)> {
    let i = usize::try_from(fd).ok().filter(|&i| i < LIMIT)?;
    Some((&OWN[i / 64], 1 << (i % 64)))
}

/// The lowest number the shim moves the descriptors it opens to, or 0 where it keeps them where they
/// are: the middle of the soft limit, at most 512. A program picks low numbers for descriptors of its
/// own (a shell's `exec 5>log` is a `dup2` onto 5, which would replace whatever the shim held there,
/// and the engine would write its index into the log); the kernel hands out the lowest free ones.
fn floor() -> c_int {
    static FLOOR: std::sync::OnceLock<c_int> = std::sync::OnceLock::new();
    *FLOOR.get_or_init(|| {
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes into `limit`.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 || limit.rlim_cur < 128 {
            return 0; // a limit this low leaves no room above the program's own
        }
        (limit.rlim_cur / 2).min(512) as c_int
    })
}

/// Descriptor `fd`, just opened by the shim's engine through the shim's own open for itself to keep (see
/// `tierstore_core::interposer::lasting`), is the shim's: moved above [`floor`] (close-on-exec), out of
/// the numbers a program names itself, and kept. Returns the number the engine is to use.
pub(crate) fn keep_high(fd: c_int) -> c_int {
    let floor = floor();
    if fd < 0 || fd >= floor {
        keep(fd);
        return fd;
    }
    // SAFETY: plain descriptor calls; `fd` is the engine's, not yet seen by anyone else. The duplicate
    // shares its open file (offset, status flags, `flock` locks), so closing `fd` loses nothing of it
    // but the POSIX record locks of the process on the file, which is why the files the engine takes
    // those on are never moved (`open_common`, `tierstore_core::interposer::holds_record_locks`). Raw
    // system calls: through libc they would come back to the shim's own `fcntl` and `close`.
    let high = unsafe { libc::syscall(libc::SYS_fcntl, fd, libc::F_DUPFD_CLOEXEC, floor) } as c_int;
    if high < 0 {
        keep(fd); // the numbers above are full: it stays where it is
        return fd;
    }
    unsafe { libc::syscall(libc::SYS_close, fd) };
    keep(high);
    high
}

/// A call that made descriptor `fd` (when not negative) returned, or the engine reported one it made by a
/// raw system call: the shim's own engine made it, so it is the shim's; or the program did, and the
/// number is the program's. Returns `fd`.
pub(crate) fn made(fd: c_int) -> c_int {
    if crate::shim_calling() {
        keep(fd);
    } else {
        release(fd);
    }
    fd
}

/// Descriptor `fd`, just opened by the shim's engine, is the shim's.
pub(crate) fn keep(fd: c_int) {
    if let Some((word, bit)) = slot(fd) {
        word.fetch_or(bit, Ordering::Relaxed);
    }
}

/// Descriptor number `fd` is not the shim's (any more): closed by it, or handed to the program.
pub(crate) fn release(fd: c_int) {
    if let Some((word, bit)) = slot(fd) {
        if word.load(Ordering::Relaxed) & bit != 0 {
            word.fetch_and(!bit, Ordering::Relaxed);
        }
    }
}

/// Whether descriptor `fd` is the shim's.
pub(crate) fn holds(fd: c_int) -> bool {
    slot(fd).is_some_and(|(word, bit)| word.load(Ordering::Relaxed) & bit != 0)
}

/// The shim's descriptors from `first` to `last` (both included), in order.
fn within(first: c_uint, last: c_uint) -> Vec<c_uint> {
    let end = (last as usize).min(LIMIT - 1);
    let mut found = Vec::new();
    let mut i = first as usize;
    while i <= end {
        let word = OWN[i / 64].load(Ordering::Relaxed) >> (i % 64);
        if word == 0 {
            i = (i / 64 + 1) * 64; // the rest of this word holds none
            continue;
        }
        let next = i + word.trailing_zeros() as usize;
        if next <= end {
            found.push(next as c_uint);
        }
        i = next + 1;
    }
    found
}

/// `close_range(first, last, flags)` for the program: `real` over the range less the shim's descriptors,
/// one call per stretch between them. Returns the first failure, or 0.
pub(crate) fn close_range_around(
    first: c_uint,
    last: c_uint,
    flags: c_int,
    real: impl Fn(c_uint, c_uint, c_int) -> c_int,
) -> c_int {
    if first > last {
        return real(first, last, flags); // EINVAL is the real function's to give
    }
    // The stretches from `from` up to the next of the shim's descriptors, then up to `last`.
    let mut from = first as u64;
    for own in within(first, last) {
        if own as u64 > from {
            let rc = real(from as c_uint, own - 1, flags);
            if rc != 0 {
                return rc;
            }
        }
        from = own as u64 + 1;
    }
    if from <= last as u64 {
        return real(from as c_uint, last, flags);
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    #[test]
    fn a_range_is_closed_around_the_shims_descriptors_and_no_further() {
        for fd in [10, 12, 13, 64, 200] {
            keep(fd);
        }
        let calls = RefCell::new(Vec::new());
        let real = |a, b, _| {
            calls.borrow_mut().push((a, b));
            0
        };
        assert_eq!(close_range_around(3, u32::MAX, 0, real), 0);
        assert_eq!(calls.take(), [(3, 9), (11, 11), (14, 63), (65, 199), (201, u32::MAX)]);
        close_range_around(12, 13, 0, real);
        assert_eq!(calls.take(), []);
        close_range_around(12, 14, 0, real);
        assert_eq!(calls.take(), [(14, 14)]);
        close_range_around(5, 10, 0, real);
        assert_eq!(calls.take(), [(5, 9)]);
        release(12);
        assert!(!holds(12) && holds(13));
        close_range_around(12, 13, 0, real);
        assert_eq!(calls.take(), [(12, 12)]);
        // A number past what the bitmap keeps is the program's; a failure stops the closing.
        keep(LIMIT as c_int);
        assert!(!holds(LIMIT as c_int));
        let failing = |a, b, _| {
            calls.borrow_mut().push((a, b));
            -1
        };
        assert_eq!(close_range_around(3, 100, 0, failing), -1);
        assert_eq!(calls.take(), [(3, 9)]);
        for fd in [10, 13, 64, 200] {
            release(fd);
        }
        assert!(within(0, u32::MAX).is_empty());
    }
}
