//! A count of the index's changes that any process of the node reads with two atomic loads, so that a
//! process may keep what it looked up (the entry of a file it opens again every epoch) for as long as the
//! index has not changed, instead of reading the index again on every open.
//!
//! Two numbers in a small shared file beside the LMDB environment: `begun`, set by a writer to its own
//! number while it holds LMDB's write lock and before it changes anything, and `done`, raised to that
//! number once its transaction has ended (committed or not). When the two are equal, every change
//! numbered up to them is visible and no other has begun, so the index is as it was at that number.
//!
//! - A look kept with number `n` (read *before* the look) is current while the index still reads `n`:
//!   the look saw every change up to `n`, and none has begun since. A look that also saw a later change is
//!   only kept under an older number, which the later change has already moved on from: it is looked up
//!   again, never served stale.
//! - A writer killed inside its transaction leaves `begun` ahead of `done`: nothing reads as unchanged (no
//!   look is kept) until the next writer's number is done (`done` is raised to the largest number
//!   finished, so a slow writer finishing after a later one never lowers it).
//! - Hits written back for the eviction order (`Index::record_access`) are not counted: they change no
//!   entry's version, copy or place, and under an evicting policy they are written every half second.
//!
//! The numbers are never reset (a counter that came back to a number some process kept would make its
//! look current again).

use std::io;
use std::path::Path;
use std::sync::atomic::Ordering;

use crate::shared_words::SharedWords;

const MAGIC: u64 = 0x7469_6572_6368_6731; // "tierchg1"
/// Words: the magic number, `begun`, `done`.
const WORDS: usize = 3;
const BEGUN: usize = 1;
const DONE: usize = 2;

/// The shared change numbers of one index (see the module).
pub(super) struct Changes {
    words: SharedWords,
}

impl Changes {
    /// Maps (creating if needed, mode 0600, never through a symbolic link, owned by this user) the file at
    /// `path`.
    pub(super) fn open(path: &Path) -> io::Result<Changes> {
        let file = crate::private::open_own_file(path)?;
        let c = Changes { words: SharedWords::map(&file, WORDS)? };
        let _ = c.words.word(0).compare_exchange(0, MAGIC, Ordering::Relaxed, Ordering::Relaxed);
        Ok(c)
    }

    /// The number of the index as it is now, or `None` while a change is under way (or was left
    /// unfinished by a writer that died).
    pub(super) fn now(&self) -> Option<u64> {
        // `done` first: a writer sets `begun` before it changes anything and `done` after, so seeing the
        // same number in `begun` afterwards means no change began in between.
        let done = self.words.word(DONE).load(Ordering::Acquire);
        let begun = self.words.word(BEGUN).load(Ordering::Acquire);
        (done == begun).then_some(done)
    }

    /// Numbers a change about to be made under the index's write lock; [`Changes::end`] it after.
    pub(super) fn begin(&self) -> u64 {
        // The write lock orders writers, so this add is never raced by another; `SeqCst` keeps it ahead of
        // the transaction's own writes for the readers of the map.
        self.words.word(BEGUN).fetch_add(1, Ordering::SeqCst) + 1
    }

    /// Marks change `number` ended: its transaction committed or was abandoned.
    pub(super) fn end(&self, number: u64) {
        self.words.word(DONE).fetch_max(number, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_number_reads_only_between_changes_and_a_dead_writer_holds_it_until_the_next_one_ends() {
        let dir = tempfile::tempdir().unwrap();
        let a = Changes::open(&dir.path().join("changes")).unwrap();
        let b = Changes::open(&dir.path().join("changes")).unwrap();
        assert_eq!(a.now(), Some(0));
        let one = a.begin();
        assert_eq!(b.now(), None, "a change under way");
        a.end(one);
        assert_eq!(b.now(), Some(1));
        let _dead = b.begin(); // never ended
        assert_eq!(a.now(), None);
        let three = a.begin();
        a.end(three);
        assert_eq!(b.now(), Some(3), "the next change that ends makes the number readable again");
        let four = a.begin();
        let five = b.begin();
        b.end(five);
        a.end(four); // a slow writer that ends last never lowers `done`
        assert_eq!(a.now(), Some(5));
    }
}
