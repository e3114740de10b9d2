//! A thin, fork-aware wrapper over LMDB (the C library that `heed` also wraps).
//!
//! Why not `heed` itself: heed keeps a process-global registry of opened environments and refuses to open
//! a path twice. LMDB's rule is the opposite of what a forked PyTorch DataLoader worker needs: an
//! environment inherited through `fork()` must not be used, and the child must open its own. heed gives no
//! way to forget the inherited handle, so the child could never reopen the index. This wrapper exposes
//! exactly the calls the index uses, and [`Env::forget`] leaks an inherited handle instead of closing it.
//!
//! A deadline on the write lock of a durable environment (the write-back journal). LMDB's writer lock is
//! a mutex in the shared lock file with no timed wait: a process stopped (SIGSTOP, a debugger) or stuck
//! inside a write transaction would leave every other process of the node waiting on it forever, and the
//! journal's writers do I/O inside theirs (the agent publishes a file on the store under the lock). So
//! each of its write transactions is taken under a `flock` of `writer.lock` beside the environment
//! first, waited for at most [`WRITE_WITHIN`]: LMDB's own mutex is then only ever contended between
//! threads of one process. The index's write transactions touch only the map and the node's own tier
//! (an evicted copy's unlink) and are the densest (one or two per fetch, from every worker of a job at
//! once): there the second lock cost 4 processes fetching 1 KiB files 1.08-1.47x the CPU time (10 paired
//! rounds), so the index keeps LMDB's mutex alone, without a deadline. Opening an environment whose
//! databases exist takes no write lock at all (the handles are opened in a read transaction).

use std::ffi::CString;
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::ptr;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use lmdb_master_sys as ffi;

/// An LMDB failure: the library's code and its message.
#[derive(Debug, thiserror::Error)]
#[error("LMDB {op}: {message} (code {code})")]
pub struct LmdbError {
    /// The LMDB call that failed.
    pub op: &'static str,
    /// LMDB's error code (negative) or an errno (positive).
    pub code: i32,
    /// LMDB's description of the code.
    pub message: String,
}

impl LmdbError {
    fn new(op: &'static str, code: i32) -> Self {
        // SAFETY: mdb_strerror returns a pointer to a static string for every code.
        let message = unsafe { std::ffi::CStr::from_ptr(ffi::mdb_strerror(code)) }.to_string_lossy().into_owned();
        LmdbError { op, code, message }
    }

    /// A failure to open or take `writer.lock`: its errno, else `ETIMEDOUT` for a deadline passed and
    /// `EIO` for a file refused (not the user's own, say).
    fn writer_lock(e: std::io::Error) -> Self {
        let fallback = if e.kind() == std::io::ErrorKind::TimedOut { libc::ETIMEDOUT } else { libc::EIO };
        LmdbError { op: "writer_lock", code: e.raw_os_error().unwrap_or(fallback), message: e.to_string() }
    }

    /// True when the environment's map is full (the index needs a larger map).
    pub fn is_map_full(&self) -> bool {
        self.code == ffi::MDB_MAP_FULL
    }
}

fn check(op: &'static str, rc: i32) -> Result<(), LmdbError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(LmdbError::new(op, rc))
    }
}

/// An open LMDB environment with a fixed set of named databases.
pub struct Env {
    raw: *mut ffi::MDB_env,
    dbs: Vec<ffi::MDB_dbi>,
    /// Read transactions that ended, reset and kept with their reader slot: beginning a read transaction
    /// takes a slot under a mutex shared by every process of the node (all the workers of a DataLoader
    /// contend for it on every lookup), renewing a reset one does not (LMDB's `mdb_txn_reset` /
    /// `mdb_txn_renew`).
    spare: Mutex<Vec<SpareTxn>>,
    /// The process that opened the environment: only it may renew the spare transactions (a reset
    /// transaction's reader slot belongs to its process; one inherited through `fork()` is never used).
    pid: u32,
    /// A durable environment's `writer.lock`, held through every write transaction.
    writer: Option<WriterLock>,
}

/// `writer.lock` (see the module's documentation); the mutex keeps this process's threads in turn, since
/// they share the descriptor and with it the `flock`.
struct WriterLock {
    file: Mutex<File>,
    path: PathBuf,
}

/// How long a write transaction waits for another process's (see the module's documentation) before it
/// fails with an error that names the lock file: far longer than any commit takes, even one fsynced on a
/// busy disk.
pub const WRITE_WITHIN: Duration = Duration::from_secs(30);

