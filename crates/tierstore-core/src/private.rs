//! Directories and files that belong to one user, on a node that other users share.
//!
//! Every directory tierstore keeps bytes in (a tier's namespace, a write-back stage, the agent's runtime
//! directory) may sit where another user of the node can reach it: `/dev/shm`, `/tmp`, a scratch disk.
//! Nothing there is trusted because it was found; it is trusted because it was checked, as OpenSSH's
//! StrictModes checks `~/.ssh` and tmux checks its socket directory:
//!
//! - the directory itself is created mode 0700, or, if it exists, opened with `O_DIRECTORY|O_NOFOLLOW`
//!   and `fstat`ed: owned by the effective user and writable by nobody else, else refused;
//! - every directory above it, as written and as resolved, is owned by root or the user and writable by
//!   nobody else unless it is sticky (`/tmp`, `/dev/shm`), so that no other user can rename it away and
//!   put one of their own in its place after the check.
//!
//! Then every path beneath it is as private as the directory: other users can neither read nor plant
//! anything there, and a path-based open beneath it cannot be redirected. Files made in it are 0600 and
//! created with `O_EXCL|O_NOFOLLOW` where a name could be foreseen.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

/// The effective user of this process.
pub fn euid() -> u32 {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, format!("{}: a path with a NUL byte", path.display())))
}

fn refused(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, message)
}

/// Whether a file of `mode` can be changed by users other than its owner.
fn writable_by_others(mode: u32) -> bool {
    mode & 0o022 != 0
}

/// Checks one directory (or link) above a private directory: see the module's second rule.
fn check_above(above: &Path, meta: &std::fs::Metadata, below: &Path, me: u32) -> io::Result<()> {
    let owner = meta.uid();
    if owner != 0 && owner != me {
        return Err(refused(format!(
            "{} (above {}) belongs to uid {owner}, not to you (uid {me}) or root: its owner could replace \
             what tierstore keeps beneath it. Choose a path under a directory of your own, or under a shared \
             one such as /tmp or /dev/shm",
            above.display(),
            below.display()
        )));
    }
    let sticky = meta.mode() & libc::S_ISVTX != 0;
    if meta.is_dir() && writable_by_others(meta.mode()) && !sticky {
        return Err(refused(format!(
            "{} (above {}) is writable by other users (mode {:04o}) and not sticky: another user could \
             replace what tierstore keeps beneath it. Run chmod go-w {} (or chmod +t, as /tmp is), or choose \
             another path",
            above.display(),
            below.display(),
            meta.mode() & 0o7777,
            above.display()
        )));
    }
    Ok(())
}

/// Checks every directory above `dir`, as written and as resolved (see the module's second rule).
fn check_ancestors(dir: &Path) -> io::Result<()> {
    let absolute = if dir.is_absolute() { dir.to_path_buf() } else { std::env::current_dir()?.join(dir) };
    let mut chains = vec![absolute.clone()];
    if let Some(parent) = absolute.parent() {
        if let Ok(real) = std::fs::canonicalize(parent) {
            let resolved = real.join(absolute.file_name().unwrap_or_default());
            // A path with no link above it resolves to itself: checked once (each engine a forked worker
            // starts opens half a dozen private directories, and each check costs a `statx` a component).
            if resolved != absolute {
                chains.push(resolved);
            }
        }
    }
    let me = euid();
    for chain in chains {
        let mut prefix = PathBuf::new();
        let components: Vec<Component> = chain.components().collect();
        // Every prefix but the directory itself, which `open_checked` checks through its descriptor.
        for c in &components[..components.len().saturating_sub(1)] {
            prefix.push(c);
            if matches!(c, Component::ParentDir | Component::CurDir) {
                continue;
            }
            match std::fs::symlink_metadata(&prefix) {
                Ok(meta) => check_above(&prefix, &meta, dir, me)?,
                Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                Err(e) => return Err(io::Error::new(e.kind(), format!("{}: {e}", prefix.display()))),
            }
        }
    }
    Ok(())
}

/// Opens `dir` with `O_DIRECTORY|O_NOFOLLOW` and checks, through the descriptor, that it is this user's
/// own: owned by the effective user and writable by nobody else. One that others can only read (left by
/// an older tierstore, or made with a wide umask) is narrowed to 0700, since nobody else could have put
/// anything in it.
fn open_checked(dir: &Path) -> io::Result<File> {
    let c = c_path(dir)?;
    // SAFETY: open with a NUL-terminated path; the new descriptor is owned below.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
    checked(fd, dir)
}

