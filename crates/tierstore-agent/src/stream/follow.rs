//! Model streams across nodes (Viper's notification path): the publisher's agent announces each version in
//! Redis (a `latest` key per stream, and a pub/sub message), and the agent of every node with a local
//! subscriber follows the stream there and pulls each version from the publisher's agent, over the agent
//! protocol, into its own shared memory. Only the tensors it does not hold cross the network (the others
//! are already in its `blobs`), each checked against its blake3; a version is registered, and its local
//! subscribers notified, once every tensor is in. N consumers on a node cost one transfer.
//!
//! While every local subscriber of a stream asked for notices only, the agent pulls the version's manifest
//! alone and relays it (`Streams::relay`, below): its consumers receive the tensors through their process
//! group, and the node's link carries them once, not twice. A version one of them needs after all is
//! pulled when it asks (`fetch`).
//!
//! Redis going away stops nothing: the announcer keeps the latest version of each stream and sets it again
//! once Redis answers (and every few seconds: a restarted Redis has lost its keys); a follower reconnects
//! with back-off and reads the `latest` key, so a node that was away catches up to the newest version, and
//! its subscribers are told how many versions they skipped.

use std::collections::HashMap;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::consumers::{Notice, Told};
use super::peers::{Announcement, BlobOffer, PeerAsk, MAX_CREDIT};
use super::{
    answer, check_name, held_notice, io_err, notice_json, remember_commit, Conn, StreamError, Streams, RELAYED_KEPT,
};
use crate::client::Client;
use crate::protocol::Frame;
use tierstore_core::models::manifest::{check_hash, Manifest, Tensor};
use tierstore_core::models::requests::VersionNotice;

/// How a node's streams reach the other nodes.
#[derive(Clone, Debug)]
pub struct Remote {
    /// The Redis server of the job (`redis://host:port`).
    pub redis: String,
    /// The job's name: keys live under `tierstore:{job}:stream:`.
    pub job: String,
    /// This node's name, in hellos to other agents.
    pub node: String,
    /// This agent's address as other agents reach it (`host:port`), announced with each version.
    pub me: String,
    /// The job's token, proven to other agents.
    pub token: Option<Vec<u8>>,
    /// The deadline of every request to Redis and of every frame to another agent.
    pub deadline: Duration,
}

impl Remote {
    fn latest_key(&self, name: &str) -> String {
        format!("tierstore:{}:stream:{name}:latest", self.job)
    }

    fn channel(&self, name: &str) -> String {
        format!("tierstore:{}:stream:{name}", self.job)
    }

    /// The MAC of an announcement of `version` of `name` by `agent`, under the job's token (none without
    /// one): anyone may write to the job's Redis, only the job's agents can announce a version there.
    fn mac(&self, name: &str, version: u64, agent: &str) -> Option<String> {
        let key = blake3::derive_key("tierstore stream announcement v1", self.token.as_deref()?);
        let mut h = blake3::Hasher::new_keyed(&key);
        for part in [self.job.as_bytes(), name.as_bytes(), &version.to_be_bytes(), agent.as_bytes()] {
            h.update(&(part.len() as u64).to_be_bytes());
            h.update(part);
        }
        Some(h.finalize().to_hex()[..32].to_string())
    }

    /// `announcement` with its MAC added (see [`Remote::mac`]).
    fn signed(&self, name: &str, announcement: Announcement) -> Announcement {
        let mac = self.mac(name, announcement.version, &announcement.agent);
        Announcement { mac, ..announcement }
    }

    /// The version and the announcing agent of `payload`, if it is an announcement of `name` a job's agent
    /// signed; anything else is ignored (and said once per follower).
    fn verified(&self, name: &str, payload: &[u8]) -> Option<(u64, String)> {
        let a = serde_json::from_slice::<Announcement>(payload).ok()?;
        let expected = self.mac(name, a.version, &a.agent)?;
        let given = a.mac.as_deref().unwrap_or_default();
        // Equal lengths first, then a comparison that does not stop at the first difference.
        let same = given.len() == expected.len()
            && given.bytes().zip(expected.bytes()).fold(0u8, |d, (a, b)| d | (a ^ b)) == 0;
        if !same {
            log::warn!("an announcement of {name} in {} is not signed with the job's token: ignored", self.redis);
            return None;
        }
        Some((a.version, a.agent))
    }

