//! Sending a file to the process of another node that asked for it (the owner's side of a `Fetch`).
//!
//! The agent first makes sure its node holds the file (its cache fetches it from the source once, as
//! for any reader of the node), says which version it sends, then streams it in chunks of at most
//! [`CHUNK`] bytes, never more than the asker's credit ahead (DYAD's receiver-driven flow control: a
//! slow reader holds back the sender instead of filling its memory). The file's blake3, recorded when
//! the copy was made from the source, ends the transfer.
//!
//! A copy with a recorded blake3 goes from its descriptor into the socket with `sendfile`
//! ([`crate::sendfile`]): the agent neither copies it through user space nor hashes it. The reader
//! checks every byte against the recorded hash; when they do not match it says so ([`Frame::Damaged`]),
//! and the agent checks its copy ([`serve_damaged`]) and removes it if it is damaged, while the reader
//! reads the source. A copy with no recorded hash (the source's own descriptor, when no tier had room)
//! is read and hashed as it is sent, and a mismatch found then is reported as damage at once.
//!
//! Every path a request names ([`serve_fetch`], [`serve_ranges`], [`serve_damaged`]) is resolved beneath
//! the source directory by the cache's peer opens ([`Cache::open_for_peer`],
//! [`Cache::open_parts_for_peer`], [`Cache::check_served`]; see `tierstore_core::cache`'s `peers.rs`): a
//! symlink that leads out of the source is refused with an error frame before a byte is read, even where
//! a local open of this node cached its target, and the reader reads the file from the store itself.

use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Duration;

use tierstore_core::cache::Served;
use tierstore_core::{Cache, Growing};
use tokio::io::{AsyncRead, AsyncWrite};

use crate::protocol::{Conn, ErrorCode, Frame, CHUNK};
use crate::sendfile::{Polled, Socket};

/// How often an owner still fetching a file from the store tells the asker so: well within any reader's
/// deadline on a frame.
pub const STILL_FETCHING: Duration = Duration::from_millis(250);

/// Serves one `Fetch` on `stream`. `Err` only when the connection itself failed (it is then closed); a
/// file that cannot be served is answered with an error frame and the connection goes on.
pub async fn serve_fetch<S: AsyncRead + AsyncWrite + Unpin + Socket>(
    stream: &mut Conn<S>,
    cache: Option<Arc<Cache>>,
    deadline: Duration,
    id: u32,
    asked: Whole<'_>,
) -> io::Result<()> {
    let Whole { source, rel, credit } = asked;
    let cache = match serving(cache, source) {
        Ok(c) => c,
        Err(refusal) => return write(stream, &refusal, deadline).await,
    };
    let mut answer = Answer { stream, cache: cache.clone(), id, credit, deadline, nonce: 0 };
    let Some(served) = answer.open(rel).await? else { return Ok(()) };
    let size = served.identity.size;
    answer.write(&Frame::Found { id, identity: served.identity }).await?;
    if credit == 0 {
        // Asked only to hold the file.
        return answer.write(&Frame::Done { id, hash: served.checksum.unwrap_or([0; 32]) }).await;
    }
    let sent = if let Some(copy) = served.copy.clone() {
        if zero_copy(answer.stream).is_some() {
            answer.send_growing(served.file, copy, size).await?
        } else if answer.await_whole(&copy, rel).await? {
            // No socket to hand to `sendfile` (an in-memory pipe): the copy goes out once it is whole.
            answer.send_hashed(served.file, size, None, rel).await?
        } else {
            false
        }
    } else {
        match served.checksum {
            Some(recorded) if zero_copy(answer.stream).is_some() => {
                answer.send_recorded(served.file, size, recorded).await?
            }
            recorded => answer.send_hashed(served.file, size, recorded, rel).await?,
        }
    };
    if sent {
        cache.count_served(size);
    }
    Ok(())
}

/// One `Fetch` being answered: the connection, the cache serving it, the transfer's id and the credit
/// the asker granted first, the deadline on each frame, and the pings sent while the asker waits.
struct Answer<'s, S> {
    stream: &'s mut Conn<S>,
    cache: Arc<Cache>,
    id: u32,
    credit: u32,
    deadline: Duration,
    nonce: u64,
}