/// The directory `dir` just opened as `fd` (or the failure to open it, when `fd` < 0), checked through
/// the descriptor as [`open_checked`] says.
fn checked(fd: libc::c_int, dir: &Path) -> io::Result<File> {
    if fd < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ELOOP) || e.raw_os_error() == Some(libc::ENOTDIR) {
            return Err(refused(format!(
                "{} is a symbolic link or not a directory: tierstore keeps its bytes only in a directory it \
                 made or checked, never through a link. Remove it (rm {}); tierstore creates it again",
                dir.display(),
                dir.display()
            )));
        }
        // Another user's directory this user may not even enter (0700): say whose it is, as below.
        if let Some(owner) = std::fs::symlink_metadata(dir).ok().map(|m| m.uid()).filter(|&u| u != euid()) {
            return Err(foreign_dir(dir, owner));
        }
        return Err(io::Error::new(e.kind(), format!("cannot open {}: {e}", dir.display())));
    }
    // SAFETY: `fd` was just opened and is owned by nobody else.
    let file = unsafe { File::from_raw_fd(fd) };
    let meta = file.metadata()?;
    if meta.uid() != euid() {
        return Err(foreign_dir(dir, meta.uid()));
    }
    if writable_by_others(meta.mode()) {
        return Err(refused(format!(
            "{} is writable by other users (mode {:04o}): they could have planted bytes tierstore would \
             serve. Remove it (rm -r {}); tierstore creates it again, mode 0700",
            dir.display(),
            meta.mode() & 0o7777,
            dir.display()
        )));
    }
    if meta.mode() & 0o077 != 0 {
        // SAFETY: fchmod of a descriptor we own.
        if unsafe { libc::fchmod(file.as_raw_fd(), 0o700) } != 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(e.kind(), format!("cannot make {} private (chmod 700): {e}", dir.display())));
        }
    }
    Ok(file)
}

/// Makes `name` in `parent`, a directory [`ensure_dir`] returned, a directory of this user's own (0700),
/// or checks that it is one, and returns a descriptor of it. Nothing above it needs checking again: the
/// parent is this user's alone, so nobody else can have put or replaced anything in it. The error names
/// `parent_path`/`name`, what was found and the fix.
pub fn ensure_subdir(parent: &File, parent_path: &Path, name: &str) -> io::Result<File> {
    let dir = parent_path.join(name);
    if name.contains('/') || name.is_empty() || name == "." || name == ".." {
        let what = format!("{}: not a plain directory name", dir.display());
        return Err(io::Error::new(io::ErrorKind::InvalidInput, what));
    }
    let c = c_path(Path::new(name))?;
    // SAFETY: mkdirat and openat with a valid directory descriptor and a NUL-terminated name; the new
    // descriptor is owned by `checked`.
    if unsafe { libc::mkdirat(parent.as_raw_fd(), c.as_ptr(), 0o700) } != 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::AlreadyExists {
            return Err(io::Error::new(e.kind(), format!("cannot create {}: {e}", dir.display())));
        }
    }
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: as above.
    let fd = unsafe { libc::openat(parent.as_raw_fd(), c.as_ptr(), flags) };
    checked(fd, &dir)
}

/// The refusal of a directory `owner` (not this user) made.
fn foreign_dir(dir: &Path, owner: u32) -> io::Error {
    refused(format!(
        "{} belongs to uid {owner}, not to you (uid {}): another user could read or plant the bytes tierstore \
         keeps there. Choose another path; if the directory is yours to remove, remove it and tierstore creates \
         it again, mode 0700",
        dir.display(),
        euid()
    ))
}

