//! Model streaming in the agent (ARCHITECTURE.md, "Model streaming"; Viper's memory-first path): the
//! versions of the node's model streams, held in shared memory the agent owns, and their subscribers.
//!
//! Layout of the agent's stream directory (on /dev/shm):
//!
//! ```text
//! blobs/<blake3 hex>            one tensor's bytes, shared by every version holding that content
//! versions/<name>/<n>.json      a version's manifest: its tensors (name, dtype, shape, hash, nbytes)
//! tmp/<publish>/                a publish in progress: its new tensors and its manifest
//! notices/<name>/<n>.json       the manifest of a version another node holds, relayed without its tensors
//! ```
//!
//! A publisher `begin`s (and is leased the latest version, the base it compares against), writes the
//! tensors that changed into its `tmp` directory, writes the manifest, and `commit`s: the agent moves the
//! new tensors into `blobs` (renames, nothing copied), numbers the version, writes its manifest and pushes
//! a notice to every subscriber. Until that commit nothing of the version is visible; a publisher whose
//! connection ends first (killed mid-publish) leaves nothing but its `tmp` directory, removed at once.
//!
//! Each notice pushed to a subscriber leases it that version; leases end with a `release` or with the
//! connection (a consumer killed frees what it held). The agent keeps the last `keep` versions of a stream,
//! and older ones while leased; a tensor file is removed when no version kept holds it.
//!
//! A subscriber may ask for notices only (`notices_only`): a consumer that receives the changed tensors by
//! other means (a torch.distributed process group) needs to know of each version, not its bytes here.
//! While every subscriber of a stream on this node asks so, the agent relays each version announced by
//! another node as a notice of its manifest (`held: false`, the manifest under `notices/`) and pulls none
//! of its tensors; a consumer that needs the bytes after all (a version sent outside its group) asks for
//! that version with `fetch`, and the agent pulls it then. A subscriber that takes the tensors makes the
//! agent pull every version, as before. Subscribers that report the version they serve (`serving`) are
//! listed with their lag (see [`consumers`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, watch};

use crate::protocol::{self, ErrorCode, Frame};

mod consumers;
mod follow;

use consumers::{Consumer, Told, COMMITS_KEPT};
pub use follow::{serve_peer, Remote};

/// What this agent's stream requests offer beyond those of the first version of the protocol, answered to
/// every `subscribe`: a client uses an option only where its agent lists it (an older agent ignores
/// `notices_only` and pulls, and would refuse `serving` and `fetch`).
pub const FEATURES: &[&str] = &["notices_only", "serving", "fetch"];

/// Relayed manifests kept per stream: a subscriber reads one as its notice arrives.
const RELAYED_KEPT: usize = 16;

/// Versions kept per stream when none is configured: the one consumers serve and the one before it.
pub const DEFAULT_KEEP: usize = 2;

/// Why a stream request failed.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// A request that is not JSON of a known shape.
    #[error("not a stream request ({0}); use the tierstore.stream of the same tierstore as the agent")]
    BadRequest(String),
    /// A stream name that cannot be a directory name.
    #[error("stream name {0:?}: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit")]
    BadName(String),
    /// A commit, abort or release of something this connection does not hold.
    #[error("{0}")]
    NotHeld(String),
    /// The publisher's manifest is missing or wrong.
    #[error("publish {publish} of {name}: {detail}; publish the version again")]
    BadPublish {
        /// The publish.
        publish: u64,
        /// The stream.
        name: String,
        /// What is wrong.
        detail: String,
    },
    /// A version that is not (or no longer) kept.
    #[error("{name} version {version} is not held by this agent (it keeps the last {keep} and leased ones)")]
    Gone {
        /// The stream.
        name: String,
        /// The version.
        version: u64,
        /// Versions kept.
        keep: usize,
    },
    /// A version relayed here could not be pulled from the node that holds it.
    #[error("pulling {name} version {version} from the agent at {agent}: {detail}; the consumer keeps the version it serves")]
    Pull {
        /// The stream.
        name: String,
        /// The version.
        version: u64,
        /// The agent that announced it.
        agent: String,
        /// What failed.
        detail: String,
    },
    /// The shared memory could not be written.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// Where.
        path: String,
        /// The error.
        source: io::Error,
    },
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> StreamError {
    let path = path.display().to_string();
    move |source| StreamError::Io { what, path, source }
}

/// A request of a stream connection (the JSON of a `StreamRequest` frame, tagged by `op`).
#[derive(Debug, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Starts publishing a version of `name`: answers the publish's number, its directory and the base.
    Begin {
        /// The stream.
        name: String,
    },
    /// Makes the version written under the publish's directory visible, and notifies.
    Commit {
        /// The publish.
        publish: u64,
    },
    /// Drops a publish in progress.
    Abort {
        /// The publish.
        publish: u64,
    },
    /// Pushes a notice of every version of `name` newer than `after` to this connection, from now on
    /// (starting with the latest, if it is newer).
    Subscribe {
        /// The stream.
        name: String,
        /// The newest version the subscriber already has (0: none).
        #[serde(default)]
        after: u64,
        /// Notices only: versions other nodes hold are relayed without pulling their tensors here.
        #[serde(default)]
        notices_only: bool,
        /// The subscriber's process id, for `tierstore stream show|watch`.
        #[serde(default)]
        pid: Option<u32>,
        /// What the subscriber calls itself, for `tierstore stream show|watch`.
        #[serde(default)]
        label: Option<String>,
    },
    /// The subscriber of this connection serves `version` from now on (no answer): its lag is listed.
    Serving {
        /// The version it swapped to.
        version: u64,
    },
    /// Answers the notice of version `version` of `name` and leases it to this connection, pulling it from
    /// the node that holds it when it was only relayed here.
    Fetch {
        /// The stream.
        name: String,
        /// The version.
        version: u64,
    },
    /// Ends one lease of this connection on a version (no answer).
    Release {
        /// The stream.
        name: String,
        /// The version.
        version: u64,
    },
    /// The streams of this agent, their versions, leases and subscribers.
    List,
}