    fn connect(&self, client: &redis::Client) -> redis::RedisResult<redis::Connection> {
        let c = client.get_connection_with_timeout(self.deadline)?;
        c.set_read_timeout(Some(self.deadline))?;
        c.set_write_timeout(Some(self.deadline))?;
        Ok(c)
    }
}

/// The version of `name` last announced in Redis, if it answers within the deadline: a publisher's agent
/// that restarts numbers its versions after it, so that the other nodes take them as new.
pub(super) fn announced_latest(remote: &Remote, name: &str) -> Option<u64> {
    let client = redis::Client::open(remote.redis.as_str()).ok()?;
    let mut con = match remote.connect(&client) {
        Ok(c) => c,
        Err(e) => {
            log::warn!("{}: {e}; {name} is numbered from this agent's own versions", remote.redis);
            return None;
        }
    };
    let v: Option<Vec<u8>> = redis::cmd("GET").arg(remote.latest_key(name)).query(&mut con).ok()?;
    remote.verified(name, &v?).map(|(version, _)| version)
}

/// The streams' side of the other nodes: connecting to them, following a stream, relaying a version another
/// node holds, and pulling one.
impl Streams {
    /// Connects the streams to the other nodes, when the options name a Redis: versions published here
    /// are announced with this agent's address (`me`, else the peer listener), which must be reachable.
    pub fn join_nodes(&self, options: &crate::options::Options, listen: Option<std::net::SocketAddr>) {
        let Some(redis) = options.stream.redis.clone() else { return };
        let me =
            if options.me.is_empty() { listen.map(|a| a.to_string()).unwrap_or_default() } else { options.me.clone() };
        let job = if options.job.is_empty() { "tierstore".to_string() } else { options.job.clone() };
        let remote = Remote {
            redis,
            job,
            node: options.node.clone(),
            me,
            token: options.token.clone(),
            deadline: options.deadline,
        };
        let tx = announcer(remote.clone());
        let _ = self.remote.set((remote, tx));
    }

    /// Follows `name` in Redis from now on, if the streams reach other nodes (once per stream); the answer
    /// comes once the follower listens (or it gave up connecting for now): a version announced after the
    /// first subscriber's `subscribe` was answered reaches this node.
    pub(super) fn follow(self: &Arc<Self>, name: &str) -> Option<tokio::sync::oneshot::Receiver<()>> {
        let (remote, _) = self.remote.get()?;
        if !self.followed.lock().unwrap_or_else(|p| p.into_inner()).insert(name.to_string()) {
            return None;
        }
        let rt = tokio::runtime::Handle::try_current().ok()?;
        let (listening, rx) = tokio::sync::oneshot::channel();
        follow(self.clone(), remote.clone(), name.to_string(), rt, listening);
        Some(rx)
    }

    /// Tells this node's notices-only subscribers of `name` of the version `m` describes, which the agent at
    /// `agent` holds: its manifest is kept under `notices/`, none of its tensors is pulled.
    pub(super) fn relay(&self, name: &str, m: &Manifest, agent: &str) -> Result<(), StreamError> {
        let dir = self.dir.join("notices").join(name);
        std::fs::create_dir_all(&dir).map_err(io_err("cannot create", &dir))?;
        let path = dir.join(format!("{}.json", m.version));
        let part = dir.join(format!("{}.json.part", m.version));
        let body = serde_json::to_vec(m).map_err(|e| StreamError::BadRequest(e.to_string()))?;
        std::fs::write(&part, body)
            .and_then(|()| std::fs::rename(&part, &path))
            .map_err(io_err("cannot write", &path))?;
        let nbytes: u64 = m.tensors.iter().map(|t| t.nbytes).sum();
        let notice = VersionNotice {
            name: name.to_string(),
            version: m.version,
            manifest: path,
            step: m.step,
            nbytes,
            new_bytes: 0,
            tensors: m.tensors.len(),
            created: m.created,
            held: false,
            agent: Some(agent.to_string()),
        };
        let json = notice_json(&notice);
        let mut st = self.lock();
        let stream = st.streams.entry(name.to_string()).or_default();
        if m.version <= stream.relayed {
            return Ok(());
        }
        stream.relayed = m.version;
        stream.relays += 1;
        stream.relayed_notice = Some(json.clone());
        stream.relayed_from.insert(m.version, agent.to_string());
        while stream.relayed_from.len() > RELAYED_KEPT {
            if let Some((old, _)) = stream.relayed_from.pop_first() {
                let _ = std::fs::remove_file(dir.join(format!("{old}.json")));
            }
        }
        remember_commit(stream, m.version, m.created);
        let notice = Notice { name: name.to_string(), version: m.version, held: false, json };
        stream.subscribers.retain(|_, c| !matches!(c.tell(&notice), Told::Gone));
        Ok(())
    }