/// The name of the write lock's file in the environment's directory.
pub const WRITER_LOCK: &str = "writer.lock";

/// The write lock held for a write transaction; released when the transaction has ended.
struct Writing<'env>(MutexGuard<'env, File>);

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        crate::flock::unlock(&self.0);
    }
}

/// A reset read transaction (see [`Env::spare`]).
struct SpareTxn(*mut ffi::MDB_txn);

// SAFETY: with `MDB_NOTLS` a read transaction is not tied to a thread; a spare one is used by one
// transaction at a time (it is popped from the list under its lock).
unsafe impl Send for SpareTxn {}

/// How many reset read transactions an environment keeps (each holds one of the node's reader slots,
/// `maxreaders`, while its process lives): a process rarely reads with more threads at once.
const SPARE_MAX: usize = 4;

// SAFETY: an MDB_env is thread-safe; transactions are confined to their creating thread by `NOTLS`
// read transactions and by LMDB's own writer mutex.
unsafe impl Send for Env {}
unsafe impl Sync for Env {}

impl Env {
    /// Opens (creating if needed) the environment in directory `dir` with the named databases.
    ///
    /// `NOSYNC`: the index describes a cache, so losing the last transactions in a power cut is fine (the
    /// entries are validated against the source and their own size on every open); a process crash loses
    /// nothing because LMDB writes land in the page cache.
    pub fn open(dir: &Path, map_size: usize, names: &[&str]) -> Result<Env, LmdbError> {
        Self::open_flags(dir, map_size, names, ffi::MDB_NOSYNC, None)
    }

    /// Like [`Env::open`], but every commit is fsynced before it returns: for records that must survive
    /// a power cut (the write-back journal, whose entries stand for bytes the program was told are safe).
    /// Its write transactions wait for another process's at most [`WRITE_WITHIN`].
    pub fn open_durable(dir: &Path, map_size: usize, names: &[&str]) -> Result<Env, LmdbError> {
        let path = dir.join(WRITER_LOCK);
        // 0600, this user's own, never through a link, like the directory (see `private`).
        let file = crate::private::open_own_file(&path).map_err(LmdbError::writer_lock)?;
        Self::open_flags(dir, map_size, names, 0, Some(WriterLock { file: Mutex::new(file), path }))
    }

    fn open_flags(
        dir: &Path,
        map_size: usize,
        names: &[&str],
        sync: u32,
        writer: Option<WriterLock>,
    ) -> Result<Env, LmdbError> {
        let mut raw = ptr::null_mut();
        // SAFETY: plain FFI calls on a handle we own; on failure the handle is closed before returning.
        unsafe {
            check("env_create", ffi::mdb_env_create(&mut raw))?;
            let mut env =
                Env { raw, dbs: Vec::new(), spare: Mutex::new(Vec::new()), pid: crate::process::pid(), writer };
            check("env_set_mapsize", ffi::mdb_env_set_mapsize(raw, map_size))?;
            check("env_set_maxdbs", ffi::mdb_env_set_maxdbs(raw, names.len() as u32 + 1))?;
            check("env_set_maxreaders", ffi::mdb_env_set_maxreaders(raw, 1024))?;
            let c_path = CString::new(dir.as_os_str().as_bytes()).expect("path without NUL bytes");
            let flags = sync | ffi::MDB_NOTLS;
            // 0600: an index names every file its user cached (its directory is private too, see `private`).
            // Its data file is written for the life of the process: out of the numbers a program names.
            check("env_open", crate::interposer::lasting(|| ffi::mdb_env_open(raw, c_path.as_ptr(), flags, 0o600)))?;
            // LMDB opens the data file without O_CLOEXEC (its lock file and sync descriptor have it): every
            // program this process executes (`tierstore run`'s job, a subprocess) would inherit a writable
            // descriptor of the index.
            let mut fd = -1;
            if ffi::mdb_env_get_fd(raw, &mut fd) == 0 && fd >= 0 {
                libc::fcntl(fd, libc::F_SETFD, libc::fcntl(fd, libc::F_GETFD) | libc::FD_CLOEXEC);
            }
            // Databases that exist are opened in a read transaction, without the write lock, so that
            // opening never waits for another process's write; only creating them takes it.
            env.dbs = match env.open_dbs(names, false)? {
                Some(dbs) => dbs,
                None => env.open_dbs(names, true)?.expect("created"),
            };
            // Readers left by processes that died (SIGKILL) would pin old pages forever.
            let mut dead = 0;
            ffi::mdb_reader_check(raw, &mut dead);
            Ok(env)
        }
    }

