//! The stage's journal: an fsynced LMDB environment beside the staged bytes, shared by every process of
//! the node (the writers record, the agent migrates and removes).
//!
//! One entry per staged file, keyed by a sequence number taken when the program closed (or renamed,
//! or truncated) the file: the agent migrates in key order, so a file closed after another reaches the
//! store after it (a checkpoint's metadata file, written last, appears last). Any change to a pending
//! file re-keys it with a new number, which also tells a migration in flight that its copy is stale.
//! Each commit is synchronous (no `MDB_NOSYNC`, unlike the read cache's index): an entry committed here
//! exists on disk before the close that made it returns. A close with `durability = "buffered"` appends
//! its entry to the log of closes instead ([`super::closes`]), and every operation here folds that log in
//! first, so that the journal's order and answers include every close that returned.

use std::collections::HashMap;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use super::closes::{Closes, Record, RecordId};
pub use super::entry::Entry;
use crate::clock::now_ns;
use crate::hash::hash_file;
use crate::lmdb::{Db, Env, LmdbError};

/// Why a journal operation failed.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// LMDB failed.
    #[error("the write-back journal in {dir}: {source}")]
    Lmdb {
        /// The journal's directory.
        dir: PathBuf,
        /// The error.
        source: LmdbError,
    },
    /// A file of the stage could not be read or written.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// An entry that does not decode (written by another version, or damaged).
    #[error("the write-back journal in {0} holds an entry this version cannot read; finish it with the tierstore that wrote it")]
    Corrupt(PathBuf),
}

impl JournalError {
    /// The `errno` to report to a program whose call failed for this reason.
    pub fn errno(&self) -> i32 {
        match self {
            JournalError::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            _ => libc::EIO,
        }
    }
}

/// What is pending under a path (`tierstore status`, `tierstore sync`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pending {
    /// Files not yet on the store.
    pub files: u64,
    /// Their bytes.
    pub bytes: u64,
    /// When the oldest was first closed (ns since the epoch), if any.
    pub oldest_ns: Option<u64>,
    /// Files whose last migration attempt failed: (destination, attempts, error).
    pub errors: Vec<(PathBuf, u32, String)>,
}

/// How a migration's final step ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Finish {
    /// The file is on the store; its entry and staged copy are gone.
    Done,
    /// The program changed the file meanwhile (renamed, rewrote, truncated or deleted it): the copy
    /// made is not what it wants, and the newer entry (if any) is migrated in its turn.
    Superseded,
}

/// The journal of one stage directory.
pub struct Journal {
    dir: PathBuf,
    data: PathBuf,
    env: Env,
    entries: Db,
    paths: Db,
    meta: Db,
    closes: Closes,
}

const NEXT_SEQ: &[u8] = b"next_seq";
const BYTES: &[u8] = b"bytes";
const LAST_CHANGE: &[u8] = b"last_change_ns";
/// The id of the last record of the log of closes folded in (see [`Journal::fold`]).
const LAST_FOLDED: &[u8] = b"last_folded";

fn get_u64(t: &crate::lmdb::Txn<'_>, db: Db, k: &[u8]) -> Result<u64, LmdbError> {
    Ok(t.get(db, k)?.and_then(|v| v.try_into().ok()).map(u64::from_be_bytes).unwrap_or(0))
}

impl Journal {
    /// Opens (creating) the journal of the stage directory `stage`: `stage/journal` (LMDB) and
    /// `stage/data` (the staged files). The stage and both directories are this user's own (created 0700,
    /// or checked: see `private`), and the journal's files are 0600, so that no other user of the node
    /// reads a staged byte or plants an entry.
    pub fn open(stage: &Path) -> Result<Journal, JournalError> {
        let dir = stage.join("journal");
        let data = stage.join("data");
        let private = |d: &Path| {
            crate::private::ensure_dir(d).map_err(|source| JournalError::Io {
                what: "cannot use the stage directory",
                path: d.to_path_buf(),
                source,
            })
        };
        private(stage)?;
        let journal_dir = private(&dir)?;
        private(&data)?;
        // LMDB would create its files with the umask (0644): made first, 0600, never through a link.
        for name in ["data.mdb", "lock.mdb"] {
            let made = crate::private::open_file(&journal_dir, name).and_then(|f| {
                use std::os::unix::fs::{MetadataExt, PermissionsExt};
                if f.metadata()?.mode() & 0o077 != 0 {
                    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
                }
                Ok(())
            });
            made.map_err(|source| JournalError::Io {
                what: "cannot create the journal file",
                path: dir.join(name),
                source,
            })?;
        }
        let env = Env::open_durable(&dir, 1 << 30, &["entries", "paths", "meta"])
            .map_err(|source| JournalError::Lmdb { dir: dir.clone(), source })?;
        let log = dir.join(super::closes::LOG);
        let closes = Closes::open(&journal_dir, log.clone()).map_err(|source| JournalError::Io {
            what: "cannot open the log of buffered closes",
            path: log,
            source,
        })?;
        Ok(Journal { entries: env.db(0), paths: env.db(1), meta: env.db(2), env, dir, data, closes })
    }

