//! tierstore-core: a node-local, tiered cache in front of a slow shared store.
//!
//! A [`Cache`] serves files of a source directory from the fastest tier that holds a current copy
//! (RAM, then local disks), fetches each file from the source at most once per node however many threads
//! and processes ask, places copies by policy, and falls back to the source on any cache fault.
//! See `ARCHITECTURE.md` for the design and the papers it comes from.
#![deny(missing_docs)]

pub mod cache;
pub mod cluster;
pub mod config;
pub mod counters;
pub mod flight;
pub mod index;
pub mod lmdb;
pub mod lock;
pub mod marks;
pub mod owners;
pub mod pack;
pub mod placement;
pub mod pool;
pub mod reader;
pub mod remote;
pub mod source;
pub mod stream;
pub mod tier;
pub mod wire;
pub mod writeback;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Once;

static PID: AtomicU32 = AtomicU32::new(0);

extern "C" fn forget_pid() {
    PID.store(0, Ordering::Relaxed);
}

/// The current process id, without a system call on the hot path (glibc no longer caches `getpid`). A
/// fork handler clears the cached value in the child, which then reads its own.
pub fn pid() -> u32 {
    static HANDLER: Once = Once::new();
    HANDLER.call_once(|| {
        // SAFETY: registers a handler that only stores to an atomic, which is async-signal-safe.
        unsafe { libc::pthread_atfork(None, None, Some(forget_pid)) };
    });
    match PID.load(Ordering::Relaxed) {
        0 => {
            let pid = std::process::id();
            PID.store(pid, Ordering::Relaxed);
            pid
        }
        pid => pid,
    }
}

pub use cache::{Cache, Native, PrefetchProgress, SourceStats, Stats, TierStats};
pub use config::{Config, ConfigError, Overrides, Revalidate, TierConfig, TierKind, Verify};
pub use placement::Policy;
pub use reader::{CopyState, Growing, Reader};
pub use source::OutsideSource;

/// Everything that can go wrong, folded from the modules' own errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration value is invalid.
    #[error(transparent)]
    Config(Box<ConfigError>),
    /// A path is not under the source.
    #[error(transparent)]
    OutsideSource(#[from] OutsideSource),
    /// An I/O operation on a file failed (the source's errors keep their kind: not found, permission…).
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A tier cannot be used.
    #[error("cache tier {}: {message}", path.display())]
    Tier {
        /// The tier's directory.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
}

impl From<ConfigError> for Error {
    fn from(e: ConfigError) -> Error {
        Error::Config(Box::new(e))
    }
}

impl Error {
    /// Whether the file does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self, Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
    }

    /// An I/O error on `path`.
    pub fn io(path: &Path, source: std::io::Error) -> Error {
        Error::Io { path: path.to_path_buf(), source }
    }
}
