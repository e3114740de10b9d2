//! Spare files of shared memory, allocated ahead of the next publish.
//!
//! A publish writes every changed tensor into a file of fresh shared memory, and the kernel allocates and
//! zeroes each page as a write first touches it: for 100 MB on this project's test machine, 51 ms of
//! writes into new files against 24 ms into files whose pages were allocated before. Pages of a retired
//! version cannot be written over instead (a consumer may still map them), so after each publish the agent
//! allocates, on a thread of its own and off every request's path, one spare file for each size of tensor
//! that publish wrote new: a training step usually changes the same tensors as the step before. The next
//! publish renames a spare of a tensor's size into its own directory and writes into it
//! (`tierstore_core::models::stream::Spares`).
//!
//! The spares hold at most the bytes the last publish wrote new (tensors of `SPARE_MIN` bytes or more): a
//! 3%-changed update keeps 3% of the model ahead, a full update the whole model. A size the last publish
//! did not write has its spares removed. Nothing depends on a spare being there: a publish that finds none
//! writes a new file, as before. The thread waits `AFTER_COMMIT` after each commit and runs at
//! `SCHED_IDLE`, so that it takes neither the memory bandwidth nor a core from the consumers copying the
//! version just committed (made at once, the spares slowed that copy by a fifth), nor a core from the
//! trainer.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};

use tierstore_core::models::stream::{spare_len, spare_name, SPARE_MIN};

/// How long after a commit the spares are made: after the consumers' copy of the version (a 100 MB full
/// update: 20-50 ms on this project's test machine), well before the next publish of a trainer.
const AFTER_COMMIT: std::time::Duration = std::time::Duration::from_millis(60);

/// The thread that keeps the spares of a stream directory, and its off switch.
pub(super) struct Keeper {
    dir: PathBuf,
    sizes: Sender<Vec<u64>>,
    /// Set when the directory is being removed; held while a spare is made or removed, so that once set
    /// no file appears in the directory behind its removal.
    closed: Arc<Mutex<bool>>,
}

impl Keeper {
    /// Starts the thread that keeps the spares in `dir`. It ends with the agent.
    pub(super) fn start(dir: PathBuf) -> Keeper {
        let (tx, rx) = channel::<Vec<u64>>();
        let closed = Arc::new(Mutex::new(false));
        let shut = closed.clone();
        let keeps = dir.clone();
        std::thread::Builder::new()
            .name("tierstore-stream-spares".into())
            .spawn(move || {
                // Only on a core nothing else wants: right after a commit the consumers copy the version in,
                // on every core, and a spare is not needed before the next publish.
                let idle = libc::sched_param { sched_priority: 0 };
                // SAFETY: sets this thread's own policy (pid 0); failure leaves it at the normal one.
                unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &idle) };
                let mut made = 0u64;
                while let Ok(mut sizes) = rx.recv() {
                    // The consumers copy the version in right after its commit, and the memory an allocation
                    // zeroes competes with their copy even where the cores do not.
                    std::thread::sleep(AFTER_COMMIT);
                    // Publishes faster than the spares are made: only the latest counts.
                    while let Ok(newer) = rx.try_recv() {
                        sizes = newer;
                    }
                    match_sizes(&keeps, &sizes, &mut made, &shut);
                }
            })
            .expect("spawning a thread");
        Keeper { dir, sizes: tx, closed }
    }

    /// The directory of the spares, which a publish takes them from.
    pub(super) fn dir(&self) -> &Path {
        &self.dir
    }

    /// The bytes the spares hold now.
    pub(super) fn bytes(&self) -> u64 {
        let spares = std::fs::read_dir(&self.dir).into_iter().flatten().flatten();
        spares.filter_map(|e| e.metadata().ok()).map(|m| m.len()).sum()
    }

    /// After a commit: the sizes of the tensors the publish wrote new, which the spares are made to match.
    pub(super) fn publish_wrote(&self, sizes: Vec<u64>) {
        let _ = self.sizes.send(sizes);
    }

    /// Makes no spare from now on (the directory is being removed), waiting for one being made.
    pub(super) fn close(&self) {
        *self.closed.lock().unwrap_or_else(|p| p.into_inner()) = true;
    }
}

/// Makes the spares in `dir` one per size in `sizes` (each of `SPARE_MIN` bytes or more): removes those of
/// sizes not wanted (or more than wanted), then allocates the missing ones, numbered from `made`; nothing
/// once `closed`.
fn match_sizes(dir: &Path, sizes: &[u64], made: &mut u64, closed: &Mutex<bool>) {
    let mut wanted: HashMap<u64, usize> = HashMap::new();
    for &len in sizes.iter().filter(|&&len| len >= SPARE_MIN) {
        *wanted.entry(len).or_default() += 1;
    }
    let open = || closed.lock().unwrap_or_else(|p| p.into_inner());
    {
        let guard = open();
        if *guard {
            return;
        }
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let keep = spare_len(&name).and_then(|len| wanted.get_mut(&len)).filter(|n| **n > 0);
            match keep {
                Some(n) => *n -= 1,
                // Not wanted, or left unfinished by an allocation that failed.
                None => {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
    }
    for (len, n) in wanted {
        for _ in 0..n {
            let guard = open();
            if *guard {
                return;
            }
            *made += 1;
            if let Err(e) = allocate(dir, len, *made) {
                // Out of shared memory, most likely: publishes write new files, as without spares.
                log::debug!("no spare of {len} bytes in {}: {e}", dir.display());
                return;
            }
        }
    }
}

/// Allocates a spare of `len` bytes as `dir/<len>-<n>`, under a name no publish takes until it is whole.
fn allocate(dir: &Path, len: u64, n: u64) -> io::Result<()> {
    let unfinished = dir.join(format!(".new-{n}"));
    let f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&unfinished)?;
    // SAFETY: fallocate on a descriptor this function owns; it allocates (zeroed) pages and sets the size.
    let allocated = unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, len as libc::off_t) } == 0;
    let result = if allocated {
        std::fs::rename(&unfinished, dir.join(spare_name(len, n)))
    } else {
        Err(io::Error::last_os_error())
    };
    if result.is_err() {
        let _ = std::fs::remove_file(&unfinished);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spares_in(dir: &Path) -> Vec<u64> {
        let mut lens: Vec<u64> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let len = spare_len(&e.file_name().to_string_lossy()).expect("only spares");
                assert_eq!(e.metadata().unwrap().len(), len, "a spare is as long as its name says");
                len
            })
            .collect();
        lens.sort_unstable();
        lens
    }

    #[test]
    fn the_spares_follow_the_sizes_of_the_last_publish() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (SPARE_MIN, 3 * SPARE_MIN);
        let (mut made, open) = (0, Mutex::new(false));
        match_sizes(dir.path(), &[a, b, b, 100], &mut made, &open);
        assert_eq!(spares_in(dir.path()), [a, b, b], "one per size written, none below SPARE_MIN");
        // A publish took one of size b; the next wrote only b and a new size c.
        let taken = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| spare_len(&p.file_name().unwrap().to_string_lossy()) == Some(b))
            .unwrap();
        std::fs::remove_file(taken).unwrap();
        std::fs::write(dir.path().join(".new-99"), b"left by a failed allocation").unwrap();
        let c = 2 * SPARE_MIN;
        match_sizes(dir.path(), &[b, c], &mut made, &open);
        assert_eq!(spares_in(dir.path()), [c, b]);
        // Closed (the directory is being removed): nothing more is made or removed.
        match_sizes(dir.path(), &[a], &mut made, &Mutex::new(true));
        assert_eq!(spares_in(dir.path()), [c, b]);
    }
}