    /// A directory for a version being pulled from another node.
    pub(super) fn begin_pull(&self) -> Result<(u64, PathBuf), StreamError> {
        let id = {
            let mut st = self.lock();
            st.next_id += 1;
            st.next_id
        };
        let tmp = self.dir.join("tmp").join(id.to_string());
        std::fs::create_dir(&tmp).map_err(io_err("cannot create", &tmp))?;
        Ok((id, tmp))
    }

    pub(super) fn drop_pull(&self, id: u64) {
        let _ = std::fs::remove_dir_all(self.dir.join("tmp").join(id.to_string()));
    }

    /// Registers a version pulled whole into its directory, under the publisher's number (`leased`: with
    /// one lease, taken before anything could free it, for the connection that asked for it).
    pub(super) fn install_pulled(
        &self,
        id: u64,
        name: &str,
        version: u64,
        bytes: u64,
        leased: bool,
    ) -> Result<Value, StreamError> {
        let r = self.install(id, name, Some(version), bytes, leased);
        self.drop_pull(id);
        r
    }

    /// The notice of version `version` of `name` if it is held here, leased to `conn`.
    pub(super) fn lease_held(&self, conn: &mut Conn, name: &str, version: u64) -> Option<Value> {
        let mut st = self.lock();
        let k = st.streams.get_mut(name)?.versions.get_mut(&version)?;
        k.leases += 1;
        *conn.leases.entry((name.to_string(), version)).or_default() += 1;
        Some(answer(held_notice(name, version, k)))
    }

    /// The notice of version `version` of `name`, leased to `conn`: held here already, or pulled now from
    /// the agent that announced it (a version relayed to notices-only subscribers).
    pub(super) async fn fetch(
        self: &Arc<Self>,
        conn: &mut Conn,
        name: &str,
        version: u64,
    ) -> Result<Value, StreamError> {
        check_name(name)?;
        if let Some(v) = self.lease_held(conn, name, version) {
            return Ok(v);
        }
        let from = self.lock().streams.get(name).and_then(|s| s.relayed_from.get(&version).cloned());
        let (Some(agent), Some((remote, _))) = (from, self.remote.get()) else {
            return Err(StreamError::Gone { name: name.to_string(), version, keep: self.keep });
        };
        match pull(self, remote, &agent, name, version, true).await {
            Ok(_) => {
                // Installed with the lease this connection now holds.
                *conn.leases.entry((name.to_string(), version)).or_default() += 1;
                let st = self.lock();
                let k = st.streams.get(name).and_then(|s| s.versions.get(&version));
                k.map(|k| answer(held_notice(name, version, k))).ok_or(StreamError::Gone {
                    name: name.to_string(),
                    version,
                    keep: self.keep,
                })
            }
            // Pulled meanwhile for a subscriber that takes the tensors.
            Err(detail) => self.lease_held(conn, name, version).ok_or(StreamError::Pull {
                name: name.to_string(),
                version,
                agent,
                detail,
            }),
        }
    }
}

/// Chunks a puller lets the other agent send ahead of what it has written.
const WINDOW: u32 = 8;

/// How often an announcer sets every stream's `latest` again, and a follower reads it (a lost message or a
/// restarted Redis costs at most this).
const REFRESH: Duration = Duration::from_secs(2);

/// Starts the thread that announces this node's versions; returns where to send (stream, announcement).
pub(super) fn announcer(remote: Remote) -> mpsc::Sender<(String, Announcement)> {
    let (tx, rx) = mpsc::channel::<(String, Announcement)>();
    std::thread::Builder::new()
        .name("tierstore-stream-announce".into())
        .spawn(move || announce(&remote, &rx))
        .expect("spawn the announcer");
    tx
}

