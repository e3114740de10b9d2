//! Bindings of model streaming's byte work (`tierstore_core::stream`): placing a version's tensors,
//! reading them into a consumer's buffers, snapshotting into a staging buffer. Over the buffer protocol,
//! without the GIL.

use std::path::PathBuf;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tierstore_core::models::manifest::{Manifest, Tensor};
use tierstore_core::stream;

use crate::error::io_to_py;
use crate::pack::View;

/// `heads_only[i]`: tensor `i` was said unchanged, and only its first bytes are compared (None: every
/// tensor compared whole).
fn checks(heads_only: Option<Vec<bool>>) -> Vec<stream::Check> {
    heads_only
        .unwrap_or_default()
        .into_iter()
        .map(|h| if h { stream::Check::Head } else { stream::Check::Whole })
        .collect()
}

/// Places tensors into the directory of a publish: `bases[i]` is `(file, hash)` of tensor `i` in the
/// version before, or None. Returns `(hash, written)` per tensor. `threads`: at most this many threads
/// (None: every core). `heads_only`: see [`checks`]. `spares`: the agent's directory of spare files,
/// written into instead of new files where one has a tensor's size.
#[pyfunction]
#[pyo3(signature = (buffers, bases, dir, threads=None, heads_only=None, spares=None))]
pub fn stream_place<'py>(
    py: Python<'py>,
    buffers: Vec<Bound<'py, PyAny>>,
    bases: Vec<Option<(PathBuf, Vec<u8>)>>,
    dir: PathBuf,
    threads: Option<usize>,
    heads_only: Option<Vec<bool>>,
    spares: Option<PathBuf>,
) -> PyResult<Vec<(Bound<'py, PyBytes>, bool)>> {
    let checks = checks(heads_only);
    let views = buffers.iter().map(|b| View::of(b, false)).collect::<PyResult<Vec<_>>>()?;
    let bases = bases
        .into_iter()
        .map(|b| {
            b.map(|(p, h)| Ok((p, <[u8; 32]>::try_from(h).map_err(|_| PyValueError::new_err("a hash is 32 bytes"))?)))
                .transpose()
        })
        .collect::<PyResult<Vec<_>>>()?;
    let placed = crate::exiting::without_gil(py, || {
        // SAFETY: the views hold their buffers exported for this call.
        let slices: Vec<&[u8]> = views.iter().map(|v| unsafe { v.bytes() }).collect();
        match threads {
            Some(n) => stream::place_on(n, &slices, &bases, &checks, &dir, spares.as_deref()),
            None => stream::place(&slices, &bases, &checks, &dir, spares.as_deref()),
        }
    })
    .map_err(|e| io_to_py(e, Some(&dir.to_string_lossy())))?;
    Ok(placed.iter().map(|p| (PyBytes::new(py, &p.hash), p.written)).collect())
}

/// Reads each file whole into the writable buffer of the same index, in parallel.
#[pyfunction]
pub fn stream_read(py: Python<'_>, paths: Vec<PathBuf>, buffers: Vec<Bound<'_, PyAny>>) -> PyResult<()> {
    let views = buffers.iter().map(|b| View::of(b, true)).collect::<PyResult<Vec<_>>>()?;
    crate::exiting::without_gil(py, || {
        // SAFETY: every view holds its writable buffer exported for this call; each is passed once.
        let mut dests: Vec<&mut [u8]> = views.iter().map(|v| unsafe { v.bytes_mut() }).collect();
        stream::read_into(&paths, &mut dests)
    })
    .map_err(|e| io_to_py(e, None))
}

/// Copies each source buffer into the writable buffer of the same index, in parallel; returns whether
/// each differed before. `heads_only`: see [`checks`].
#[pyfunction]
#[pyo3(signature = (sources, dests, heads_only=None))]
pub fn stream_copy(
    py: Python<'_>,
    sources: Vec<Bound<'_, PyAny>>,
    dests: Vec<Bound<'_, PyAny>>,
    heads_only: Option<Vec<bool>>,
) -> PyResult<Vec<bool>> {
    let checks = checks(heads_only);
    let src = sources.iter().map(|b| View::of(b, false)).collect::<PyResult<Vec<_>>>()?;
    let dst = dests.iter().map(|b| View::of(b, true)).collect::<PyResult<Vec<_>>>()?;
    crate::exiting::without_gil(py, || {
        // SAFETY: the views hold their buffers exported for this call; destinations are distinct.
        let s: Vec<&[u8]> = src.iter().map(|v| unsafe { v.bytes() }).collect();
        let mut d: Vec<&mut [u8]> = dst.iter().map(|v| unsafe { v.bytes_mut() }).collect();
        stream::copy_changed(&s, &mut d, &checks)
    })
    .map_err(|e| io_to_py(e, None))
}

/// One tensor of a manifest as Python gives it: (name, dtype, shape, blake3 hex, bytes).
type TensorEntry = (String, String, Vec<u64>, String, u64);

/// Writes the manifest of a version being published at `path`, in the schema the agent reads
/// (`tierstore_core::models::manifest`): its tensors in order, the trainer's step, and the publisher's
/// metadata as a JSON object's text.
#[pyfunction]
#[pyo3(signature = (path, tensors, step, metadata))]
pub fn stream_manifest_write(
    path: PathBuf,
    tensors: Vec<TensorEntry>,
    step: Option<i64>,
    metadata: &str,
) -> PyResult<()> {
    let metadata: serde_json::Value =
        serde_json::from_str(metadata).map_err(|e| PyValueError::new_err(format!("metadata is not JSON: {e}")))?;
    let tensors = tensors
        .into_iter()
        .map(|(name, dtype, shape, hash, nbytes)| Tensor { name, dtype, shape, hash, nbytes })
        .collect();
    let m = Manifest { name: String::new(), version: 0, created: 0.0, step, metadata, tensors };
    m.write(&path).map_err(|e| io_to_py(e, Some(&path.to_string_lossy())))
}

/// The manifest of a version at `path`, checked against the schema, as a JSON object's text.
#[pyfunction]
pub fn stream_manifest_read(path: PathBuf) -> PyResult<String> {
    let m = Manifest::read(&path).map_err(|e| io_to_py(e, Some(&path.to_string_lossy())))?;
    serde_json::to_string(&m).map_err(|e| PyValueError::new_err(e.to_string()))
}