/// One tensor of a manifest.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Tensor {
    /// The state-dict key.
    pub name: String,
    /// The dtype's name (torch's or numpy's).
    pub dtype: String,
    /// The shape.
    pub shape: Vec<u64>,
    /// blake3 of the bytes, lowercase hex: the name of its file in `blobs`.
    pub hash: String,
    /// The size in bytes.
    pub nbytes: u64,
}

/// A version's manifest: what the publisher writes, completed by the agent at commit.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    /// The stream (set by the agent).
    #[serde(default)]
    pub name: String,
    /// The version number (set by the agent).
    #[serde(default)]
    pub version: u64,
    /// Seconds since the epoch at commit (set by the agent).
    #[serde(default)]
    pub created: f64,
    /// The trainer's step, if it gave one.
    #[serde(default)]
    pub step: Option<i64>,
    /// The publisher's metadata.
    #[serde(default)]
    pub metadata: Value,
    /// The tensors, in the publisher's order.
    pub tensors: Vec<Tensor>,
}

/// Where streams keep their versions, and how many.
#[derive(Clone, Debug)]
pub struct StreamOptions {
    /// The stream directory (none: on /dev/shm, named after the agent's socket).
    pub dir: Option<PathBuf>,
    /// Versions kept per stream besides leased ones (at least 1).
    pub keep: usize,
    /// The job's Redis (`redis://host:port`), where versions are announced to other nodes and followed
    /// from them (none: streams stay on this node).
    pub redis: Option<String>,
}

impl Default for StreamOptions {
    fn default() -> Self {
        StreamOptions { dir: None, keep: DEFAULT_KEEP, redis: None }
    }
}

/// The stream directory of the agent on `socket`: on /dev/shm (memory) when there is one, private to the
/// user, one per socket (agents of several nodes may share a machine in tests).
pub fn default_dir(socket: &Path) -> PathBuf {
    let tag = &crate::stream::hex8(socket.as_os_str().as_encoded_bytes());
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    let shm = Path::new("/dev/shm");
    let base =
        if shm.is_dir() { shm.to_path_buf() } else { socket.parent().unwrap_or(Path::new("/tmp")).to_path_buf() };
    base.join(format!("tierstore-{uid}-stream-{tag}"))
}

fn hex8(bytes: &[u8]) -> String {
    tierstore_core::hash::hex(&tierstore_core::hash::hash(bytes))[..8].to_string()
}

fn check_name(name: &str) -> Result<(), StreamError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(StreamError::BadName(name.chars().take(200).collect()))
    }
}

fn check_hash(h: &str) -> bool {
    h.len() == 64 && h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs_f64()
}

/// The notice of a version held here.
fn held_notice(name: &str, version: u64, k: &Kept) -> Value {
    json!({
        "event": "version", "name": name, "version": version, "manifest": k.manifest, "step": k.step,
        "nbytes": k.nbytes, "new_bytes": k.new_bytes, "tensors": k.tensors, "created": k.created, "held": true,
    })
}

/// Records when `version` of a stream was committed (for the consumers' lag), forgetting the oldest.
fn remember_commit(stream: &mut Stream, version: u64, created: f64) {
    stream.committed.insert(version, created);
    while stream.committed.len() > COMMITS_KEPT {
        stream.committed.pop_first();
    }
}

/// Who subscribes, as its `subscribe` request says.
#[derive(Default)]
struct Subscribing {
    notices_only: bool,
    pid: Option<u32>,
    label: Option<String>,
}

/// A notice pushed to subscribers.
#[derive(Clone, Debug)]
struct Notice {
    name: String,
    version: u64,
    /// The version is held here (its notice is a lease), not only relayed from another node.
    held: bool,
    json: Arc<String>,
}

struct Kept {
    manifest: PathBuf,
    hashes: Vec<String>,
    nbytes: u64,
    new_bytes: u64,
    tensors: usize,
    step: Option<i64>,
    created: f64,
    leases: usize,
}

#[derive(Default)]
struct Stream {
    versions: BTreeMap<u64, Kept>,
    latest: u64,
    /// The notice of the newest version relayed, for a notices-only subscriber that arrives later.
    relayed_notice: Option<Arc<String>>,
    subscribers: HashMap<u64, Consumer>,
    published: u64,
    /// Commit times of the last versions known here (held or relayed), for the consumers' lag.
    committed: BTreeMap<u64, f64>,
    /// The newest version relayed without its tensors, how many were, and the agent holding each of the
    /// last ones (where `fetch` pulls them from).
    relayed: u64,
    relays: u64,
    relayed_from: BTreeMap<u64, String>,
    /// Versions pulled from another node's agent, and their bytes that crossed the network.
    pulled: u64,
    pulled_bytes: u64,
    /// Failures to follow or pull this stream, and the last one.
    errors: u64,
    last_error: Option<String>,
}

struct Pending {
    id: u64,
    name: String,
    base: Option<u64>,
}

#[derive(Default)]
struct State {
    streams: HashMap<String, Stream>,
    /// Tensor files and how many kept versions hold each (a version holding a content twice counts twice).
    blobs: HashMap<String, usize>,
    next_id: u64,
}

