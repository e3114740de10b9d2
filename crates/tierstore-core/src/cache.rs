//! The cache engine: the read path (lookup, single flight, fetch, publish), prefetch, counters and faults.
//!
//! The read path in order: resolve the path under the source; `stat` the source (its identity decides
//! whether a copy is current); look the key up tier by tier and open a valid copy (a hit); otherwise join
//! the in-process flight of the key, take the node-wide fetch lock, look again (another process may have
//! just published), reserve room by policy, and read the source once. Small files are read whole and
//! handed to every waiter at once while the copy pool writes them into the tier; large files are copied
//! by the pool while readers follow the copy. Any cache fault falls back to the source.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::config::{Config, Revalidate, Verify};
use crate::counters::{source as src_slot, tier as tier_slot, Counters};
use crate::error::Error;
use crate::flight::{Flight, Flights, Outcome, Role};
use crate::index::{key_of, Entry, Key, Link, Listed, Reservation, SourceId, Usage};
use crate::lock::{lock_shared, try_lock_exclusive, FetchGuard, FetchLocks};
use crate::placement::plan;
use crate::pool::Pool;
use crate::reader::{Backing, Growing, Reader};
use crate::source::{CopyFault, PosixSource, Source, SourceFile};
use crate::tier::Tier;

mod confirm;
mod peers;
pub use peers::Served;
mod order;
pub use order::{OrderProgress, OrderedPrefetch, ReadLog};
mod prefetch;
mod xattrs;
pub use prefetch::{PrefetchProgress, DEFAULT_JOBS as DEFAULT_PREFETCH_JOBS, MAX_JOBS as MAX_PREFETCH_JOBS};

/// A copy file as one version of it: device, inode and change time (seconds, nanoseconds).
type CopyIncarnation = (u64, u64, i64, i64);

/// How many copies' rewritten `stat`s a process remembers before it starts over.
const COPY_STATS_KEPT: usize = 1 << 16;

fn now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

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

/// Counters and usage of one tier, as `tierstore status` shows them.
#[derive(Clone, Debug)]
pub struct TierStats {
    /// The tier's directory as configured.
    pub path: PathBuf,
    /// `"memory"` or `"local"`.
    pub kind: &'static str,
    /// The quota in bytes.
    pub quota: u64,
    /// Opens served from the tier.
    pub hits: u64,
    /// Lookups that did not find a valid copy in the tier.
    pub misses: u64,
    /// Bytes read by jobs from the tier.
    pub bytes_served: u64,
    /// Entries evicted.
    pub evictions: u64,
    /// Cache faults.
    pub faults: u64,
    /// Entries published.
    pub inserts: u64,
    /// Bytes written into the tier.
    pub bytes_written: u64,
    /// Entries, bytes used, fetches in flight.
    pub usage: Usage,
    /// Why the tier is unavailable, if it is.
    pub error: Option<String>,
}

/// Counters of the source.
#[derive(Clone, Copy, Debug, Default)]
pub struct SourceStats {
    /// Files opened on the source.
    pub opens: u64,
    /// `stat` calls.
    pub stats: u64,
    /// `read` calls.
    pub reads: u64,
    /// Bytes read.
    pub bytes_read: u64,
    /// Reads that fell back to the source after a cache fault.
    pub fallbacks: u64,
    /// Opens served from the source because no tier had room.
    pub uncached: u64,
    /// Files received from a peer's agent instead of the source.
    pub peer_hits: u64,
    /// Bytes received from peers.
    pub peer_bytes: u64,
    /// Reads from a peer that failed and went to the source.
    pub peer_faults: u64,
    /// Files this node's agent served to peers.
    pub served_files: u64,
    /// Bytes this node's agent served to peers.
    pub served_bytes: u64,
    /// Listing requests sent to an object store.
    pub lists: u64,
}

/// A snapshot of every counter of a cache.
#[derive(Clone, Debug)]
pub struct Stats {
    /// The source.
    pub source: SourceStats,
    /// Each tier, fastest first.
    pub tiers: Vec<TierStats>,
}

struct Inner {
    config: Config,
    source: Arc<dyn Source>,
    tiers: Vec<Arc<Tier>>,
    locks: Arc<FetchLocks>,
    flights: Flights,
    /// Hits not yet written to the index: (tier, key) -> (hits, last access).
    access: Mutex<HashMap<(usize, Key), (u64, u64)>>,
    last_access_flush: Mutex<Instant>,
    logged: Mutex<HashSet<String>>,
    pool: OnceLock<Weak<Pool>>,
    /// Prefetches whose workers are still running, for [`Cache::wait_idle`].
    prefetches: Mutex<usize>,
    prefetch_idle: Condvar,
    /// The process that opened the cache; a forked child must open its own.
    pid: u32,
    /// The job's other members, when nodes share their caches (not in the agent's own cache).
    remote: Option<crate::cluster::remote::Remote>,
    /// What `copy_stat` found for each copy incarnation this process has seen (see there).
    copy_stats: Mutex<HashMap<CopyIncarnation, libc::stat>>,
    /// Whether copies record their blake3: asked for (`verify = "checksum"`), or needed to vouch for
    /// the bytes served to peers.
    record_checksums: bool,
}

/// A tiered, node-local cache of one source directory.
pub struct Cache {
    inner: Arc<Inner>,
    pool: Arc<Pool>,
}

/// What the fetch under the lock is for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Purpose {
    /// A reader waits for the bytes.
    Read,
    /// Warm the cache; nobody waits.
    Prefetch,
    /// A program wants a real descriptor: a small file is fetched whole first, a large one is copied in
    /// the background while the program holds a descriptor of the source.
    Native,
}

/// A file opened for a program that reads it with system calls (see [`Cache::open_native`]).
pub enum Native {
    /// A descriptor holding exactly the file's bytes: a published copy, or the source when no tier has
    /// room or the cache failed.
    Whole(File),
    /// A large file being copied into a tier: `source` is a descriptor of the source file itself, which
    /// the program may read natively; reads can be served from `copy` as it grows, and the descriptor
    /// moved to the copy once it is [`finished`](crate::reader::CopyState::Finished).
    Copying {
        /// The source file, open read-only.
        source: File,
        /// The copy being written.
        copy: Arc<Growing>,
    },
}

