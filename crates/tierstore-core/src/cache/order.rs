//! Ordered prefetch: fetches the files of an epoch in the order they will be read, ahead of the readers,
//! keeping at most a byte budget fetched but not yet read (NoPFS's "clairvoyance").
//!
//! A DataLoader asks for one file at a time per worker, so on a latency-bound store epoch 1 costs a round
//! trip per file. Its sampler knew the whole order before the epoch began: given that order, `jobs`
//! threads of the prefetch's own fetch files in it, so their round trips overlap, and the readers find
//! copies in the tier (or join a fetch in flight) instead of asking the store.
//!
//! Rules, and why:
//! - **In order, within the budget.** A position is admitted (its bytes counted as ahead) only after every
//!   earlier position, and only while the bytes admitted and not yet read, plus its own, fit the budget
//!   (a file larger than the whole budget is admitted alone, or it would never be). So tier use ahead of
//!   the readers stays inside the budget and what is fetched is what is read next.
//! - **Room before the open.** A file's size is known only once it is opened, and opening an object is
//!   already a `GET`; so a position is admitted on the mean size of the files opened before it (the first
//!   alone), then counted at its own size once opened. A file this prefetch opened is always fetched by it:
//!   were it let go while the budget was full, a reader would open it a second time. And the tiers are
//!   asked for room for the estimate before the open (letting go of copies read, below): a file opened
//!   and then found to have no room would be opened again by its reader.
//! - **Reads are learnt from read marks** (see `marks.rs`): readers in any process mark the files they
//!   open; a mark frees the file's bytes from the budget. A file read before the prefetch reached it is
//!   skipped, and the prefetch jumps to the first position not read yet.
//! - **A sample begun is its reader's.** A reader that marks a sample begun (`marks::STARTED`: a
//!   DataLoader worker does, as it comes to each index) opens its files itself, from the store when the
//!   tiers have no room; the prefetch never fetches a begun position, and looks again once it holds the
//!   claim. Without this, a prefetch that waited for room copied files their reader had just read from
//!   the store: 0.6-1.6% more store bytes than no prefetch for a data set twice the tiers. For the same
//!   reason a file is claimed before copies are let go of for it: room let go of for a file its reader
//!   then read from the store stayed empty, and the next epoch began with one copy fewer.
//! - **Through the engine's fetch path, claimed before it is opened.** A worker leads the file's in-process
//!   flight and takes its node-wide fetch lock (with `try_lock` only: a file another process is fetching is
//!   left to it) after its admission and before it opens the file, so a reader that comes while it is
//!   opened waits for this one fetch instead of opening the file again; a reader never waits on the budget,
//!   which is waited for with nothing claimed. The copy is the engine's own (`Fetcher::fetch_locked`). A
//!   reader that waits on it waits for one copy, never a queue.
//! - **Never ahead of a waiting reader.** The copies run on the prefetch's own threads, not on the copy
//!   pool, so the pool's `urgent` queue (what readers wait on) never waits behind a warm-up.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::engine::Inner;
use super::flight::{Lead, Role};
use super::job::Fetched;
use super::job::{FetchJob, Purpose};
use super::lock::FetchGuard;
use super::lookup::Look;
use super::order_files::OrderFiles;
use crate::clock::now_ns;
use crate::error::Error;
use crate::index::{Key, SourceId};
use crate::marks::ReadMarks;
use crate::source::SourceFile;

/// How often a prefetch waiting for room looks at the read marks again: readers in other processes mark
/// with a plain store (no wake-up), and a millisecond is below one round trip to a loaded store.
const POLL: Duration = Duration::from_millis(1);
/// Problems kept for the report; the rest are only counted.
const MAX_ERRORS: usize = 1000;

