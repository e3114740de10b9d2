//! Sending a copy's bytes from its descriptor straight into the socket (`sendfile`): the owner neither
//! reads them into user space nor hashes them; the blake3 recorded when the copy was made goes with them,
//! and the reader checks it.
//!
//! The whole send loop of a transfer runs on tokio's blocking pool, on a duplicate of the connection's
//! socket: a slow reader holds a blocking thread, never the runtime, and a connection dropped meanwhile
//! cannot leave the loop writing into a descriptor number reused since. The socket stays nonblocking (the
//! runtime owns its flags): a full socket buffer is waited for with `poll`, at most the deadline per wait,
//! as the async path waits at most the deadline per frame. The reader's credit frames are read on the
//! same duplicate, between chunks, exactly as many bytes as each frame has.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use tierstore_core::cluster::seal::Seals;
use tierstore_core::cluster::wire::{Frame, CHUNK};
use tierstore_core::{CopyState, Growing, Piece};

/// A connection whose socket the owner can hand to `sendfile`: TCP and Unix sockets. Anything else (an
/// in-memory pipe in a test) says `None`, and its bytes go through the buffered path.
pub trait Socket {
    /// The connection's socket, if it has one.
    fn socket(&self) -> Option<BorrowedFd<'_>>;
}

impl Socket for tokio::net::TcpStream {
    fn socket(&self) -> Option<BorrowedFd<'_>> {
        Some(std::os::fd::AsFd::as_fd(self))
    }
}

impl Socket for tokio::net::UnixStream {
    fn socket(&self) -> Option<BorrowedFd<'_>> {
        Some(std::os::fd::AsFd::as_fd(self))
    }
}

impl Socket for tokio::io::DuplexStream {
    fn socket(&self) -> Option<BorrowedFd<'_>> {
        None
    }
}

/// A nonblocking socket used from a blocking thread: each wait for it is at most `deadline`. Its frames
/// are tagged under the connection's keys, in turn with the frames the async side wrote before.
pub struct Polled {
    fd: OwnedFd,
    deadline: Duration,
    seals: Seals,
}

impl Polled {
    /// `socket` (a duplicate of the connection's, nonblocking), whose frames are tagged under `seals`,
    /// each wait at most `deadline`.
    pub fn new(socket: OwnedFd, seals: Seals, deadline: Duration) -> Polled {
        Polled { fd: socket, deadline, seals }
    }