    fn log_error(&self, what: &'static str) -> impl Fn(io::Error) -> JournalError + '_ {
        move |source| JournalError::Io { what, path: self.closes.path().to_path_buf(), source }
    }

    /// Moves the buffered closes appended to the log into the journal, in their order, in one fsynced
    /// commit, then empties the log. Costs one `fstat` when the log is empty. Records up to the last one
    /// a fold already committed are passed over (a fold cut short before it emptied the log), and so is a
    /// record whose staged file is gone (nothing is left to migrate). A close appended without its hash
    /// is hashed here, before the commit.
    pub fn fold(&self) -> Result<usize, JournalError> {
        if self.closes.is_empty().map_err(self.log_error("cannot read"))? {
            return Ok(0);
        }
        // The files are hashed before the log is held, so that the closes of a program still writing do
        // not wait for the hashing (only for the commit). A close appended meanwhile is hashed below.
        let hashed = self.hash_closes();
        let log = self.closes.hold().map_err(self.log_error("cannot lock"))?;
        let records = log.records().map_err(self.log_error("cannot read"))?;
        let Some(last) = records.last().map(|r| r.id) else {
            log.clear().map_err(self.log_error("cannot empty"))?;
            return Ok(0);
        };
        // Only folds change it, and no other fold runs while the log is held.
        let folded_before = {
            let t = self.env.read().map_err(self.lmdb())?;
            t.get(self.meta, LAST_FOLDED).map_err(self.lmdb())?.map(<[u8]>::to_vec)
        };
        let new = match records.iter().position(|r| Some(&r.id[..]) == folded_before.as_deref()) {
            Some(i) => &records[i + 1..],
            None => &records[..],
        };
        let ready: Vec<Entry> = new.iter().filter_map(|r| self.ready(r, log.path(), &hashed)).collect();
        let mut t = self.env.write().map_err(self.lmdb())?;
        let mut superseded = Vec::new();
        for entry in &ready {
            superseded.extend(self.supersede(&mut t, entry.clone()).map_err(self.lmdb())?.1);
        }
        t.put(self.meta, LAST_FOLDED, &last).map_err(self.lmdb())?;
        t.commit().map_err(self.lmdb())?;
        self.remove_staged(superseded);
        log.clear().map_err(self.log_error("cannot empty"))?;
        Ok(ready.len())
    }

    /// The size and blake3 of the staged file of each close now in the log that was appended unhashed
    /// in this boot, read without holding the log (a file that cannot be read is left to the fold).
    fn hash_closes(&self) -> HashMap<RecordId, (u64, [u8; 32])> {
        let Ok((records, _)) = self.closes.peek() else { return HashMap::new() };
        let boot = crate::process::boot_id();
        records
            .iter()
            .filter(|r| !r.hashed && r.entry.unflushed_in == boot)
            .filter_map(|r| Some((r.id, crate::hash::hash_file_now(&self.staged_path(&r.entry.staged)).ok()?)))
            .collect()
    }

    /// The entry a record of the log stands for, hashed; `None` (said) when there is nothing to migrate:
    /// its staged file is gone, unreadable, or was closed unhashed before a crash of the node (its bytes
    /// may be torn, and nothing would tell: it is removed, and the store keeps what it held before).
    fn ready(&self, r: &Record, log: &Path, hashed: &HashMap<RecordId, (u64, [u8; 32])>) -> Option<Entry> {
        let mut e = r.entry.clone();
        let staged = self.staged_path(&e.staged);
        if r.hashed {
            if staged.exists() {
                return Some(e);
            }
            log::warn!(
                "{}: the close of {} names a staged file that is gone; passed over",
                log.display(),
                e.dest.display()
            );
            return None;
        }
        if e.unflushed_in != crate::process::boot_id() {
            log::error!(
                "{} was lost: it was closed just before a crash of the node, before its staged copy {} was hashed \
                 (durability \"buffered\"); the store keeps what it held before",
                e.dest.display(),
                staged.display()
            );
            let _ = std::fs::remove_file(&staged);
            return None;
        }
        match hashed.get(&r.id).copied().map_or_else(|| crate::hash::hash_file_now(&staged), Ok) {
            Ok((size, hash)) => {
                (e.size, e.hash) = (size, hash);
                Some(e)
            }
            Err(err) => {
                let how = if err.kind() == io::ErrorKind::NotFound { log::Level::Warn } else { log::Level::Error };
                log::log!(
                    how,
                    "{}: the staged copy {} of {} cannot be hashed ({err}); passed over",
                    log.display(),
                    staged.display(),
                    e.dest.display()
                );
                None
            }
        }
    }

    /// Whether buffered closes wait in the log while the program is still closing files: the last was
    /// appended less than `quiet` ago and the oldest less than `within` ago. The agent folds the log
    /// once this is false, so a checkpoint's closes are folded in one commit, after it.
    pub fn closes_settling(&self, quiet: std::time::Duration, within: std::time::Duration) -> bool {
        let Ok((records, modified)) = self.closes.peek() else { return false };
        let Some(first) = records.first() else { return false };
        let recent = modified.and_then(|m| m.elapsed().ok()).is_some_and(|age| age < quiet);
        let young = now_ns().saturating_sub(first.entry.created_ns) < within.as_nanos() as u64;
        recent && young
    }

    fn lmdb(&self) -> impl Fn(LmdbError) -> JournalError + '_ {
        move |source| JournalError::Lmdb { dir: self.dir.clone(), source }
    }

