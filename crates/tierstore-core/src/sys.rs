//! System calls that glibc wraps only in versions newer than the wheel's floor, glibc 2.17
//! (manylinux2014): `getrandom` (a wrapper since 2.25), `memfd_create` (2.27), `statx` (2.28) and `gettid`
//! (2.30). Calling them through `syscall(2)`, which every glibc has, keeps every artifact of the wheel
//! (the extension, the LD_PRELOAD shim, the agent) free of GLIBC_ symbol versions past 2.17: zig links
//! the wheel against glibc 2.17's symbols, where the wrappers are missing (the agent would not link; the
//! shared libraries would fail at the first call on an older glibc). The wrappers are these system calls
//! and nothing more, so the behaviour is the same; where the kernel lacks one (statx before Linux 4.11,
//! getrandom and memfd_create before 3.17) it answers ENOSYS, which the callers' error paths already take.

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `getrandom(2)`: fills up to `len` bytes at `buf`; the count written, or -1 with errno set.
///
/// # Safety
/// `buf` must be valid for `len` bytes of writes.
pub unsafe fn getrandom(buf: *mut c_void, len: usize, flags: c_uint) -> isize {
    libc::syscall(libc::SYS_getrandom, buf, len, flags) as isize
}

/// `memfd_create(2)`: a new anonymous file's descriptor, or -1 with errno set.
///
/// # Safety
/// `name` must be a NUL-terminated string.
pub unsafe fn memfd_create(name: *const c_char, flags: c_uint) -> c_int {
    let fd = libc::syscall(libc::SYS_memfd_create, name, flags) as c_int;
    crate::interposer::made(fd);
    fd
}

/// `statx(2)`: 0 with `buf` filled, or -1 with errno set.
///
/// # Safety
/// `path` must be a NUL-terminated string and `buf` valid for a write of a `statx`.
pub unsafe fn statx(dirfd: c_int, path: *const c_char, flags: c_int, mask: c_uint, buf: *mut libc::statx) -> c_int {
    libc::syscall(libc::SYS_statx, dirfd, path, flags, mask, buf) as c_int
}

/// `gettid(2)`: the calling thread's ID.
pub fn gettid() -> libc::pid_t {
    // SAFETY: gettid takes no arguments and cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) as libc::pid_t }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_system_calls_answer_as_the_wrappers_do() {
        let mut b = [0u8; 64];
        // SAFETY: `b` is 64 writable bytes.
        assert_eq!(unsafe { getrandom(b.as_mut_ptr().cast(), b.len(), 0) }, 64);
        assert_ne!(b, [0u8; 64]);
        // SAFETY: a NUL-terminated name.
        let fd = unsafe { memfd_create(c"tierstore-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "{}", std::io::Error::last_os_error());
        assert_eq!(unsafe { libc::write(fd, b"abc".as_ptr().cast(), 3) }, 3);
        let mut x = std::mem::MaybeUninit::<libc::statx>::zeroed();
        // SAFETY: the empty path with AT_EMPTY_PATH, and room for a statx.
        let rc = unsafe { statx(fd, c"".as_ptr(), libc::AT_EMPTY_PATH, libc::STATX_BASIC_STATS, x.as_mut_ptr()) };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        // SAFETY: statx succeeded.
        assert_eq!(unsafe { x.assume_init() }.stx_size, 3);
        // SAFETY: our descriptor.
        unsafe { libc::close(fd) };
        assert!(gettid() > 0);
        assert_ne!(gettid(), std::thread::spawn(gettid).join().unwrap(), "each thread has its own ID");
    }
}
