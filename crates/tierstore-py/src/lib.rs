//! Python bindings of tierstore, compiled to `tierstore._core`. Conversions only: the behaviour lives in
//! `tierstore-core`, the Python API is shaped in `python/tierstore`.

mod agent_link;
mod buffer;
mod error;
mod exiting;
mod file;
mod marks;
mod pack;
mod stream;
mod writeback;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use tierstore_core::cache::{OrderedPrefetch, ReadLog};
use tierstore_core::config::settings::{self, Type};
use tierstore_core::{Cache, Config, Overrides, PrefetchProgress};

use crate::error::to_py;

/// A tiered cache of one source directory (see `tierstore.Cache`).
#[pyclass(name = "Cache", module = "tierstore._core", frozen)]
struct PyCache {
    config: Config,
    /// The engine of the process that uses it: a forked child (a DataLoader worker) opens its own, and
    /// leaks the inherited one without closing it (its threads and locks belong to the parent).
    engine: Mutex<(u32, Arc<Cache>)>,
}

fn open_engine(py: Python<'_>, config: &Config) -> PyResult<Arc<Cache>> {
    let config = config.clone();
    crate::exiting::without_gil(py, move || Cache::new(config)).map(Arc::new).map_err(to_py)
}

impl PyCache {
    fn engine(&self, py: Python<'_>) -> PyResult<Arc<Cache>> {
        let mut g = self.engine.lock().unwrap_or_else(|p| p.into_inner());
        let pid = tierstore_core::pid();
        if g.0 != pid {
            let fresh = open_engine(py, &self.config)?;
            let old = std::mem::replace(&mut *g, (pid, fresh));
            std::mem::forget(old);
        }
        Ok(g.1.clone())
    }
}

impl Drop for PyCache {
    fn drop(&mut self) {
        // A forked child (a DataLoader worker) that drops a cache it inherited must not drop the parent's
        // engine: its copy threads and its S3 runtime live in the parent, and joining them here would wait
        // forever or crash. Keep a reference so that it is never freed.
        let g = self.engine.get_mut().unwrap_or_else(|p| p.into_inner());
        if g.0 != tierstore_core::pid() {
            std::mem::forget(g.1.clone());
        }
    }
}

/// A tier as the Python layer passes it: (path, quota or None).
type TierArg<'py> = (Bound<'py, PyAny>, Option<Bound<'py, PyAny>>);

fn path_arg(p: &Bound<'_, PyAny>) -> PyResult<PathBuf> {
    if let Ok(s) = p.downcast::<pyo3::types::PyString>() {
        return Ok(PathBuf::from(s.to_str()?));
    }
    let fspath = p.py().import("os")?.getattr("fspath")?.call1((p,))?;
    if let Ok(s) = fspath.extract::<String>() {
        return Ok(PathBuf::from(s));
    }
    let b: Vec<u8> = fspath.extract()?;
    Ok(PathBuf::from(<std::ffi::OsString as std::os::unix::ffi::OsStringExt>::from_vec(b)))
}

fn size_text(v: &Bound<'_, PyAny>) -> PyResult<String> {
    int_or_text(v, || "a size is an int (bytes) or a string like \"8G\"".to_string())
}

/// An int as its decimal text, or a string as it is; anything else is a `TypeError` saying `what`.
fn int_or_text(v: &Bound<'_, PyAny>, what: impl FnOnce() -> String) -> PyResult<String> {
    if let Ok(n) = v.extract::<i64>() {
        return Ok(n.to_string());
    }
    v.extract::<String>().map_err(|_| PyTypeError::new_err(what()))
}

/// A keyword of `Cache(...)` that gives a top-level setting (`source`, `policy`, `threads`, ...), as the
/// key and the text the file would hold, read by the setting's type.
fn keyword_value(keyword: &str, v: &Bound<'_, PyAny>) -> PyResult<(String, String)> {
    let Some(setting) = settings::top_values().find(|s| s.argument == Some(keyword)) else {
        let known: Vec<&str> = settings::top_values().filter_map(|s| s.argument).collect();
        return Err(PyTypeError::new_err(format!("Cache() has no keyword {keyword:?}; it takes {}", known.join(", "))));
    };
    let text = match setting.ty {
        Type::Path => path_arg(v)?.to_string_lossy().into_owned(),
        Type::Size => size_text(v)?,
        Type::Count { .. } => int_or_text(v, || format!("{keyword}= takes a whole number, like 8"))?,
        _ => v.extract::<String>().map_err(|_| {
            PyTypeError::new_err(format!(
                "{keyword}= takes a string, not {}",
                v.get_type().name().map(|n| n.to_string()).unwrap_or_default()
            ))
        })?,
    };
    Ok((setting.key.to_string(), text))
}