/// Progress of an ordered prefetch, updated by its workers.
#[derive(Default)]
pub struct OrderProgress {
    /// Positions in the order.
    pub files_total: AtomicU64,
    /// Positions handled (fetched, already cached, read first, left for want of room, or failed).
    pub files_done: AtomicU64,
    /// Files this prefetch fetched from the source into a tier.
    pub files_fetched: AtomicU64,
    /// Bytes of the files this prefetch fetched.
    pub bytes_fetched: AtomicU64,
    /// Files already cached (or being fetched by another process) when the prefetch reached them.
    pub files_cached: AtomicU64,
    /// Files a reader opened before the prefetch reached them.
    pub files_read_first: AtomicU64,
    /// Files that could not be prefetched (each in `errors`).
    pub files_failed: AtomicU64,
    /// Files left to their readers because the tiers had no room for them, even after letting go of copies
    /// this epoch had read: expected of a data set larger than the tiers, so counted, not an error (a
    /// reader fetches such a file itself, as without a prefetch).
    pub files_no_room: AtomicU64,
    /// Bytes admitted ahead of the readers and not read yet, now.
    pub bytes_ahead: AtomicU64,
    /// The most bytes ever ahead of the readers: at most the budget (or one file larger than it), where
    /// files are as large as the mean of those before them (see the module's rules).
    pub max_bytes_ahead: AtomicU64,
    /// Positions before this one have all been read.
    pub position: AtomicU64,
    /// Every problem met (up to a thousand), each naming the file and what to do.
    pub errors: Mutex<Vec<String>>,
    running: AtomicUsize,
}

impl OrderProgress {
    /// True when every worker has left (the order is done, or the prefetch was stopped).
    pub fn finished(&self) -> bool {
        self.running.load(Ordering::Acquire) == 0
    }

