//! The cache engine: the read path (lookup, single flight, fetch, publish), prefetch, counters and faults.
//!
//! The read path in order: resolve the path under the source; `stat` the source (its identity decides
//! whether a copy is current); look the key up tier by tier and open a valid copy (a hit); otherwise join
//! the in-process flight of the key, take the node-wide fetch lock, look again (another process may have
//! just published), reserve room by policy, and read the source once. Small files are read whole and
//! handed to every waiter at once while the copy pool writes them into the tier; large files are copied
//! by the pool while readers follow the copy. Any cache fault falls back to the source.
//!
//! This file is the cache's face: [`Cache`] and every public method, each documented here. The work is
//! done by components, one concept per file, each owning its state and calling only those below it:
//!
//! - `engine.rs`: the read path from top to bottom, and the state of the process that opened the cache;
//! - `peers.rs`: the peers step (a miss asked of the owner's agent, through `link.rs`);
//! - `fetch.rs`: the fetch step (a miss fetched under the node's lock, placed, copied and published), with
//!   `flight.rs`, `lock.rs` and `pool.rs` (single flight in a process and on a node, and the copy pool);
//! - `storage.rs`: the source, the tiers (`lookup.rs`) and the settings, which every step stands on;
//! - above the read path: `serve.rs` (this node's agent serving its peers), `sibling.rs` (a peer served
//!   from another process's copy), `parts.rs` (parts of a file through its owner), `prefetch.rs` and
//!   `order.rs` (warming the cache), `confirm.rs` (bounded staleness);
//! - beside it: `trusted.rs` (the metadata a trusted source replays) and `stats.rs` (the counters).

mod blocks;
mod confirm;
mod copy_stats;
mod engine;
mod faults;
mod fetch;
mod flight;
mod job;
mod link;
mod lock;
mod lookup;
mod order;
mod order_files;
mod parts;
mod peers;
mod pool;
mod prefetch;
mod serve;
mod serve_parts;
mod sibling;
mod stats;
mod storage;
mod sweep;
mod trusted;

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::config::{Config, TierConfig, Verify};
use crate::counters::{source as src_slot, tier as tier_slot, Counters};
use crate::error::Error;
use crate::hash::Hash;
use crate::index::key_of;
use crate::reader::Reader;
use crate::source::{PosixSource, Source};
use crate::tier::Tier;
use engine::Inner;
use faults::Faults;
use fetch::Fetcher;
use link::PeerLink;
use lock::FetchLocks;
use lookup::Lookup;
use peers::Peers;
use pool::Pool;
use storage::Storage;

pub use blocks::BLOCK as PART_BLOCK;
pub use copy_stats::descriptor_ended;
pub use engine::Native;
pub use order::{OrderProgress, OrderedPrefetch, ReadLog};
pub use order_files::OrderFiles;
pub use parts::Parts;
pub use prefetch::{PrefetchProgress, DEFAULT_JOBS as DEFAULT_PREFETCH_JOBS, MAX_JOBS as MAX_PREFETCH_JOBS};
pub use serve::Served;
pub use serve_parts::PartsServed;
pub use stats::{SourceStats, Stats, TierStats};
pub use trusted::Trusted;

/// Process-wide registry of opened tiers and lock files. LMDB must not open one environment twice in a
/// process, and closing any descriptor of the lock file would drop the process's fetch locks, so every
/// cache of a process that names the same directory shares one handle. After `fork()` the registry is
/// abandoned (leaked, never closed) and the child opens its own.
struct Registry {
    pid: u32,
    tiers: HashMap<PathBuf, Weak<Tier>>,
    locks: HashMap<PathBuf, Weak<FetchLocks>>,
}

fn registry() -> std::sync::MutexGuard<'static, Registry> {
    static REG: OnceLock<Mutex<Registry>> = OnceLock::new();
    let m = REG.get_or_init(|| {
        Mutex::new(Registry { pid: crate::process::pid(), tiers: HashMap::new(), locks: HashMap::new() })
    });
    let mut g = m.lock().unwrap_or_else(|p| p.into_inner());
    if g.pid != crate::process::pid() {
        let old = std::mem::replace(
            &mut *g,
            Registry { pid: crate::process::pid(), tiers: HashMap::new(), locks: HashMap::new() },
        );
        std::mem::forget(old);
    }
    g
}