    /// The stage's directory of staged files.
    pub fn data_dir(&self) -> &Path {
        &self.data
    }

    /// Leaks this handle: what a forked child must do with one it inherited (see `Env::forget`).
    pub fn forget(self) {
        self.env.forget();
    }

    /// The path of staged file `name`.
    pub fn staged_path(&self, name: &str) -> PathBuf {
        self.data.join(name)
    }

    /// Bytes of the files waiting for migration.
    /// (The closes not yet folded count too, without a fold: a new file's `begin` asks this.)
    pub fn staged_bytes(&self) -> Result<u64, JournalError> {
        let buffered: u64 =
            self.closes.peek().map_err(self.log_error("cannot read"))?.0.iter().map(|r| r.entry.size).sum();
        let t = self.env.read().map_err(self.lmdb())?;
        Ok(get_u64(&t, self.meta, BYTES).map_err(self.lmdb())? + buffered)
    }

    /// When a file was last closed, renamed or truncated (ns since the epoch; 0 if never).
    pub fn last_change_ns(&self) -> Result<u64, JournalError> {
        self.fold()?;
        let t = self.env.read().map_err(self.lmdb())?;
        get_u64(&t, self.meta, LAST_CHANGE).map_err(self.lmdb())
    }

    /// The pending entry for `dest`, if any.
    /// A close still in the log of closes is the newest for its path (everything that changes the
    /// journal folds the log first), so it answers without a fold: a checkpoint's next `open` asks this,
    /// and must not wait for an fsync. Its `seq` is 0 until the fold gives it its place.
    pub fn lookup(&self, dest: &Path) -> Result<Option<Entry>, JournalError> {
        let (buffered, _) = self.closes.peek().map_err(self.log_error("cannot read"))?;
        let newest = buffered.into_iter().rev().map(|r| r.entry).find(|e| e.dest == dest);
        if let Some(e) = newest.filter(|e| self.staged_path(&e.staged).exists()) {
            return Ok(Some(e));
        }
        let t = self.env.read().map_err(self.lmdb())?;
        let Some(seq) = t.get(self.paths, dest.as_os_str().as_bytes()).map_err(self.lmdb())? else { return Ok(None) };
        let seq: [u8; 8] = seq.try_into().map_err(|_| JournalError::Corrupt(self.dir.clone()))?;
        match t.get(self.entries, &seq).map_err(self.lmdb())? {
            Some(v) => Ok(Some(
                Entry::decode(u64::from_be_bytes(seq), v).ok_or_else(|| JournalError::Corrupt(self.dir.clone()))?,
            )),
            None => Ok(None),
        }
    }

    /// The entry migrated next (the lowest sequence number), if any.
    pub fn first(&self) -> Result<Option<Entry>, JournalError> {
        self.fold()?;
        let t = self.env.read().map_err(self.lmdb())?;
        let mut found = None;
        t.scan(self.entries, &[], |k, v| {
            found = Some(k.try_into().ok().map(u64::from_be_bytes).and_then(|seq| Entry::decode(seq, v)));
            false
        })
        .map_err(self.lmdb())?;
        match found {
            None => Ok(None),
            Some(e) => e.map(Some).ok_or_else(|| JournalError::Corrupt(self.dir.clone())),
        }
    }