    /// Opens the named databases in one transaction: a read-only one, or with `create` a write
    /// transaction that creates those missing. `None` when one does not exist and `create` is false.
    fn open_dbs(&self, names: &[&str], create: bool) -> Result<Option<Vec<ffi::MDB_dbi>>, LmdbError> {
        let (txn, dbi_flags) =
            if create { (self.write()?, ffi::MDB_CREATE) } else { (self.begin(ffi::MDB_RDONLY)?, 0) };
        let mut dbs = Vec::with_capacity(names.len());
        for name in names {
            let c_name = CString::new(*name).expect("database name without NUL bytes");
            let mut dbi = 0;
            // SAFETY: a live transaction of this environment; the name is NUL-terminated.
            match unsafe { ffi::mdb_dbi_open(txn.raw, c_name.as_ptr(), dbi_flags, &mut dbi) } {
                0 => dbs.push(dbi),
                ffi::MDB_NOTFOUND => return Ok(None), // the transaction aborts, and its handles close
                rc => return Err(LmdbError::new("dbi_open", rc)),
            }
        }
        // A commit, read-only too, keeps the handles opened in the transaction for the environment.
        txn.commit()?;
        Ok(Some(dbs))
    }

    /// Leaks this handle without closing it: the only safe thing to do with an environment inherited
    /// through `fork()` (closing it would touch the parent's lock table).
    pub fn forget(self) {
        std::mem::forget(self);
    }

    /// The database handle of the `i`-th name given to [`Env::open`].
    pub fn db(&self, i: usize) -> Db {
        Db(self.dbs[i])
    }

    /// Starts a read-only transaction (no lock taken; a reader slot is used until it ends, and kept
    /// for the next one).
    pub fn read(&self) -> Result<Txn<'_>, LmdbError> {
        if crate::process::pid() != self.pid {
            return self.begin(ffi::MDB_RDONLY); // LMDB forbids this anyway: leave the parent's slots alone
        }
        let spare = self.spare.lock().unwrap_or_else(|p| p.into_inner()).pop();
        if let Some(SpareTxn(raw)) = spare {
            // SAFETY: a transaction of this environment, reset by `Txn::drop` and owned by nobody else.
            if unsafe { ffi::mdb_txn_renew(raw) } == 0 {
                return Ok(Txn { raw, env: Some(self), writer: None, _env: std::marker::PhantomData });
            }
            // SAFETY: as above; a handle that cannot be renewed is freed.
            unsafe { ffi::mdb_txn_abort(raw) };
        }
        let mut txn = self.begin(ffi::MDB_RDONLY)?;
        txn.env = Some(self);
        Ok(txn)
    }

    /// Starts the write transaction; waits while another thread or process holds it (for at most
    /// [`WRITE_WITHIN`] when it is another process, in a durable environment).
    pub fn write(&self) -> Result<Txn<'_>, LmdbError> {
        self.write_within(WRITE_WITHIN)
    }

    /// [`Env::write`], waiting for another process's write for at most `within` in a durable environment.
    pub fn write_within(&self, within: Duration) -> Result<Txn<'_>, LmdbError> {
        let Some(lock) = &self.writer else { return self.begin(0) };
        let file = lock.file.lock().unwrap_or_else(|p| p.into_inner());
        crate::flock::lock_within(&file, libc::LOCK_EX, &lock.path, within, "a write to this database")
            .map_err(LmdbError::writer_lock)?;
        let writing = Writing(file);
        let mut txn = self.begin(0)?;
        txn.writer = Some(writing);
        Ok(txn)
    }

    fn begin(&self, flags: u32) -> Result<Txn<'_>, LmdbError> {
        let mut txn = ptr::null_mut();
        // SAFETY: the environment is open for the lifetime of `self`.
        check("txn_begin", unsafe { ffi::mdb_txn_begin(self.raw, ptr::null_mut(), flags, &mut txn) })?;
        Ok(Txn { raw: txn, env: None, writer: None, _env: std::marker::PhantomData })
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        // SAFETY: no transaction outlives the environment (they borrow it); the spare ones are freed first.
        unsafe {
            let spare = std::mem::take(self.spare.get_mut().unwrap_or_else(|p| p.into_inner()));
            if crate::process::pid() == self.pid {
                for SpareTxn(raw) in spare {
                    ffi::mdb_txn_abort(raw);
                }
            }
            ffi::mdb_env_close(self.raw)
        };
    }
}

