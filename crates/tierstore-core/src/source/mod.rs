//! The source: where the truth lives (a directory on the shared store, or a bucket of an object store).
//! It is never written by the read path, and every request sent to it is counted, because keeping those
//! requests off the shared store is what tierstore is for.
//!
//! # Contract
//!
//! A [`Source`] names its files by a path relative to its root (`rel`: `a/b.bin`, never empty, no `..`),
//! and promises:
//! - **Identity.** [`Source::identify`] returns a [`SourceId`] that differs whenever the bytes may differ:
//!   size, mtime, ctime, inode and device of a POSIX file; size, last-modified and a hash of the ETag of an
//!   object (its `ino` and `dev` carry the hash). Two equal identities mean the same bytes.
//! - **Pinned reads.** [`Source::open`] pins one version of a file; reads through the [`SourceFile`] never
//!   return bytes of another version. A POSIX descriptor pins the inode (a file replaced by rename keeps
//!   serving the old bytes to the holder); an object handle checks every response's identity and fails
//!   with [`io::ErrorKind::Other`] "changed while being read" rather than mix versions.
//! - **Whole and ranged reads.** [`Source::read_at`] reads a range; [`Source::copy`] writes a whole file
//!   into a tier copy in order, reporting progress so that readers can follow it.
//! - **Listing.** [`Source::list`] names the files under a directory (POSIX: one level, with types; an
//!   object store: every key under the prefix); [`Source::identities`] gives the identity of each file
//!   directly in a directory, in as few requests as the store allows, equal to what `identify` says.
//! - **Requests from other nodes** resolve beneath the root: [`PosixSource::open_beneath`] opens a path a
//!   peer named with `openat2(RESOLVE_BENEATH)`, so a symlink never leads such a request out of the
//!   source, while [`Source::open`] (every local open) follows the file system's own rules. An object
//!   store has no symlinks: its keys are what they name.
//! - **Errors** keep their kind (`NotFound`, `PermissionDenied`, `TimedOut`…) and their message names the
//!   file and what to do; no request waits past the source's deadline.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::counters::Counters;
use crate::index::SourceId;

pub mod aws_profile;
#[cfg(feature = "object-store")]
pub mod object;
pub mod posix;
pub mod store_config;
pub mod store_shown;

#[cfg(feature = "object-store")]
pub use object::{ObjectFile, ObjectSource};
pub use posix::{list_dir, normalize, normalized, open_at, open_at_c, open_dir, PosixSource};

/// A source file opened for reading, pinned to one version.
pub enum SourceFile {
    /// A descriptor of a file of a POSIX source.
    Posix(File),
    /// One version of an object (boxed: it holds its first bytes and a read window).
    #[cfg(feature = "object-store")]
    Object(Box<ObjectFile>),
}

impl SourceFile {
    /// The descriptor, when the source is a POSIX directory (programs under `tierstore run` read it).
    pub fn as_file(&self) -> Option<&File> {
        match self {
            SourceFile::Posix(f) => Some(f),
            #[cfg(feature = "object-store")]
            SourceFile::Object(_) => None,
        }
    }

    /// The descriptor, when the source is a POSIX directory.
    pub fn into_file(self) -> Option<File> {
        match self {
            SourceFile::Posix(f) => Some(f),
            #[cfg(feature = "object-store")]
            SourceFile::Object(_) => None,
        }
    }
}

/// One entry of a listing: its path relative to the listed directory and, when the listing says,
/// whether it is a directory (`None`: unknown, as FUSE file systems often leave it).
pub struct ListedEntry {
    /// The name (POSIX: one component) or the key below the listed prefix (an object store).
    pub name: std::ffi::OsString,
    /// `Some(true)` for a directory, `Some(false)` for a file, `None` when the listing does not say.
    pub is_dir: Option<bool>,
}

/// Where a step of a copy failed: reading the source, or writing the tier.
pub enum CopyFault {
    /// The source failed (the copy is abandoned; the reader goes on from the source or fails).
    Source(io::Error),
    /// The tier failed (full, read-only, gone): a cache fault.
    Tier(io::Error),
}