    /// The first entry in migration order for which `pick` holds, if any (`first` with a filter: the
    /// agent skips entries whose destination it refuses).
    pub fn first_where(&self, mut pick: impl FnMut(&Entry) -> bool) -> Result<Option<Entry>, JournalError> {
        self.fold()?;
        let t = self.env.read().map_err(self.lmdb())?;
        let mut found = None;
        let mut bad = false;
        t.scan(self.entries, &[], |k, v| {
            match k.try_into().ok().map(u64::from_be_bytes).and_then(|seq| Entry::decode(seq, v)) {
                Some(e) if pick(&e) => {
                    found = Some(e);
                    false
                }
                Some(_) => true,
                None => {
                    bad = true;
                    false
                }
            }
        })
        .map_err(self.lmdb())?;
        if bad {
            return Err(JournalError::Corrupt(self.dir.clone()));
        }
        Ok(found)
    }

    /// Every pending entry, in migration order.
    pub fn entries(&self) -> Result<Vec<Entry>, JournalError> {
        self.fold()?;
        let t = self.env.read().map_err(self.lmdb())?;
        let mut out = Vec::new();
        let mut bad = false;
        t.scan(self.entries, &[], |k, v| {
            match k.try_into().ok().map(u64::from_be_bytes).and_then(|seq| Entry::decode(seq, v)) {
                Some(e) => out.push(e),
                None => bad = true,
            }
            true
        })
        .map_err(self.lmdb())?;
        if bad {
            return Err(JournalError::Corrupt(self.dir.clone()));
        }
        Ok(out)
    }

    /// What is pending at or under `under`.
    pub fn pending(&self, under: &Path) -> Result<Pending, JournalError> {
        let mut p = Pending::default();
        for e in self.entries()?.into_iter().filter(|e| e.dest.starts_with(under)) {
            p.files += 1;
            p.bytes += e.size;
            p.oldest_ns = Some(p.oldest_ns.map_or(e.created_ns, |o| o.min(e.created_ns)));
            if !e.error.is_empty() {
                p.errors.push((e.dest.clone(), e.attempts, e.error.clone()));
            }
        }
        Ok(p)
    }

    /// Removes the pending entry of `dest` inside `t`, returning its staged file to delete after commit.
    fn drop_path(&self, t: &mut crate::lmdb::Txn<'_>, dest: &Path) -> Result<Option<Entry>, LmdbError> {
        let key = dest.as_os_str().as_bytes();
        let Some(seq) = t.get(self.paths, key)?.and_then(|v| <[u8; 8]>::try_from(v).ok()) else { return Ok(None) };
        let old = t.get(self.entries, &seq)?.and_then(|v| Entry::decode(u64::from_be_bytes(seq), v));
        t.del(self.entries, &seq)?;
        t.del(self.paths, key)?;
        if let Some(e) = &old {
            let bytes = get_u64(t, self.meta, BYTES)?.saturating_sub(e.size);
            t.put(self.meta, BYTES, &bytes.to_be_bytes())?;
        }
        Ok(old)
    }

    /// Makes `e` the pending entry of its path, next in the order, inside `t`: returns its sequence number
    /// and the entry it replaced, if any, whose staged file (another) is to be deleted after commit.
    fn supersede(&self, t: &mut crate::lmdb::Txn<'_>, e: Entry) -> Result<(u64, Option<Entry>), LmdbError> {
        let old = self.drop_path(t, &e.dest)?.filter(|o| o.staged != e.staged);
        Ok((self.insert(t, e)?, old))
    }

    fn insert(&self, t: &mut crate::lmdb::Txn<'_>, mut e: Entry) -> Result<u64, LmdbError> {
        let seq = get_u64(t, self.meta, NEXT_SEQ)?.max(1);
        t.put(self.meta, NEXT_SEQ, &(seq + 1).to_be_bytes())?;
        e.seq = seq;
        t.put(self.entries, &seq.to_be_bytes(), &e.encode())?;
        t.put(self.paths, e.dest.as_os_str().as_bytes(), &seq.to_be_bytes())?;
        let bytes = get_u64(t, self.meta, BYTES)? + e.size;
        t.put(self.meta, BYTES, &bytes.to_be_bytes())?;
        t.put(self.meta, LAST_CHANGE, &now_ns().to_be_bytes())?;
        Ok(seq)
    }

    fn remove_staged(&self, gone: impl IntoIterator<Item = Entry>) {
        for e in gone {
            let _ = std::fs::remove_file(self.staged_path(&e.staged));
        }
    }

    /// Records a closed staged file (already fsynced) as the next to migrate to `dest`; an entry still
    /// pending for `dest` is superseded (its staged copy deleted). Returns the new sequence number once
    /// the entry is durable.
    pub fn commit(&self, dest: &Path, staged: &str, size: u64, hash: [u8; 32]) -> Result<u64, JournalError> {
        self.record(dest, staged, size, hash, None)
    }

