//! Where members of an elastic job find each other, and where what hashing cannot place is recorded
//! (files produced inside the job, model versions): a small store of members with a time to live and of
//! keys with values.
//!
//! Two implementations pass one conformance suite (`tests/registry.rs`): [`Embedded`], kept by the agent
//! of a one-node job (nothing to install), and [`Redis`], a real server shared by the agents of a job.
//! Every call has a deadline; a registry that fails leaves the agent with what it knew last.

use std::time::Duration;

mod embedded;
mod redis;
mod signed;

pub use embedded::Embedded;
pub use redis::Redis;
pub use signed::Signed;

/// A registry call that failed.
#[derive(Debug, thiserror::Error)]
#[error("registry {at}: {message}")]
pub struct RegistryError {
    /// The registry (its URL, without credentials).
    pub at: String,
    /// What went wrong.
    pub message: String,
}

/// Members with a time to live, and keys with values, of one job.
pub trait Registry: Send + Sync {
    /// Registers `member` (an agent's `host:port`), or renews it, until `ttl` from now.
    fn join(&self, member: &str, ttl: Duration) -> Result<(), RegistryError>;
    /// Removes `member` at once (an agent that stops).
    fn leave(&self, member: &str) -> Result<(), RegistryError>;
    /// The members whose registration has not expired, sorted.
    fn members(&self) -> Result<Vec<String>, RegistryError>;
    /// Sets `key` to `value`, for `ttl` or for good.
    fn put(&self, key: &str, value: &[u8], ttl: Option<Duration>) -> Result<(), RegistryError>;
    /// The value of `key`, if it is set and has not expired.
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, RegistryError>;
    /// Removes `key`; whether it was set.
    fn remove(&self, key: &str) -> Result<bool, RegistryError>;
    /// Entries found in the registry and refused, each counted once: not written with the job's token,
    /// or claiming an end they cannot have (see [`Signed`]). None for a registry that checks nothing.
    fn refused(&self) -> u64 {
        0
    }
}

/// A registry shared with other owners (a test keeps one to write into it as a stranger would).
impl<R: Registry> Registry for std::sync::Arc<R> {
    fn join(&self, member: &str, ttl: Duration) -> Result<(), RegistryError> {
        (**self).join(member, ttl)
    }
    fn leave(&self, member: &str) -> Result<(), RegistryError> {
        (**self).leave(member)
    }
    fn members(&self) -> Result<Vec<String>, RegistryError> {
        (**self).members()
    }
    fn put(&self, key: &str, value: &[u8], ttl: Option<Duration>) -> Result<(), RegistryError> {
        (**self).put(key, value, ttl)
    }
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, RegistryError> {
        (**self).get(key)
    }
    fn remove(&self, key: &str) -> Result<bool, RegistryError> {
        (**self).remove(key)
    }
    fn refused(&self) -> u64 {
        (**self).refused()
    }
}

/// The registry a configuration names (Redis at `url`, or an embedded one), its entries signed and
/// checked with the job's `token` (see [`Signed`]).
pub fn open(url: Option<&str>, job: &str, token: &[u8]) -> Result<Box<dyn Registry>, RegistryError> {
    let inner: Box<dyn Registry> = match url {
        Some(u) => Box::new(Redis::connect(u, job, Duration::from_secs(1))?),
        None => Box::new(Embedded::default()),
    };
    Ok(Box::new(Signed::new(inner, job, token)))
}
