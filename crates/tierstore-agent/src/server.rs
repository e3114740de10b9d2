//! The agent's server: a Unix socket for the processes of its node, TCP for its peers, one task per
//! connection, every read under a deadline, and a graceful stop (a local `Stop`, SIGTERM, or idleness).
//!
//! Shape after mini-redis's server: `run(options, shutdown)` binds, accepts with back-off on accept
//! errors, and a watch channel tells every connection to finish its request and close. Every connection
//! is accepted at once and then counted against its door's [`budget`]: a bounded number may still be in
//! their handshake (the oldest closed first when a new one needs the place), and those that completed it
//! have a reserve of their own.

use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpSocket, UnixListener};
use tokio::sync::watch;

use crate::members::Members;
use tierstore_core::cluster::dial::dial_local;
use tierstore_core::cluster::session;

use crate::protocol::{self, Conn, ErrorCode, Frame, MAX_HELLO, VERSION};

mod budget;

use budget::{Budget, Limits, NoSession, Session, Unproven};

pub use crate::options::Options;
pub use crate::status::{CacheView, Status};

/// How a connection may act: processes of this node may stop the agent; peers may not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Local,
    Peer,
}

/// Why the agent could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// Listening without a token would let any host, and on loopback any user of this machine, read the
    /// cache and the staged files.
    #[error(
        "refusing to listen on {0} without a token: peers must prove the job's token (on 127.0.0.1 too, which \
         every user of this machine reaches); give every agent of the job the same --token-file, or set \
         [cluster] sharing, which makes ~/.tierstore/token when none is configured"
    )]
    NoToken(SocketAddr),
    /// Pinging peers needs the token they will ask for.
    #[error("--peers needs the job's token to prove to them: give every agent of the job the same --token-file")]
    NoTokenForPeers,
    /// Another agent answers on the socket.
    #[error("an agent already runs on {0}; stop it with `tierstore agent stop`, or give another --socket")]
    AlreadyRunning(PathBuf),
    /// A socket or listener could not be set up.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// Where.
        path: String,
        /// The error.
        source: io::Error,
    },
    /// The model streams' directory could not be set up.
    #[error(transparent)]
    Stream(#[from] crate::stream::StreamError),
}

struct Shared {
    options: Options,
    members: Arc<Members>,
    listen: Option<SocketAddr>,
    started: Instant,
    open: AtomicU64,
    total: AtomicU64,
    refused: AtomicU64,
    timeouts: AtomicU64,
    /// The addresses peers may dial this agent at, which their proofs must name (see
    /// `tierstore_core::cluster::session`): as the members name it, as it listens, as its host and node.
    names: Vec<String>,
    /// When a refused handshake was last logged at `warn` (see [`Shared::refusal`]).
    refusal_logged: Mutex<Option<Instant>>,
    last_activity: Mutex<Instant>,
    stop: watch::Sender<bool>,
    /// The job's members, this node included (the registry's list when there is one).
    job_members: Mutex<Vec<String>>,
    /// Registry calls that failed.
    registry_errors: AtomicU64,
    /// The node's model streams.
    streams: Arc<crate::stream::Streams>,
}

impl Shared {
    fn status(&self) -> Status {
        Status {
            node: self.options.node.clone(),
            pid: std::process::id(),
            protocol: VERSION,
            uptime_s: self.started.elapsed().as_secs_f64(),
            socket: self.options.socket.display().to_string(),
            listen: self.listen.map(|a| a.to_string()),
            connections: self.open.load(Ordering::Relaxed),
            connections_total: self.total.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            timeouts: self.timeouts.load(Ordering::Relaxed),
            idle_exit_s: self.options.idle_exit.map(|d| d.as_secs_f64()),
            members: self.members.view(),
            cache: self.options.cache.as_deref().map(CacheView::of),
            registry_job: self.options.registry.as_ref().map(|_| self.options.job.clone()),
            // Failed calls, and the entries the registry held that were refused (issue #49).
            registry_errors: self.registry_errors.load(Ordering::Relaxed)
                + self.options.registry.as_ref().map_or(0, |r| r.refused()),
            // Where the versions are: a fresh directory when another user made the default first.
            stream_dir: self.streams.dir().display().to_string(),
            stream_keep: self.options.stream.keep,
            stream_redis: self.options.stream.redis.clone(),
            writeback: self.options.writeback.as_deref().map(crate::status::WritebackView::of),
        }
    }

