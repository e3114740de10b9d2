//! The one place where Rust errors become Python exceptions. I/O errors keep their kind (an `OSError`
//! built from errno becomes `FileNotFoundError`, `PermissionError`, `IsADirectoryError`…); everything else
//! derives from `tierstore.TierstoreError`.

use pyo3::exceptions::{PyException, PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyDict, PyTuple, PyType};
use tierstore_core::Error;

static TIERSTORE_ERROR: GILOnceCell<Py<PyType>> = GILOnceCell::new();
static CONFIG_ERROR: GILOnceCell<Py<PyType>> = GILOnceCell::new();
static OUTSIDE_SOURCE_ERROR: GILOnceCell<Py<PyType>> = GILOnceCell::new();
static INTEGRITY_ERROR: GILOnceCell<Py<PyType>> = GILOnceCell::new();
static STREAM_ERROR: GILOnceCell<Py<PyType>> = GILOnceCell::new();

fn make_type(py: Python<'_>, name: &str, bases: &[Bound<'_, PyAny>], doc: &str) -> PyResult<Py<PyType>> {
    let ns = PyDict::new(py);
    ns.set_item("__doc__", doc)?;
    ns.set_item("__module__", "tierstore")?;
    let t = py.import("builtins")?.getattr("type")?.call1((name, PyTuple::new(py, bases)?, ns))?;
    Ok(t.downcast_into::<PyType>()?.unbind())
}

/// Creates the exception classes and adds them to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let base = TIERSTORE_ERROR.get_or_try_init(py, || {
        make_type(py, "TierstoreError", &[py.get_type::<PyException>().into_any()], "Base of tierstore's errors.")
    })?;
    let config = CONFIG_ERROR.get_or_try_init(py, || {
        make_type(
            py,
            "ConfigError",
            &[base.bind(py).clone().into_any(), py.get_type::<PyValueError>().into_any()],
            "A configuration value is invalid; the message names the key, the value, where it was set and the fix.",
        )
    })?;
    let outside = OUTSIDE_SOURCE_ERROR.get_or_try_init(py, || {
        make_type(
            py,
            "OutsideSourceError",
            &[base.bind(py).clone().into_any(), py.get_type::<PyValueError>().into_any()],
            "A path given to the cache is not under its source directory.",
        )
    })?;
    let integrity = INTEGRITY_ERROR.get_or_try_init(py, || {
        make_type(
            py,
            "IntegrityError",
            &[base.bind(py).clone().into_any()],
            "Stored bytes do not match their recorded hash: they are never returned.",
        )
    })?;
    let stream = STREAM_ERROR.get_or_try_init(py, || {
        let t = make_type(
            py,
            "StreamError",
            &[base.bind(py).clone().into_any()],
            "A stream request failed; the message names the stream, the version and what to do.",
        )?;
        t.bind(py).setattr("__module__", "tierstore.stream")?;
        Ok::<_, PyErr>(t)
    })?;
    m.add("StreamError", stream.bind(py))?;
    m.add("IntegrityError", integrity.bind(py))?;
    m.add("TierstoreError", base.bind(py))?;
    m.add("ConfigError", config.bind(py))?;
    m.add("OutsideSourceError", outside.bind(py))?;
    Ok(())
}

fn raise(py: Python<'_>, cell: &GILOnceCell<Py<PyType>>, message: String) -> PyErr {
    match cell.get(py) {
        Some(t) => PyErr::from_type(t.bind(py).clone(), message),
        None => PyException::new_err(message),
    }
}

/// `ConfigError(message)` with the parts of the error as attributes (`key`, `value`, `problem`, `fix`), so
/// that a caller can tell which setting was wrong without reading the message.
fn config_error(py: Python<'_>, e: &tierstore_core::config::ConfigError) -> PyErr {
    let made = CONFIG_ERROR.get(py).map(|t| -> PyResult<PyErr> {
        let err = t.bind(py).call1((e.to_string(),))?;
        err.setattr("key", &e.key)?;
        err.setattr("value", &e.value)?;
        err.setattr("problem", &e.problem)?;
        err.setattr("fix", &e.fix)?;
        Ok(PyErr::from_value(err))
    });
    match made {
        Some(Ok(err)) => err,
        Some(Err(failed)) => failed,
        None => PyException::new_err(e.to_string()),
    }
}