    /// Like [`Journal::commit`], for a staged file whose bytes may still be only in the page cache
    /// (`durability = "buffered"`): the entry names this boot of the node, and is appended to the log of
    /// closes without waiting for the disk ([`super::closes`]); the next operation folds it in, and
    /// hashes the file then when `hash` is not given.
    pub fn close_buffered(
        &self,
        dest: &Path,
        staged: &str,
        size: u64,
        hash: Option<[u8; 32]>,
    ) -> Result<(), JournalError> {
        let entry = Entry::closed(dest, staged, size, hash.unwrap_or_default(), crate::process::boot_id());
        self.closes.append(&entry, hash.is_some()).map_err(self.log_error("cannot append to"))
    }

    /// [`Journal::commit`]; the tests also name an earlier boot.
    pub(super) fn record(
        &self,
        dest: &Path,
        staged: &str,
        size: u64,
        hash: [u8; 32],
        unflushed_in: Option<[u8; 16]>,
    ) -> Result<u64, JournalError> {
        self.fold()?;
        let mut t = self.env.write().map_err(self.lmdb())?;
        let e = Entry::closed(dest, staged, size, hash, unflushed_in);
        let (seq, superseded) = self.supersede(&mut t, e).map_err(self.lmdb())?;
        t.commit().map_err(self.lmdb())?;
        self.remove_staged(superseded);
        Ok(seq)
    }

    /// The program renamed `from` to `to`: when `from` is pending, its entry moves to `to` (with a new
    /// place in the order, after everything closed before the rename) and `to`'s pending entry, if any,
    /// is superseded. Returns whether `from` was pending.
    pub fn rename(&self, from: &Path, to: &Path) -> Result<bool, JournalError> {
        self.fold()?;
        let mut t = self.env.write().map_err(self.lmdb())?;
        let Some(mut e) = self.drop_path(&mut t, from).map_err(self.lmdb())? else { return Ok(false) };
        let replaced = self.drop_path(&mut t, to).map_err(self.lmdb())?;
        e.dest = to.to_path_buf();
        e.attempts = 0;
        e.error.clear();
        self.insert(&mut t, e).map_err(self.lmdb())?;
        t.commit().map_err(self.lmdb())?;
        self.remove_staged(replaced);
        Ok(true)
    }

    /// The program deleted `dest`: its pending entry and staged copy go. Returns whether it was pending.
    pub fn remove(&self, dest: &Path) -> Result<bool, JournalError> {
        self.fold()?;
        let mut t = self.env.write().map_err(self.lmdb())?;
        let old = self.drop_path(&mut t, dest).map_err(self.lmdb())?;
        t.commit().map_err(self.lmdb())?;
        let was = old.is_some();
        self.remove_staged(old);
        Ok(was)
    }