    fn touch(&self) {
        *self.last_activity.lock().expect("activity lock") = Instant::now();
    }

    /// Counts a refused handshake and logs why: at `warn` once a second at most, the others at `debug`,
    /// so that a stranger sending hellos in a loop (or a job past its sessions) does not fill the log.
    fn refusal(&self, why: std::fmt::Arguments<'_>) {
        self.refused.fetch_add(1, Ordering::Relaxed);
        let mut last = self.refusal_logged.lock().expect("refusal log lock");
        let now = Instant::now();
        let due = match *last {
            Some(t) => now.duration_since(t) >= Duration::from_secs(1),
            None => true,
        };
        if due {
            *last = Some(now);
            drop(last);
            log::warn!("{why} (further refusals within a second are logged at debug)");
        } else {
            drop(last);
            log::debug!("{why}");
        }
    }
}

/// A started agent: its listeners are bound (clients can connect) and [`Agent::serve`] runs it.
pub struct Agent {
    shared: Arc<Shared>,
    unix: UnixListener,
    tcp: Option<TcpListener>,
    metrics: Option<TcpListener>,
}

fn io_err(what: &'static str, path: impl std::fmt::Display) -> impl FnOnce(io::Error) -> AgentError {
    let path = path.to_string();
    move |source| AgentError::Io { what, path, source }
}

impl Agent {
    /// Checks the options and binds the listeners.
    pub async fn bind(options: Options) -> Result<Agent, AgentError> {
        if let (Some(addr), None) = (options.listen, &options.token) {
            return Err(AgentError::NoToken(addr));
        }
        if !options.peers.is_empty() && options.token.is_none() {
            return Err(AgentError::NoTokenForPeers);
        }
        let unix = bind_unix(&options.socket).await?;
        let streams = crate::stream::Streams::open(&options.stream, &options.socket)?;
        let tcp = match options.listen {
            Some(addr) => Some(listen_tcp(addr).map_err(io_err("cannot listen on", addr))?),
            None => None,
        };
        let metrics = match options.metrics {
            Some(addr) => Some(TcpListener::bind(addr).await.map_err(io_err("cannot serve metrics on", addr))?),
            None => None,
        };
        let listen = match &tcp {
            Some(l) => Some(l.local_addr().map_err(io_err("cannot read the address of", "the listener"))?),
            None => None,
        };
        streams.join_nodes(&options, listen);
        let (stop, _) = watch::channel(false);
        let members = Members::new(options.peers.clone());
        let options_members = options.job_members.clone();
        let names = dialed_names(&options, listen);
        let shared = Arc::new(Shared {
            members,
            options,
            listen,
            started: Instant::now(),
            open: AtomicU64::new(0),
            total: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            timeouts: AtomicU64::new(0),
            names,
            refusal_logged: Mutex::new(None),
            last_activity: Mutex::new(Instant::now()),
            stop,
            job_members: Mutex::new(options_members),
            registry_errors: AtomicU64::new(0),
            streams: Arc::new(streams),
        });
        Ok(Agent { shared, unix, tcp, metrics })
    }

