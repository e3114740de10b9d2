//! What the connections of one door (the TCP port, the node's socket) may hold: those that have not proved
//! the job's token yet, in total and per address, and, counted apart, the sessions of those that have.
//!
//! The agent accepts every connection as soon as it arrives and only then asks the budget, so that the
//! kernel's accept queue never fills and a SYN of a member is never dropped behind a flood. A connection
//! still in its handshake that finds the budget full does not wait: an older unproven connection is closed
//! for it, the oldest of its own address when that address has its share, otherwise the oldest of the
//! address that holds the most (the oldest of all among equals). A member's handshake takes one round
//! trip and is one connection of its address: a flood from a few dozen addresses, each holding many, loses
//! its own connections first, even when a member's process is slow to answer (a loaded node: CI saw a
//! member's handshake closed when the oldest of all went first). The sessions' own budget is a reserve
//! that no number of unproven connections can take.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;

/// The sizes of one door's budget.
#[derive(Clone, Copy, Debug)]
pub(super) struct Limits {
    /// Connections that have not proved the token yet, from all addresses.
    pub unproven: usize,
    /// The same, from one address.
    pub per_address: usize,
    /// Sessions: connections that proved the token (or, on the node's socket, completed the handshake).
    pub sessions: usize,
}

/// One door's budget, shared by its accept loop and its connections.
pub(super) struct Budget<A> {
    limits: Limits,
    state: Mutex<State<A>>,
}

struct State<A> {
    /// The number the next connection admitted gets: a smaller number is an older connection.
    next: u64,
    /// The unproven connections by age, each with its address and the sender whose drop closes it.
    unproven: BTreeMap<u64, (A, oneshot::Sender<()>)>,
    /// The numbers of the unproven connections of each address with any.
    by_address: HashMap<A, BTreeSet<u64>>,
    sessions: usize,
}

impl<A: Copy + Eq + Hash> State<A> {
    /// The unproven connection to close for a newer one: the oldest of the address that holds the most
    /// (of the one whose oldest is oldest, among equals).
    fn eldest_of_the_largest(&self) -> Option<u64> {
        self.by_address
            .values()
            .filter_map(|ids| Some((ids.len(), std::cmp::Reverse(*ids.first()?))))
            .max()
            .map(|(_, std::cmp::Reverse(id))| id)
    }

    /// Forgets unproven connection `id`; its [`Unproven::closed`] resolves (unless the connection itself
    /// asked). False when it was no longer counted.
    fn remove(&mut self, id: u64) -> bool {
        let Some((from, _close)) = self.unproven.remove(&id) else { return false };
        if let Some(ids) = self.by_address.get_mut(&from) {
            ids.remove(&id);
            if ids.is_empty() {
                self.by_address.remove(&from);
            }
        }
        true
    }
}

/// Why an unproven connection gets no session.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum NoSession {
    /// The budget closed it for a newer connection before it proved the token.
    Closed,
    /// Every session is taken.
    Full(usize),
}

impl<A: Copy + Eq + Hash> Budget<A> {
    pub(super) fn new(limits: Limits) -> Arc<Budget<A>> {
        let state = State { next: 0, unproven: BTreeMap::new(), by_address: HashMap::new(), sessions: 0 };
        Arc::new(Budget { limits, state: Mutex::new(state) })
    }

    fn state(&self) -> MutexGuard<'_, State<A>> {
        self.state.lock().expect("budget lock")
    }

    /// Counts a connection from `from` that has just been accepted, closing older unproven connections
    /// where it needs their place: the oldest of `from` when `from` has its share, else, when all are
    /// taken, the oldest of the address holding the most. Returns it, and how many it closed.
    pub(super) fn admit(self: &Arc<Self>, from: A) -> (Unproven<A>, usize) {
        let mut s = self.state();
        let mut closed = 0;
        let theirs = s.by_address.get(&from).map_or(0, BTreeSet::len);
        if theirs >= self.limits.per_address.max(1) {
            let oldest = s.by_address.get(&from).and_then(|ids| ids.first().copied());
            closed += oldest.map_or(0, |id| usize::from(s.remove(id)));
        }
        while s.unproven.len() >= self.limits.unproven.max(1) {
            let Some(victim) = s.eldest_of_the_largest() else { break };
            s.remove(victim);
            closed += 1;
        }
        let id = s.next;
        s.next += 1;
        let (close, closed_rx) = oneshot::channel();
        s.unproven.insert(id, (from, close));
        s.by_address.entry(from).or_default().insert(id);
        (Unproven { budget: self.clone(), id, closed: closed_rx }, closed)
    }

    /// Closes an unproven connection (the oldest of the address holding the most), to give its descriptor
    /// to a new one (when the process has run out of them); false when there is none.
    pub(super) fn close_oldest(&self) -> bool {
        let mut s = self.state();
        let victim = s.eldest_of_the_largest();
        victim.is_some_and(|id| s.remove(id))
    }

    /// Unproven connections now.
    #[cfg(test)]
    pub(super) fn unproven(&self) -> usize {
        self.state().unproven.len()
    }

    /// Sessions now.
    #[cfg(test)]
    pub(super) fn sessions(&self) -> usize {
        self.state().sessions
    }
}

/// A connection that has not proved the token yet, counted until it does, it ends, or the budget closes
/// it for a newer one (then [`Unproven::closed`] resolves and the connection must end).
pub(super) struct Unproven<A: Copy + Eq + Hash> {
    budget: Arc<Budget<A>>,
    id: u64,
    closed: oneshot::Receiver<()>,
}