#[pymethods]
impl PyCache {
    #[new]
    #[pyo3(signature = (*, config_file=None, tiers=None, settings=None, s3=None, object_store=None))]
    fn new(
        py: Python<'_>,
        config_file: Option<Bound<'_, PyAny>>,
        tiers: Option<Vec<TierArg<'_>>>,
        settings: Option<BTreeMap<String, Bound<'_, PyAny>>>,
        s3: Option<BTreeMap<String, Bound<'_, PyAny>>>,
        object_store: Option<BTreeMap<String, Bound<'_, PyAny>>>,
    ) -> PyResult<Self> {
        let config = load_config(py, config_file, tiers, settings, s3, object_store)?;
        let engine = open_engine(py, &config)?;
        Ok(PyCache { config, engine: Mutex::new((tierstore_core::pid(), engine)) })
    }

    /// Opens a file under the source for reading.
    fn open(&self, py: Python<'_>, path: &Bound<'_, PyAny>) -> PyResult<file::PyCachedFile> {
        let p = path_arg(path)?;
        let engine = self.engine(py)?;
        let reader = crate::exiting::without_gil(py, || engine.open(&p)).map_err(to_py)?;
        Ok(file::PyCachedFile::new(py, reader, path, &p))
    }

    /// The path of a current cached copy of `path`, or None.
    #[pyo3(signature = (path, validate=true))]
    fn lookup(&self, py: Python<'_>, path: &Bound<'_, PyAny>, validate: bool) -> PyResult<Option<String>> {
        let p = path_arg(path)?;
        let engine = self.engine(py)?;
        let found = crate::exiting::without_gil(py, || engine.lookup(&p, validate)).map_err(to_py)?;
        Ok(found.map(|p| p.to_string_lossy().into_owned()))
    }

    /// A descriptor holding exactly the bytes of `path`, for the caller to own and close: the tier copy
    /// (fetched whole first on a miss, from the owning peer or the source), a private copy a peer sent, or
    /// the source file itself when no tier has room. What the shim hands to programs.
    fn open_file(&self, py: Python<'_>, path: &Bound<'_, PyAny>) -> PyResult<i32> {
        use std::os::fd::IntoRawFd;
        let p = path_arg(path)?;
        let engine = self.engine(py)?;
        let file = crate::exiting::without_gil(py, || engine.open_file(&p)).map_err(to_py)?;
        Ok(file.into_raw_fd())
    }

    /// Reads `(offset, destination buffer, expected hash or None)` requests of the pack `path` through the
    /// cache, each as soon as its bytes are there (a copy still arriving is read as it grows), checking
    /// the hashes; raises `IntegrityError` as `read_into` does. `pack_hash`: the blake3 of the whole pack
    /// (32 bytes), which spares hashing each tensor of a copy the cache hashed whole as it made it for this
    /// read; True when it did (see `pack::read_into_cached`).
    #[pyo3(signature = (path, requests, pack_hash=None))]
    fn read_into(
        &self,
        py: Python<'_>,
        path: &Bound<'_, PyAny>,
        requests: Vec<pack::Request<'_>>,
        pack_hash: Option<Vec<u8>>,
    ) -> PyResult<bool> {
        let p = path_arg(path)?;
        let engine = self.engine(py)?;
        pack::read_into_cached(py, &engine, p, requests, pack_hash)
    }