/// The announcer's loop, until the agent drops its sender: each version received is signed, set as its
/// stream's `latest` and published (those received together in one pass); every [`REFRESH`] every
/// stream's `latest` is set again. Redis failing: the unsent ones are retried every 200 ms, the failure
/// logged once.
fn announce(remote: &Remote, rx: &mpsc::Receiver<(String, Announcement)>) {
    let client = match redis::Client::open(remote.redis.as_str()) {
        Ok(c) => c,
        Err(e) => {
            log::warn!("stream announcements: {} is not a Redis URL ({e}); versions stay on this node", remote.redis);
            return;
        }
    };
    let mut latest: HashMap<String, Announcement> = HashMap::new();
    let mut unsent: HashMap<String, Announcement> = HashMap::new();
    let mut con: Option<redis::Connection> = None;
    let mut failing = false;
    let mut refreshed = Instant::now();
    loop {
        let wait = if unsent.is_empty() { REFRESH } else { Duration::from_millis(200) };
        let mut take = |(name, v): (String, Announcement)| {
            let v = remote.signed(&name, v);
            latest.insert(name.clone(), v.clone());
            unsent.insert(name, v);
        };
        match rx.recv_timeout(wait) {
            Ok(first) => {
                take(first);
                while let Ok(next) = rx.try_recv() {
                    take(next);
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
        let refresh = refreshed.elapsed() >= REFRESH;
        if unsent.is_empty() && !refresh {
            continue;
        }
        let sent = connected(remote, &client, &mut con)
            .and_then(|c| send_announcements(remote, c, &unsent, refresh.then_some(&latest)));
        match sent {
            Ok(()) => {
                unsent.clear();
                if refresh {
                    refreshed = Instant::now();
                }
                if failing {
                    log::info!("stream announcements: {} answers again", remote.redis);
                    failing = false;
                }
            }
            Err(e) => {
                con = None;
                if !failing {
                    log::warn!("stream announcements: {} failed ({e}); retrying", remote.redis);
                    failing = true;
                }
            }
        }
    }
}

/// The announcer's Redis connection, made when there is none.
fn connected<'c>(
    remote: &Remote,
    client: &redis::Client,
    con: &'c mut Option<redis::Connection>,
) -> redis::RedisResult<&'c mut redis::Connection> {
    if con.is_none() {
        *con = Some(remote.connect(client)?);
    }
    Ok(con.as_mut().expect("connected"))
}

/// Sets each of `unsent` as its stream's `latest` and publishes it on the stream's channel (one round trip
/// each); with `refresh`, sets every stream's `latest` again.
fn send_announcements(
    remote: &Remote,
    c: &mut redis::Connection,
    unsent: &HashMap<String, Announcement>,
    refresh: Option<&HashMap<String, Announcement>>,
) -> redis::RedisResult<()> {
    for (name, v) in unsent {
        let text = v.text();
        redis::pipe()
            .cmd("SET")
            .arg(remote.latest_key(name))
            .arg(&text)
            .ignore()
            .cmd("PUBLISH")
            .arg(remote.channel(name))
            .arg(&text)
            .ignore()
            .query::<()>(c)?;
    }
    for (name, v) in refresh.into_iter().flatten() {
        redis::cmd("SET").arg(remote.latest_key(name)).arg(v.text()).query::<()>(c)?;
    }
    Ok(())
}

/// Starts following stream `name` in Redis: every version announced by another node's agent is pulled
/// here (or relayed). `listening` is sent once the follower first listens to the stream's announcements.
/// Runs until the agent exits.
pub(super) fn follow(
    streams: Arc<Streams>,
    remote: Remote,
    name: String,
    rt: tokio::runtime::Handle,
    listening: tokio::sync::oneshot::Sender<()>,
) {
    let spawned = std::thread::Builder::new()
        .name(format!("tierstore-stream-follow-{name}"))
        .spawn(move || keep_following(&streams, &remote, &name, &rt, listening));
    if let Err(e) = spawned {
        log::warn!("cannot follow a stream: {e}");
    }
}

/// The follower's loop: two connections to Redis (one subscribed to the stream's channel, one to read its
/// `latest`), `listening` told once it first listens; a lost connection is made again with back-off (50 ms,
/// doubling to 1 s), an outage recorded once.
fn keep_following(
    streams: &Arc<Streams>,
    remote: &Remote,
    name: &str,
    rt: &tokio::runtime::Handle,
    listening: tokio::sync::oneshot::Sender<()>,
) {
    let mut listening = Some(listening);
    let client = match redis::Client::open(remote.redis.as_str()) {
        Ok(c) => c,
        Err(e) => {
            streams.record_error(name, format!("{} is not a Redis URL ({e})", remote.redis));
            return;
        }
    };
    let mut backoff = Duration::from_millis(50);
    let mut failing = false;
    loop {
        let mut con = match remote.connect(&client) {
            Ok(c) => c,
            Err(e) => {
                if !failing {
                    streams.record_error(name, format!("cannot follow {name} in {} ({e}); retrying", remote.redis));
                    failing = true;
                }
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        let Ok(mut reader) = remote.connect(&client) else { continue };
        let _ = con.set_read_timeout(Some(Duration::from_millis(250)));
        let mut ps = con.as_pubsub();
        if ps.subscribe(remote.channel(name)).is_err() {
            continue;
        }
        if let Some(tx) = listening.take() {
            let _ = tx.send(());
        }
        if failing {
            log::info!("following {name} in {} again", remote.redis);
            failing = false;
        }
        backoff = Duration::from_millis(50);
        if let Some(e) = listen(streams, remote, name, rt, &mut ps, &mut reader) {
            streams.record_error(name, format!("lost {} ({e}); reconnecting", remote.redis));
            failing = true;
        }
    }
}

/// Takes `name`'s announcements until a connection fails: every one published on its channel, and its
/// `latest` read every [`REFRESH`] (a lost message costs at most that). The subscription's error, or None
/// when the reading connection failed (made again quietly).
fn listen(
    streams: &Arc<Streams>,
    remote: &Remote,
    name: &str,
    rt: &tokio::runtime::Handle,
    ps: &mut redis::PubSub<'_>,
    reader: &mut redis::Connection,
) -> Option<redis::RedisError> {
    let mut checked = Instant::now() - REFRESH;
    loop {
        if checked.elapsed() >= REFRESH {
            checked = Instant::now();
            match redis::cmd("GET").arg(remote.latest_key(name)).query::<Option<Vec<u8>>>(reader) {
                Ok(Some(v)) => arrived(streams, remote, name, &v, rt),
                Ok(None) => {}
                Err(_) => return None,
            }
        }
        match ps.get_message() {
            Ok(msg) => arrived(streams, remote, name, msg.get_payload_bytes(), rt),
            Err(e) if e.is_timeout() => {}
            Err(e) => return Some(e),
        }
    }
}

fn arrived(streams: &Arc<Streams>, remote: &Remote, name: &str, payload: &[u8], rt: &tokio::runtime::Handle) {
    let Some((version, agent)) = remote.verified(name, payload) else { return };
    let agent = agent.as_str();
    if agent == remote.me {
        return;
    }
    if streams.relays_only(name) {
        let newest = streams.newest(name);
        if version <= newest {
            return;
        }
        // Every version in order (a consumer of a process group takes part in each one's transfer): those
        // an announcement overtook too, as many as are kept.
        let first =
            if newest == 0 { version } else { (newest + 1).max(version.saturating_sub(RELAYED_KEPT as u64 - 1)) };
        for v in first..=version {
            if let Err(e) = rt.block_on(relay(streams, remote, agent, name, v)) {
                streams.record_error(name, format!("relaying {name} version {v} from {agent}: {e}"));
            }
        }
        return;
    }
    if version <= streams.latest(name) {
        return;
    }
    let started = Instant::now();
    let pulled = rt.block_on(pull(streams, remote, agent, name, version, false));
    match pulled {
        Ok(bytes) => {
            log::info!("pulled {name} version {version} from {agent}: {bytes} bytes in {:?}", started.elapsed())
        }
        Err(e) => streams.record_error(name, format!("pulling {name} version {version} from {agent}: {e}")),
    }
}

/// Asks the agent at the other end of `c` for the manifest of version `version` of `name`.
async fn manifest<S>(c: &mut Client<S>, name: &str, version: u64) -> Result<Manifest, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let ask = PeerAsk::Manifest { name: name.to_string(), version };
    match c.call(&Frame::StreamRequest { json: ask.text() }).await.map_err(|e| e.to_string())? {
        Frame::StreamEvent { json } => serde_json::from_str(&json).map_err(|e| format!("its manifest: {e}")),
        other => Err(format!("unexpected answer {other:?}")),
    }
}

/// Relays version `version` of `name`, held by the agent at `agent`, to this node's notices-only
/// subscribers: one manifest crosses the network, no tensor.
async fn relay(streams: &Arc<Streams>, remote: &Remote, agent: &str, name: &str, version: u64) -> Result<(), String> {
    let mut c =
        Client::peer(agent, &remote.node, remote.token.as_deref(), remote.deadline).await.map_err(|e| e.to_string())?;
    let m = manifest(&mut c, name, version).await?;
    if m.version != version || m.name != name {
        return Err(format!("asked for {name} version {version}, answered {} version {}", m.name, m.version));
    }
    streams.relay(name, &m, agent).map_err(|e| e.to_string())
}

/// Pulls version `version` of `name` from the agent at `agent`: the tensors this node lacks, then the
/// version is installed (`leased`: with a lease for the connection that asked); the bytes that crossed.
pub(super) async fn pull(
    streams: &Arc<Streams>,
    remote: &Remote,
    agent: &str,
    name: &str,
    version: u64,
    leased: bool,
) -> Result<u64, String> {
    let mut c =
        Client::peer(agent, &remote.node, remote.token.as_deref(), remote.deadline).await.map_err(|e| e.to_string())?;
    let m = manifest(&mut c, name, version).await?;
    let (id, tmp) = streams.begin_pull().map_err(|e| e.to_string())?;
    let result = async {
        let mut bytes = 0u64;
        let mut fetched: Vec<&str> = Vec::new();
        for t in &m.tensors {
            if streams.holds(&t.hash) || fetched.contains(&t.hash.as_str()) {
                continue;
            }
            bytes += pull_tensor(&mut c, t, &tmp).await?;
            fetched.push(&t.hash);
        }
        let body = serde_json::to_vec(&m).map_err(|e| e.to_string())?;
        std::fs::write(tmp.join("manifest.json"), body).map_err(|e| e.to_string())?;
        Ok(bytes)
    }
    .await;
    match result {
        Ok(bytes) => {
            let s = streams.clone();
            let name = name.to_string();
            tokio::task::spawn_blocking(move || s.install_pulled(id, &name, version, bytes, leased))
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())?;
            Ok(bytes)
        }
        Err(e) => {
            streams.drop_pull(id);
            Err(e)
        }
    }
}

/// Receives tensor `t` from the other agent into `tmp/HASH`, under a window of [`WINDOW`] chunks, hashing
/// each chunk as it lands; its bytes, or why it is not used (an offer of another size, a damaged copy).
async fn pull_tensor(c: &mut Client<tokio::net::TcpStream>, t: &Tensor, tmp: &Path) -> Result<u64, String> {
    if !check_hash(&t.hash) {
        return Err(format!("tensor {:?} has no blake3 hex hash", t.name));
    }
    let ask = PeerAsk::Blob { hash: t.hash.clone(), credit: WINDOW };
    match c.call(&Frame::StreamRequest { json: ask.text() }).await.map_err(|e| e.to_string())? {
        Frame::StreamEvent { json } => {
            let offer: BlobOffer =
                serde_json::from_str(&json).map_err(|e| format!("tensor {:?}: its offer: {e}", t.name))?;
            if offer.size != t.nbytes {
                return Err(format!("tensor {:?}: {} bytes offered, {} expected", t.name, offer.size, t.nbytes));
            }
        }
        other => return Err(format!("unexpected answer {other:?}")),
    }
    let path = tmp.join(&t.hash);
    let file = std::fs::File::create(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut hasher = tierstore_core::hash::Hasher::new();
    let mut offset = 0u64;
    loop {
        match c.receive_frame().await.map_err(|e| e.to_string())? {
            Frame::Chunk { offset: at, data, .. } if at == offset => {
                hasher.update(&data);
                file.write_all_at(&data, offset).map_err(|e| format!("{}: {e}", path.display()))?;
                offset += data.len() as u64;
                c.send_frame(&Frame::Credit { id: 0, more: 1 }).await.map_err(|e| e.to_string())?;
            }
            Frame::Done { .. } => break,
            Frame::Error { message, .. } => return Err(message),
            other => return Err(format!("unexpected frame {other:?} at byte {offset} of {:?}", t.name)),
        }
    }
    let got = tierstore_core::hash::hex(hasher.finalize().as_bytes());
    if offset != t.nbytes || got != t.hash {
        return Err(format!("tensor {:?} arrived damaged ({offset} bytes, blake3 {got}); not used", t.name));
    }
    Ok(offset)
}

/// Answers another agent's stream requests on a peer connection: a version's manifest, a tensor's bytes.
pub async fn serve_peer<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    stream: &mut crate::protocol::Conn<S>,
    first: String,
    streams: Arc<Streams>,
    deadline: Duration,
) -> io::Result<()> {
    let mut next = Some(first);
    loop {
        let json = match next.take() {
            Some(j) => j,
            None => match tokio::time::timeout(Duration::from_secs(300), stream.read_frame()).await {
                Ok(Ok(Some(Frame::StreamRequest { json }))) => json,
                // Credit the last transfer did not need.
                Ok(Ok(Some(Frame::Credit { .. }))) => continue,
                _ => return Ok(()),
            },
        };
        let refuse = |message: String| Frame::Error { code: crate::protocol::ErrorCode::NotFound, message };
        let ask = match serde_json::from_str::<PeerAsk>(&json) {
            Ok(ask) => ask,
            Err(e) => {
                let message = format!("another agent may ask for a version's manifest or a tensor only ({e})");
                write(stream, &Frame::Error { code: crate::protocol::ErrorCode::BadRequest, message }, deadline)
                    .await?;
                continue;
            }
        };
        match ask {
            PeerAsk::Manifest { name, version } => {
                let answer = match streams.manifest_text(&name, version) {
                    Ok(text) => Frame::StreamEvent { json: text },
                    Err(e) => refuse(e.to_string()),
                };
                write(stream, &answer, deadline).await?;
            }
            PeerAsk::Blob { hash, credit } => {
                let credit = credit.clamp(1, MAX_CREDIT);
                let file = if check_hash(&hash) { std::fs::File::open(streams.blob(&hash)).ok() } else { None };
                let Some(file) = file else {
                    write(stream, &refuse(format!("no tensor {hash} here (its version was freed)")), deadline).await?;
                    continue;
                };
                let size = file.metadata()?.len();
                let offer = serde_json::to_string(&BlobOffer { size }).expect("an offer is plain JSON");
                write(stream, &Frame::StreamEvent { json: offer }, deadline).await?;
                match crate::transfer::send_chunks(stream, Arc::new(file), size, 0, credit, deadline).await? {
                    Ok(hash) => {
                        write(stream, &Frame::Done { id: 0, hash }, deadline).await?;
                        streams.count_served(size);
                    }
                    Err(e) => write(stream, &refuse(format!("reading tensor {hash}: {e}")), deadline).await?,
                }
            }
        }
    }
}

async fn write<S: tokio::io::AsyncWrite + Unpin>(
    stream: &mut crate::protocol::Conn<S>,
    frame: &Frame,
    deadline: Duration,
) -> io::Result<()> {
    match tokio::time::timeout(deadline, stream.write_frame(frame)).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, "the other agent took nothing in time")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn remote(token: &[u8]) -> Remote {
        Remote {
            redis: "redis://127.0.0.1:6379".into(),
            job: "job".into(),
            node: "a".into(),
            me: "10.0.0.1:7078".into(),
            token: Some(token.to_vec()),
            deadline: Duration::from_secs(1),
        }
    }

    #[test]
    fn only_announcements_signed_with_the_jobs_token_are_followed() {
        let job = remote(b"the-token-of-the-job-0123456789abcdef");
        let announced =
            Announcement { name: "policy".into(), version: 7, agent: "10.0.0.1:7078".into(), nbytes: 1, mac: None };
        let signed = job.signed("policy", announced.clone()).text();
        assert_eq!(job.verified("policy", signed.as_bytes()), Some((7, "10.0.0.1:7078".to_string())));
        // Unsigned, for another stream, or with its version or agent changed: ignored.
        assert_eq!(job.verified("policy", announced.text().as_bytes()), None);
        assert_eq!(job.verified("other", signed.as_bytes()), None);
        let mut forged: Value = serde_json::from_str(&signed).unwrap();
        forged["version"] = json!(1u64 << 40);
        assert_eq!(job.verified("policy", forged.to_string().as_bytes()), None);
        forged["version"] = json!(7);
        forged["agent"] = json!("10.6.6.6:7078");
        assert_eq!(job.verified("policy", forged.to_string().as_bytes()), None);
        // Signed with another token: ignored.
        let stranger = remote(b"a stranger's token, not the job's own one");
        assert_eq!(job.verified("policy", stranger.signed("policy", announced).text().as_bytes()), None);
    }
}
