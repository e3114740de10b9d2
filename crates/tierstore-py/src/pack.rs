//! Bindings of the model repository's pack files: hashing, packed writes and verified parallel reads,
//! all over the buffer protocol (numpy arrays and byte views of torch tensors) with the GIL released.

use std::path::PathBuf;
use std::sync::Mutex;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tierstore_core::models::manifest::RepositoryManifest;
use tierstore_core::pack::{self, PackWriter, ReadError, ReadInto};

use crate::buffer::{new_pack_map, ByteBuffer};
use crate::error::io_to_py;

/// A contiguous byte view of a Python buffer, kept alive by the `ByteBuffer` it came from.
pub(crate) struct View {
    _buffer: ByteBuffer,
    ptr: usize,
    len: usize,
}

impl View {
    pub(crate) fn of(obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<View> {
        let buffer = ByteBuffer::get(obj).map_err(|_| {
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
    pub(crate) unsafe fn bytes(&self) -> &[u8] {
        std::slice::from_raw_parts(self.ptr as *const u8, self.len)
    }

    /// # Safety
    /// As [`View::bytes`], and the buffer must be writable and not aliased.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn bytes_mut(&self) -> &mut [u8] {
        std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.len)
    }
}

/// blake3 hashes of buffers, computed in parallel without the GIL.
#[pyfunction]
pub fn hash_buffers<'py>(py: Python<'py>, buffers: Vec<Bound<'py, PyAny>>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let views = buffers.iter().map(|b| View::of(b, false)).collect::<PyResult<Vec<_>>>()?;
    let hashes = crate::exiting::without_gil(py, || {
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
        self.with(|w| crate::exiting::without_gil(py, || w.append(unsafe { view.bytes() })))
    }

    /// Appends buffers, each at the next aligned offset, in as few `writev` calls as possible; returns
    /// their offsets.
    fn append_all(&self, py: Python<'_>, buffers: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<u64>> {
        let views = buffers.iter().map(|b| View::of(b, false)).collect::<PyResult<Vec<_>>>()?;
        self.with(|w| {
            crate::exiting::without_gil(py, || {
                // SAFETY: the views hold their buffers exported for this call.
                let slices: Vec<&[u8]> = views.iter().map(|v| unsafe { v.bytes() }).collect();
                w.append_all(&slices)
            })
        })
    }

    /// Bytes written so far.
    #[getter]
    fn size(&self) -> PyResult<u64> {
        self.with(|w| Ok(w.len()))
    }

    /// fsyncs the pack and renames it into place; returns the blake3 of the whole file, lowercase hex.
    fn commit(&self, py: Python<'_>) -> PyResult<String> {
        let w = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
        let w = w.ok_or_else(|| PyValueError::new_err("the pack is already committed or aborted"))?;
        let hash = crate::exiting::without_gil(py, || w.commit())
            .map_err(|e| io_to_py(e, Some(&self.path.to_string_lossy())))?;
        Ok(tierstore_core::hash::hex(&hash))
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
pub fn read_into(py: Python<'_>, path: PathBuf, requests: Vec<Request<'_>>) -> PyResult<()> {
    let views = request_views(&requests)?;
    let result = crate::exiting::without_gil(py, || {
        // SAFETY: every view holds its writable buffer exported for this call; the Python side passes
        // each destination once.
        let mut reqs = unsafe { read_requests(&views) };
        pack::read_into(&path, &mut reqs)
    });
    result.map_err(|e| read_error_to_py(py, e))
}

/// `read_into` through `cache`: the pack is opened as a reader of the cache (its tier copy, or a copy
/// still arriving from the store or from the node that owns it, read as it grows), and each request is
/// read and checked as soon as its bytes are there. With `pack_hash` (the pack's own blake3, from the
/// manifest), the tensors of a copy made for this read are not hashed one by one when the cache hashed
/// the copy whole as it landed and that hash is `pack_hash` (`pack::read_into_vouched`): each byte is
/// hashed once, not twice. Returns whether it was (the tensors were then not hashed again).
pub fn read_into_cached(
    py: Python<'_>,
    cache: &tierstore_core::Cache,
    path: PathBuf,
    requests: Vec<Request<'_>>,
    pack_hash: Option<Vec<u8>>,
) -> PyResult<bool> {
    let views = request_views(&requests)?;
    let pack_hash = hash_of(pack_hash.as_deref())?;
    let since = tierstore_core::clock::now_ns();
    let opened = crate::exiting::without_gil(py, || cache.open(&path));
    let reader = std::sync::Mutex::new(opened.map_err(crate::error::to_py)?);
    let result = crate::exiting::without_gil(py, || {
        // SAFETY: as in `read_into`.
        let mut reqs = unsafe { read_requests(&views) };
        let fetch = |offset: u64, buf: &mut [u8]| {
            // One reader thread reads in order (the other threads hash): the lock is never contended.
            let mut r = reader.lock().unwrap_or_else(|p| p.into_inner());
            let mut done = 0;
            while done < buf.len() {
                match r.read_at(&mut buf[done..], offset + done as u64)? {
                    0 => return Ok(false),
                    n => done += n,
                }
            }
            Ok(true)
        };
        let Some(want) = pack_hash.filter(|_| cache.hashes_copies()) else {
            return pack::read_into_from(&path, &mut reqs, fetch).map(|()| false);
        };
        let lock = || reader.lock().unwrap_or_else(|p| p.into_inner());
        // Decided with the reader locked, and read after (the reads lock it).
        let guard = lock();
        let kind = guard.backing_kind();
        let made_now = match guard.backing() {
            // A copy that another process made while this read began (this node's agent, fetching the
            // pack for a peer): vouched for by the hash it was made with.
            tierstore_core::reader::Backing::Copy(file, _) => {
                Some(cache.hash_of_new_copy(&path, file, since).ok().flatten() == Some(want))
            }
            // A copy being made: its hash once it is whole.
            tierstore_core::reader::Backing::Growing(_) => None,
            _ => Some(false),
        };
        drop(guard);
        if made_now == Some(false) {
            log::debug!(
                "{}: a load read from its {kind} copy, made before it: hashed tensor by tensor",
                path.display()
            );
            return pack::read_into_from(&path, &mut reqs, fetch).map(|()| false);
        }
        let mut vouched = false;
        let read = pack::read_into_vouched(&path, &mut reqs, fetch, || {
            vouched = made_now.unwrap_or_else(|| lock().hash_of_arriving_copy() == Some(want));
            vouched
        });
        let how = if vouched { "vouched for by the pack's hash" } else { "hashed tensor by tensor" };
        log::debug!("{}: a load read from its {kind} copy, {how}", path.display());
        read.map(|()| vouched)
    });
    result.map_err(|e| read_error_to_py(py, e))
}

/// `read_into` as parts from the agent of the node that owns the pack (a partial load: only the tensors'
/// bytes cross, and the job reads them from the store once). `False` when no owner could serve them: the
/// caller reads the store's pack.
pub fn read_parts(
    py: Python<'_>,
    cache: &tierstore_core::Cache,
    path: PathBuf,
    requests: Vec<Request<'_>>,
) -> PyResult<bool> {
    let views = request_views(&requests)?;
    let result = crate::exiting::without_gil(py, || {
        // SAFETY: as in `read_into`.
        let mut reqs = unsafe { read_requests(&views) };
        pack::read_parts(cache, &path, &mut reqs)
    });
    result.map_err(|e| read_error_to_py(py, e))
}

/// `map_pack` as parts from the agent of the node that owns the pack: the spans in private memory the
/// size of the pack, checked. `None` when no owner could serve them.
pub fn map_parts(
    py: Python<'_>,
    cache: &tierstore_core::Cache,
    path: PathBuf,
    spans: Vec<(u64, usize, Option<Vec<u8>>)>,
) -> PyResult<Option<PyObject>> {
    let spans = spans_of(spans)?;
    let map = crate::exiting::without_gil(py, || pack::map_parts(cache, &path, &spans))
        .map_err(|e| read_error_to_py(py, e))?;
    map.map(|map| new_pack_map(py, map)).transpose()
}

/// One request of a pack read from Python: `(offset, destination buffer, expected hash or None)`.
pub type Request<'py> = (u64, Bound<'py, PyAny>, Option<Vec<u8>>);

/// A pack read's requests, with each buffer exported writable.
fn request_views(requests: &[Request<'_>]) -> PyResult<Vec<(u64, View, Option<pack::Hash>)>> {
    requests
        .iter()
        .map(|(offset, buffer, expect)| Ok((*offset, View::of(buffer, true)?, hash_of(expect.as_deref())?)))
        .collect()
}

/// The requests over `views`' buffers.
///
/// # Safety
/// Each view's buffer must be exported for as long as the requests live, and no two views may share one.
unsafe fn read_requests<'v>(views: &'v [(u64, View, Option<pack::Hash>)]) -> Vec<ReadInto<'v>> {
    views
        .iter()
        // SAFETY: the caller vouches for the buffers.
        .map(|(offset, v, expect)| ReadInto { offset: *offset, dest: unsafe { v.bytes_mut() }, expect: *expect })
        .collect()
}

fn read_error_to_py(py: Python<'_>, e: ReadError) -> PyErr {
    match e {
        // With its errno, so that a missing pack is a FileNotFoundError naming the pack.
        ReadError::Io { path, source } if source.raw_os_error().is_some() => {
            io_to_py(source, Some(&path.to_string_lossy()))
        }
        ReadError::Io { ref source, .. } => io_to_py(std::io::Error::new(source.kind(), e.to_string()), None),
        ReadError::Truncated { .. } => crate::error::integrity_error(py, e.to_string(), e.index(), "truncated"),
        ReadError::Corrupt { .. } => crate::error::integrity_error(py, e.to_string(), e.index(), "corrupt"),
    }
}

/// Spans from Python: `(offset, length, expected hash or None)`.
fn spans_of(spans: Vec<(u64, usize, Option<Vec<u8>>)>) -> PyResult<Vec<pack::Span>> {
    spans
        .into_iter()
        .map(|(offset, len, expect)| Ok(pack::Span { offset, len, expect: hash_of(expect.as_deref())? }))
        .collect()
}

fn hash_of(h: Option<&[u8]>) -> PyResult<Option<pack::Hash>> {
    h.map(|h| <[u8; 32]>::try_from(h).map_err(|_| PyValueError::new_err("a hash is 32 bytes"))).transpose()
}

/// Maps a pack and checks `(offset, length, expected hash or None)` tensors in it, without the GIL and
/// without copying a byte. Raises `IntegrityError(message, index, kind)` as `read_into` does. Returns a
/// `PackMap` (`crate::buffer`): a writable buffer whose bytes are the pack's, mapped copy-on-write (writes
/// copy the page and never reach the file). Tensors made over it keep it alive.
#[pyfunction]
pub fn map_pack(py: Python<'_>, path: PathBuf, spans: Vec<(u64, usize, Option<Vec<u8>>)>) -> PyResult<PyObject> {
    let spans = spans_of(spans)?;
    let map =
        crate::exiting::without_gil(py, || pack::map_verified(&path, &spans)).map_err(|e| read_error_to_py(py, e))?;
    new_pack_map(py, map)
}

/// Checks `(offset, length, expected hash or None)` tensors of a pack, without the GIL and keeping no
/// byte: one entry per span, `None` when it is intact, else `(kind, message)` with kind `"corrupt"`,
/// `"truncated"` or `"unreadable"`. Every damaged span is reported, not only the first. Raises `OSError`
/// (`FileNotFoundError`...) when the pack cannot be opened.
#[pyfunction]
pub fn verify_pack(
    py: Python<'_>,
    path: PathBuf,
    spans: Vec<(u64, usize, Option<Vec<u8>>)>,
) -> PyResult<Vec<Option<(&'static str, String)>>> {
    let spans = spans_of(spans)?;
    let found = crate::exiting::without_gil(py, || pack::verify(&path, &spans)).map_err(|e| read_error_to_py(py, e))?;
    Ok(found
        .into_iter()
        .map(|r| {
            r.err().map(|e| {
                let kind = match e {
                    ReadError::Corrupt { .. } => "corrupt",
                    ReadError::Truncated { .. } => "truncated",
                    ReadError::Io { .. } => "unreadable",
                };
                (kind, e.to_string())
            })
        })
        .collect())
}

/// A damaged or refused manifest as `ValueError` (the file and what is wrong); any other failure as the
/// `OSError` of its errno (`FileNotFoundError` for one deleted meanwhile).
fn manifest_error(e: std::io::Error, path: &std::path::Path) -> PyErr {
    match e.kind() {
        std::io::ErrorKind::InvalidData | std::io::ErrorKind::InvalidInput => PyValueError::new_err(e.to_string()),
        _ => io_to_py(e, Some(&path.to_string_lossy())),
    }
}

/// The repository manifest at `path`, checked against its schema
/// (`tierstore_core::models::manifest::RepositoryManifest`), as a JSON object's text.
#[pyfunction]
pub fn model_manifest_read(py: Python<'_>, path: PathBuf) -> PyResult<String> {
    let m =
        crate::exiting::without_gil(py, || RepositoryManifest::read(&path)).map_err(|e| manifest_error(e, &path))?;
    serde_json::to_string(&m).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// Writes the repository manifest `json` (a JSON object's text) at `path`, after checking it against its
/// schema: whole and durably (a temporary name, fsync, rename, fsync of the directory).
#[pyfunction]
pub fn model_manifest_write(py: Python<'_>, path: PathBuf, json: &str) -> PyResult<()> {
    let m: RepositoryManifest = serde_json::from_str(json)
        .map_err(|e| PyValueError::new_err(format!("{}: not a repository manifest: {e}", path.display())))?;
    crate::exiting::without_gil(py, || m.write(&path)).map_err(|e| manifest_error(e, &path))
}