    /// The blake3 (32 bytes) the cache recorded when it made the tier copy that the descriptor `fd` is,
    /// the published copy of `path`, if it recorded one and made the copy at `since_ns` (ns since the
    /// epoch, `time.time_ns()`) or later; None otherwise (see `tierstore_core::Cache::hash_of_new_copy`).
    fn hash_of_new_copy<'py>(
        &self,
        py: Python<'py>,
        path: &Bound<'py, PyAny>,
        fd: i32,
        since_ns: u64,
    ) -> PyResult<Option<Bound<'py, pyo3::types::PyBytes>>> {
        use std::os::fd::FromRawFd;
        let p = path_arg(path)?;
        let engine = self.engine(py)?;
        if fd < 0 {
            return Err(pyo3::exceptions::PyValueError::new_err(format!("{fd} is not a descriptor")));
        }
        // SAFETY: the caller's descriptor, borrowed for the call and never closed here (ManuallyDrop); one
        // that is not open fails the `fstat` and gives None.
        let file = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(fd) });
        let hash = crate::exiting::without_gil(py, || engine.hash_of_new_copy(&p, &file, since_ns)).map_err(to_py)?;
        Ok(hash.map(|h| pyo3::types::PyBytes::new(py, &h)))
    }

    /// Reads `(offset, destination buffer, expected hash or None)` requests of the pack `path` as parts
    /// from the agent of the node that owns it, checking the hashes (raises `IntegrityError`, after
    /// telling the owner). False when no owner could serve them (no cluster, or it failed): read the store.
    fn read_parts(&self, py: Python<'_>, path: &Bound<'_, PyAny>, requests: Vec<pack::Request<'_>>) -> PyResult<bool> {
        let p = path_arg(path)?;
        let engine = self.engine(py)?;
        pack::read_parts(py, &engine, p, requests)
    }

    /// `map_pack`'s `(offset, length, expected hash or None)` spans of the pack `path` as parts from the
    /// agent of the node that owns it: a `PackMap` of private memory holding the spans, checked; None when
    /// no owner could serve them.
    fn map_parts(
        &self,
        py: Python<'_>,
        path: &Bound<'_, PyAny>,
        spans: Vec<(u64, usize, Option<Vec<u8>>)>,
    ) -> PyResult<Option<PyObject>> {
        let p = path_arg(path)?;
        let engine = self.engine(py)?;
        pack::map_parts(py, &engine, p, spans)
    }

    /// Forgets every cached copy of `path` (it was found damaged, or changed through the source).
    fn invalidate(&self, py: Python<'_>, path: &Bound<'_, PyAny>) -> PyResult<()> {
        let p = path_arg(path)?;
        let engine = self.engine(py)?;
        crate::exiting::without_gil(py, || engine.invalidate(&p)).map_err(to_py)
    }

    /// Every file under `path` (a directory, an object store prefix), by its full name, sorted.
    fn list_files(&self, py: Python<'_>, path: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
        let p = path_arg(path)?;
        let engine = self.engine(py)?;
        let found = crate::exiting::without_gil(py, || engine.list_files(&p)).map_err(to_py)?;
        Ok(found.into_iter().map(|p| p.to_string_lossy().into_owned()).collect())
    }

    /// Starts warming the cache with files and directories, `jobs` files at a time (the core's default
    /// when None); returns a progress handle.
    #[pyo3(signature = (paths, jobs=None))]
    fn prefetch(&self, py: Python<'_>, paths: Vec<Bound<'_, PyAny>>, jobs: Option<usize>) -> PyResult<PyPrefetch> {
        let paths = paths.iter().map(path_arg).collect::<PyResult<Vec<_>>>()?;
        let engine = self.engine(py)?;
        let jobs = jobs.unwrap_or(tierstore_core::cache::DEFAULT_PREFETCH_JOBS);
        let progress = crate::exiting::without_gil(py, || engine.prefetch_with(&paths, jobs)).map_err(to_py)?;
        Ok(PyPrefetch { progress })
    }

    /// Starts fetching `paths`, each the name of one file (an object, on an object store: never listed as
    /// a prefix), `jobs` at a time; returns a progress handle. With `expected_size`, room for that many
    /// bytes is held before each file is opened, and a file no tier has room for is left unopened.
    #[pyo3(signature = (paths, jobs=None, expected_size=None))]
    fn prefetch_files(
        &self,
        py: Python<'_>,
        paths: Vec<Bound<'_, PyAny>>,
        jobs: Option<usize>,
        expected_size: Option<u64>,
    ) -> PyResult<PyPrefetch> {
        let paths = paths.iter().map(path_arg).collect::<PyResult<Vec<_>>>()?;
        let engine = self.engine(py)?;
        let jobs = jobs.unwrap_or(tierstore_core::cache::DEFAULT_PREFETCH_JOBS);
        let progress =
            crate::exiting::without_gil(py, || engine.prefetch_files(&paths, jobs, expected_size)).map_err(to_py)?;
        Ok(PyPrefetch { progress })
    }

    /// Whether a tier has room for `size` more bytes now; nothing is reserved.
    fn has_room(&self, py: Python<'_>, size: u64) -> PyResult<bool> {
        let engine = self.engine(py)?;
        Ok(crate::exiting::without_gil(py, || engine.has_room(size)))
    }

    /// Lets go of the cached copy of `path` for room, unless a fetch of it is under way; the bytes freed.
    fn let_go(&self, py: Python<'_>, path: &Bound<'_, PyAny>) -> PyResult<u64> {
        let p = path_arg(path)?;
        let engine = self.engine(py)?;
        crate::exiting::without_gil(py, || engine.let_go(&p)).map_err(to_py)
    }

    /// Starts fetching `paths` in order, `budget` bytes ahead of their reads, `jobs` files at a time. Reads
    /// are recorded as `reads` says, `(marks file, slot of each position, value)`, or, without it, in a
    /// new marks file with one slot per distinct path.
    #[pyo3(signature = (paths, budget, jobs=None, reads=None))]
    fn prefetch_order(
        &self,
        py: Python<'_>,
        paths: Vec<Bound<'_, PyAny>>,
        budget: u64,
        jobs: Option<usize>,
        reads: Option<(Bound<'_, PyAny>, Vec<u32>, u32)>,
    ) -> PyResult<PyOrderPrefetch> {
        let paths = paths.iter().map(path_arg).collect::<PyResult<Vec<_>>>()?;
        let reads = reads.map(|(marks, slots, tag)| path_arg(&marks).map(|m| (m, slots, tag))).transpose()?;
        let engine = self.engine(py)?;
        let jobs = jobs.unwrap_or(tierstore_core::cache::DEFAULT_PREFETCH_JOBS);
        let handle = crate::exiting::without_gil(py, || {
            let log = match reads {
                None => None,
                Some((m, slots, tag)) => {
                    let opened =
                        tierstore_core::marks::ReadMarks::open(&m).map_err(|e| tierstore_core::Error::io(&m, e))?;
                    Some(ReadLog { marks: Arc::new(opened), slots, tag })
                }
            };
            engine.prefetch_order(&paths, budget, jobs, log)
        })
        .map_err(to_py)?;
        Ok(PyOrderPrefetch { handle })
    }

    /// The files `paths` made ready for the ordered prefetches of a loader's epochs (`prefetch_in_order`):
    /// each made relative to the source and keyed once; numbered in the order given.
    fn order_files(&self, py: Python<'_>, paths: Vec<Bound<'_, PyAny>>) -> PyResult<PyOrderFiles> {
        let paths = paths.iter().map(path_arg).collect::<PyResult<Vec<_>>>()?;
        let engine = self.engine(py)?;
        let files = crate::exiting::without_gil(py, || engine.order_files(&paths)).map_err(to_py)?;
        Ok(PyOrderFiles { files })
    }

    /// Starts fetching the files of `files` numbered in `order`, in that order, `budget` bytes ahead of
    /// their reads, `jobs` files at a time. Reads are recorded as `reads` says, `(marks file, value)`, the
    /// slot of each position being its file's number + 1 (slot 0 holds the epoch's tag: a loader's layout,
    /// one slot per dataset index).
    #[pyo3(signature = (files, order, budget, reads, jobs=None))]
    fn prefetch_in_order(
        &self,
        py: Python<'_>,
        files: &PyOrderFiles,
        order: Vec<u32>,
        budget: u64,
        reads: (Bound<'_, PyAny>, u32),
        jobs: Option<usize>,
    ) -> PyResult<PyOrderPrefetch> {
        let (marks, tag) = (path_arg(&reads.0)?, reads.1);
        let engine = self.engine(py)?;
        let jobs = jobs.unwrap_or(tierstore_core::cache::DEFAULT_PREFETCH_JOBS);
        let files = files.files.clone();
        let handle = crate::exiting::without_gil(py, || {
            let opened =
                tierstore_core::marks::ReadMarks::open(&marks).map_err(|e| tierstore_core::Error::io(&marks, e))?;
            let slots = order.iter().map(|&f| f.saturating_add(1)).collect();
            let log = ReadLog { marks: Arc::new(opened), slots, tag };
            engine.prefetch_in_order(files, order, budget, jobs, Some(log))
        })
        .map_err(to_py)?;
        Ok(PyOrderPrefetch { handle })
    }

    /// The directory of the read-marks files (see `create_read_marks`); it may not exist yet.
    fn order_dir(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.engine(py)?.order_dir().to_string_lossy().into_owned())
    }

    /// Creates a read-marks file of `slots` slots next to the node's cache state; returns its path.
    fn create_read_marks(&self, py: Python<'_>, slots: usize) -> PyResult<String> {
        let engine = self.engine(py)?;
        let marks = crate::exiting::without_gil(py, || engine.read_marks(slots)).map_err(to_py)?;
        // The caller removes it when its readers are done.
        Ok(marks.keep().to_string_lossy().into_owned())
    }

    /// Blocks until queued copies are published.
    fn wait_idle(&self, py: Python<'_>) -> PyResult<()> {
        let engine = self.engine(py)?;
        crate::exiting::without_gil(py, || engine.wait_idle());
        Ok(())
    }

    /// Copies queued or running.
    fn pending_copies(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.engine(py)?.pending_copies())
    }

    /// All counters, node-wide.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let engine = self.engine(py)?;
        let s = crate::exiting::without_gil(py, || engine.stats());
        let out = PyDict::new(py);
        let src = PyDict::new(py);
        src.set_item("opens", s.source.opens)?;
        src.set_item("stats", s.source.stats)?;
        src.set_item("reads", s.source.reads)?;
        src.set_item("bytes_read", s.source.bytes_read)?;
        src.set_item("fallbacks", s.source.fallbacks)?;
        src.set_item("uncached", s.source.uncached)?;
        src.set_item("peer_hits", s.source.peer_hits)?;
        src.set_item("peer_bytes", s.source.peer_bytes)?;
        src.set_item("peer_faults", s.source.peer_faults)?;
        src.set_item("served_files", s.source.served_files)?;
        src.set_item("served_bytes", s.source.served_bytes)?;
        src.set_item("lists", s.source.lists)?;
        src.set_item("path", self.config.source.to_string_lossy())?;
        out.set_item("source", src)?;
        let tiers = PyList::empty(py);
        for t in s.tiers {
            let d = PyDict::new(py);
            d.set_item("path", t.path.to_string_lossy())?;
            d.set_item("kind", t.kind)?;
            d.set_item("quota", t.quota)?;
            d.set_item("hits", t.hits)?;
            d.set_item("misses", t.misses)?;
            d.set_item("bytes_served", t.bytes_served)?;
            d.set_item("entries", t.usage.entries)?;
            d.set_item("bytes_used", t.usage.used)?;
            d.set_item("in_flight", t.usage.pending)?;
            d.set_item("evictions", t.evictions)?;
            d.set_item("faults", t.faults)?;
            d.set_item("inserts", t.inserts)?;
            d.set_item("bytes_written", t.bytes_written)?;
            d.set_item("error", t.error)?;
            tiers.append(d)?;
        }
        out.set_item("tiers", tiers)?;
        Ok(out)
    }

    /// Sets every counter to zero (node-wide).
    fn reset_counters(&self, py: Python<'_>) -> PyResult<()> {
        self.engine(py)?.reset_counters();
        Ok(())
    }

    /// Removes every cached copy of this source.
    fn clear(&self, py: Python<'_>) -> PyResult<()> {
        let engine = self.engine(py)?;
        crate::exiting::without_gil(py, || engine.clear()).map_err(to_py)
    }

    /// The effective configuration: {key: (value, origin)}.
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        config_dict(py, &self.config)
    }

    /// The source directory.
    #[getter]
    fn source(&self) -> String {
        self.config.source.to_string_lossy().into_owned()
    }

    /// Environment variables that let processes started for this cache (`tierstore run`) take the
    /// source as this process resolved it, instead of asking the store again.
    fn resolved_env(&self) -> Vec<(String, String)> {
        self.config.resolved_env().into_iter().map(|(k, v)| (k.to_string(), v.to_string_lossy().into_owned())).collect()
    }
}