    /// The address metrics are served on (the port is known once bound, also for port 0).
    pub fn metrics_address(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// The other members as this agent sees them.
    pub fn members(&self) -> Arc<Members> {
        self.shared.members.clone()
    }

    /// The address peers reach this agent on (the port is known once bound, also for port 0).
    pub fn peer_address(&self) -> Option<SocketAddr> {
        self.shared.listen
    }

    /// Serves until `shutdown` completes, a local client sends `Stop`, or the agent was idle for
    /// `idle_exit`. Open connections finish their current request; the socket file is removed.
    pub async fn serve(self, shutdown: impl Future<Output = ()>) {
        let Agent { shared, unix, tcp, metrics } = self;
        // One budget for each door, so that a flood of connections on the TCP port never keeps the node's
        // own processes out (and the other way round).
        let sessions = shared.options.max_connections;
        let local_budget = Budget::new(Limits { unproven: UNPROVEN_LOCAL, per_address: UNPROVEN_LOCAL, sessions });
        let peer_budget = Budget::new(Limits { unproven: UNPROVEN_PEERS, per_address: UNPROVEN_PER_ADDRESS, sessions });
        let mut stopped = shared.stop.subscribe();
        let unix_loop = accept_unix(unix, shared.clone(), local_budget);
        let tcp_loop = async {
            match tcp {
                Some(l) => accept_tcp(l, shared.clone(), peer_budget).await,
                None => std::future::pending().await,
            }
        };
        let metrics_loop = async {
            match metrics {
                Some(l) => serve_metrics(l, shared.clone()).await,
                None => std::future::pending().await,
            }
        };
        let registration = register(shared.clone());
        let idle = watch_idleness(shared.clone());
        let o = &shared.options;
        let heartbeats = shared.members.clone().watch(o.node.clone(), o.token.clone(), o.heartbeat, o.deadline);
        tokio::select! {
            _ = heartbeats => {}
            _ = unix_loop => {}
            _ = tcp_loop => {}
            _ = metrics_loop => {}
            _ = registration => {}
            _ = idle => log::info!(
                "idle for {} s with nothing pending: exiting",
                shared.options.idle_exit.map_or(0.0, |d| d.as_secs_f64())
            ),
            _ = shutdown => log::info!("asked to stop"),
            _ = stopping(&mut stopped) => log::info!("stopped by a local client"),
        }
        let _ = shared.stop.send(true);
        if let Some(r) = shared.options.registry.clone() {
            let me = shared.options.me.clone();
            match tokio::task::spawn_blocking(move || r.leave(&me)).await {
                Ok(Ok(())) => log::info!("left the registry"),
                Ok(Err(e)) => log::warn!("could not leave the registry ({e}); the registration expires on its own"),
                Err(_) => {}
            }
        }
        // Wait (bounded) for the connections to finish the request they are serving.
        let deadline = Instant::now() + shared.options.deadline;
        while shared.open.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let _ = std::fs::remove_file(&shared.options.socket);
        shared.streams.remove();
    }
}

/// The addresses a peer may dial this agent at: as the members name it (`me`), as it listens, and as
/// `host:port` and `node:port` for its port (a node named by its address, port included, as it is), each
/// once.
fn dialed_names(options: &Options, listen: Option<SocketAddr>) -> Vec<String> {
    let mut names = Vec::new();
    if !options.me.is_empty() {
        names.push(options.me.clone());
    }
    if let Some(l) = listen {
        names.push(l.to_string());
        names.push(at_port(&tierstore_core::cluster::hostname(), l.port()));
        names.push(at_port(&options.node, l.port()));
        if l.ip().is_loopback() || l.ip().is_unspecified() {
            names.push(format!("localhost:{}", l.port()));
            names.push(format!("127.0.0.1:{}", l.port()));
        }
    }
    let mut seen = std::collections::HashSet::new();
    names.retain(|n| seen.insert(n.clone()));
    names
}

/// `host` as dialed at `port`: `host:port`, `[v6]:port`, or `host` itself when it already names a port
/// (`127.0.0.1:7078`, `[::1]:7078`, `node:7078`).
fn at_port(host: &str, port: u16) -> String {
    if host.parse::<SocketAddr>().is_ok() {
        return host.to_string();
    }
    if let Ok(IpAddr::V6(v6)) = host.parse::<IpAddr>() {
        return SocketAddr::from((v6, port)).to_string();
    }
    match host.rsplit_once(':') {
        Some((name, p)) if !name.contains(':') && p.parse::<u16>().is_ok() => host.to_string(),
        _ => format!("{host}:{port}"),
    }
}

/// Binds the Unix socket in a directory of this user's own (made 0700, or checked: see
/// `tierstore_core::private`; never one another user made first), replacing a stale socket file (one
/// nobody listens on) and refusing to start beside a live agent: one that takes the connection, or whose
/// queue stays full for a second (a busy agent, not a dead one: a non-blocking connect fails at once with
/// `EAGAIN` there, and an agent that took that for a dead one would take the busy one's socket).
async fn bind_unix(path: &Path) -> Result<UnixListener, AgentError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        tierstore_core::private::ensure_dir(dir).map_err(io_err("cannot use the socket directory", dir.display()))?;
    }
    if std::fs::symlink_metadata(path).is_ok() {
        let probe = path.to_path_buf();
        let live = tokio::task::spawn_blocking(move || dial_local(&probe, Duration::from_secs(1))).await;
        if matches!(live, Ok(Ok(_))) || matches!(&live, Ok(Err(e)) if e.kind() == io::ErrorKind::TimedOut) {
            return Err(AgentError::AlreadyRunning(path.to_path_buf()));
        }
        std::fs::remove_file(path).map_err(io_err("cannot remove the stale socket", path.display()))?;
    }
    let l = UnixListener::bind(path).map_err(io_err("cannot bind the socket", path.display()))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(io_err("cannot restrict the socket", path.display()))?;
    Ok(l)
}

