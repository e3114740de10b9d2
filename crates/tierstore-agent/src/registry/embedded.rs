//! The registry of a one-node job, in the agent's memory.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{Registry, RegistryError};

/// A value and when it expires (never: `None`).
type Value = (Vec<u8>, Option<Instant>);

/// Members and keys in memory, with their expiry.
#[derive(Default)]
pub struct Embedded {
    members: Mutex<BTreeMap<String, Instant>>,
    keys: Mutex<HashMap<String, Value>>,
}

impl Registry for Embedded {
    fn join(&self, member: &str, ttl: Duration) -> Result<(), RegistryError> {
        self.members.lock().expect("members lock").insert(member.to_string(), Instant::now() + ttl);
        Ok(())
    }

    fn leave(&self, member: &str) -> Result<(), RegistryError> {
        self.members.lock().expect("members lock").remove(member);
        Ok(())
    }

    fn members(&self) -> Result<Vec<String>, RegistryError> {
        let now = Instant::now();
        let mut m = self.members.lock().expect("members lock");
        m.retain(|_, until| *until > now);
        Ok(m.keys().cloned().collect())
    }

    fn put(&self, key: &str, value: &[u8], ttl: Option<Duration>) -> Result<(), RegistryError> {
        let until = ttl.map(|t| Instant::now() + t);
        self.keys.lock().expect("keys lock").insert(key.to_string(), (value.to_vec(), until));
        Ok(())
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, RegistryError> {
        let mut keys = self.keys.lock().expect("keys lock");
        match keys.get(key) {
            Some((_, Some(until))) if *until <= Instant::now() => {
                keys.remove(key);
                Ok(None)
            }
            Some((v, _)) => Ok(Some(v.clone())),
            None => Ok(None),
        }
    }

    fn remove(&self, key: &str) -> Result<bool, RegistryError> {
        let live = self.get(key)?.is_some();
        self.keys.lock().expect("keys lock").remove(key);
        Ok(live)
    }
}
