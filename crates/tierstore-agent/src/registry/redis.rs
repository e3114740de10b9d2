//! The registry of an elastic job: a Redis server every agent of the job reaches.
//!
//! Keys are under `tierstore:{job}:`. Members are a sorted set scored by their expiry in milliseconds
//! since the epoch, so a reader drops expired ones and lists the rest in one round trip; values are plain
//! keys with Redis's own expiry. One connection, reopened after a failure; a connect, read or write that
//! takes longer than the deadline fails the call.

use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redis::{Client, Connection};

use super::{Registry, RegistryError};

/// A job's registry on a Redis server.
pub struct Redis {
    client: Client,
    /// The URL without credentials, for messages.
    at: String,
    prefix: String,
    deadline: Duration,
    connection: Mutex<Option<Connection>>,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64
}

impl Redis {
    /// The registry of `job` on the server at `url` (`redis://host:port[/db]`). Connects lazily: a
    /// server that is down now is reported by the first call.
    pub fn connect(url: &str, job: &str, deadline: Duration) -> Result<Redis, RegistryError> {
        let at = match url.split_once('@') {
            Some((scheme_user, host)) => format!("{}//…@{host}", scheme_user.split("//").next().unwrap_or("")),
            None => url.to_string(),
        };
        let client = Client::open(url).map_err(|e| RegistryError {
            at: at.clone(),
            message: format!("{e}; write the registry as redis://HOST:6379"),
        })?;
        Ok(Redis { client, at, prefix: format!("tierstore:{job}:"), deadline, connection: Mutex::new(None) })
    }

    fn fail(&self, e: redis::RedisError) -> RegistryError {
        RegistryError { at: self.at.clone(), message: e.to_string() }
    }

    /// Runs `f` on the connection, opening it first if needed; a failed call drops the connection so
    /// the next one reconnects.
    fn with<T>(&self, f: impl FnOnce(&mut Connection) -> redis::RedisResult<T>) -> Result<T, RegistryError> {
        let mut slot = self.connection.lock().expect("connection lock");
        if slot.is_none() {
            let c = self.client.get_connection_with_timeout(self.deadline).map_err(|e| self.fail(e))?;
            c.set_read_timeout(Some(self.deadline)).map_err(|e| self.fail(e))?;
            c.set_write_timeout(Some(self.deadline)).map_err(|e| self.fail(e))?;
            *slot = Some(c);
        }
        let result = f(slot.as_mut().expect("connected"));
        if result.is_err() {
            *slot = None;
        }
        result.map_err(|e| self.fail(e))
    }

    fn members_key(&self) -> String {
        format!("{}members", self.prefix)
    }

    fn value_key(&self, key: &str) -> String {
        format!("{}kv:{key}", self.prefix)
    }
}

impl Registry for Redis {
    fn join(&self, member: &str, ttl: Duration) -> Result<(), RegistryError> {
        let until = now_ms() + ttl.as_millis() as u64;
        let key = self.members_key();
        self.with(|c| redis::cmd("ZADD").arg(&key).arg(until).arg(member).query::<()>(c))
    }

    fn leave(&self, member: &str) -> Result<(), RegistryError> {
        let key = self.members_key();
        self.with(|c| redis::cmd("ZREM").arg(&key).arg(member).query::<()>(c))
    }

    fn members(&self) -> Result<Vec<String>, RegistryError> {
        let key = self.members_key();
        let now = now_ms();
        let mut members: Vec<String> = self.with(|c| {
            redis::pipe()
                .cmd("ZREMRANGEBYSCORE")
                .arg(&key)
                .arg("-inf")
                .arg(now)
                .ignore()
                .cmd("ZRANGE")
                .arg(&key)
                .arg(0)
                .arg(-1)
                .query::<(Vec<String>,)>(c)
                .map(|(live,)| live)
        })?;
        members.sort();
        Ok(members)
    }

    fn put(&self, key: &str, value: &[u8], ttl: Option<Duration>) -> Result<(), RegistryError> {
        let k = self.value_key(key);
        self.with(|c| {
            let mut cmd = redis::cmd("SET");
            cmd.arg(&k).arg(value);
            if let Some(t) = ttl {
                cmd.arg("PX").arg(t.as_millis().max(1) as u64);
            }
            cmd.query::<()>(c)
        })
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, RegistryError> {
        let k = self.value_key(key);
        self.with(|c| redis::cmd("GET").arg(&k).query::<Option<Vec<u8>>>(c))
    }

    fn remove(&self, key: &str) -> Result<bool, RegistryError> {
        let k = self.value_key(key);
        self.with(|c| redis::cmd("DEL").arg(&k).query::<u64>(c).map(|n| n > 0))
    }
}
