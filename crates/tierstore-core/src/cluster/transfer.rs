//! Receiving a file from a peer's agent: the side of a peer read that takes the bytes in. A [`Transfer`]
//! starts once the owner said which version it sends ([`super::remote::Remote`] connected, shook hands and
//! asked); then chunks come under receiver-driven credit, each received straight into where it goes
//! ([`Dest`]: a buffer, a file, or a file that readers follow as it grows) and checked there (`Check`):
//! against the chaining value the owner vouched for it when the owner's copy is still being made, else all
//! of them against the blake3 the owner sends at the end. No byte is usable before it is checked; a
//! mismatch is reported to the owner, which checks its copy and removes it if it is damaged.

use std::io;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::seal::{Seal, Seals};
use super::wire::{self, ErrorCode, Frame};
use crate::index::SourceId;

/// Why a file could not be had from a peer. Every one of them sends the reader to the source.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// Nothing answers at the member's address.
    #[error("the agent of {at} cannot be reached ({source})")]
    Unreachable {
        /// The member.
        at: String,
        /// Why.
        source: io::Error,
    },
    /// The member did not answer within the deadline.
    #[error("the agent of {at} did not answer within {waited:?}")]
    Deadline {
        /// The member.
        at: String,
        /// The deadline.
        waited: Duration,
    },
    /// The member refused or could not serve the request.
    #[error("the agent of {at} refused: {message}")]
    Refused {
        /// The member.
        at: String,
        /// Its error code.
        code: ErrorCode,
        /// Its message.
        message: String,
    },
    /// The bytes received are not the bytes the owner vouched for.
    #[error("the agent of {at} sent damaged bytes: {detail}")]
    Corrupt {
        /// The member.
        at: String,
        /// What did not match.
        detail: String,
    },
    /// The connection broke or carried something out of order.
    #[error("the connection to the agent of {at} failed: {detail}")]
    Broken {
        /// The member.
        at: String,
        /// What happened.
        detail: String,
    },
    /// Writing the received bytes failed on this node.
    #[error("cannot keep the bytes received: {0}")]
    Sink(io::Error),
}

impl RemoteError {
    /// Whether the member itself failed (rather than the file or this node): it is then marked down.
    pub fn member_failed(&self) -> bool {
        matches!(
            self,
            RemoteError::Unreachable { .. }
                | RemoteError::Deadline { .. }
                | RemoteError::Broken { .. }
                | RemoteError::Refused { code: ErrorCode::ShuttingDown, .. }
        )
    }
}

/// Receives exactly `len` bytes from `stream` into `to`, with as few calls as the kernel allows
/// (`MSG_WAITALL`: one call per chunk, where a plain `read` returns at each packet). A timeout with
/// nothing received is `WouldBlock`, as for a read.
///
/// # Safety
/// `to` must be valid for writes of `len` bytes.
unsafe fn recv_exact(stream: &TcpStream, to: *mut u8, len: usize) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    recv_all(stream.as_raw_fd(), to, len)
}

