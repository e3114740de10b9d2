//! A client of an agent: connect, check who is there (the agent's proof of the token on TCP, the socket
//! owner's uid on the node), say hello, then one request at a time. Every step has a deadline, and an error names the agent and how long it waited.

use std::io;
use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpStream, UnixStream};

use tierstore_core::cluster::session::{ClientHello, KeyShare};

use crate::protocol::{self, Frame, Seals};

/// A failed exchange with an agent.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No agent answers there.
    #[error("no agent at {at} ({source}); start one with `tierstore agent run`")]
    Unreachable {
        /// The socket or address.
        at: String,
        /// Why the connection failed.
        source: io::Error,
    },
    /// The agent did not answer in time.
    #[error("the agent at {at} did not answer within {waited:?}")]
    Deadline {
        /// The socket or address.
        at: String,
        /// How long the client waited.
        waited: Duration,
    },
    /// The agent refused the request.
    #[error("the agent at {at} refused: {message}")]
    Refused {
        /// The socket or address.
        at: String,
        /// The agent's message.
        message: String,
    },
    /// The connection broke or carried something that is not a frame.
    #[error("the connection to the agent at {at} failed: {source}")]
    Broken {
        /// The socket or address.
        at: String,
        /// The error.
        source: io::Error,
    },
}

/// A connection to an agent, past its hello.
pub struct Client<S> {
    stream: S,
    /// The frame keys of the connection (plain on the node's socket).
    seals: Seals,
    at: String,
    deadline: Duration,
    /// The agent's node name, from its welcome.
    pub node: String,
}

impl Client<UnixStream> {
    /// Connects to the agent of this node on `socket` (waiting for room in its queue, within `deadline`).
    pub async fn local(socket: &Path, deadline: Duration) -> Result<Self, ClientError> {
        let at = socket.display().to_string();
        let path = socket.to_path_buf();
        let dialed = tokio::task::spawn_blocking(move || tierstore_core::cluster::dial::dial_local(&path, deadline))
            .await
            .map_err(|e| ClientError::Unreachable { at: at.clone(), source: io::Error::other(e) })?;
        let stream = match dialed.and_then(|s| s.set_nonblocking(true).map(|()| s)).and_then(UnixStream::from_std) {
            Ok(s) => s,
            Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                return Err(ClientError::Deadline { at, waited: deadline })
            }
            Err(source) => return Err(ClientError::Unreachable { at, source }),
        };
        if let Err(source) = tierstore_core::private::check_peer(&stream, socket) {
            return Err(ClientError::Refused { at, message: source.to_string() });
        }
        Client::hello(stream, at, "local", None, deadline).await
    }
}

impl Client<TcpStream> {
    /// Connects to the agent of a peer at `addr` as node `me`; both prove the job's `token` (without one,
    /// nothing is asked of a peer).
    pub async fn peer(addr: &str, me: &str, token: Option<&[u8]>, deadline: Duration) -> Result<Self, ClientError> {
        let at = addr.to_string();
        let Some(token) = token else {
            let message = format!("no token to prove to it; {}", tierstore_core::cluster::TOKEN_FIX);
            return Err(ClientError::Refused { at, message });
        };
        let stream = match tokio::time::timeout(deadline, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(source)) => return Err(ClientError::Unreachable { at, source }),
            Err(_) => return Err(ClientError::Deadline { at, waited: deadline }),
        };
        let _ = stream.set_nodelay(true);
        Client::hello(stream, at, me, Some(token), deadline).await
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Client<S> {
    async fn hello(
        stream: S,
        at: String,
        me: &str,
        token: Option<&[u8]>,
        deadline: Duration,
    ) -> Result<Self, ClientError> {
        let mut c = Client { stream, seals: Seals::default(), at, deadline, node: String::new() };
        let challenge = c.receive().await?;
        let refused = |at: &str, e: tierstore_core::cluster::session::HandshakeError| ClientError::Refused {
            at: at.to_string(),
            message: e.to_string(),
        };
        let (handshake, hello) = ClientHello::answer(challenge, &c.at, me, token).map_err(|e| refused(&c.at, e))?;
        c.send(&hello).await?;
        let answer = c.receive().await?;
        let welcomed = handshake.welcome(answer).map_err(|e| refused(&c.at, e))?;
        (c.node, c.seals) = (welcomed.node, welcomed.seals);
        if welcomed.encrypt {
            // The agent demands encryption (`[cluster] encrypt`): the key exchange comes first.
            let (share, frame) = KeyShare::new();
            c.send(&frame).await?;
            let theirs = c.receive().await?;
            share.finish(theirs, &mut c.seals).map_err(|e| refused(&c.at, e))?;
        }
        Ok(c)
    }

    fn unexpected(&self, frame: &Frame) -> ClientError {
        match frame {
            Frame::Error { message, .. } => ClientError::Refused { at: self.at.clone(), message: message.clone() },
            other => ClientError::Broken {
                at: self.at.clone(),
                source: io::Error::new(io::ErrorKind::InvalidData, format!("unexpected answer {other:?}")),
            },
        }
    }

    async fn receive(&mut self) -> Result<Frame, ClientError> {
        match tokio::time::timeout(self.deadline, protocol::read_sealed(&mut self.stream, &mut self.seals.recv)).await {
            Ok(Ok(Some(f))) => Ok(f),
            Ok(Ok(None)) => Err(ClientError::Broken {
                at: self.at.clone(),
                source: io::Error::new(io::ErrorKind::UnexpectedEof, "the agent closed the connection"),
            }),
            Ok(Err(source)) => Err(ClientError::Broken { at: self.at.clone(), source }),
            Err(_) => Err(ClientError::Deadline { at: self.at.clone(), waited: self.deadline }),
        }
    }

    async fn send(&mut self, frame: &Frame) -> Result<(), ClientError> {
        match tokio::time::timeout(self.deadline, protocol::write_sealed(&mut self.stream, &mut self.seals.send, frame))
            .await
        {
            Ok(Ok(())) => Ok(()),
            Ok(Err(source)) => Err(ClientError::Broken { at: self.at.clone(), source }),
            Err(_) => Err(ClientError::Deadline { at: self.at.clone(), waited: self.deadline }),
        }
    }

    /// Sends `request` and returns the agent's answer (an error answer becomes [`ClientError::Refused`]).
    pub async fn call(&mut self, request: &Frame) -> Result<Frame, ClientError> {
        self.send(request).await?;
        match self.receive().await? {
            Frame::Error { message, .. } => Err(ClientError::Refused { at: self.at.clone(), message }),
            answer => Ok(answer),
        }
    }

    /// The next frame the agent sends (a chunk of a transfer in progress), within the deadline.
    pub async fn receive_frame(&mut self) -> Result<Frame, ClientError> {
        self.receive().await
    }

    /// Sends a frame that gets no answer (credit for a transfer), within the deadline.
    pub async fn send_frame(&mut self, frame: &Frame) -> Result<(), ClientError> {
        match tokio::time::timeout(self.deadline, protocol::write_sealed(&mut self.stream, &mut self.seals.send, frame))
            .await
        {
            Ok(Ok(())) => Ok(()),
            Ok(Err(source)) => Err(ClientError::Broken { at: self.at.clone(), source }),
            Err(_) => Err(ClientError::Deadline { at: self.at.clone(), waited: self.deadline }),
        }
    }

    /// The agent's status as JSON text.
    pub async fn status(&mut self) -> Result<String, ClientError> {
        match self.call(&Frame::Status).await? {
            Frame::StatusReport { json } => Ok(json),
            other => Err(self.unexpected(&other)),
        }
    }
}