impl<A: Copy + Eq + Hash> Unproven<A> {
    /// Resolves once the budget has closed this connection for a newer one.
    pub(super) async fn closed(&mut self) {
        let _ = (&mut self.closed).await;
    }

    /// The connection proved the token: it leaves the unproven ones and takes a session, if one is free.
    pub(super) fn prove(self) -> Result<Session<A>, NoSession> {
        let mut s = self.budget.state();
        if !s.remove(self.id) {
            return Err(NoSession::Closed);
        }
        if s.sessions >= self.budget.limits.sessions {
            return Err(NoSession::Full(s.sessions));
        }
        s.sessions += 1;
        drop(s);
        Ok(Session { budget: self.budget.clone() })
    }
}

impl<A: Copy + Eq + Hash> Drop for Unproven<A> {
    fn drop(&mut self) {
        self.budget.state().remove(self.id);
    }
}

/// A session: a connection past its handshake, counted until it ends.
pub(super) struct Session<A: Copy + Eq + Hash> {
    budget: Arc<Budget<A>>,
}

impl<A: Copy + Eq + Hash> Drop for Session<A> {
    fn drop(&mut self) {
        self.budget.state().sessions -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::oneshot::error::TryRecvError;

    fn budget(unproven: usize, per_address: usize, sessions: usize) -> Arc<Budget<u8>> {
        Budget::new(Limits { unproven, per_address, sessions })
    }

    fn is_closed(u: &mut Unproven<u8>) -> bool {
        matches!(u.closed.try_recv(), Err(TryRecvError::Closed))
    }

    #[test]
    fn when_all_are_taken_the_oldest_unproven_connection_is_closed_first() {
        let b = budget(3, 3, 10);
        let mut held: Vec<_> = (0..3).map(|i| b.admit(i).0).collect();
        let (mut newest, closed) = b.admit(9);
        assert_eq!(closed, 1);
        assert!(is_closed(&mut held[0]), "the oldest connection was left open");
        assert!(!is_closed(&mut held[1]) && !is_closed(&mut held[2]) && !is_closed(&mut newest));
        assert_eq!(b.unproven(), 3);
        // The closed one gets no session; a newer one does.
        assert_eq!(held.remove(0).prove().err(), Some(NoSession::Closed));
        let _session = newest.prove().expect("a session");
        assert_eq!((b.unproven(), b.sessions()), (2, 1));
    }

    #[test]
    fn when_all_are_taken_the_address_holding_the_most_loses_its_oldest_not_a_slow_member() {
        let b = budget(6, 6, 10);
        // A member's handshake, slow to complete: the oldest unproven connection of all.
        let (mut member, _) = b.admit(1);
        // A flood from two addresses fills the rest, then keeps coming.
        let mut flood: Vec<_> = (0..5u8).map(|i| b.admit(7 + i % 2).0).collect();
        let newer: Vec<_> = (0..20u8).map(|i| b.admit(7 + i % 2)).collect();
        assert!(newer.iter().all(|(_, closed)| *closed == 1));
        assert!(!is_closed(&mut member), "the member's one connection was closed for the flood");
        assert!(flood.iter_mut().all(is_closed), "the flood's oldest connections are the ones closed");
        assert_eq!(b.unproven(), 6);
        assert!(member.prove().is_ok());
        // Out of descriptors: the flood's oldest goes first too.
        let (mut other, _) = b.admit(2);
        assert!(b.close_oldest() && !is_closed(&mut other));
    }

    #[test]
    fn an_address_with_its_share_loses_its_own_oldest_and_no_other_address_loses_one() {
        let b = budget(10, 2, 10);
        let (mut member, _) = b.admit(1);
        let mut flood: Vec<_> = (0..2).map(|_| b.admit(7).0).collect();
        let (mut third, closed) = b.admit(7);
        assert_eq!(closed, 1);
        assert!(is_closed(&mut flood[0]));
        assert!(!is_closed(&mut flood[1]) && !is_closed(&mut third) && !is_closed(&mut member));
        assert_eq!(b.unproven(), 3);
    }

    #[test]
    fn a_flood_of_unproven_connections_never_takes_the_sessions_reserve() {
        let b = budget(4, 4, 2);
        let first = b.admit(1).0.prove().expect("a session");
        // A flood from many addresses, far more than the budget holds.
        let mut flood: Vec<_> = (0..100u8).map(|i| b.admit(i % 50).0).collect();
        assert_eq!(b.unproven(), 4);
        assert_eq!(flood.iter_mut().map(is_closed).filter(|closed| !closed).count(), 4);
        // A member's handshake arriving now still gets the session left, and its own first.
        let (member, _) = b.admit(200);
        let second = member.prove().expect("the reserve");
        assert_eq!(b.sessions(), 2);
        // Sessions full: the next one that proves the token is told, and counted nowhere.
        let (late, _) = b.admit(201);
        assert_eq!(late.prove().err(), Some(NoSession::Full(2)));
        drop((first, second));
        assert_eq!(b.sessions(), 0);
        assert_eq!(b.admit(202).0.prove().map(|_| ()), Ok(()));
    }

    #[test]
    fn a_connection_that_ends_gives_its_place_back() {
        let b = budget(2, 2, 2);
        let (a, _) = b.admit(1);
        let (_b, _) = b.admit(1);
        drop(a);
        let (_c, closed) = b.admit(1);
        assert_eq!((closed, b.unproven()), (0, 2));
        assert!(b.close_oldest());
        assert!(b.close_oldest());
        assert!(!b.close_oldest());
        assert_eq!(b.unproven(), 0);
    }
}