/// A database handle inside an [`Env`].
#[derive(Clone, Copy, Debug)]
pub struct Db(ffi::MDB_dbi);

/// A transaction; aborted on drop unless committed (a read transaction is reset and kept by its
/// environment for the next one).
pub struct Txn<'env> {
    raw: *mut ffi::MDB_txn,
    /// The environment of a read transaction.
    env: Option<&'env Env>,
    /// The write lock of a write transaction, released after it ends (the fields drop after `drop`).
    writer: Option<Writing<'env>>,
    _env: std::marker::PhantomData<&'env Env>,
}

fn val(bytes: &[u8]) -> ffi::MDB_val {
    ffi::MDB_val { mv_size: bytes.len(), mv_data: bytes.as_ptr() as *mut _ }
}

/// # Safety
/// `v` must come from LMDB inside a live transaction that outlives `'t`.
unsafe fn slice<'t>(v: &ffi::MDB_val) -> &'t [u8] {
    if v.mv_size == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(v.mv_data as *const u8, v.mv_size)
    }
}

impl<'env> Txn<'env> {
    /// The value stored under `key`, borrowed from the map for the life of the transaction.
    pub fn get(&self, db: Db, key: &[u8]) -> Result<Option<&[u8]>, LmdbError> {
        let k = val(key);
        let mut v = ffi::MDB_val { mv_size: 0, mv_data: ptr::null_mut() };
        // SAFETY: the transaction is live; LMDB only reads `k`.
        let rc = unsafe { ffi::mdb_get(self.raw, db.0, &k as *const _ as *mut _, &mut v) };
        match rc {
            0 => Ok(Some(unsafe { slice(&v) })),
            ffi::MDB_NOTFOUND => Ok(None),
            rc => Err(LmdbError::new("get", rc)),
        }
    }

    /// Stores `value` under `key`, replacing what was there.
    pub fn put(&mut self, db: Db, key: &[u8], value: &[u8]) -> Result<(), LmdbError> {
        let k = val(key);
        let v = val(value);
        // SAFETY: a write transaction; LMDB copies both buffers.
        check("put", unsafe { ffi::mdb_put(self.raw, db.0, &k as *const _ as *mut _, &v as *const _ as *mut _, 0) })
    }

    /// Deletes `key`; returns whether it existed.
    pub fn del(&mut self, db: Db, key: &[u8]) -> Result<bool, LmdbError> {
        let k = val(key);
        // SAFETY: a write transaction.
        let rc = unsafe { ffi::mdb_del(self.raw, db.0, &k as *const _ as *mut _, ptr::null_mut()) };
        match rc {
            0 => Ok(true),
            ffi::MDB_NOTFOUND => Ok(false),
            rc => Err(LmdbError::new("del", rc)),
        }
    }

    /// Removes every record of `db`.
    pub fn clear(&mut self, db: Db) -> Result<(), LmdbError> {
        // SAFETY: a write transaction; 0 = empty the database, keep its handle.
        check("drop", unsafe { ffi::mdb_drop(self.raw, db.0, 0) })
    }

    /// Number of records in `db`.
    pub fn len(&self, db: Db) -> Result<u64, LmdbError> {
        let mut stat = std::mem::MaybeUninit::<ffi::MDB_stat>::zeroed();
        // SAFETY: the transaction is live and `stat` is written by LMDB.
        check("stat", unsafe { ffi::mdb_stat(self.raw, db.0, stat.as_mut_ptr()) })?;
        Ok(unsafe { stat.assume_init() }.ms_entries as u64)
    }

    /// Calls `visit(key, value)` for records in key order, starting at the first key `>= from`,
    /// until it returns false.
    pub fn scan(&self, db: Db, from: &[u8], mut visit: impl FnMut(&[u8], &[u8]) -> bool) -> Result<(), LmdbError> {
        let mut cursor = ptr::null_mut();
        // SAFETY: the cursor lives only inside this call and is closed before returning.
        unsafe {
            check("cursor_open", ffi::mdb_cursor_open(self.raw, db.0, &mut cursor))?;
            let mut k = val(from);
            let mut v = ffi::MDB_val { mv_size: 0, mv_data: ptr::null_mut() };
            let mut op = if from.is_empty() { ffi::MDB_FIRST } else { ffi::MDB_SET_RANGE };
            let result = loop {
                let rc = ffi::mdb_cursor_get(cursor, &mut k, &mut v, op);
                if rc == ffi::MDB_NOTFOUND {
                    break Ok(());
                }
                if rc != 0 {
                    break Err(LmdbError::new("cursor_get", rc));
                }
                if !visit(slice(&k), slice(&v)) {
                    break Ok(());
                }
                op = ffi::MDB_NEXT;
            };
            ffi::mdb_cursor_close(cursor);
            result
        }
    }

