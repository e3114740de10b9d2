//! Read marks for the ordered prefetch of `tierstore run --order`: the launcher fetches the job's files
//! in order, a byte budget ahead of the reads, and learns of each read from here. An open of a file of
//! the order stores the epoch's tag into its slot of the shared marks file (`$TIERSTORE_ORDER_MARKS`),
//! one atomic store, no system call. The slot of each path comes from the marks' names file, written by
//! the launcher, loaded once per process on the first open under the source.

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

/// Records a read of `rel` (a path relative to the source), if it is a file of the order.
pub fn note_open(rel: &[u8]) {
    if let Some(o) = order() {
        if let Some(&slot) = o.slots.get(rel) {
            o.marks.mark(slot as usize, 1);
        }
    }
}