/// The configuration `Cache(...)` would open with: every keyword becomes the key the file would write,
/// read by the same code as the file's.
fn load_config(
    py: Python<'_>,
    config_file: Option<Bound<'_, PyAny>>,
    tiers: Option<Vec<TierArg<'_>>>,
    settings: Option<BTreeMap<String, Bound<'_, PyAny>>>,
    s3: Option<BTreeMap<String, Bound<'_, PyAny>>>,
    object_store: Option<BTreeMap<String, Bound<'_, PyAny>>>,
) -> PyResult<Config> {
    let mut overrides =
        Overrides { config_file: config_file.as_ref().map(path_arg).transpose()?, ..Default::default() };
    if let Some(list) = tiers {
        let tiers = list
            .iter()
            .map(|(p, q)| Ok((path_arg(p)?.to_string_lossy().into_owned(), q.as_ref().map(size_text).transpose()?)))
            .collect::<PyResult<Vec<_>>>()?;
        overrides = overrides.with_tiers(&tiers);
    }
    for (key, table) in [("s3", s3), ("object_store", object_store)] {
        let Some(table) = table else { continue };
        let values = table.into_iter().map(|(k, v)| Ok((k, toml::Value::String(v.str()?.to_string()))));
        overrides = overrides.with_value(key, toml::Value::Table(values.collect::<PyResult<_>>()?));
    }
    for (keyword, v) in settings.unwrap_or_default() {
        let (key, text) = keyword_value(&keyword, &v)?;
        overrides = overrides.with(&key, text);
    }
    crate::exiting::without_gil(py, || Config::load(&overrides).map_err(tierstore_core::Error::from)).map_err(to_py)
}