    /// The program truncated the pending file `dest` to `len`: its staged copy is cut, fsynced and
    /// re-hashed, and it takes a new place in the order. Returns whether it was pending.
    pub fn truncate(&self, dest: &Path, len: u64) -> Result<bool, JournalError> {
        self.fold()?;
        let mut t = self.env.write().map_err(self.lmdb())?;
        let Some(mut e) = self.drop_path(&mut t, dest).map_err(self.lmdb())? else { return Ok(false) };
        let path = self.staged_path(&e.staged);
        let io = |what: &'static str| {
            let path = path.clone();
            move |source| JournalError::Io { what, path, source }
        };
        let f = {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(self.staged_path(&e.staged))
                .map_err(io("cannot open"))?
        };
        f.set_len(len).map_err(io("cannot truncate"))?;
        f.sync_all().map_err(io("cannot fsync"))?;
        let (size, hash) = hash_file(&self.staged_path(&e.staged)).map_err(io("cannot read"))?;
        e.size = size;
        e.hash = hash;
        self.insert(&mut t, e).map_err(self.lmdb())?;
        t.commit().map_err(self.lmdb())?;
        Ok(true)
    }

    /// Records a failed migration attempt of entry `seq` (shown by `tierstore status`).
    pub fn note_error(&self, seq: u64, error: &str) -> Result<(), JournalError> {
        let mut t = self.env.write().map_err(self.lmdb())?;
        let key = seq.to_be_bytes();
        let Some(mut e) = t.get(self.entries, &key).map_err(self.lmdb())?.and_then(|v| Entry::decode(seq, v)) else {
            return Ok(());
        };
        e.attempts += 1;
        e.error = error.chars().take(1000).collect();
        t.put(self.entries, &key, &e.encode()).map_err(self.lmdb())?;
        t.commit().map_err(self.lmdb())
    }

    /// The last step of a migration: if `entry` is still current, runs `publish` (which renames the
    /// checked copy into place on the store and fsyncs its directory) and removes the entry, then its
    /// staged copy. The journal's write lock is held throughout, so the program cannot rename or rewrite
    /// the file between the check and the publication.
    pub fn finish(
        &self,
        entry: &Entry,
        publish: impl FnOnce() -> io::Result<()>,
    ) -> Result<Result<Finish, io::Error>, JournalError> {
        self.fold()?;
        let mut t = self.env.write().map_err(self.lmdb())?;
        let key = entry.seq.to_be_bytes();
        let current = t.get(self.entries, &key).map_err(self.lmdb())?.and_then(|v| Entry::decode(entry.seq, v));
        if current.as_ref().map(|c| (&c.dest, &c.staged)) != Some((&entry.dest, &entry.staged)) {
            return Ok(Ok(Finish::Superseded));
        }
        if let Err(e) = publish() {
            return Ok(Err(e));
        }
        self.drop_path(&mut t, &entry.dest).map_err(self.lmdb())?;
        t.commit().map_err(self.lmdb())?;
        let _ = std::fs::remove_file(self.staged_path(&entry.staged));
        Ok(Ok(Finish::Done))
    }

    /// Deletes staged files that no entry names and whose writer is gone (a program killed before its
    /// close, or an agent killed between removing an entry and its file). Returns how many.
    pub fn sweep_orphans(&self) -> Result<usize, JournalError> {
        // Files of dead writers first, the journal after: a writer dead when its file was listed either
        // journaled it before it died (and the journal, read later, names it) or never will.
        let dead: Vec<(String, PathBuf)> = std::fs::read_dir(&self.data)
            .map_err(|source| JournalError::Io { what: "cannot list", path: self.data.clone(), source })?
            .flatten()
            .map(|f| (f.file_name().to_string_lossy().into_owned(), f.path()))
            .filter(|(name, _)| {
                let pid: Option<i32> = name.split('.').next().and_then(|p| p.parse().ok());
                // SAFETY: kill with signal 0 only checks that the process exists.
                let alive = pid.is_some_and(|p| {
                    (unsafe { libc::kill(p, 0) }) == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
                });
                !alive
            })
            .collect();
        let named: std::collections::HashSet<String> = self.entries()?.into_iter().map(|e| e.staged).collect();
        let gone = dead.into_iter().filter(|(name, path)| !named.contains(name) && std::fs::remove_file(path).is_ok());
        Ok(gone.count())
    }
}