/// Receives exactly `len` bytes from `fd` into `to`.
///
/// # Safety
/// `to` must be valid for writes of `len` bytes.
unsafe fn recv_all(fd: std::os::fd::RawFd, to: *mut u8, len: usize) -> io::Result<()> {
    let mut done = 0;
    while done < len {
        // SAFETY: the caller vouches for `to..to + len`; `done < len`.
        let n = unsafe { libc::recv(fd, to.add(done) as *mut libc::c_void, len - done, libc::MSG_WAITALL) };
        match n {
            0 => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed inside a chunk")),
            n if n > 0 => done += n as usize,
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

/// Where the data of the chunk whose head was just read come from: the stream, or, on an encrypted
/// connection, the frame its seal decrypted.
struct Incoming<'a> {
    stream: &'a TcpStream,
    seal: &'a mut Seal,
}

impl Incoming<'_> {
    /// Takes the chunk's `len` bytes into `to`.
    ///
    /// # Safety
    /// `to` must be valid for writes of `len` bytes.
    unsafe fn take(&mut self, to: *mut u8, len: usize) -> io::Result<()> {
        match self.seal.take_decrypted() {
            Some(d) if d.len() == len => {
                // SAFETY: the caller vouches for `to..to + len`; `d` holds `len` bytes.
                unsafe { std::ptr::copy_nonoverlapping(d.as_ptr(), to, len) };
                Ok(())
            }
            Some(d) => {
                Err(wire::invalid(wire::FrameError::Truncated { field: if d.len() < len { "data" } else { "chunk" } }))
            }
            // SAFETY: as above.
            None => unsafe { recv_exact(self.stream, to, len) },
        }
    }
}

/// Why a chunk could not be taken: the connection, or where its bytes go.
enum Received {
    Wire(io::Error),
    Sink(io::Error),
    /// The chunk does not match the chaining value the owner vouched for it.
    Damaged(String),
}

/// How the bytes of a transfer are checked: each chunk against the chaining value the owner vouched for
/// it ([`Frame::Vouch`], for a copy the owner is still making), or all of them against the blake3 at the
/// end. Either way each byte is hashed once, and the values vouched for must merge into that blake3.
struct Check {
    size: u64,
    whole: crate::hash::Hasher,
    /// The value vouched for the next chunk, and that chunk's offset.
    next: Option<(u64, crate::hash::ChainingValue)>,
    pieces: Vec<crate::hash::ChainingValue>,
    unvouched: bool,
}

impl Check {
    fn new(size: u64) -> Check {
        Check { size, whole: crate::hash::Hasher::new(), next: None, pieces: Vec::new(), unvouched: false }
    }

    /// Takes a vouch for the chunk at `offset`. Only a file of more than one piece is vouched for piece
    /// by piece (a single piece is the root of its own tree).
    fn vouch(&mut self, offset: u64, cv: crate::hash::ChainingValue) -> Result<(), String> {
        use crate::hash::PIECE;
        let aligned = offset == self.pieces.len() as u64 * PIECE as u64;
        if self.size <= PIECE as u64 || !aligned || self.unvouched || self.next.is_some() {
            return Err(format!("a vouch for a chunk at {offset} out of turn"));
        }
        self.next = Some((offset, cv));
        Ok(())
    }

    /// Checks the chunk at `offset`: `Ok(true)` when it matched its vouch and may be used now,
    /// `Ok(false)` when it is checked only at the end.
    fn chunk(&mut self, offset: u64, bytes: &[u8]) -> Result<bool, String> {
        match self.next.take() {
            Some((at, cv)) if at == offset && bytes.len() == crate::hash::PIECE.min((self.size - offset) as usize) => {
                if crate::hash::subtree(offset, bytes) != cv {
                    return Err(format!("the chunk at {offset} does not match the value vouched for it"));
                }
                self.pieces.push(cv);
                Ok(true)
            }
            Some((at, _)) => Err(format!("a chunk of {} bytes at {offset} after a vouch for one at {at}", bytes.len())),
            None if !self.pieces.is_empty() => Err(format!("the chunk at {offset} came without its vouch")),
            None => {
                self.unvouched = true;
                self.whole.update(bytes);
                Ok(false)
            }
        }
    }

    /// Whether every byte hashes to `hash`.
    fn matches(&self, hash: &[u8; 32]) -> bool {
        if self.pieces.is_empty() {
            return *self.whole.finalize().as_bytes() == *hash;
        }
        crate::hash::root_of_pieces(&self.pieces, self.size, crate::hash::PIECE) == *hash
    }
}

/// What comes next in a transfer.
enum Next {
    /// A chunk's header: its `len` bytes follow in the stream.
    Chunk { offset: u64, len: usize },
    /// The chaining value of the chunk at `offset`, which comes next.
    Vouch { offset: u64, cv: crate::hash::ChainingValue },
    /// The end, and the owner's blake3 of what it sent.
    Done([u8; 32]),
}

/// A file on its way from a peer: its version is known, its bytes follow.
pub struct Transfer {
    stream: TcpStream,
    /// The connection's frame keys: every frame but a chunk's data is checked against them.
    seals: Seals,
    at: String,
    /// The version the owner sends.
    pub found: SourceId,
    deadline: Duration,
    /// How long the owner may keep saying (with pings) that the next chunk is not there yet.
    fetch_wait: Duration,
    /// What to tell the owner when its bytes do not hash to the blake3 it sent (a `Fetch`'s report; none
    /// for a staged file, whose owner still hashes what it sends).
    report: Option<Frame>,
}

/// Where the bytes of a [`Transfer`] go.
pub enum Dest<'a> {
    /// A buffer the file's bytes are appended to (it should be empty, with room for the file): each chunk
    /// is received straight into its place, never zeroed first.
    Bytes(&'a mut Vec<u8>),
    /// A file, written at each chunk's offset (through one buffer of a chunk, reused).
    File(&'a std::fs::File),
    /// A file that readers follow as it grows: the callback is told how many bytes from the start are
    /// written and checked, chunk by chunk when the owner vouches for each (a copy it is still making),
    /// up to the last chunk; the caller makes the end usable once the transfer returned `Ok`.
    Growing(&'a std::fs::File, &'a mut dyn FnMut(u64)),
}

impl Transfer {
    /// A transfer on `stream`, whose owner at `at` said it sends the version `found`.
    pub(super) fn new(
        stream: TcpStream,
        seals: Seals,
        at: String,
        found: SourceId,
        deadline: Duration,
        fetch_wait: Duration,
    ) -> Transfer {
        Transfer { stream, seals, at, found, deadline, fetch_wait, report: None }
    }

    /// Says what to tell the owner when its bytes do not hash to the blake3 it sent.
    pub(super) fn report_to(&mut self, report: Frame) {
        self.report = Some(report);
    }

    /// Takes every chunk in order into `sink(offset, bytes)`, granting credit as they come, and checks
    /// the size and the owner's blake3. Returns the blake3 of the file.
    pub fn receive(self, mut sink: impl FnMut(u64, &[u8]) -> io::Result<()>) -> Result<[u8; 32], RemoteError> {
        let mut buf = Vec::new();
        self.receive_with(|offset, len, incoming, check| {
            buf.resize(len, 0);
            // SAFETY: `buf` is valid for `len` bytes.
            unsafe { incoming.take(buf.as_mut_ptr(), len) }.map_err(Received::Wire)?;
            check.chunk(offset, &buf).map_err(Received::Damaged)?;
            sink(offset, &buf).map_err(Received::Sink)
        })
    }

    /// Takes every chunk in order into `dest`, as [`Transfer::receive`] does, with no buffer in between
    /// for a [`Dest::Bytes`]: each chunk goes from the socket into its place, and is hashed there. The
    /// caller uses no byte of `dest` unless this returns `Ok`.
    pub fn receive_into(self, dest: Dest<'_>) -> Result<[u8; 32], RemoteError> {
        match dest {
            Dest::Bytes(bytes) => {
                let start = bytes.len();
                self.receive_with(|offset, len, incoming, check| {
                    bytes.reserve(len);
                    let at = bytes.len();
                    // SAFETY: `reserve` made room for `len` bytes past the end; `take` writes them all or
                    // fails, and the length grows only over bytes it wrote.
                    unsafe {
                        incoming.take(bytes.as_mut_ptr().add(at), len).map_err(Received::Wire)?;
                        bytes.set_len(at + len);
                    }
                    check.chunk(offset, &bytes[at..]).map_err(Received::Damaged)?;
                    Ok(())
                })
                .inspect_err(|_| bytes.truncate(start))
            }
            Dest::File(file) => self.receive_into_file(file, |_| {}),
            Dest::Growing(file, progress) => self.receive_into_file(file, progress),
        }
    }

    /// Takes every chunk into `file` at its offset; `usable(end)` is called once the first `end` bytes
    /// are written and checked (chunk by chunk when the owner vouches for each), up to the last chunk: the
    /// file's end is the caller's to announce once the whole file's hash matched.
    fn receive_into_file(self, file: &std::fs::File, mut usable: impl FnMut(u64)) -> Result<[u8; 32], RemoteError> {
        use std::os::unix::fs::FileExt;
        let size = self.found.size;
        let mut buf = vec![0u8; wire::CHUNK];
        self.receive_with(|offset, len, incoming, check| {
            let b = &mut buf[..len];
            // SAFETY: `b` is valid for `len` bytes.
            unsafe { incoming.take(b.as_mut_ptr(), len) }.map_err(Received::Wire)?;
            let checked = check.chunk(offset, b).map_err(Received::Damaged)?;
            file.write_all_at(b, offset).map_err(Received::Sink)?;
            if checked && offset + (len as u64) < size {
                usable(offset + len as u64);
            }
            Ok(())
        })
    }

    /// The loop of a transfer: `take(offset, len, incoming, check)` takes the next chunk's `len` bytes
    /// to where they go, and checks them (or adds them to the whole file's hash).
    fn receive_with(
        mut self,
        mut take: impl FnMut(u64, usize, &mut Incoming<'_>, &mut Check) -> Result<(), Received>,
    ) -> Result<[u8; 32], RemoteError> {
        let mut check = Check::new(self.found.size);
        let mut got = 0u64;
        let mut last_chunk = Instant::now();
        loop {
            match self.next(last_chunk)? {
                Next::Chunk { offset, len } => {
                    if offset != got || got + len as u64 > self.found.size {
                        return Err(self.corrupt(format!("a chunk of {len} bytes at {offset}, expected one at {got}")));
                    }
                    let mut incoming = Incoming { stream: &self.stream, seal: &mut self.seals.recv };
                    match take(offset, len, &mut incoming, &mut check) {
                        Ok(()) => {}
                        Err(Received::Wire(e)) => return Err(self.broken(e)),
                        Err(Received::Sink(e)) => return Err(RemoteError::Sink(e)),
                        Err(Received::Damaged(why)) => {
                            let detail = format!("{why}; {}", self.report_damage());
                            return Err(self.corrupt(detail));
                        }
                    }
                    got += len as u64;
                    last_chunk = Instant::now();
                    if got < self.found.size {
                        self.grant()?;
                    }
                }
                Next::Done(hash) => {
                    if got != self.found.size {
                        return Err(self.corrupt(format!("{got} bytes of {} before the end", self.found.size)));
                    }
                    if !check.matches(&hash) {
                        let detail = self.report_damage();
                        return Err(self.corrupt(detail));
                    }
                    return Ok(hash);
                }
                Next::Vouch { offset, cv } => {
                    check.vouch(offset, cv).map_err(|detail| RemoteError::Broken { at: self.at.clone(), detail })?;
                }
            }
        }
    }

    /// Takes the parts a [`Remote::open_ranges`](super::remote::Remote::open_ranges) asked for into `dests`: one buffer per range, in the
    /// order asked and of its length, each chunk received straight into its place. With `hash`, the bytes
    /// are checked against the owner's blake3 of them (a mismatch is reported to it); without, the
    /// caller checks every byte itself (a model's tensors, against their hashes: no byte is hashed twice)
    /// and reports a mismatch with [`Transfer::damaged`]. No byte of `dests` is to be used on `Err`.
    pub fn receive_ranges(&mut self, dests: &mut [(u64, &mut [u8])], hash: bool) -> Result<(), RemoteError> {
        let mut hasher = hash.then(crate::hash::Hasher::new);
        let mut left: u64 = dests.iter().map(|(_, d)| d.len() as u64).sum();
        let (mut part, mut filled) = (0usize, 0usize);
        let mut last_chunk = Instant::now();
        loop {
            while part < dests.len() && filled == dests[part].1.len() {
                (part, filled) = (part + 1, 0);
            }
            match self.next(last_chunk)? {
                Next::Chunk { offset, len } => {
                    let Some((start, dest)) = dests.get_mut(part) else {
                        return Err(self.corrupt(format!("a chunk of {len} bytes at {offset} after the last part")));
                    };
                    let expected = *start + filled as u64;
                    if offset != expected || len > dest.len() - filled {
                        return Err(
                            self.corrupt(format!("a chunk of {len} bytes at {offset}, expected one at {expected}"))
                        );
                    }
                    let to = &mut dest[filled..filled + len];
                    // SAFETY: `to` is valid for `len` bytes.
                    let mut incoming = Incoming { stream: &self.stream, seal: &mut self.seals.recv };
                    unsafe { incoming.take(to.as_mut_ptr(), len) }.map_err(|e| self.broken(e))?;
                    if let Some(h) = hasher.as_mut() {
                        h.update(to);
                    }
                    filled += len;
                    left -= len as u64;
                    last_chunk = Instant::now();
                    if left > 0 {
                        self.grant()?;
                    }
                }
                Next::Done(sent) => {
                    if left > 0 {
                        return Err(self.corrupt(format!("the owner ended with {left} bytes of the parts unsent")));
                    }
                    if hasher.is_some_and(|h| *h.finalize().as_bytes() != sent) {
                        let detail = self.report_damage();
                        return Err(self.corrupt(detail));
                    }
                    return Ok(());
                }
                Next::Vouch { offset, .. } => {
                    return Err(RemoteError::Broken {
                        at: self.at.clone(),
                        detail: format!("a vouch for a chunk at {offset} in a transfer of parts"),
                    })
                }
            }
        }
    }

    /// Tells the owner that the parts it sent failed the caller's own check, so that it drops what it
    /// sent them from; returns what to say of it.
    pub fn damaged(&mut self) -> String {
        self.report_damage()
    }

    /// The next chunk header, vouch or end of the transfer, read past the pings of an owner still
    /// fetching from the store (for at most `fetch_wait` after `last_chunk`).
    fn next(&mut self, last_chunk: Instant) -> Result<Next, RemoteError> {
        loop {
            let head = match self.seals.recv.read_head(&mut self.stream) {
                Ok(Some(h)) => h,
                Ok(None) => {
                    let detail = "closed before the end of the transfer".to_string();
                    return Err(RemoteError::Broken { at: self.at.clone(), detail });
                }
                Err(e) => return Err(self.broken(e)),
            };
            let at = self.at.clone();
            match head {
                wire::Head::Chunk { id: 1, offset, len } => return Ok(Next::Chunk { offset, len }),
                wire::Head::Frame(Frame::Done { id: 1, hash }) => return Ok(Next::Done(hash)),
                wire::Head::Frame(Frame::Vouch { id: 1, offset, cv }) => return Ok(Next::Vouch { offset, cv }),
                // The owner's copy from the store has not reached the next chunk yet.
                wire::Head::Frame(Frame::Ping { .. }) if last_chunk.elapsed() < self.fetch_wait => {}
                wire::Head::Frame(Frame::Ping { .. }) => {
                    return Err(RemoteError::Deadline { at, waited: self.fetch_wait })
                }
                wire::Head::Frame(Frame::Error { code, message }) => {
                    return Err(RemoteError::Refused { at, code, message })
                }
                other => return Err(RemoteError::Broken { at, detail: format!("unexpected {other:?}") }),
            }
        }
    }

    /// Lets the owner send one more chunk.
    fn grant(&mut self) -> Result<(), RemoteError> {
        self.seals.send.write_frame(&mut self.stream, &Frame::Credit { id: 1, more: 1 }).map_err(|e| self.broken(e))
    }

    /// A failed read or write of the connection, as the error it is.
    fn broken(&self, e: io::Error) -> RemoteError {
        if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
            RemoteError::Deadline { at: self.at.clone(), waited: self.deadline }
        } else {
            RemoteError::Broken { at: self.at.clone(), detail: e.to_string() }
        }
    }

    fn corrupt(&self, detail: String) -> RemoteError {
        RemoteError::Corrupt { at: self.at.clone(), detail }
    }

    /// Tells the owner that its bytes did not hash to the blake3 it sent, and waits (within the deadline)
    /// for it to check its copy: a damaged one is removed before the reader goes to the source, so the
    /// next reader is not sent the same damage. Returns what to say of the mismatch.
    fn report_damage(&mut self) -> String {
        let Some(report) = self.report.take() else { return "blake3 mismatch".into() };
        let (stream, seals) = (&mut self.stream, &mut self.seals);
        let answer = seals.send.write_frame(stream, &report).and_then(|()| seals.recv.read_frame(stream));
        match answer {
            Ok(Some(Frame::Checked { removed: true, .. })) => {
                "blake3 mismatch; the owner removed its damaged copy".into()
            }
            Ok(Some(Frame::Checked { removed: false, .. })) => {
                "blake3 mismatch; the owner's copy matches its record (damaged on the way?)".into()
            }
            Ok(other) => format!("blake3 mismatch; the owner answered the report with {other:?}"),
            Err(e) => format!("blake3 mismatch; the owner did not answer the report ({e})"),
        }
    }

    /// Waits for the owner to confirm it cached the file (a transfer opened with no credit).
    pub fn confirmed(mut self) -> Result<(), RemoteError> {
        match self.seals.recv.read_frame(&mut self.stream) {
            Ok(Some(Frame::Done { .. })) => Ok(()),
            Ok(Some(Frame::Error { code, message })) => Err(RemoteError::Refused { at: self.at, code, message }),
            Ok(other) => Err(RemoteError::Broken { at: self.at, detail: format!("unexpected {other:?}") }),
            Err(e) => Err(RemoteError::Broken { at: self.at, detail: e.to_string() }),
        }
    }
}
