//! The agent's stream directory as a thing on the node: where it is by default (memory, private to the
//! user, one per agent socket), the file its agent holds locked while it lives, what is left of agents
//! that died, and the thread that frees dropped tensors' memory off every commit's path.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use super::{io_err, StreamError};

/// The stream directory of the agent on `socket`: on /dev/shm (memory) when there is one, private to the
/// user, one per socket (agents of several nodes may share a machine in tests).
pub fn default_dir(socket: &Path) -> PathBuf {
    let tag = &hex8(socket.as_os_str().as_encoded_bytes());
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    let shm = Path::new("/dev/shm");
    let base =
        if shm.is_dir() { shm.to_path_buf() } else { socket.parent().unwrap_or(Path::new("/tmp")).to_path_buf() };
    base.join(format!("tierstore-{uid}-stream-{tag}"))
}

/// The stream directory `dir`, this user's own (0700, never through a link), and its `LIVE` file.
pub(super) fn own_dir(dir: &Path) -> std::io::Result<std::fs::File> {
    tierstore_core::private::ensure_dir(dir).and_then(|d| tierstore_core::private::open_file(&d, LIVE))
}

/// The default stream directory `dir`, or, when another user made its foreseeable name first (a
/// directory or link of theirs, or one others can write: refused by [`own_dir`], never used), a fresh
/// one beside it whose name nobody can foresee (`<name>.<random>`, made 0700 by this agent), so that the
/// agent still starts. Its readers learn where it is from the agent's answers; the next agent of the
/// user removes it once its agent is gone, as any other (`remove_dead_siblings`).
pub(super) fn default_or_fresh(dir: &Path) -> Result<(PathBuf, std::fs::File), StreamError> {
    let refused = match own_dir(dir) {
        Ok(live) => return Ok((dir.to_path_buf(), live)),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => e,
        Err(e) => return Err(io_err("cannot create the stream directory", dir)(e)),
    };
    let name = dir.file_name().unwrap_or_default().to_string_lossy().into_owned();
    let mut last = None;
    for _ in 0..8 {
        let nonce = tierstore_core::cluster::session::nonce();
        let fresh = dir.with_file_name(format!("{name}.{}", &tierstore_core::hash::hex(&nonce)[..16]));
        // Made here, now: a name that exists already (nobody could have foreseen it) is passed over.
        let c = std::ffi::CString::new(fresh.as_os_str().as_encoded_bytes()).expect("no NUL in a path we made");
        // SAFETY: mkdir with a NUL-terminated path.
        if unsafe { libc::mkdir(c.as_ptr(), 0o700) } != 0 {
            last = Some(std::io::Error::last_os_error());
            continue;
        }
        let live = own_dir(&fresh).map_err(io_err("cannot create the stream directory", &fresh))?;
        log::warn!(
            "{refused}; the agent keeps its stream versions in {} instead (to use {} again, have its owner or \
             root remove it)",
            fresh.display(),
            dir.display()
        );
        return Ok((fresh, live));
    }
    Err(io_err("cannot create a stream directory beside", dir)(last.unwrap_or(refused)))
}

/// Whether `live`, the `LIVE` file this agent opened and locked, is still the one in `dir`: a sweep may
/// have removed the directory before the lock was taken.
pub(super) fn still_in(dir: &Path, live: &std::fs::File) -> bool {
    use std::os::unix::fs::MetadataExt;
    let (Ok(held), Ok(named)) = (live.metadata(), std::fs::symlink_metadata(dir.join(LIVE))) else { return false };
    held.nlink() > 0 && held.dev() == named.dev() && held.ino() == named.ino()
}

fn hex8(bytes: &[u8]) -> String {
    tierstore_core::hash::hex(&tierstore_core::hash::hash(bytes))[..8].to_string()
}

/// The directories under the stream directory: tensor files, manifests, publishes in progress, manifests
/// of versions relayed without their tensors, tensor files dropped but not yet freed, and spare files
/// allocated for the next publish (`spares.rs`).
pub(super) const SUBDIRS: [&str; 6] = ["blobs", "versions", "tmp", "notices", "trash", "spares"];

/// The file of a stream directory its agent holds locked while it lives.
pub(super) const LIVE: &str = "live.lock";

/// Removes the default stream directories of this user's agents that died without removing theirs
/// (killed): those beside `dir` whose `LIVE` file nobody holds locked. Versions live only as long as the
/// agent that numbered them, so nothing of use goes. Only directories of this user's own, never through
/// a link; anything else is left alone.
pub(super) fn remove_dead_siblings(dir: &Path) {
    use std::os::unix::fs::MetadataExt;
    let (Some(parent), Some(own)) = (dir.parent(), dir.file_name()) else { return };
    let prefix = format!("tierstore-{}-stream-", tierstore_core::private::euid());
    let Ok(entries) = std::fs::read_dir(parent) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if name == own || !name.to_string_lossy().starts_with(&prefix) {
            continue;
        }
        let path = entry.path();
        let ours = std::fs::symlink_metadata(&path)
            .is_ok_and(|m| m.is_dir() && m.uid() == tierstore_core::private::euid() && m.mode() & 0o077 == 0);
        if !ours {
            continue;
        }
        let Ok(live) = tierstore_core::private::open_nofollow(&path.join(LIVE), false, false) else { continue };
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(live.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            match std::fs::remove_dir_all(&path) {
                Ok(()) => log::info!("removed {}, the stream directory of an agent that died", path.display()),
                Err(e) => {
                    log::warn!("cannot remove {}, the stream directory of an agent that died: {e}", path.display())
                }
            }
        }
    }
}

/// Unlinks each file sent, until the sender is gone.
pub(super) fn reaper() -> std::sync::mpsc::Sender<PathBuf> {
    let (tx, rx) = std::sync::mpsc::channel::<PathBuf>();
    std::thread::Builder::new()
        .name("tierstore-stream-reaper".into())
        .spawn(move || {
            for path in rx {
                let _ = std::fs::remove_file(path);
            }
        })
        .expect("spawning a thread");
    tx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_file_is_still_in_its_directory_until_a_sweep_removes_or_replaces_it() {
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join("tierstore-0-stream-test");
        let live = own_dir(&dir).unwrap();
        assert!(still_in(&dir, &live));
        // What a sweep that locked it first does: the directory goes, and an agent starting may make a new
        // one with a new LIVE file before this one looks.
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(!still_in(&dir, &live));
        let _again = own_dir(&dir).unwrap();
        assert!(!still_in(&dir, &live));
    }
}