impl Registry {
    /// This process's handle of tier `t` of `config`'s source, opened (and its leftover temporaries
    /// swept) the first time.
    fn tier(&mut self, t: &TierConfig, config: &Config) -> Result<Arc<Tier>, Error> {
        let existing = self.tiers.get(&t.path).and_then(Weak::upgrade);
        if let Some(tier) = existing.filter(|tier| tier.root == crate::tier::namespace_dir(&t.path, &config.source)) {
            return Ok(tier);
        }
        let tier = Arc::new(Tier::open(t, &config.source, config.policy).map_err(|e| Error::io(&t.path, e))?);
        tier.sweep_temps();
        self.tiers.insert(t.path.clone(), Arc::downgrade(&tier));
        Ok(tier)
    }

    /// This process's handle of the fetch lock file at `path`.
    fn locks(&mut self, path: PathBuf) -> Result<Arc<FetchLocks>, Error> {
        if let Some(l) = self.locks.get(&path).and_then(Weak::upgrade) {
            return Ok(l);
        }
        let l = Arc::new(FetchLocks::open(&path).map_err(|e| Error::io(&path, e))?);
        self.locks.insert(path, Arc::downgrade(&l));
        Ok(l)
    }
}

/// A tiered, node-local cache of one source directory.
pub struct Cache {
    /// The read path and its components.
    inner: Arc<Inner>,
    /// The source, the tiers and the settings (the engine's own, held here for what needs no more).
    storage: Arc<Storage>,
    pool: Arc<Pool>,
}

// Every call that may touch the source or the tiers first exempts its thread from a shim loaded in the same
// process (`interposer`): the engine's file calls must reach the file system, not the shim's cache.
impl Cache {
    /// Opens the cache described by `config`: creates tier directories, opens indexes (an index that
    /// cannot be opened leaves its tier out and is reported, reads go on), maps counters.
    pub fn new(config: Config) -> Result<Cache, Error> {
        Cache::open_with(config, true)
    }

    /// The cache a node's agent serves its peers from: the same tiers and source, read without asking
    /// any peer (a request from a peer is never forwarded to a third node).
    pub fn serving(config: Config) -> Result<Cache, Error> {
        Cache::open_with(config, false)
    }

    fn open_with(config: Config, ask_peers: bool) -> Result<Cache, Error> {
        let _exempt = crate::interposer::calls();
        let record_checksums =
            config.verify == Verify::Checksum || config.cluster.sharing != crate::cluster::Sharing::Off;
        // The engine's own files live in the first tier's directory for this source, which opening the
        // tier makes or checks (private: see `private.rs`); it is not checked a second time here.
        let (tiers, locks, state_dir) = {
            let mut reg = registry();
            let tiers = config.tiers.iter().map(|t| reg.tier(t, &config)).collect::<Result<Vec<_>, _>>()?;
            let state_dir = tiers[0].root.clone();
            (tiers, reg.locks(state_dir.join("fetch.lock"))?, state_dir)
        };
        let source_counters =
            Counters::open(&state_dir.join("source-counters")).map_err(|e| Error::io(&state_dir, e))?;
        let source = open_source(&config, Arc::new(source_counters))?;
        let pool = Arc::new(Pool::new(config.threads));
        let faults = Arc::new(Faults::new(source.counters().clone()));
        let link = PeerLink::open(&config, ask_peers, source.counters().clone(), faults.clone())?;
        let blocks = if ask_peers { blocks::Blocks::new(0) } else { blocks::Blocks::from_env() };
        let lookup = Lookup::new(tiers, config.policy, config.verify, faults.clone());
        let storage = Arc::new(Storage::new(config, source, lookup, faults));
        let fetcher = Arc::new(Fetcher::new(storage.clone(), locks, record_checksums));
        fetcher.set_pool(&pool);
        let peers = link.map(|link| Arc::new(Peers::new(storage.clone(), fetcher.clone(), link)));
        let inner = Arc::new(Inner::new(storage.clone(), fetcher, peers, blocks));
        for (i, t) in storage.lookup().tiers().iter().enumerate() {
            if let Err(e) = &t.index {
                t.counters.add(tier_slot::FAULTS, 1);
                storage.log_once(&format!("index{i}"), &format!("index of tier {} cannot be opened ({e}); the tier is skipped and reads go to the source. `tierstore clear` rebuilds it", t.config.path.display()));
            }
        }
        Ok(Cache { inner, storage, pool })
    }

    /// The effective configuration.
    pub fn config(&self) -> &Config {
        self.storage.config()
    }

