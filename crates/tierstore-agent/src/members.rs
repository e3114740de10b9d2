//! Which members of the job are up: the agent pings every peer on a short period, and a peer that misses
//! a deadline is marked down at once (its reads go elsewhere), then up again on its first answer.
//!
//! The list of members is fixed by the launcher (see `tierstore_core::cluster`); this is only their
//! liveness, as this node sees it. Owner hashing (`peers.rs`) consults it through [`Members::is_up`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::net::TcpStream;

use crate::client::Client;
use crate::protocol::Frame;

/// How this node sees one peer.
#[derive(Clone, Debug, Serialize)]
pub struct PeerView {
    /// `host:port` of the peer's agent.
    pub address: String,
    /// Its node name, once it answered.
    pub node: Option<String>,
    /// Whether it answered its last ping within the deadline.
    pub up: bool,
    /// Seconds since its last answer (none yet: never answered).
    pub last_seen_s: Option<f64>,
    /// The round trip of its last answer, in milliseconds.
    pub rtt_ms: Option<f64>,
    /// Times it went from up to down.
    pub downs: u64,
    /// What went wrong last, for a person.
    pub last_error: Option<String>,
}

struct Peer {
    address: String,
    node: Option<String>,
    up: bool,
    last_seen: Option<Instant>,
    rtt: Option<Duration>,
    downs: u64,
    last_error: Option<String>,
}

/// The liveness of the job's other members.
pub struct Members {
    peers: Mutex<Vec<Peer>>,
    /// Pings sent, for the status.
    pings: AtomicU64,
    /// Bumped each time the list changes (a registry's members come and go).
    generation: AtomicU64,
}

fn fresh(address: String) -> Peer {
    Peer { address, node: None, up: false, last_seen: None, rtt: None, downs: 0, last_error: None }
}

impl Members {
    /// The members at `addresses` (this node excluded by the caller), all down until they answer.
    pub fn new(addresses: Vec<String>) -> Arc<Members> {
        let peers = addresses.into_iter().map(fresh).collect();
        Arc::new(Members { peers: Mutex::new(peers), pings: AtomicU64::new(0), generation: AtomicU64::new(0) })
    }

    /// Makes `addresses` the other members (a registry's list): those that stay keep what is known of
    /// them, new ones are down until they answer.
    pub fn replace(&self, mut addresses: Vec<String>) {
        addresses.sort();
        addresses.dedup();
        let mut peers = self.peers.lock().expect("members lock");
        if peers.iter().map(|p| &p.address).eq(addresses.iter()) {
            return;
        }
        let mut old: Vec<Peer> = std::mem::take(&mut *peers);
        for a in addresses {
            match old.iter().position(|p| p.address == a) {
                Some(i) => peers.push(old.swap_remove(i)),
                None => {
                    log::info!("member {a} joined");
                    peers.push(fresh(a));
                }
            }
        }
        for gone in old {
            log::info!("member {} left", gone.address);
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Whether peer `i` is up.
    pub fn is_up(&self, i: usize) -> bool {
        self.peers.lock().expect("members lock").get(i).is_some_and(|p| p.up)
    }

    /// How this node sees each peer.
    pub fn view(&self) -> Vec<PeerView> {
        self.peers
            .lock()
            .expect("members lock")
            .iter()
            .map(|p| PeerView {
                address: p.address.clone(),
                node: p.node.clone(),
                up: p.up,
                last_seen_s: p.last_seen.map(|t| t.elapsed().as_secs_f64()),
                rtt_ms: p.rtt.map(|d| d.as_secs_f64() * 1e3),
                downs: p.downs,
                last_error: p.last_error.clone(),
            })
            .collect()
    }

    fn record(&self, address: &str, outcome: Result<(String, Duration), String>) {
        let mut peers = self.peers.lock().expect("members lock");
        let Some(p) = peers.iter_mut().find(|p| p.address == address) else { return };
        match outcome {
            Ok((node, rtt)) => {
                if !p.up {
                    log::info!("peer {} ({node}) is up", p.address);
                }
                p.up = true;
                p.node = Some(node);
                p.last_seen = Some(Instant::now());
                p.rtt = Some(rtt);
            }
            Err(e) => {
                if p.up {
                    p.downs += 1;
                    log::warn!("peer {} is down: {e}", p.address);
                }
                p.up = false;
                p.last_error = Some(e);
            }
        }
    }

    /// Pings every peer each `period`, each ping under `deadline`, until the task is dropped. A peer's
    /// connection is kept between pings and opened again after a failure.
    pub async fn watch(self: Arc<Self>, me: String, token: Option<Vec<u8>>, period: Duration, deadline: Duration) {
        struct AbortOnDrop(Vec<tokio::task::JoinHandle<()>>);
        impl Drop for AbortOnDrop {
            fn drop(&mut self) {
                self.0.iter().for_each(|t| t.abort());
            }
        }
        loop {
            let generation = self.generation.load(Ordering::Acquire);
            let addresses: Vec<String> =
                self.peers.lock().expect("members lock").iter().map(|p| p.address.clone()).collect();
            let mut tasks = Vec::new();
            for address in addresses {
                let members = self.clone();
                let (me, token) = (me.clone(), token.clone());
                tasks.push(tokio::spawn(async move {
                    let mut conn: Option<Client<TcpStream>> = None;
                    let mut nonce = 0u64;
                    loop {
                        let started = Instant::now();
                        let outcome = ping(&mut conn, &address, &me, token.as_deref(), deadline, nonce).await;
                        members.pings.fetch_add(1, Ordering::Relaxed);
                        if outcome.is_err() {
                            conn = None;
                        }
                        members.record(&address, outcome.map(|node| (node, started.elapsed())));
                        nonce += 1;
                        tokio::time::sleep(period.saturating_sub(started.elapsed())).await;
                    }
                }));
            }
            let _guard = AbortOnDrop(tasks);
            // Until the list changes: then the pingers are started again for the new one.
            while self.generation.load(Ordering::Acquire) == generation {
                tokio::time::sleep(period.min(Duration::from_millis(200))).await;
            }
        }
    }
}

/// One ping of a peer (connecting first if needed); its node name on success.
async fn ping(
    conn: &mut Option<Client<TcpStream>>,
    address: &str,
    me: &str,
    token: Option<&[u8]>,
    deadline: Duration,
    nonce: u64,
) -> Result<String, String> {
    let exchange = async {
        if conn.is_none() {
            *conn = Some(Client::peer(address, me, token, deadline).await.map_err(|e| e.to_string())?);
        }
        let c = conn.as_mut().expect("connected above");
        match c.call(&Frame::Ping { nonce }).await.map_err(|e| e.to_string())? {
            Frame::Pong { nonce: n } if n == nonce => Ok(c.node.clone()),
            other => Err(format!("answered {other:?} to a ping")),
        }
    };
    match tokio::time::timeout(deadline, exchange).await {
        Ok(r) => r,
        Err(_) => Err(format!("no answer within {deadline:?}")),
    }
}
