//! Prefetch: warms the cache with whole directory trees, many directories and files at a time.
//!
//! A shared store answers each request after a round trip, so a prefetch is bounded by how many requests
//! it keeps in flight, not by the CPU. `jobs` worker threads share one queue of directories to list and
//! entries to fetch; listings go first (they find the work), and each worker copies the file it took
//! itself, so up to `jobs` files are in flight whatever the size of the copy pool.
//!
//! What each file costs the store: a file the index holds is confirmed from the index alone when the
//! dataset is trusted (`revalidate = "never"`), or with one `stat` (`"always"`); a file it does not hold
//! is opened from its directory's descriptor (one lookup of its name) and identified from the open
//! descriptor, then copied. Entries whose type the listing does not give (FUSE gives none) are identified
//! the same way, never by a `stat` of their own.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs::File;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use super::engine::Inner;
use super::fetch::{Held, Hold};
use super::flight::Role;
use super::job::Fetched;
use super::job::{FetchJob, Purpose};
use super::lookup::Look;
use crate::clock::now_ns;
use crate::config::Revalidate;
use crate::error::Error;
use crate::index::{key_of, Key, SourceId};
use crate::source::{list_dir, SourceFile};

/// Files fetched at once when the caller does not say: enough to hide a store's round trip behind the
/// others (on the stand-in store, 2000 files took 4.3 s with 4, 2.6 s with 16, 2.0 s with 32), few enough
/// not to flood its metadata server.
pub const DEFAULT_JOBS: usize = 32;
/// The most files a prefetch fetches at once.
pub const MAX_JOBS: usize = 1024;
/// Directory descriptors kept open for entries still queued: past this, entries are fetched before more
/// directories are listed, so a wide tree cannot run the process out of descriptors.
const MAX_OPEN_DIRS: usize = 256;
/// Problems kept for the report; the rest are only counted.
const MAX_ERRORS: usize = 1000;

/// Progress of a prefetch, updated by its workers and read by whoever shows it.
#[derive(Default)]
pub struct PrefetchProgress {
    /// Files found so far (final once the prefetch is [`finished`](PrefetchProgress::finished)): every
    /// entry of a listed directory counts until it turns out not to be a regular file.
    pub files_total: AtomicU64,
    /// Bytes of the files identified so far.
    pub bytes_total: AtomicU64,
    /// Files handled (copied, already cached, or failed).
    pub files_done: AtomicU64,
    /// Bytes of handled files.
    pub bytes_done: AtomicU64,
    /// Files copied by this prefetch.
    pub files_copied: AtomicU64,
    /// Files that could not be cached (no room, or an error), and directories that could not be walked.
    pub files_failed: AtomicU64,
    /// Files left unopened, to their readers, because no tier had room for the size the caller expected
    /// them to have (see [`Walk::expecting`]): not failures.
    pub files_no_room: AtomicU64,
    /// The first problem met, for the report.
    pub first_error: Mutex<Option<String>>,
    /// Every problem met (up to a thousand), each naming the file and what to do.
    pub errors: Mutex<Vec<String>>,
    done: AtomicBool,
}

impl PrefetchProgress {
    /// True when the walk is over and every file is handled.
    pub fn finished(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// A copy of the problems met so far.
    pub fn errors(&self) -> Vec<String> {
        self.errors.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn fail(&self, message: String) {
        self.files_failed.fetch_add(1, Ordering::Relaxed);
        self.first_error.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert_with(|| message.clone());
        let mut errors = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        if errors.len() < MAX_ERRORS {
            errors.push(message);
        }
    }

    /// An entry counted as a file turned out to be something else (a directory, a FIFO...).
    fn not_a_file(&self) {
        self.files_total.fetch_sub(1, Ordering::AcqRel);
    }

    fn handled(&self, size: u64) {
        self.bytes_done.fetch_add(size, Ordering::Relaxed);
        self.files_done.fetch_add(1, Ordering::AcqRel);
    }
}

/// What a user reads when a file of a prefetch fails: the file, what happened, what to do.
fn describe(path: &Path, e: &io::Error) -> String {
    let path = path.display();
    match e.kind() {
        io::ErrorKind::NotFound => format!(
            "{path}: vanished during the prefetch (removed or renamed on the store); if it was replaced, run the prefetch again"
        ),
        io::ErrorKind::PermissionDenied => {
            format!("{path}: permission denied; make it readable on the store, then run the prefetch again")
        }
        _ => format!("{path}: {e}; not cached, run the prefetch again to retry (cached files are skipped)"),
    }
}

fn describe_error(e: &Error) -> String {
    match e {
        Error::Io { path, source } => describe(path, source),
        other => other.to_string(),
    }
}

/// An open directory of the source, kept while entries found in it wait to be fetched, so that each is
/// opened with one lookup of its own name.
struct DirHandle {
    file: File,
    rel: String,
    open: Arc<AtomicUsize>,
}

impl Drop for DirHandle {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::Relaxed);
    }
}