    /// Opens `path` (a file under the source) for reading through the cache.
    pub fn open(&self, path: &Path) -> Result<Reader, Error> {
        let _exempt = crate::interposer::calls();
        self.inner.open_rel(&self.storage.source().relative(path)?)
    }

    /// Opens `path` as a real file descriptor holding exactly its bytes: the tier copy (fetched whole
    /// first on a miss, under the same single-flight rules), or the source itself when no tier has room.
    /// This is what the LD_PRELOAD shim hands to unmodified programs, so that read, pread, mmap and fstat
    /// need no further interception.
    pub fn open_file(&self, path: &Path) -> Result<File, Error> {
        let _exempt = crate::interposer::calls();
        match self.inner.open_native_rel(&self.storage.source().relative(path)?, false)? {
            // A mark that the file is read from the store ends here: the caller closes the descriptor
            // where the cache cannot see it (stdio's `fclose` under the shim, a raw descriptor in Python).
            Native::Whole(f) | Native::FromStore { file: f, .. } => Ok(f),
            Native::Copying { .. } => unreachable!("only open_native streams"),
        }
    }

    /// Like [`Cache::open_file`], except that a miss on a file larger than `inline_max` does not wait for
    /// the whole copy: it returns a descriptor of the source at once and copies the file in the
    /// background, so the program's first byte costs what it costs without the cache. The source is read
    /// once: by the copy, whose reader the caller can follow.
    pub fn open_native(&self, path: &Path) -> Result<Native, Error> {
        let _exempt = crate::interposer::calls();
        self.inner.open_native_rel(&self.storage.source().relative(path)?, true)
    }

    /// The copy [`Cache::open_native`] would open for the source-relative path `rel`
    /// ([`Cache::source_relative`]) when the first tier holds a current one, found without asking the store
    /// or a peer; `None` (nothing counted) otherwise, for `open_native` to take the whole way. The shim tries
    /// it first, so that a warm open skips the checks only a miss needs, and keeps the `rel` of each name
    /// it opens.
    pub fn open_native_cached_rel(&self, rel: &str) -> Result<Option<Native>, Error> {
        let _exempt = crate::interposer::calls();
        self.inner.open_native_hit(rel)
    }

    /// `path` relative to the source, as the cache names it; an error for a path outside the source.
    pub fn source_relative(&self, path: &Path) -> Result<String, Error> {
        Ok(self.storage.source().relative(path)?)
    }

