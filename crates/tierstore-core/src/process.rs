//! The process: its id, read without a system call, and forgotten by a forked child.
//!
//! Everything that belongs to one process (an LMDB environment, a copy pool, a temporary file's name)
//! compares this id with the one it was made under, so that a forked child (a DataLoader worker) never
//! uses what its parent opened.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Once;

static PID: AtomicU32 = AtomicU32::new(0);

extern "C" fn forget_pid() {
    PID.store(0, Ordering::Relaxed);
}

/// The current process id, without a system call on the hot path (glibc no longer caches `getpid`). A
/// fork handler clears the cached value in the child, which then reads its own.
pub fn pid() -> u32 {
    static HANDLER: Once = Once::new();
    HANDLER.call_once(|| {
        // SAFETY: registers a handler that only stores to an atomic, which is async-signal-safe.
        unsafe { libc::pthread_atfork(None, None, Some(forget_pid)) };
    });
    match PID.load(Ordering::Relaxed) {
        0 => {
            let pid = std::process::id();
            PID.store(pid, Ordering::Relaxed);
            pid
        }
        pid => pid,
    }
}

/// The kernel's identity of this boot of the node (`/proc/sys/kernel/random/boot_id`, 16 bytes), or
/// `None` where it cannot be read. A record that names the boot it was written in tells, after a crash
/// of the node, that what the page cache held then may not have reached the disk.
pub fn boot_id() -> Option<[u8; 16]> {
    static BOOT: std::sync::OnceLock<Option<[u8; 16]>> = std::sync::OnceLock::new();
    *BOOT.get_or_init(|| {
        let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let hex: Vec<u8> = text.trim().bytes().filter(|b| *b != b'-').collect();
        let mut id = [0u8; 16];
        for (i, pair) in hex.chunks(2).enumerate() {
            *id.get_mut(i)? = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
        }
        (hex.len() == 32).then_some(id)
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_boot_id_is_read_and_the_same_every_time() {
        let id = super::boot_id().expect("Linux names its boot");
        assert_ne!(id, [0; 16]);
        assert_eq!(super::boot_id(), Some(id));
    }
}
