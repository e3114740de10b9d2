//! The request loop of a stream connection: a local client's `StreamRequest` frames (JSON, tagged by
//! `op`) are read by a task of their own while the notices of its subscription are pushed to it, each
//! request answered in turn; whatever the connection held (a publish, a subscription, its leases) ends
//! with it, however its task ends.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use tierstore_core::models::requests::Aborted;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, watch};

use super::consumers::Notice;
use super::{answer, Conn, StreamError, Streams, Subscribing};
use crate::protocol::{self, ErrorCode, Frame};
pub use tierstore_core::models::requests::Request;

/// Ends a connection's holdings however its task ends (a closed socket, an error, the agent stopping).
struct Holdings {
    streams: Arc<Streams>,
    conn: Conn,
}

impl Drop for Holdings {
    fn drop(&mut self) {
        self.streams.close(&mut self.conn);
    }
}

/// Runs blocking work that is quick (a commit: a few renames and a small write on /dev/shm, the files of
/// dropped versions being freed by the reaper) on this worker, which the runtime replaces meanwhile. The
/// blocking pool would cost a thread wake-up each way: on a VM, most of a commit's latency.
fn quick_blocking<R>(f: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    if Handle::try_current().is_ok_and(|h| h.runtime_flavor() == RuntimeFlavor::MultiThread) {
        tokio::task::block_in_place(f)
    } else {
        f()
    }
}

async fn next_notice(sub: &mut Option<(String, u64, mpsc::UnboundedReceiver<Notice>)>) -> Option<Notice> {
    match sub {
        Some((_, _, rx)) => rx.recv().await,
        None => std::future::pending().await,
    }
}

async fn send<S: AsyncWrite + Unpin>(stream: &mut S, json: String, deadline: Duration) -> bool {
    matches!(
        tokio::time::timeout(deadline, protocol::write_frame(stream, &Frame::StreamEvent { json })).await,
        Ok(Ok(()))
    )
}

/// What a stream connection does next.
enum Next {
    Frame(io::Result<Option<Frame>>),
    Notice(Option<Notice>),
    Stop,
}

/// What waiting on a connection came to.
enum Waited {
    /// A stream request to answer (its JSON).
    Request(String),
    /// Something handled on the way (a ping, a notice pushed): wait again.
    Handled,
    /// The connection ends: closed, refused, a subscriber too slow, or the agent stopping.
    End,
}

async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await.map(|_| ());
}

/// Serves a stream connection from its first stream request until it closes (or the agent stops). A
/// subscriber that does not take a notice within `deadline` is disconnected (its leases end).
pub async fn serve<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    first: String,
    streams: Arc<Streams>,
    mut stop: watch::Receiver<bool>,
    deadline: Duration,
) {
    let (rd, wr) = tokio::io::split(stream);
    let (tx, mut rx) = mpsc::unbounded_channel::<io::Result<Option<Frame>>>();
    let main = async {
        let holdings = Holdings { streams: streams.clone(), conn: Conn::default() };
        let mut session = Session { wr, h: holdings, streams, deadline };
        let mut next = Some(first);
        loop {
            let json = match next.take() {
                Some(json) => json,
                None => match session.wait(&mut rx, &mut stop).await {
                    Waited::Request(json) => json,
                    Waited::Handled => continue,
                    Waited::End => return,
                },
            };
            if !session.answer(&json).await {
                return;
            }
        }
    };
    tokio::select! {
        _ = main => {}
        _ = read_frames(rd, tx) => {}
    }
}

/// Reads the connection's frames into `tx`, in a loop of its own: a read cut short by a notice would lose
/// its bytes. It never stops reading (the queue is unbounded): a subscriber blocked sending releases while
/// the agent waits for it to take a notice would be a deadlock. Never returns; the connection's end is the
/// last item it queues (`Ok(None)` or the error).
async fn read_frames<R: AsyncRead + Unpin>(mut rd: R, tx: mpsc::UnboundedSender<io::Result<Option<Frame>>>) {
    loop {
        let r = protocol::read_frame(&mut rd).await;
        let end = !matches!(r, Ok(Some(_)));
        if tx.send(r).is_err() || end {
            break;
        }
    }
    std::future::pending::<()>().await
}

/// A stream connection being served: where its answers go, what it holds, the agent's streams.
struct Session<W> {
    wr: W,
    h: Holdings,
    streams: Arc<Streams>,
    deadline: Duration,
}

