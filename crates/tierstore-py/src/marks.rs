//! A process's mapping of a read-marks file (`tierstore_core::marks`), the one `tierstore.order.ReadMarker`
//! reads and writes through: single marks, and a DataLoader worker's marks a batch at a time
//! (`begin_each`, `begin_then_read_each`, `read_each`) without a Python frame per sample. Under the
//! DataLoader hook every sample is marked begun and read: in Python that was about 1,750 of the 3,300
//! instructions a warm sample costs a worker under `tierstore run` beyond a local read
//! (docs/benchmarks/sample-attribution.md).

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyIterator};
use tierstore_core::marks::{ReadMarks, STARTED};

/// A read-marks file mapped in this process (`tierstore.order.ReadMarker` makes one per process).
#[pyclass(module = "tierstore._core", name = "Marks", frozen)]
pub struct PyMarks {
    marks: Arc<ReadMarks>,
}

/// The slot of dataset index `item` (the index + 1), if it has one: an `int`, or what `int()` makes of
/// anything else (a NumPy or 0-d tensor index), as `ReadMarker` reads indices.
fn slot_of(marks: &ReadMarks, item: &Bound<'_, PyAny>) -> Option<usize> {
    let k: i64 = match item.downcast_exact::<PyInt>() {
        Ok(int) => int.extract().ok()?,
        Err(_) => item.py().get_type::<PyInt>().call1((item,)).ok()?.extract().ok()?,
    };
    let slot = usize::try_from(k).ok()? + 1;
    (slot < marks.len()).then_some(slot)
}

/// A sample's slot (1 or more; slot 0 holds the epoch's tag), or None.
fn sample_slot(slot: i64) -> Option<usize> {
    usize::try_from(slot).ok().filter(|&s| s > 0)
}

#[pymethods]
impl PyMarks {
    #[new]
    fn new(path: PathBuf) -> PyResult<PyMarks> {
        let marks = ReadMarks::open(&path).map_err(|e| PyOSError::new_err(format!("{}: {e}", path.display())))?;
        Ok(PyMarks { marks: Arc::new(marks) })
    }

    fn __len__(&self) -> usize {
        self.marks.len()
    }

    /// What `slot` holds (0 for a slot out of range, negative included).
    fn get(&self, slot: i64) -> u32 {
        usize::try_from(slot).map_or(0, |s| self.marks.get(s))
    }

    /// Stores `tag` into `slot` (out of range: ignored; a reader never fails because of the prefetch).
    fn mark(&self, slot: i64, tag: u32) {
        if let Ok(s) = usize::try_from(slot) {
            self.marks.mark(s, tag);
        }
    }

    /// Stores the current epoch's tag (slot 0) into `slot`, which must be 1 or more: a read of its sample.
    fn mark_read(&self, slot: i64) {
        if let Some(s) = sample_slot(slot) {
            self.marks.mark(s, self.marks.get(0));
        }
    }

    /// Stores the current epoch's tag with the started bit into `slot` (1 or more): its sample begun.
    fn mark_started(&self, slot: i64) {
        if let Some(s) = sample_slot(slot) {
            self.marks.mark(s, self.marks.get(0) | STARTED);
        }
    }

    /// How many slots from `start` on hold `tag`.
    #[pyo3(signature = (tag, start=0))]
    fn count(&self, tag: u32, start: usize) -> usize {
        (start..self.marks.len()).filter(|&s| self.marks.get(s) == tag).count()
    }

    /// Yields each index of `indices`, its slot marked begun (the epoch's tag with the started bit) as it
    /// is yielded; with `then_read`, marked read (the tag) once the next is asked for.
    #[pyo3(signature = (indices, then_read=false))]
    fn begin_each(&self, indices: &Bound<'_, PyAny>, then_read: bool) -> PyResult<BeginEach> {
        let tag = self.marks.get(0);
        Ok(BeginEach { marks: self.marks.clone(), indices: indices.try_iter()?.unbind(), tag, then_read, begun: None })
    }

    /// Marks the slot of each index of `indices` read in the current epoch (the tag in slot 0).
    fn read_each(&self, indices: &Bound<'_, PyAny>) -> PyResult<()> {
        let tag = self.marks.get(0);
        for item in indices.try_iter()? {
            if let Some(slot) = slot_of(&self.marks, &item?) {
                self.marks.mark(slot, tag);
            }
        }
        Ok(())
    }
}

/// The iterator of [`PyMarks::begin_each`].
#[pyclass(module = "tierstore._core")]
pub struct BeginEach {
    marks: Arc<ReadMarks>,
    indices: Py<PyIterator>,
    tag: u32,
    then_read: bool,
    /// The slot last yielded, to mark read when the next is asked for (`then_read`).
    begun: Option<usize>,
}

#[pymethods]
impl BeginEach {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__<'py>(&mut self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        if let Some(slot) = self.begun.take() {
            self.marks.mark(slot, self.tag);
        }
        let Some(item) = self.indices.bind(py).clone().next() else { return Ok(None) };
        let item = item?;
        if let Some(slot) = slot_of(&self.marks, &item) {
            self.marks.mark(slot, self.tag | STARTED);
            self.begun = self.then_read.then_some(slot);
        }
        Ok(Some(item))
    }
}