    /// What the LD_PRELOAD shim answers from the cache without asking the store: `stat`s, links,
    /// `realpath`, `statfs`, listings, extended attributes, shadow directories and the `fstat` of a copy
    /// (see [`Trusted`]).
    pub fn trusted(&self) -> Trusted<'_> {
        Trusted::of(&self.storage)
    }

    /// The source directory (symlinks resolved).
    pub fn source_root(&self) -> &Path {
        self.storage.source().root()
    }

    /// Forgets every cached copy of `path` (it is being written, renamed or removed through the source).
    pub fn invalidate(&self, path: &Path) -> Result<(), Error> {
        let _exempt = crate::interposer::calls();
        let rel = self.storage.source().relative(path)?;
        let key = key_of(&rel);
        if let Some(ix) = self.storage.lookup().directories() {
            let _ = ix.forget_path(&key);
            // A name appeared, went or changed in its directory; a directory itself may have gone.
            let parent = rel.rsplit_once('/').map_or("", |(dir, _)| dir);
            let _ = ix.forget_listing(&key_of(parent));
            let _ = ix.forget_listing(&key);
        }
        let _guard = self.inner.fetcher().lock(&key).map_err(|e| self.storage.error(&rel, e))?;
        self.inner.fetcher().remove_entries(&key);
        Ok(())
    }

    /// The path of a current cached copy of `path`, if a tier holds one. With `validate`, the source is
    /// `stat`ed and a copy of an older version does not count; without it, this is the index lookup alone.
    pub fn lookup(&self, path: &Path, validate: bool) -> Result<Option<PathBuf>, Error> {
        let _exempt = crate::interposer::calls();
        let rel = self.storage.source().relative(path)?;
        let key = key_of(&rel);
        let sid = if validate {
            let known = self.inner.known_identity(&key, &rel)?;
            match known {
                Some(sid) => Some(sid),
                None => return Ok(None), // trusted, and no tier holds it
            }
        } else {
            None
        };
        Ok(self.storage.lookup().copy_path(&key, &rel, sid.as_ref()))
    }

    /// The blake3 this cache recorded when it made the tier copy that `file` is, the published copy of
    /// `path`, if it recorded one and the copy was made (its inode last changed) at `since_ns` (ns since
    /// the epoch) or later; `None` otherwise.
    ///
    /// A copy is hashed as it is made where the cache records checksums (`verify = "checksum"`, or a
    /// cluster, whose peers are sent only vouched bytes): from the store's bytes as they are written, or
    /// checked against the owner's chaining values as they arrive. So for a copy made during the caller's
    /// own load, the hash vouches for the bytes the caller reads, and a model load whose pack's hash (in
    /// its manifest) equals it need not hash each tensor again. A copy made earlier may have been damaged
    /// in its tier since; its reader hashes what it reads.
    pub fn hash_of_new_copy(&self, path: &Path, file: &File, since_ns: u64) -> Result<Option<Hash>, Error> {
        let _exempt = crate::interposer::calls();
        let rel = self.storage.source().relative(path)?;
        Ok(self.storage.lookup().hash_of_new_copy(&key_of(&rel), &rel, file, since_ns))
    }

    /// Whether this cache hashes the copies it makes (see [`Cache::hash_of_new_copy`]): a reader that
    /// follows a copy being made then learns its hash when the copy ends ([`Reader::hash_of_arriving_copy`]).
    pub fn hashes_copies(&self) -> bool {
        self.inner.fetcher().records_checksums()
    }

    /// Warms the cache with `paths` (files, or directories walked recursively), fetching
    /// [`DEFAULT_PREFETCH_JOBS`] files at a time. Returns at once; watch the progress, or
    /// [`Cache::wait_idle`].
    pub fn prefetch(&self, paths: &[PathBuf]) -> Result<Arc<PrefetchProgress>, Error> {
        self.prefetch_with(paths, DEFAULT_PREFETCH_JOBS)
    }

    /// Like [`Cache::prefetch`], with up to `jobs` files (and directory listings) in flight at once
    /// (1 to [`MAX_PREFETCH_JOBS`]; out of range is brought into it). The paths named are checked here: one
    /// that is missing or outside the source is an error before anything starts.
    pub fn prefetch_with(&self, paths: &[PathBuf], jobs: usize) -> Result<Arc<PrefetchProgress>, Error> {
        let _exempt = crate::interposer::calls();
        let walk = Arc::new(prefetch::Walk::new(self.inner.clone()));
        for p in paths {
            // A relative path is relative to the current directory on a file system, to the prefix on
            // an object store.
            let named = if self.storage.posix().is_some() { normalize_abs(p) } else { p.clone() };
            let rel = self.storage.source().relative_or_root(&named)?;
            let full = self.storage.source().path_of(&rel);
            let Some(posix) = self.storage.posix() else {
                // An object store has no directories: a prefix names every object under it.
                walk.add_listing(rel);
                continue;
            };
            let m = posix.stat_path(&full).map_err(|e| Error::io(&full, e))?;
            if m.is_dir() {
                posix.counters().add(src_slot::OPENS, 1);
                let dir = crate::source::open_dir(&full).map_err(|e| Error::io(&full, e))?;
                walk.add_dir(dir, rel);
            } else {
                walk.add_file(rel);
            }
        }
        let progress = walk.progress();
        walk.start(jobs)?;
        Ok(progress)
    }

    /// Like [`Cache::prefetch_with`] for paths the caller knows to be files: each is fetched as the file
    /// (on an object store, the object) of that name, with no `stat` or listing first. On an object store
    /// `prefetch_with` lists a name as a prefix, one `LIST` more per name; a read-ahead that names the
    /// shards it wants asks for each with its `GET` alone. A name that is missing or a directory is counted
    /// as failed or skipped in the progress, not an error here. With an `expected` size, room for it is
    /// held before each file is opened, and a file no tier has that room for is left unopened
    /// (`files_no_room`): a read-ahead's open never finds the room gone and leaves its reader a second.
    pub fn prefetch_files(
        &self,
        paths: &[PathBuf],
        jobs: usize,
        expected: Option<u64>,
    ) -> Result<Arc<PrefetchProgress>, Error> {
        let _exempt = crate::interposer::calls();
        let walk = Arc::new(prefetch::Walk::new(self.inner.clone()).expecting(expected));
        for p in paths {
            let named = if self.storage.posix().is_some() { normalize_abs(p) } else { p.clone() };
            walk.add_file(self.storage.source().relative(&named)?);
        }
        let progress = walk.progress();
        walk.start(jobs)?;
        Ok(progress)
    }

    /// Whether a tier has room for `size` more bytes now (free room, or an evicting policy whose quota
    /// holds it); nothing is reserved.
    pub fn has_room(&self, size: u64) -> bool {
        self.inner.fetcher().has_room(size)
    }

    /// Lets go of the cached copy of `path` for room (the read-ahead's: a shard its reader has passed),
    /// unless a fetch of it is under way; returns the bytes freed (0: no copy, or a fetch held it). A
    /// reader with the copy open keeps reading it; a later open fetches the file again.
    pub fn let_go(&self, path: &Path) -> Result<u64, Error> {
        let _exempt = crate::interposer::calls();
        let rel = self.storage.source().relative(path)?;
        Ok(self.inner.fetcher().let_go(&key_of(&rel), &rel))
    }

    /// Every file under `path` (a directory of the source, an object store prefix, or the source itself),
    /// by its full name, sorted. One listing per directory (POSIX) or per thousand keys (an object store).
    pub fn list_files(&self, path: &Path) -> Result<Vec<PathBuf>, Error> {
        let _exempt = crate::interposer::calls();
        let src = &self.storage.source();
        let mut out = Vec::new();
        let mut dirs = vec![src.relative_or_root(path)?];
        while let Some(dir) = dirs.pop() {
            let join = |name: &std::ffi::OsStr| {
                if dir.is_empty() {
                    name.to_string_lossy().into_owned()
                } else {
                    format!("{dir}/{}", name.to_string_lossy())
                }
            };
            for e in src.list(&dir).map_err(|e| Error::io(&src.path_of(&dir), e))? {
                let rel = join(&e.name);
                let is_dir = match e.is_dir {
                    Some(d) => d,
                    None => src.path_of(&rel).is_dir(),
                };
                if is_dir {
                    dirs.push(rel);
                } else {
                    out.push(src.path_of(&rel));
                }
            }
        }
        out.sort();
        Ok(out)
    }

    /// Fetches `paths` (files under the source, in the order they will be read) ahead of their readers,
    /// `jobs` at a time, keeping at most `budget` bytes fetched but not yet read (see `cache/order.rs`).
    /// Reads are learnt from `log`; without one, a new marks file gets a slot per distinct path, and
    /// readers record through the handle or that file. Every path is checked here: one outside the source
    /// is an error before anything starts. Returns at once; not counted by [`Cache::wait_idle`], since it
    /// waits on readers.
    pub fn prefetch_order(
        &self,
        paths: &[PathBuf],
        budget: u64,
        jobs: usize,
        log: Option<ReadLog>,
    ) -> Result<OrderedPrefetch, Error> {
        let _exempt = crate::interposer::calls();
        let rels = paths.iter().map(|p| self.storage.source().relative(p)).collect::<Result<Vec<_>, _>>()?;
        // A path the order names twice is one file (one slot of a new read log, one fetch).
        let (order, distinct) = crate::marks::slots_of(&rels);
        let mut unique = vec![String::new(); distinct];
        for (rel, &f) in rels.into_iter().zip(&order) {
            unique[f as usize] = rel;
        }
        self.prefetch_in_order(Arc::new(OrderFiles::new(unique)), order, budget, jobs, log)
    }

    /// The files `paths` (under the source) made ready for ordered prefetches that each draw an order from
    /// them ([`Cache::prefetch_in_order`]): a loader's, made once for all its epochs, so that an epoch
    /// costs no path, hash or index read for the files a last look found cached (see
    /// `cache/order_files.rs`). One outside the source is an error.
    pub fn order_files(&self, paths: &[PathBuf]) -> Result<Arc<OrderFiles>, Error> {
        let _exempt = crate::interposer::calls();
        let rels = paths.iter().map(|p| self.storage.source().relative(p)).collect::<Result<Vec<_>, _>>()?;
        Ok(Arc::new(OrderFiles::new(rels)))
    }

    /// [`Cache::prefetch_order`] of the files of `files` numbered in `order`, in that order.
    pub fn prefetch_in_order(
        &self,
        files: Arc<OrderFiles>,
        order: Vec<u32>,
        budget: u64,
        jobs: usize,
        log: Option<ReadLog>,
    ) -> Result<OrderedPrefetch, Error> {
        let _exempt = crate::interposer::calls();
        if let Some(&f) = order.iter().find(|&&f| f as usize >= files.len()) {
            return Err(Error::Tier {
                path: self.order_dir(),
                message: format!(
                    "the order names file {f} of only {} made ready for it: make the files again with every path the order reads",
                    files.len()
                ),
            });
        }
        let log = match log {
            Some(log) => log,
            None => {
                let (slots, distinct) = crate::marks::slots_of(&order);
                let marks = self.read_marks(distinct)?;
                // Readers that know paths, not positions (the LD_PRELOAD shim), find their slot by name.
                let mut names = vec![""; distinct];
                for (&f, &slot) in order.iter().zip(&slots) {
                    names[slot as usize] = files.rel(f);
                }
                marks.write_names(&names).map_err(|e| Error::io(&marks.names_path(), e))?;
                ReadLog { marks: Arc::new(marks), slots, tag: 1 }
            }
        };
        let tag_ok = log.tag != 0 && log.tag & crate::marks::STARTED == 0;
        if log.slots.len() != order.len() || log.slots.iter().any(|&s| s as usize >= log.marks.len()) || !tag_ok {
            return Err(Error::Tier {
                path: log.marks.path().to_path_buf(),
                message: format!(
                    "read log does not fit the order ({} positions, {} slots, {} marks, tag {}): give one slot per position, each below the number of marks, and a tag from 1 to 2^31 - 1",
                    order.len(),
                    log.slots.len(),
                    log.marks.len(),
                    log.tag
                ),
            });
        }
        OrderedPrefetch::start(self.inner.clone(), files, order, log, budget, jobs)
    }

    /// A new read-marks file of `slots` slots next to the node's cache state, for the readers of an
    /// ordered prefetch in other processes.
    pub fn read_marks(&self, slots: usize) -> Result<crate::marks::ReadMarks, Error> {
        let _exempt = crate::interposer::calls();
        let dir = self.order_dir();
        crate::marks::ReadMarks::create_in(&dir, slots).map_err(|e| Error::io(&dir, e))
    }

    /// The directory of the ordered prefetches' read-marks files (and of what the Python side keeps beside
    /// them: each loader's learned order and progress, which `tierstore status` shows). Private to the
    /// user once a marks file was made in it; it may not exist yet.
    pub fn order_dir(&self) -> PathBuf {
        crate::tier::namespace_dir(&self.storage.config().tiers[0].path, &self.storage.config().source).join("order")
    }

    /// Blocks until every prefetch has finished and every queued copy is published (and access
    /// statistics are written).
    pub fn wait_idle(&self) {
        if self.inner.pid_matches() {
            // A forked child inherits the count but not the threads: it has no prefetch to wait for.
            self.inner.wait_prefetches();
        }
        self.pool.wait_idle();
        self.storage.lookup().flush_access();
    }

    /// Copies queued or running in the pool.
    pub fn pending_copies(&self) -> usize {
        self.pool.pending()
    }

    /// A snapshot of all counters.
    pub fn stats(&self) -> Stats {
        self.storage.stats()
    }

    /// Sets every counter of this cache (node-wide) back to zero.
    pub fn reset_counters(&self) {
        self.storage.reset_counters()
    }

    /// Removes every cached copy and index entry of this source from every tier. Readers that have a
    /// copy open keep reading it (the file is unlinked, not truncated).
    pub fn clear(&self) -> Result<(), Error> {
        let _exempt = crate::interposer::calls();
        self.pool.wait_idle();
        for t in self.storage.lookup().tiers() {
            if let Ok(ix) = &t.index {
                ix.clear().map_err(|e| Error::Tier { path: t.config.path.clone(), message: e.to_string() })?;
            }
            // Empty `data/` but keep it: every process of the node holds a descriptor of it.
            let data = t.root.join("data");
            for sub in std::fs::read_dir(&data).map_err(|e| Error::io(&data, e))?.flatten() {
                std::fs::remove_dir_all(sub.path()).map_err(|e| Error::io(&sub.path(), e))?;
            }
        }
        Ok(())
    }

    /// Asks the agent of the node that owns `path` (this node's own when it owns it) for `ranges` of it,
    /// `(offset, length)` each. `Ok(None)` when the cache shares nothing across nodes, no member is up,
    /// or the owner could not be asked (counted as a peer fault, and said once): read the store instead.
    pub fn open_parts(&self, path: &Path, ranges: &[(u64, u64)]) -> Result<Option<Parts>, Error> {
        let _exempt = crate::interposer::calls();
        let Some(peers) = self.inner.peers() else { return Ok(None) };
        let rel = self.storage.source().relative(path)?;
        Ok(peers.ask_parts(&rel, ranges))
    }

    /// Opens `rel` for parts a peer asked for: the copy a tier holds whole when there is a current one,
    /// else the store's file, read by the blocks this agent keeps ([`PartsServed::read`]). No whole copy is
    /// fetched for parts. On a POSIX source the path is resolved beneath the source, as for a whole file
    /// (see `peers.rs`): the copy is served only when its version is vouched for, and the store's file is
    /// the descriptor opened beneath it; a path that leaves the source is refused.
    pub fn open_parts_for_peer(&self, rel: &str) -> Result<PartsServed, Error> {
        let _exempt = crate::interposer::calls();
        PartsServed::open(&self.inner, rel)
    }

    /// Opens `rel` for a peer that asked this node's agent for it: fetched from the source first if no tier
    /// holds it (once per node, as for any reader of this node). The agent's own cache reads only local
    /// tiers and the source, never another peer, so requests cannot chase each other around the job.
    /// With `follow`, a large file is served while its copy is still being made ([`Served::copy`]).
    ///
    /// With `follow` the asker reads the bytes: its request counts in this node's tiers as an open of this
    /// node's does, one hit, or one miss when the file is fetched from the store for it. Without, it only
    /// asks this node to hold the file (a partitioned prefetch), which counts no hit or miss, as a
    /// prefetch does not.
    pub fn open_for_peer(&self, rel: &str, follow: bool) -> Result<Served, Error> {
        let _exempt = crate::interposer::calls();
        self.inner.open_for_peer(rel, follow)
    }

    /// Counts a file served to a peer.
    pub fn count_served(&self, bytes: u64) {
        self.inner.count_served(bytes)
    }

    /// Forgets this node's copy of `rel`, which was found damaged while it was served.
    pub fn drop_damaged(&self, rel: &str) {
        let _exempt = crate::interposer::calls();
        self.inner.drop_damaged(rel)
    }

    /// Checks this node's copy of `rel` against the blake3 recorded when it was made, because a peer found
    /// that the bytes it was sent do not match it; a damaged copy is removed (and the fault logged).
    /// Returns whether it was. A copy with no recorded blake3, or none at all, is left as it is.
    pub fn check_served(&self, rel: &str) -> Result<bool, Error> {
        let _exempt = crate::interposer::calls();
        self.inner.check_served(rel)
    }
}