/// Why the directory `dir` is not this user's own, without opening or changing anything: `None` when it
/// is one (owned by the effective user, writable by nobody else, not a link) or does not exist yet (this
/// user makes it), else what was found. For a path chosen by default, so that another one can be chosen
/// where another user made this one first.
pub fn why_not_own(dir: &Path) -> Option<String> {
    let meta = match std::fs::symlink_metadata(dir) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return None,
        Err(e) => return Some(format!("{} cannot be checked: {e}", dir.display())),
    };
    let me = euid();
    if !meta.is_dir() {
        Some(format!("{} is a symbolic link or not a directory", dir.display()))
    } else if meta.uid() != me {
        Some(format!("{} belongs to uid {}, not to you (uid {me})", dir.display(), meta.uid()))
    } else if writable_by_others(meta.mode()) {
        Some(format!("{} is writable by other users (mode {:04o})", dir.display(), meta.mode() & 0o7777))
    } else {
        None
    }
}

/// Makes `dir` (and any missing directory above it, each 0700) a directory of this user's own, or checks
/// that it is one, and returns a descriptor of it. The error names the path, what was found and the fix.
pub fn ensure_dir(dir: &Path) -> io::Result<File> {
    check_ancestors(dir)?;
    let mut missing = Vec::new();
    let mut at = dir;
    while std::fs::symlink_metadata(at).is_err() {
        missing.push(at.to_path_buf());
        match at.parent() {
            Some(p) if !p.as_os_str().is_empty() => at = p,
            _ => break,
        }
    }
    for d in missing.iter().rev() {
        let c = c_path(d)?;
        // SAFETY: mkdir with a NUL-terminated path.
        if unsafe { libc::mkdir(c.as_ptr(), 0o700) } != 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::AlreadyExists {
                return Err(io::Error::new(e.kind(), format!("cannot create {}: {e}", d.display())));
            }
        }
    }
    if !missing.is_empty() {
        // Another user may have made a missing directory above first (a race in a sticky directory):
        // what exists now is checked again, before anything is trusted beneath it.
        check_ancestors(dir)?;
    }
    open_checked(dir)
}

/// The directory of this user under a tier or stage path that several users may give (`/dev/shm/tierstore`):
/// `<path>/<uid>`.
pub fn user_dir(path: &Path) -> PathBuf {
    path.join(euid().to_string())
}

/// Opens (creating 0600 if absent) the file `name` in the private directory `dir` for reading and
/// writing, never through a symbolic link, and refuses a file that is not this user's own.
pub fn open_file(dir: &File, name: &str) -> io::Result<File> {
    let c = CString::new(name).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a name with a NUL byte"))?;
    let flags = libc::O_RDWR | libc::O_CREAT | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: openat with a valid directory descriptor and NUL-terminated name; the descriptor is owned.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), flags, 0o600 as libc::c_uint) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened.
    let file = unsafe { File::from_raw_fd(fd) };
    let meta = file.metadata()?;
    if meta.uid() != euid() || !meta.is_file() {
        return Err(refused(format!("{name} is not a file of yours (uid {}, mode {:04o})", meta.uid(), meta.mode())));
    }
    Ok(file)
}

/// Opens the file at `path` for reading and writing (appending, with `append`), creating it mode 0600
/// when `create`, never through a symbolic link: a link planted in its place (to make this process write
/// elsewhere) is refused with its path and the fix.
pub fn open_nofollow(path: &Path, append: bool, create: bool) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut options = std::fs::OpenOptions::new();
    options.read(true).create(create).mode(0o600).custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC);
    if append {
        options.append(true);
    } else {
        options.write(true).truncate(false);
    }
    options.open(path).map_err(|e| match e.raw_os_error() {
        Some(libc::ELOOP) => refused(format!("{} is a symbolic link: it is never followed; remove it", path.display())),
        _ => e,
    })
}

/// Opens (creating 0600 if absent) the file at `path` for reading and writing, never through a symbolic
/// link, and checks it through its descriptor as a private directory is checked: a plain file owned by
/// the effective user that nobody else can write, else refused with the path, what was found and the
/// fix. One that others may only read (made with the umask's 0644 by an older tierstore) is narrowed to
/// 0600, since nobody else could have changed it.
pub fn open_own_file(path: &Path) -> io::Result<File> {
    own_file(open_nofollow(path, false, true)?, path)
}

/// [`open_own_file`] of a file that must exist already (another process of the job made it): a missing
/// one is `NotFound`, never created.
pub fn open_own_existing(path: &Path) -> io::Result<File> {
    own_file(open_nofollow(path, false, false)?, path)
}

