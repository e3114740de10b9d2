//! The agent's stream directory as a thing on the node: where it is by default (memory, private to the
//! user, one per agent socket), the file its agent holds locked while it lives, what is left of agents
//! that died, and the thread that frees dropped tensors' memory off every commit's path.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

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

fn hex8(bytes: &[u8]) -> String {
    tierstore_core::hash::hex(&tierstore_core::hash::hash(bytes))[..8].to_string()
}

/// The directories under the stream directory: tensor files, manifests, publishes in progress, manifests
/// of versions relayed without their tensors, and tensor files dropped but not yet freed.
pub(super) const SUBDIRS: [&str; 5] = ["blobs", "versions", "tmp", "notices", "trash"];

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