    /// Makes the transaction's writes durable and visible.
    pub fn commit(mut self) -> Result<(), LmdbError> {
        let raw = self.raw;
        let writer = self.writer.take();
        // Nothing else it holds needs dropping.
        std::mem::forget(self);
        // SAFETY: commit consumes the transaction handle.
        let committed = check("txn_commit", unsafe { ffi::mdb_txn_commit(raw) });
        drop(writer);
        committed
    }
}

impl Drop for Txn<'_> {
    fn drop(&mut self) {
        if let Some(env) = self.env {
            let mut spare = env.spare.lock().unwrap_or_else(|p| p.into_inner());
            if spare.len() < SPARE_MAX {
                // SAFETY: a live read transaction: reset releases its snapshot and keeps its reader slot.
                unsafe { ffi::mdb_txn_reset(self.raw) };
                spare.push(SpareTxn(self.raw));
                return;
            }
        }
        // SAFETY: the handle was not committed (commit forgets `self`).
        unsafe { ffi::mdb_txn_abort(self.raw) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_renewed_read_transaction_sees_the_latest_commit_and_reuses_its_slot() {
        let dir = tempfile::tempdir().unwrap();
        let env = Env::open(dir.path(), 1 << 20, &["t"]).unwrap();
        let db = env.db(0);
        let put = |v: &[u8]| {
            let mut w = env.write().unwrap();
            w.put(db, b"k", v).unwrap();
            w.commit().unwrap();
        };
        put(b"1");
        let first = env.read().unwrap();
        let raw = first.raw;
        assert_eq!(first.get(db, b"k").unwrap(), Some(&b"1"[..]));
        drop(first);
        put(b"2");
        let again = env.read().unwrap();
        assert_eq!(again.raw, raw, "the reset transaction is renewed, not a new one begun");
        assert_eq!(again.get(db, b"k").unwrap(), Some(&b"2"[..]), "a renewed snapshot is the latest");
        // Two at once: the second is a new transaction, and both are kept, up to SPARE_MAX.
        let other = env.read().unwrap();
        assert_ne!(other.raw, raw);
        drop((again, other));
        let held: Vec<_> = (0..SPARE_MAX + 2).map(|_| env.read().unwrap()).collect();
        drop(held);
        assert_eq!(env.spare.lock().unwrap().len(), SPARE_MAX);
    }

    #[test]
    fn a_process_stopped_inside_a_write_delays_no_open_and_fails_a_write_within_the_deadline() {
        let dir = tempfile::tempdir().unwrap();
        {
            let env = Env::open_durable(dir.path(), 1 << 20, &["t"]).unwrap();
            let mut w = env.write().unwrap();
            w.put(env.db(0), b"k", b"v").unwrap();
            w.commit().unwrap();
        }
        // Another process's descriptor, holding the lock as a process stopped inside a write would.
        let other = File::open(dir.path().join(WRITER_LOCK)).unwrap();
        crate::flock::lock_within(&other, libc::LOCK_EX, dir.path(), WRITE_WITHIN, "a test").unwrap();
        let start = std::time::Instant::now();
        let env = Env::open_durable(dir.path(), 1 << 20, &["t"]).unwrap();
        assert_eq!(env.read().unwrap().get(env.db(0), b"k").unwrap(), Some(&b"v"[..]));
        let e = env.write_within(Duration::from_millis(200)).err().expect("the write waits for the lock");
        assert_eq!(e.code, libc::ETIMEDOUT, "{e}");
        assert!(e.to_string().contains("writer.lock") && e.to_string().contains("kill -CONT"), "{e}");
        assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
        // Once it goes on, writes go on; and a write's end releases the lock for the next process.
        crate::flock::unlock(&other);
        let mut w = env.write_within(Duration::from_millis(200)).unwrap();
        w.put(env.db(0), b"k", b"w").unwrap();
        w.commit().unwrap();
        crate::flock::lock_within(&other, libc::LOCK_EX | libc::LOCK_NB, dir.path(), Duration::ZERO, "a test")
            .expect("the commit released the lock");
        crate::flock::unlock(&other);
        drop(env.write().unwrap()); // an aborted write releases it too
        crate::flock::lock_within(&other, libc::LOCK_EX, dir.path(), Duration::ZERO, "a test").unwrap();
    }
}