impl<S: AsyncRead + AsyncWrite + Unpin + Socket> Answer<'_, S> {
    async fn write(&mut self, frame: &Frame) -> io::Result<()> {
        write(self.stream, frame, self.deadline).await
    }

    async fn refuse(&mut self, code: ErrorCode, message: String) -> io::Result<()> {
        self.write(&Frame::Error { code, message }).await
    }

    /// The copy of `rel` to serve, opened on the blocking pool; `None` when it could not be (refused).
    /// A reader that takes the bytes can have a large file while this node's copy of it is still being
    /// made; one that only asks this node to hold the file is answered once the copy is whole.
    async fn open(&mut self, rel: &str) -> io::Result<Option<Served>> {
        let (opener, wanted, follow) = (self.cache.clone(), rel.to_string(), self.credit > 0);
        let opening = tokio::task::spawn_blocking(move || opener.open_for_peer(&wanted, follow));
        // Fetching a large file from the store may take longer than the asker's deadline on a frame (its
        // own TIERSTORE_PEER_DEADLINE_MS): say every STILL_FETCHING that the file is still coming, so that
        // the asker keeps waiting for this one fetch rather than reading the store itself.
        match while_pinging(self.stream, self.deadline, &mut self.nonce, opening).await? {
            Ok(served) => Ok(Some(served)),
            Err(e) => {
                let code = if e.is_not_found() { ErrorCode::NotFound } else { ErrorCode::Failed };
                self.refuse(code, e.to_string()).await?;
                Ok(None)
            }
        }
    }

    /// Sends a copy still being made: each chunk goes out once written, with the chaining value the copy
    /// recorded for it; the whole file's blake3 follows from those values. True when all of it went.
    async fn send_growing(&mut self, file: std::fs::File, copy: Arc<Growing>, size: u64) -> io::Result<bool> {
        let socket = zero_copy(self.stream).expect("checked by the caller").try_clone_to_owned()?;
        let seals = std::mem::take(&mut self.stream.seals);
        let (following, deadline, id, credit) = (copy.clone(), self.deadline, self.id, self.credit);
        let (sent, seals) = tokio::task::spawn_blocking(move || {
            let copy = Some((&*following, STILL_FETCHING));
            crate::sendfile::send_chunks(Polled::new(socket, seals, deadline), &file, size, id, credit, copy)
        })
        .await
        .map_err(io::Error::other)??;
        self.stream.seals = seals;
        if let Err(why) = sent {
            self.refuse(ErrorCode::Failed, why).await?;
            return Ok(false);
        }
        let hash = tierstore_core::hash::root_of_pieces(&copy.pieces(), size, tierstore_core::hash::PIECE);
        self.write(&Frame::Done { id, hash }).await?;
        Ok(true)
    }

    /// Waits until a copy whose readers cannot follow it is whole, pinging the asker meanwhile. False
    /// (refused) when the copy stopped short.
    async fn await_whole(&mut self, copy: &Arc<Growing>, rel: &str) -> io::Result<bool> {
        loop {
            let c = copy.clone();
            match tokio::task::spawn_blocking(move || c.ended(STILL_FETCHING)).await.map_err(io::Error::other)? {
                Some(tierstore_core::CopyState::Finished) => return Ok(true),
                Some(_) => {
                    let why = format!("this node's copy of {rel} from the store stopped short");
                    self.refuse(ErrorCode::Failed, why).await?;
                    return Ok(false);
                }
                None => {
                    self.nonce += 1;
                    self.write(&Frame::Ping { nonce: self.nonce }).await?;
                }
            }
        }
    }

    /// Sends the copy as it was recorded: straight from its descriptor, unhashed (the reader checks it
    /// against the `recorded` blake3).
    async fn send_recorded(&mut self, file: std::fs::File, size: u64, recorded: [u8; 32]) -> io::Result<bool> {
        let socket = zero_copy(self.stream).expect("checked by the caller").try_clone_to_owned()?;
        let seals = std::mem::take(&mut self.stream.seals);
        let (deadline, id, credit) = (self.deadline, self.id, self.credit);
        let (sent, seals) = tokio::task::spawn_blocking(move || {
            crate::sendfile::send_chunks(Polled::new(socket, seals, deadline), &file, size, id, credit, None)
        })
        .await
        .map_err(io::Error::other)??;
        sent.map_err(io::Error::other)?;
        self.stream.seals = seals;
        self.write(&Frame::Done { id, hash: recorded }).await?;
        Ok(true)
    }

    /// Sends the copy through this process, hashing it as it goes. A copy whose hash differs from the
    /// `recorded` one is damaged: it is removed, and the reader told.
    async fn send_hashed(
        &mut self,
        file: std::fs::File,
        size: u64,
        recorded: Option<[u8; 32]>,
        rel: &str,
    ) -> io::Result<bool> {
        let (id, credit, deadline) = (self.id, self.credit, self.deadline);
        let hash = match send_chunks(self.stream, Arc::new(file), size, id, credit, deadline).await? {
            Ok(hash) => hash,
            Err(e) => {
                self.refuse(ErrorCode::Failed, format!("reading the copy of {rel} failed: {e}")).await?;
                return Ok(false);
            }
        };
        if recorded.is_some_and(|recorded| recorded != hash) {
            let (c, wanted) = (self.cache.clone(), rel.to_string());
            let _ = tokio::task::spawn_blocking(move || c.drop_damaged(&wanted)).await;
            self.refuse(ErrorCode::Failed, format!("the copy of {rel} on this node is damaged; it was removed"))
                .await?;
            return Ok(false);
        }
        self.write(&Frame::Done { id, hash }).await?;
        Ok(true)
    }
}

