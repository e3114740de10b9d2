//! The background copy pool: writes fetched bytes into tiers, off the reader's path.
//!
//! One queue, in order: the copies of large files that readers follow, and the publishes of small files
//! that other processes wait for. Prefetches copy on workers of their own (`prefetch.rs`, `order.rs`),
//! so a warm-up never queues ahead of a read.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Queues {
    urgent: VecDeque<Job>,
    running: usize,
    stopping: bool,
}

struct Shared {
    queues: Mutex<Queues>,
    work: Condvar,
    idle: Condvar,
}

/// A fixed set of worker threads with one queue.
pub struct Pool {
    shared: Arc<Shared>,
    size: usize,
    /// Started with the first job: a process that only reads cached files (a DataLoader worker after
    /// the first epoch, one per epoch when workers are not persistent) never needs them.
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Pool {
    /// A pool of `threads` workers, started when the first job is queued.
    pub fn new(threads: usize) -> Pool {
        let shared =
            Arc::new(Shared { queues: Mutex::new(Queues::default()), work: Condvar::new(), idle: Condvar::new() });
        Pool { shared, size: threads.max(1), threads: Mutex::new(Vec::new()) }
    }

    fn start(&self) {
        let mut threads = self.threads.lock().expect("pool threads lock");
        if !threads.is_empty() {
            return;
        }
        for i in 0..self.size {
            let s = self.shared.clone();
            let t =
                crate::interposer::spawn(format!("tierstore-copy-{i}"), move || worker(&s)).expect("spawn copy thread");
            threads.push(t);
        }
    }

    /// Queues a job that a reader is waiting on.
    pub fn urgent(&self, job: impl FnOnce() + Send + 'static) {
        self.start();
        self.shared.queues.lock().expect("pool lock").urgent.push_back(Box::new(job));
        self.shared.work.notify_one();
    }

    /// Blocks until the queue is empty and no job runs.
    pub fn wait_idle(&self) {
        let mut q = self.shared.queues.lock().expect("pool lock");
        while q.running > 0 || !q.urgent.is_empty() {
            q = self.shared.idle.wait(q).expect("pool lock");
        }
    }

    /// Jobs queued or running.
    pub fn pending(&self) -> usize {
        let q = self.shared.queues.lock().expect("pool lock");
        q.running + q.urgent.len()
    }
}

fn worker(s: &Shared) {
    loop {
        let job = {
            let mut q = s.queues.lock().expect("pool lock");
            loop {
                if let Some(j) = q.urgent.pop_front() {
                    q.running += 1;
                    break j;
                }
                if q.stopping {
                    return;
                }
                q = s.work.wait(q).expect("pool lock");
            }
        };
        // A panicking job must not take the worker (and the jobs behind it) down with it.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
        let mut q = s.queues.lock().expect("pool lock");
        q.running -= 1;
        if q.running == 0 && q.urgent.is_empty() {
            s.idle.notify_all();
        }
    }
}

impl Drop for Pool {
    /// Finishes queued copies before the pool goes, so that a clean exit leaves them published.
    fn drop(&mut self) {
        self.shared.queues.lock().expect("pool lock").stopping = true;
        self.shared.work.notify_all();
        for t in self.threads.get_mut().unwrap_or_else(|p| p.into_inner()).drain(..) {
            let _ = t.join();
        }
    }
}