    /// A copy of the problems met so far.
    pub fn errors(&self) -> Vec<String> {
        self.errors.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn fail(&self, message: String) {
        self.files_failed.fetch_add(1, Ordering::Relaxed);
        let mut errors = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        if errors.len() < MAX_ERRORS {
            errors.push(message);
        }
    }
}

/// Where an order's reads are recorded: the marks file, the slot of each position, and this epoch's tag.
pub struct ReadLog {
    /// The shared marks.
    pub marks: Arc<ReadMarks>,
    /// The slot of each position of the order.
    pub slots: Vec<u32>,
    /// The value a read of this epoch stores into its slot (never 0, which a new file holds).
    pub tag: u32,
}

#[derive(Default)]
struct State {
    /// The next position a worker takes.
    next: usize,
    /// Positions before this one have passed admission (in order).
    admitted: usize,
    /// Positions admitted and not known to be read: (slot, bytes).
    held: VecDeque<(u32, u64)>,
    /// Bytes of `held`.
    ahead: u64,
    /// Positions before this one are all read.
    low: usize,
    /// Files opened so far, and their bytes: their mean is what a position is admitted on.
    sized: u64,
    sized_bytes: u64,
    stopped: bool,
}

impl State {
    /// The bytes a position not opened yet is admitted on: the mean size of the files opened so far;
    /// `None` before the first.
    fn estimate(&self) -> Option<u64> {
        (self.sized > 0).then(|| self.sized_bytes / self.sized)
    }
}

/// Starts `jobs` workers on `shared`. Workers that could not be started are accounted as gone, so that the
/// handle does not wait for them; none at all is an error.
fn spawn_workers(shared: &Arc<Shared>, jobs: usize) -> Result<(), Error> {
    shared.progress.running.store(jobs, Ordering::Release);
    for i in 0..jobs {
        let s = shared.clone();
        let spawned = crate::interposer::spawn(format!("tierstore-order-{i}"), move || {
            // A panic must not leave the prefetch running forever in the eyes of its handle.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.work()));
            s.leave();
        });
        if let Err(e) = spawned {
            for _ in i..jobs {
                shared.leave();
            }
            if i == 0 {
                return Err(Error::Tier {
                    path: shared.inner.storage().config().tiers[0].path.clone(),
                    message: format!("cannot start a prefetch thread: {e}"),
                });
            }
            break;
        }
    }
    Ok(())
}

/// With `revalidate = "always"` the reader's open asks the source about a cached copy anyway (one request
/// per open is what that mode promises): the prefetch leaves cached files to it rather than asking a second
/// time. A copy the source has replaced is then fetched by the reader's open, not ahead of it.
fn left_to_reader(inner: &Inner) -> bool {
    inner.storage().config().revalidate == crate::config::Revalidate::Always
}

struct Shared {
    inner: Arc<Inner>,
    /// The files the order draws from, and the file of each position.
    files: Arc<OrderFiles>,
    order: Vec<u32>,
    /// Positions whose file a tier held, trusted without asking the source, when the prefetch started:
    /// never taken by a worker, and passed over by admission. A warm epoch so costs an index lookup per
    /// file, once, instead of a walk of the whole order beside the readers.
    cached: Vec<bool>,
    log: ReadLog,
    budget: u64,
    state: Mutex<State>,
    turn: Condvar,
    progress: Arc<OrderProgress>,
    /// Positions before this one were looked at for copies to let go of (`let_go`).
    let_go_from: Mutex<usize>,
    /// Bytes of the files workers found room for and have not placed yet (`room_before_open`): the room
    /// one worker saw is not promised to the next.
    opening: Mutex<u64>,
}

/// A running ordered prefetch. Dropping the handle stops it (files under way finish).
pub struct OrderedPrefetch {
    shared: Arc<Shared>,
}

impl OrderedPrefetch {
    /// Starts `jobs` threads fetching the files of `order` (numbers of `files`) in that order within
    /// `budget` bytes ahead of the reads recorded in `log`.
    pub(super) fn start(
        inner: Arc<Inner>,
        files: Arc<OrderFiles>,
        order: Vec<u32>,
        log: ReadLog,
        budget: u64,
        jobs: usize,
    ) -> Result<OrderedPrefetch, Error> {
        let progress = Arc::new(OrderProgress::default());
        progress.files_total.store(order.len() as u64, Ordering::Relaxed);
        let cached = files.cached(&inner, &order, left_to_reader(&inner));
        let warm = cached.iter().filter(|c| **c).count() as u64;
        progress.files_cached.store(warm, Ordering::Relaxed);
        progress.files_done.store(warm, Ordering::Relaxed);
        let cold = order.len() - warm as usize;
        let jobs = jobs.clamp(1, super::prefetch::MAX_JOBS).min(cold.max(1));
        let state = Mutex::new(State::default());
        let let_go_from = Mutex::new(0);
        let shared = Arc::new(Shared {
            inner,
            files,
            order,
            cached,
            log,
            budget,
            state,
            turn: Condvar::new(),
            progress,
            let_go_from,
            opening: Mutex::new(0),
        });
        spawn_workers(&shared, jobs)?;
        Ok(OrderedPrefetch { shared })
    }

    /// The progress counters, brought up to the reads recorded so far: the workers update them only when
    /// they take or admit a file, so after the last one the readers' later reads would not show.
    pub fn progress(&self) -> Arc<OrderProgress> {
        let mut s = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
        self.shared.refresh(&mut s);
        self.shared.progress.clone()
    }

    /// The marks file readers in other processes record their reads in.
    pub fn marks_path(&self) -> &Path {
        self.shared.log.marks.path()
    }

    /// Records that the file at `position` of the order was read (from this process).
    pub fn mark_read(&self, position: usize) {
        if let Some(&slot) = self.shared.log.slots.get(position) {
            self.shared.log.marks.mark(slot as usize, self.shared.log.tag);
            self.shared.turn.notify_all();
        }
    }

    /// Records that every file before `position` was read (a reader that goes strictly in order).
    pub fn advance(&self, position: usize) {
        let log = &self.shared.log;
        let start = self.shared.progress.position.load(Ordering::Acquire) as usize;
        for &slot in log.slots.iter().take(position).skip(start) {
            log.marks.mark(slot as usize, log.tag);
        }
        self.shared.turn.notify_all();
    }

    /// Stops taking new files; files under way finish.
    pub fn stop(&self) {
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner()).stopped = true;
        self.shared.turn.notify_all();
    }

