//! What the shim keeps for a descriptor of the program's, and the one place it ends: the copy its reads
//! follow while the copy grows (`streams`), and its mark of a read from the store (below). `io`'s
//! `close`, `dup2`, `dup3` and `fclose` and `open`'s `freopen` call [`forget`] as they end or replace a
//! descriptor, and `close_range` and `closefrom` call [`forget_within`]; `open` records the marks.

use libc::c_int;
use tierstore_core::Kept;

use crate::fd_table::FdTable;
use crate::streams;

/// The marks that the program reads a file from the store (no tier had room for it), by its descriptor:
/// kept until the program closes it, so that a prefetch of this node does not read the same bytes again
/// meanwhile (`close`, `dup2`, `dup3`, and `fclose` or `freopen` of a stream `fdopen` made of it, end
/// it, and so do `close_range` and `closefrom` over it). A descriptor closed where the shim does not see
/// it (`fcloseall`, a raw system call) keeps its mark until its number is opened or closed again: at
/// worst a prefetch left undone, never a byte served wrong. (`fopen` takes no mark: its whole-file
/// fetch reads a file no tier has room for from the store unmarked, as a prefetch does.)
static STORE_READS: FdTable<Kept> = FdTable::new();

/// Keeps `mark` until descriptor `fd`, the program's read of a file from the store, ends.
pub(crate) fn mark_store_read(fd: c_int, mark: Kept) {
    STORE_READS.insert(fd, mark);
}

/// What the shim keeps for descriptor `fd` ends, the descriptor closed or replaced.
pub(crate) fn forget(fd: c_int) {
    streams::forget(fd);
    crate::drop_as_shim(STORE_READS.remove(fd)); // one atomic load while the table is empty
}

/// What the shim keeps for the descriptors from `first` to `last` ends, closed together
/// (`close_range`, `closefrom`).
pub(crate) fn forget_within(first: c_int, last: c_int) {
    streams::forget_within(first, last);
    let gone = STORE_READS.remove_within(first, last);
    crate::drop_as_shim((!gone.is_empty()).then_some(gone));
}