/// The effective configuration of `Cache(...)` with these arguments, `{key: (value, origin)}`, without
/// opening the cache: no store is asked, no credential printed and no job token made (`tierstore config
/// show`); the configuration's own checks still make each tier's private directory.
#[pyfunction]
#[pyo3(signature = (*, config_file=None, tiers=None, settings=None, s3=None, object_store=None))]
fn effective_config<'py>(
    py: Python<'py>,
    config_file: Option<Bound<'py, PyAny>>,
    tiers: Option<Vec<TierArg<'py>>>,
    settings: Option<BTreeMap<String, Bound<'py, PyAny>>>,
    s3: Option<BTreeMap<String, Bound<'py, PyAny>>>,
    object_store: Option<BTreeMap<String, Bound<'py, PyAny>>>,
) -> PyResult<Bound<'py, PyDict>> {
    config_dict(py, &load_config(py, config_file, tiers, settings, s3, object_store)?)
}

/// A configuration as `{key: (value, origin)}`, what `Cache.config()` and `effective_config` return.
fn config_dict<'py>(py: Python<'py>, c: &Config) -> PyResult<Bound<'py, PyDict>> {
    use tierstore_core::config::settings::{Table, SETTINGS};
    use tierstore_core::config::Shown;
    let out = PyDict::new(py);
    let origin = |k: &str| origin_of(c, k);
    // The settings of the top of the file, in the table's order: each value as `Config::shown` gives it,
    // each section as its own builder does.
    for setting in SETTINGS.iter().filter(|s| s.table == Table::Top) {
        let key = setting.key;
        match key {
            "tiers" => out.set_item(key, (tiers_list(py, c)?, origin(key)))?,
            "cluster" => out.set_item(key, (cluster_dict(py, c)?, origin(key)))?,
            "object_store" => {
                if let Some(store) = &c.object_store {
                    out.set_item(key, store_dict(py, store)?)?;
                }
            }
            // The older name of `object_store`, shown under it; write-back and streams have their own
            // APIs (`Writeback.destinations()`, the stream's connection).
            "s3" | "writeback" | "stream" => {}
            _ => match c.shown(key) {
                Some(Shown::Text(text)) => out.set_item(key, (text, origin(key)))?,
                Some(Shown::Count(n)) => out.set_item(key, (n, origin(key)))?,
                // Every value of the top has one (`every_value_at_the_top_of_the_file_is_shown`).
                None => {}
            },
        }
    }
    Ok(out)
}