/// A new staged file's name: the writer's pid (so that a sweep knows when its writer is gone), then a
/// number unique within the process and the time.
pub fn new_staged_name() -> String {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{}.{n}.{}", crate::process::pid(), now_ns())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn staged(j: &Journal, bytes: &[u8]) -> String {
        let name = new_staged_name();
        std::fs::write(j.staged_path(&name), bytes).unwrap();
        name
    }

    #[test]
    fn buffered_closes_take_their_place_in_close_order_before_any_answer() {
        let d = tempfile::tempdir().unwrap();
        let j = Journal::open(d.path()).unwrap();
        let (a, b, c, a2) = (staged(&j, b"a"), staged(&j, b"bb"), staged(&j, b"ccc"), staged(&j, b"a2"));
        j.close_buffered(Path::new("/s/a"), &a, 1, Some([1; 32])).unwrap();
        j.close_buffered(Path::new("/s/b"), &b, 2, Some([2; 32])).unwrap();
        // Not folded yet, yet counted against the stage's quota and seen by a read of /s/a, which folds
        // nothing (a checkpoint's next open asks it).
        assert_eq!(j.staged_bytes().unwrap(), 3);
        assert_eq!(j.lookup(Path::new("/s/a")).unwrap().map(|e| e.staged), Some(a.clone()));
        assert!(!j.closes.is_empty().unwrap(), "the lookup folded nothing");
        assert_eq!(j.lookup(Path::new("/s/none")).unwrap(), None);
        // A fsynced close after them comes after them; a buffered rewrite of /s/a supersedes its copy.
        j.commit(Path::new("/s/c"), &c, 3, [3; 32]).unwrap();
        j.close_buffered(Path::new("/s/a"), &a2, 2, Some([4; 32])).unwrap();
        assert_eq!(j.lookup(Path::new("/s/a")).unwrap().map(|e| e.staged), Some(a2.clone()), "the newest close");
        let order: Vec<String> = j.entries().unwrap().into_iter().map(|e| e.staged).collect();
        assert_eq!(order, vec![b.clone(), c, a2]);
        assert!(!j.staged_path(&a).exists(), "the superseded copy is deleted");
        assert_eq!(j.staged_bytes().unwrap(), 2 + 3 + 2);
    }

    #[test]
    fn a_close_appended_unhashed_is_hashed_by_the_fold_unless_a_crash_of_the_node_came_first() {
        let d = tempfile::tempdir().unwrap();
        let j = Journal::open(d.path()).unwrap();
        let (a, b) = (staged(&j, b"the bytes closed"), staged(&j, b"closed before the crash"));
        j.close_buffered(Path::new("/s/a"), &a, 16, None).unwrap();
        // As a record that a crash of the node left in the log: appended in another boot, unhashed.
        let earlier = Entry::closed(Path::new("/s/b"), &b, 23, [0; 32], Some([7; 16]));
        j.closes.append(&earlier, false).unwrap();
        let entries = j.entries().unwrap();
        assert_eq!(entries.len(), 1, "{entries:?}");
        assert_eq!(entries[0].staged, a);
        assert_eq!(entries[0].hash, crate::hash::hash(b"the bytes closed"));
        assert!(!j.staged_path(&b).exists(), "the copy of the lost close is removed");
    }

    #[test]
    fn a_fold_cut_short_before_the_log_was_emptied_is_not_applied_twice() {
        let d = tempfile::tempdir().unwrap();
        let j = Journal::open(d.path()).unwrap();
        let (a, a2) = (staged(&j, b"a"), staged(&j, b"a2"));
        j.close_buffered(Path::new("/s/a"), &a, 1, Some([1; 32])).unwrap();
        j.close_buffered(Path::new("/s/a"), &a2, 2, Some([2; 32])).unwrap();
        let log = d.path().join("journal").join(super::super::closes::LOG);
        let appended = std::fs::read(&log).unwrap();
        assert_eq!(j.fold().unwrap(), 2);
        // The folder was killed after its commit and before it emptied the log; the first copy's file
        // was not deleted yet either. A later fold must not bring the first close back over the second.
        std::fs::write(&log, &appended).unwrap();
        std::fs::write(j.staged_path(&a), b"a").unwrap();
        let b = staged(&j, b"b");
        j.close_buffered(Path::new("/s/b"), &b, 1, Some([3; 32])).unwrap();
        assert_eq!(j.fold().unwrap(), 1, "only the close appended since");
        let got: Vec<(PathBuf, String)> = j.entries().unwrap().into_iter().map(|e| (e.dest, e.staged)).collect();
        assert_eq!(got, vec![(PathBuf::from("/s/a"), a2), (PathBuf::from("/s/b"), b)]);
    }

    #[test]
    fn closes_appended_by_several_processes_while_others_fold_are_each_journaled_once_in_order() {
        let d = tempfile::tempdir().unwrap();
        // One handle per writer: each has its own descriptor of the log, as a process has.
        let writers: Vec<Journal> = (0..3).map(|_| Journal::open(d.path()).unwrap()).collect();
        let folder = Journal::open(d.path()).unwrap();
        let per_writer = 200;
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let handles: Vec<_> = writers
                .iter()
                .enumerate()
                .map(|(w, j)| {
                    s.spawn(move || {
                        for i in 0..per_writer {
                            let name = staged(j, b"x");
                            j.close_buffered(Path::new(&format!("/s/{w}/{i}")), &name, 1, None).unwrap();
                        }
                    })
                })
                .collect();
            s.spawn(|| {
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    folder.fold().unwrap();
                }
            });
            for h in handles {
                h.join().unwrap();
            }
            done.store(true, std::sync::atomic::Ordering::Relaxed);
        });
        let entries = folder.entries().unwrap();
        assert_eq!(entries.len(), 3 * per_writer);
        // Hashed before the log was held, or (appended meanwhile) while it was: each one right.
        assert!(entries.iter().all(|e| e.hash == crate::hash::hash(b"x")), "every close hashed, rightly");
        for w in 0..3 {
            let mine: Vec<String> = entries
                .iter()
                .map(|e| e.dest.to_string_lossy().into_owned())
                .filter(|p| p.starts_with(&format!("/s/{w}/")))
                .collect();
            let expected: Vec<String> = (0..per_writer).map(|i| format!("/s/{w}/{i}")).collect();
            assert_eq!(mine, expected, "writer {w}'s closes, in the order it made them");
        }
    }

    #[test]
    fn an_unflushed_close_names_this_boot_and_an_entry_of_the_first_layout_still_decodes() {
        let d = tempfile::tempdir().unwrap();
        let j = Journal::open(d.path()).unwrap();
        let (a, b) = (staged(&j, b"a"), staged(&j, b"b"));
        j.commit(Path::new("/s/fsynced"), &a, 1, [1; 32]).unwrap();
        j.close_buffered(Path::new("/s/buffered"), &b, 1, Some([2; 32])).unwrap();
        let entries = j.entries().unwrap();
        assert_eq!(entries[0].unflushed_in, None);
        assert_eq!(entries[1].unflushed_in, crate::process::boot_id());
        assert!(entries[1].unflushed_in.is_some());
        // Version 1, as tierstore wrote it before "buffered" existed: no boot, always fsynced.
        let mut v1 = vec![1u8];
        v1.extend_from_slice(&3u64.to_be_bytes());
        v1.extend_from_slice(&[5; 32]);
        v1.extend_from_slice(&7u64.to_be_bytes());
        v1.extend_from_slice(&0u32.to_be_bytes());
        for text in [&b"/s/old"[..], b"staged", b""] {
            v1.extend_from_slice(&(text.len() as u32).to_be_bytes());
            v1.extend_from_slice(text);
        }
        let old = Entry::decode(9, &v1).expect("version 1 decodes");
        assert_eq!((old.size, old.created_ns, old.unflushed_in), (3, 7, None));
        assert_eq!(old.dest, Path::new("/s/old"));
        assert_eq!(Entry::decode(old.seq, &old.encode()), Some(old));
        assert_eq!(Entry::decode(1, &[3, 0, 0]), None, "a newer version is refused, not misread");
    }

    #[test]
    fn entries_come_in_close_order_and_renames_move_to_the_end() {
        let d = tempfile::tempdir().unwrap();
        let j = Journal::open(d.path()).unwrap();
        let dest = Path::new("/store/ckpt");
        for (i, name) in ["a", "b", "tmp"].iter().enumerate() {
            let s = staged(&j, &[i as u8; 10]);
            j.commit(&dest.join(name), &s, 10, [0; 32]).unwrap();
        }
        assert!(j.rename(&dest.join("tmp"), &dest.join("meta")).unwrap());
        assert!(!j.rename(&dest.join("nothing"), &dest.join("x")).unwrap());
        let order: Vec<_> = j.entries().unwrap().iter().map(|e| e.dest.file_name().unwrap().to_owned()).collect();
        assert_eq!(order, ["a", "b", "meta"]);
        assert_eq!(j.staged_bytes().unwrap(), 30);
        assert_eq!(j.pending(dest).unwrap().files, 3);
        assert_eq!(j.pending(&dest.join("a")).unwrap().bytes, 10);
        // Rewriting "a" supersedes its entry and deletes its staged copy; the new one goes last.
        let old = j.lookup(&dest.join("a")).unwrap().unwrap();
        let s = staged(&j, b"new");
        j.commit(&dest.join("a"), &s, 3, [1; 32]).unwrap();
        assert!(!j.staged_path(&old.staged).exists());
        assert_eq!(j.entries().unwrap().last().unwrap().dest, dest.join("a"));
        assert_eq!(j.staged_bytes().unwrap(), 23);
        assert!(j.remove(&dest.join("b")).unwrap());
        assert_eq!(j.entries().unwrap().len(), 2);
    }

    #[test]
    fn finish_refuses_a_superseded_entry_and_removes_a_current_one() {
        let d = tempfile::tempdir().unwrap();
        let j = Journal::open(d.path()).unwrap();
        let s = staged(&j, b"abc");
        j.commit(Path::new("/s/x"), &s, 3, [0; 32]).unwrap();
        let e = j.first().unwrap().unwrap();
        j.rename(Path::new("/s/x"), Path::new("/s/y")).unwrap();
        assert_eq!(j.finish(&e, || Ok(())).unwrap().unwrap(), Finish::Superseded);
        let e = j.first().unwrap().unwrap();
        let failed = j.finish(&e, || Err(io::Error::other("store down"))).unwrap();
        assert!(failed.is_err());
        assert!(j.lookup(Path::new("/s/y")).unwrap().is_some(), "a failed publication keeps the entry");
        assert_eq!(j.finish(&e, || Ok(())).unwrap().unwrap(), Finish::Done);
        assert!(j.first().unwrap().is_none());
        assert!(!j.staged_path(&e.staged).exists());
        assert_eq!(j.staged_bytes().unwrap(), 0);
    }

    #[test]
    fn orphans_of_dead_writers_are_swept_and_named_files_kept() {
        let d = tempfile::tempdir().unwrap();
        let j = Journal::open(d.path()).unwrap();
        let kept = staged(&j, b"1");
        j.commit(Path::new("/s/k"), &kept, 1, [0; 32]).unwrap();
        let mine = staged(&j, b"open"); // this process lives: its file is being written
        std::fs::write(j.staged_path("999999999.0.0"), b"dead").unwrap();
        assert_eq!(j.sweep_orphans().unwrap(), 1);
        assert!(j.staged_path(&kept).exists() && j.staged_path(&mine).exists());
    }
}