/// Listens for peers on `addr` with an accept queue of [`PEER_BACKLOG`] connections. tokio's `bind` asks
/// for 128, as Rust's standard library does: a flood of connections that never prove the token refills
/// that between two turns of the accept loop on a busy node (the flood test saw 3,000 overflows a run),
/// and the kernel then drops the next SYN, a member's too, which TCP sends again only a second later.
fn listen_tcp(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(PEER_BACKLOG)
}

async fn accept_unix(l: UnixListener, shared: Arc<Shared>, budget: Arc<Budget<()>>) {
    let mut backoff = Duration::from_millis(1);
    loop {
        match l.accept().await {
            Ok((stream, _)) => {
                backoff = Duration::from_millis(1);
                // The socket's directory is private, but a process of another user that holds a
                // descriptor of it (or root's choice of directory) must still not be served.
                if let Err(e) = tierstore_core::private::check_peer(&stream, &shared.options.socket) {
                    shared.refused.fetch_add(1, Ordering::Relaxed);
                    log::warn!("refused a local connection: {e}");
                    continue;
                }
                let (unproven, closed) = budget.admit(());
                shared.refused.fetch_add(closed as u64, Ordering::Relaxed);
                let shared = shared.clone();
                tokio::spawn(serve_connection(stream, Side::Local, "the node's socket".into(), shared, unproven));
            }
            Err(e) => backoff = accept_failed(e, backoff, "on the socket", &budget).await,
        }
    }
}

/// Accepts every connection of a peer as it arrives (never waiting on a budget, so that the kernel's
/// accept queue never fills and a member's connection is never dropped behind a flood) and counts it
/// against `budget`, which closes the oldest unproven connections when the new one needs their place.
async fn accept_tcp(l: TcpListener, shared: Arc<Shared>, budget: Arc<Budget<IpAddr>>) {
    let mut backoff = Duration::from_millis(1);
    loop {
        match l.accept().await {
            Ok((stream, from)) => {
                backoff = Duration::from_millis(1);
                let (unproven, closed) = budget.admit(from.ip());
                shared.refused.fetch_add(closed as u64, Ordering::Relaxed);
                let _ = stream.set_nodelay(true);
                let shared = shared.clone();
                tokio::spawn(serve_connection(stream, Side::Peer, from.to_string(), shared, unproven));
            }
            Err(e) => backoff = accept_failed(e, backoff, "of a peer", &budget).await,
        }
    }
}

/// After a failed accept: when the process is out of descriptors, closes the oldest unproven connection
/// to free one; waits `backoff` (doubled for the next failure, up to a second) and returns the next.
async fn accept_failed<A: Copy + Eq + std::hash::Hash>(
    e: io::Error,
    backoff: Duration,
    what: &str,
    budget: &Budget<A>,
) -> Duration {
    let out_of_descriptors = matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
    if out_of_descriptors && budget.close_oldest() {
        log::debug!("accept {what} failed ({e}): closed the oldest connection not past its handshake");
    } else {
        log::warn!("accept {what} failed ({e}); retrying in {backoff:?}");
    }
    tokio::time::sleep(backoff).await;
    (backoff * 2).min(Duration::from_secs(1))
}

