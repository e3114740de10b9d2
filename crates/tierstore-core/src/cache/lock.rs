//! Locks between processes of a node.
//!
//! *Fetch locks* decide which process reads a file from the source (DYAD's coordination). One lock file
//! holds a one-byte POSIX record lock per key, at an offset taken from the key's hash: no lock file per
//! entry, and the kernel releases a dead fetcher's locks when it dies, even by SIGKILL, so a crashed fetch
//! blocks nobody. POSIX record locks belong to the process, not the thread, and are not inherited by
//! `fork()` children (a DataLoader worker never holds its parent's fetch); threads of one process are kept
//! apart by the in-process single flight in `flight.rs`.
//!
//! *Store-read marks* say that a reader reads a file from the store itself (no tier had room for it): a
//! shared record lock on a second byte of the key's, in the half of the lock file above the fetch locks,
//! held while the reader is open. A prefetch that claims the file after the reader's fetch let go of its
//! lock sees the mark and leaves the file alone: copied then, its bytes would be read from the store a
//! second time for a reader that already has them. The kernel ends a dead reader's mark as it ends its
//! fetch locks; threads of one process, which record locks do not tell apart, are counted in process.
//!
//! *Read locks* keep an entry from being evicted under its reader: a reader holds a shared `flock` on the
//! copy it opened; eviction takes the exclusive lock without waiting and skips entries it cannot get.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustc_hash::FxHashMap;

/// Where the store-read marks begin in the lock file: above every fetch lock's offset (those are below
/// 2^62), and with the key's own offset added, below the largest offset a record lock takes (2^63 - 1).
const STORE_READS: i64 = 1 << 62;

/// The lock file of a node's fetch locks.
pub struct FetchLocks {
    file: File,
    /// This process's store-read marks, counted per key (a record lock is not counted: it is taken at the
    /// first and let go of at the last), and the process they belong to (a forked child starts with none:
    /// record locks are not inherited).
    store_reads: Mutex<(u32, FxHashMap<[u8; 16], u32>)>,
}

/// A held fetch lock; released on drop. It may be moved to the background thread that finishes the fetch.
pub struct FetchGuard {
    locks: Arc<FetchLocks>,
    offset: i64,
}

/// The one-byte record lock of `kind` at `offset`.
fn one_byte(kind: i32, offset: i64) -> libc::flock {
    // SAFETY: an all-zero flock is valid; fields are set below.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as i16;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_start = offset;
    fl.l_len = 1;
    fl
}

