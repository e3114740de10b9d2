//! Files reached from a directory's descriptor, as the POSIX source reads its tree: `openat`, `openat2`
//! with `RESOLVE_BENEATH`, and a walk one component at a time that never follows a link (the fallback on a
//! kernel without `openat2`), `fstatat` and `getdents64`. Kept apart from the source itself because these
//! are the system calls, each with its own safety argument, that keep a read inside the source.

use std::fs::File;
use std::io;
use std::path::Path;

pub(super) fn c_path(rel: &str) -> io::Result<std::ffi::CString> {
    std::ffi::CString::new(rel).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path with a NUL byte"))
}

/// Opens a directory as a descriptor to resolve relative paths from.
pub fn open_dir(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECTORY).open(path)
}

/// Opens `rel` (relative to `dir`) read-only.
pub fn open_at(dir: &File, rel: &str) -> io::Result<File> {
    open_at_c(dir, &c_path(rel)?)
}

/// [`open_at`] of a path already NUL-terminated (a tier's copy, named on the stack). A raw system call
/// (rustix), not libc's `openat`: in a job under the LD_PRELOAD shim, libc's is the shim's own, which
/// would look at the path only to pass it on.
pub fn open_at_c(dir: &File, c: &std::ffi::CStr) -> io::Result<File> {
    use rustix::fs::{Mode, OFlags};
    let fd = rustix::fs::openat(dir, c, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())?;
    crate::interposer::made(std::os::fd::AsRawFd::as_raw_fd(&fd));
    Ok(File::from(fd))
}

/// `openat2(dir, path, O_RDONLY | O_CLOEXEC | O_NONBLOCK, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`: see
/// [`PosixSource::open_beneath`](super::PosixSource::open_beneath). `O_NONBLOCK` keeps a FIFO planted in the source from blocking the caller
/// (regular files ignore it).
pub(super) fn openat2_beneath(dir: &File, path: &std::ffi::CStr) -> io::Result<File> {
    use std::os::fd::{AsRawFd, FromRawFd};
    // SAFETY: an all-zero open_how is valid (no flags, no mode, no resolve restrictions); its fields are
    // set below. The struct is non-exhaustive, so it cannot be written as a literal.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NONBLOCK) as u64;
    how.resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS;
    loop {
        // SAFETY: openat2 with a valid directory descriptor, a NUL-terminated path and a pointer to `how`
        // with its size; the new descriptor is owned by the File.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                dir.as_raw_fd(),
                path.as_ptr(),
                &how as *const libc::open_how,
                std::mem::size_of::<libc::open_how>(),
            )
        };
        if fd >= 0 {
            crate::interposer::made(fd as i32);
            return Ok(unsafe { File::from_raw_fd(fd as i32) });
        }
        let e = io::Error::last_os_error();
        // RESOLVE_BENEATH fails with EAGAIN when a rename raced the lookup: try again.
        if !matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EINTR)) {
            return Err(e);
        }
    }
}

/// Why [`walk_nofollow`] did not open a file.
pub(super) enum Walked {
    /// The component named (the path up to it) is a symlink.
    Symlink(String),
    /// Another error (not found, permission…), as the system gave it.
    Failed(io::Error),
}

/// Opens `rel` beneath `dir` one component at a time, none of them followed if it is a symlink: the
/// fallback of [`openat2_beneath`] on a kernel without `openat2`. `rel` is a checked relative path (no
/// `.`, `..` or empty component), so the walk cannot climb out of `dir`.
pub(super) fn walk_nofollow(dir: &File, rel: &str) -> Result<File, Walked> {
    let parts: Vec<&str> = rel.split('/').collect();
    let mut at: Option<File> = None;
    for (i, part) in parts.iter().enumerate() {
        let here = parts[..=i].join("/");
        if part.is_empty() || *part == "." || *part == ".." {
            return Err(Walked::Failed(io::Error::new(io::ErrorKind::InvalidInput, format!("bad path {rel:?}"))));
        }
        let c = c_path(part).map_err(Walked::Failed)?;
        let last = i + 1 == parts.len();
        let flags = if last {
            libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NONBLOCK | libc::O_NOFOLLOW
        } else {
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC | libc::O_NOFOLLOW
        };
        let from = at.as_ref().unwrap_or(dir);
        match open_at_flags(from, &c, flags) {
            Ok(f) => at = Some(f),
            // O_NOFOLLOW on a symlink: ELOOP for the last component, ENOTDIR (with O_DIRECTORY) before it.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) => {
                let link = stat_at_nofollow(from, &c).is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFLNK);
                return Err(if link { Walked::Symlink(here) } else { Walked::Failed(e) });
            }
            Err(e) => return Err(Walked::Failed(e)),
        }
    }
    at.ok_or_else(|| Walked::Failed(io::Error::new(io::ErrorKind::InvalidInput, "empty path")))
}

