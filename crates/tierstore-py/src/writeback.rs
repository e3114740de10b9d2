//! `tierstore._core.Writeback`: the writers' side of write-back staging (conversions only; the Python
//! API is `tierstore.writeback`).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use tierstore_core::writeback::{Begin, Writeback};

use crate::error::writeback_to_py;

/// Write-back staging of this process (see `tierstore.writeback`).
#[pyclass(name = "Writeback", module = "tierstore._core", frozen)]
pub struct PyWriteback {
    /// A forked child opens its own journals and leaks the inherited ones.
    inner: Mutex<(u32, Arc<Writeback>)>,
}

fn abs(p: &str) -> PathBuf {
    let p = Path::new(p);
    tierstore_core::source::normalize(&std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf()))
}

impl PyWriteback {
    fn get(&self) -> Arc<Writeback> {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let pid = tierstore_core::pid();
        if g.0 != pid {
            let fresh = Arc::new(Writeback::new(g.1.destinations().to_vec()));
            let old = std::mem::replace(&mut *g, (pid, fresh));
            std::mem::forget(old);
        }
        g.1.clone()
    }
}

#[pymethods]
impl PyWriteback {
    /// Loads the `[[writeback]]` configuration (`tierstore.toml`, `$TIERSTORE_CONFIG`,
    /// `$TIERSTORE_WRITEBACK`).
    #[new]
    fn new() -> PyResult<Self> {
        let wb = Writeback::load().map_err(|e| writeback_to_py(e.into()))?;
        Ok(PyWriteback { inner: Mutex::new((tierstore_core::pid(), Arc::new(wb))) })
    }

    /// The destinations: dicts of path, stage, quota, durability, timeout (seconds).
    fn destinations<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.get()
            .destinations()
            .iter()
            .map(|d| {
                let out = PyDict::new(py);
                out.set_item("path", d.path.to_string_lossy())?;
                out.set_item("stage", d.stage.to_string_lossy())?;
                out.set_item("quota", d.quota)?;
                out.set_item("durability", d.durability.name())?;
                out.set_item("timeout", d.timeout.as_secs_f64())?;
                Ok(out)
            })
            .collect()
    }

    /// The destination directory holding `path`, if any.
    fn destination(&self, path: &str) -> Option<String> {
        self.get().destination(&abs(path)).map(|d| d.path.to_string_lossy().into_owned())
    }

    /// Starts a write of `path`: (journal name, staged file path); or, when the stage is full, (None, the
    /// hidden file beside `path` on the store to write, which `finish_through` puts into place).
    fn begin(&self, py: Python<'_>, path: &str) -> PyResult<(Option<String>, String)> {
        let wb = self.get();
        let p = abs(path);
        match crate::exiting::without_gil(py, || wb.begin(&p)).map_err(writeback_to_py)? {
            Begin::Staged { name, path } => Ok((Some(name), path.to_string_lossy().into_owned())),
            Begin::WriteThrough { temp } => Ok((None, temp.to_string_lossy().into_owned())),
        }
    }

    /// Puts the closed file `temp`, written through to the store, into place as `path` (fsync, rename).
    fn finish_through(&self, py: Python<'_>, temp: &str, path: &str) -> PyResult<()> {
        let wb = self.get();
        let (t, p) = (abs(temp), abs(path));
        crate::exiting::without_gil(py, || wb.finish_through(&t, &p)).map_err(writeback_to_py)
    }

    /// Journals the closed staged file `name` of `path` (and waits for the store with remote durability).
    fn commit(&self, py: Python<'_>, path: &str, name: &str) -> PyResult<()> {
        let wb = self.get();
        let p = abs(path);
        crate::exiting::without_gil(py, || wb.commit(&p, name)).map_err(writeback_to_py)
    }

    /// The files pending directly in the directory `path` (not yet on the store): (name, staged copy).
    fn pending_in(&self, path: &str) -> Vec<(String, String)> {
        self.get()
            .pending_in(&abs(path))
            .into_iter()
            .map(|(n, p)| (n.to_string_lossy().into_owned(), p.to_string_lossy().into_owned()))
            .collect()
    }

    /// The staged copy of `path` while it is not on the store yet.
    fn lookup(&self, path: &str) -> Option<String> {
        self.get().lookup(&abs(path)).map(|(p, _)| p.to_string_lossy().into_owned())
    }

    /// A copy of `path` staged on another node (not yet on the store), received whole and checked into a
    /// new file of this node's stage (the caller opens, then deletes it); None when no node holds it.
    fn fetch_staged(&self, py: Python<'_>, path: &str) -> PyResult<Option<String>> {
        let wb = self.get();
        let p = abs(path);
        let got = crate::exiting::without_gil(py, || wb.peer_copy(&p)).map_err(writeback_to_py)?;
        Ok(got.map(|f| f.to_string_lossy().into_owned()))
    }

    /// Moves a pending file in the journal; False when `src` is not pending (rename it on the store).
    fn rename(&self, src: &str, dst: &str) -> PyResult<bool> {
        self.get().rename(&abs(src), &abs(dst)).map_err(writeback_to_py)
    }

    /// Forgets a pending file; False when it was not pending.
    fn remove(&self, path: &str) -> PyResult<bool> {
        self.get().remove(&abs(path)).map_err(writeback_to_py)
    }

    /// Waits until nothing is pending under `path` (every destination when None).
    #[pyo3(signature = (path=None, timeout=None))]
    fn wait(&self, py: Python<'_>, path: Option<&str>, timeout: Option<f64>) -> PyResult<()> {
        let wb = self.get();
        let p = path.map(abs);
        let longest = wb.destinations().iter().map(|d| d.timeout).max().unwrap_or(Duration::from_secs(600));
        let timeout = timeout.map(Duration::from_secs_f64).unwrap_or(longest);
        crate::exiting::without_gil(py, || wb.wait(p.as_deref(), timeout)).map_err(writeback_to_py)
    }

    /// `tierstore sync`: `wait`, refused (a TierstoreError naming the fix) where this
    /// configuration names no destination covering `path`.
    #[pyo3(signature = (path=None, timeout=None))]
    fn sync(&self, py: Python<'_>, path: Option<&str>, timeout: Option<f64>) -> PyResult<()> {
        let wb = self.get();
        let p = path.map(abs);
        let longest = wb.destinations().iter().map(|d| d.timeout).max().unwrap_or(Duration::from_secs(600));
        let timeout = timeout.map(Duration::from_secs_f64).unwrap_or(longest);
        crate::exiting::without_gil(py, || wb.sync(p.as_deref(), timeout)).map_err(writeback_to_py)
    }

    /// What is pending, per destination: dicts of path, stage, files, bytes, oldest (ns since the epoch or
    /// None), errors [(file, attempts, error)].
    #[pyo3(signature = (path=None))]
    fn pending<'py>(&self, py: Python<'py>, path: Option<&str>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let p = path.map(abs);
        let list = self.get().pending(p.as_deref()).map_err(writeback_to_py)?;
        list.into_iter()
            .map(|(d, p)| {
                let out = PyDict::new(py);
                out.set_item("path", d.path.to_string_lossy())?;
                out.set_item("stage", d.stage.to_string_lossy())?;
                out.set_item("files", p.files)?;
                out.set_item("bytes", p.bytes)?;
                out.set_item("oldest_ns", p.oldest_ns)?;
                let errors: Vec<(String, u32, String)> =
                    p.errors.into_iter().map(|(f, n, e)| (f.to_string_lossy().into_owned(), n, e)).collect();
                out.set_item("errors", errors)?;
                Ok(out)
            })
            .collect()
    }
}