/// `file`, opened from `path`, if it is a plain file of the effective user's that nobody else can write
/// (narrowed to 0600 if others may read it); else refused with the fix.
fn own_file(file: File, path: &Path) -> io::Result<File> {
    let meta = file.metadata()?;
    let me = euid();
    let remove = |what: String| {
        refused(format!("{what}. Remove it (rm {}); tierstore creates it again, mode 0600", path.display()))
    };
    if !meta.is_file() {
        return Err(remove(format!("{} is not a plain file", path.display())));
    }
    if meta.uid() != me {
        return Err(remove(format!(
            "{} belongs to uid {}, not to you (uid {me}): another user made it, and could change it",
            path.display(),
            meta.uid()
        )));
    }
    if writable_by_others(meta.mode()) {
        return Err(remove(format!(
            "{} is writable by other users (mode {:04o})",
            path.display(),
            meta.mode() & 0o7777
        )));
    }
    if meta.mode() & 0o077 != 0 {
        // SAFETY: fchmod of a descriptor we own.
        if unsafe { libc::fchmod(file.as_raw_fd(), 0o600) } != 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(e.kind(), format!("cannot make {} private (chmod 600): {e}", path.display())));
        }
    }
    Ok(file)
}

/// Creates a new file at `path` (which must not exist), mode 0600, never through a symbolic link.
pub fn create_new(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// The user at the other end of a connected Unix socket, as the kernel recorded it (`SO_PEERCRED`).
pub fn peer_uid(socket: &impl AsRawFd) -> io::Result<u32> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`.
    let r = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut cred as *mut libc::ucred as *mut libc::c_void,
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.uid)
}

/// Checks that the process at the other end of the Unix socket at `path` runs as this user (or root): a
/// socket another user bound in its place is a stranger, whatever it answers.
pub fn check_peer(socket: &impl AsRawFd, path: &Path) -> io::Result<()> {
    let uid = peer_uid(socket)?;
    let me = euid();
    if uid != me && uid != 0 {
        return Err(refused(format!(
            "the agent socket {} is served by uid {uid}, not by you (uid {me}): another user's process listens \
             there. Stop using it: remove {} if it is yours to remove, or give another socket",
            path.display(),
            path.parent().unwrap_or(path).display()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().mode() & 0o7777
    }

    #[test]
    fn a_new_directory_and_its_missing_parents_are_0700() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("a/b/c");
        ensure_dir(&d).unwrap();
        assert_eq!(mode(&d), 0o700);
        assert_eq!(mode(&t.path().join("a")), 0o700);
    }

    #[test]
    fn a_directory_others_can_write_is_refused_and_one_they_can_read_is_narrowed() {
        let t = tempfile::tempdir().unwrap();
        let open = t.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = ensure_dir(&open).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
        assert!(e.to_string().contains("writable by other users (mode 0777)"), "{e}");
        let readable = t.path().join("readable");
        std::fs::create_dir(&readable).unwrap();
        std::fs::set_permissions(&readable, std::fs::Permissions::from_mode(0o755)).unwrap();
        ensure_dir(&readable).unwrap();
        assert_eq!(mode(&readable), 0o700);
    }

    #[test]
    fn a_link_is_never_followed() {
        let t = tempfile::tempdir().unwrap();
        let real = t.path().join("real");
        std::fs::create_dir(&real).unwrap();
        std::os::unix::fs::symlink(&real, t.path().join("link")).unwrap();
        let e = ensure_dir(&t.path().join("link")).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
    }

    #[test]
    fn a_directory_reached_through_a_link_above_is_checked_where_it_really_is() {
        // The path as written is clean; where it resolves to sits in a directory anyone can write.
        let t = tempfile::tempdir().unwrap();
        let shared = t.path().join("shared");
        std::fs::create_dir_all(shared.join("real")).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
        std::os::unix::fs::symlink(shared.join("real"), t.path().join("alias")).unwrap();
        let e = ensure_dir(&t.path().join("alias").join("mine")).unwrap_err();
        assert!(e.to_string().contains("not sticky"), "{e}");
    }

    #[test]
    fn a_subdirectory_is_made_0700_narrowed_or_refused_beneath_a_checked_one() {
        let t = tempfile::tempdir().unwrap();
        let root_path = t.path().join("root");
        let root = ensure_dir(&root_path).unwrap();
        ensure_subdir(&root, &root_path, "new").unwrap();
        assert_eq!(mode(&root_path.join("new")), 0o700);
        let readable = root_path.join("readable");
        std::fs::create_dir(&readable).unwrap();
        std::fs::set_permissions(&readable, std::fs::Permissions::from_mode(0o755)).unwrap();
        ensure_subdir(&root, &root_path, "readable").unwrap();
        assert_eq!(mode(&readable), 0o700);
        let open = root_path.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = ensure_subdir(&root, &root_path, "open").unwrap_err();
        assert!(e.to_string().contains("writable by other users (mode 0777)"), "{e}");
        std::os::unix::fs::symlink(t.path(), root_path.join("link")).unwrap();
        let e = ensure_subdir(&root, &root_path, "link").unwrap_err();
        assert!(e.to_string().contains("symbolic link") && e.to_string().contains("root/link"), "{e}");
        for name in ["a/b", "..", ""] {
            let e = ensure_subdir(&root, &root_path, name).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{name:?}: {e}");
        }
    }

    #[test]
    fn a_directory_above_that_others_can_write_is_refused_unless_sticky() {
        let t = tempfile::tempdir().unwrap();
        let shared = t.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = ensure_dir(&shared.join("mine")).unwrap_err();
        assert!(e.to_string().contains("not sticky"), "{e}");
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
        ensure_dir(&shared.join("mine")).unwrap();
    }

    #[test]
    fn a_file_of_ones_own_is_made_0600_narrowed_or_refused_with_its_fix() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("fetch.lock");
        open_own_file(&p).unwrap();
        assert_eq!(mode(&p), 0o600);
        // An older tierstore's, made with the umask's 0644: narrowed.
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        open_own_file(&p).unwrap();
        assert_eq!(mode(&p), 0o600);
        // One others can write: refused, with the path and the fix.
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o666)).unwrap();
        let e = open_own_file(&p).unwrap_err().to_string();
        assert!(e.contains(&format!("{} is writable by other users (mode 0666)", p.display())), "{e}");
        assert!(e.contains(&format!("rm {}", p.display())), "{e}");
        // A link: never followed, whatever it points at.
        std::fs::remove_file(&p).unwrap();
        let target = t.path().join("victim");
        std::fs::write(&target, b"keep").unwrap();
        std::os::unix::fs::symlink(&target, &p).unwrap();
        assert!(open_own_file(&p).unwrap_err().to_string().contains("symbolic link"));
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        // Another user's (only root can make one here).
        if euid() == 0 {
            std::fs::remove_file(&p).unwrap();
            std::fs::write(&p, b"").unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
            std::os::unix::fs::chown(&p, Some(65534), None).unwrap();
            let e = open_own_file(&p).unwrap_err().to_string();
            assert!(e.contains("belongs to uid 65534, not to you (uid 0)"), "{e}");
        }
    }

    #[test]
    fn why_not_own_names_what_another_user_made_first() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("run");
        assert_eq!(why_not_own(&d), None, "a missing directory is made by this user");
        ensure_dir(&d).unwrap();
        assert_eq!(why_not_own(&d), None);
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(why_not_own(&d).unwrap().contains("writable by other users (mode 0777)"));
        std::fs::remove_dir(&d).unwrap();
        std::os::unix::fs::symlink(t.path(), &d).unwrap();
        assert!(why_not_own(&d).unwrap().contains("symbolic link"));
        if euid() == 0 {
            std::fs::remove_file(&d).unwrap();
            std::fs::create_dir(&d).unwrap();
            std::os::unix::fs::chown(&d, Some(65534), None).unwrap();
            assert!(why_not_own(&d).unwrap().contains("belongs to uid 65534"));
        }
    }

    #[test]
    fn files_are_0600_and_never_opened_through_a_link() {
        let t = tempfile::tempdir().unwrap();
        let dir = ensure_dir(&t.path().join("d")).unwrap();
        let target = t.path().join("victim");
        std::fs::write(&target, b"keep").unwrap();
        std::os::unix::fs::symlink(&target, t.path().join("d/counters")).unwrap();
        assert!(open_file(&dir, "counters").is_err());
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        open_file(&dir, "fresh").unwrap();
        assert_eq!(mode(&t.path().join("d/fresh")), 0o600);
        create_new(&t.path().join("d/new")).unwrap();
        assert_eq!(mode(&t.path().join("d/new")), 0o600);
    }
}