    /// Blocks until every worker has left, or `timeout` passes; returns whether they all left.
    pub fn wait(&self, timeout: Option<Duration>) -> bool {
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        let mut g = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
        while !self.shared.progress.finished() {
            if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                return false;
            }
            g = self.shared.turn.wait_timeout(g, Duration::from_millis(20)).unwrap_or_else(|p| p.into_inner()).0;
        }
        true
    }
}

impl Drop for OrderedPrefetch {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Shared {
    /// The source-relative path of the file at `position`.
    fn rel(&self, position: usize) -> &str {
        self.files.rel(self.order[position])
    }

    /// The key of the file at `position`.
    fn key(&self, position: usize) -> &Key {
        self.files.key(self.order[position])
    }

    fn read(&self, position: usize) -> bool {
        self.log.marks.is_marked(self.log.slots[position] as usize, self.log.tag)
    }

    /// Whether the reader of `position` has begun it (or read it): it opens the file itself, so a fetch
    /// now would read the file from the store a second time.
    fn started(&self, position: usize) -> bool {
        self.log.marks.is_started(self.log.slots[position] as usize, self.log.tag)
    }

    /// The counter for a position the prefetch gave up: read first when its reader has begun it (and
    /// opens it itself), else left for want of room.
    fn left_counter(&self, position: usize) -> &AtomicU64 {
        let p = &self.progress;
        if self.started(position) {
            &p.files_read_first
        } else {
            &p.files_no_room
        }
    }

    /// Frees the bytes of held files that have been read, and moves the read position (and the next
    /// position to take, so that a prefetch the readers overtook goes on ahead of them).
    fn refresh(&self, s: &mut State) {
        let (marks, tag) = (&self.log.marks, self.log.tag);
        let before = s.held.len();
        if before > 0 {
            let mut freed = 0;
            s.held.retain(|&(slot, size)| {
                let read = marks.is_marked(slot as usize, tag);
                if read {
                    freed += size;
                }
                !read
            });
            if s.held.len() != before {
                s.ahead -= freed;
                self.progress.bytes_ahead.store(s.ahead, Ordering::Relaxed);
            }
        }
        while s.low < self.order.len() && self.read(s.low) {
            s.low += 1;
        }
        self.progress.position.store(s.low as u64, Ordering::Relaxed);
        // Files the readers overtook are never taken: they are done, read first (a cached one was
        // counted done at the start).
        if s.next < s.low {
            let overtaken = (s.next..s.low).filter(|&p| !self.cached[p]).count() as u64;
            self.progress.files_done.fetch_add(overtaken, Ordering::Relaxed);
            self.progress.files_read_first.fetch_add(overtaken, Ordering::Relaxed);
            s.next = s.low;
        }
    }

    /// Waits for `position`'s turn in order. With `wanted`, also for room in the budget, and admits it on
    /// its estimated size (see the module's rules), returning the bytes reserved; without, passes it.
    /// `None` when the position needs no fetch (read meanwhile, or the prefetch stopped). Nothing is
    /// claimed while this waits, so a reader never waits on the budget.
    fn admit(&self, position: usize, wanted: bool) -> Option<u64> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            self.refresh(&mut s);
            if s.stopped {
                return None;
            }
            // Positions the readers passed, and those cached at the start, are never waited for.
            s.admitted = s.admitted.max(s.low);
            while s.admitted < self.order.len() && self.cached[s.admitted] {
                s.admitted += 1;
            }
            if s.admitted > position {
                return None;
            }
            if s.admitted == position {
                if !wanted || self.started(position) {
                    s.admitted += 1;
                    self.turn.notify_all();
                    return None;
                }
                // Before the first size is known, one file at a time: its open tells the mean.
                let room = match s.estimate() {
                    Some(size) => s.ahead == 0 || s.ahead + size <= self.budget,
                    None => s.held.is_empty(),
                };
                if room {
                    let size = s.estimate().unwrap_or(0);
                    s.admitted += 1;
                    s.held.push_back((self.log.slots[position], size));
                    s.ahead += size;
                    self.show_ahead(&s);
                    self.turn.notify_all();
                    return Some(size);
                }
            }
            s = self.turn.wait_timeout(s, POLL).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Counts an admitted file at its own size, now that its open said it, instead of the `reserved`
    /// estimate; the size joins the mean later positions are admitted on.
    fn settle(&self, position: usize, reserved: u64, size: u64) {
        let slot = self.log.slots[position];
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.sized += 1;
        s.sized_bytes += size;
        if let Some(held) = s.held.iter_mut().find(|(sl, sz)| *sl == slot && *sz == reserved) {
            held.1 = size;
            s.ahead = s.ahead - reserved + size;
            self.show_ahead(&s);
        }
        self.turn.notify_all();
    }

