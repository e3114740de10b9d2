//! Model streaming in the agent (docs/design/architecture.md, "Model streaming"; Viper's memory-first path): the
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
//! listed with their lag (see `consumers.rs`).
//!
//! This file is the version store: the streams' state under one lock, publishing, leases, eviction and
//! subscriptions, kept together (some 720 lines and their tests) because each of them changes that state
//! under that lock. Beside it: the manifest's schema (`manifest.rs`), the request loop of a stream
//! connection (`requests.rs`), the consumers as the agent sees them (`consumers.rs`), and the streams
//! across nodes: announcing, following, relaying and pulling versions (`follow.rs`). The request loop
//! and the follower work on the store's own state, so they import it from here; nothing else imports
//! back up.

mod consumers;
mod directory;
mod follow;
mod peers;
mod report;
mod requests;
mod spares;

pub use directory::default_dir;
use directory::{default_or_fresh, own_dir, reaper, remove_dead_siblings, still_in, LIVE, SUBDIRS};

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;
use tokio::sync::mpsc;

use consumers::{Consumer, Notice, Told, COMMITS_KEPT};
use peers::Announcement;
use tierstore_core::models::manifest::check_hash;

pub use crate::options::StreamOptions;
pub use follow::{serve_peer, Remote};
pub use requests::{serve, Request};
pub use tierstore_core::models::manifest::{Manifest, Tensor};
use tierstore_core::models::requests::{Base, Begun, Committed, Subscribed, VersionNotice};

/// What this agent's stream requests offer beyond those of the first version of the protocol, answered to
/// every `subscribe`: a client uses an option only where its agent lists it (an older agent ignores
/// `notices_only` and pulls, and would refuse `serving` and `fetch`).
pub const FEATURES: &[&str] = &["notices_only", "serving", "fetch"];

/// Relayed manifests kept per stream: a subscriber reads one as its notice arrives.
const RELAYED_KEPT: usize = 16;

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

/// The tensors of `m` that its publish placed in `tmp` (hash and bytes, each hash once), after checking
/// that every tensor is either held already (`st.blobs`) or was placed there whole; else what is wrong.
fn placed_tensors<'m>(st: &State, m: &'m Manifest, tmp: &Path) -> Result<Vec<(&'m str, u64)>, String> {
    let mut new: Vec<(&str, u64)> = Vec::new();
    for t in &m.tensors {
        if !check_hash(&t.hash) {
            return Err(format!("tensor {:?} has no blake3 hex hash", t.name));
        }
        if st.blobs.contains_key(&t.hash) || new.iter().any(|(h, _)| *h == t.hash) {
            continue;
        }
        match std::fs::metadata(tmp.join(&t.hash)) {
            Ok(md) if md.len() == t.nbytes => new.push((&t.hash, t.nbytes)),
            Ok(md) => return Err(format!("tensor {:?} was placed with {} bytes, not {}", t.name, md.len(), t.nbytes)),
            Err(_) => return Err(format!("tensor {:?} ({}) was neither placed nor held", t.name, t.hash)),
        }
    }
    Ok(new)
}