/// `lstat` of `name` relative to `dir`.
fn stat_at_nofollow(dir: &File, name: &std::ffi::CStr) -> io::Result<libc::stat> {
    use std::os::fd::AsRawFd;
    let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: fstatat writes into `st` on success.
    if unsafe { libc::fstatat(dir.as_raw_fd(), name.as_ptr(), st.as_mut_ptr(), libc::AT_SYMLINK_NOFOLLOW) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(unsafe { st.assume_init() })
}

/// The device and inode of an open file, from the kernel's own inode (`statx` asking only for them, with
/// `AT_STATX_DONT_SYNC`: no round trip to a network file system), in the form [`SourceId`](crate::index::SourceId) records them.
pub fn inode_of(file: &File) -> io::Result<(u64, u64)> {
    use std::os::fd::AsRawFd;
    let mut x = std::mem::MaybeUninit::<libc::statx>::zeroed();
    let flags = libc::AT_EMPTY_PATH | libc::AT_STATX_DONT_SYNC;
    // SAFETY: statx writes into `x` on success; the path is the empty C string.
    let rc = unsafe { crate::sys::statx(file.as_raw_fd(), c"".as_ptr(), flags, libc::STATX_INO, x.as_mut_ptr()) };
    if rc != 0 {
        let m = file.metadata()?;
        use std::os::unix::fs::MetadataExt;
        return Ok((m.dev(), m.ino()));
    }
    // SAFETY: statx succeeded.
    let x = unsafe { x.assume_init() };
    Ok((libc::makedev(x.stx_dev_major, x.stx_dev_minor), x.stx_ino))
}

pub(super) fn open_at_flags(dir: &File, name: &std::ffi::CStr, flags: libc::c_int) -> io::Result<File> {
    use std::os::fd::{AsRawFd, FromRawFd};
    // SAFETY: openat with a valid directory descriptor and NUL-terminated name; the new descriptor is owned.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// The entries of an open directory (`.` and `..` left out) with the type `readdir` gave them
/// (`libc::DT_*`; `DT_UNKNOWN` where the file system does not say, as FUSE file systems often do not).
/// One listing of the directory, and nothing asked of any entry: `std::fs::read_dir` would `lstat` every
/// entry of unknown type.
pub fn list_dir(dir: &File) -> io::Result<Vec<(std::ffi::OsString, u8)>> {
    use std::os::fd::AsRawFd;
    use std::os::unix::ffi::OsStrExt;
    // fdopendir takes the descriptor over (closedir closes it): hand it a duplicate.
    // SAFETY: dup of an open descriptor.
    let fd = unsafe { libc::fcntl(dir.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is an open directory descriptor we own; on failure we close it.
    let d = unsafe { libc::fdopendir(fd) };
    if d.is_null() {
        let e = io::Error::last_os_error();
        unsafe { libc::close(fd) };
        return Err(e);
    }
    // The duplicate shares the file offset of `dir`: start at the beginning whatever was read before.
    unsafe { libc::rewinddir(d) };
    let mut out = Vec::new();
    let result = loop {
        // SAFETY: errno is thread-local; readdir returns null at the end (errno unchanged) or on error.
        unsafe { *libc::__errno_location() = 0 };
        let ent = unsafe { libc::readdir64(d) };
        if ent.is_null() {
            let errno = unsafe { *libc::__errno_location() };
            break if errno == 0 { Ok(()) } else { Err(io::Error::from_raw_os_error(errno)) };
        }
        // SAFETY: a non-null entry is valid until the next readdir; its name is NUL-terminated.
        let (name, kind) = unsafe { (std::ffi::CStr::from_ptr((*ent).d_name.as_ptr()), (*ent).d_type) };
        let name = name.to_bytes();
        if name != b"." && name != b".." {
            out.push((std::ffi::OsStr::from_bytes(name).to_os_string(), kind));
        }
    };
    // SAFETY: `d` came from fdopendir and is closed once.
    unsafe { libc::closedir(d) };
    result.map(|()| out)
}

/// `stat` of `rel` relative to `dir`, following symlinks.
pub fn stat_at(dir: &File, rel: &str) -> io::Result<libc::stat> {
    stat_at_c(dir, &c_path(rel)?)
}

pub(super) fn stat_at_c(dir: &File, c: &std::ffi::CStr) -> io::Result<libc::stat> {
    use std::os::fd::AsRawFd;
    let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: fstatat writes into `st` on success.
    if unsafe { libc::fstatat(dir.as_raw_fd(), c.as_ptr(), st.as_mut_ptr(), 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(unsafe { st.assume_init() })
}
