//! In-process single flight: threads of one process that miss the same file share one fetch.
//!
//! The first thread to miss a key leads its flight; the others wait on it and are handed what the leader
//! got as soon as it has it (the bytes of a small file, or the growing copy of a large one), without
//! waiting for the copy to be published. Across processes, the fetch lock in `lock.rs` plays this role.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};

use crate::index::Key;
use crate::reader::Growing;

/// What a flight delivers to the threads that wait on it.
#[derive(Clone)]
pub enum Outcome {
    /// The whole file, read from the source.
    Bytes(Arc<Vec<u8>>),
    /// A large file being copied into a tier; readers follow the copy.
    Growing(Arc<Growing>),
    /// Nothing to share: look the file up again (it was published, or must be read from the source).
    Retry,
    /// The source failed the leader's request (the file is missing, the store timed out): the waiters
    /// fail with the same error rather than each send the store the request again and wait as long.
    Failed(std::io::ErrorKind, Arc<str>),
}

impl Outcome {
    /// The outcome of a source request that failed with `e`.
    pub fn failed(e: &std::io::Error) -> Outcome {
        Outcome::Failed(e.kind(), e.to_string().into())
    }
}

/// One fetch in flight.
pub struct Flight {
    outcome: Mutex<Option<Outcome>>,
    ready: Condvar,
}

impl Flight {
    /// Hands `outcome` to every waiter, present and future, until the flight is removed.
    pub fn deliver(&self, outcome: Outcome) {
        *self.outcome.lock().expect("flight lock") = Some(outcome);
        self.ready.notify_all();
    }

    /// Blocks until the leader delivers.
    pub fn wait(&self) -> Outcome {
        let mut g = self.outcome.lock().expect("flight lock");
        loop {
            if let Some(o) = g.as_ref() {
                return o.clone();
            }
            g = self.ready.wait(g).expect("flight lock");
        }
    }
}

/// The flights of one process.
#[derive(Default)]
pub struct Flights {
    map: Mutex<HashMap<Key, Arc<Flight>>>,
}

/// A thread's place in a flight.
pub enum Role {
    /// This thread fetches, and must [`Flights::land`] the flight when the copy is published or abandoned.
    Leader(Arc<Flight>),
    /// Another thread fetches; wait on this flight.
    Follower(Arc<Flight>),
}

impl Flights {
    /// Joins the flight of `key`, leading it if there is none.
    pub fn join(&self, key: &Key) -> Role {
        let mut map = self.map.lock().expect("flights lock");
        if let Some(f) = map.get(key) {
            return Role::Follower(f.clone());
        }
        let f = Arc::new(Flight { outcome: Mutex::new(None), ready: Condvar::new() });
        map.insert(*key, f.clone());
        Role::Leader(f)
    }

    /// Ends the flight of `key`: later misses look the index up again. Waiters that have not been handed
    /// an outcome yet are told to retry.
    pub fn land(&self, key: &Key, flight: &Arc<Flight>) {
        let mut map = self.map.lock().expect("flights lock");
        if map.get(key).is_some_and(|f| Arc::ptr_eq(f, flight)) {
            map.remove(key);
        }
        drop(map);
        let mut g = flight.outcome.lock().expect("flight lock");
        if g.is_none() {
            *g = Some(Outcome::Retry);
        }
        flight.ready.notify_all();
    }
}
