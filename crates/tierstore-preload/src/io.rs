//! Calls on descriptors. Reads of a descriptor whose file is still being copied are served as the copy
//! grows (see `streams`); for every other descriptor these cost one atomic load before the real call.
//! The calls that end a descriptor's life drop it from the table of copies being followed (a missed one
//! is caught by `kcmp`, see `streams`), and `close` and `fclose` journal a staged file (see `writes`);
//! `mmap` and `munmap` let the write-back capture follow a staged file written through a mapping.
//! `close`, `close_range` and `closefrom` from the program leave the shim's own descriptors open (see
//! `own`). Every call that ends a descriptor first tells the engine (`descriptor_ended`), whose `fstat` answers
//! for the copy a thread just opened hold only while no descriptor number was freed for another file
//! (see `tierstore_core::cache::copy_stats`).

use libc::{c_int, c_uint, c_void, off_t, size_t, ssize_t, FILE};
use tierstore_core::cache::descriptor_ended;

use crate::kept::{forget, forget_within};
use crate::{engine_calling, own, set_errno, streams, writes, Busy};

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, count: size_t) -> ssize_t {
    if let Some(n) = streams::serve(fd, buf, count, None) {
        return n;
    }
    real!("read", unsafe extern "C" fn(c_int, *mut c_void, size_t) -> ssize_t)(fd, buf, count)
}

#[no_mangle]
pub unsafe extern "C" fn pread(fd: c_int, buf: *mut c_void, count: size_t, offset: off_t) -> ssize_t {
    if let Some(n) = streams::serve(fd, buf, count, Some(offset)) {
        return n;
    }
    real!("pread", unsafe extern "C" fn(c_int, *mut c_void, size_t, off_t) -> ssize_t)(fd, buf, count, offset)
}

#[no_mangle]
pub unsafe extern "C" fn pread64(fd: c_int, buf: *mut c_void, count: size_t, offset: off_t) -> ssize_t {
    if let Some(n) = streams::serve(fd, buf, count, Some(offset)) {
        return n;
    }
    real!("pread64", unsafe extern "C" fn(c_int, *mut c_void, size_t, off_t) -> ssize_t)(fd, buf, count, offset)
}

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    descriptor_ended();
    if own::holds(fd) {
        if !engine_calling() {
            // Never the program's (see `own`): without the shim this number would not be open.
            set_errno(libc::EBADF);
            return -1;
        }
        own::release(fd);
    }
    forget(fd);
    writes::close(fd, || real!("close", unsafe extern "C" fn(c_int) -> c_int)(fd))
}

#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    descriptor_ended();
    let rc = real!("dup2", unsafe extern "C" fn(c_int, c_int) -> c_int)(old, new);
    if rc >= 0 && old != new {
        forget(new);
        own::release(new); // the program's now, whatever it was
    }
    rc
}

#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    descriptor_ended();
    let rc = real!("dup3", unsafe extern "C" fn(c_int, c_int, c_int) -> c_int)(old, new, flags);
    if rc >= 0 {
        forget(new);
        own::release(new);
    }
    rc
}

/// `close_range` (glibc 2.34, which Python's `os.closerange` and subprocess's children call). The
/// program's closes the range less the shim's own descriptors (see `own`), and what the shim kept for
/// the program's descriptors in it ends.
#[no_mangle]
pub unsafe extern "C" fn close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int {
    descriptor_ended();
    let Some(real) = next!("close_range", unsafe extern "C" fn(c_uint, c_uint, c_int) -> c_int) else {
        set_errno(libc::ENOSYS);
        return -1;
    };
    let Some(_busy) = Busy::enter() else { return real(first, last, flags) }; // an engine's own
    program_close_range(first, last, flags, |a, b, f| real(a, b, f))
}

/// The program's `close_range(first, last, flags)` through `real`, the shim's descriptors left open.
fn program_close_range(
    first: c_uint,
    last: c_uint,
    flags: c_int,
    real: impl Fn(c_uint, c_uint, c_int) -> c_int,
) -> c_int {
    if flags & libc::CLOSE_RANGE_CLOEXEC as c_int == 0 && first <= last {
        let to_int = |n: c_uint| c_int::try_from(n).unwrap_or(c_int::MAX);
        forget_within(to_int(first), to_int(last));
    }
    own::close_range_around(first, last, flags, real)
}