/// Where the configuration's value of `key` came from, as `config()` says it (`default` when unset).
fn origin_of(c: &Config, key: &str) -> String {
    c.origins.get(key).map_or_else(|| "default".into(), |o| o.to_string())
}

/// The tiers as `config()` shows them: path, quota in bytes, kind.
fn tiers_list<'py>(py: Python<'py>, c: &Config) -> PyResult<Bound<'py, PyList>> {
    let tiers = PyList::empty(py);
    for t in &c.tiers {
        let d = PyDict::new(py);
        d.set_item("path", t.path.to_string_lossy())?;
        d.set_item("quota", t.quota)?;
        d.set_item("kind", t.kind.name())?;
        tiers.append(d)?;
    }
    Ok(tiers)
}

/// The cluster as `config()` shows it: sharing, members, this node, the agents' port and listen address,
/// the token file, encryption, the registry and the job, and where each came from.
fn cluster_dict<'py>(py: Python<'py>, c: &Config) -> PyResult<Bound<'py, PyDict>> {
    let cluster = PyDict::new(py);
    cluster.set_item("sharing", c.cluster.sharing.name())?;
    cluster.set_item("members", c.cluster.members.iter().map(|m| m.address()).collect::<Vec<_>>())?;
    cluster.set_item("port", c.cluster.port)?;
    cluster.set_item("listen", &c.cluster.listen)?;
    cluster.set_item("token_file", c.cluster.token_file.as_ref().map(|p| p.to_string_lossy().into_owned()))?;
    cluster.set_item("encrypt", c.cluster.encrypt)?;
    cluster.set_item("registry", c.cluster.registry.as_deref())?;
    cluster.set_item("job", &c.cluster.job)?;
    cluster.set_item("node", c.cluster.my_address())?;
    let origins = PyDict::new(py);
    for key in ["peers", "node", "registry", "job", "token_file", "encrypt", "port", "listen"] {
        origins.set_item(key, origin_of(c, &format!("cluster.{key}")))?;
    }
    cluster.set_item("origins", origins)?;
    Ok(cluster)
}

/// An object store's settings as `config show` prints them (`StoreConfig::shown`): `({key: value, ...,
/// "origins": {key: where}}, where the table came from)`, secrets as "set" or "not set".
fn store_dict<'py>(
    py: Python<'py>,
    store: &tierstore_core::source::store_config::StoreConfig,
) -> PyResult<(Bound<'py, PyDict>, String)> {
    let shown = store.shown();
    let (values, origins) = (PyDict::new(py), PyDict::new(py));
    for s in &shown.settings {
        match &s.value {
            serde_json::Value::Number(n) => values.set_item(&s.key, n.as_u64())?,
            serde_json::Value::String(text) => values.set_item(&s.key, text)?,
            other => values.set_item(&s.key, other.to_string())?,
        }
        origins.set_item(&s.key, &s.origin)?;
    }
    values.set_item("origins", origins)?;
    Ok((values, shown.came_from))
}

/// Progress of a prefetch.
#[pyclass(name = "Prefetch", module = "tierstore._core", frozen)]
struct PyPrefetch {
    progress: Arc<PrefetchProgress>,
}

#[pymethods]
impl PyPrefetch {
    /// Counts so far: files and bytes total and done, files copied and failed, the first error and every
    /// error (each naming its file).
    fn progress<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        use std::sync::atomic::Ordering::Relaxed;
        let p = &self.progress;
        let d = PyDict::new(py);
        d.set_item("files_total", p.files_total.load(Relaxed))?;
        d.set_item("files_done", p.files_done.load(Relaxed))?;
        d.set_item("bytes_total", p.bytes_total.load(Relaxed))?;
        d.set_item("bytes_done", p.bytes_done.load(Relaxed))?;
        d.set_item("files_copied", p.files_copied.load(Relaxed))?;
        d.set_item("files_failed", p.files_failed.load(Relaxed))?;
        d.set_item("files_no_room", p.files_no_room.load(Relaxed))?;
        d.set_item("first_error", p.first_error.lock().unwrap_or_else(|e| e.into_inner()).clone())?;
        d.set_item("errors", p.errors())?;
        Ok(d)
    }

    /// True when the walk is over and every file is handled.
    #[getter]
    fn done(&self) -> bool {
        self.progress.finished()
    }
}