    fn show_ahead(&self, s: &State) {
        self.progress.bytes_ahead.store(s.ahead, Ordering::Relaxed);
        self.progress.max_bytes_ahead.fetch_max(s.ahead, Ordering::Relaxed);
    }

    /// Leads the in-process flight of `key` and holds its node-wide fetch lock; `None` when another
    /// thread or process is fetching it, or a reader is reading it from the store.
    fn claim(&self, key: &Key) -> Option<Claim> {
        let Role::Leader(lead) = self.inner.fetcher().join(key) else { return None };
        match self.inner.fetcher().lock_to_prefetch(key) {
            Ok(Some(guard)) => Some(Claim { lead, guard }),
            _ => None,
        }
    }

    /// Gives back the budget of an admitted file that was not fetched (it failed).
    fn release(&self, position: usize, size: u64) {
        let slot = self.log.slots[position];
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = s.held.iter().position(|&(sl, sz)| sl == slot && sz == size) {
            s.held.remove(i);
            s.ahead -= size;
            self.progress.bytes_ahead.store(s.ahead, Ordering::Relaxed);
        }
        self.turn.notify_all();
    }

    fn take(&self) -> Option<usize> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        self.refresh(&mut s);
        while s.next < self.order.len() && self.cached[s.next] {
            s.next += 1;
        }
        if s.stopped || s.next >= self.order.len() {
            return None;
        }
        let p = s.next;
        s.next += 1;
        Some(p)
    }

    fn leave(&self) {
        self.progress.running.fetch_sub(1, Ordering::AcqRel);
        self.turn.notify_all();
    }