/// Serves one [`Frame::Damaged`]: a reader found that the bytes of `rel` it was sent do not hash to the
/// blake3 sent with them. The copy is checked against its record on the blocking pool and removed if it
/// does not match; the answer says which.
pub async fn serve_damaged<S: AsyncWrite + Unpin>(
    stream: &mut Conn<S>,
    cache: Option<Arc<Cache>>,
    deadline: Duration,
    id: u32,
    source: &str,
    rel: &str,
) -> io::Result<()> {
    let Some(cache) = cache.filter(|c| c.config().source.to_string_lossy() == source) else {
        return write(stream, &Frame::Checked { id, removed: false }, deadline).await;
    };
    let wanted = rel.to_string();
    let removed = match tokio::task::spawn_blocking(move || cache.check_served(&wanted)).await {
        Ok(Ok(removed)) => removed,
        Ok(Err(e)) => {
            log::warn!("a reader reported damaged bytes of {rel}, and its copy could not be checked: {e}");
            false
        }
        Err(e) => {
            log::warn!("checking the copy of {rel} failed: {e}");
            false
        }
    };
    write(stream, &Frame::Checked { id, removed }, deadline).await
}

/// Sends `size` bytes of `file` as chunks of transfer `id`, never more than the reader's credit ahead
/// (starting with `credit`, then as it grants more); returns their blake3. `Err`: the connection failed;
/// `Ok(Err)`: the file could not be read (nothing more was sent; the caller answers with an error).
pub async fn send_chunks<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut Conn<S>,
    file: Arc<std::fs::File>,
    size: u64,
    id: u32,
    credit: u32,
    deadline: Duration,
) -> io::Result<Result<[u8; 32], io::Error>> {
    let mut credit = credit;
    let mut offset = 0u64;
    let mut hasher = tierstore_core::hash::Hasher::new();
    while offset < size {
        await_credit(stream, id, &mut credit, deadline).await?;
        let n = CHUNK.min((size - offset) as usize);
        let f = file.clone();
        let data = tokio::task::spawn_blocking(move || {
            let mut buf = vec![0u8; n];
            f.read_exact_at(&mut buf, offset).map(|()| buf)
        })
        .await
        .map_err(io::Error::other)?;
        let data = match data {
            Ok(d) => d,
            Err(e) => return Ok(Err(e)),
        };
        hasher.update(&data);
        write(stream, &Frame::Chunk { id, offset, data }, deadline).await?;
        offset += n as u64;
        credit -= 1;
    }
    Ok(Ok(*hasher.finalize().as_bytes()))
}

/// What a `Fetch` asks for.
pub struct Whole<'a> {
    /// The source directory, as every node mounts it.
    pub source: &'a str,
    /// The file, relative to the source.
    pub rel: &'a str,
    /// Chunks the asker takes before it grants more.
    pub credit: u32,
}