impl<W: AsyncWrite + Unpin> Session<W> {
    /// Waits for the next frame, notice or stop; answers pings and pushes notices on the way.
    async fn wait(
        &mut self,
        rx: &mut mpsc::UnboundedReceiver<io::Result<Option<Frame>>>,
        stop: &mut watch::Receiver<bool>,
    ) -> Waited {
        let deadline = self.deadline;
        let event = tokio::select! {
            r = rx.recv() => Next::Frame(r.unwrap_or(Ok(None))),
            n = next_notice(&mut self.h.conn.subscription) => Next::Notice(n),
            _ = stopped(stop) => Next::Stop,
        };
        match event {
            Next::Frame(Ok(Some(Frame::StreamRequest { json }))) => Waited::Request(json),
            Next::Frame(Ok(Some(Frame::Ping { nonce }))) => {
                let _ =
                    tokio::time::timeout(deadline, protocol::write_frame(&mut self.wr, &Frame::Pong { nonce })).await;
                Waited::Handled
            }
            Next::Frame(Ok(Some(other))) => {
                let message = format!("a stream connection takes stream requests, not {other:?}");
                let error = Frame::Error { code: ErrorCode::BadRequest, message };
                let _ = tokio::time::timeout(deadline, protocol::write_frame(&mut self.wr, &error)).await;
                Waited::End
            }
            Next::Frame(_) | Next::Stop | Next::Notice(None) => Waited::End,
            Next::Notice(Some(n)) => {
                if n.held {
                    *self.h.conn.leases.entry((n.name.clone(), n.version)).or_default() += 1;
                }
                if send(&mut self.wr, n.json.as_ref().clone(), deadline).await {
                    Waited::Handled
                } else {
                    log::warn!("a subscriber of {} took no notice within {deadline:?}: disconnected", n.name);
                    Waited::End
                }
            }
        }
    }

    /// Parses and handles one stream request and writes its answer, if it has one. False when the answer
    /// could not be written within the deadline (the connection ends).
    async fn answer(&mut self, json: &str) -> bool {
        let request: Request = match serde_json::from_str(json) {
            Ok(r) => r,
            Err(e) => {
                let message = StreamError::BadRequest(e.to_string()).to_string();
                let _ =
                    protocol::write_frame(&mut self.wr, &Frame::Error { code: ErrorCode::BadRequest, message }).await;
                return true;
            }
        };
        let Some(answer) = self.handle(request).await else { return true };
        let frame = match answer {
            Ok(v) => Frame::StreamEvent { json: v.to_string() },
            Err(e) => {
                let code = if matches!(e, StreamError::Io { .. }) { ErrorCode::Failed } else { ErrorCode::BadRequest };
                Frame::Error { code, message: e.to_string() }
            }
        };
        matches!(tokio::time::timeout(self.deadline, protocol::write_frame(&mut self.wr, &frame)).await, Ok(Ok(())))
    }

    /// Does what `request` asks; None for the requests that have no answer (a release, a serving report).
    async fn handle(&mut self, request: Request) -> Option<Result<serde_json::Value, StreamError>> {
        let (streams, h) = (&self.streams, &mut self.h);
        Some(match request {
            Request::Begin { name } if streams.remote.get().is_none() => streams.begin(&mut h.conn, &name),
            Request::Begin { name } => {
                // May ask Redis (under its deadline) for the stream's numbering: off the runtime.
                let s = streams.clone();
                let mut conn = std::mem::take(&mut h.conn);
                let (r, c) = tokio::task::spawn_blocking(move || {
                    let r = s.begin(&mut conn, &name);
                    (r, conn)
                })
                .await
                .unwrap_or_else(|e| (Err(StreamError::NotHeld(format!("the begin failed: {e}"))), Conn::default()));
                h.conn = c;
                r
            }
            Request::Commit { publish } => quick_blocking(|| streams.commit(&mut h.conn, publish)),
            Request::Abort { publish } => match h.conn.pending.take() {
                Some(p) if p.id == publish => {
                    streams.abort_pending(&mut h.conn, p);
                    Ok(answer(Aborted { aborted: publish }))
                }
                other => {
                    h.conn.pending = other;
                    Err(StreamError::NotHeld(format!("publish {publish} is not in progress on this connection")))
                }
            },
            Request::Subscribe { name, after, notices_only, pid, label } => {
                let who = Subscribing { notices_only, pid, label };
                let r = streams.subscribe(&mut h.conn, &name, after, who);
                if r.is_ok() {
                    if let Some(listening) = streams.follow(&name) {
                        // Redis unreachable costs this subscriber half a deadline (the other half is the
                        // answer's); the follower keeps retrying meanwhile.
                        let _ = tokio::time::timeout(self.deadline / 2, listening).await;
                    }
                }
                r
            }
            Request::Release { name, version } => {
                streams.release(&mut h.conn, &name, version);
                return None;
            }
            Request::Serving { version } => {
                streams.serving(&h.conn, version);
                return None;
            }
            // Each frame to the other agent has its deadline; the asker waits with its own.
            Request::Fetch { name, version } => streams.fetch(&mut h.conn, &name, version).await,
            Request::List => Ok(streams.list()),
        })
    }
}