/// `closefrom` (glibc 2.34), which closes through glibc's own `close_range`, not the shim's: the program's
/// is a `close_range` to the last number, the shim's descriptors left open.
#[no_mangle]
pub unsafe extern "C" fn closefrom(low: c_int) {
    descriptor_ended();
    let Some(real) = next!("closefrom", unsafe extern "C" fn(c_int)) else { return };
    let Some(_busy) = Busy::enter() else { return real(low) }; // an engine's own
    let Some(range) = next!("close_range", unsafe extern "C" fn(c_uint, c_uint, c_int) -> c_int) else {
        return real(low);
    };
    let low = low.max(0) as c_uint;
    if program_close_range(low, c_uint::MAX, 0, |a, b, f| range(a, b, f)) != 0 {
        // A kernel without close_range (before 5.9): each open descriptor of the range, one by one.
        let open: Vec<c_int> = std::fs::read_dir("/proc/self/fd")
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
        let close = real!("close", unsafe extern "C" fn(c_int) -> c_int);
        for fd in open.into_iter().filter(|&fd| fd >= low as c_int && !own::holds(fd)) {
            close(fd);
        }
    }
}

/// `fcntl`, for the duplicates it makes (`F_DUPFD`, `F_DUPFD_CLOEXEC`: Rust's `try_clone`). The third
/// argument of this variadic function arrives where a fixed one would, whatever the command (see `open`),
/// and goes on the same way.
#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: libc::c_ulong) -> c_int {
    let rc = real!("fcntl", unsafe extern "C" fn(c_int, c_int, ...) -> c_int)(fd, cmd, arg);
    if rc >= 0 && (cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC) {
        own::made(rc);
    }
    rc
}

#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    own::made(real!("dup", unsafe extern "C" fn(c_int) -> c_int)(fd))
}

/// `socket`, `accept` and `accept4`: the engine's connections to its agent and its peers.
#[no_mangle]
pub unsafe extern "C" fn socket(domain: c_int, kind: c_int, protocol: c_int) -> c_int {
    own::made(real!("socket", unsafe extern "C" fn(c_int, c_int, c_int) -> c_int)(domain, kind, protocol))
}

#[no_mangle]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut libc::sockaddr, len: *mut libc::socklen_t) -> c_int {
    own::made(real!("accept", unsafe extern "C" fn(c_int, *mut libc::sockaddr, *mut libc::socklen_t) -> c_int)(
        fd, addr, len,
    ))
}

#[no_mangle]
pub unsafe extern "C" fn accept4(
    fd: c_int,
    addr: *mut libc::sockaddr,
    len: *mut libc::socklen_t,
    flags: c_int,
) -> c_int {
    type Accept4 = unsafe extern "C" fn(c_int, *mut libc::sockaddr, *mut libc::socklen_t, c_int) -> c_int;
    own::made(real!("accept4", Accept4)(fd, addr, len, flags))
}

/// `fcloseall`: every stream, closed by glibc's own `close`.
#[no_mangle]
pub unsafe extern "C" fn fcloseall() -> c_int {
    descriptor_ended();
    real!("fcloseall", unsafe extern "C" fn() -> c_int)()
}

/// `fclose`: the journal for a stream of a staged file (see `writes`), and the end of what the shim kept for
/// its descriptor.
#[no_mangle]
pub unsafe extern "C" fn fclose(f: *mut FILE) -> c_int {
    descriptor_ended();
    // glibc closes the stream's descriptor by its own `close`: what the shim keeps for it ends here (a
    // stream of `fdopen` over a descriptor the program opened under the source).
    let fd = if f.is_null() { -1 } else { libc::fileno(f) };
    if fd >= 0 {
        forget(fd);
        own::release(fd);
    }
    writes::fclose(f, || real!("fclose", unsafe extern "C" fn(*mut FILE) -> c_int)(f))
}

/// `mmap`: a writable shared mapping of a staged descriptor is remembered, so that the file is journaled
/// only once the mapping is gone too (see `writes`). The system call itself is made directly: `mmap` is
/// what `malloc` and the dynamic loader call, and looking up the next definition could recurse.
#[no_mangle]
pub unsafe extern "C" fn mmap(
    addr: *mut libc::c_void,
    len: libc::size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: libc::off_t,
) -> *mut libc::c_void {
    // syscall(2) reads every argument as a long: each is widened here (an int's upper half is undefined).
    type L = libc::c_long;
    let p = libc::syscall(libc::SYS_mmap, addr as L, len as L, prot as L, flags as L, fd as L, off as L)
        as *mut libc::c_void;
    writes::mapped(p, len, prot, flags, fd);
    p
}

/// See [`mmap`] (the same function under its large-file name).
#[no_mangle]
pub unsafe extern "C" fn mmap64(
    addr: *mut libc::c_void,
    len: libc::size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: libc::off_t,
) -> *mut libc::c_void {
    mmap(addr, len, prot, flags, fd, off)
}

/// `munmap`: a staged file whose descriptor was closed is journaled when its last mapping goes (see
/// `writes`). The system call is made directly, as `mmap`'s.
#[no_mangle]
pub unsafe extern "C" fn munmap(addr: *mut libc::c_void, len: libc::size_t) -> c_int {
    let rc = libc::syscall(libc::SYS_munmap, addr as libc::c_long, len as libc::c_long) as c_int;
    if rc == 0 {
        writes::unmapped(addr, len);
    }
    rc
}