/// Answers every HTTP request on `l` with the metrics (scrapes are not activity: they do not keep an
/// agent started on demand alive).
async fn serve_metrics(l: TcpListener, shared: Arc<Shared>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    loop {
        let Ok((mut stream, _)) = l.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let deadline = shared.options.deadline;
            let mut request = Vec::new();
            let mut buf = [0u8; 1024];
            let read = tokio::time::timeout(deadline, async {
                while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < 8192 {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return false,
                        Ok(n) => request.extend_from_slice(&buf[..n]),
                    }
                }
                true
            })
            .await;
            if !matches!(read, Ok(true)) {
                return;
            }
            let line = String::from_utf8_lossy(&request);
            let path = line.split_whitespace().nth(1).unwrap_or("/");
            let (code, body) = if path == "/metrics" || path == "/" {
                let status = tokio::task::spawn_blocking({
                    let shared = shared.clone();
                    move || shared.status()
                })
                .await;
                match status {
                    Ok(s) => ("200 OK", crate::metrics::render(&s)),
                    Err(e) => ("500 Internal Server Error", format!("{e}\n")),
                }
            } else {
                ("404 Not Found", "metrics are at /metrics\n".to_string())
            };
            let head = format!(
                "HTTP/1.1 {code}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = tokio::time::timeout(deadline, async {
                stream.write_all(head.as_bytes()).await?;
                stream.write_all(body.as_bytes()).await
            })
            .await;
        });
    }
}

/// How long a registration lasts without a heartbeat.
pub const REGISTRATION_TTL: Duration = Duration::from_secs(10);

/// Registers this agent and renews it every heartbeat, taking the registered members as the job's; a
/// registry that fails leaves the last list in place (counted and logged once per failure streak).
/// Never resolves; without a registry, does nothing.
async fn register(shared: Arc<Shared>) {
    let Some(registry) = shared.options.registry.clone() else { return std::future::pending().await };
    let me = shared.options.me.clone();
    let mut failing = false;
    loop {
        let (r, m) = (registry.clone(), me.clone());
        let round = tokio::task::spawn_blocking(move || {
            r.join(&m, REGISTRATION_TTL)?;
            r.members()
        })
        .await;
        match round {
            Ok(Ok(members)) => {
                if failing {
                    log::info!("the registry answers again");
                    failing = false;
                }
                shared.members.replace(members.iter().filter(|a| **a != me).cloned().collect());
                *shared.job_members.lock().expect("members lock") = members;
            }
            Ok(Err(e)) => {
                shared.registry_errors.fetch_add(1, Ordering::Relaxed);
                if !failing {
                    log::warn!("{e}; keeping the members known last");
                    failing = true;
                }
            }
            Err(_) => {}
        }
        tokio::time::sleep(shared.options.heartbeat).await;
    }
}

/// Resolves once the agent has had no connection for `idle_exit` (never, without it).
async fn watch_idleness(shared: Arc<Shared>) {
    let Some(idle) = shared.options.idle_exit else { return std::future::pending().await };
    loop {
        tokio::time::sleep(Duration::from_millis(100).min(idle)).await;
        let quiet = shared.last_activity.lock().expect("activity lock").elapsed();
        let busy = shared.options.busy.as_ref().is_some_and(|b| b());
        if shared.open.load(Ordering::Acquire) == 0 && quiet >= idle && !busy {
            return;
        }
    }
}

/// Resolves once the agent is stopping (the watch's guard is not held across an await).
async fn stopping(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await.map(|_| ());
}

/// Counts a connection open for as long as it lives.
struct Open(Arc<Shared>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
        self.0.touch();
    }
}

/// Connections on the TCP port that have not proved the token yet, at most; past it the oldest is closed
/// for the newest. A member's handshake takes one round trip, so it completes long before this many newer
/// connections arrive; the descriptors (with the sessions') stay well below the open-file limit the agent
/// raises at start (see `main.rs`).
const UNPROVEN_PEERS: usize = 512;

/// The same from one address: one host cannot take all of them; past it, that address's oldest goes. A
/// node whose processes all connect at once (a DataLoader's workers) stays well below it.
const UNPROVEN_PER_ADDRESS: usize = 64;

/// The accept queue asked of the kernel for the TCP port (it caps it at `net.core.somaxconn`, 4096 by
/// default since Linux 5.4; the node's socket already gets that much from tokio): room for the SYNs a
/// flood sends while the accept loop waits for a core, so that a member's finds a place (a flood larger
/// still meets the reader's own redial: `tierstore_core::cluster::dial`).
const PEER_BACKLOG: u32 = 4096;

