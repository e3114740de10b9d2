//! A connection to the node's agent for model streams, for `tierstore.stream`: Python speaks the wire
//! protocol through `tierstore_core::cluster::wire`, its one implementation, instead of packing frames itself.
//! One Unix socket past the agent's challenge and this process's hello; requests and events are JSON in
//! stream frames. Sends from several threads are serialized, and so are receives; each waits at most its
//! deadline, and the GIL is released while it waits.

use std::io;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use pyo3::exceptions::{PyConnectionError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use tierstore_core::cluster::dial::dial_local;
use tierstore_core::cluster::session::{ClientHello, HandshakeError};
use tierstore_core::cluster::wire::{self, Frame};
use tierstore_core::models::requests::Request;

use crate::error::stream_error;

/// One connection to the node's agent (`tierstore._core.AgentLink(path, deadline)`).
#[pyclass(name = "AgentLink", module = "tierstore._core", frozen)]
pub struct PyAgentLink {
    path: PathBuf,
    deadline: Duration,
    reader: Mutex<UnixStream>,
    writer: Mutex<UnixStream>,
}

/// A failure met without the GIL, made a Python exception once the GIL is back: building a `StreamError`
/// takes the GIL, which a daemon thread must not take while the interpreter exits (see `exiting`).
enum Failure {
    Stream(String),
    Py(PyErr),
}

impl From<PyErr> for Failure {
    fn from(e: PyErr) -> Self {
        Failure::Py(e)
    }
}

impl From<io::Error> for Failure {
    fn from(e: io::Error) -> Self {
        Failure::Py(e.into())
    }
}

impl From<Failure> for PyErr {
    fn from(f: Failure) -> Self {
        match f {
            Failure::Stream(message) => stream_error(message),
            Failure::Py(e) => e,
        }
    }
}

/// The name of a frame's kind, for a message about a frame that was not expected.
fn kind_of(frame: &Frame) -> String {
    let debug = format!("{frame:?}");
    debug.split([' ', '{', '(']).next().unwrap_or("?").to_string()
}

impl PyAgentLink {
    fn timed_out(&self, waited: Duration) -> PyErr {
        PyTimeoutError::new_err(format!(
            "the agent on {} did not answer within {:.1} s",
            self.path.display(),
            waited.as_secs_f64()
        ))
    }

    /// Reads one frame within `wait` (none: as long as it takes).
    fn read(&self, stream: &mut UnixStream, wait: Option<Duration>) -> PyResult<Frame> {
        stream.set_read_timeout(wait)?;
        match wire::read_frame(stream) {
            Ok(Some(frame)) => Ok(frame),
            Ok(None) => {
                Err(PyConnectionError::new_err(format!("the agent on {} closed the connection", self.path.display())))
            }
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                Err(self.timed_out(wait.unwrap_or(self.deadline)))
            }
            Err(e) => Err(e.into()),
        }
    }
}

#[pymethods]
impl PyAgentLink {
    /// Connects to the agent on the Unix socket `path` and introduces this process to it; every step waits
    /// at most `deadline` seconds.
    #[new]
    fn new(py: Python<'_>, path: PathBuf, deadline: f64) -> PyResult<Self> {
        let deadline = Duration::from_secs_f64(deadline.max(0.001));
        let stream = crate::exiting::without_gil(py, || dial_local(&path, deadline)).map_err(|e| {
            stream_error(format!(
                "no agent answers on {} ({e}); start one with `tierstore agent start` (or pass socket= the agent's \
                 socket)",
                path.display()
            ))
        })?;
        // Another user's process bound in the socket's place is a stranger, whatever it answers.
        tierstore_core::private::check_peer(&stream, &path).map_err(|e| stream_error(e.to_string()))?;
        stream.set_write_timeout(Some(deadline))?;
        let reader = stream.try_clone()?;
        let link = PyAgentLink { path: path.clone(), deadline, reader: Mutex::new(reader), writer: Mutex::new(stream) };
        crate::exiting::without_gil(py, || -> Result<(), Failure> {
            let mut r = link.reader.lock().expect("reader lock");
            let agent = path.display();
            let failed = |e: HandshakeError| match e {
                HandshakeError::Version(theirs) => Failure::Stream(format!(
                    "the agent on {agent} speaks protocol {theirs}, this tierstore {}: run the same tierstore for the \
                     agent and its clients",
                    wire::VERSION
                )),
                HandshakeError::Refused(_, message) => {
                    Failure::Stream(format!("the agent on {agent} refused the connection: {message}"))
                }
                other => Failure::Stream(format!("the agent on {agent}: {other}")),
            };
            let challenge = link.read(&mut r, Some(deadline))?;
            let (handshake, hello) = ClientHello::answer(challenge, "", "local", None).map_err(failed)?;
            wire::write_frame(&mut *link.writer.lock().expect("writer lock"), &hello)?;
            handshake.welcome(link.read(&mut r, Some(deadline))?).map_err(failed)?;
            Ok(())
        })?;
        Ok(link)
    }

    /// The agent's socket.
    #[getter]
    fn path(&self) -> PathBuf {
        self.path.clone()
    }

    /// Sends one stream request (a JSON object's text), once it has read as one of the requests the agent
    /// takes (`tierstore_core::models::requests::Request`): a wrong one raises ValueError here, naming
    /// the fault, and never reaches the agent.
    fn send(&self, py: Python<'_>, json: String) -> PyResult<()> {
        let request: Request = serde_json::from_str(&json)
            .map_err(|e| PyValueError::new_err(format!("not a stream request ({e}): {json}")))?;
        let json = serde_json::to_string(&request).map_err(|e| PyValueError::new_err(e.to_string()))?;
        crate::exiting::without_gil(py, || {
            let mut w = self.writer.lock().expect("writer lock");
            wire::write_frame(&mut *w, &Frame::StreamRequest { json }).map_err(PyErr::from)
        })
    }

    /// The next stream event (an answer, or a notice the agent pushed), as a JSON object's text; waits at
    /// most `timeout` seconds (None: as long as it takes).
    #[pyo3(signature = (timeout))]
    fn recv(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<String> {
        let wait = match timeout {
            Some(t) if t <= 0.0 => return Err(self.timed_out(Duration::ZERO)),
            Some(t) => Some(Duration::from_secs_f64(t)),
            None => None,
        };
        let event = crate::exiting::without_gil(py, || -> Result<String, Failure> {
            let mut r = self.reader.lock().expect("reader lock");
            loop {
                match self.read(&mut r, wait)? {
                    Frame::StreamEvent { json } => return Ok(json),
                    Frame::Pong { .. } => continue,
                    Frame::Error { message, .. } => {
                        return Err(Failure::Stream(format!("the agent on {}: {message}", self.path.display())))
                    }
                    other => {
                        return Err(Failure::Stream(format!(
                            "the agent on {} sent a {} frame where a stream event was due",
                            self.path.display(),
                            kind_of(&other)
                        )))
                    }
                }
            }
        });
        Ok(event?)
    }

    /// Sends a request and returns its answer, within the connection's deadline.
    fn call(&self, py: Python<'_>, json: String) -> PyResult<String> {
        self.send(py, json)?;
        self.recv(py, Some(self.deadline.as_secs_f64()))
    }

    /// Closes the connection (a receive waiting in another thread returns with an error).
    fn close(&self) {
        if let Ok(w) = self.writer.lock() {
            let _ = w.shutdown(std::net::Shutdown::Both);
        }
    }
}
