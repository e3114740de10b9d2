//! Calls on descriptors. Reads of a descriptor whose file is still being copied are served as the copy
//! grows (see `streams`); for every other descriptor these cost one atomic load before the real call.
//! The calls that end a descriptor's life drop it from the table of copies being followed (a missed one
//! is caught by `kcmp`, see `streams`), and `close` and `fclose` journal a staged file (see `writes`);
//! `mmap` and `munmap` let the write-back capture follow a staged file written through a mapping.
//! Every call that ends a descriptor first tells the engine (`descriptor_ended`), whose `fstat` answers
//! for the copy a thread just opened hold only while no descriptor number was freed for another file
//! (see `tierstore_core::cache::copy_stats`).

use libc::{c_int, c_uint, c_void, off_t, size_t, ssize_t, FILE};
use tierstore_core::cache::descriptor_ended;

use crate::kept::forget;
use crate::{set_errno, streams, writes};

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
    forget(fd);
    writes::close(fd, || real!("close", unsafe extern "C" fn(c_int) -> c_int)(fd))
}

#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    descriptor_ended();
    let rc = real!("dup2", unsafe extern "C" fn(c_int, c_int) -> c_int)(old, new);
    if rc >= 0 && old != new {
        forget(new);
    }
    rc
}

#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    descriptor_ended();
    let rc = real!("dup3", unsafe extern "C" fn(c_int, c_int, c_int) -> c_int)(old, new, flags);
    if rc >= 0 {
        forget(new);
    }
    rc
}

/// `close_range` (glibc 2.34, which Python's `os.closerange` and subprocess's children call).
#[no_mangle]
pub unsafe extern "C" fn close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int {
    descriptor_ended();
    match next!("close_range", unsafe extern "C" fn(c_uint, c_uint, c_int) -> c_int) {
        Some(real) => real(first, last, flags),
        None => {
            set_errno(libc::ENOSYS);
            -1
        }
    }
}

/// `closefrom` (glibc 2.34), which closes through glibc's own `close_range`, not the shim's.
#[no_mangle]
pub unsafe extern "C" fn closefrom(low: c_int) {
    descriptor_ended();
    if let Some(real) = next!("closefrom", unsafe extern "C" fn(c_int)) {
        real(low);
    }
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