/// Files made ready for a loader's ordered prefetches (see `Cache.order_files`).
#[pyclass(name = "OrderFiles", module = "tierstore._core", frozen)]
struct PyOrderFiles {
    files: Arc<tierstore_core::cache::OrderFiles>,
}

#[pymethods]
impl PyOrderFiles {
    fn __len__(&self) -> usize {
        self.files.len()
    }
}

/// A running ordered prefetch (see `tierstore.Cache.prefetch_order`).
#[pyclass(name = "OrderPrefetch", module = "tierstore._core", frozen)]
struct PyOrderPrefetch {
    handle: OrderedPrefetch,
}

#[pymethods]
impl PyOrderPrefetch {
    /// Counts so far: files total, done, fetched, already cached, read first, failed; bytes fetched and
    /// ahead of the readers (now and at most); the read position; every error.
    fn progress<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        use std::sync::atomic::Ordering::Relaxed;
        let p = self.handle.progress();
        let d = PyDict::new(py);
        d.set_item("files_total", p.files_total.load(Relaxed))?;
        d.set_item("files_done", p.files_done.load(Relaxed))?;
        d.set_item("files_fetched", p.files_fetched.load(Relaxed))?;
        d.set_item("bytes_fetched", p.bytes_fetched.load(Relaxed))?;
        d.set_item("files_cached", p.files_cached.load(Relaxed))?;
        d.set_item("files_read_first", p.files_read_first.load(Relaxed))?;
        d.set_item("files_failed", p.files_failed.load(Relaxed))?;
        d.set_item("files_no_room", p.files_no_room.load(Relaxed))?;
        d.set_item("bytes_ahead", p.bytes_ahead.load(Relaxed))?;
        d.set_item("max_bytes_ahead", p.max_bytes_ahead.load(Relaxed))?;
        d.set_item("position", p.position.load(Relaxed))?;
        d.set_item("errors", p.errors())?;
        Ok(d)
    }

    /// True when every worker has left.
    #[getter]
    fn done(&self) -> bool {
        self.handle.progress().finished()
    }

    /// The marks file readers in other processes record their reads in.
    #[getter]
    fn marks_path(&self) -> String {
        self.handle.marks_path().to_string_lossy().into_owned()
    }

    /// Records that the file at `position` was read.
    fn mark_read(&self, position: usize) {
        self.handle.mark_read(position);
    }

    /// Records that every file before `position` was read.
    fn advance(&self, position: usize) {
        self.handle.advance(position);
    }

    /// Stops taking new files.
    fn stop(&self) {
        self.handle.stop();
    }

    /// Waits until every worker has left (at most `timeout` seconds); returns whether they have.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> bool {
        let t = timeout.map(|s| std::time::Duration::from_secs_f64(s.max(0.0)));
        crate::exiting::without_gil(py, || self.handle.wait(t))
    }
}

/// Parses a size ("8G", "512MiB", "4096") into bytes; None if it is not one.
/// The owner of each of `rels` among `members` (as `host:port`) not in `down`, by the agents' own
/// rendezvous hashing (what the cluster simulator predicts with); `None` where every member is down.
#[pyfunction]
#[pyo3(signature = (members, rels, down = Vec::new()))]
fn owners(py: Python<'_>, members: Vec<String>, rels: Vec<String>, down: Vec<String>) -> Vec<Option<String>> {
    crate::exiting::without_gil(py, || {
        let o = tierstore_core::cluster::owners::Owners::new(&members);
        let names = o.members();
        let out: Vec<bool> = names.iter().map(|n| down.contains(n)).collect();
        rels.iter().map(|r| o.owner(r.as_bytes(), |m| !out[m]).map(|m| names[m].clone())).collect()
    })
}

#[pyfunction]
fn parse_size(text: &str) -> Option<u64> {
    tierstore_core::config::parse_size(text)
}

/// Whether an object store setting's value is a secret, shown only as "set" (`config show`).
#[pyfunction]
fn is_secret(key: &str) -> bool {
    tierstore_core::source::store_config::is_secret(key)
}

/// Sets this process's log level (`tierstore -v`); the processes it starts take `$TIERSTORE_LOG`.
#[pyfunction]
fn set_log_level(level: &str) -> PyResult<()> {
    let level = tierstore_core::logging::parse(level).map_err(pyo3::exceptions::PyValueError::new_err)?;
    log::set_max_level(level);
    Ok(())
}

/// Makes `path` a directory of this user's own (0700), or checks that it is one (`tierstore_core::private`).
#[pyfunction]
fn private_dir(path: std::path::PathBuf) -> PyResult<()> {
    tierstore_core::private::ensure_dir(&path).map(drop).map_err(|e| error::io_to_py(e, None))
}

