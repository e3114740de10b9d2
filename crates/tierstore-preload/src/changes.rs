//! The calls that change the store (unlink, mkdir, rmdir, symlink, rename, truncate) pass through untouched, then
//! invalidate what they changed; under a write-back destination, those of a pending file change its journal
//! instead (see `writes`). Extended attributes are changed in `xattrs`, beside their records.

use libc::{c_char, c_int, c_uint, mode_t};

use crate::dirs::{at, unshadow};
use crate::{changed, writes};

#[no_mangle]
pub unsafe extern "C" fn unlink(path: *const c_char) -> c_int {
    if let Some(rc) =
        writes::unlink(libc::AT_FDCWD, path, || real!("unlink", unsafe extern "C" fn(*const c_char) -> c_int)(path))
    {
        return rc;
    }
    let rc = real!("unlink", unsafe extern "C" fn(*const c_char) -> c_int)(path);
    changed(rc, &[(libc::AT_FDCWD, path)])
}

#[no_mangle]
pub unsafe extern "C" fn unlinkat(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int {
    let u = unshadow(dirfd, path);
    let (dirfd, path) = at(&u, dirfd, path);
    if flags & libc::AT_REMOVEDIR == 0 {
        let real = || real!("unlinkat", unsafe extern "C" fn(c_int, *const c_char, c_int) -> c_int)(dirfd, path, flags);
        if let Some(rc) = writes::unlink(dirfd, path, real) {
            return rc;
        }
    }
    let rc = real!("unlinkat", unsafe extern "C" fn(c_int, *const c_char, c_int) -> c_int)(dirfd, path, flags);
    changed(rc, &[(dirfd, path)])
}

#[no_mangle]
pub unsafe extern "C" fn mkdir(path: *const c_char, mode: mode_t) -> c_int {
    let rc = real!("mkdir", unsafe extern "C" fn(*const c_char, mode_t) -> c_int)(path, mode);
    changed(rc, &[(libc::AT_FDCWD, path)])
}

#[no_mangle]
pub unsafe extern "C" fn mkdirat(dirfd: c_int, path: *const c_char, mode: mode_t) -> c_int {
    let u = unshadow(dirfd, path);
    let (dirfd, path) = at(&u, dirfd, path);
    let rc = real!("mkdirat", unsafe extern "C" fn(c_int, *const c_char, mode_t) -> c_int)(dirfd, path, mode);
    changed(rc, &[(dirfd, path)])
}

#[no_mangle]
pub unsafe extern "C" fn rmdir(path: *const c_char) -> c_int {
    let rc = real!("rmdir", unsafe extern "C" fn(*const c_char) -> c_int)(path);
    changed(rc, &[(libc::AT_FDCWD, path)])
}

#[no_mangle]
pub unsafe extern "C" fn symlink(target: *const c_char, path: *const c_char) -> c_int {
    let rc = real!("symlink", unsafe extern "C" fn(*const c_char, *const c_char) -> c_int)(target, path);
    changed(rc, &[(libc::AT_FDCWD, path)])
}

#[no_mangle]
pub unsafe extern "C" fn symlinkat(target: *const c_char, dirfd: c_int, path: *const c_char) -> c_int {
    let u = unshadow(dirfd, path);
    let (dirfd, path) = at(&u, dirfd, path);
    let rc =
        real!("symlinkat", unsafe extern "C" fn(*const c_char, c_int, *const c_char) -> c_int)(target, dirfd, path);
    changed(rc, &[(dirfd, path)])
}

#[no_mangle]
pub unsafe extern "C" fn rename(old: *const c_char, new: *const c_char) -> c_int {
    if let Some(rc) = writes::rename(libc::AT_FDCWD, old, libc::AT_FDCWD, new, 0) {
        return rc;
    }
    let rc = real!("rename", unsafe extern "C" fn(*const c_char, *const c_char) -> c_int)(old, new);
    changed(rc, &[(libc::AT_FDCWD, old), (libc::AT_FDCWD, new)])
}

#[no_mangle]
pub unsafe extern "C" fn renameat(olddir: c_int, old: *const c_char, newdir: c_int, new: *const c_char) -> c_int {
    let (uo, un) = (unshadow(olddir, old), unshadow(newdir, new));
    let ((olddir, old), (newdir, new)) = (at(&uo, olddir, old), at(&un, newdir, new));
    if let Some(rc) = writes::rename(olddir, old, newdir, new, 0) {
        return rc;
    }
    let rc = real!("renameat", unsafe extern "C" fn(c_int, *const c_char, c_int, *const c_char) -> c_int)(
        olddir, old, newdir, new,
    );
    changed(rc, &[(olddir, old), (newdir, new)])
}

#[no_mangle]
pub unsafe extern "C" fn renameat2(
    olddir: c_int,
    old: *const c_char,
    newdir: c_int,
    new: *const c_char,
    flags: c_uint,
) -> c_int {
    let (uo, un) = (unshadow(olddir, old), unshadow(newdir, new));
    let ((olddir, old), (newdir, new)) = (at(&uo, olddir, old), at(&un, newdir, new));
    if let Some(rc) = writes::rename(olddir, old, newdir, new, flags) {
        return rc;
    }
    let rc = real!("renameat2", unsafe extern "C" fn(c_int, *const c_char, c_int, *const c_char, c_uint) -> c_int)(
        olddir, old, newdir, new, flags,
    );
    changed(rc, &[(olddir, old), (newdir, new)])
}

#[no_mangle]
pub unsafe extern "C" fn truncate(path: *const c_char, len: libc::off_t) -> c_int {
    if let Some(rc) = writes::truncate(path, len) {
        return rc;
    }
    let rc = real!("truncate", unsafe extern "C" fn(*const c_char, libc::off_t) -> c_int)(path, len);
    changed(rc, &[(libc::AT_FDCWD, path)])
}

#[no_mangle]
pub unsafe extern "C" fn truncate64(path: *const c_char, len: libc::off_t) -> c_int {
    if let Some(rc) = writes::truncate(path, len) {
        return rc;
    }
    let rc = real!("truncate64", unsafe extern "C" fn(*const c_char, libc::off_t) -> c_int)(path, len);
    changed(rc, &[(libc::AT_FDCWD, path)])
}