    /// Waits until the socket is ready for `events`, at most the deadline.
    fn wait(&self, events: libc::c_short) -> io::Result<()> {
        let until = Instant::now() + self.deadline;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let what = if events == libc::POLLIN { "granted no credit" } else { "took nothing" };
                return Err(io::Error::new(io::ErrorKind::TimedOut, format!("the reader {what} in time")));
            }
            let mut p = libc::pollfd { fd: self.fd.as_raw_fd(), events, revents: 0 };
            let ms = left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
            // SAFETY: one valid pollfd, for the duration of the call.
            let n = unsafe { libc::poll(&mut p, 1, ms) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if n > 0 {
                // An error or hang-up shows in the next send or recv.
                return Ok(());
            }
        }
    }

    /// Sends all of `bytes`, telling the kernel more follows (the chunk's data) so that a header is not
    /// a packet of its own.
    fn send_more(&self, bytes: &[u8]) -> io::Result<()> {
        self.send_all(bytes, libc::MSG_MORE)
    }

    /// Sends one whole frame now (not held back for more).
    fn send_frame(&mut self, frame: &Frame) -> io::Result<()> {
        let bytes = self.seals.send.bytes_of(frame);
        self.send_all(&bytes, 0)
    }

    /// Sends a frame that the chunk after it follows at once.
    fn send_frame_more(&mut self, frame: &Frame) -> io::Result<()> {
        let bytes = self.seals.send.bytes_of(frame);
        self.send_more(&bytes)
    }

    /// Reads one frame (the reader's credit).
    fn read_frame(&mut self) -> io::Result<Option<Frame>> {
        let mut seal = std::mem::take(&mut self.seals.recv);
        let read = seal.read_frame(&mut &*self);
        self.seals.recv = seal;
        read
    }

    /// Sends all of `bytes` with `send(2)` and `flags`, waiting (at most the deadline each time) while the
    /// socket is full.
    fn send_all(&self, mut bytes: &[u8], flags: libc::c_int) -> io::Result<()> {
        while !bytes.is_empty() {
            // SAFETY: `bytes` is valid for its length for the duration of the call.
            let n = unsafe {
                libc::send(
                    self.fd.as_raw_fd(),
                    bytes.as_ptr() as *const libc::c_void,
                    bytes.len(),
                    flags | libc::MSG_NOSIGNAL,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::WouldBlock => self.wait(libc::POLLOUT)?,
                    io::ErrorKind::Interrupted => {}
                    _ => return Err(e),
                }
                continue;
            }
            bytes = &bytes[n as usize..];
        }
        Ok(())
    }

    /// Sends `len` bytes of `file` from `offset` with `sendfile`. Where the file ends early (it shrank
    /// since it was opened) or cannot be read, the rest is sent as zeros: the frame stays whole, and the
    /// reader's hash check refuses the bytes (and reports the copy) instead of the connection breaking.
    fn send_file(&self, file: &File, offset: u64, len: usize) -> io::Result<()> {
        let mut off = offset as libc::off_t;
        let mut left = len;
        while left > 0 {
            // SAFETY: both descriptors are open for the call; `off` is a valid offset pointer.
            let n = unsafe { libc::sendfile(self.fd.as_raw_fd(), file.as_raw_fd(), &mut off, left) };
            if n > 0 {
                left -= n as usize;
                continue;
            }
            if n == 0 {
                break;
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EAGAIN) => self.wait(libc::POLLOUT)?,
                Some(libc::EINTR) => {}
                // The file's side failed: no byte of this call was sent.
                Some(libc::EIO | libc::EINVAL | libc::ENOSYS | libc::EOVERFLOW) => break,
                _ => return Err(e),
            }
        }
        let zeros = [0u8; 64 << 10];
        while left > 0 {
            let n = left.min(zeros.len());
            self.send_more(&zeros[..n])?;
            left -= n;
        }
        Ok(())
    }
}

impl Read for &Polled {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            // SAFETY: `buf` is valid for its length for the duration of the call.
            let n = unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock => self.wait(libc::POLLIN)?,
                io::ErrorKind::Interrupted => {}
                _ => return Err(e),
            }
        }
    }
}

/// Sends `size` bytes of `file` as chunks of transfer `id` on `to` (its frame keys come back with the
/// result, moved past the frames sent and read), never more than the reader's credit ahead (starting with `credit`, then as it grants more). Blocking:
/// run it on the blocking pool. `Err`: the connection failed (or broke the protocol) and must be closed.
///
/// With `copy`, `file` is a copy still being made from the store: each chunk is sent once the copy has
/// written it, after a [`Frame::Vouch`] with the chaining value the copy recorded for it, so the reader
/// checks and uses it at once; while a chunk is not there yet the reader is sent a [`Frame::Ping`] every
/// `still`, as a whole-file fetch is. `Ok(Err(why))`: the copy stopped short, or did not end as a copy of
/// one version of the file (nothing more was sent; the caller refuses the transfer).
pub fn send_chunks(
    mut to: Polled,
    file: &File,
    size: u64,
    id: u32,
    credit: u32,
    copy: Option<(&Growing, Duration)>,
) -> io::Result<(Result<(), String>, Seals)> {
    let sent = send_all_chunks(&mut to, file, size, id, credit, copy)?;
    Ok((sent, to.seals))
}