impl Drop for Cache {
    fn drop(&mut self) {
        if self.inner.pid_matches() {
            self.pool.wait_idle();
            self.storage.lookup().flush_access();
        }
    }
}

fn normalize_abs(p: &Path) -> PathBuf {
    if p.is_absolute() {
        crate::source::normalize(p)
    } else {
        crate::source::normalize(&std::env::current_dir().unwrap_or_default().join(p))
    }
}

/// The source a configuration names: an object store (`s3://`, `gs://`, `az://`, `http(s)://`), or a
/// directory.
fn open_source(config: &Config, counters: Arc<Counters>) -> Result<Arc<dyn Source>, Error> {
    match &config.object_store {
        None => Ok(Arc::new(PosixSource::new(&config.source, config.source_alias.as_deref(), counters))),
        #[cfg(feature = "object-store")]
        Some(store) => Ok(Arc::new(
            crate::source::ObjectSource::new(store.clone(), counters).map_err(|e| Error::io(&config.source, e))?,
        )),
        #[cfg(not(feature = "object-store"))]
        Some(store) => Err(Error::io(
            &config.source,
            std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                format!(
                    "this build of tierstore cannot read {} (built without the object-store feature); use the \
                     Python package",
                    store.url
                ),
            ),
        )),
    }
}

impl crate::models::load::PartsSource for Cache {
    fn open_parts(
        &self,
        path: &Path,
        ranges: &[(u64, u64)],
    ) -> Result<Option<Box<dyn crate::models::load::ReceivedParts>>, Error> {
        Ok(Cache::open_parts(self, path, ranges)?.map(|p| Box::new(p) as Box<dyn crate::models::load::ReceivedParts>))
    }
}