/// The streams of one agent.
pub struct Streams {
    dir: PathBuf,
    keep: usize,
    state: Mutex<State>,
    /// Where versions go to and come from other nodes, and the announcer's queue.
    remote: OnceLock<(Remote, std::sync::mpsc::Sender<(String, Value)>)>,
    /// The streams followed in Redis (those with a subscriber here).
    followed: Mutex<HashSet<String>>,
    /// The streams whose numbering was read from Redis at their first publish here.
    numbered: Mutex<HashSet<String>>,
    /// Tensor bytes sent to other nodes' agents.
    served_bytes: AtomicU64,
    /// Files of dropped versions, moved into `trash/` under the lock and unlinked by a thread of their
    /// own: freeing shared memory costs about 0.25 ms a MiB, which no commit should wait for.
    reaper: std::sync::mpsc::Sender<PathBuf>,
    trashed: AtomicU64,
}

/// The directories under the stream directory: tensor files, manifests, publishes in progress, manifests
/// of versions relayed without their tensors, and tensor files dropped but not yet freed.
const SUBDIRS: [&str; 5] = ["blobs", "versions", "tmp", "notices", "trash"];

/// Unlinks each file sent, until the sender is gone.
fn reaper() -> std::sync::mpsc::Sender<PathBuf> {
    let (tx, rx) = std::sync::mpsc::channel::<PathBuf>();
    std::thread::Builder::new()
        .name("tierstore-stream-reaper".into())
        .spawn(move || {
            for path in rx {
                let _ = std::fs::remove_file(path);
            }
        })
        .expect("spawning a thread");
    tx
}