/// What a `FetchRanges` asks for.
pub struct Parts<'a> {
    /// The source directory, as every node mounts it.
    pub source: &'a str,
    /// The file, relative to the source.
    pub rel: &'a str,
    /// `(offset, length)` of each part.
    pub ranges: &'a [(u64, u64)],
    /// Chunks the asker takes before it grants more.
    pub credit: u32,
    /// The asker checks every byte itself: nothing is hashed, and the `Done` carries zeros.
    pub unhashed: bool,
}

/// Serves one `FetchRanges`: parts of a file (a partial model load's tensors), read from this node's
/// whole copy when a tier holds one, else from the store by the blocks this agent keeps for the next
/// asker ([`Cache::open_parts_for_peer`]); never a whole-file fetch. Each part goes out in order, as
/// chunks that never cross a block, under the asker's credit; the blake3 of all the bytes sent ends it
/// (unless the asker checks them itself).
// Long on purpose: one pass of awaits over the connection that threads the asker's credit, the running
// hash and the keep-alive pings' nonce through every part; split, each step would take all three.
pub async fn serve_ranges<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut Conn<S>,
    cache: Option<Arc<Cache>>,
    deadline: Duration,
    id: u32,
    asked: Parts<'_>,
) -> io::Result<()> {
    let Parts { source, rel, ranges, credit, unhashed } = asked;
    use tierstore_core::PART_BLOCK;
    let refuse = |code: ErrorCode, message: String| Frame::Error { code, message };
    let cache = match serving(cache, source) {
        Ok(c) => c,
        Err(refusal) => return write(stream, &refusal, deadline).await,
    };
    let wanted = rel.to_string();
    let mut nonce = 0;
    let opening = tokio::task::spawn_blocking(move || cache.open_parts_for_peer(&wanted));
    let served = match while_pinging(stream, deadline, &mut nonce, opening).await? {
        Ok(s) => Arc::new(s),
        Err(e) => {
            let code = if e.is_not_found() { ErrorCode::NotFound } else { ErrorCode::Failed };
            return write(stream, &refuse(code, e.to_string()), deadline).await;
        }
    };
    let size = served.identity.size;
    if let Some((offset, len)) = ranges.iter().find(|(o, l)| o.checked_add(*l).is_none_or(|end| end > size)) {
        let why = format!("the part of {len} bytes at {offset} lies past the end of {rel} ({size} bytes)");
        return write(stream, &refuse(ErrorCode::BadRequest, why), deadline).await;
    }
    write(stream, &Frame::Found { id, identity: served.identity }, deadline).await?;
    let (mut credit, mut sent) = (credit, 0u64);
    let mut hasher = (!unhashed).then(tierstore_core::hash::Hasher::new);
    for &(offset, len) in ranges {
        let (mut at, end) = (offset, offset + len);
        while at < end {
            await_credit(stream, id, &mut credit, deadline).await?;
            let n = (end - at).min(PART_BLOCK - at % PART_BLOCK).min(CHUNK as u64) as usize;
            let (s, mut h) = (served.clone(), hasher.take());
            // Read (from the store, when the block is nobody's yet) and hashed on the blocking pool.
            let reading = tokio::task::spawn_blocking(move || {
                let read = s.read(at, n, end);
                if let (Ok(data), Some(h)) = (&read, h.as_mut()) {
                    h.update(data);
                }
                (read, h)
            });
            let (read, h) = while_pinging(stream, deadline, &mut nonce, reading).await?;
            hasher = h;
            let data = match read {
                Ok(data) => data,
                Err(e) => {
                    return write(stream, &refuse(ErrorCode::Failed, format!("reading a part failed: {e}")), deadline)
                        .await
                }
            };
            write(stream, &Frame::Chunk { id, offset: at, data }, deadline).await?;
            (at, sent, credit) = (at + n as u64, sent + n as u64, credit - 1);
        }
    }
    let hash = hasher.map_or([0; 32], |h| *h.finalize().as_bytes());
    write(stream, &Frame::Done { id, hash }, deadline).await?;
    served.count_served(sent);
    Ok(())
}

