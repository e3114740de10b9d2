//! Serving a peer a file that another process of this node is copying from the store right now.
//!
//! The node's fetch lock lets one process copy a file from the store while the others wait for it
//! (DYAD's coordination). The agent must not wait: a peer asking it for a large file would then get its
//! first byte only after this node's whole copy, where it gets it at once when the agent makes the copy
//! itself. On a model's start-up both happen, and which one does depends on who asks first: the owner
//! node's own load, or another node through the agent. So when the agent finds the fetch lock held by
//! another process, it follows that process's temporary copy as it grows: it reads each piece once the
//! file holds it, hashes it (the other process keeps its chaining values to itself), and records the value
//! in a [`Growing`] of its own, which the send loop serves exactly as a copy of its own. The last bytes
//! count only once the other process has published the copy with the blake3 the pieces merge into; if it
//! gives up, or publishes something else, the transfer fails and the peer reads the store.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::engine::Inner;
use super::flight::{Lead, Outcome};
use super::serve::{Beneath, Served};
use crate::error::Error;
use crate::hash::{root_of_pieces, subtree, Hash, PIECE};
use crate::index::Key;
use crate::reader::Growing;

/// How often the size of the other process's copy is looked at while it has not grown.
const POLL: Duration = Duration::from_millis(2);

/// How long the process holding a file's fetch lock may take to start its copy (it opens and identifies
/// the store's file first) before the agent waits for its end instead.
const TEMP_WAIT: Duration = Duration::from_secs(2);

/// How long the other process's copy may stay the same size (or stay unpublished once whole) before the
/// agent stops following it and fails the transfer.
const STALLED: Duration = Duration::from_secs(60);

impl Inner {
    /// A large file (more than one piece) that another process of this node is copying from the store:
    /// served as it grows, the flight this thread leads handed the same copy for the agent's other askers
    /// and landed when the copy ends. `Ok(Err(lead))` hands the lead back when no other process is
    /// copying it, or (a POSIX source) `beneath` does not vouch for the version it copies; `Err` (the
    /// flight landed) when the path the peer asked for leaves the source.
    pub(super) fn follow_sibling(
        self: &Arc<Self>,
        rel: &str,
        lead: Lead,
        beneath: &mut Beneath<'_>,
    ) -> Result<Result<Served, Lead>, Error> {
        let key = *lead.key();
        let Some((t, temp)) = self.sibling_temp(&key) else { return Ok(Err(lead)) };
        let Ok(file) = File::open(&temp) else { return Ok(Err(lead)) };
        let path = self.storage().source().path_of(rel);
        // The version the other process copies: its copy is checked against it once published. (A store
        // that fails to say is left to the usual path, which reports it.)
        let sid = if beneath.applies() {
            // On a POSIX source, the version the other process reserved its copy for: it reads the copy
            // from a descriptor of exactly that version, so a version vouched for is a file beneath the
            // source (and the copy of a file a local open reached through a symlink out of it never is).
            let reserved =
                self.storage().lookup().tiers()[t].index.as_ref().ok().and_then(|ix| ix.lookup(&key).ok().flatten());
            let Some(sid) = reserved.filter(|e| !e.ready && e.rel == rel).map(|e| e.source) else {
                return Ok(Err(lead));
            };
            match beneath.vouches(&sid) {
                Ok(true) => sid,
                Ok(false) => return Ok(Err(lead)),
                Err(e) => return Err(e),
            }
        } else {
            let Ok(sid) = self.storage().source().identify(rel) else { return Ok(Err(lead)) };
            sid
        };
        if sid.size <= PIECE as u64 {
            return Ok(Err(lead));
        }
        // Until the flight has the copy, failing here leaves this thread its leader on the usual path.
        let Ok(reader) = file.try_clone() else { return Ok(Err(lead)) };
        let copy = Arc::new(Growing::new(reader, sid));
        lead.deliver(Outcome::Growing(copy.clone()));
        let (inner, k, r, following) = (self.clone(), key, rel.to_string(), copy.clone());
        let spawned = crate::interposer::spawn("tierstore-sibling".into(), move || {
            match inner.watch_sibling(&k, &r, &file, &following) {
                Ok(merged) => following.finish(Some(merged)),
                Err(why) => {
                    log::debug!("stopped following another process's copy of {r}: {why}");
                    following.fail();
                }
            }
            drop(lead);
        });
        if let Err(e) = spawned {
            // The closure, and the lead with it, is dropped: the flight has landed.
            copy.fail();
            return Err(Error::io(&path, e));
        }
        let file = copy.file().try_clone().map_err(|e| Error::io(&temp, e))?;
        Ok(Ok(Served { file, identity: sid, checksum: None, copy: Some(copy) }))
    }