fn send_all_chunks(
    s: &mut Polled,
    file: &File,
    size: u64,
    id: u32,
    credit: u32,
    copy: Option<(&Growing, Duration)>,
) -> io::Result<Result<(), String>> {
    let mut credit = credit;
    let mut offset = 0u64;
    let mut nonce = 0u64;
    let mut ping = |s: &mut Polled| {
        nonce += 1;
        s.send_frame(&Frame::Ping { nonce })
    };
    while offset < size {
        if let Some((copy, still)) = copy {
            let k = (offset / CHUNK as u64) as usize;
            let cv = loop {
                match copy.piece(k, still) {
                    Piece::Ready(cv) => break cv,
                    Piece::Pending => ping(s)?,
                    Piece::Failed(why) => return Ok(Err(stopped(why))),
                }
            };
            s.send_frame_more(&Frame::Vouch { id, offset, cv })?;
        }
        while credit == 0 {
            match s.read_frame()? {
                Some(Frame::Credit { id: i, more }) if i == id => credit = credit.saturating_add(more),
                other => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("expected credit for transfer {id}, got {other:?}"),
                    ))
                }
            }
        }
        let n = CHUNK.min((size - offset) as usize);
        let head = s.seals.send.chunk_head(id, offset, n);
        s.send_more(&head)?;
        s.send_file(file, offset, n)?;
        offset += n as u64;
        credit -= 1;
    }
    if let Some((copy, still)) = copy {
        // Every piece is sent; the copy still has to end as a copy of the one version it started from.
        loop {
            match copy.ended(still) {
                Some(CopyState::Finished) => break,
                Some(_) => return Ok(Err(stopped(None))),
                None => ping(s)?,
            }
        }
    }
    Ok(Ok(()))
}