impl DirHandle {
    fn child(&self, name: &OsString) -> String {
        let name = name.to_string_lossy();
        if self.rel.is_empty() {
            name.into_owned()
        } else {
            format!("{}/{name}", self.rel)
        }
    }
}

enum Job {
    /// List an open directory.
    List(Arc<DirHandle>),
    /// Open a subdirectory (the listing said it is one) and list it.
    Dir { parent: Arc<DirHandle>, name: OsString },
    /// A file, or an entry of unknown type; `parent` is None for a file named by the caller.
    Entry { parent: Option<Arc<DirHandle>>, name: OsString, rel: String },
    /// Every object under a prefix of an object store (`""` for the source's own prefix); an object that
    /// is named whole has nothing under it and is fetched itself.
    Listing(String),
}

#[derive(Default)]
struct Queue {
    dirs: VecDeque<Job>,
    entries: VecDeque<Job>,
    busy: usize,
}

/// One prefetch: its queue, its workers' shared state and its progress.
pub(super) struct Walk {
    inner: Arc<Inner>,
    progress: Arc<PrefetchProgress>,
    queue: Mutex<Queue>,
    work: Condvar,
    open_dirs: Arc<AtomicUsize>,
    workers: AtomicUsize,
    expected: Option<u64>,
}

impl Walk {
    pub(super) fn new(inner: Arc<Inner>) -> Walk {
        Walk {
            inner,
            progress: Arc::new(PrefetchProgress::default()),
            queue: Mutex::new(Queue::default()),
            work: Condvar::new(),
            open_dirs: Arc::new(AtomicUsize::new(0)),
            workers: AtomicUsize::new(0),
            expected: None,
        }
    }

    /// Holds room for `size` bytes of each file before it is opened, and leaves a file no tier has that
    /// room for unopened (`files_no_room`): for a caller that knows about how large the files are (a
    /// read-ahead of shards of one size) and whose readers open what it leaves. Without this a file is
    /// opened, then found to have no room: a failure, and an open the reader makes again.
    pub(super) fn expecting(mut self, size: Option<u64>) -> Walk {
        self.expected = size.filter(|&s| s > 0);
        self
    }

    pub(super) fn progress(&self) -> Arc<PrefetchProgress> {
        self.progress.clone()
    }

    /// Queues a directory of the source (`rel` "" for its root), already opened.
    pub(super) fn add_dir(&self, file: File, rel: String) {
        let h = self.handle(file, rel);
        self.push(vec![Job::List(h)], Vec::new());
    }

    /// Queues every object under the prefix `rel` of an object store.
    pub(super) fn add_listing(&self, rel: String) {
        self.push(vec![Job::Listing(rel)], Vec::new());
    }

    /// Queues a file named by the caller.
    pub(super) fn add_file(&self, rel: String) {
        self.progress.files_total.fetch_add(1, Ordering::AcqRel);
        self.push(Vec::new(), vec![Job::Entry { parent: None, name: OsString::new(), rel }]);
    }