/// Connections on the node's socket that have not completed their handshake yet, at most (they are the
/// user's own processes, which answer the challenge at once).
const UNPROVEN_LOCAL: usize = 128;

/// The longest a connection may take to answer the challenge with its hello: a stranger holds its place
/// no longer than this (a member answers within a round trip).
const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(1);

/// Serves one connection: the handshake (see `tierstore_core::cluster::session`; before it, at most a
/// hello's bytes are read and for at most [`HANDSHAKE_DEADLINE`], and the connection is closed as soon as
/// its door's budget needs its place), then, as a session of that budget, its requests.
async fn serve_connection<S, A>(stream: S, side: Side, from: String, shared: Arc<Shared>, unproven: Unproven<A>)
where
    S: AsyncRead + AsyncWrite + Unpin + crate::sendfile::Socket,
    A: Copy + Eq + std::hash::Hash,
{
    shared.open.fetch_add(1, Ordering::AcqRel);
    shared.total.fetch_add(1, Ordering::Relaxed);
    shared.touch();
    let _open = Open(shared.clone());
    let mut stop = shared.stop.subscribe();
    let Some((mut stream, _session)) = handshake(stream, side, &from, &shared, unproven).await else { return };
    loop {
        let Some(frame) = next_request(&mut stream, &shared, &mut stop).await else { return };
        shared.touch();
        if side == Side::Peer && !stream.seals.encrypted() {
            match frame {
                Frame::KeyShare { .. } => {
                    if let Err(e) = answer_key_share(&mut stream, frame, shared.options.deadline).await {
                        log::warn!("a peer's key exchange failed: {e}");
                        return;
                    }
                    continue;
                }
                _ if shared.options.encrypt => {
                    shared.refused.fetch_add(1, Ordering::Relaxed);
                    let message = "this agent encrypts every connection ([cluster] encrypt = true): a peer sends its \
                                   key share first; run the same tierstore on every node"
                        .to_string();
                    let _ = stream.write_frame(&Frame::Error { code: ErrorCode::Unauthorized, message }).await;
                    return;
                }
                _ => {}
            }
        }
        if !serve_request(&mut stream, frame, side, &shared, &stop).await {
            return;
        }
    }
}

/// The handshake: a challenge, the client's hello within the deadline (unless the budget closes the
/// connection first), and this agent's welcome with a session of the budget (or its refusal, counted).
/// `None` when the connection ends there. A refused client is told only what it needs; why, with the
/// names this agent goes by, stays in the agent's log.
// Long on purpose: its four steps (challenge, hello, welcome or refusal, a session of the budget) in the
// order they happen on the wire, each one's way out beside it.
async fn handshake<S, A>(
    mut stream: S,
    side: Side,
    from: &str,
    shared: &Shared,
    mut unproven: Unproven<A>,
) -> Option<(Conn<S>, Session<A>)>
where
    S: AsyncRead + AsyncWrite + Unpin,
    A: Copy + Eq + std::hash::Hash,
{
    let n = session::nonce();
    let within = shared.options.deadline.min(HANDSHAKE_DEADLINE);
    let challenged = async {
        protocol::write_frame(&mut stream, &Frame::Challenge { version: VERSION, nonce: n }).await?;
        protocol::read_frame_within(&mut stream, MAX_HELLO).await
    };
    let hello = tokio::select! {
        read = tokio::time::timeout(within, challenged) => match read {
            Ok(Ok(Some(f))) => f,
            Ok(_) => return None,
            Err(_) => {
                shared.timeouts.fetch_add(1, Ordering::Relaxed);
                return None;
            }
        },
        _ = unproven.closed() => return None,
    };
    let token = match side {
        Side::Peer => shared.options.token.as_deref(),
        Side::Local => None,
    };
    let agent = session::AgentSide {
        token,
        names: &shared.names,
        me: &shared.options.node,
        encrypt: shared.options.encrypt && side == Side::Peer,
    };
    let (welcome, seals) = match session::welcome(&hello, &n, &agent) {
        Ok(w) => w,
        Err((code, message)) => {
            let names = match code {
                ErrorCode::Unauthorized => format!("; this agent goes by {}", shared.names.join(", ")),
                _ => String::new(),
            };
            shared.refusal(format_args!("refused a {side:?} connection from {from}: {message}{names}"));
            let _ = protocol::write_frame(&mut stream, &Frame::Error { code, message }).await;
            return None;
        }
    };
    let session = match unproven.prove() {
        Ok(s) => s,
        Err(NoSession::Closed) => return None,
        Err(NoSession::Full(n)) => {
            shared
                .refusal(format_args!("refused a {side:?} connection from {from}: {n} connections are served already"));
            let message = format!("this agent serves {n} connections already: read from the store, try it later");
            let _ = protocol::write_frame(&mut stream, &Frame::Error { code: ErrorCode::Failed, message }).await;
            return None;
        }
    };
    protocol::write_frame(&mut stream, &welcome).await.ok()?;
    Some((Conn { stream, seals }, session))
}

