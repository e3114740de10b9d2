//! In-process single flight: threads of one process that miss the same file share one fetch.
//!
//! The first thread to miss a key leads its flight; the others wait on it and are handed what the leader
//! got as soon as it has it (the bytes of a small file, or the growing copy of a large one), without
//! waiting for the copy to be published. Across processes, the fetch lock in `lock.rs` plays this role.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use crate::index::{Key, SourceId};
use crate::reader::Growing;

/// What a flight delivers to the threads that wait on it.
#[derive(Clone)]
pub enum Outcome {
    /// The whole file, read from the source, and the version they are of.
    Bytes(Arc<Vec<u8>>, SourceId),
    /// A large file being copied into a tier; readers follow the copy.
    Growing(Arc<Growing>),
    /// Nothing to share: look the file up again (it was published, or must be read from the source).
    Retry,
    /// The source failed the leader's request (the file is missing, the store timed out): the waiters
    /// fail with the same error rather than each send the store the request again and wait as long.
    Failed(std::io::ErrorKind, Arc<str>),
}

impl Outcome {
    /// Whether this outcome's bytes are of another version than `known`, the one the waiter's open
    /// confirmed with the source. A flight outlives its delivery while its copy is published, so a
    /// waiter that joins after the file changed (a `revalidate = "always"` open that saw the new version)
    /// must not be handed the old bytes.
    pub fn of_another_version(&self, known: Option<&SourceId>) -> bool {
        let version = match self {
            Outcome::Bytes(_, v) => v,
            Outcome::Growing(g) => g.version(),
            Outcome::Retry | Outcome::Failed(..) => return false,
        };
        known.is_some_and(|k| k != version)
    }

    /// The outcome of a source request that failed with `e`.
    pub fn failed(e: &std::io::Error) -> Outcome {
        Outcome::Failed(e.kind(), e.to_string().into())
    }
}

/// One fetch in flight.
pub struct Flight {
    outcome: Mutex<Option<Outcome>>,
    ready: Condvar,
    /// When the leader delivered (`clock::now_ns`), 0 before.
    delivered_ns: AtomicU64,
}

impl Flight {
    /// Hands `outcome` to every waiter, present and future, until the flight is removed.
    fn deliver(&self, outcome: Outcome) {
        *self.outcome.lock().expect("flight lock") = Some(outcome);
        self.delivered_ns.store(crate::clock::now_ns(), Ordering::Release);
        self.ready.notify_all();
    }

    /// Whether the leader had delivered before `t_ns`: a waiter whose open began at `t_ns` then joined
    /// a flight that read the source before it was asked, as it would join a published copy.
    pub fn delivered_before(&self, t_ns: u64) -> bool {
        let at = self.delivered_ns.load(Ordering::Acquire);
        at != 0 && at < t_ns
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
        let f = Arc::new(Flight { outcome: Mutex::new(None), ready: Condvar::new(), delivered_ns: AtomicU64::new(0) });
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
        lead.deliver(Outcome::Bytes(Arc::new(b"abc".to_vec()), SourceId::default()));
        assert!(matches!(waiter.wait(), Outcome::Bytes(b, _) if b.as_slice() == b"abc"));
        drop(lead);
        // Landed: the next miss leads a flight of its own.
        assert!(matches!(flights.join(&key), Role::Leader(_)));
    }

    #[test]
    fn a_flight_tells_whether_it_delivered_before_an_open_began() {
        let flights = Flights::default();
        let key = [9u8; 16];
        let lead = lead(&flights, &key);
        let waiter = follow(&flights, &key);
        let before = crate::clock::now_ns();
        assert!(!waiter.delivered_before(before + 1), "nothing delivered yet");
        lead.deliver(Outcome::Bytes(Arc::new(b"v".to_vec()), SourceId::default()));
        let after = crate::clock::now_ns() + 1;
        assert!(!waiter.delivered_before(before), "an open begun before the delivery shares it");
        assert!(waiter.delivered_before(after), "an open begun after it asks the source under \"always\"");
    }

    #[test]
    fn a_waiter_that_confirmed_another_version_is_not_handed_the_flights_bytes() {
        let old = SourceId { size: 3, ..SourceId::default() };
        let new = SourceId { size: 3, mtime_ns: 1, ..SourceId::default() };
        let bytes = Outcome::Bytes(Arc::new(b"old".to_vec()), old);
        assert!(bytes.of_another_version(Some(&new)), "the file changed after the flight's read");
        assert!(!bytes.of_another_version(Some(&old)));
        assert!(!bytes.of_another_version(None), "a waiter that asked the source nothing takes the flight's");
        assert!(!Outcome::Retry.of_another_version(Some(&new)));
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
