//! What the ordered prefetches learn from the job's opens.
//!
//! - Read marks for `tierstore run --order`: the launcher fetches the job's files in order, a byte budget
//!   ahead of the reads, and learns of each read from here. An open of a file of the order stores the
//!   epoch's tag into its slot of the shared marks file (`$TIERSTORE_ORDER_MARKS`), one atomic store, no
//!   system call. The slot of each path comes from the marks' names file, written by the launcher, loaded
//!   once per process on the first open under the source.
//! - The files a sample opened, for `tierstore.auto_order`'s learned order: a DataLoader worker starts a
//!   record on its thread before it reads a sample and takes it after
//!   ([`tierstore_preload_record_start`], [`tierstore_preload_record_take`]), so the next epoch can be
//!   prefetched in the sampler's order for a dataset that does not say which files its samples are.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::OnceLock;

use tierstore_core::marks::ReadMarks;

struct Order {
    slots: HashMap<Vec<u8>, u32>,
    marks: ReadMarks,
}

fn order() -> Option<&'static Order> {
    // A forked child keeps both: the mapping is shared, the map is plain memory.
    static ORDER: OnceLock<Option<Order>> = OnceLock::new();
    ORDER
        .get_or_init(|| {
            let path = std::env::var_os("TIERSTORE_ORDER_MARKS")?;
            let marks = ReadMarks::open(std::path::Path::new(&path)).ok()?;
            let names = std::fs::read(marks.names_path()).ok()?;
            let slots = names.split(|&b| b == b'\n').zip(0u32..).map(|(name, slot)| (name.to_vec(), slot)).collect();
            Some(Order { slots, marks })
        })
        .as_ref()
}

thread_local! {
    /// The files this thread opened from the cache since its record started: absolute paths, each ended
    /// by a NUL. None while no record runs (the common case: one borrow per open, nothing kept).
    static RECORD: RefCell<Option<Vec<u8>>> = const { RefCell::new(None) };
}

/// Records a read of the file `abs`, `rel` relative to the source: in the order's marks if it is a file of
/// the order, and in this thread's record if one runs.
pub fn note_open(abs: &[u8], rel: &[u8]) {
    if let Some(o) = order() {
        if let Some(&slot) = o.slots.get(rel) {
            o.marks.mark(slot as usize, 1);
        }
    }
    RECORD.with(|r| {
        if let Some(record) = r.borrow_mut().as_mut() {
            record.extend_from_slice(abs);
            record.push(0);
        }
    });
}

/// Starts a record of the files this thread opens from the cache (dropping one that ran).
#[no_mangle]
pub extern "C" fn tierstore_preload_record_start() {
    RECORD.with(|r| *r.borrow_mut() = Some(Vec::new()));
}

/// Ends this thread's record and copies it into `buf` (`len` bytes): the paths opened, each ended by a
/// NUL. Returns the record's length; when that is more than `len`, nothing is copied and the record goes
/// on, so that the caller can ask again with room enough. 0 when no record ran.
///
/// # Safety
/// `buf` is valid for writes of `len` bytes (or `len` is 0).
#[no_mangle]
pub unsafe extern "C" fn tierstore_preload_record_take(buf: *mut u8, len: usize) -> usize {
    RECORD.with(|r| {
        let mut r = r.borrow_mut();
        let n = r.as_ref().map_or(0, Vec::len);
        if n <= len {
            if let Some(record) = r.take() {
                // SAFETY: the caller gives `len` >= `n` writable bytes at `buf`.
                unsafe { std::ptr::copy_nonoverlapping(record.as_ptr(), buf, n) };
            }
        }
        n
    })
}