/// The connection's next request, read within the idle limit. `None` when the connection ends: closed,
/// idle too long (counted), a frame that does not parse (answered), or the agent stopping (said).
async fn next_request<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut Conn<S>,
    shared: &Shared,
    stop: &mut watch::Receiver<bool>,
) -> Option<Frame> {
    let request = tokio::select! {
        r = tokio::time::timeout(shared.options.idle_connection, stream.read_frame()) => r,
        _ = stopping(stop) => {
            let _ = stream.write_frame(&Frame::Error {
                code: ErrorCode::ShuttingDown,
                message: "the agent is shutting down".into(),
            }).await;
            return None;
        }
    };
    match request {
        Ok(Ok(Some(f))) => Some(f),
        Ok(Ok(None)) => None,
        Ok(Err(e)) => {
            let _ = stream.write_frame(&Frame::Error { code: ErrorCode::BadRequest, message: e.to_string() }).await;
            None
        }
        Err(_) => {
            shared.timeouts.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

/// Serves one request of a connection past its handshake (and its key exchange, where one is due);
/// false when the connection ends with it.
// Long on purpose: one arm per request a connection may send, each a line or a call to the module that
// serves it, so that what an agent answers (and to which side) reads in one place.
async fn serve_request<S: AsyncRead + AsyncWrite + Unpin + crate::sendfile::Socket>(
    stream: &mut Conn<S>,
    frame: Frame,
    side: Side,
    shared: &Arc<Shared>,
    stop: &watch::Receiver<bool>,
) -> bool {
    let deadline = shared.options.deadline;
    let (answer, then_stop) = match frame {
        Frame::Ping { nonce } => (Frame::Pong { nonce }, false),
        Frame::Status => {
            let json = serde_json::to_string(&shared.status()).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"));
            (Frame::StatusReport { json }, false)
        }
        Frame::Fetch { id, source, rel, credit } => {
            let cache = shared.options.cache.clone();
            let asked = crate::transfer::Whole { source: &source, rel: &rel, credit };
            let sent = crate::transfer::serve_fetch(stream, cache, deadline, id, asked).await;
            return sent.map_err(|e| log::warn!("sending {rel} to a {side:?} client failed: {e}")).is_ok();
        }
        Frame::FetchRanges { id, source, rel, ranges, credit, unhashed } => {
            let cache = shared.options.cache.clone();
            let asked = crate::transfer::Parts { source: &source, rel: &rel, ranges: &ranges, credit, unhashed };
            let sent = crate::transfer::serve_ranges(stream, cache, deadline, id, asked).await;
            return sent.map_err(|e| log::warn!("sending parts of {rel} to a {side:?} client failed: {e}")).is_ok();
        }
        Frame::Damaged { id, source, rel } => {
            let cache = shared.options.cache.clone();
            return crate::transfer::serve_damaged(stream, cache, deadline, id, &source, &rel).await.is_ok();
        }
        Frame::StagedFetch { id, path, credit } => {
            let wb = shared.options.writeback.clone();
            let sent = crate::transfer::serve_staged(stream, wb, deadline, id, &path, credit).await;
            return sent.map_err(|e| log::warn!("sending the staged {path} to a {side:?} client failed: {e}")).is_ok();
        }
        // Credit a finished transfer did not need.
        Frame::Credit { .. } => return true,
        Frame::Members => {
            (Frame::MemberList { members: shared.job_members.lock().expect("members lock").clone() }, false)
        }
        Frame::StreamRequest { json } if side == Side::Local => {
            // The node's socket: its frames are plain, so the stream loop reads and writes them itself.
            debug_assert!(!stream.seals.send.is_keyed());
            let local = &mut stream.stream;
            crate::stream::serve(local, json, shared.streams.clone(), stop.clone(), deadline).await;
            return false;
        }
        // Another node's agent pulling a version's tensors.
        Frame::StreamRequest { json } => {
            if let Err(e) = crate::stream::serve_peer(stream, json, shared.streams.clone(), deadline).await {
                log::warn!("sending stream tensors to a peer failed: {e}");
            }
            return false;
        }
        Frame::Stop if side == Side::Local => (Frame::Stopping, true),
        Frame::Stop => (
            Frame::Error {
                code: ErrorCode::BadRequest,
                message: "only processes of the agent's node may stop it".into(),
            },
            false,
        ),
        other => (Frame::Error { code: ErrorCode::BadRequest, message: format!("not a request: {other:?}") }, false),
    };
    let sent = tokio::time::timeout(deadline, stream.write_frame(&answer)).await;
    if then_stop {
        let _ = shared.stop.send(true);
    }
    matches!(sent, Ok(Ok(())))
}

/// Answers a peer's key share with this agent's own, and switches the connection to encrypted frames
/// (see `tierstore_core::cluster::session::KeyShare`).
async fn answer_key_share<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut Conn<S>,
    theirs: Frame,
    deadline: Duration,
) -> io::Result<()> {
    let (share, ours) = session::KeyShare::new();
    tokio::time::timeout(deadline, stream.write_frame(&ours))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "the peer took nothing in time"))??;
    share.finish(theirs, &mut stream.seals).map_err(io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agent_named_by_its_address_goes_by_each_name_once_and_each_well_formed() {
        let mut o = Options::new("127.0.0.1:7078", "/nonexistent/agent.sock");
        o.me = "127.0.0.1:7078".into();
        let names = dialed_names(&o, Some("127.0.0.1:7078".parse().unwrap()));
        let mut once = names.clone();
        once.sort();
        once.dedup();
        assert_eq!(once.len(), names.len(), "a name twice: {names:?}");
        assert!(names.iter().all(|n| n.matches(':').count() == 1), "a malformed name: {names:?}");
        assert!(names.contains(&"localhost:7078".to_string()), "{names:?}");
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
    }

    #[test]
    fn an_agent_whose_queue_is_full_is_running_and_keeps_its_socket() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let live = socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::STREAM, None).unwrap();
        live.bind(&socket2::SockAddr::unix(&path).unwrap()).unwrap();
        live.listen(0).unwrap();
        let _waiting = std::os::unix::net::UnixStream::connect(&path).unwrap();
        let inode = std::fs::metadata(&path).unwrap().ino();
        let e = runtime().block_on(bind_unix(&path)).unwrap_err();
        assert!(matches!(e, AgentError::AlreadyRunning(_)), "{e}");
        assert_eq!(std::fs::metadata(&path).unwrap().ino(), inode, "the live agent's socket was replaced");
        // A socket file nobody listens on is stale, and is replaced.
        drop(live);
        let rt = runtime();
        let _mine = rt.block_on(bind_unix(&path)).expect("a stale socket file replaced");
        dial_local(&path, Duration::from_secs(1)).expect("the new listener takes connections");
    }

    #[test]
    fn a_host_is_dialed_at_the_port_unless_it_names_one() {
        assert_eq!(at_port("node-a", 7078), "node-a:7078");
        assert_eq!(at_port("10.0.0.2", 7078), "10.0.0.2:7078");
        assert_eq!(at_port("::1", 7078), "[::1]:7078");
        assert_eq!(at_port("node-a:7079", 7078), "node-a:7079");
        assert_eq!(at_port("10.0.0.2:7079", 7078), "10.0.0.2:7079");
        assert_eq!(at_port("[::1]:7079", 7078), "[::1]:7079");
    }
}