    fn work(&self) {
        while let Some(position) = self.take() {
            self.one(position);
            self.progress.files_done.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Handles one position of the order: admitted, then claimed, opened and copied.
    fn one(&self, position: usize) {
        let inner = &self.inner;
        let p = &self.progress;
        let (rel, key) = (self.rel(position), *self.key(position));
        let skip = |counter: &AtomicU64| {
            counter.fetch_add(1, Ordering::Relaxed);
            self.admit(position, false);
        };
        if self.started(position) {
            return skip(&p.files_read_first);
        }
        if self.held(&key, rel) {
            return skip(&p.files_cached);
        }
        let Some(reserved) = self.admit(position, true) else {
            if self.started(position) {
                p.files_read_first.fetch_add(1, Ordering::Relaxed);
            }
            return;
        };
        let (opening, Claim { lead, guard }) = match self.room_before_open(position, &key, reserved) {
            Room::Found(opening, claim) => (opening, claim),
            Room::ReadFirst => {
                self.release(position, reserved);
                self.left_counter(position).fetch_add(1, Ordering::Relaxed);
                return;
            }
            Room::Claimed => {
                // Being fetched by a reader or another process: it lands ahead all the same.
                p.files_cached.fetch_add(1, Ordering::Relaxed);
                return;
            }
        };
        if self.started(position) {
            // Its reader began it while this waited for room: it opens the file itself, as it may have
            // already (from the store, when the tiers had no room), and this would read it a second time.
            // Looked at once the claim is held: a reader that begins after this waits for this fetch.
            drop((guard, lead));
            self.release(position, reserved);
            p.files_read_first.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if self.held(&key, rel) {
            // A reader fetched it while this waited for room: it is published, and the claim came after.
            drop((guard, lead));
            p.files_cached.fetch_add(1, Ordering::Relaxed);
            return;
        }
        // Identified from the open descriptor (one open): the budget counts the file at its size.
        let seen = now_ns();
        let (sid, file) = match inner.storage().open_identified(rel) {
            Ok(x) => x,
            Err(e) => {
                self.release(position, reserved);
                drop((guard, lead));
                p.fail(describe(&e));
                return;
            }
        };
        self.settle(position, reserved, sid.size);
        let job = FetchJob { rel, purpose: Purpose::Prefetch, seen, lead };
        self.copy(position, job, sid, guard, file, opening);
    }

    /// Waits until a tier has room for about `size` bytes (the position's estimate), with nothing opened:
    /// opening first and finding no room would cost the store an open that the reader then makes again.
    /// While the tiers have room, nothing is claimed either. When they have none, the file is claimed
    /// before copies this epoch has read are let go of for it, and it is looked at once more: a reader that
    /// began it meanwhile reads it itself, and nothing was let go of for it (room freed for a file its
    /// reader then reads from the store would stay empty to the end of the epoch, and the next epoch would
    /// begin with one copy fewer than the tiers hold without a prefetch); a reader that begins it after
    /// waits for this one fetch. The claim is held only while letting go, never while waiting. Room found,
    /// the file is claimed (when it was not to let go): `Claimed` when another thread or process has it.
    fn room_before_open(&self, position: usize, key: &Key, size: u64) -> Room<'_> {
        loop {
            if self.started(position) || self.stopped() {
                return Room::ReadFirst;
            }
            if let Some(opening) = self.opening(size) {
                return self.claim(key).map_or(Room::Claimed, |claim| Room::Found(opening, claim));
            }
            let Some(claim) = self.claim(key) else { return Room::Claimed };
            if self.started(position) {
                return Room::ReadFirst;
            }
            if self.let_go(position, size) {
                if let Some(opening) = self.opening(size) {
                    return Room::Found(opening, claim);
                }
            }
            drop(claim);
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Room for about `size` more bytes than the workers about to open files already counted on.
    fn opening(&self, size: u64) -> Option<Opening<'_>> {
        let mut opening = self.opening.lock().unwrap_or_else(|p| p.into_inner());
        self.inner.fetcher().has_room(*opening + size).then(|| {
            *opening += size;
            Opening { shared: self, size }
        })
    }

    /// Whether a tier holds `rel` already: that costs the index lookup (and one `stat` when copies are
    /// revalidated), not a fetch, and no budget.
    fn held(&self, key: &Key, rel: &str) -> bool {
        let inner = &self.inner;
        inner.storage().lookup().published(key, rel).is_some()
            && (left_to_reader(inner)
                || inner
                    .known_identity(key, rel)
                    .ok()
                    .flatten()
                    .is_some_and(|sid| inner.storage().hit(key, rel, &sid, Look::Quiet).is_some()))
    }

    /// Copies the file at `position`, admitted to the budget, and counts what came of it; a copy that
    /// did not land gives its bytes back to the budget.
    fn copy(
        &self,
        position: usize,
        job: FetchJob<'_>,
        sid: SourceId,
        guard: FetchGuard,
        file: SourceFile,
        opening: Opening<'_>,
    ) {
        let (inner, p, rel, seen) = (&self.inner, &self.progress, job.rel, job.seen);
        // The file stays open through a first attempt that finds no room: the second copies from it.
        let mut file = Some(file);
        // Once placed, or found no room, the room this worker saw is the index's to say.
        let mut fetched = inner.fetcher().fetch_locked_then(job, sid, guard, &mut file, || drop(opening));
        // Tiers that keep what they hold and are full: wait for the readers to pass copies this epoch has
        // read, let go of them and try again; until a reader gets to the file first, or the prefetch is
        // stopped, or room let go of was taken three times over by others.
        // Claimed before letting go, as in `room_before_open`.
        let mut taken = 0;
        while matches!(fetched, Ok(Fetched::NoRoom)) && taken < 3 && !self.started(position) && !self.stopped() {
            let Some(Claim { lead, guard }) = self.claim(self.key(position)) else { break };
            if self.started(position) {
                break; // its reader began it meanwhile, and reads it from the store itself (see `one`)
            }
            if !self.let_go(position, sid.size) {
                drop((guard, lead));
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            let job = FetchJob { rel, purpose: Purpose::Prefetch, seen, lead };
            fetched = inner.fetcher().fetch_locked(job, sid, guard, &mut file);
            taken += 1;
        }
        match fetched {
            Ok(Fetched::Cached) => {
                p.files_fetched.fetch_add(1, Ordering::Relaxed);
                p.bytes_fetched.fetch_add(sid.size, Ordering::Relaxed);
            }
            Ok(Fetched::Skipped | Fetched::Reader(_) | Fetched::Streaming(..)) => {
                p.files_cached.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Fetched::NoRoom) => {
                self.release(position, sid.size);
                self.left_counter(position).fetch_add(1, Ordering::Relaxed);
            }
            Ok(Fetched::Uncached) => {
                self.release(position, sid.size);
                p.fail(format!(
                    "{}: not prefetched: it changed while it was copied, or a tier failed (see `tierstore status`)",
                    inner.storage().source().path_of(rel).display()
                ));
            }
            Err(e) => {
                self.release(position, sid.size);
                p.fail(describe(&e));
            }
        }
    }
}

impl Shared {
    /// The tiers have no room for `size` more bytes and keep what they hold (the default placement,
    /// `fill`, never evicts): lets go of copies of files this epoch has already read, earliest in the
    /// order first, until `size` bytes are freed. An epoch in a random order reads each file once, so
    /// those are the copies it needs least, and a data set larger than the tiers is still fetched ahead
    /// of its readers in every epoch (MONARCH's one exception to keeping what it placed). A copy being
    /// fetched, or held by another process's fetch lock, is passed over. Returns whether any was let go.
    fn stopped(&self) -> bool {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).stopped
    }

    fn let_go(&self, position: usize, size: u64) -> bool {
        let inner = &self.inner;
        let mut from = self.let_go_from.lock().unwrap_or_else(|p| p.into_inner());
        let mut freed = 0;
        // Positions before `from` are settled (let go, or not held); an unread one is looked at again
        // next time, since the readers are about to reach it.
        let mut unread = None;
        for p in *from..position {
            if freed >= size {
                unread = unread.or(Some(p));
                break;
            }
            if !self.read(p) {
                unread = unread.or(Some(p));
                continue;
            }
            freed += inner.fetcher().let_go(self.key(p), self.rel(p));
        }
        *from = unread.unwrap_or(position.max(*from));
        if freed > 0 {
            log::debug!("ordered prefetch: let go of {freed} B of copies read this epoch, for room");
        }
        freed > 0
    }
}

/// What a worker found when it looked for room for a file it is about to open.
enum Room<'a> {
    /// Room, and the file's claim.
    Found(Opening<'a>, Claim),
    /// Its reader began the file first (or the prefetch stopped).
    ReadFirst,
    /// Another thread or process is fetching the file.
    Claimed,
}

/// Room a worker found for a file it is about to open and place, counted in `Shared::opening` until it
/// is dropped.
struct Opening<'a> {
    shared: &'a Shared,
    size: u64,
}

impl Drop for Opening<'_> {
    fn drop(&mut self) {
        let mut opening = self.shared.opening.lock().unwrap_or_else(|p| p.into_inner());
        *opening = opening.saturating_sub(self.size);
    }
}

/// A file claimed for fetching: its node-wide fetch lock (held) and its in-process flight (led). Dropped
/// unused, it releases the lock, then lands the flight (fields drop in this order).
struct Claim {
    guard: FetchGuard,
    lead: Lead,
}

fn describe(e: &Error) -> String {
    match e {
        Error::Io { path, source } if source.kind() == std::io::ErrorKind::NotFound => {
            format!("{}: not found on the store; remove it from the order, or check the path", path.display())
        }
        other => format!("{other}; not prefetched (a read of it will fetch it)"),
    }
}
