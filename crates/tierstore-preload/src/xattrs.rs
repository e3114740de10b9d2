//! Extended attributes and ACLs of a trusted source's paths (`revalidate = "never"`), answered without
//! the store.
//!
//! `cp -a`, `cp --preserve=all` and `shutil.copytree` ask every path they copy for its attribute list
//! and its ACLs (libattr and libacl call `llistxattr`, `lgetxattr`, and `flistxattr`/`fgetxattr` on the
//! descriptor they read), and every such question is a round trip to the store, after a path lookup.
//! So the first time a question is asked about a path of a trusted source, the shim asks the store once,
//! with a buffer that holds any answer, records the whole answer in the first tier's index (see
//! `Index::xattr`), and answers this and every later call from it exactly as the store would: the size
//! for a size query, ERANGE for a buffer too small, the store's errno (ENODATA, EOPNOTSUPP) for a
//! missing attribute or an unsupported file system. Only lasting answers are recorded (a value, ENODATA,
//! EOPNOTSUPP); any other error goes to the program unrecorded.
//!
//! The calls that follow a symlink (`getxattr`, `listxattr`) and those that do not (`l*`) read the same
//! attributes unless the path is a symlink, so a question is recorded as asked without following once
//! the path is known to be no symlink (from the cache's records, or else one `lstat` of the store, noted
//! as a program's `lstat` would be); through a recorded symlink, a following call reads the records of
//! the path it leads to. A descriptor of a tier copy or of a shadow directory (see `dirs`) answers for
//! the source file or directory it stands for, never for the tier's own file (with `revalidate =
//! "always"`, by asking the store about that path), and `fsetxattr`/`fremovexattr` on one change the
//! source. Every change of attributes through the shim forgets the path's records.

