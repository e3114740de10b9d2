//! Connecting within a deadline when the listener's queue may be full: to a peer's agent over TCP
//! ([`dial`]), and to this node's agent on its Unix socket ([`dial_local`]).
//!
//! When a listener's accept queue is full, Linux drops the SYN, and TCP sends it again only after its
//! initial retransmission timeout: a second, as long as a peer read's whole connect deadline
//! (`TIERSTORE_PEER_CONNECT_MS`). A node whose agent is flooded with connections, or that the processes
//! of every node dial at once as a job starts, drops some SYNs; a reader that waited on its first one
//! would miss the deadline, fall back to the store and leave the member out for a while
//! ([`super::remote::DOWN_FOR`]). So [`dial`] sends a fresh SYN from a new socket after
//! [`FIRST_REDIAL`], then after twice as long each time, keeps the earlier ones waiting (the first may
//! just be slow), and takes whichever connects first. On a network that answers, the first SYN connects
//! within a round trip and no second socket is ever made.
//!
//! A Unix socket whose queue is full makes a blocking connect wait for room with no end, and a
//! non-blocking one fail at once with `EAGAIN`, as if nobody listened there; [`dial_local`] waits for room
//! until its deadline.

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, SockAddr, Socket, Type};

/// How long the first SYN is waited for before a second is sent: a hundred round trips of a cluster's
/// network, a tenth of the kernel's own retransmission.
pub const FIRST_REDIAL: Duration = Duration::from_millis(100);

/// Sockets dialing at once, at most: with the waits doubling, the eighth is sent 12.7 s in, and from then
/// on the eight are waited for until the deadline.
const MOST_PENDING: usize = 8;

/// Connects to `addr` within `deadline`, sending a new SYN after [`FIRST_REDIAL`], then after twice as
/// long each time, until one connects. The stream returned is blocking. A refused connection (nothing
/// listens there) is an error at once; past the deadline, [`io::ErrorKind::TimedOut`].
pub fn dial(addr: &SocketAddr, deadline: Duration) -> io::Result<TcpStream> {
    let start = Instant::now();
    let end = start + deadline;
    let mut pending: Vec<Socket> = Vec::new();
    let mut next_dial = start;
    let mut gap = FIRST_REDIAL;
    loop {
        let now = Instant::now();
        if now >= end {
            return Err(io::Error::new(io::ErrorKind::TimedOut, format!("no answer within {deadline:?}")));
        }
        if now >= next_dial && pending.len() < MOST_PENDING {
            match start_connecting(addr)? {
                Started::Connected(s) => return connected(s),
                Started::Pending(s) => pending.push(s),
            }
            next_dial = now + gap;
            gap *= 2;
        }
        let until = if pending.len() < MOST_PENDING { next_dial.min(end) } else { end };
        if let Some(at) = finished(&pending, until.saturating_duration_since(now))? {
            let s = pending.swap_remove(at);
            return match s.take_error()? {
                None => connected(s),
                Some(e) => Err(e),
            };
        }
    }
}

/// Connects to the Unix socket at `path`, waiting at most `deadline` for room in its listener's queue
/// (Linux bounds a blocking connect's wait by the socket's send timeout). A queue still full at the
/// deadline is [`io::ErrorKind::TimedOut`]; nobody listening is `ECONNREFUSED` (or `ENOENT`) at once.
pub fn dial_local(path: &Path, deadline: Duration) -> io::Result<UnixStream> {
    let s = Socket::new(Domain::UNIX, Type::STREAM, None)?;
    s.set_write_timeout(Some(deadline.max(Duration::from_millis(1))))?;
    match s.connect(&SockAddr::unix(path)?) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{} took no connection within {deadline:?}: its queue is full", path.display()),
            ))
        }
        Err(e) => return Err(e),
    }
    s.set_write_timeout(None)?;
    Ok(UnixStream::from(OwnedFd::from(s)))
}

enum Started {
    Connected(Socket),
    Pending(Socket),
}

/// A non-blocking socket (close-on-exec, as socket2 makes them) that has sent its SYN to `addr`.
fn start_connecting(addr: &SocketAddr) -> io::Result<Started> {
    let s = Socket::new(Domain::for_address(*addr), Type::STREAM, Some(Protocol::TCP))?;
    s.set_nonblocking(true)?;
    match s.connect(&SockAddr::from(*addr)) {
        Ok(()) => Ok(Started::Connected(s)),
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => Ok(Started::Pending(s)),
        Err(e) => Err(e),
    }
}

fn connected(s: Socket) -> io::Result<TcpStream> {
    s.set_nonblocking(false)?;
    Ok(s.into())
}