/// Converts a core error into the matching Python exception.
pub fn to_py(err: Error) -> PyErr {
    Python::with_gil(|py| match err {
        Error::Config(e) => config_error(py, &e),
        Error::OutsideSource(e) => raise(py, &OUTSIDE_SOURCE_ERROR, e.to_string()),
        Error::Io { path, source } => io_to_py(source, Some(&path.to_string_lossy())),
        other => raise(py, &TIERSTORE_ERROR, other.to_string()),
    })
}

/// Converts an I/O error into `OSError(errno, message, filename)`, which Python turns into the subclass
/// of its errno (`FileNotFoundError` for ENOENT, …).
pub fn io_to_py(err: std::io::Error, path: Option<&str>) -> PyErr {
    let message = err.to_string();
    match (err.raw_os_error(), path) {
        (Some(errno), Some(p)) => {
            let text = std::io::Error::from_raw_os_error(errno).to_string();
            let text = text.split(" (os error").next().unwrap_or(&text).to_string();
            PyOSError::new_err((errno, text, p.to_string()))
        }
        (Some(errno), None) => PyOSError::new_err((errno, message)),
        // An error with a kind but no errno (an object store's): the errno of its kind, so that Python
        // raises the matching subclass (FileNotFoundError, PermissionError, TimeoutError) with our message.
        (None, _) => match errno_of_kind(err.kind()) {
            Some(errno) => PyOSError::new_err((errno, message)),
            None => PyOSError::new_err(message),
        },
    }
}

fn errno_of_kind(kind: std::io::ErrorKind) -> Option<i32> {
    use std::io::ErrorKind as K;
    Some(match kind {
        K::NotFound => libc::ENOENT,
        K::PermissionDenied => libc::EACCES,
        K::TimedOut => libc::ETIMEDOUT,
        K::ConnectionRefused => libc::ECONNREFUSED,
        K::ConnectionReset => libc::ECONNRESET,
        K::Unsupported => libc::EOPNOTSUPP,
        K::IsADirectory => libc::EISDIR,
        _ => return None,
    })
}

/// `tierstore.stream.StreamError(message)`: the agent refused or failed a stream request.
pub fn stream_error(message: String) -> PyErr {
    Python::with_gil(|py| raise(py, &STREAM_ERROR, message))
}

/// `IntegrityError(message, index, kind)`: which request failed, and how ("corrupt" or "truncated").
pub fn integrity_error(py: Python<'_>, message: String, index: Option<usize>, kind: &str) -> PyErr {
    match INTEGRITY_ERROR.get(py) {
        Some(t) => PyErr::from_type(t.bind(py).clone(), (message, index, kind.to_string())),
        None => PyException::new_err(message),
    }
}

/// Converts a write-back error: a store that did not take the files in time is a `TimeoutError`, a file
/// error keeps its errno, the configuration's is a `ConfigError`, the rest a `TierstoreError`.
pub fn writeback_to_py(err: tierstore_core::writeback::WritebackError) -> PyErr {
    use tierstore_core::writeback::WritebackError as W;
    Python::with_gil(|py| match err {
        W::Config(e) => config_error(py, &e),
        W::Timeout { .. } => pyo3::exceptions::PyTimeoutError::new_err(err.to_string()),
        W::Io { ref path, ref source, .. } if source.raw_os_error().is_some() => {
            let errno = source.raw_os_error().unwrap_or(libc::EIO);
            PyOSError::new_err((errno, err.to_string(), path.to_string_lossy().into_owned()))
        }
        other => raise(py, &TIERSTORE_ERROR, other.to_string()),
    })
}
