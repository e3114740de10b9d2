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
    fn deliver(&self, outcome: Outcome) {
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
    map: Arc<Mutex<HashMap<Key, Arc<Flight>>>>,
}

/// A thread's place in a flight.
pub enum Role {
    /// This thread fetches: the flight lands when its [`Lead`] is dropped.
    Leader(Lead),
    /// Another thread fetches; wait on this flight.
    Follower(Arc<Flight>),
}

/// The lead of one flight. Whoever holds it fetches (a thread, or the background job it hands the copy
/// to); dropping it lands the flight, on every path (an early return, an error, a panic), so that no
/// waiter is left waiting for a leader that has gone. Later misses then look the index up again, and
/// waiters not yet handed an outcome are told to retry.
pub struct Lead {
    map: Arc<Mutex<HashMap<Key, Arc<Flight>>>>,
    key: Key,
    flight: Arc<Flight>,
}

impl Lead {
    /// The key of the file (or directory) the flight fetches.
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// Hands `outcome` to every waiter, present and future, until the flight lands.
    pub fn deliver(&self, outcome: Outcome) {
        self.flight.deliver(outcome);
    }

    /// Lands the flight after its source request failed with `e`: the waiters fail with the same error
    /// rather than each send the store the request again and wait as long.
    pub fn fail(self, e: &std::io::Error) {
        self.deliver(Outcome::failed(e));
    }
}

impl Drop for Lead {
    fn drop(&mut self) {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if map.get(&self.key).is_some_and(|f| Arc::ptr_eq(f, &self.flight)) {
            map.remove(&self.key);
        }
        drop(map);
        let mut g = self.flight.outcome.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            *g = Some(Outcome::Retry);
        }
        self.flight.ready.notify_all();
    }
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
        Role::Leader(Lead { map: self.map.clone(), key: *key, flight: f })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn lead(flights: &Flights, key: &Key) -> Lead {
        match flights.join(key) {
            Role::Leader(lead) => lead,
            Role::Follower(_) => panic!("the first thread to join followed"),
        }
    }

    fn follow(flights: &Flights, key: &Key) -> Arc<Flight> {
        match flights.join(key) {
            Role::Follower(f) => f,
            Role::Leader(_) => panic!("a second thread led a flight already led"),
        }
    }

    #[test]
    fn a_delivered_outcome_reaches_every_waiter_and_the_flight_lands_when_its_lead_is_dropped() {
        let flights = Flights::default();
        let key = [7u8; 16];
        let lead = lead(&flights, &key);
        let waiter = follow(&flights, &key);
        lead.deliver(Outcome::Bytes(Arc::new(b"abc".to_vec())));
        assert!(matches!(waiter.wait(), Outcome::Bytes(b) if b.as_slice() == b"abc"));
        drop(lead);
        // Landed: the next miss leads a flight of its own.
        assert!(matches!(flights.join(&key), Role::Leader(_)));
    }

    #[test]
    fn a_leader_that_panics_leaves_no_waiter_waiting() {
        let flights = Arc::new(Flights::default());
        let key = [9u8; 16];
        let lead = lead(&flights, &key);
        let waiter = follow(&flights, &key);
        let waiting = std::thread::spawn(move || waiter.wait());
        std::thread::sleep(Duration::from_millis(50));
        let leader = std::thread::spawn(move || {
            let _lead = lead;
            panic!("a leader's fetch panicked");
        });
        assert!(leader.join().is_err());
        assert!(matches!(waiting.join().expect("the waiter"), Outcome::Retry));
        assert!(matches!(flights.join(&key), Role::Leader(_)));
    }

    #[test]
    fn a_failed_lead_hands_its_error_to_the_waiters() {
        let flights = Flights::default();
        let key = [3u8; 16];
        let lead = lead(&flights, &key);
        let waiter = follow(&flights, &key);
        lead.fail(&std::io::Error::new(std::io::ErrorKind::TimedOut, "the store did not answer"));
        match waiter.wait() {
            Outcome::Failed(kind, message) => {
                assert_eq!(kind, std::io::ErrorKind::TimedOut);
                assert!(message.contains("did not answer"), "{message}");
            }
            _ => panic!("the waiter was not handed the leader's error"),
        }
    }
}