use std::ffi::{CStr, CString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use libc::{c_char, c_int, c_void, size_t, ssize_t};
use tierstore_core::config::Revalidate;
use tierstore_core::index::{XattrAnswer, XattrQuery};
use tierstore_core::Cache;

use crate::{changed, dirs, set_errno, shim, Busy};

/// The largest attribute value and list Linux returns (XATTR_SIZE_MAX, XATTR_LIST_MAX): a buffer this
/// large never gets ERANGE, so one call to the store learns the whole answer.
const WHOLE: usize = 64 << 10;

/// What an attribute call is about, once the shim looked at its argument.
enum Target {
    /// A path of a trusted source, and whether the call follows a symlink there: answered from records.
    Trusted(&'static Cache, PathBuf, bool),
    /// Make the call on this source path instead (the file a tier copy's descriptor stands for), with
    /// the variant that follows symlinks.
    Instead(CString),
    /// The real call, as the program made it.
    Real,
}

fn c_path(p: &Path) -> Option<CString> {
    CString::new(p.as_os_str().as_bytes()).ok()
}

fn trusted(cache: &Cache) -> bool {
    cache.config().revalidate == Revalidate::Never
}

/// The target of a call about `path` (`follow`: the variant that follows a final symlink).
unsafe fn path_target(path: *const c_char, follow: bool) -> Target {
    let Some(s) = shim() else { return Target::Real };
    let Some(abs) = s.source_path(libc::AT_FDCWD, path) else { return Target::Real };
    match s.cache() {
        Some(cache) if trusted(cache) => Target::Trusted(cache, abs, follow),
        _ => Target::Real,
    }
}

/// The target of a call about descriptor `fd`: a tier copy or a shadow answers for its source path.
/// The cache is not opened for this: without it, no copy or shadow was handed out.
unsafe fn fd_target(fd: c_int) -> Target {
    if let Some((cache, dir)) = dirs::shadowed(fd) {
        return Target::Trusted(cache, dir, true); // shadows are handed out for trusted sources only
    }
    let Some(cache) = shim().and_then(|s| s.cache.get()).and_then(Option::as_ref) else { return Target::Real };
    let Ok(name) = std::fs::read_link(format!("/proc/self/fd/{fd}")) else { return Target::Real };
    // A descriptor of a file of a trusted source itself (a large file read while it is copied): the kernel
    // names it by its own path, symlinks resolved.
    if trusted(cache) && name.strip_prefix(cache.source_root()).is_ok_and(|rel| !rel.as_os_str().is_empty()) {
        return Target::Trusted(cache, name, false);
    }
    match cache.trusted().copy_source(&name) {
        Some(source) if trusted(cache) => Target::Trusted(cache, source, true),
        Some(source) => c_path(&source).map_or(Target::Real, Target::Instead),
        None => Target::Real,
    }
}

/// The path whose own attributes a call about `path` reads (`follow`: through a symlink there), when
/// records may answer it: the path itself, known (from the cache's records, or else one `lstat` of the
/// store, noted as a program's `lstat` would be) to be no symlink or asked without following, or what a
/// recorded symlink leads to under the source. `None`: the store must answer the call as it was made.
unsafe fn node(cache: &Cache, path: PathBuf, follow: bool) -> Option<PathBuf> {
    let st = match cache.trusted().cached_stat(&path, true).ok().flatten() {
        Some(st) => st,
        None => {
            let c = c_path(&path)?;
            let mut st: libc::stat = std::mem::zeroed();
            if real!("lstat", unsafe extern "C" fn(*const c_char, *mut libc::stat) -> c_int)(c.as_ptr(), &mut st) != 0 {
                return None;
            }
            cache.trusted().note_stat(&path, &st, true); // records a directory or a symlink
            st
        }
    };
    if st.st_mode & libc::S_IFMT != libc::S_IFLNK || !follow {
        return Some(path);
    }
    // A symlink, recorded by now with where it leads.
    let to = cache.trusted().cached_real_path(&path).ok().flatten()?;
    to.starts_with(cache.source_root()).then_some(to)
}

type ListFn = unsafe extern "C" fn(*const c_char, *mut c_char, size_t) -> ssize_t;
type GetFn = unsafe extern "C" fn(*const c_char, *const c_char, *mut c_void, size_t) -> ssize_t;

/// Asks the store `query` about `path` itself (not following a symlink there), for the whole answer.
unsafe fn ask(path: &CStr, query: &XattrQuery) -> XattrAnswer {
    let mut buf = vec![0u8; WHOLE];
    let out = buf.as_mut_ptr();
    let n = match &query.name {
        None => real!("llistxattr", ListFn)(path.as_ptr(), out as *mut c_char, WHOLE),
        Some(name) => {
            let Ok(name) = CString::new(name.as_slice()) else { return XattrAnswer::Errno(libc::EINVAL) };
            real!("lgetxattr", GetFn)(path.as_ptr(), name.as_ptr(), out as *mut c_void, WHOLE)
        }
    };
    if n < 0 {
        return XattrAnswer::Errno(*libc::__errno_location());
    }
    buf.truncate(n as usize);
    XattrAnswer::Value(buf)
}

/// Whether an answer says something lasting about the path: a value, no such attribute, or no
/// attributes on this file system. Anything else (EIO, ENOMEM, EINTR, a permission refused) may be
/// different next time, and is not recorded.
fn lasting(answer: &XattrAnswer) -> bool {
    match answer {
        XattrAnswer::Value(_) => true,
        XattrAnswer::Errno(e) => *e == libc::ENODATA || *e == libc::EOPNOTSUPP,
    }
}

/// Hands `answer` to the program as the system call would for a buffer of `size` bytes at `out`.
unsafe fn give(answer: &XattrAnswer, out: *mut c_void, size: size_t) -> ssize_t {
    match answer {
        XattrAnswer::Errno(e) => {
            set_errno(*e);
            -1
        }
        XattrAnswer::Value(v) if size == 0 => v.len() as ssize_t,
        XattrAnswer::Value(v) if size < v.len() => {
            set_errno(libc::ERANGE);
            -1
        }
        XattrAnswer::Value(v) => {
            std::ptr::copy_nonoverlapping(v.as_ptr(), out as *mut u8, v.len());
            v.len() as ssize_t
        }
    }
}

/// Every read of attributes: `target` says what the call is about, `name` which attribute (`None`: the
/// list), `real` makes the program's own call and `instead` the same call on another path.
unsafe fn read_common(
    target: impl FnOnce() -> Target,
    name: Option<*const c_char>,
    out: *mut c_void,
    size: size_t,
    real: impl FnOnce() -> ssize_t,
    instead: impl FnOnce(*const c_char) -> ssize_t,
) -> ssize_t {
    let Some(_busy) = Busy::enter() else { return real() };
    if (size > 0 && out.is_null()) || name.is_some_and(|n| n.is_null()) {
        return real(); // the kernel's EFAULT
    }
    let (cache, path, follow) = match target() {
        Target::Trusted(cache, path, follow) => (cache, path, follow),
        Target::Instead(path) => return instead(path.as_ptr()),
        Target::Real => return real(),
    };
    // Records are of a path's own attributes, asked without following a symlink there.
    let Some(node) = node(cache, path, follow) else { return real() };
    let query = XattrQuery { name: name.map(|n| CStr::from_ptr(n).to_bytes().to_vec()), follow: false };
    if let Some(answer) = cache.trusted().cached_xattr(&node, &query) {
        return give(&answer, out, size);
    }
    let Some(c_node) = c_path(&node) else { return real() };
    let answer = ask(&c_node, &query);
    if lasting(&answer) {
        cache.trusted().note_xattr(&node, &query, &answer);
    }
    give(&answer, out, size)
}

#[no_mangle]
pub unsafe extern "C" fn listxattr(path: *const c_char, list: *mut c_char, size: size_t) -> ssize_t {
    read_common(
        || path_target(path, true),
        None,
        list as *mut c_void,
        size,
        || real!("listxattr", ListFn)(path, list, size),
        |p| real!("listxattr", ListFn)(p, list, size),
    )
}

#[no_mangle]
pub unsafe extern "C" fn llistxattr(path: *const c_char, list: *mut c_char, size: size_t) -> ssize_t {
    read_common(
        || path_target(path, false),
        None,
        list as *mut c_void,
        size,
        || real!("llistxattr", ListFn)(path, list, size),
        |p| real!("listxattr", ListFn)(p, list, size),
    )
}

#[no_mangle]
pub unsafe extern "C" fn flistxattr(fd: c_int, list: *mut c_char, size: size_t) -> ssize_t {
    read_common(
        || fd_target(fd),
        None,
        list as *mut c_void,
        size,
        || real!("flistxattr", unsafe extern "C" fn(c_int, *mut c_char, size_t) -> ssize_t)(fd, list, size),
        |p| real!("listxattr", ListFn)(p, list, size),
    )
}

#[no_mangle]
pub unsafe extern "C" fn getxattr(
    path: *const c_char,
    name: *const c_char,
    value: *mut c_void,
    size: size_t,
) -> ssize_t {
    read_common(
        || path_target(path, true),
        Some(name),
        value,
        size,
        || real!("getxattr", GetFn)(path, name, value, size),
        |p| real!("getxattr", GetFn)(p, name, value, size),
    )
}

#[no_mangle]
pub unsafe extern "C" fn lgetxattr(
    path: *const c_char,
    name: *const c_char,
    value: *mut c_void,
    size: size_t,
) -> ssize_t {
    read_common(
        || path_target(path, false),
        Some(name),
        value,
        size,
        || real!("lgetxattr", GetFn)(path, name, value, size),
        |p| real!("getxattr", GetFn)(p, name, value, size),
    )
}

#[no_mangle]
pub unsafe extern "C" fn fgetxattr(fd: c_int, name: *const c_char, value: *mut c_void, size: size_t) -> ssize_t {
    read_common(
        || fd_target(fd),
        Some(name),
        value,
        size,
        || {
            real!("fgetxattr", unsafe extern "C" fn(c_int, *const c_char, *mut c_void, size_t) -> ssize_t)(
                fd, name, value, size,
            )
        },
        |p| real!("getxattr", GetFn)(p, name, value, size),
    )
}

// Changes of attributes pass through and forget the records of the path (and, through a symlink, of the
// node it leads to). On a descriptor of a tier copy or a shadow they are made on the source path it
// stands for: the tier's own file is not the program's.

/// After a change of attributes of `path` (`follow`: through a final symlink) succeeded.
unsafe fn changed_path(rc: c_int, path: *const c_char, follow: bool) -> c_int {
    if rc == 0 {
        if let Some(_busy) = Busy::enter() {
            if let Target::Trusted(cache, path, follow) = path_target(path, follow) {
                // Through a recorded symlink the attributes changed are its target's.
                if let Some(to) = follow.then(|| cache.trusted().cached_real_path(&path).ok().flatten()).flatten() {
                    let _ = cache.invalidate(&to);
                }
            }
        }
    }
    changed(rc, &[(libc::AT_FDCWD, path)])
}

/// A change of attributes of descriptor `fd`: `real` on it, or `instead` on the source path a copy or
/// shadow stands for (then forgotten).
unsafe fn change_fd(fd: c_int, real: impl FnOnce() -> c_int, instead: impl FnOnce(*const c_char) -> c_int) -> c_int {
    let target = match Busy::enter() {
        Some(_busy) => fd_target(fd),
        None => Target::Real,
    };
    let path = match target {
        Target::Real => return real(),
        Target::Trusted(_, node, _) => match c_path(&node) {
            Some(p) => p,
            None => return real(),
        },
        Target::Instead(p) => p,
    };
    let rc = instead(path.as_ptr());
    changed(rc, &[(libc::AT_FDCWD, path.as_ptr())])
}

type SetFn = unsafe extern "C" fn(*const c_char, *const c_char, *const c_void, size_t, c_int) -> c_int;
type RemoveFn = unsafe extern "C" fn(*const c_char, *const c_char) -> c_int;

#[no_mangle]
pub unsafe extern "C" fn setxattr(
    path: *const c_char,
    name: *const c_char,
    value: *const c_void,
    size: size_t,
    flags: c_int,
) -> c_int {
    changed_path(real!("setxattr", SetFn)(path, name, value, size, flags), path, true)
}

#[no_mangle]
pub unsafe extern "C" fn lsetxattr(
    path: *const c_char,
    name: *const c_char,
    value: *const c_void,
    size: size_t,
    flags: c_int,
) -> c_int {
    changed_path(real!("lsetxattr", SetFn)(path, name, value, size, flags), path, false)
}

#[no_mangle]
pub unsafe extern "C" fn fsetxattr(
    fd: c_int,
    name: *const c_char,
    value: *const c_void,
    size: size_t,
    flags: c_int,
) -> c_int {
    change_fd(
        fd,
        || {
            real!("fsetxattr", unsafe extern "C" fn(c_int, *const c_char, *const c_void, size_t, c_int) -> c_int)(
                fd, name, value, size, flags,
            )
        },
        |p| real!("setxattr", SetFn)(p, name, value, size, flags),
    )
}

#[no_mangle]
pub unsafe extern "C" fn removexattr(path: *const c_char, name: *const c_char) -> c_int {
    changed_path(real!("removexattr", RemoveFn)(path, name), path, true)
}

#[no_mangle]
pub unsafe extern "C" fn lremovexattr(path: *const c_char, name: *const c_char) -> c_int {
    changed_path(real!("lremovexattr", RemoveFn)(path, name), path, false)
}

#[no_mangle]
pub unsafe extern "C" fn fremovexattr(fd: c_int, name: *const c_char) -> c_int {
    change_fd(
        fd,
        || real!("fremovexattr", unsafe extern "C" fn(c_int, *const c_char) -> c_int)(fd, name),
        |p| real!("removexattr", RemoveFn)(p, name),
    )
}