    /// Starts `jobs` workers (at least one); the last to leave marks the prefetch finished.
    pub(super) fn start(self: Arc<Self>, jobs: usize) -> Result<(), Error> {
        let jobs = jobs.clamp(1, MAX_JOBS);
        self.inner.prefetch_started();
        self.workers.store(jobs, Ordering::Release);
        let mut started = 0;
        let mut failure = None;
        for i in 0..jobs {
            let walk = self.clone();
            match crate::interposer::spawn(format!("tierstore-prefetch-{i}"), move || walk.work()) {
                Ok(_) => started += 1,
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        // Workers that could not be started never leave: account for them here.
        for _ in started..jobs {
            self.leave();
        }
        match failure {
            Some(e) if started == 0 => Err(Error::Tier {
                path: self.inner.storage().config().tiers[0].path.clone(),
                message: format!("cannot start a prefetch thread: {e}"),
            }),
            _ => Ok(()),
        }
    }

    fn handle(&self, file: File, rel: String) -> Arc<DirHandle> {
        self.open_dirs.fetch_add(1, Ordering::Relaxed);
        Arc::new(DirHandle { file, rel, open: self.open_dirs.clone() })
    }

    fn push(&self, dirs: Vec<Job>, entries: Vec<Job>) {
        if dirs.is_empty() && entries.is_empty() {
            return;
        }
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        q.dirs.extend(dirs);
        q.entries.extend(entries);
        drop(q);
        self.work.notify_all();
    }

    fn work(&self) {
        loop {
            let job = {
                let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
                loop {
                    let list_first = self.open_dirs.load(Ordering::Relaxed) < MAX_OPEN_DIRS || q.entries.is_empty();
                    let job = if list_first {
                        q.dirs.pop_front().or_else(|| q.entries.pop_front())
                    } else {
                        q.entries.pop_front().or_else(|| q.dirs.pop_front())
                    };
                    if let Some(job) = job {
                        q.busy += 1;
                        break Some(job);
                    }
                    if q.busy == 0 {
                        break None;
                    }
                    q = self.work.wait(q).unwrap_or_else(|p| p.into_inner());
                }
            };
            let Some(job) = job else {
                self.work.notify_all();
                break;
            };
            // A panic must not leave the prefetch unfinished forever.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run(job)));
            let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
            q.busy -= 1;
            if q.busy == 0 && q.dirs.is_empty() && q.entries.is_empty() {
                self.work.notify_all();
            }
        }
        self.leave();
    }

    fn leave(&self) {
        if self.workers.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.progress.done.store(true, Ordering::Release);
            self.inner.prefetch_finished();
        }
    }

    fn run(&self, job: Job) {
        match job {
            Job::List(h) => self.list(h),
            Job::Listing(rel) => self.list_objects(rel),
            Job::Dir { parent, name } => {
                let rel = parent.child(&name);
                let Some(posix) = self.inner.storage().posix() else { return };
                match posix.open_in(&parent.file, &name) {
                    Ok(f) => self.list(self.handle(f, rel)),
                    Err(e) => self.fail_dir(format!(
                        "{}: cannot open the directory ({e}); its files were not prefetched",
                        self.inner.storage().source().path_of(&rel).display()
                    )),
                }
            }
            Job::Entry { parent, name, rel } => self.entry(parent, &name, rel),
        }
    }

    /// A directory that cannot be walked counts as one failed entry, so that the counts still add up
    /// (done = copied + already cached + failed).
    fn fail_dir(&self, message: String) {
        self.progress.files_total.fetch_add(1, Ordering::AcqRel);
        self.progress.fail(message);
        self.progress.handled(0);
    }

    /// Lists an object store's prefix (paged by the store: one LIST request per thousand keys) and
    /// queues each object under it; a name with nothing under it is an object of its own.
    fn list_objects(&self, rel: String) {
        let entries = match self.inner.storage().source().list(&rel) {
            Ok(entries) => entries,
            Err(e) => {
                self.fail_dir(format!(
                    "{}: cannot list ({e}); nothing under it was prefetched",
                    self.inner.storage().source().path_of(&rel).display()
                ));
                return;
            }
        };
        let files: Vec<Job> = if entries.is_empty() && !rel.is_empty() {
            vec![Job::Entry { parent: None, name: OsString::new(), rel }]
        } else {
            let mut names: Vec<String> = entries.into_iter().map(|e| e.name.to_string_lossy().into_owned()).collect();
            names.sort();
            names
                .into_iter()
                .map(|name| {
                    let rel = if rel.is_empty() { name } else { format!("{rel}/{name}") };
                    Job::Entry { parent: None, name: OsString::new(), rel }
                })
                .collect()
        };
        self.progress.files_total.fetch_add(files.len() as u64, Ordering::AcqRel);
        self.push(Vec::new(), files);
    }

    fn list(&self, h: Arc<DirHandle>) {
        let mut entries = match list_dir(&h.file) {
            Ok(entries) => entries,
            Err(e) => {
                self.fail_dir(format!(
                    "{}: cannot list the directory ({e}); its files were not prefetched",
                    self.inner.storage().source().path_of(&h.rel).display()
                ));
                return;
            }
        };
        entries.sort();
        let (mut dirs, mut files) = (Vec::new(), Vec::new());
        for (name, kind) in entries {
            match kind {
                libc::DT_DIR => dirs.push(Job::Dir { parent: h.clone(), name }),
                libc::DT_REG | libc::DT_LNK | libc::DT_UNKNOWN => {
                    let rel = h.child(&name);
                    files.push(Job::Entry { parent: Some(h.clone()), name, rel });
                }
                _ => {} // FIFOs, sockets, devices: nothing to cache
            }
        }
        self.progress.files_total.fetch_add(files.len() as u64, Ordering::AcqRel);
        self.push(dirs, files);
    }

    /// One entry: confirmed from the index if it can be, else asked of its owner, else opened, identified
    /// and copied.
    fn entry(&self, parent: Option<Arc<DirHandle>>, name: &OsString, rel: String) {
        let p = &self.progress;
        let key = key_of(&rel);
        match self.cached(parent.as_deref(), name, &key, &rel) {
            Ok(None) => {}
            Ok(Some(size)) => {
                p.bytes_total.fetch_add(size, Ordering::Relaxed);
                return p.handled(size);
            }
            Err(msg) => {
                p.fail(msg);
                return p.handled(0);
            }
        }
        if self.served_by_owner(&key, &rel) {
            return;
        }
        if self.inner.storage().posix().is_none() {
            return self.object(&key, &rel);
        }
        self.posix_file(parent, name, &key, rel);
    }

    /// The size of the entry's copy when it is cached and still current (checked as `revalidate` says:
    /// its directory's listing, a `stat`, or not at all); `None` when it must be copied.
    fn cached(&self, parent: Option<&DirHandle>, name: &OsString, key: &Key, rel: &str) -> Result<Option<u64>, String> {
        let inner = &self.inner;
        let Some(e) = inner.storage().lookup().published(key, rel) else { return Ok(None) };
        let current = match inner.storage().config().revalidate {
            Revalidate::Never => Some(e.source),
            // One listing confirms the copies of the whole directory.
            Revalidate::Within(d) => {
                Some(inner.confirmed_identity(key, rel, &e, d).map_err(|err| describe_error(&err))?)
            }
            Revalidate::Always => {
                let st = match (parent, inner.storage().posix()) {
                    (Some(d), Some(posix)) => posix
                        .stat_in(&d.file, name)
                        .map(|st| (st.st_mode & libc::S_IFMT == libc::S_IFREG).then(|| SourceId::of_stat(&st))),
                    _ => inner.storage().source().identify(rel).map(Some),
                };
                match st {
                    Ok(sid) => sid, // None: no longer a file, the open that follows says what it is
                    Err(err) if err.raw_os_error() == Some(libc::EISDIR) => None,
                    Err(err) => return Err(describe(&inner.storage().source().path_of(rel), &err)),
                }
            }
        };
        Ok(current.filter(|sid| inner.storage().hit(key, rel, sid, Look::Quiet).is_some()).map(|sid| sid.size))
    }

    /// Whether another node's agent, the file's owner, served it (which caches it, reading the store once
    /// for the whole job; this node keeps a copy only in inclusive mode). When it did not, the store is
    /// asked by the caller.
    fn served_by_owner(&self, key: &Key, rel: &str) -> bool {
        let inner = &self.inner;
        if inner.peers().is_none() {
            return false;
        }
        let Role::Leader(lead) = inner.fetcher().join(key) else { return false };
        let mut known = None;
        // Not served: the lead drops here, before the store is asked.
        let job = FetchJob { rel, purpose: Purpose::Prefetch, seen: now_ns(), lead };
        if inner.ask_peers(job, &mut known).is_err() {
            return false;
        }
        let p = &self.progress;
        let size = known.map_or(0, |sid| sid.size);
        p.bytes_total.fetch_add(size, Ordering::Relaxed);
        p.files_copied.fetch_add(1, Ordering::Relaxed);
        p.handled(size);
        true
    }

    /// An object of an object store: claimed before it is opened, as opening one is a `GET`.
    fn object(&self, key: &Key, rel: &str) {
        let p = &self.progress;
        let path = self.inner.storage().source().path_of(rel);
        let fetcher = self.inner.fetcher();
        let claimed = match fetcher.claim(key, rel) {
            Ok(Some(claimed)) => claimed,
            Ok(None) => return p.handled(0), // cached, or being fetched by another process
            Err(e) => {
                self.record(&path, Err(e));
                return p.handled(0);
            }
        };
        let Ok(_hold) = self.hold(key, rel) else { return };
        match fetcher.prefetch_object(claimed, rel) {
            Ok((sid, fetched)) => {
                p.bytes_total.fetch_add(sid.size, Ordering::Relaxed);
                self.record(&path, Ok(fetched));
                p.handled(sid.size);
            }
            Err(e) => {
                self.record(&path, Err(e));
                p.handled(0);
            }
        }
    }

    /// A POSIX entry: claimed, opened (beneath its directory's handle when the walk has one), identified
    /// from the open descriptor, and copied; a directory the listing did not type is walked.
    fn posix_file(&self, parent: Option<Arc<DirHandle>>, name: &OsString, key: &Key, rel: String) {
        let (inner, p) = (&self.inner, &self.progress);
        let path = inner.storage().source().path_of(&rel);
        let seen = now_ns();
        // Claimed before it is opened: a file a reader is fetching, or fetched since `entry` looked, is
        // left alone rather than opened again.
        let claimed = match inner.fetcher().claim(key, &rel) {
            Ok(Some(claimed)) => claimed,
            Ok(None) => return p.handled(0),
            Err(e) => {
                self.record(&path, Err(e));
                return p.handled(0);
            }
        };
        let Ok(_hold) = self.hold(key, &rel) else { return };
        let opened = match (&parent, inner.storage().posix()) {
            (Some(d), Some(posix)) => posix.open_in(&d.file, name).map(SourceFile::Posix),
            _ => inner.storage().source().open(&rel),
        };
        let identified = opened
            .and_then(|f| inner.storage().source().identify_opened(&f, &rel).map(|(sid, is_dir)| (f, sid, is_dir)));
        let (file, sid, is_dir) = match identified {
            Ok(x) => x,
            Err(err) => {
                p.fail(describe(&path, &err));
                return p.handled(0);
            }
        };
        let canonical = sid.attrs.is_some_and(|a| a.canonical);
        if is_dir {
            drop(claimed);
            p.not_a_file();
            // A directory the listing did not type is walked; a symlink to one is not (no loops).
            if let (true, Some(_), Some(dir)) = (canonical, &parent, file.into_file()) {
                self.list(self.handle(dir, rel));
            }
            return;
        }
        if sid.attrs.is_some_and(|a| a.mode & libc::S_IFMT != libc::S_IFREG) {
            return p.not_a_file();
        }
        p.bytes_total.fetch_add(sid.size, Ordering::Relaxed);
        self.record(&path, inner.fetcher().prefetch_file(claimed, &rel, sid, file, seen));
        p.handled(sid.size);
    }

    /// The room held for the claimed file before it is opened, when the caller expects a size (`None`
    /// when it does not, or the key has a stale entry); `Err` when no tier has that room: the file is
    /// left unopened, counted and handled.
    fn hold(&self, key: &Key, rel: &str) -> Result<Option<Hold<'_>>, ()> {
        let Some(size) = self.expected else { return Ok(None) };
        match self.inner.fetcher().hold_room(key, rel, size) {
            Held::Room(hold) => Ok(Some(hold)),
            Held::Stale => Ok(None),
            Held::NoRoom => {
                self.progress.files_no_room.fetch_add(1, Ordering::Relaxed);
                self.progress.handled(0);
                Err(())
            }
        }
    }

    fn record(&self, path: &Path, fetched: Result<Fetched, Error>) {
        let p = &self.progress;
        match fetched {
            Ok(Fetched::Cached) => {
                p.files_copied.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Fetched::NoRoom) => p.fail(format!(
                "{}: not cached, no tier has room (quota reached); raise a tier's quota or add a tier",
                path.display()
            )),
            Ok(Fetched::Uncached) => p.fail(format!(
                "{}: not cached: it changed while it was copied, or a tier failed (see `tierstore status`); run the prefetch again",
                path.display()
            )),
            Ok(Fetched::Reader(_) | Fetched::Streaming(..) | Fetched::Skipped) => {}
            Err(e) => p.fail(describe_error(&e)),
        }
    }
}