/// The position in `sockets` of one whose connect has finished (connected or failed), waiting at most
/// `wait` for one; `None` when none has.
fn finished(sockets: &[Socket], wait: Duration) -> io::Result<Option<usize>> {
    let mut fds: Vec<libc::pollfd> =
        sockets.iter().map(|s| libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLOUT, revents: 0 }).collect();
    // Rounded up, so that a wait under a millisecond does not spin.
    let ms = wait.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
    // SAFETY: `fds` is a live array of `fds.len()` pollfd structures for the duration of the call.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted { Ok(None) } else { Err(e) };
    }
    Ok(fds.iter().position(|p| p.revents != 0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A listener whose accept queue holds one connection (backlog 0) and holds it already: the kernel
    /// drops every SYN that arrives until the queue is drained.
    fn full_listener() -> (TcpListener, TcpStream) {
        let s = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).unwrap();
        s.bind(&SockAddr::from(SocketAddr::from(([127, 0, 0, 1], 0)))).unwrap();
        s.listen(0).unwrap();
        let l: TcpListener = s.into();
        let filler = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (l, filler)
    }

    /// Drains a full queue `delay` from now: the connection that filled it, then the one dialed.
    fn accept_two_after<T: Send + 'static>(
        delay: Duration,
        accept: impl Fn() -> T + Send + 'static,
    ) -> std::thread::JoinHandle<Vec<T>> {
        std::thread::spawn(move || {
            std::thread::sleep(delay);
            (0..2).map(|_| accept()).collect()
        })
    }

    #[test]
    fn a_syn_dropped_by_a_full_queue_is_sent_again_well_before_the_kernel_would() {
        let (l, _filler) = full_listener();
        let addr = l.local_addr().unwrap();
        // The queue is drained 150 ms after the dial starts; TCP alone would send the dropped SYN again
        // at 1 s. (Redials go at 100, 300 and 700 ms: a drain late by half a second on a busy machine is
        // still caught before the kernel's own retry.)
        let drain = accept_two_after(Duration::from_millis(150), move || l.accept().unwrap().0);
        let asked = Instant::now();
        let s = dial(&addr, Duration::from_secs(3)).expect("connected after the queue was drained");
        let took = asked.elapsed();
        assert_eq!(s.peer_addr().unwrap(), addr);
        assert!(took >= Duration::from_millis(150) && took < Duration::from_millis(950), "{took:?}");
        let accepted = drain.join().unwrap();
        assert!(accepted.iter().any(|a| a.peer_addr().unwrap() == s.local_addr().unwrap()));
    }

    #[test]
    fn a_queue_never_drained_is_a_timeout_at_the_deadline() {
        let (l, _filler) = full_listener();
        let asked = Instant::now();
        let e = dial(&l.local_addr().unwrap(), Duration::from_millis(300)).unwrap_err();
        let took = asked.elapsed();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(took >= Duration::from_millis(300) && took < Duration::from_millis(900), "{took:?}");
    }

    #[test]
    fn a_port_nobody_listens_on_is_refused_at_once() {
        let addr = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let asked = Instant::now();
        let e = dial(&addr, Duration::from_secs(5)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");
        assert!(asked.elapsed() < Duration::from_secs(1));
    }

    /// A Unix listener whose queue holds one connection and holds it already.
    fn full_local_listener(dir: &Path) -> (std::os::unix::net::UnixListener, UnixStream, std::path::PathBuf) {
        let path = dir.join("agent.sock");
        let s = Socket::new(Domain::UNIX, Type::STREAM, None).unwrap();
        s.bind(&SockAddr::unix(&path).unwrap()).unwrap();
        s.listen(0).unwrap();
        let filler = UnixStream::connect(&path).unwrap();
        (std::os::unix::net::UnixListener::from(OwnedFd::from(s)), filler, path)
    }

    #[test]
    fn a_full_local_queue_is_waited_for_until_it_has_room() {
        let dir = tempfile::tempdir().unwrap();
        let (l, _filler, path) = full_local_listener(dir.path());
        let drain = accept_two_after(Duration::from_millis(100), move || l.accept().unwrap().0);
        let asked = Instant::now();
        let s = dial_local(&path, Duration::from_secs(5)).expect("connected once the queue had room");
        assert!(asked.elapsed() >= Duration::from_millis(100), "{:?}", asked.elapsed());
        assert_eq!(s.write_timeout().unwrap(), None, "the wait's timeout is left on the stream");
        drain.join().unwrap();
    }

    #[test]
    fn a_local_queue_never_drained_is_a_timeout_at_the_deadline_and_nobody_listening_an_error_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let (_l, _filler, path) = full_local_listener(dir.path());
        let asked = Instant::now();
        let e = dial_local(&path, Duration::from_millis(300)).unwrap_err();
        let took = asked.elapsed();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(2), "{took:?}");
        let e = dial_local(&dir.path().join("nobody.sock"), Duration::from_secs(5)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "{e}");
    }

    #[test]
    fn an_answering_listener_takes_one_socket() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let s = dial(&l.local_addr().unwrap(), Duration::from_secs(1)).unwrap();
        let (a, _) = l.accept().unwrap();
        assert_eq!(a.peer_addr().unwrap(), s.local_addr().unwrap());
        l.set_nonblocking(true).unwrap();
        assert_eq!(l.accept().unwrap_err().kind(), io::ErrorKind::WouldBlock, "a second connection was made");
    }
}
