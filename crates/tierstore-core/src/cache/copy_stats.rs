//! What `fstat` reports for the tier copies this process opened, rewritten as their source files' (the
//! shim's replay, [`Trusted::copy_stat`](super::Trusted::copy_stat)).
//!
//! A copy is never changed in place, so one incarnation of a copy file (device, inode, change time) always
//! stands for one source version, and what was found for it once holds for the process's life.
//!
//! The usual asker is the program that just opened the copy: Python's `open` calls `fstat` once as it
//! opens a file and again as `read()` sizes its buffer, on the thread that opened it, before it opens
//! another. So each thread keeps the copy it opened last in a slot of its own, which the open fills and
//! those `fstat`s read without a lock or a hash. A copy opened and left unasked when the thread opens the
//! next goes into the shared memo, for a program that opens several files before it asks of any.
//!
//! **Answered without the system call.** The slot also holds the descriptor the copy was opened as. While
//! that descriptor still names the copy, the shim answers its `fstat` from the slot and the kernel is not
//! asked: the two `fstat`s were a tenth of a warm 4 KiB read under the shim. A descriptor number names
//! another file only after it was closed and used again, so the slot holds the count of descriptors the
//! process had ended when the copy was opened ([`descriptor_ended`], which the shim calls before every
//! call that ends one: `close`, `dup2`, `dup3`, `close_range`, `closefrom`, `fclose`, `fcloseall`,
//! `freopen`, `closedir`). The slot answers only while that count has not moved. What it cannot see is a
//! descriptor closed by a raw system call (`syscall(SYS_close)`, io_uring), or by another process that
//! shares this one's descriptor table but not its memory (`clone` with `CLONE_FILES` and not `CLONE_VM`),
//! and its number used again before the next `close` the shim sees: if the new file is asked for on the
//! same thread before any other close in the process, it is told of the copy. A forked child has a table
//! and a count of its own, so its closes and its parent's do not meet.
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use rustc_hash::FxHashMap;

/// A copy file as one version of it: device, inode and change time (seconds, nanoseconds).
pub(super) type CopyIncarnation = (u64, u64, i64, i64);

/// How many copies' rewritten `stat`s the shared memo holds before it starts over.
const KEPT: usize = 1 << 16;

/// Descriptors the process ended, as far as [`descriptor_ended`] was told.
static ENDED: AtomicU64 = AtomicU64::new(0);

/// A descriptor of this process is about to be closed or replaced: every slot's descriptor stops
/// answering (see the module). Called before the call that ends it, so that its number cannot be handed
/// out again before the count moves.
pub fn descriptor_ended() {
    ENDED.fetch_add(1, Ordering::SeqCst);
}

/// The copy a thread opened last (see the module).
struct Last {
    /// The [`CopyStats`] it belongs to (0: none): a process may hold caches of several sources.
    owner: usize,
    incarnation: CopyIncarnation,
    /// The descriptor it was opened as, and [`ENDED`] then.
    fd: i32,
    ended: u64,
    st: libc::stat,
    /// Whether an `fstat` read it: one that was not goes to the shared memo when the slot is taken.
    asked: bool,
}

thread_local! {
    // Borrowed in place, not copied in and out as a `Cell` would: a `stat` is 144 bytes.
    static LAST: RefCell<Last> = const {
        // SAFETY: an all-zero `stat` is a valid value (every field is an integer).
        RefCell::new(Last {
            owner: 0,
            incarnation: (0, 0, 0, 0),
            fd: -1,
            ended: 0,
            st: unsafe { std::mem::zeroed() },
            asked: true,
        })
    };
}

/// The rewritten `stat`s of copies this process opened (see the module).
pub(super) struct CopyStats {
    /// This one's number among the process's, for the slots (never reused, unlike an address).
    id: usize,
    memo: Mutex<FxHashMap<CopyIncarnation, libc::stat>>,
    /// Whether anything asked for one (the shim does): until then opens remember nothing, and a process
    /// that reads through the Python API pays nothing per open for them.
    asked: AtomicBool,
}

impl Default for CopyStats {
    fn default() -> CopyStats {
        static NEXT: AtomicUsize = AtomicUsize::new(1);
        CopyStats { id: NEXT.fetch_add(1, Ordering::Relaxed), memo: Mutex::default(), asked: AtomicBool::new(false) }
    }
}

impl CopyStats {
    /// Whether an open should remember what it found ([`CopyStats::opened`]).
    pub(super) fn wanted(&self) -> bool {
        self.asked.load(Ordering::Relaxed)
    }