/// Queues `notice` of a version held here to `stream`'s subscribers not told of it or a newer one, and
/// forgets those gone. Each is leased the version with its notice, under the state's lock, so that it
/// cannot be dropped before the subscriber has seen it: returns how many leases were taken.
fn tell_subscribers(stream: &mut Stream, notice: Notice) -> usize {
    let mut leases = 0;
    stream.subscribers.retain(|_, c| match c.tell(&notice) {
        Told::Sent => {
            leases += 1;
            true
        }
        Told::Skipped => true,
        Told::Gone => false,
    });
    leases
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> StreamError {
    let path = path.display().to_string();
    move |source| StreamError::Io { what, path, source }
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

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs_f64()
}

/// The notice of a version held here.
fn held_notice(name: &str, version: u64, k: &Kept) -> VersionNotice {
    VersionNotice {
        name: name.to_string(),
        version,
        manifest: k.manifest.clone(),
        step: k.step,
        nbytes: k.nbytes,
        new_bytes: k.new_bytes,
        tensors: k.tensors,
        created: k.created,
        held: true,
        agent: None,
    }
}

/// An answer (`Begun`, `Committed`, a notice, ...) as the JSON value a request is answered with.
pub(super) fn answer(typed: impl serde::Serialize) -> Value {
    serde_json::to_value(typed).expect("an answer is JSON")
}

/// A notice as the JSON a connection sends.
fn notice_json(notice: &VersionNotice) -> Arc<String> {
    Arc::new(serde_json::to_string(notice).expect("a notice is JSON"))
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

/// A version held here; as the `list` report shows it, less its manifest's path and its tensors' hashes.
#[derive(serde::Serialize)]
struct Kept {
    #[serde(skip)]
    manifest: PathBuf,
    #[serde(skip)]
    hashes: Vec<String>,
    nbytes: u64,
    /// Bytes this version added to what the versions before it held.
    new_bytes: u64,
    tensors: usize,
    step: Option<i64>,
    /// When it was committed (seconds since the epoch).
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
    /// The directory's `LIVE` file, locked while this agent lives.
    _live: std::fs::File,
    keep: usize,
    state: Mutex<State>,
    /// Where versions go to and come from other nodes, and the announcer's queue.
    remote: OnceLock<(Remote, std::sync::mpsc::Sender<(String, Announcement)>)>,
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
    /// The sizes each publish wrote new, to the thread that allocates spares of them for the next one
    /// (`spares.rs`); none when `[stream] spares` is off.
    spares: Option<spares::Keeper>,
}

impl Streams {
    /// Opens the stream directory, emptied: versions live only as long as the agent that numbered them.
    pub fn open(options: &StreamOptions, socket: &Path) -> Result<Streams, StreamError> {
        let (dir, live) = Self::claim(options, socket)?;
        for sub in SUBDIRS {
            let d = dir.join(sub);
            if d.exists() {
                std::fs::remove_dir_all(&d).map_err(io_err("cannot empty the stream directory", &d))?;
            }
        }
        for sub in SUBDIRS {
            let d = dir.join(sub);
            std::fs::create_dir_all(&d).map_err(io_err("cannot create", &d))?;
        }
        if options.dir.is_none() {
            remove_dead_siblings(&dir);
        }
        Ok(Streams {
            _live: live,
            keep: options.keep.max(1),
            state: Mutex::new(State::default()),
            remote: OnceLock::new(),
            followed: Mutex::new(HashSet::new()),
            numbered: Mutex::new(HashSet::new()),
            served_bytes: AtomicU64::new(0),
            reaper: reaper(),
            trashed: AtomicU64::new(0),
            spares: options.spares.then(|| spares::Keeper::start(dir.join("spares"))),
            dir,
        })
    }

    /// The stream directory and its `LIVE` file, locked by this agent: held while it lives, so that another
    /// agent's sweep (`remove_dead_siblings`) knows the directory is in use. That sweep may lock and remove
    /// the directory between the file's open here and this agent's lock (a fresh directory, or the
    /// default one after a restart); the lock is then on a file no longer in it, and the directory is
    /// claimed again.
    fn claim(options: &StreamOptions, socket: &Path) -> Result<(PathBuf, std::fs::File), StreamError> {
        let mut tries = 0;
        loop {
            let (dir, live) = match &options.dir {
                Some(dir) => (dir.clone(), own_dir(dir).map_err(io_err("cannot create the stream directory", dir))?),
                None => default_or_fresh(&default_dir(socket))?,
            };
            // An agent of this socket that was just stopped may still be exiting: it is given a few seconds.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            // SAFETY: flock on a descriptor we own.
            while unsafe { libc::flock(live.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                if std::time::Instant::now() > deadline {
                    let e = io::Error::other("another agent uses it; give each agent its own --stream-dir");
                    return Err(io_err("cannot use the stream directory", &dir)(e));
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            tries += 1;
            if still_in(&dir, &live) {
                return Ok((dir, live));
            }
            if tries == 4 {
                let e = io::Error::other("another agent removed it four times while this one started");
                return Err(io_err("cannot use the stream directory", &dir)(e));
            }
        }
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

    /// The stream directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Frees the shared memory of every version (an agent that stops): consumers keep the tensors they
    /// mapped or copied; nothing new can be opened.
    pub fn remove(&self) {
        if let Some(spares) = &self.spares {
            spares.close();
        }
        for sub in SUBDIRS {
            let _ = std::fs::remove_dir_all(self.dir.join(sub));
        }
        // Still locked (the descriptor lives on): no other agent's sweep takes the directory meanwhile.
        let _ = std::fs::remove_file(self.dir.join(LIVE));
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
        let base = base.map(|(version, manifest)| Base { version, manifest });
        let spares = self.spares.as_ref().map(|k| k.dir().to_path_buf());
        Ok(answer(Begun { publish: id, dir: tmp, blobs: self.dir.join("blobs"), base, spares }))
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
        let new = placed_tensors(&st, &m, &tmp).map_err(bad)?;
        // A publish of this node's wrote these sizes; the next one most likely writes them again.
        let sizes: Vec<u64> = if version_given.is_none() { new.iter().map(|(_, n)| *n).collect() } else { Vec::new() };
        let new_bytes = self.hold_blobs(&mut st, &m, &tmp, &new)?;
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
        let manifest = self.write_manifest(id, &m)?;
        let nbytes = m.tensors.iter().map(|t| t.nbytes).sum();
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
        let notice = held_notice(name, version, &kept);
        stream.latest = stream.latest.max(version);
        if version_given.is_some() {
            stream.pulled += 1;
        }
        stream.published += 1;
        stream.pulled_bytes += pulled;
        remember_commit(stream, version, m.created);
        kept.leases += tell_subscribers(
            stream,
            Notice { name: name.to_string(), version, held: true, json: notice_json(&notice) },
        );
        stream.versions.insert(version, kept);
        self.evict(&mut st, name);
        drop(st);
        if version_given.is_none() {
            if let Some(spares) = &self.spares {
                spares.publish_wrote(sizes);
            }
            self.announce(name, version, nbytes);
        }
        Ok(answer(Committed { version, nbytes, new_bytes, manifest: notice.manifest }))
    }

    /// Moves the tensors a publish placed in `tmp` (`new`, from [`placed_tensors`]) among the blobs, and
    /// counts one more holder of every tensor of `m`; the bytes that were new.
    fn hold_blobs(&self, st: &mut State, m: &Manifest, tmp: &Path, new: &[(&str, u64)]) -> Result<u64, StreamError> {
        for (h, _) in new {
            let to = self.blob(h);
            std::fs::rename(tmp.join(h), &to).map_err(io_err("cannot place", &to))?;
            st.blobs.insert(h.to_string(), 0);
        }
        for t in &m.tensors {
            *st.blobs.get_mut(&t.hash).expect("placed or held") += 1;
        }
        Ok(new.iter().map(|(_, n)| n).sum())
    }

    /// Tells the other nodes (through the job's Redis, where streams cross nodes) of a version published here.
    fn announce(&self, name: &str, version: u64, nbytes: u64) {
        if let Some((remote, tx)) = self.remote.get() {
            let announcement =
                Announcement { name: name.to_string(), version, agent: remote.me.clone(), nbytes, mac: None };
            let _ = tx.send((name.to_string(), announcement));
        }
    }

    /// Writes `m`, a version of its stream, as `versions/NAME/VERSION.json` (beside it first, then renamed
    /// in, so that a reader sees a manifest whole or not at all).
    fn write_manifest(&self, publish: u64, m: &Manifest) -> Result<PathBuf, StreamError> {
        let vdir = self.dir.join("versions").join(&m.name);
        std::fs::create_dir_all(&vdir).map_err(io_err("cannot create", &vdir))?;
        let manifest = vdir.join(format!("{}.json", m.version));
        let part = vdir.join(format!("{}.json.part", m.version));
        let body = serde_json::to_vec(m).map_err(|e| StreamError::BadPublish {
            publish,
            name: m.name.clone(),
            detail: e.to_string(),
        })?;
        std::fs::write(&part, body)
            .and_then(|()| std::fs::rename(&part, &manifest))
            .map_err(io_err("cannot write", &manifest))?;
        Ok(manifest)
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
            let json = notice_json(&held_notice(name, latest, k));
            if let Told::Sent = consumer.tell(&Notice { name: name.to_string(), version: latest, held: true, json }) {
                k.leases += 1;
            }
        }
        stream.subscribers.insert(id, consumer);
        conn.subscription = Some((name.to_string(), id, rx));
        let features = FEATURES.iter().map(|f| f.to_string()).collect();
        Ok(answer(Subscribed { subscribed: name.to_string(), latest, blobs: self.dir.join("blobs"), features }))
    }

    /// Records the version the subscriber of this connection serves from now on.
    fn serving(&self, conn: &Conn, version: u64) {
        let Some((name, id, _)) = &conn.subscription else { return };
        if let Some(c) = self.lock().streams.get_mut(name).and_then(|s| s.subscribers.get_mut(id)) {
            c.serving = Some((version, now()));
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
        let s = Streams::open(
            &StreamOptions { dir: Some(dir.path().join("s")), keep: 1, redis: None, spares: true },
            Path::new("/x"),
        )
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
        // The report's keys of a version, as `tierstore stream list` reads them (no path, no hashes).
        let version = s.list()["streams"][0]["versions"][0].clone();
        let mut keys: Vec<&str> = version.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort();
        assert_eq!(keys, ["created", "leases", "nbytes", "new_bytes", "step", "tensors", "version"]);
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
        let s = Streams::open(
            &StreamOptions { dir: Some(dir.path().join("s")), keep: 2, redis: None, spares: true },
            Path::new("/x"),
        )
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