/// A path that lies outside the source.
#[derive(Debug, thiserror::Error)]
#[error(
    "{path} is outside the cached source {source_root}; open it directly, or configure its directory as the source"
)]
pub struct OutsideSource {
    /// The path asked for.
    pub path: PathBuf,
    /// The source directory.
    pub source_root: PathBuf,
}

/// The store a cache reads from (see the module's contract).
pub trait Source: Send + Sync {
    /// The source as configured: a directory, or a URL such as `s3://bucket/prefix`.
    fn root(&self) -> &Path;

    /// The path of `path` relative to the source; relative paths are taken as `open()` takes them (from
    /// the current directory, or from the prefix of an object store).
    fn relative(&self, path: &Path) -> Result<String, OutsideSource>;

    /// Like [`Source::relative`], with the source's root itself as `""`.
    fn relative_or_root(&self, path: &Path) -> Result<String, OutsideSource>;

    /// The full name of a source-relative path, for messages and for programs (a path or a URL).
    fn path_of(&self, rel: &str) -> PathBuf;

    /// The counters of requests sent to the source.
    fn counters(&self) -> &Arc<Counters>;

    /// The identity of a file (one counted request: `stat`, or `HEAD`). A directory is an
    /// `IsADirectory` error.
    fn identify(&self, rel: &str) -> io::Result<SourceId>;

    /// Opens a file for reading, pinned to its current version (one counted request).
    fn open(&self, rel: &str) -> io::Result<SourceFile>;

    /// Opens the version `sid` of a file again, for a reader whose copy failed half way; reads fail rather
    /// than return bytes of another version where the source can tell.
    fn reopen(&self, rel: &str, sid: &SourceId) -> io::Result<SourceFile> {
        let _ = sid;
        self.open(rel)
    }

    /// The identity of a file this process has just opened, and whether it is a directory.
    fn identify_opened(&self, file: &SourceFile, rel: &str) -> io::Result<(SourceId, bool)>;

    /// Reads at `offset` from an opened file (counted).
    fn read_at(&self, file: &SourceFile, buf: &mut [u8], offset: u64) -> io::Result<usize>;

    /// Reads a whole file into memory. Returns the bytes and the file's identity as it was after the read;
    /// the caller publishes only if that identity is the one it reserved for. `pre` is the file when the
    /// caller already opened it.
    fn read_whole(&self, rel: &str, expect: u64, pre: Option<SourceFile>) -> io::Result<(Vec<u8>, SourceId)>;

    /// Copies the whole of `from` (of `size` bytes) into `to`, in order from its start, feeding `hasher`
    /// each step's bytes after they are written (so a piece it reports is already in `to`), and calling `progress` with the bytes copied so far after each step. Returns the bytes copied and
    /// the file's identity after the copy (`None` when it cannot be told).
    fn copy(
        &self,
        from: &SourceFile,
        to: &File,
        size: u64,
        hasher: Option<&mut crate::hash::Pieces<'_>>,
        progress: &mut dyn FnMut(u64),
    ) -> Result<(u64, Option<SourceId>), CopyFault>;

    /// The entries of the directory `rel` (`""` for the root); see the contract.
    fn list(&self, rel: &str) -> io::Result<Vec<ListedEntry>>;

    /// The identity of every file directly in the directory `dir` (`""` for the root), by name, as
    /// [`Source::identify`] would give it: what confirms a directory's cached copies at once
    /// (`revalidate = "<duration>"`). A POSIX store reads the directory and `stat`s its files in
    /// parallel; an object store sends one `LIST` (with the `/` delimiter) per thousand keys.
    fn identities(&self, dir: &str) -> io::Result<Vec<(String, SourceId)>>;

    /// The POSIX source behind this one, for what only a directory on a file system has (descriptors for
    /// programs, directory listings for the shim, symlinks).
    fn posix(&self) -> Option<&PosixSource> {
        None
    }
}