/// The cache that serves `source`, or the error frame that says why this agent does not.
fn serving(cache: Option<Arc<Cache>>, source: &str) -> Result<Arc<Cache>, Frame> {
    let Some(cache) = cache else {
        let message = "this agent serves no source; start it with the job's --source".into();
        return Err(Frame::Error { code: ErrorCode::BadRequest, message });
    };
    let ours = cache.config().source.to_string_lossy().into_owned();
    if source != ours {
        let message =
            format!("this agent caches {ours}, not {source}: every node must mount the source at the same path");
        return Err(Frame::Error { code: ErrorCode::NotFound, message });
    }
    Ok(cache)
}

/// Waits for `work` on the blocking pool, telling the asker every [`STILL_FETCHING`] that its bytes are
/// still coming (a read of the store may outlast the asker's deadline on a frame).
async fn while_pinging<S: AsyncWrite + Unpin, T: Send + 'static>(
    stream: &mut Conn<S>,
    deadline: Duration,
    nonce: &mut u64,
    mut work: tokio::task::JoinHandle<T>,
) -> io::Result<T> {
    loop {
        tokio::select! {
            done = &mut work => return done.map_err(|e| io::Error::other(format!("the read failed: {e}"))),
            _ = tokio::time::sleep(STILL_FETCHING) => {
                *nonce += 1;
                write(stream, &Frame::Ping { nonce: *nonce }, deadline).await?;
            }
        }
    }
}

/// Waits until the asker of transfer `id` has granted credit for a chunk.
async fn await_credit<S: AsyncRead + Unpin>(
    stream: &mut Conn<S>,
    id: u32,
    credit: &mut u32,
    deadline: Duration,
) -> io::Result<()> {
    while *credit == 0 {
        match tokio::time::timeout(deadline, stream.read_frame()).await {
            Ok(Ok(Some(Frame::Credit { id: i, more }))) if i == id => *credit = credit.saturating_add(more),
            Ok(Ok(other)) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("expected credit for transfer {id}, got {other:?}"),
                ))
            }
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(io::Error::new(io::ErrorKind::TimedOut, "the reader granted no credit in time")),
        }
    }
    Ok(())
}

/// The socket to hand to `sendfile`: none on an encrypted connection, whose chunks must go through
/// the cipher (nor on an in-memory pipe).
fn zero_copy<S: Socket>(stream: &Conn<S>) -> Option<std::os::fd::BorrowedFd<'_>> {
    if stream.seals.encrypted() {
        return None;
    }
    stream.stream.socket()
}

async fn write<S: AsyncWrite + Unpin>(stream: &mut Conn<S>, frame: &Frame, deadline: Duration) -> io::Result<()> {
    match tokio::time::timeout(deadline, stream.write_frame(frame)).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, "the reader took nothing in time")),
    }
}