fn record_lock(fd: i32, kind: i32, offset: i64, wait: bool) -> io::Result<()> {
    let fl = one_byte(kind, offset);
    let cmd = if wait { libc::F_SETLKW } else { libc::F_SETLK };
    // SAFETY: fcntl with a valid descriptor and flock struct.
    if unsafe { libc::fcntl(fd, cmd, &fl) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

impl FetchLocks {
    /// Opens (creating if needed) the lock file. Keep one per process and path: closing any descriptor of
    /// the file would drop every POSIX lock the process holds on it.
    ///
    /// It is the user's own, as every file beside the copies is: made 0600, never opened through a link,
    /// and refused (with the fix) when another user owns it or can write to it, since whoever can lock it
    /// can hold back every fetch of the node ([`crate::private::open_own_file`]).
    pub fn open(path: &Path) -> io::Result<FetchLocks> {
        let file = crate::private::open_own_file(path)?;
        Ok(FetchLocks { file, store_reads: Mutex::new((crate::process::pid(), FxHashMap::default())) })
    }

    fn offset(key: &[u8; 16]) -> i64 {
        (u64::from_le_bytes(key[..8].try_into().expect("8 bytes")) >> 2) as i64
    }

    /// Blocks until this process holds the fetch lock of `key`.
    pub fn lock(self: &Arc<Self>, key: &[u8; 16]) -> io::Result<FetchGuard> {
        let offset = Self::offset(key);
        loop {
            match record_lock(self.file.as_raw_fd(), libc::F_WRLCK, offset, true) {
                Ok(()) => return Ok(FetchGuard { locks: self.clone(), offset }),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                // The kernel sees processes, not threads, so two processes each fetching one key while
                // waiting for the other's can look like a deadlock. It is not one: back off and wait again.
                Err(e) if e.raw_os_error() == Some(libc::EDEADLK) => std::thread::sleep(Duration::from_millis(1)),
                Err(e) => return Err(e),
            }
        }
    }

    /// Takes the fetch lock of `key` if no other process holds it.
    pub fn try_lock(self: &Arc<Self>, key: &[u8; 16]) -> io::Result<Option<FetchGuard>> {
        let offset = Self::offset(key);
        match record_lock(self.file.as_raw_fd(), libc::F_WRLCK, offset, false) {
            Ok(()) => Ok(Some(FetchGuard { locks: self.clone(), offset })),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Marks `key` read from the store by this process until the mark is dropped (see the module).
    pub fn mark_store_read(self: &Arc<Self>, key: &[u8; 16]) -> io::Result<StoreRead> {
        let pid = crate::process::pid();
        let mut reads = self.store_reads_of(pid);
        let count = reads.1.entry(*key).or_insert(0);
        if *count == 0 {
            record_lock(self.file.as_raw_fd(), libc::F_RDLCK, STORE_READS + Self::offset(key), false)?;
        }
        *count += 1;
        Ok(StoreRead { locks: self.clone(), key: *key, pid })
    }

    /// Whether a reader of this process or another reads `key` from the store now.
    pub fn read_from_store(&self, key: &[u8; 16]) -> io::Result<bool> {
        if self.store_reads_of(crate::process::pid()).1.contains_key(key) {
            return Ok(true);
        }
        // A write lock asked for, not taken: the kernel names any other process's lock in its way.
        let mut fl = one_byte(libc::F_WRLCK, STORE_READS + Self::offset(key));
        // SAFETY: fcntl with a valid descriptor and flock struct.
        if unsafe { libc::fcntl(self.file.as_raw_fd(), libc::F_GETLK, &mut fl) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(fl.l_type != libc::F_UNLCK as i16)
    }

    /// This process's store-read marks: the ones counted, or none in a child forked since.
    fn store_reads_of(&self, pid: u32) -> std::sync::MutexGuard<'_, (u32, FxHashMap<[u8; 16], u32>)> {
        let mut reads = self.store_reads.lock().unwrap_or_else(|p| p.into_inner());
        if reads.0 != pid {
            *reads = (pid, FxHashMap::default());
        }
        reads
    }
}

/// A reader's mark that it reads a file from the store ([`FetchLocks::mark_store_read`]); ended on drop.
pub struct StoreRead {
    locks: Arc<FetchLocks>,
    key: [u8; 16],
    /// The process that took it: a copy of it in a forked child ends nothing.
    pid: u32,
}

impl Drop for StoreRead {
    fn drop(&mut self) {
        if self.pid != crate::process::pid() {
            return;
        }
        let mut reads = self.locks.store_reads_of(self.pid);
        let Some(count) = reads.1.get_mut(&self.key) else { return };
        *count -= 1;
        if *count == 0 {
            reads.1.remove(&self.key);
            let offset = STORE_READS + FetchLocks::offset(&self.key);
            let _ = record_lock(self.locks.file.as_raw_fd(), libc::F_UNLCK, offset, false);
        }
    }
}

impl Drop for FetchGuard {
    fn drop(&mut self) {
        let _ = record_lock(self.locks.file.as_raw_fd(), libc::F_UNLCK, self.offset, false);
    }
}

/// Takes a shared read lock on an open cached copy (blocks only while an evictor holds it, microseconds).
pub fn lock_shared(file: &File) -> io::Result<()> {
    loop {
        // SAFETY: flock on an open descriptor.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Tries to take the exclusive lock an evictor needs; false while any reader holds the copy open.
pub fn try_lock_exclusive(file: &File) -> bool {
    // SAFETY: flock on an open descriptor.
    unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_locks_block_eviction() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("entry");
        std::fs::write(&p, b"x").unwrap();
        let reader = File::open(&p).unwrap();
        lock_shared(&reader).unwrap();
        let evictor = File::open(&p).unwrap();
        assert!(!try_lock_exclusive(&evictor));
        drop(reader);
        assert!(try_lock_exclusive(&evictor));
    }

    #[test]
    fn the_lock_file_is_private_and_never_opened_through_a_link() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("fetch.lock");
        FetchLocks::open(&p).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o666)).unwrap();
        let e = FetchLocks::open(&p).err().expect("a lock file others can write was used").to_string();
        assert!(e.contains(&p.display().to_string()) && e.contains("writable by other users"), "{e}");
        std::fs::remove_file(&p).unwrap();
        let elsewhere = dir.path().join("elsewhere");
        std::os::unix::fs::symlink(&elsewhere, &p).unwrap();
        assert!(FetchLocks::open(&p).is_err());
        assert!(!elsewhere.exists(), "the lock file was made through a link");
    }

    #[test]
    fn a_store_read_mark_lasts_until_its_last_reader_in_the_process_drops_it() {
        let dir = tempfile::tempdir().unwrap();
        let locks = Arc::new(FetchLocks::open(&dir.path().join("locks")).unwrap());
        let (key, other) = ([7u8; 16], [8u8; 16]);
        assert!(!locks.read_from_store(&key).unwrap());
        let first = locks.mark_store_read(&key).unwrap();
        let second = locks.mark_store_read(&key).unwrap();
        assert!(locks.read_from_store(&key).unwrap() && !locks.read_from_store(&other).unwrap());
        // The mark is not the key's fetch lock: a fetch of the key goes on, and sees the mark.
        assert!(locks.try_lock(&key).unwrap().is_some());
        drop(first);
        assert!(locks.read_from_store(&key).unwrap(), "one reader of two let go of the other's mark");
        drop(second);
        assert!(!locks.read_from_store(&key).unwrap());
        // The key whose mark sits at the last offset a record lock takes.
        let top = locks.mark_store_read(&[0xff; 16]).unwrap();
        assert!(locks.read_from_store(&[0xff; 16]).unwrap());
        drop(top);
    }

    #[test]
    fn fetch_lock_is_released_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let locks = Arc::new(FetchLocks::open(&dir.path().join("locks")).unwrap());
        let key = [7u8; 16];
        let g = locks.lock(&key).unwrap();
        drop(g);
        assert!(locks.try_lock(&key).unwrap().is_some());
    }
}