/// The Unix socket of this user's agent when none is given (`tierstore_core::cluster::default_socket`):
/// one rule for the agent, the core and Python.
#[pyfunction]
fn default_socket() -> std::path::PathBuf {
    tierstore_core::cluster::default_socket()
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    tierstore_core::logging::init();
    // Under `tierstore run` the shim is loaded in this process too: keep this engine's file calls from it.
    tierstore_core::interposer::find();
    m.add_class::<PyCache>()?;
    m.add_class::<file::PyCachedFile>()?;
    m.add_class::<PyPrefetch>()?;
    m.add_class::<PyOrderPrefetch>()?;
    m.add_class::<PyOrderFiles>()?;
    m.add_class::<marks::PyMarks>()?;
    m.add_class::<marks::BeginEach>()?;
    m.add_function(wrap_pyfunction!(effective_config, m)?)?;
    m.add_function(wrap_pyfunction!(parse_size, m)?)?;
    m.add_function(wrap_pyfunction!(is_secret, m)?)?;
    m.add_function(wrap_pyfunction!(private_dir, m)?)?;
    m.add_function(wrap_pyfunction!(default_socket, m)?)?;
    m.add_function(wrap_pyfunction!(set_log_level, m)?)?;
    m.add_function(wrap_pyfunction!(exiting::interpreter_exiting, m)?)?;
    m.add_function(wrap_pyfunction!(owners, m)?)?;
    m.add_class::<pack::PyPackWriter>()?;
    m.add_function(wrap_pyfunction!(pack::hash_buffers, m)?)?;
    m.add_function(wrap_pyfunction!(pack::read_into, m)?)?;
    m.add_function(wrap_pyfunction!(pack::map_pack, m)?)?;
    m.add_function(wrap_pyfunction!(pack::verify_pack, m)?)?;
    m.add_function(wrap_pyfunction!(pack::model_manifest_read, m)?)?;
    m.add_function(wrap_pyfunction!(pack::model_manifest_write, m)?)?;
    m.add("REPOSITORY_FORMAT", tierstore_core::models::manifest::REPOSITORY_FORMAT)?;
    m.add("PackMap", buffer::pack_map_type(m.py())?)?;
    m.add_function(wrap_pyfunction!(stream::stream_place, m)?)?;
    m.add_function(wrap_pyfunction!(stream::stream_read, m)?)?;
    m.add_function(wrap_pyfunction!(stream::stream_copy, m)?)?;
    m.add_function(wrap_pyfunction!(stream::stream_manifest_write, m)?)?;
    m.add_function(wrap_pyfunction!(stream::stream_manifest_read, m)?)?;
    m.add_class::<writeback::PyWriteback>()?;
    m.add_class::<agent_link::PyAgentLink>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("DEFAULT_PREFETCH_JOBS", tierstore_core::cache::DEFAULT_PREFETCH_JOBS)?;
    m.add("MAX_PREFETCH_JOBS", tierstore_core::cache::MAX_PREFETCH_JOBS)?;
    // Every setting, declared once in Rust (`config/settings.rs`): what the Python side maps, offers and
    // documents is read from here. The `[s3]` keys, tierstore's own `[object_store]` keys and their
    // defaults are views of it, for `config show`.
    use tierstore_core::config::settings::Table;
    m.add("SETTINGS", settings_table(m.py())?)?;
    let keywords: Vec<&str> = settings::top_values().filter_map(|s| s.argument).collect();
    m.add("VALUE_KEYWORDS", pyo3::types::PyTuple::new(m.py(), keywords)?)?;
    m.add("STORE_KEYS", pyo3::types::PyTuple::new(m.py(), settings::keys_of(Table::ObjectStore))?)?;
    error::register(m)
}

/// `_core.SETTINGS`: each setting of `config/settings.rs` as a dict (`table`, `key`, `name`, `type`,
/// `choices`, `bounds`, `default`, `default_text`, `env`, `argument`, `flag`, `doc`), in the table's order.
fn settings_table(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyTuple>> {
    use tierstore_core::config::settings::{DefaultIs, SETTINGS};
    let mut rows = Vec::with_capacity(SETTINGS.len());
    for s in SETTINGS {
        let d = PyDict::new(py);
        d.set_item("table", s.table.name())?;
        d.set_item("key", s.key)?;
        d.set_item("name", s.name())?;
        d.set_item("type", s.ty.name())?;
        d.set_item("choices", if let Type::Choice(words) = s.ty { Some(words.to_vec()) } else { None })?;
        d.set_item("bounds", if let Type::Count { min, max } = s.ty { Some((min, max)) } else { None })?;
        let (value, text) = match s.default {
            DefaultIs::Value(v) => (Some(v), Some(v)),
            DefaultIs::Derived(how) => (None, Some(how)),
            DefaultIs::Unset => (None, None),
        };
        d.set_item("default", value)?;
        d.set_item("default_text", text)?;
        d.set_item("env", s.env)?;
        d.set_item("argument", s.argument)?;
        d.set_item("flag", s.flag)?;
        d.set_item("doc", s.doc)?;
        rows.push(d);
    }
    pyo3::types::PyTuple::new(py, rows)
}
