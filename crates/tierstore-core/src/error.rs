//! The crate's error: the modules' own errors folded into one small public enum.

use std::path::{Path, PathBuf};

use crate::config::values::ConfigError;
use crate::source::OutsideSource;

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