/// What a fetch under the lock produced.
enum Fetched {
    Reader(Reader),
    /// A large file whose copy has started: a descriptor of the source for the program, and the copy.
    Streaming(File, Arc<Growing>),
    Cached,
    Uncached,
    /// A prefetch found no tier with room.
    NoRoom,
    /// Already cached, or being fetched by another thread or process.
    Skipped,
}

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
        let remote = match (ask_peers, config.cluster.sharing) {
            (false, _) | (_, crate::cluster::Sharing::Off) => None,
            _ => {
                let token = match &config.cluster.token_file {
                    Some(f) => Some(crate::cluster::read_token(f).map_err(|problem| Error::Tier {
                        path: f.clone(),
                        message: format!("[cluster] token_file: {problem}; {}", crate::cluster::TOKEN_FIX),
                    })?),
                    None => None,
                };
                Some(crate::cluster::remote::Remote::new(&config.cluster, &config.source.to_string_lossy(), token))
            }
        };
        let record_checksums =
            config.verify == Verify::Checksum || config.cluster.sharing != crate::cluster::Sharing::Off;
        let state_dir = config.tiers[0].path.join(crate::tier::namespace(&config.source));
        std::fs::create_dir_all(&state_dir).map_err(|e| Error::io(&state_dir, e))?;
        let source_counters =
            Counters::open(&state_dir.join("source-counters")).map_err(|e| Error::io(&state_dir, e))?;
        let source = open_source(&config, Arc::new(source_counters))?;
        let mut reg = registry();
        let mut tiers = Vec::new();
        for t in &config.tiers {
            let existing = reg.tiers.get(&t.path).and_then(Weak::upgrade);
            let tier = match existing {
                Some(tier)
                    if tier.root.starts_with(&t.path)
                        && tier.root.ends_with(crate::tier::namespace(&config.source)) =>
                {
                    tier
                }
                _ => {
                    let tier =
                        Arc::new(Tier::open(t, &config.source, config.policy).map_err(|e| Error::io(&t.path, e))?);
                    tier.sweep_temps();
                    reg.tiers.insert(t.path.clone(), Arc::downgrade(&tier));
                    tier
                }
            };
            tiers.push(tier);
        }
        let lock_path = state_dir.join("fetch.lock");
        let locks = match reg.locks.get(&lock_path).and_then(Weak::upgrade) {
            Some(l) => l,
            None => {
                let l = Arc::new(FetchLocks::open(&lock_path).map_err(|e| Error::io(&lock_path, e))?);
                reg.locks.insert(lock_path, Arc::downgrade(&l));
                l
            }
        };
        drop(reg);
        let pool = Arc::new(Pool::new(config.threads));
        let inner = Arc::new(Inner {
            config,
            source,
            tiers,
            locks,
            flights: Flights::default(),
            access: Mutex::new(HashMap::new()),
            last_access_flush: Mutex::new(Instant::now()),
            logged: Mutex::new(HashSet::new()),
            pool: OnceLock::new(),
            prefetches: Mutex::new(0),
            prefetch_idle: Condvar::new(),
            pid: crate::process::pid(),
            remote,
            record_checksums,
            copy_stats: Mutex::new(HashMap::new()),
        });
        let _ = inner.pool.set(Arc::downgrade(&pool));
        for (i, t) in inner.tiers.iter().enumerate() {
            if let Err(e) = &t.index {
                t.counters.add(tier_slot::FAULTS, 1);
                inner.log_once(&format!("index{i}"), &format!("index of tier {} cannot be opened ({e}); the tier is skipped and reads go to the source. `tierstore clear` rebuilds it", t.config.path.display()));
            }
        }
        Ok(Cache { inner, pool })
    }

    /// The effective configuration.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// Opens `path` (a file under the source) for reading through the cache.
    pub fn open(&self, path: &Path) -> Result<Reader, Error> {
        let rel = self.followed(path)?;
        self.inner.open_rel(&rel)
    }

    /// Opens `path` as a real file descriptor holding exactly its bytes: the tier copy (fetched whole
    /// first on a miss, under the same single-flight rules), or the source itself when no tier has room.
    /// This is what the LD_PRELOAD shim hands to unmodified programs, so that read, pread, mmap and fstat
    /// need no further interception.
    pub fn open_file(&self, path: &Path) -> Result<File, Error> {
        let rel = self.followed(path)?;
        match self.inner.open_native_rel(&rel, false)? {
            Native::Whole(f) => Ok(f),
            Native::Copying { .. } => unreachable!("only open_native streams"),
        }
    }

    /// Like [`Cache::open_file`], except that a miss on a file larger than `inline_max` does not wait for
    /// the whole copy: it returns a descriptor of the source at once and copies the file in the
    /// background, so the program's first byte costs what it costs without the cache. The source is read
    /// once: by the copy, whose reader the caller can follow.
    pub fn open_native(&self, path: &Path) -> Result<Native, Error> {
        let rel = self.followed(path)?;
        self.inner.open_native_rel(&rel, true)
    }

    /// The source-relative path to open for `path`: the file a recorded symlink leads to when copies are
    /// trusted and it leads into the source (so a file reached by its link and by its own name is one
    /// cached copy, and an open through the link asks the store nothing), else `path`'s own.
    fn followed(&self, path: &Path) -> Result<String, Error> {
        let rel = self.inner.source.relative(path)?;
        if self.inner.config.revalidate == Revalidate::Never {
            if let Some(to) = self.inner.link(&rel).and_then(|l| l.resolved) {
                if let Ok(target) = self.inner.source.relative(Path::new(OsStr::from_bytes(&to))) {
                    return Ok(target);
                }
            }
        }
        Ok(rel)
    }

    /// `stat` of a cached file, of a source directory or of a symlink under the source, as the source gave
    /// it, without asking the source; `None` when the answer must come from the source (not known,
    /// recorded by an older index, or copies are revalidated on every open anyway). With `nofollow`
    /// (`lstat`), only for a path known to name the file itself, with no symlink on the way, or a
    /// recorded symlink; without it, a recorded symlink is answered by what it leads to, when that is
    /// known under the source.
    pub fn cached_stat(&self, path: &Path, nofollow: bool) -> Result<Option<libc::stat>, Error> {
        if self.inner.config.revalidate != Revalidate::Never {
            return Ok(None);
        }
        let rel = self.inner.source.relative_or_root(path)?;
        let known = match self.inner.known_path(&rel, nofollow) {
            Some(sid) => Some(sid),
            None => self.inner.link(&rel).and_then(|link| {
                if nofollow {
                    return Some(link.lstat);
                }
                let to = self.inner.source.relative_or_root(Path::new(OsStr::from_bytes(&link.resolved?))).ok()?;
                self.inner.known_path(&to, false)
            }),
        };
        Ok(known.and_then(|sid| sid.to_stat()))
    }

    /// Takes note of what the source answered to a `stat` (`lstat` with `nofollow`) of `path`, so that
    /// the next one of a directory is answered from the cache (only when the source is trusted). A symlink
    /// met by `lstat` is recorded the first time with its target and where it resolves to (asking the
    /// store those two once), so that `lstat`, `readlink`, `realpath`, `stat` and opens through it are
    /// answered from the cache from then on.
    pub fn note_stat(&self, path: &Path, st: &libc::stat, nofollow: bool) {
        if self.inner.config.revalidate != Revalidate::Never {
            return;
        }
        let Some(ix) = self.inner.directories() else { return };
        let Ok(rel) = self.inner.source.relative_or_root(path) else { return };
        let key = key_of(&rel);
        match st.st_mode & libc::S_IFMT {
            libc::S_IFDIR => {}
            libc::S_IFLNK if nofollow && !rel.is_empty() => {
                let lstat = SourceId::of_stat(st);
                if ix.link(&key, &rel).ok().flatten().is_some_and(|l| l.lstat == lstat) {
                    return;
                }
                let own = self.inner.source.path_of(&rel);
                self.inner.source.counters().add(src_slot::STATS, 2);
                let Ok(target) = std::fs::read_link(&own) else { return };
                let resolved = std::fs::canonicalize(&own).ok().map(|p| p.into_os_string().into_vec());
                let _ =
                    ix.record_link(&key, &rel, &Link { lstat, target: target.into_os_string().into_vec(), resolved });
                return;
            }
            _ => return,
        }
        let before = ix.directory(&key, &rel).ok().flatten();
        let canonical = nofollow || before.is_some_and(|b| b.attrs.is_some_and(|a| a.canonical));
        let mut sid = SourceId::of_stat(st);
        if let Some(a) = sid.attrs.as_mut() {
            a.canonical = canonical;
        }
        if before.is_none_or(|b| b != sid || b.attrs.map(|a| a.canonical) != Some(canonical)) {
            let _ = ix.record_directory(&key, &rel, sid);
        }
    }

    /// What `readlink` of `path` returns, when it is a symlink under a trusted source that was recorded.
    pub fn cached_link(&self, path: &Path) -> Result<Option<Vec<u8>>, Error> {
        if self.inner.config.revalidate != Revalidate::Never {
            return Ok(None);
        }
        let rel = self.inner.source.relative(path)?;
        Ok(self.inner.link(&rel).map(|l| l.target))
    }

    /// The path of a cached file, or of a recorded symlink, with every symlink resolved (`realpath`),
    /// without asking the source; `None` when only the source can tell.
    pub fn cached_real_path(&self, path: &Path) -> Result<Option<PathBuf>, Error> {
        let Some((rel, e)) = self.trusted_entry(path)? else {
            if self.inner.config.revalidate != Revalidate::Never {
                return Ok(None);
            }
            let rel = self.inner.source.relative(path)?;
            return Ok(self.inner.link(&rel).and_then(|l| l.resolved).map(|p| PathBuf::from(OsStr::from_bytes(&p))));
        };
        if e.source.attrs.is_some_and(|a| a.canonical) {
            return Ok(Some(self.inner.source.path_of(&rel)));
        }
        Ok(self.inner.link(&rel).and_then(|l| l.resolved).map(|p| PathBuf::from(OsStr::from_bytes(&p))))
    }

    /// What `statfs` said of the source's file system, recorded the first time it was asked, when the
    /// source is trusted (`revalidate = "never"`); `None` otherwise. One record stands for the whole
    /// source, so a file system mounted inside the source would be reported as the source's.
    pub fn cached_statfs(&self) -> Option<libc::statfs64> {
        if self.inner.config.revalidate != Revalidate::Never {
            return None;
        }
        let raw = self.inner.directories()?.statfs().ok()??;
        if raw.len() != std::mem::size_of::<libc::statfs64>() {
            return None;
        }
        // SAFETY: a plain C struct, written by `note_statfs` on this node with the same layout.
        Some(unsafe { std::ptr::read_unaligned(raw.as_ptr() as *const libc::statfs64) })
    }

    /// Takes note of what the source answered to `statfs` (only when the source is trusted).
    pub fn note_statfs(&self, st: &libc::statfs64) {
        if self.inner.config.revalidate != Revalidate::Never {
            return;
        }
        let Some(ix) = self.inner.directories() else { return };
        // SAFETY: the bytes of a plain C struct.
        let raw = unsafe {
            std::slice::from_raw_parts(st as *const libc::statfs64 as *const u8, std::mem::size_of::<libc::statfs64>())
        };
        let _ = ix.record_statfs(raw);
    }

    /// The listing of the source directory `path` as it was recorded, when the source is trusted and
    /// nothing changed it through tierstore since; `None` otherwise.
    pub fn cached_listing(&self, path: &Path) -> Option<Vec<Listed>> {
        if self.inner.config.revalidate != Revalidate::Never {
            return None;
        }
        let rel = self.inner.source.relative_or_root(path).ok()?;
        let (at, entries) = self.inner.directories()?.listing(&key_of(&rel)).ok()??;
        (at == rel).then_some(entries)?
    }

    /// Records what `readdir` listed of the source directory `path` (only when the source is trusted).
    pub fn note_listing(&self, path: &Path, entries: &[Listed]) {
        if self.inner.config.revalidate != Revalidate::Never {
            return;
        }
        let (Some(ix), Ok(rel)) = (self.inner.directories(), self.inner.source.relative_or_root(path)) else {
            return;
        };
        self.inner.source.counters().add(src_slot::STATS, 1);
        let _ = ix.record_listing(&key_of(&rel), &rel, Some(entries));
    }

    /// The empty directory of the first tier that stands for the source directory `path` when the source
    /// is trusted (a descriptor of it is handed out in place of one of the source directory, and
    /// [`Cache::shadowed`] maps it back); `None` otherwise.
    pub fn shadow_dir(&self, path: &Path) -> Option<PathBuf> {
        if self.inner.config.revalidate != Revalidate::Never {
            return None;
        }
        let rel = self.inner.source.relative_or_root(path).ok()?;
        let key = key_of(&rel);
        let tier = self.inner.tiers.iter().find(|t| t.index.is_ok())?;
        let ix = tier.index.as_ref().ok()?;
        if ix.listing(&key).ok()?.is_none_or(|(at, _)| at != rel) {
            ix.record_listing(&key, &rel, None).ok()?;
        }
        tier.shadow_dir(&key).ok()
    }

    /// The source directory that the shadow directory `name` (as /proc names an open descriptor) stands
    /// for, if it is one.
    pub fn shadowed(&self, name: &Path) -> Option<PathBuf> {
        let tier = self.inner.tiers.iter().find(|t| t.index.is_ok())?;
        let key = tier.key_of_shadow(name)?;
        let (rel, _) = tier.index.as_ref().ok()?.listing(&key).ok()??;
        Some(self.inner.source.path_of(&rel))
    }

    /// Whether `path` (the name of an open descriptor) is a copy in one of the tiers.
    pub fn is_copy(&self, path: &Path) -> bool {
        self.inner.tiers.iter().any(|t| t.key_of_copy(path).is_some())
    }

    /// The source directory (symlinks resolved).
    pub fn source_root(&self) -> &Path {
        self.inner.source.root()
    }

    /// The published entry of `path` when copies are trusted (`revalidate = "never"`).
    fn trusted_entry(&self, path: &Path) -> Result<Option<(String, Entry)>, Error> {
        if self.inner.config.revalidate != Revalidate::Never {
            return Ok(None);
        }
        let rel = self.inner.source.relative(path)?;
        let key = key_of(&rel);
        Ok(self.inner.published(&key, &rel).map(|e| (rel, e)))
    }

    /// What `fstat` should say of descriptor `fd`, whose own `fstat` gave `st`: for a tier copy handed out
    /// by this cache, the `stat` of the source file it is a copy of (so `stat` of the path and `fstat` of
    /// the descriptor agree, as programs such as cp and tar check); `None` for any other descriptor. Costs
    /// nothing for files on other devices than the tiers', and one `readlink` in /proc for the rest.
    pub fn copy_stat(&self, fd: i32, st: &libc::stat) -> Option<libc::stat> {
        let tier = self.inner.tiers.iter().find(|t| t.holds_device(st.st_dev))?;
        // A copy is never changed in place: one incarnation (device, inode, ctime) always stands for the
        // same source version, and a removed copy (evicted, invalidated) has no link left. So what was
        // found for it once is remembered in this process: Python's `open` calls `fstat` on every file.
        // (Callers that know less of the descriptor, with no inode or link count, take the long way.)
        let incarnation = (st.st_dev, st.st_ino, st.st_ctime, st.st_ctime_nsec);
        let remembered = st.st_nlink > 0 && st.st_ino != 0;
        if remembered {
            if let Some(known) = self.inner.copy_stats.lock().expect("copy stats lock").get(&incarnation) {
                return (known.st_size == st.st_size).then_some(*known);
            }
        }
        let name = std::fs::read_link(format!("/proc/self/fd/{fd}")).ok()?;
        let key = tier.key_of_copy(&name)?;
        let e = tier.index.as_ref().ok()?.lookup(&key).ok()??;
        if !e.ready || e.source.size != st.st_size as u64 {
            return None;
        }
        let rewritten = e.source.to_stat()?;
        if remembered {
            self.inner.remember_copy(incarnation, rewritten);
        }
        Some(rewritten)
    }

    /// Forgets every cached copy of `path` (it is being written, renamed or removed through the source).
    pub fn invalidate(&self, path: &Path) -> Result<(), Error> {
        let rel = self.inner.source.relative(path)?;
        let key = key_of(&rel);
        if let Some(ix) = self.inner.directories() {
            let _ = ix.forget_path(&key);
            // A name appeared, went or changed in its directory; a directory itself may have gone.
            let parent = rel.rsplit_once('/').map_or("", |(dir, _)| dir);
            let _ = ix.forget_listing(&key_of(parent));
            let _ = ix.forget_listing(&key);
        }
        let _guard = self.inner.locks.lock(&key).map_err(|e| Error::io(&self.inner.source.path_of(&rel), e))?;
        self.inner.remove_entries(&key);
        Ok(())
    }

    /// The path of a current cached copy of `path`, if a tier holds one. With `validate`, the source is
    /// `stat`ed and a copy of an older version does not count; without it, this is the index lookup alone.
    pub fn lookup(&self, path: &Path, validate: bool) -> Result<Option<PathBuf>, Error> {
        let rel = self.inner.source.relative(path)?;
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
        for tier in &self.inner.tiers {
            let Ok(index) = &tier.index else { continue };
            if let Ok(Some(e)) = index.lookup(&key) {
                if e.ready && e.rel == rel && sid.is_none_or(|s| s == e.source) {
                    return Ok(Some(tier.data_path(&key)));
                }
            }
        }
        Ok(None)
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
        let walk = Arc::new(prefetch::Walk::new(self.inner.clone()));
        for p in paths {
            // A relative path is relative to the current directory on a file system, to the prefix on
            // an object store.
            let named = if self.inner.posix().is_some() { normalize_abs(p) } else { p.clone() };
            let rel = self.inner.source.relative_or_root(&named)?;
            let full = self.inner.source.path_of(&rel);
            let Some(posix) = self.inner.posix() else {
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

    /// Every file under `path` (a directory of the source, an object store prefix, or the source itself),
    /// by its full name, sorted. One listing per directory (POSIX) or per thousand keys (an object store).
    pub fn list_files(&self, path: &Path) -> Result<Vec<PathBuf>, Error> {
        let src = &self.inner.source;
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
        let rels = paths.iter().map(|p| self.inner.source.relative(p)).collect::<Result<Vec<_>, _>>()?;
        let log = match log {
            Some(log) => log,
            None => {
                let (slots, distinct) = crate::marks::slots_of(&rels);
                let marks = self.read_marks(distinct)?;
                // Readers that know paths, not positions (the LD_PRELOAD shim), find their slot by name.
                let mut names = vec![""; distinct];
                for (rel, &slot) in rels.iter().zip(&slots) {
                    names[slot as usize] = rel;
                }
                marks.write_names(&names).map_err(|e| Error::io(&marks.names_path(), e))?;
                ReadLog { marks: Arc::new(marks), slots, tag: 1 }
            }
        };
        if log.slots.len() != rels.len() || log.slots.iter().any(|&s| s as usize >= log.marks.len()) || log.tag == 0 {
            return Err(Error::Tier {
                path: log.marks.path().to_path_buf(),
                message: format!(
                    "read log does not fit the order ({} positions, {} slots, {} marks, tag {}): give one slot per position, each below the number of marks, and a tag other than 0",
                    rels.len(),
                    log.slots.len(),
                    log.marks.len(),
                    log.tag
                ),
            });
        }
        OrderedPrefetch::start(self.inner.clone(), rels, log, budget, jobs)
    }

    /// A new read-marks file of `slots` slots next to the node's cache state, for the readers of an
    /// ordered prefetch in other processes.
    pub fn read_marks(&self, slots: usize) -> Result<crate::marks::ReadMarks, Error> {
        let dir = self.inner.config.tiers[0].path.join(crate::tier::namespace(&self.inner.config.source)).join("order");
        crate::marks::ReadMarks::create_in(&dir, slots).map_err(|e| Error::io(&dir, e))
    }

    /// Blocks until every prefetch has finished and every queued copy is published (and access
    /// statistics are written).
    pub fn wait_idle(&self) {
        if self.inner.pid_matches() {
            // A forked child inherits the count but not the threads: it has no prefetch to wait for.
            let mut running = self.inner.prefetches.lock().unwrap_or_else(|p| p.into_inner());
            while *running > 0 {
                running = self.inner.prefetch_idle.wait(running).unwrap_or_else(|p| p.into_inner());
            }
        }
        self.pool.wait_idle();
        self.inner.flush_access();
    }

    /// Copies queued or running in the pool.
    pub fn pending_copies(&self) -> usize {
        self.pool.pending()
    }

    /// A snapshot of all counters.
    pub fn stats(&self) -> Stats {
        let c = self.inner.source.counters();
        let source = SourceStats {
            opens: c.get(src_slot::OPENS),
            stats: c.get(src_slot::STATS),
            reads: c.get(src_slot::READS),
            bytes_read: c.get(src_slot::BYTES_READ),
            fallbacks: c.get(src_slot::FALLBACKS),
            uncached: c.get(src_slot::UNCACHED),
            peer_hits: c.get(src_slot::PEER_HITS),
            peer_bytes: c.get(src_slot::PEER_BYTES),
            peer_faults: c.get(src_slot::PEER_FAULTS),
            served_files: c.get(src_slot::SERVED_FILES),
            served_bytes: c.get(src_slot::SERVED_BYTES),
            lists: c.get(src_slot::LISTS),
        };
        let tiers = self
            .inner
            .tiers
            .iter()
            .map(|t| {
                let (usage, error) = match &t.index {
                    Ok(ix) => match ix.usage() {
                        Ok(u) => (u, None),
                        Err(e) => (Usage::default(), Some(e.to_string())),
                    },
                    Err(e) => (Usage::default(), Some(e.clone())),
                };
                TierStats {
                    path: t.config.path.clone(),
                    kind: t.config.kind.name(),
                    quota: t.config.quota,
                    hits: t.counters.get(tier_slot::HITS),
                    misses: t.counters.get(tier_slot::MISSES),
                    bytes_served: t.counters.get(tier_slot::BYTES_SERVED),
                    evictions: t.counters.get(tier_slot::EVICTIONS),
                    faults: t.counters.get(tier_slot::FAULTS),
                    inserts: t.counters.get(tier_slot::INSERTS),
                    bytes_written: t.counters.get(tier_slot::BYTES_WRITTEN),
                    usage,
                    error,
                }
            })
            .collect();
        Stats { source, tiers }
    }

    /// Sets every counter of this cache (node-wide) back to zero.
    pub fn reset_counters(&self) {
        self.inner.source.counters().reset();
        for t in &self.inner.tiers {
            t.counters.reset();
        }
    }

    /// Removes every cached copy and index entry of this source from every tier. Readers that have a
    /// copy open keep reading it (the file is unlinked, not truncated).
    pub fn clear(&self) -> Result<(), Error> {
        self.pool.wait_idle();
        for t in &self.inner.tiers {
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
}

impl Drop for Cache {
    fn drop(&mut self) {
        if self.inner.pid_matches() {
            self.pool.wait_idle();
            self.inner.flush_access();
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

/// The error of asking a descriptor of a source that has none (an object store).
fn no_descriptor() -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        "an object store has no file descriptors; read it through tierstore.open",
    )
}

/// The source a configuration names: an object store (`s3://`), or a directory.
fn open_source(config: &Config, counters: Arc<Counters>) -> Result<Arc<dyn Source>, Error> {
    match &config.s3 {
        None => Ok(Arc::new(PosixSource::new(&config.source, config.source_alias.as_deref(), counters))),
        #[cfg(feature = "s3")]
        Some(s3) => Ok(Arc::new(
            crate::source::ObjectSource::new(s3.clone(), counters).map_err(|e| Error::io(&config.source, e))?,
        )),
        #[cfg(not(feature = "s3"))]
        Some(s3) => Err(Error::io(
            &config.source,
            io::Error::new(
                io::ErrorKind::Unsupported,
                format!(
                    "this build of tierstore cannot read {} (built without the s3 feature); use the Python package",
                    s3.url
                ),
            ),
        )),
    }
}

/// Sets the copy's modification time to the source's, so that a copy keeps the source's mtime and a
/// write into the copy (which changes its mtime) is detected on the next open.
fn set_mtime(file: &File, mtime_ns: i64) -> io::Result<()> {
    let ts = libc::timespec { tv_sec: mtime_ns.div_euclid(1_000_000_000), tv_nsec: mtime_ns.rem_euclid(1_000_000_000) };
    let times = [ts, ts];
    // SAFETY: futimens on an open descriptor with two valid timespecs.
    if unsafe { libc::futimens(file.as_raw_fd(), times.as_ptr()) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

impl Inner {
    /// The source as a POSIX directory, for what only a file system has (descriptors for programs,
    /// directory walks, symlinks); `None` for an object store.
    fn posix(&self) -> Option<&PosixSource> {
        self.source.posix()
    }

    fn pid_matches(&self) -> bool {
        self.pid == crate::process::pid()
    }

    fn prefetch_started(&self) {
        *self.prefetches.lock().unwrap_or_else(|p| p.into_inner()) += 1;
    }

    fn prefetch_finished(&self) {
        let mut running = self.prefetches.lock().unwrap_or_else(|p| p.into_inner());
        *running = running.saturating_sub(1);
        if *running == 0 {
            self.prefetch_idle.notify_all();
        }
    }

    fn pool(&self) -> Option<Arc<Pool>> {
        self.pool.get().and_then(Weak::upgrade)
    }

    /// Counts a cache fault in `tier` and says so on stderr once per kind and process.
    fn fault(&self, tier: Option<usize>, kind: &str, detail: &str) {
        if let Some(i) = tier {
            self.tiers[i].counters.add(tier_slot::FAULTS, 1);
        }
        self.source.counters().add(src_slot::FALLBACKS, 1);
        self.log_once(kind, &format!("cache fault ({detail}); served from the source. Further faults of this kind are counted, not logged: see `tierstore status`"));
    }

    fn log_once(&self, kind: &str, message: &str) {
        if std::env::var("TIERSTORE_LOG").is_ok_and(|v| v == "off") {
            return;
        }
        if self.logged.lock().expect("log lock").insert(kind.to_string()) {
            let _ = writeln!(io::stderr(), "tierstore: warning: {message}");
        }
    }

    /// The version of the source file to serve, when a tier holds a copy of it to check: see
    /// [`Inner::current_identity`]. `None` when no tier holds one: there is nothing to check, so the
    /// thread that leads the fetch opens the file under the node's fetch lock and identifies it from the
    /// open (`fstat`, or the `GET`'s own response). A miss costs the store that one open in every
    /// `revalidate` mode, and the threads and processes that wait for the fetch send the store nothing.
    fn known_identity(&self, key: &Key, rel: &str) -> Result<Option<SourceId>, Error> {
        match self.published(key, rel) {
            Some(e) => self.current_identity(key, rel, &e).map(Some),
            None => Ok(None),
        }
    }

    /// The version of `rel` to serve when a tier holds the copy `e`: the copy's own when the dataset is
    /// trusted (`revalidate = "never"`) or the copy was confirmed recently enough (`"<duration>"`; else its
    /// directory is confirmed now, see `cache/confirm.rs`), or the source's current one, asked with one
    /// `stat` or `HEAD` (`"always"`).
    fn current_identity(&self, key: &Key, rel: &str, e: &Entry) -> Result<SourceId, Error> {
        match self.config.revalidate {
            Revalidate::Never => Ok(e.source),
            Revalidate::Within(d) => self.confirmed_identity(key, rel, e, d),
            Revalidate::Always => self.source.identify(rel).map_err(|err| Error::io(&self.source.path_of(rel), err)),
        }
    }

    /// Opens a source file and identifies it from the open descriptor (one open, and the attributes the
    /// open fetched).
    fn open_identified(&self, rel: &str) -> Result<(SourceId, SourceFile), Error> {
        let path = self.source.path_of(rel);
        let f = self.source.open(rel).map_err(|e| Error::io(&path, e))?;
        let (sid, is_dir) = self.source.identify_opened(&f, rel).map_err(|e| Error::io(&path, e))?;
        if is_dir {
            return Err(Error::io(&path, io::Error::from_raw_os_error(libc::EISDIR)));
        }
        Ok((sid, f))
    }

    /// Leads the flight of `key`: identifies the file if needed (the leader alone opens it), then fetches.
    /// `seen`: a time at or before which the source showed the version `known` (or will show the one the
    /// leader opens), which its copy records as confirmed.
    // The arguments are one fetch's (what, which version, since when, its flight, why, the open source).
    #[allow(clippy::too_many_arguments)]
    fn lead_flight(
        self: &Arc<Self>,
        key: &Key,
        rel: &str,
        known: &mut Option<SourceId>,
        flight: Arc<Flight>,
        purpose: Purpose,
        pre: &mut Option<SourceFile>,
        seen: u64,
    ) -> Result<Fetched, Error> {
        match *known {
            Some(sid) => self.lead(key, rel, sid, flight, purpose, pre, seen),
            None => self.lead_unknown_flight(key, rel, known, flight, purpose, pre, seen),
        }
    }

    /// Opens and identifies `rel` for the flight of `key` it leads, keeping the open file in `pre`; on
    /// failure the flight lands, so that its followers stop waiting.
    fn open_for_flight(
        &self,
        key: &Key,
        rel: &str,
        flight: &Arc<Flight>,
        pre: &mut Option<SourceFile>,
    ) -> Result<SourceId, Error> {
        match self.open_identified(rel) {
            Ok((sid, f)) => {
                *pre = Some(f);
                Ok(sid)
            }
            Err(e) => {
                self.fail_flight(key, flight, &e);
                Err(e)
            }
        }
    }

    /// [`Inner::lead_flight`] for a file no tier held when the open began. The node-wide fetch lock is
    /// taken before the source is opened: processes racing for the same cold file then send the store one
    /// open (one `GET`) between them, whatever the `revalidate` mode, and the ones that waited find it
    /// published and check it as any copy.
    #[allow(clippy::too_many_arguments)]
    fn lead_unknown_flight(
        self: &Arc<Self>,
        key: &Key,
        rel: &str,
        known: &mut Option<SourceId>,
        flight: Arc<Flight>,
        purpose: Purpose,
        pre: &mut Option<SourceFile>,
        seen: u64,
    ) -> Result<Fetched, Error> {
        let guard = match self.locks.lock(key) {
            Ok(g) => Some(g),
            Err(e) => {
                self.fault(None, "fetch-lock", &format!("fetch lock failed: {e}"));
                None
            }
        };
        let published = self.published(key, rel).map(|e| self.current_identity(key, rel, &e));
        let sid = match published {
            Some(Ok(sid)) => sid,
            Some(Err(e)) => {
                self.fail_flight(key, &flight, &e);
                return Err(e);
            }
            None => self.open_for_flight(key, rel, &flight, pre)?,
        };
        *known = Some(sid);
        match guard {
            Some(guard) => self.fetch_locked(key, rel, sid, flight, guard, purpose, pre, seen),
            None => {
                self.flights.land(key, &flight);
                Ok(Fetched::Reader(self.direct(rel, sid, pre)?))
            }
        }
    }

    /// Lands a flight whose source request failed with `e`, handing the error to its waiters.
    fn fail_flight(&self, key: &Key, flight: &Arc<Flight>, e: &Error) {
        if let Error::Io { source, .. } = e {
            flight.deliver(Outcome::failed(source));
        }
        self.flights.land(key, flight);
    }

    /// The waiter's side of [`Inner::fail_flight`].
    fn flight_failed(&self, rel: &str, kind: io::ErrorKind, message: &str) -> Error {
        Error::io(&self.source.path_of(rel), io::Error::new(kind, message.to_string()))
    }

    /// The first published entry of `key` in tier order, with the tier's index.
    fn published_in(&self, key: &Key, rel: &str) -> Option<(usize, Entry)> {
        self.tiers.iter().enumerate().find_map(|(i, t)| {
            let e = t.index.as_ref().ok()?.lookup(key).ok()??;
            (e.ready && e.rel == rel).then_some((i, e))
        })
    }

    /// The index that records the source's directories: the first tier's that is available.
    fn directories(&self) -> Option<&crate::index::Index> {
        self.tiers.iter().find_map(|t| t.index.as_ref().ok())
    }

    /// What a published entry or a directory record says of `rel`; with `nofollow`, only one recorded as
    /// the path's own (`lstat`).
    fn known_path(&self, rel: &str, nofollow: bool) -> Option<SourceId> {
        let key = key_of(rel);
        let known = match self.published(&key, rel) {
            Some(e) => Some(e.source),
            None => self.directories().and_then(|ix| ix.directory(&key, rel).ok().flatten()),
        };
        known.filter(|sid| !nofollow || sid.attrs.is_some_and(|a| a.canonical))
    }

    /// The record of the symlink `rel`, if one was made.
    fn link(&self, rel: &str) -> Option<Link> {
        self.directories()?.link(&key_of(rel), rel).ok().flatten()
    }

    fn published(&self, key: &Key, rel: &str) -> Option<Entry> {
        self.published_in(key, rel).map(|(_, e)| e)
    }

    fn open_rel(self: &Arc<Self>, rel: &str) -> Result<Reader, Error> {
        let seen = now_ns();
        let key = key_of(rel);
        let mut known = self.known_identity(&key, rel)?;
        let mut pre = None;
        for _ in 0..3 {
            match known {
                Some(sid) => {
                    if let Some(r) = self.hit(&key, rel, &sid, true) {
                        return Ok(r);
                    }
                }
                None => self.count_misses(),
            }
            match self.flights.join(&key) {
                Role::Leader(flight) => {
                    if let Some(Fetched::Reader(r)) = self.from_peer(&key, rel, &mut known, &flight, Purpose::Read) {
                        return Ok(r);
                    }
                    match self.lead_flight(&key, rel, &mut known, flight, Purpose::Read, &mut pre, seen)? {
                        Fetched::Reader(r) => return Ok(r),
                        Fetched::Cached
                        | Fetched::Uncached
                        | Fetched::NoRoom
                        | Fetched::Skipped
                        | Fetched::Streaming(..) => {}
                    }
                }
                Role::Follower(flight) => match flight.wait() {
                    Outcome::Bytes(b) => {
                        let size = b.len() as u64;
                        return Ok(Reader::new(Backing::Memory(b), size, rel.into(), self.source.clone()));
                    }
                    Outcome::Growing(g) => {
                        let size = g.size();
                        return Ok(Reader::new(Backing::Growing(g), size, rel.into(), self.source.clone()));
                    }
                    Outcome::Retry => {}
                    Outcome::Failed(kind, message) => return Err(self.flight_failed(rel, kind, &message)),
                },
            }
            if known.is_none() {
                known = self.known_identity(&key, rel)?;
            }
        }
        let sid = match known {
            Some(sid) => sid,
            None => {
                let (sid, f) = self.open_identified(rel)?;
                pre = Some(f);
                sid
            }
        };
        self.direct(rel, sid, &mut pre)
    }

    /// Counts a miss in every available tier (a trusted file that no tier holds).
    fn count_misses(&self) {
        for t in &self.tiers {
            if t.index.is_ok() {
                t.counters.add(tier_slot::MISSES, 1);
            }
        }
    }

    /// A reader of the source itself (through `pre` when the source is already open).
    fn direct(&self, rel: &str, sid: SourceId, pre: &mut Option<SourceFile>) -> Result<Reader, Error> {
        let f = match pre.take() {
            Some(f) => f,
            None => self.source.open(rel).map_err(|e| Error::io(&self.source.path_of(rel), e))?,
        };
        Ok(Reader::new(Backing::Source(f), sid.size, rel.into(), self.source.clone()))
    }

    /// Opens a valid published copy of `key`, if a tier has one.
    fn hit(&self, key: &Key, rel: &str, sid: &SourceId, count: bool) -> Option<Reader> {
        for (i, tier) in self.tiers.iter().enumerate() {
            let Ok(index) = &tier.index else { continue };
            let entry = match index.lookup(key) {
                Ok(Some(e)) if e.ready && e.rel == rel && e.source == *sid => e,
                Ok(_) => {
                    if count {
                        tier.counters.add(tier_slot::MISSES, 1);
                    }
                    continue;
                }
                Err(e) => {
                    self.fault(
                        Some(i),
                        "index-read",
                        &format!("index of {} unreadable: {e}", tier.config.path.display()),
                    );
                    continue;
                }
            };
            match self.open_copy(i, key, &entry) {
                Ok(Some(backing)) => {
                    if count {
                        tier.counters.add(tier_slot::HITS, 1);
                        self.note_access(i, key);
                    }
                    return Some(Reader::new(backing, sid.size, rel.into(), self.source.clone()));
                }
                Ok(None) => {
                    if count {
                        tier.counters.add(tier_slot::MISSES, 1);
                    }
                }
                Err(detail) => {
                    // The look under the fetch lock (count = false) sees the same damage again: once is a fault.
                    if count {
                        tier.counters.add(tier_slot::MISSES, 1);
                        self.fault(
                            Some(i),
                            "bad-copy",
                            &format!("{detail} for {rel} in {}; it will be fetched again", tier.config.path.display()),
                        );
                    }
                }
            }
        }
        None
    }

    /// Opens and checks the copy of a ready entry. `Ok(None)`: evicted meanwhile (not a fault).
    fn open_copy(&self, i: usize, key: &Key, e: &Entry) -> Result<Option<Backing>, String> {
        let tier = &self.tiers[i];
        let file = match tier.open_copy(key) {
            Ok(f) => f,
            // Under an evicting policy another thread or process may have evicted the copy since the
            // lookup: if its entry is gone or changed too, that is a miss, not damage.
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                let still = tier.index.as_ref().ok().and_then(|ix| ix.lookup_settled(key).ok().flatten());
                return match still {
                    Some(now)
                        if now.ready && now.source == e.source && now.stats.inserted_seq == e.stats.inserted_seq =>
                    {
                        Err("missing copy".into())
                    }
                    _ => Ok(None),
                };
            }
            Err(err) => return Err(format!("copy unreadable ({err})")),
        };
        // Only an evicting policy deletes copies readers may hold; `fill` never does, so skip the syscall.
        if self.config.policy.evicts() {
            lock_shared(&file).map_err(|err| format!("copy cannot be locked ({err})"))?;
        }
        let m = file.metadata().map_err(|err| format!("copy cannot be inspected ({err})"))?;
        use std::os::unix::fs::MetadataExt;
        if m.nlink() == 0 {
            return Ok(None);
        }
        let mtime = m.mtime() * 1_000_000_000 + m.mtime_nsec();
        if m.size() != e.source.size {
            return Err(format!("truncated copy ({} of {} bytes)", m.size(), e.source.size));
        }
        if mtime != e.source.mtime_ns {
            return Err("modified copy (its mtime changed)".into());
        }
        // The reader's `fstat` of the copy comes next (Python's `open` asks it of every file): remember
        // its answer from what was just read, rather than find the entry again through /proc then.
        if let Some(st) = e.source.to_stat() {
            self.remember_copy((m.dev(), m.ino(), m.ctime(), m.ctime_nsec()), st);
        }
        if self.config.verify == Verify::Checksum {
            // A copy published without a checksum (while verification was by metadata) cannot be
            // vouched for: fetch it again, which records one. Not a fault.
            if e.checksum.is_none() {
                return Ok(None);
            }
            let mut bytes = Vec::with_capacity(m.size() as usize);
            use std::io::Read;
            (&file).read_to_end(&mut bytes).map_err(|err| format!("copy unreadable ({err})"))?;
            if Some(crate::hash::hash_serial(&bytes)) != e.checksum {
                return Err("corrupted copy (checksum mismatch)".into());
            }
            tier.counters.add(tier_slot::BYTES_SERVED, bytes.len() as u64);
            return Ok(Some(Backing::Memory(Arc::new(bytes))));
        }
        Ok(Some(Backing::Copy(file, tier.clone())))
    }

    /// Remembers what `fstat` reports for a copy's incarnation (see [`Cache::copy_stat`]).
    fn remember_copy(&self, incarnation: CopyIncarnation, st: libc::stat) {
        let mut memo = self.copy_stats.lock().expect("copy stats lock");
        if memo.len() >= COPY_STATS_KEPT {
            memo.clear();
        }
        memo.insert(incarnation, st);
    }

    fn note_access(&self, tier: usize, key: &Key) {
        if !self.config.policy.tracks_access() {
            return;
        }
        let n = {
            let mut a = self.access.lock().expect("access lock");
            let slot = a.entry((tier, *key)).or_insert((0, 0));
            slot.0 += 1;
            slot.1 = now_ns();
            a.len()
        };
        let due = n >= 512 || self.last_access_flush.lock().expect("flush lock").elapsed().as_millis() >= 500;
        if due {
            self.flush_access();
        }
    }

    /// Writes pending hit statistics into the indexes (batched: one write transaction per tier).
    fn flush_access(&self) {
        let batch = std::mem::take(&mut *self.access.lock().expect("access lock"));
        *self.last_access_flush.lock().expect("flush lock") = Instant::now();
        let mut per_tier: HashMap<usize, Vec<(Key, u64, u64)>> = HashMap::new();
        for ((t, k), (hits, last)) in batch {
            per_tier.entry(t).or_default().push((k, hits, last));
        }
        for (t, list) in per_tier {
            if let Ok(ix) = &self.tiers[t].index {
                if let Err(e) = ix.record_access(&list) {
                    self.fault(Some(t), "access-stats", &format!("access statistics not written: {e}"));
                }
            }
        }
    }

    /// Fetches `key` under the node-wide fetch lock (the caller leads the in-process flight).
    #[allow(clippy::too_many_arguments)]
    fn lead(
        self: &Arc<Self>,
        key: &Key,
        rel: &str,
        sid: SourceId,
        flight: Arc<Flight>,
        purpose: Purpose,
        pre: &mut Option<SourceFile>,
        seen: u64,
    ) -> Result<Fetched, Error> {
        let guard = match self.locks.lock(key) {
            Ok(g) => g,
            Err(e) => {
                self.fault(None, "fetch-lock", &format!("fetch lock failed: {e}"));
                self.flights.land(key, &flight);
                return Ok(Fetched::Reader(self.direct(rel, sid, pre)?));
            }
        };
        self.fetch_locked(key, rel, sid, flight, guard, purpose, pre, seen)
    }

    // The arguments are what one fetch is about (key, path, version, its flight, its lock, its purpose,
    // the source descriptor it may already have, and when the source showed the version); bundling them
    // would only rename them.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fetch_locked(
        self: &Arc<Self>,
        key: &Key,
        rel: &str,
        sid: SourceId,
        flight: Arc<Flight>,
        guard: FetchGuard,
        purpose: Purpose,
        pre: &mut Option<SourceFile>,
        seen: u64,
    ) -> Result<Fetched, Error> {
        let land = |f: Fetched| {
            self.flights.land(key, &flight);
            Ok(f)
        };
        // Another process may have published while this one waited for the lock.
        if let Some(r) = self.hit(key, rel, &sid, false) {
            return land(match purpose {
                Purpose::Read => Fetched::Reader(r),
                Purpose::Prefetch | Purpose::Native => Fetched::Cached,
            });
        }
        // Under the lock, any entry of this key is stale, damaged, or left by a dead fetcher.
        self.remove_entries(key);
        let Some(t) = self.place(key, rel, sid, seen) else {
            self.source.counters().add(src_slot::UNCACHED, 1);
            drop(guard);
            return land(match purpose {
                Purpose::Read | Purpose::Native => Fetched::Reader(self.direct(rel, sid, pre)?),
                Purpose::Prefetch => Fetched::NoRoom,
            });
        };
        let small = sid.size <= self.config.inline_max;
        // A small file for a program is fetched whole in this thread, as a prefetch would.
        let purpose = if purpose == Purpose::Native && small { Purpose::Prefetch } else { purpose };
        match purpose {
            Purpose::Prefetch => {
                let r = self.copy_into(t, key, rel, sid, None, pre.take());
                drop(guard);
                self.flights.land(key, &flight);
                r.map(|ok| if ok { Fetched::Cached } else { Fetched::Uncached })
            }
            Purpose::Read if small => {
                let (bytes, after) = match self.source.read_whole(rel, sid.size, pre.take()) {
                    Ok(x) => x,
                    Err(e) => {
                        self.abort(t, key);
                        drop(guard);
                        flight.deliver(Outcome::failed(&e));
                        self.flights.land(key, &flight);
                        return Err(Error::io(&self.source.path_of(rel), e));
                    }
                };
                let bytes = Arc::new(bytes);
                flight.deliver(Outcome::Bytes(bytes.clone()));
                let reader =
                    Reader::new(Backing::Memory(bytes.clone()), bytes.len() as u64, rel.into(), self.source.clone());
                let inner = self.clone();
                let key = *key;
                let job = move || {
                    if after == sid && bytes.len() as u64 == sid.size {
                        inner.publish_bytes(t, &key, &bytes, sid);
                    } else {
                        inner.abort(t, &key);
                    }
                    drop(guard);
                    inner.flights.land(&key, &flight);
                };
                match self.pool() {
                    Some(pool) => pool.urgent(job),
                    None => job(),
                }
                Ok(Fetched::Reader(reader))
            }
            Purpose::Read | Purpose::Native => {
                // For a program: its descriptor shares the copy's open file (a dup: no second open on the
                // store); the copy reads with pread, so the program's file offset is its own.
                let mut src = pre.take();
                let program = if purpose == Purpose::Native {
                    let opened = src.take().map_or_else(|| self.source.open(rel), Ok).and_then(|f| {
                        let program = f.as_file().ok_or_else(no_descriptor)?.try_clone()?;
                        Ok((f, program))
                    });
                    match opened {
                        Ok((f, program)) => {
                            src = Some(f);
                            Some(program)
                        }
                        Err(e) => {
                            self.abort(t, key);
                            drop(guard);
                            self.flights.land(key, &flight);
                            return Err(Error::io(&self.source.path_of(rel), e));
                        }
                    }
                } else {
                    None
                };
                let tier = &self.tiers[t];
                let temp = tier.create_temp(key).and_then(|(path, f)| {
                    let reader = File::open(&path)?;
                    lock_shared(&reader)?;
                    Ok((path, f, reader))
                });
                let (path, file, read_handle) = match temp {
                    Ok(x) => x,
                    Err(e) => {
                        self.fault(
                            Some(t),
                            "tier-write",
                            &format!("cannot create a copy in {}: {e}", tier.config.path.display()),
                        );
                        self.abort(t, key);
                        drop(guard);
                        self.flights.land(key, &flight);
                        return Ok(Fetched::Reader(self.direct(rel, sid, &mut src)?));
                    }
                };
                let growing = Arc::new(Growing::new(read_handle, sid));
                flight.deliver(Outcome::Growing(growing.clone()));
                let fetched = match program {
                    Some(f) => Fetched::Streaming(f, growing.clone()),
                    None => Fetched::Reader(Reader::new(
                        Backing::Growing(growing.clone()),
                        sid.size,
                        rel.into(),
                        self.source.clone(),
                    )),
                };
                let inner = self.clone();
                let (key, rel) = (*key, rel.to_string());
                let job = move || {
                    let _ = inner.copy_into(t, &key, &rel, sid, Some((path, file, growing)), src);
                    drop(guard);
                    inner.flights.land(&key, &flight);
                };
                match self.pool() {
                    Some(pool) => pool.urgent(job),
                    None => job(),
                }
                Ok(fetched)
            }
        }
    }

    /// Removes every entry of `key` and its copy (the caller holds the key's fetch lock).
    fn remove_entries(&self, key: &Key) {
        for tier in &self.tiers {
            if let Ok(ix) = &tier.index {
                if let Ok(Some(old)) = ix.remove_if(key, |_| true) {
                    if old.ready {
                        let _ = std::fs::remove_file(tier.data_path(key));
                    }
                }
            }
        }
    }

    /// See [`Cache::open_file`] (`stream` false) and [`Cache::open_native`] (`stream` true).
    fn open_native_rel(self: &Arc<Self>, rel: &str, stream: bool) -> Result<Native, Error> {
        // A program can follow a growing copy only beside a descriptor of the source itself.
        let stream = stream && self.posix().is_some();
        let seen = now_ns();
        let key = key_of(rel);
        let mut known = self.known_identity(&key, rel)?;
        let mut pre = None;
        let purpose = if stream { Purpose::Native } else { Purpose::Prefetch };
        for _ in 0..3 {
            match known {
                Some(sid) => {
                    if let Some(f) = self.hit(&key, rel, &sid, true).and_then(Reader::into_file) {
                        return Ok(Native::Whole(f));
                    }
                }
                None => self.count_misses(),
            }
            match self.flights.join(&key) {
                // Small files (and every file without `stream`) are fetched whole in this thread, so the
                // caller gets a complete copy.
                Role::Leader(flight) => match self
                    .from_peer(&key, rel, &mut known, &flight, Purpose::Native)
                    .map_or_else(|| self.lead_flight(&key, rel, &mut known, flight, purpose, &mut pre, seen), Ok)?
                {
                    Fetched::Uncached | Fetched::NoRoom => break,
                    Fetched::Reader(r) => {
                        if let Some(f) = r.into_file() {
                            return Ok(Native::Whole(f));
                        }
                    }
                    Fetched::Streaming(source, copy) => return Ok(Native::Copying { source, copy }),
                    Fetched::Cached | Fetched::Skipped => {}
                },
                Role::Follower(flight) => match flight.wait() {
                    Outcome::Growing(copy) if stream => {
                        let source = self.source_descriptor(rel, None)?;
                        return Ok(Native::Copying { source, copy });
                    }
                    Outcome::Failed(kind, message) => return Err(self.flight_failed(rel, kind, &message)),
                    Outcome::Growing(_) | Outcome::Bytes(_) | Outcome::Retry => {}
                },
            }
            if known.is_none() {
                known = self.known_identity(&key, rel)?;
            }
        }
        self.source_descriptor(rel, pre.take()).map(Native::Whole)
    }

    /// A descriptor holding a source file's bytes for a program: the file's own on a POSIX source (`pre`
    /// when already open); for an object store, which has no descriptors, its bytes in a memory file.
    fn source_descriptor(&self, rel: &str, pre: Option<SourceFile>) -> Result<File, Error> {
        let path = self.source.path_of(rel);
        if self.posix().is_some() {
            return match pre {
                Some(f) => f.into_file().ok_or_else(|| Error::io(&path, no_descriptor())),
                None => self
                    .source
                    .open(rel)
                    .map_err(|e| Error::io(&path, e))?
                    .into_file()
                    .ok_or_else(|| Error::io(&path, no_descriptor())),
            };
        }
        let (bytes, _) = self.source.read_whole(rel, 0, pre).map_err(|e| Error::io(&path, e))?;
        let file = peers::memory_file(rel).map_err(|e| Error::io(&path, e))?;
        use std::os::unix::fs::FileExt;
        file.write_all_at(&bytes, 0).map_err(|e| Error::io(&path, e))?;
        Ok(file)
    }

    /// Reserves room for the entry by policy; returns the tier that took it. `seen`: when the source showed
    /// the version `sid` (0: not known, the copy is confirmed before it is trusted for a while).
    fn place(&self, key: &Key, rel: &str, sid: SourceId, seen: u64) -> Option<usize> {
        let free: Vec<Option<u64>> = self
            .tiers
            .iter()
            .map(|t| {
                t.index
                    .as_ref()
                    .ok()
                    .and_then(|ix| ix.usage_bytes().ok())
                    .map(|used| t.config.quota.saturating_sub(used))
            })
            .collect();
        let quotas: Vec<u64> = self.tiers.iter().map(|t| t.config.quota).collect();
        for (i, evict) in plan(self.config.policy, sid.size, &free, &quotas) {
            let tier = &self.tiers[i];
            let Ok(ix) = &tier.index else { continue };
            let mut try_remove = |victim: &Key, _: &Entry| {
                let path = tier.data_path(victim);
                match File::open(&path) {
                    Ok(f) if try_lock_exclusive(&f) => std::fs::remove_file(&path).is_ok(),
                    Ok(_) => false,
                    Err(e) => e.kind() == io::ErrorKind::NotFound,
                }
            };
            match ix.reserve(key, rel, sid, seen, tier.config.quota, evict, &mut try_remove) {
                Ok(Reservation::Reserved { evicted }) => {
                    tier.counters.add(tier_slot::EVICTIONS, evicted);
                    return Some(i);
                }
                Ok(Reservation::NoRoom { evicted }) => tier.counters.add(tier_slot::EVICTIONS, evicted),
                Err(e) => self.fault(
                    Some(i),
                    "index-write",
                    &format!("index of {} not writable: {e}", tier.config.path.display()),
                ),
            }
        }
        None
    }

    fn abort(&self, t: usize, key: &Key) {
        if let Ok(ix) = &self.tiers[t].index {
            let pid = crate::process::pid();
            let _ = ix.remove_if(key, |e| !e.ready && e.pid == pid);
        }
    }

    /// The blake3 of a copy, computed only when copies are verified by checksum (hashing costs a few
    /// percent of a first epoch that nothing else would use).
    fn checksum(&self, bytes: &[u8]) -> Option<[u8; 32]> {
        self.record_checksums.then(|| crate::hash::hash_serial(bytes))
    }

    fn finish_publish(
        &self,
        t: usize,
        key: &Key,
        temp: &Path,
        file: &File,
        sid: SourceId,
        sum: Option<[u8; 32]>,
    ) -> io::Result<()> {
        let tier = &self.tiers[t];
        set_mtime(file, sid.mtime_ns)?;
        tier.publish_file(temp, key)?;
        let published = match &tier.index {
            Ok(ix) => ix.publish(key, sum, now_ns()).unwrap_or(false),
            Err(_) => false,
        };
        if published {
            tier.counters.add(tier_slot::INSERTS, 1);
            tier.counters.add(tier_slot::BYTES_WRITTEN, sid.size);
        } else {
            // The reservation vanished (the cache was cleared meanwhile): leave no unaccounted copy.
            let _ = std::fs::remove_file(tier.data_path(key));
        }
        Ok(())
    }

    /// Writes fetched bytes into tier `t` and publishes them.
    fn publish_bytes(&self, t: usize, key: &Key, bytes: &[u8], sid: SourceId) {
        let tier = &self.tiers[t];
        let r = tier.create_temp(key).and_then(|(path, mut f)| {
            let result =
                f.write_all(bytes).and_then(|_| self.finish_publish(t, key, &path, &f, sid, self.checksum(bytes)));
            if result.is_err() {
                let _ = std::fs::remove_file(&path);
            }
            result
        });
        if let Err(e) = r {
            self.fault(Some(t), "tier-write", &format!("cannot write a copy into {}: {e}", tier.config.path.display()));
            self.abort(t, key);
        }
    }

    /// Streams a source file into tier `t` and publishes it; readers of `growing` follow the copy. Returns
    /// whether the copy was published.
    fn copy_into(
        &self,
        t: usize,
        key: &Key,
        rel: &str,
        sid: SourceId,
        started: Option<(PathBuf, File, Arc<Growing>)>,
        source_file: Option<SourceFile>,
    ) -> Result<bool, Error> {
        let tier = &self.tiers[t];
        let (temp, file, growing) = match started {
            Some((p, f, g)) => (p, f, Some(g)),
            None => match tier.create_temp(key) {
                Ok((p, f)) => (p, f, None),
                Err(e) => {
                    self.fault(
                        Some(t),
                        "tier-write",
                        &format!("cannot create a copy in {}: {e}", tier.config.path.display()),
                    );
                    self.abort(t, key);
                    return Ok(false);
                }
            },
        };
        let fail = |why: Option<(&str, String)>| {
            if let Some(g) = &growing {
                g.fail();
            }
            let _ = std::fs::remove_file(&temp);
            self.abort(t, key);
            if let Some((kind, detail)) = why {
                self.fault(Some(t), kind, &detail);
            }
        };
        let src = match source_file.map(Ok).unwrap_or_else(|| self.source.open(rel)) {
            Ok(f) => f,
            Err(e) => {
                if let Some(g) = &growing {
                    g.fail_source(&e);
                }
                fail(None);
                return Err(Error::io(&self.source.path_of(rel), e));
            }
        };
        let mut hasher = self.record_checksums.then(crate::hash::Hasher::new);
        let mut progress = |copied: u64| {
            if let Some(g) = &growing {
                g.advance(copied);
            }
        };
        let (copied, after) = match self.source.copy(&src, &file, sid.size, hasher.as_mut(), &mut progress) {
            Ok(x) => x,
            Err(CopyFault::Source(e)) => {
                // The store failed (timed out, went away): its readers fail with it now, rather than ask
                // the store again and wait as long a second time. A tier fault, below, sends them to the
                // source instead.
                if let Some(g) = &growing {
                    g.fail_source(&e);
                }
                fail(None);
                return Err(Error::io(&self.source.path_of(rel), e));
            }
            Err(CopyFault::Tier(e)) => {
                fail(Some(("tier-write", format!("cannot write a copy into {}: {e}", tier.config.path.display()))));
                return Ok(false);
            }
        };
        // A file rewritten during the copy is never published.
        if copied != sid.size || after != Some(sid) {
            fail(None);
            return Ok(false);
        }
        if let Err(e) = self.finish_publish(t, key, &temp, &file, sid, hasher.map(|h| *h.finalize().as_bytes())) {
            fail(Some(("tier-write", format!("cannot publish a copy in {}: {e}", tier.config.path.display()))));
            return Ok(false);
        }
        if let Some(g) = &growing {
            g.finish();
        }
        Ok(true)
    }

    /// One object of a prefetch: claimed before it is opened (opening an object is a GET), so that a
    /// prefetch racing another process's fetch of it sends no request. `None`: cached, or being fetched.
    fn prefetch_object(self: &Arc<Self>, key: &Key, rel: &str) -> Result<Option<(SourceId, Fetched)>, Error> {
        let seen = now_ns();
        let Role::Leader(flight) = self.flights.join(key) else { return Ok(None) };
        let guard = match self.locks.try_lock(key) {
            Ok(Some(guard)) => guard,
            Ok(None) => {
                self.flights.land(key, &flight);
                return Ok(None);
            }
            Err(e) => {
                self.flights.land(key, &flight);
                return Err(Error::io(&self.source.path_of(rel), e));
            }
        };
        if let Some(e) = self.published(key, rel) {
            if self.trusted_now(&e) && self.hit(key, rel, &e.source, false).is_some() {
                self.flights.land(key, &flight);
                return Ok(None);
            }
        }
        let mut pre = None;
        let sid = self.open_for_flight(key, rel, &flight, &mut pre)?;
        let fetched = self.fetch_locked(key, rel, sid, flight, guard, Purpose::Prefetch, &mut pre, seen)?;
        Ok(Some((sid, fetched)))
    }

    /// One file of a prefetch, opened and identified by the caller (at `seen` or after): copy it unless
    /// it is cached or being fetched by someone else.
    fn prefetch_file(
        self: &Arc<Self>,
        key: &Key,
        rel: &str,
        sid: SourceId,
        file: SourceFile,
        seen: u64,
    ) -> Result<Fetched, Error> {
        if self.hit(key, rel, &sid, false).is_some() {
            return Ok(Fetched::Skipped);
        }
        let Role::Leader(flight) = self.flights.join(key) else {
            return Ok(Fetched::Skipped);
        };
        // Never block a prefetch worker on another process's fetch: it is being done, which is all a
        // prefetch wants.
        match self.locks.try_lock(key) {
            Ok(Some(guard)) => {
                self.fetch_locked(key, rel, sid, flight, guard, Purpose::Prefetch, &mut Some(file), seen)
            }
            Ok(None) => {
                self.flights.land(key, &flight);
                Ok(Fetched::Skipped)
            }
            Err(e) => {
                self.flights.land(key, &flight);
                Err(Error::io(&self.source.path_of(rel), e))
            }
        }
    }
}