    /// This thread opened the copy `incarnation` as descriptor `fd`; its source's `stat` is `st`.
    pub(super) fn opened(&self, incarnation: CopyIncarnation, fd: i32, st: libc::stat) {
        LAST.with_borrow_mut(|last| {
            if !last.asked && last.owner == self.id && last.incarnation != incarnation {
                self.remember(last.incarnation, last.st);
            }
            let ended = ENDED.load(Ordering::SeqCst);
            *last = Last { owner: self.id, incarnation, fd, ended, st, asked: false };
        });
    }

    /// What was remembered of `incarnation`.
    pub(super) fn remembered(&self, incarnation: &CopyIncarnation) -> Option<libc::stat> {
        self.asked.store(true, Ordering::Relaxed);
        let mine = LAST.with_borrow_mut(|last| {
            (last.owner == self.id && last.incarnation == *incarnation).then(|| {
                last.asked = true;
                last.st
            })
        });
        mine.or_else(|| self.memo.lock().unwrap_or_else(|p| p.into_inner()).get(incarnation).copied())
    }

    /// What `fstat` of descriptor `fd` reports, without asking the kernel, if `fd` is the copy this thread
    /// opened last and no descriptor of the process was ended since (see the module).
    pub(super) fn of_descriptor(&self, fd: i32) -> Option<libc::stat> {
        LAST.with_borrow_mut(|last| {
            let current = last.owner == self.id && last.fd == fd && last.ended == ENDED.load(Ordering::SeqCst);
            current.then(|| {
                last.asked = true;
                last.st
            })
        })
    }

    /// Remembers `st` for `incarnation` in the shared memo (found the long way, or spilled from a slot).
    pub(super) fn remember(&self, incarnation: CopyIncarnation, st: libc::stat) {
        let mut memo = self.memo.lock().unwrap_or_else(|p| p.into_inner());
        if memo.len() >= KEPT {
            memo.clear();
        }
        memo.insert(incarnation, st);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat_of_size(size: i64) -> libc::stat {
        // SAFETY: an all-zero stat is a valid value.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        st.st_size = size;
        st
    }

    #[test]
    fn the_last_copy_opened_is_answered_on_its_thread_and_one_left_unasked_from_the_memo() {
        let stats = CopyStats::default();
        let (a, b, c) = ((1, 10, 0, 0), (1, 11, 0, 0), (1, 12, 0, 0));
        stats.opened(a, 3, stat_of_size(100));
        assert_eq!(stats.remembered(&a).map(|s| s.st_size), Some(100));
        // `b` is opened and not asked before `c` is: it goes to the memo; `a`, asked, does not.
        stats.opened(b, 4, stat_of_size(200));
        stats.opened(c, 5, stat_of_size(300));
        assert_eq!(stats.remembered(&b).map(|s| s.st_size), Some(200));
        assert_eq!(stats.remembered(&c).map(|s| s.st_size), Some(300));
        assert!(stats.remembered(&a).is_none());
        // Another thread has a slot of its own, and sees only the memo.
        std::thread::scope(|s| {
            s.spawn(|| {
                assert!(stats.remembered(&c).is_none());
                assert_eq!(stats.remembered(&b).map(|s| s.st_size), Some(200));
            });
        });
    }

    #[test]
    fn a_descriptor_answers_until_any_descriptor_is_ended() {
        let stats = CopyStats::default();
        let a = (1, 10, 0, 0);
        stats.opened(a, 7, stat_of_size(100));
        assert_eq!(stats.of_descriptor(7).map(|s| s.st_size), Some(100));
        assert_eq!(stats.of_descriptor(7).map(|s| s.st_size), Some(100), "asked twice, as Python does");
        assert!(stats.of_descriptor(8).is_none(), "another descriptor");
        // Any close in the process (here of another descriptor): number 7 may name another file from now.
        descriptor_ended();
        assert!(stats.of_descriptor(7).is_none());
        // The incarnation itself is still known, for an `fstat` that asked the kernel.
        assert_eq!(stats.remembered(&a).map(|s| s.st_size), Some(100));
        // Another thread never sees this thread's slot.
        stats.opened(a, 9, stat_of_size(100));
        std::thread::scope(|s| {
            s.spawn(|| assert!(stats.of_descriptor(9).is_none()));
        });
        assert_eq!(stats.of_descriptor(9).map(|s| s.st_size), Some(100));
    }

    #[test]
    fn a_slot_of_another_cache_answers_nothing() {
        let (one, two) = (CopyStats::default(), CopyStats::default());
        let a = (1, 10, 0, 0);
        one.opened(a, 3, stat_of_size(100));
        assert!(two.remembered(&a).is_none());
        assert!(two.of_descriptor(3).is_none());
        assert_eq!(one.remembered(&a).map(|s| s.st_size), Some(100));
    }
}