/// Serves one `StagedFetch`: the staged copy of `path` (a file this node wrote under a write-back
/// destination and has not yet put on the store), as `serve_fetch` serves a cached file. Its `Found`
/// carries the size and the time the program closed it; its `Done` the blake3 the journal recorded at
/// close, sent only when the bytes sent hash to it (a copy changed since is refused, never vouched for).
pub async fn serve_staged<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut Conn<S>,
    writeback: Option<Arc<crate::writeback::Migrations>>,
    deadline: Duration,
    id: u32,
    path: &str,
    credit: u32,
) -> io::Result<()> {
    let refuse = |code: ErrorCode, message: String| Frame::Error { code, message };
    let not_here = || refuse(ErrorCode::NotFound, format!("{path} is not staged on this node"));
    let Some(wb) = writeback else { return write(stream, &not_here(), deadline).await };
    let wanted = std::path::PathBuf::from(path);
    let staged = match tokio::task::spawn_blocking(move || wb.staged(&wanted)).await {
        Ok(Some(s)) => s,
        Ok(None) => return write(stream, &not_here(), deadline).await,
        Err(e) => return write(stream, &refuse(ErrorCode::Failed, format!("the lookup failed: {e}")), deadline).await,
    };
    let (entry, file) = staged;
    let closed = entry.created_ns as i64;
    let identity = tierstore_core::index::SourceId {
        size: entry.size,
        mtime_ns: closed,
        ctime_ns: closed,
        ino: 0,
        dev: 0,
        attrs: None,
    };
    write(stream, &Frame::Found { id, identity }, deadline).await?;
    if credit == 0 {
        return write(stream, &Frame::Done { id, hash: entry.hash }, deadline).await;
    }
    let hash = match send_chunks(stream, Arc::new(file), entry.size, id, credit, deadline).await? {
        Ok(hash) => hash,
        Err(e) => {
            let f = refuse(ErrorCode::Failed, format!("reading the staged copy of {path} failed: {e}"));
            return write(stream, &f, deadline).await;
        }
    };
    if hash != entry.hash {
        let f = refuse(
            ErrorCode::Failed,
            format!("the staged copy of {path} no longer matches what its program closed (changed since)"),
        );
        return write(stream, &f, deadline).await;
    }
    write(stream, &Frame::Done { id, hash }, deadline).await
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use tierstore_core::hash::hash_file;
    use tierstore_core::writeback::journal::{new_staged_name, Journal};

    use super::*;
    use crate::protocol::{self, Seal, Seals};
    use crate::writeback::Migrations;

    /// The frames a `StagedFetch` of `path` is answered with, up to its `Done` or `Error`.
    async fn staged_fetch(m: Arc<Migrations>, path: &str, credit: u32) -> Vec<Frame> {
        let (server_end, mut client_end) = tokio::io::duplex(4 << 20);
        let path = path.to_string();
        // Tagged as on a peer's TCP connection.
        let (to_reader, to_agent) = ([1; 32], [2; 32]);
        let server = tokio::spawn(async move {
            let mut conn = Conn { stream: server_end, seals: Seals::keyed(to_reader, to_agent) };
            serve_staged(&mut conn, Some(m), Duration::from_secs(5), 1, &path, credit).await.unwrap();
        });
        let mut frames = Vec::new();
        let mut seal = Seal::keyed(to_reader);
        loop {
            let f = protocol::read_sealed(&mut client_end, &mut seal).await.unwrap().unwrap();
            let end = matches!(f, Frame::Done { .. } | Frame::Error { .. });
            frames.push(f);
            if end {
                break;
            }
        }
        server.await.unwrap();
        frames
    }

    #[test]
    fn a_staged_file_is_sent_whole_and_a_changed_one_is_never_vouched_for() {
        let d = tempfile::tempdir().unwrap();
        let j = Arc::new(Journal::open(d.path()).unwrap());
        let name = new_staged_name();
        let data: Vec<u8> = (0..CHUNK + 10).map(|i| (i % 251) as u8).collect();
        std::fs::write(j.staged_path(&name), &data).unwrap();
        let (size, hash) = hash_file(&j.staged_path(&name)).unwrap();
        j.commit(Path::new("/store/ckpt/a"), &name, size, hash).unwrap();
        let m = Arc::new(Migrations::serving(vec![j.clone()]));
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let frames = staged_fetch(m.clone(), "/store/ckpt/a", 8).await;
            let Frame::Found { identity, .. } = &frames[0] else { panic!("{:?}", frames[0]) };
            assert_eq!(identity.size, size);
            let sent: Vec<u8> = frames
                .iter()
                .filter_map(|f| match f {
                    Frame::Chunk { data, .. } => Some(data.clone()),
                    _ => None,
                })
                .flatten()
                .collect();
            assert_eq!(sent, data);
            assert_eq!(frames.last(), Some(&Frame::Done { id: 1, hash }));
            // Asked only whether it is staged: its identity and the journal's hash, no chunk.
            let frames = staged_fetch(m.clone(), "/store/ckpt/a", 0).await;
            assert_eq!(frames.len(), 2);
            let frames = staged_fetch(m.clone(), "/store/ckpt/other", 8).await;
            assert!(matches!(&frames[0], Frame::Error { code: ErrorCode::NotFound, .. }), "{frames:?}");
            // The staged copy changed after its close: its bytes go out, but never a Done for them.
            let mut changed = data.clone();
            changed[7] ^= 1;
            std::fs::write(j.staged_path(&name), &changed).unwrap();
            let frames = staged_fetch(m, "/store/ckpt/a", 8).await;
            assert!(matches!(frames.last(), Some(Frame::Error { code: ErrorCode::Failed, .. })), "{frames:?}");
        });
    }
}