    /// Records each piece of `file` (the other process's copy) in `copy` as the file comes to hold it,
    /// then waits for the other process to publish the copy: `Ok(the blake3 its pieces merge into)` once
    /// it has, as the version `copy` names, with that blake3; `Err` (why) when it gave up, stalled or
    /// published something else.
    fn watch_sibling(&self, key: &Key, rel: &str, file: &File, copy: &Growing) -> Result<Hash, String> {
        let (size, sid) = (copy.size(), *copy.version());
        let mut buf = vec![0u8; PIECE];
        let (mut hashed, mut moved) = (0u64, Instant::now());
        while hashed < size {
            let have = file.metadata().map_err(|e| e.to_string())?.len();
            if have > size {
                return Err(format!("the copy grew past {size} bytes: another version"));
            }
            let n = PIECE.min((size - hashed) as usize) as u64;
            if have >= hashed + n {
                file.read_exact_at(&mut buf[..n as usize], hashed).map_err(|e| e.to_string())?;
                copy.record_piece(&subtree(hashed, &buf[..n as usize]));
                hashed += n;
                copy.advance(hashed.min(size - 1));
                moved = Instant::now();
                continue;
            }
            if self.sibling_gave_up(key) {
                return Err("the other process stopped copying".into());
            }
            if moved.elapsed() > STALLED {
                return Err(format!("the copy stayed at {have} bytes for {STALLED:?}"));
            }
            std::thread::sleep(POLL);
        }
        let merged = root_of_pieces(&copy.pieces(), size, PIECE);
        loop {
            if let Some(e) = self.storage().lookup().published(key, rel) {
                return if e.source == sid && e.checksum == Some(merged) {
                    Ok(merged) // its end is reached once the caller finishes the copy
                } else {
                    Err("the other process published another version, or other bytes".into())
                };
            }
            if self.sibling_gave_up(key) && self.storage().lookup().published(key, rel).is_none() {
                return Err("the other process ended its copy without publishing it".into());
            }
            if moved.elapsed() > STALLED {
                return Err(format!("the copy was not published within {STALLED:?}"));
            }
            std::thread::sleep(POLL);
        }
    }

    /// The temporary copy of `key` that the process holding its fetch lock is writing, and its tier: `None`
    /// when no other process holds the lock, or it creates no copy within [`TEMP_WAIT`] (it may still be
    /// opening the store's file, or reading a small one whole). This thread must lead the process's flight of
    /// `key`: no other thread of this process then holds the lock, so taking it here means that nobody
    /// does (POSIX record locks are the process's).
    fn sibling_temp(&self, key: &Key) -> Option<(usize, std::path::PathBuf)> {
        let since = Instant::now();
        loop {
            if !matches!(self.fetcher().try_lock(key), Ok(None)) {
                return None;
            }
            if let Some(found) =
                self.storage().lookup().tiers().iter().enumerate().find_map(|(i, t)| Some((i, t.temp_of_another(key)?)))
            {
                return Some(found);
            }
            if since.elapsed() > TEMP_WAIT {
                return None;
            }
            std::thread::sleep(POLL);
        }
    }

    /// Whether no process holds the fetch lock of `key` any more (taken and let go at once).
    fn sibling_gave_up(&self, key: &Key) -> bool {
        matches!(self.fetcher().try_lock(key), Ok(Some(_)))
    }
}
