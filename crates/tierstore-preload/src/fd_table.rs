//! A table of this process's descriptors and what the shim keeps for each until the program closes it.
//!
//! One per kind of entry, in a `static`. The table belongs to a process: a forked child (a `DataLoader`
//! worker forked while another thread held the table's lock) never touches its parent's table, which it
//! sees under another pid, and starts one of its own. Tables are leaked, never freed, so a reference to
//! one stays good whatever another thread does.

use std::collections::HashMap;
use std::ptr;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use libc::c_int;

/// Entries of `T` by descriptor (see the module).
pub(crate) struct FdTable<T> {
    current: AtomicPtr<Table<T>>,
}

struct Table<T> {
    pid: u32,
    live: AtomicUsize,
    entries: Mutex<HashMap<c_int, T>>,
}

impl<T> FdTable<T> {
    pub(crate) const fn new() -> FdTable<T> {
        FdTable { current: AtomicPtr::new(ptr::null_mut()) }
    }

    /// This process's table, if it holds any entry: one atomic load, on paths every `read` and `close`
    /// take.
    fn live(&self) -> Option<&Table<T>> {
        // SAFETY: tables are leaked, never freed.
        let t = unsafe { self.current.load(Ordering::Acquire).as_ref()? };
        (t.live.load(Ordering::Relaxed) != 0 && t.pid == tierstore_core::pid()).then_some(t)
    }

    /// This process's table, made on first use (lock-free: a fork may happen at any moment).
    fn for_insert(&self) -> &Table<T> {
        let pid = tierstore_core::pid();
        loop {
            let current = self.current.load(Ordering::Acquire);
            // SAFETY: as above.
            if let Some(t) = unsafe { current.as_ref() } {
                if t.pid == pid {
                    return t;
                }
            }
            // None yet, or the parent's (inherited by fork): replace it, leaking the old one.
            let fresh =
                Box::into_raw(Box::new(Table { pid, live: AtomicUsize::new(0), entries: Mutex::new(HashMap::new()) }));
            match self.current.compare_exchange(current, fresh, Ordering::AcqRel, Ordering::Acquire) {
                // SAFETY: `fresh` was just leaked from a Box.
                Ok(_) => return unsafe { &*fresh },
                Err(_) => drop(unsafe { Box::from_raw(fresh) }),
            }
        }
    }

    /// Keeps `entry` for `fd`; returns the entry it replaces (a descriptor number closed where the shim
    /// could not see it, and used again).
    pub(crate) fn insert(&self, fd: c_int, entry: T) -> Option<T> {
        let t = self.for_insert();
        let replaced = lock(&t.entries).insert(fd, entry);
        if replaced.is_none() {
            t.live.fetch_add(1, Ordering::Relaxed);
        }
        replaced
    }

    /// Takes the entry of `fd` out, if it has one.
    pub(crate) fn remove(&self, fd: c_int) -> Option<T> {
        let t = self.live()?;
        let removed = lock(&t.entries).remove(&fd);
        if removed.is_some() {
            t.live.fetch_sub(1, Ordering::Relaxed);
        }
        removed
    }

    /// Takes out the entries of the descriptors from `first` to `last` (both included).
    pub(crate) fn remove_within(&self, first: c_int, last: c_int) -> Vec<T> {
        let Some(t) = self.live() else { return Vec::new() };
        let mut entries = lock(&t.entries);
        let fds: Vec<c_int> = entries.keys().copied().filter(|fd| (first..=last).contains(fd)).collect();
        let removed: Vec<T> = fds.iter().filter_map(|fd| entries.remove(fd)).collect();
        t.live.fetch_sub(removed.len(), Ordering::Relaxed);
        removed
    }

    /// Whether this process's table holds any entry.
    pub(crate) fn holds_any(&self) -> bool {
        self.live().is_some()
    }

    /// What `read` makes of the entry of `fd`, if it has one.
    pub(crate) fn get<R>(&self, fd: c_int, read: impl FnOnce(&T) -> R) -> Option<R> {
        let t = self.live()?;
        lock(&t.entries).get(&fd).map(read)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