impl Streams {
    /// Opens the stream directory, emptied: versions live only as long as the agent that numbered them.
    pub fn open(options: &StreamOptions, socket: &Path) -> Result<Streams, StreamError> {
        let dir = options.dir.clone().unwrap_or_else(|| default_dir(socket));
        for sub in SUBDIRS {
            let d = dir.join(sub);
            if d.exists() {
                std::fs::remove_dir_all(&d).map_err(io_err("cannot empty the stream directory", &d))?;
            }
        }
        {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&dir)
                .map_err(io_err("cannot create the stream directory", &dir))?;
        }
        for sub in SUBDIRS {
            let d = dir.join(sub);
            std::fs::create_dir_all(&d).map_err(io_err("cannot create", &d))?;
        }
        Ok(Streams {
            dir,
            keep: options.keep.max(1),
            state: Mutex::new(State::default()),
            remote: OnceLock::new(),
            followed: Mutex::new(HashSet::new()),
            numbered: Mutex::new(HashSet::new()),
            served_bytes: AtomicU64::new(0),
            reaper: reaper(),
            trashed: AtomicU64::new(0),
        })
    }

    /// Connects the streams to the other nodes, when the options name a Redis: versions published here
    /// are announced with this agent's address (`me`, else the peer listener), which must be reachable.
    pub fn join_nodes(&self, options: &crate::server::Options, listen: Option<std::net::SocketAddr>) {
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
        let tx = follow::announcer(remote.clone());
        let _ = self.remote.set((remote, tx));
    }

    /// Follows `name` in Redis from now on, if the streams reach other nodes (once per stream); the answer
    /// comes once the follower listens (or it gave up connecting for now): a version announced after the
    /// first subscriber's `subscribe` was answered reaches this node.
    fn follow(self: &Arc<Self>, name: &str) -> Option<tokio::sync::oneshot::Receiver<()>> {
        let (remote, _) = self.remote.get()?;
        if !self.followed.lock().unwrap_or_else(|p| p.into_inner()).insert(name.to_string()) {
            return None;
        }
        let rt = tokio::runtime::Handle::try_current().ok()?;
        let (listening, rx) = tokio::sync::oneshot::channel();
        follow::follow(self.clone(), remote.clone(), name.to_string(), rt, listening);
        Some(rx)
    }

    fn latest(&self, name: &str) -> u64 {
        self.lock().streams.get(name).map_or(0, |s| s.latest)
    }

    /// The newest version of `name` known here, held or relayed.
    fn newest(&self, name: &str) -> u64 {
        self.lock().streams.get(name).map_or(0, |s| s.latest.max(s.relayed))
    }

    /// Whether versions of `name` announced by other nodes are relayed rather than pulled: while it has
    /// subscribers here and every one asked for notices only.
    fn relays_only(&self, name: &str) -> bool {
        let st = self.lock();
        st.streams
            .get(name)
            .is_some_and(|s| !s.subscribers.is_empty() && s.subscribers.values().all(|c| c.notices_only))
    }

    fn holds(&self, hash: &str) -> bool {
        self.lock().blobs.contains_key(hash)
    }

    fn record_error(&self, name: &str, message: String) {
        log::warn!("{message}");
        let mut st = self.lock();
        let s = st.streams.entry(name.to_string()).or_default();
        s.errors += 1;
        s.last_error = Some(message);
    }

    fn count_served(&self, n: u64) {
        self.served_bytes.fetch_add(n, Ordering::Relaxed);
    }

    fn manifest_text(&self, name: &str, version: u64) -> Result<String, StreamError> {
        let path = self
            .lock()
            .streams
            .get(name)
            .and_then(|s| s.versions.get(&version))
            .map(|k| k.manifest.clone())
            .ok_or(StreamError::Gone { name: name.to_string(), version, keep: self.keep })?;
        std::fs::read_to_string(&path).map_err(io_err("cannot read", &path))
    }

    /// A directory for a version being pulled from another node.
    fn begin_pull(&self) -> Result<(u64, PathBuf), StreamError> {
        let id = {
            let mut st = self.lock();
            st.next_id += 1;
            st.next_id
        };
        let tmp = self.dir.join("tmp").join(id.to_string());
        std::fs::create_dir(&tmp).map_err(io_err("cannot create", &tmp))?;
        Ok((id, tmp))
    }

    fn drop_pull(&self, id: u64) {
        let _ = std::fs::remove_dir_all(self.dir.join("tmp").join(id.to_string()));
    }

    /// Registers a version pulled whole into its directory, under the publisher's number (`leased`: with
    /// one lease, taken before anything could free it, for the connection that asked for it).
    fn install_pulled(
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

    /// The stream directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Frees the shared memory of every version (an agent that stops): consumers keep the tensors they
    /// mapped or copied; nothing new can be opened.
    pub fn remove(&self) {
        for sub in SUBDIRS {
            let _ = std::fs::remove_dir_all(self.dir.join(sub));
        }
        let _ = std::fs::remove_dir(&self.dir);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn blob(&self, hash: &str) -> PathBuf {
        self.dir.join("blobs").join(hash)
    }

    fn begin(&self, conn: &mut Conn, name: &str) -> Result<Value, StreamError> {
        check_name(name)?;
        if let Some(p) = conn.pending.take() {
            self.abort_pending(conn, p);
        }
        // The first publish of a stream this agent has no version of continues the job's numbering.
        if let Some((remote, _)) = self.remote.get() {
            let fresh = !matches!(self.lock().streams.get(name), Some(s) if s.latest > 0);
            if fresh && self.numbered.lock().unwrap_or_else(|p| p.into_inner()).insert(name.to_string()) {
                if let Some(v) = follow::announced_latest(remote, name) {
                    let mut st = self.lock();
                    let s = st.streams.entry(name.to_string()).or_default();
                    s.latest = s.latest.max(v);
                }
            }
        }
        let (id, base) = {
            let mut st = self.lock();
            st.next_id += 1;
            let id = st.next_id;
            let base = st.streams.get_mut(name).and_then(|s| {
                let latest = s.latest;
                s.versions.get_mut(&latest).map(|k| {
                    k.leases += 1;
                    (latest, k.manifest.clone())
                })
            });
            (id, base)
        };
        if let Some((v, _)) = &base {
            *conn.leases.entry((name.to_string(), *v)).or_default() += 1;
        }
        let tmp = self.dir.join("tmp").join(id.to_string());
        conn.pending = Some(Pending { id, name: name.to_string(), base: base.as_ref().map(|b| b.0) });
        std::fs::create_dir(&tmp).map_err(io_err("cannot create", &tmp))?;
        Ok(json!({
            "publish": id,
            "dir": tmp,
            "blobs": self.dir.join("blobs"),
            "base": base.map(|(v, m)| json!({"version": v, "manifest": m})),
        }))
    }

    fn abort_pending(&self, conn: &mut Conn, p: Pending) {
        let _ = std::fs::remove_dir_all(self.dir.join("tmp").join(p.id.to_string()));
        if let Some(v) = p.base {
            self.release(conn, &p.name, v);
        }
    }

    fn commit(&self, conn: &mut Conn, publish: u64) -> Result<Value, StreamError> {
        let p = match conn.pending.take() {
            Some(p) if p.id == publish => p,
            other => {
                conn.pending = other;
                return Err(StreamError::NotHeld(format!(
                    "publish {publish} is not in progress on this connection; begin a publish first"
                )));
            }
        };
        let result = self.install(p.id, &p.name, None, 0, false);
        self.abort_pending(conn, p);
        result
    }

    /// Makes the version placed in directory `id` visible as `name`'s next version (or as `version`, for
    /// one pulled from another node, `pulled` of its bytes having crossed the network), and notifies the
    /// subscribers not yet told of it or a newer one (`leased`: one more lease, for a `fetch`).
    fn install(
        &self,
        id: u64,
        name: &str,
        version: Option<u64>,
        pulled: u64,
        leased: bool,
    ) -> Result<Value, StreamError> {
        let version_given = version;
        let tmp = self.dir.join("tmp").join(id.to_string());
        let bad = |detail: String| StreamError::BadPublish { publish: id, name: name.to_string(), detail };
        let text = std::fs::read(tmp.join("manifest.json")).map_err(|e| bad(format!("no manifest ({e})")))?;
        let mut m: Manifest = serde_json::from_slice(&text).map_err(|e| bad(format!("manifest: {e}")))?;
        let mut st = self.lock();
        // Every tensor is either held already or was placed by this publish, whole.
        let mut new: Vec<(&str, u64)> = Vec::new();
        for t in &m.tensors {
            if !check_hash(&t.hash) {
                return Err(bad(format!("tensor {:?} has no blake3 hex hash", t.name)));
            }
            if st.blobs.contains_key(&t.hash) || new.iter().any(|(h, _)| *h == t.hash) {
                continue;
            }
            let placed = tmp.join(&t.hash);
            match std::fs::metadata(&placed) {
                Ok(md) if md.len() == t.nbytes => new.push((&t.hash, t.nbytes)),
                Ok(md) => {
                    return Err(bad(format!(
                        "tensor {:?} was placed with {} bytes, not {}",
                        t.name,
                        md.len(),
                        t.nbytes
                    )))
                }
                Err(_) => return Err(bad(format!("tensor {:?} ({}) was neither placed nor held", t.name, t.hash))),
            }
        }
        for (h, _) in &new {
            let to = self.blob(h);
            std::fs::rename(tmp.join(h), &to).map_err(io_err("cannot place", &to))?;
            st.blobs.insert(h.to_string(), 0);
        }
        let new_bytes = new.iter().map(|(_, n)| n).sum();
        for t in &m.tensors {
            *st.blobs.get_mut(&t.hash).expect("placed or held") += 1;
        }
        let stream = st.streams.entry(name.to_string()).or_default();
        // A pulled version may be older than the latest (a `fetch` of one relayed earlier), never held twice.
        let version = match version {
            Some(v) if stream.versions.contains_key(&v) => return Err(bad(format!("version {v} is held already"))),
            Some(v) => v,
            None => stream.latest + 1,
        };
        m.name = name.to_string();
        m.version = version;
        m.created = now();
        let vdir = self.dir.join("versions").join(name);
        std::fs::create_dir_all(&vdir).map_err(io_err("cannot create", &vdir))?;
        let manifest = vdir.join(format!("{version}.json"));
        let part = vdir.join(format!("{version}.json.part"));
        let body = serde_json::to_vec(&m).map_err(|e| bad(e.to_string()))?;
        std::fs::write(&part, body)
            .and_then(|()| std::fs::rename(&part, &manifest))
            .map_err(io_err("cannot write", &manifest))?;
        let nbytes = m.tensors.iter().map(|t| t.nbytes).sum();
        let notice = json!({
            "event": "version",
            "name": name,
            "version": version,
            "manifest": manifest,
            "step": m.step,
            "nbytes": nbytes,
            "new_bytes": new_bytes,
            "tensors": m.tensors.len(),
            "created": m.created,
            "held": true,
        });
        let text = Arc::new(notice.to_string());
        let mut kept = Kept {
            manifest,
            hashes: m.tensors.iter().map(|t| t.hash.clone()).collect(),
            nbytes,
            new_bytes,
            tensors: m.tensors.len(),
            step: m.step,
            created: m.created,
            leases: usize::from(leased),
        };
        stream.latest = stream.latest.max(version);
        if version_given.is_some() {
            stream.pulled += 1;
        }
        stream.published += 1;
        stream.pulled_bytes += pulled;
        remember_commit(stream, version, m.created);
        // Each subscriber is leased the version with its notice, under the lock: it cannot be dropped
        // before the subscriber has seen it.
        let queued = Notice { name: name.to_string(), version, held: true, json: text };
        stream.subscribers.retain(|_, c| match c.tell(&queued) {
            Told::Sent => {
                kept.leases += 1;
                true
            }
            Told::Skipped => true,
            Told::Gone => false,
        });
        stream.versions.insert(version, kept);
        self.evict(&mut st, name);
        drop(st);
        if let (None, Some((remote, tx))) = (version_given, self.remote.get()) {
            let _ = tx.send((
                name.to_string(),
                json!({"name": name, "version": version, "agent": remote.me, "nbytes": nbytes}),
            ));
        }
        Ok(json!({"version": version, "nbytes": nbytes, "new_bytes": new_bytes, "manifest": notice["manifest"]}))
    }

    /// Drops the versions of `name` beyond the last `keep` that nobody leases, and the files only they held.
    fn evict(&self, st: &mut State, name: &str) {
        let Some(stream) = st.streams.get_mut(name) else { return };
        let newest: Vec<u64> = stream.versions.keys().rev().take(self.keep).copied().collect();
        let doomed: Vec<u64> =
            stream.versions.iter().filter(|(v, k)| k.leases == 0 && !newest.contains(v)).map(|(v, _)| *v).collect();
        let mut freed = Vec::new();
        for v in doomed {
            if let Some(k) = stream.versions.remove(&v) {
                let _ = std::fs::remove_file(&k.manifest);
                freed.extend(k.hashes);
            }
        }
        for h in freed {
            if let Some(n) = st.blobs.get_mut(&h) {
                *n -= 1;
                if *n == 0 {
                    st.blobs.remove(&h);
                    self.discard(self.blob(&h));
                }
            }
        }
    }

    /// Takes a tensor file out of `blobs/` now (the same content may be placed again at once) and has the
    /// reaper free its memory.
    fn discard(&self, blob: PathBuf) {
        let n = self.trashed.fetch_add(1, Ordering::Relaxed);
        let trash = self.dir.join("trash").join(n.to_string());
        match std::fs::rename(&blob, &trash) {
            Ok(()) => {
                if let Err(e) = self.reaper.send(trash) {
                    let _ = std::fs::remove_file(e.0);
                }
            }
            Err(_) => {
                let _ = std::fs::remove_file(blob);
            }
        }
    }

    fn release(&self, conn: &mut Conn, name: &str, version: u64) -> bool {
        let key = (name.to_string(), version);
        match conn.leases.get_mut(&key) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                conn.leases.remove(&key);
            }
            None => return false,
        }
        let mut st = self.lock();
        if let Some(k) = st.streams.get_mut(name).and_then(|s| s.versions.get_mut(&version)) {
            k.leases = k.leases.saturating_sub(1);
        }
        self.evict(&mut st, name);
        true
    }

    fn subscribe(&self, conn: &mut Conn, name: &str, after: u64, who: Subscribing) -> Result<Value, StreamError> {
        check_name(name)?;
        if conn.subscription.is_some() {
            return Err(StreamError::NotHeld("this connection already subscribes; open one per stream".into()));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let mut st = self.lock();
        st.next_id += 1;
        let id = st.next_id;
        let stream = st.streams.entry(name.to_string()).or_default();
        let latest = stream.latest;
        let mut consumer = Consumer {
            tx,
            notices_only: who.notices_only,
            pid: who.pid,
            label: who.label.map(|l| l.chars().take(200).collect()),
            noticed: after,
            serving: None,
        };
        // The newest version known here, held or (to a notices-only subscriber) relayed.
        let relayed = stream.relayed_notice.clone().filter(|_| who.notices_only && stream.relayed > latest);
        if let Some(json) = relayed {
            consumer.tell(&Notice { name: name.to_string(), version: stream.relayed, held: false, json });
        } else if let Some(k) = stream.versions.get_mut(&latest) {
            let json = Arc::new(held_notice(name, latest, k).to_string());
            if let Told::Sent = consumer.tell(&Notice { name: name.to_string(), version: latest, held: true, json }) {
                k.leases += 1;
            }
        }
        stream.subscribers.insert(id, consumer);
        conn.subscription = Some((name.to_string(), id, rx));
        Ok(json!({"subscribed": name, "latest": latest, "blobs": self.dir.join("blobs"), "features": FEATURES}))
    }

    /// Records the version the subscriber of this connection serves from now on.
    fn serving(&self, conn: &Conn, version: u64) {
        let Some((name, id, _)) = &conn.subscription else { return };
        if let Some(c) = self.lock().streams.get_mut(name).and_then(|s| s.subscribers.get_mut(id)) {
            c.serving = Some((version, now()));
        }
    }

    /// Tells this node's notices-only subscribers of `name` of the version `m` describes, which the agent at
    /// `agent` holds: its manifest is kept under `notices/`, none of its tensors is pulled.
    fn relay(&self, name: &str, m: &Manifest, agent: &str) -> Result<(), StreamError> {
        let dir = self.dir.join("notices").join(name);
        std::fs::create_dir_all(&dir).map_err(io_err("cannot create", &dir))?;
        let path = dir.join(format!("{}.json", m.version));
        let part = dir.join(format!("{}.json.part", m.version));
        let body = serde_json::to_vec(m).map_err(|e| StreamError::BadRequest(e.to_string()))?;
        std::fs::write(&part, body)
            .and_then(|()| std::fs::rename(&part, &path))
            .map_err(io_err("cannot write", &path))?;
        let nbytes: u64 = m.tensors.iter().map(|t| t.nbytes).sum();
        let notice = json!({
            "event": "version", "name": name, "version": m.version, "manifest": path, "step": m.step,
            "nbytes": nbytes, "new_bytes": 0, "tensors": m.tensors.len(), "created": m.created,
            "held": false, "agent": agent,
        });
        let json = Arc::new(notice.to_string());
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

    /// The notice of version `version` of `name` if it is held here, leased to `conn`.
    fn lease_held(&self, conn: &mut Conn, name: &str, version: u64) -> Option<Value> {
        let mut st = self.lock();
        let k = st.streams.get_mut(name)?.versions.get_mut(&version)?;
        k.leases += 1;
        *conn.leases.entry((name.to_string(), version)).or_default() += 1;
        Some(held_notice(name, version, k))
    }

    /// The notice of version `version` of `name`, leased to `conn`: held here already, or pulled now from
    /// the agent that announced it (a version relayed to notices-only subscribers).
    async fn fetch(self: &Arc<Self>, conn: &mut Conn, name: &str, version: u64) -> Result<Value, StreamError> {
        check_name(name)?;
        if let Some(v) = self.lease_held(conn, name, version) {
            return Ok(v);
        }
        let from = self.lock().streams.get(name).and_then(|s| s.relayed_from.get(&version).cloned());
        let (Some(agent), Some((remote, _))) = (from, self.remote.get()) else {
            return Err(StreamError::Gone { name: name.to_string(), version, keep: self.keep });
        };
        match follow::pull(self, remote, &agent, name, version, true).await {
            Ok(_) => {
                // Installed with the lease this connection now holds.
                *conn.leases.entry((name.to_string(), version)).or_default() += 1;
                let st = self.lock();
                let k = st.streams.get(name).and_then(|s| s.versions.get(&version));
                k.map(|k| held_notice(name, version, k)).ok_or(StreamError::Gone {
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

    fn list(&self) -> Value {
        let at = now();
        let st = self.lock();
        let mut names: Vec<&String> = st.streams.keys().collect();
        names.sort();
        let streams: Vec<Value> = names
            .into_iter()
            .map(|n| {
                let s = &st.streams[n];
                let versions: Vec<Value> = s
                    .versions
                    .iter()
                    .map(|(v, k)| {
                        json!({"version": v, "nbytes": k.nbytes, "new_bytes": k.new_bytes, "tensors": k.tensors,
                               "step": k.step, "created": k.created, "leases": k.leases})
                    })
                    .collect();
                let newest = s.latest.max(s.relayed);
                let mut ids: Vec<&u64> = s.subscribers.keys().collect();
                ids.sort();
                let consumers: Vec<Value> =
                    ids.into_iter().map(|id| s.subscribers[id].report(*id, newest, &s.committed, at)).collect();
                json!({"name": n, "latest": s.latest, "newest": newest, "published": s.published,
                       "subscribers": s.subscribers.len(), "consumers": consumers, "versions": versions,
                       "pulled": s.pulled, "pulled_bytes": s.pulled_bytes, "relayed": s.relays,
                       "errors": s.errors, "last_error": s.last_error})
            })
            .collect();
        let held: u64 = st.blobs.keys().filter_map(|h| std::fs::metadata(self.blob(h)).ok()).map(|m| m.len()).sum();
        json!({"dir": self.dir, "keep": self.keep, "held_bytes": held, "tensor_files": st.blobs.len(), "streams": streams,
               "served_bytes": self.served_bytes.load(Ordering::Relaxed),
               "redis": self.remote.get().map(|(r, _)| r.redis.clone())})
    }

    /// Ends everything a connection held: its publish, its subscription (and the notices queued for it,
    /// each a lease), its leases.
    fn close(&self, conn: &mut Conn) {
        if let Some(p) = conn.pending.take() {
            self.abort_pending(conn, p);
        }
        if let Some((name, id, mut rx)) = conn.subscription.take() {
            if let Some(s) = self.lock().streams.get_mut(&name) {
                s.subscribers.remove(&id);
            }
            rx.close();
            while let Ok(n) = rx.try_recv() {
                if n.held {
                    *conn.leases.entry((n.name, n.version)).or_default() += 1;
                }
            }
        }
        let leases: Vec<((String, u64), usize)> = conn.leases.drain().collect();
        let mut st = self.lock();
        let mut names = Vec::new();
        for ((name, v), n) in leases {
            if let Some(k) = st.streams.get_mut(&name).and_then(|s| s.versions.get_mut(&v)) {
                k.leases = k.leases.saturating_sub(n);
            }
            names.push(name);
        }
        for name in names {
            self.evict(&mut st, &name);
        }
    }
}

/// What one stream connection holds.
#[derive(Default)]
struct Conn {
    leases: HashMap<(String, u64), usize>,
    pending: Option<Pending>,
    subscription: Option<(String, u64, mpsc::UnboundedReceiver<Notice>)>,
}

/// Ends a connection's holdings however its task ends (a closed socket, an error, the agent stopping).
struct Holdings {
    streams: Arc<Streams>,
    conn: Conn,
}

impl Drop for Holdings {
    fn drop(&mut self) {
        self.streams.close(&mut self.conn);
    }
}

/// Runs blocking work that is quick (a commit: a few renames and a small write on /dev/shm, the files of
/// dropped versions being freed by the reaper) on this worker, which the runtime replaces meanwhile. The
/// blocking pool would cost a thread wake-up each way: on a VM, most of a commit's latency.
fn quick_blocking<R>(f: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    if Handle::try_current().is_ok_and(|h| h.runtime_flavor() == RuntimeFlavor::MultiThread) {
        tokio::task::block_in_place(f)
    } else {
        f()
    }
}

async fn next_notice(sub: &mut Option<(String, u64, mpsc::UnboundedReceiver<Notice>)>) -> Option<Notice> {
    match sub {
        Some((_, _, rx)) => rx.recv().await,
        None => std::future::pending().await,
    }
}

async fn send<S: AsyncWrite + Unpin>(stream: &mut S, json: String, deadline: Duration) -> bool {
    matches!(
        tokio::time::timeout(deadline, protocol::write_frame(stream, &Frame::StreamEvent { json })).await,
        Ok(Ok(()))
    )
}

/// What a stream connection does next.
enum Next {
    Frame(io::Result<Option<Frame>>),
    Notice(Option<Notice>),
    Stop,
}

async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await.map(|_| ());
}

/// Serves a stream connection from its first stream request until it closes (or the agent stops). A
/// subscriber that does not take a notice within `deadline` is disconnected (its leases end).
pub async fn serve<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    first: String,
    streams: Arc<Streams>,
    mut stop: watch::Receiver<bool>,
    deadline: Duration,
) {
    // Frames are read by a loop of their own: a read cut short by a notice would lose its bytes. It never
    // stops reading (its queue is unbounded): a subscriber blocked sending releases while the agent waits
    // for it to take a notice would be a deadlock.
    let (mut rd, mut wr) = tokio::io::split(stream);
    let (tx, mut rx) = mpsc::unbounded_channel::<io::Result<Option<Frame>>>();
    let reader = async move {
        loop {
            let r = protocol::read_frame(&mut rd).await;
            let end = !matches!(r, Ok(Some(_)));
            if tx.send(r).is_err() || end {
                break;
            }
        }
        std::future::pending::<()>().await
    };
    let main = async {
        let mut h = Holdings { streams: streams.clone(), conn: Conn::default() };
        let mut next = Some(first);
        loop {
            let json = match next.take() {
                Some(j) => j,
                None => {
                    let event = tokio::select! {
                        r = rx.recv() => Next::Frame(r.unwrap_or(Ok(None))),
                        n = next_notice(&mut h.conn.subscription) => Next::Notice(n),
                        _ = stopped(&mut stop) => Next::Stop,
                    };
                    match event {
                        Next::Frame(Ok(Some(Frame::StreamRequest { json }))) => json,
                        Next::Frame(Ok(Some(Frame::Ping { nonce }))) => {
                            let pong = Frame::Pong { nonce };
                            let _ = tokio::time::timeout(deadline, protocol::write_frame(&mut wr, &pong)).await;
                            continue;
                        }
                        Next::Frame(Ok(Some(other))) => {
                            let message = format!("a stream connection takes stream requests, not {other:?}");
                            let error = Frame::Error { code: ErrorCode::BadRequest, message };
                            let _ = tokio::time::timeout(deadline, protocol::write_frame(&mut wr, &error)).await;
                            return;
                        }
                        Next::Frame(_) | Next::Stop => return,
                        Next::Notice(None) => return,
                        Next::Notice(Some(n)) => {
                            if n.held {
                                *h.conn.leases.entry((n.name.clone(), n.version)).or_default() += 1;
                            }
                            if !send(&mut wr, n.json.as_ref().clone(), deadline).await {
                                log::warn!(
                                    "a subscriber of {} took no notice within {deadline:?}: disconnected",
                                    n.name
                                );
                                return;
                            }
                            continue;
                        }
                    }
                }
            };
            let request: Request = match serde_json::from_str(&json) {
                Ok(r) => r,
                Err(e) => {
                    let message = StreamError::BadRequest(e.to_string()).to_string();
                    let _ =
                        protocol::write_frame(&mut wr, &Frame::Error { code: ErrorCode::BadRequest, message }).await;
                    continue;
                }
            };
            let answer = match request {
                Request::Begin { name } if streams.remote.get().is_none() => streams.begin(&mut h.conn, &name),
                Request::Begin { name } => {
                    // May ask Redis (under its deadline) for the stream's numbering: off the runtime.
                    let s = streams.clone();
                    let mut conn = std::mem::take(&mut h.conn);
                    let (r, c) = tokio::task::spawn_blocking(move || {
                        let r = s.begin(&mut conn, &name);
                        (r, conn)
                    })
                    .await
                    .unwrap_or_else(|e| (Err(StreamError::NotHeld(format!("the begin failed: {e}"))), Conn::default()));
                    h.conn = c;
                    r
                }
                Request::Commit { publish } => quick_blocking(|| streams.commit(&mut h.conn, publish)),
                Request::Abort { publish } => match h.conn.pending.take() {
                    Some(p) if p.id == publish => {
                        streams.abort_pending(&mut h.conn, p);
                        Ok(json!({"aborted": publish}))
                    }
                    other => {
                        h.conn.pending = other;
                        Err(StreamError::NotHeld(format!("publish {publish} is not in progress on this connection")))
                    }
                },
                Request::Subscribe { name, after, notices_only, pid, label } => {
                    let who = Subscribing { notices_only, pid, label };
                    let r = streams.subscribe(&mut h.conn, &name, after, who);
                    if r.is_ok() {
                        if let Some(listening) = streams.follow(&name) {
                            // Redis unreachable costs this subscriber half a deadline (the other half is
                            // the answer's); the follower keeps retrying meanwhile.
                            let _ = tokio::time::timeout(deadline / 2, listening).await;
                        }
                    }
                    r
                }
                Request::Release { name, version } => {
                    streams.release(&mut h.conn, &name, version);
                    continue;
                }
                Request::Serving { version } => {
                    streams.serving(&h.conn, version);
                    continue;
                }
                // Each frame to the other agent has its deadline; the asker waits with its own.
                Request::Fetch { name, version } => streams.fetch(&mut h.conn, &name, version).await,
                Request::List => Ok(streams.list()),
            };
            let frame = match answer {
                Ok(v) => Frame::StreamEvent { json: v.to_string() },
                Err(e) => {
                    let code =
                        if matches!(e, StreamError::Io { .. }) { ErrorCode::Failed } else { ErrorCode::BadRequest };
                    Frame::Error { code, message: e.to_string() }
                }
            };
            if !matches!(tokio::time::timeout(deadline, protocol::write_frame(&mut wr, &frame)).await, Ok(Ok(()))) {
                return;
            }
        }
    };
    tokio::select! {
        _ = main => {}
        _ = reader => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn publish(s: &Streams, conn: &mut Conn, name: &str, tensors: &[(&str, &[u8])]) -> u64 {
        let begun = s.begin(conn, name).unwrap();
        let dir = PathBuf::from(begun["dir"].as_str().unwrap());
        let mut entries = Vec::new();
        for (n, bytes) in tensors {
            let h = tierstore_core::hash::hex(&tierstore_core::hash::hash(bytes));
            if !s.blob(&h).exists() {
                std::fs::write(dir.join(&h), bytes).unwrap();
            }
            entries
                .push(json!({"name": n, "dtype": "uint8", "shape": [bytes.len()], "hash": h, "nbytes": bytes.len()}));
        }
        std::fs::write(dir.join("manifest.json"), json!({"tensors": entries}).to_string()).unwrap();
        let id = begun["publish"].as_u64().unwrap();
        s.commit(conn, id).unwrap()["version"].as_u64().unwrap()
    }

    #[test]
    fn versions_beyond_keep_are_freed_once_no_lease_holds_them() {
        let dir = tempfile::tempdir().unwrap();
        let s =
            Streams::open(&StreamOptions { dir: Some(dir.path().join("s")), keep: 1, redis: None }, Path::new("/x"))
                .unwrap();
        let mut publisher = Conn::default();
        let mut consumer = Conn::default();
        s.subscribe(&mut consumer, "m", 0, Subscribing::default()).unwrap();
        assert_eq!(publish(&s, &mut publisher, "m", &[("a", b"one"), ("b", b"same")]), 1);
        // The consumer takes its notice: a lease on version 1.
        let n = consumer.subscription.as_mut().unwrap().2.try_recv().unwrap();
        *consumer.leases.entry((n.name, n.version)).or_default() += 1;
        assert_eq!(publish(&s, &mut publisher, "m", &[("a", b"two"), ("b", b"same")]), 2);
        let blobs = || std::fs::read_dir(dir.path().join("s/blobs")).unwrap().count();
        assert_eq!(blobs(), 3, "version 1 is leased: one, two and same are held");
        assert!(s.release(&mut consumer, "m", 1));
        assert_eq!(blobs(), 2, "version 1 freed, its unchanged tensor kept for version 2");
        // The notice of version 2 still queued is a lease too; closing the connection ends it.
        s.close(&mut consumer);
        assert_eq!(publish(&s, &mut publisher, "m", &[("a", b"three"), ("b", b"same")]), 3);
        assert_eq!(blobs(), 2);
        assert_eq!(s.list()["streams"][0]["versions"].as_array().unwrap().len(), 1);
        // The files dropped ("one", then "two") are unlinked by the reaper, after the commit returned.
        let trash = || std::fs::read_dir(dir.path().join("s/trash")).unwrap().count();
        let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while trash() > 0 && std::time::Instant::now() < end {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(trash(), 0, "the reaper freed the dropped files");
    }

    #[test]
    fn a_publish_whose_connection_ends_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let s =
            Streams::open(&StreamOptions { dir: Some(dir.path().join("s")), keep: 2, redis: None }, Path::new("/x"))
                .unwrap();
        let mut c = Conn::default();
        let begun = s.begin(&mut c, "m").unwrap();
        let tmp = PathBuf::from(begun["dir"].as_str().unwrap());
        std::fs::write(tmp.join("0".repeat(64)), b"partial").unwrap();
        s.close(&mut c);
        assert!(!tmp.exists());
        assert_eq!(s.list()["streams"].as_array().unwrap().len(), 0);
        let mut c = Conn::default();
        let begun = s.begin(&mut c, "m").unwrap();
        let id = begun["publish"].as_u64().unwrap();
        let missing =
            json!({"tensors": [{"name": "w", "dtype": "uint8", "shape": [1], "hash": "ab".repeat(32), "nbytes": 1}]});
        std::fs::write(PathBuf::from(begun["dir"].as_str().unwrap()).join("manifest.json"), missing.to_string())
            .unwrap();
        let e = s.commit(&mut c, id).unwrap_err().to_string();
        assert!(e.contains("neither placed nor held") && e.contains("publish the version again"), "{e}");
        assert!(matches!(s.begin(&mut c, "../x"), Err(StreamError::BadName(_))));
    }
}
