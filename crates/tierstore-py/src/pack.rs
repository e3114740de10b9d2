//! Bindings of the model repository's pack files: hashing, packed writes and verified parallel reads,
//! all over the buffer protocol (numpy arrays and byte views of torch tensors) with the GIL released.

use std::path::PathBuf;
use std::sync::Mutex;

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tierstore_core::pack::{self, PackWriter, ReadError, ReadInto};

use crate::error::io_to_py;

/// A contiguous byte view of a Python buffer, kept alive by the `PyBuffer` it came from.
struct View {
    _buffer: PyBuffer<u8>,
    ptr: usize,
    len: usize,
}

impl View {
    fn of(obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<View> {
        let buffer = PyBuffer::<u8>::get(obj).map_err(|_| {
            PyTypeError::new_err("expected a contiguous buffer of bytes (a uint8 numpy array or bytes)")
        })?;
        if !buffer.is_c_contiguous() {
            return Err(PyTypeError::new_err("expected a contiguous buffer"));
        }
        if writable && buffer.readonly() {
            return Err(PyTypeError::new_err("expected a writable buffer"));
        }
        let (ptr, len) = (buffer.buf_ptr() as usize, buffer.len_bytes());
        Ok(View { _buffer: buffer, ptr, len })
    }

    /// # Safety
    /// The buffer must stay exported (it is, while `self` lives) and not be used elsewhere meanwhile.
    unsafe fn bytes(&self) -> &[u8] {
        std::slice::from_raw_parts(self.ptr as *const u8, self.len)
    }

    /// # Safety
    /// As [`View::bytes`], and the buffer must be writable and not aliased.
    #[allow(clippy::mut_from_ref)]
    unsafe fn bytes_mut(&self) -> &mut [u8] {
        std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.len)
    }
}

/// blake3 hashes of buffers, computed in parallel without the GIL.
#[pyfunction]
pub fn hash_buffers<'py>(py: Python<'py>, buffers: Vec<Bound<'py, PyAny>>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let views = buffers.iter().map(|b| View::of(b, false)).collect::<PyResult<Vec<_>>>()?;
    let hashes = py.allow_threads(|| {
        // SAFETY: the views hold their buffers exported for this call.
        let slices: Vec<&[u8]> = views.iter().map(|v| unsafe { v.bytes() }).collect();
        pack::hash_many(&slices)
    });
    Ok(hashes.iter().map(|h| PyBytes::new(py, h)).collect())
}

/// A pack file being written (see `tierstore.models`).
#[pyclass(name = "PackWriter", module = "tierstore._core", frozen)]
pub struct PyPackWriter {
    inner: Mutex<Option<PackWriter>>,
    path: PathBuf,
}

impl PyPackWriter {
    fn with<T>(&self, f: impl FnOnce(&mut PackWriter) -> std::io::Result<T>) -> PyResult<T> {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let w = g.as_mut().ok_or_else(|| PyValueError::new_err("the pack is already committed or aborted"))?;
        f(w).map_err(|e| io_to_py(e, Some(&self.path.to_string_lossy())))
    }
}

#[pymethods]
impl PyPackWriter {
    #[new]
    fn new(path: PathBuf) -> PyResult<Self> {
        let w = PackWriter::create(&path).map_err(|e| io_to_py(e, Some(&path.to_string_lossy())))?;
        Ok(PyPackWriter { inner: Mutex::new(Some(w)), path })
    }

    /// Appends a buffer at the next aligned offset and returns the offset.
    fn append(&self, py: Python<'_>, buffer: &Bound<'_, PyAny>) -> PyResult<u64> {
        let view = View::of(buffer, false)?;
        // SAFETY: the view holds its buffer exported for this call.
        self.with(|w| py.allow_threads(|| w.append(unsafe { view.bytes() })))
    }

    /// Bytes written so far.
    #[getter]
    fn size(&self) -> PyResult<u64> {
        self.with(|w| Ok(w.len()))
    }

    /// fsyncs the pack and renames it into place.
    fn commit(&self, py: Python<'_>) -> PyResult<()> {
        let w = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
        let w = w.ok_or_else(|| PyValueError::new_err("the pack is already committed or aborted"))?;
        py.allow_threads(|| w.commit()).map_err(|e| io_to_py(e, Some(&self.path.to_string_lossy())))
    }

    /// Removes the unfinished pack.
    fn abort(&self) {
        if let Some(w) = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take() {
            w.abort();
        }
    }
}

/// Reads `(offset, destination buffer, expected hash or None)` requests from a pack, in parallel and
/// without the GIL. Raises `IntegrityError(message, index, kind)` naming the first request whose bytes are
/// wrong or missing.
#[pyfunction]
pub fn read_into(
    py: Python<'_>,
    path: PathBuf,
    requests: Vec<(u64, Bound<'_, PyAny>, Option<Vec<u8>>)>,
) -> PyResult<()> {
    let mut views = Vec::with_capacity(requests.len());
    for (offset, buffer, expect) in &requests {
        let expect = match expect {
            None => None,
            Some(h) => {
                Some(<[u8; 32]>::try_from(h.as_slice()).map_err(|_| PyValueError::new_err("a hash is 32 bytes"))?)
            }
        };
        views.push((*offset, View::of(buffer, true)?, expect));
    }
    let result = py.allow_threads(|| {
        // SAFETY: every view holds its writable buffer exported for this call; the Python side passes
        // each destination once.
        let mut reqs: Vec<ReadInto<'_>> = views
            .iter()
            .map(|(offset, v, expect)| ReadInto { offset: *offset, dest: unsafe { v.bytes_mut() }, expect: *expect })
            .collect();
        pack::read_into(&path, &mut reqs)
    });
    result.map_err(|e| match &e {
        ReadError::Io { source, .. } => io_to_py(std::io::Error::new(source.kind(), e.to_string()), None),
        ReadError::Truncated { .. } => crate::error::integrity_error(py, e.to_string(), e.index(), "truncated"),
        ReadError::Corrupt { .. } => crate::error::integrity_error(py, e.to_string(), e.index(), "corrupt"),
    })
}
