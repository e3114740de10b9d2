//! tierstore-core: a node-local, tiered cache in front of a slow shared store.
//!
//! A [`Cache`] serves files of a source directory from the fastest tier that holds a current copy
//! (RAM, then local disks), fetches each file from the source at most once per node however many threads
//! and processes ask, places copies by policy, and falls back to the source on any cache fault.
//! See `docs/design/architecture.md` for the design and the papers it comes from.
#![deny(missing_docs)]

pub mod cache;
pub mod clock;
pub mod cluster;
pub mod config;
pub mod counters;
pub mod error;
pub mod flock;
pub mod hash;
pub mod index;
pub mod interposer;
pub mod lmdb;
pub mod logging;
pub mod marks;
pub mod models;
pub mod placement;
pub mod private;
pub mod process;
pub mod reader;
pub mod seen;
mod shared_words;
pub mod source;
pub mod sys;
pub mod tier;
pub mod usage;
pub mod writeback;

pub use error::Error;
pub use models::{pack, stream};
pub use process::pid;

pub use cache::{Cache, Native, Parts, PartsServed, PrefetchProgress, SourceStats, Stats, TierStats, PART_BLOCK};
pub use config::{Config, ConfigError, Overrides, Revalidate, TierConfig, TierKind, Verify};
pub use placement::Policy;
pub use reader::{CopyState, Growing, Kept, Piece, Reader};
pub use source::OutsideSource;