/// Why a copy being sent stopped short, for the reader.
fn stopped(why: Option<io::Error>) -> String {
    match why {
        Some(e) => format!("the owner's copy from the store failed: {e}"),
        None => "the owner's copy from the store stopped short (the file changed, or its tier failed)".into(),
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::unix::net::UnixStream;
    use std::sync::Arc;

    use tierstore_core::cluster::wire;
    use tierstore_core::hash::Pieces;

    use super::*;

    /// The keys of a TCP connection, as the agent holds them, and the reader's.
    fn keys() -> (Seals, Seals) {
        (Seals::keyed([1; 32], [2; 32]), Seals::keyed([2; 32], [1; 32]))
    }

    /// The chunks a reader gets from `send_chunks` over a Unix socket pair, granting one credit per chunk.
    fn receive(file: File, size: u64, credit: u32) -> Vec<u8> {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let (agent, mut reader) = keys();
        let sender = std::thread::spawn(move || {
            let socket = OwnedFd::from(ours);
            let to = Polled::new(socket, agent, Duration::from_secs(5));
            send_chunks(to, &file, size, 3, credit, None).unwrap().0.unwrap();
        });
        let mut got = Vec::new();
        while (got.len() as u64) < size {
            match reader.recv.read_head(&mut theirs).unwrap().unwrap() {
                wire::Head::Chunk { id: 3, offset, len } => {
                    assert_eq!(offset, got.len() as u64);
                    let mut b = vec![0u8; len];
                    theirs.read_exact(&mut b).unwrap();
                    got.extend_from_slice(&b);
                    if (got.len() as u64) < size {
                        reader.send.write_frame(&mut theirs, &Frame::Credit { id: 3, more: 1 }).unwrap();
                    }
                }
                other => panic!("{other:?}"),
            }
        }
        sender.join().unwrap();
        got
    }

    #[test]
    fn a_file_goes_out_in_chunks_under_credit() {
        let mut f = tempfile::tempfile().unwrap();
        let data: Vec<u8> = (0..3 * CHUNK + 77).map(|i| (i % 253) as u8).collect();
        f.write_all(&data).unwrap();
        assert_eq!(receive(f, data.len() as u64, 1), data);
    }

    /// A copy made by a thread, slowly (the store), recording each piece's chaining value as it goes;
    /// `fail_after` pieces, it stops short.
    fn slow_copy(data: Vec<u8>, fail_after: Option<usize>) -> (Arc<Growing>, File, std::thread::JoinHandle<()>) {
        let (mut out, follower) = {
            let f = tempfile::tempfile().unwrap();
            let g = f.try_clone().unwrap();
            (f, g)
        };
        let version = tierstore_core::index::SourceId {
            size: data.len() as u64,
            mtime_ns: 1,
            ctime_ns: 1,
            ino: 1,
            dev: 1,
            attrs: None,
        };
        let growing = Arc::new(Growing::new(follower.try_clone().unwrap(), version));
        let g = growing.clone();
        let h = std::thread::spawn(move || {
            let mut pieces = Pieces::reporting(data.len() as u64, |cv| g.record_piece(cv));
            for (k, c) in data.chunks(CHUNK).enumerate() {
                std::thread::sleep(Duration::from_millis(150));
                if fail_after == Some(k) {
                    drop(pieces);
                    g.fail();
                    return;
                }
                out.write_all(c).unwrap();
                pieces.update(c);
                g.advance(((k * CHUNK) + c.len()) as u64);
            }
            drop(pieces);
            g.finish(None);
        });
        (growing, follower, h)
    }

    #[test]
    fn a_copy_still_being_made_goes_out_piece_by_piece_each_vouched_for() {
        let data: Vec<u8> = (0..2 * CHUNK + 99).map(|i| (i % 241) as u8).collect();
        let (growing, file, writer) = slow_copy(data.clone(), None);
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let size = data.len() as u64;
        let (agent, mut reader) = keys();
        let sender = std::thread::spawn(move || {
            let copy = Some((&*growing, Duration::from_millis(40)));
            let to = Polled::new(OwnedFd::from(ours), agent, Duration::from_secs(5));
            send_chunks(to, &file, size, 3, 8, copy).unwrap().0
        });
        let (mut got, mut pings, mut vouched) = (Vec::new(), 0, None);
        while (got.len() as u64) < size {
            match reader.recv.read_head(&mut theirs).unwrap().unwrap() {
                wire::Head::Frame(Frame::Ping { .. }) => pings += 1,
                wire::Head::Frame(Frame::Vouch { id: 3, offset, cv }) => vouched = Some((offset, cv)),
                wire::Head::Chunk { id: 3, offset, len } => {
                    let mut b = vec![0u8; len];
                    theirs.read_exact(&mut b).unwrap();
                    assert_eq!(vouched.take(), Some((offset, tierstore_core::hash::subtree(offset, &b))));
                    got.extend_from_slice(&b);
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(sender.join().unwrap(), Ok(()));
        writer.join().unwrap();
        assert_eq!(got, data);
        assert!(pings >= 1, "the reader heard nothing while the first piece was on its way");
    }

    #[test]
    fn a_copy_that_stops_short_ends_the_transfer_with_why() {
        let data = vec![7u8; 3 * CHUNK];
        let (growing, file, writer) = slow_copy(data, Some(1));
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let sender = std::thread::spawn(move || {
            let copy = Some((&*growing, Duration::from_millis(40)));
            let to = Polled::new(OwnedFd::from(ours), Seals::default(), Duration::from_secs(5));
            send_chunks(to, &file, 3 * CHUNK as u64, 3, 8, copy).unwrap().0
        });
        // Drain what was sent (one piece) until the sender gives up.
        let reader = std::thread::spawn(move || {
            let mut sink = Vec::new();
            let _ = theirs.read_to_end(&mut sink);
        });
        let why = sender.join().unwrap().unwrap_err();
        assert!(why.contains("stopped short"), "{why}");
        writer.join().unwrap();
        reader.join().unwrap();
    }

    #[test]
    fn a_file_that_shrank_is_sent_padded_so_the_frames_stay_whole() {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&[5u8; 1000]).unwrap();
        let got = receive(f, 3000, 2);
        assert_eq!(&got[..1000], &[5u8; 1000][..]);
        assert!(got[1000..].iter().all(|b| *b == 0));
    }
}
