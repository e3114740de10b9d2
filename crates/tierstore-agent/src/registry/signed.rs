//! Registry entries under the job's token: any registry (an adapter, as object_store's `limit.rs` wraps
//! any store) whose members and values carry a MAC that only holders of the token can make, and whose
//! entries without a valid one are ignored. Anyone who can write to the job's Redis key can add a line,
//! but not one the agents believe.
//!
//! A member is kept as `host:port#MAC` (the MAC in hex), a value as `MAC ‖ value`, the MAC a keyed blake3
//! of the job, the kind of entry and the entry, under a key derived from the token. A MAC'd entry replayed
//! later names an agent that must still prove the token on every connection; it gains nothing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::{Registry, RegistryError};

/// The bytes of a MAC kept with each entry.
const MAC: usize = 16;

/// A registry whose entries are signed with the job's token.
pub struct Signed {
    inner: Box<dyn Registry>,
    key: [u8; 32],
    job: String,
    /// Entries ignored for a missing or wrong MAC (shown in the agent's status as a registry error).
    pub ignored: AtomicU64,
}

impl Signed {
    /// `inner`'s entries of `job`, signed and checked with `token`.
    pub fn new(inner: Box<dyn Registry>, job: &str, token: &[u8]) -> Signed {
        let key = blake3::derive_key("tierstore registry entry v1", token);
        Signed { inner, key, job: job.to_string(), ignored: AtomicU64::new(0) }
    }

    fn mac(&self, kind: &str, parts: &[&[u8]]) -> [u8; MAC] {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        for part in [self.job.as_bytes(), kind.as_bytes()].iter().chain(parts) {
            h.update(&(part.len() as u64).to_be_bytes());
            h.update(part);
        }
        let mut out = [0u8; MAC];
        out.copy_from_slice(&h.finalize().as_bytes()[..MAC]);
        out
    }

    fn signed_member(&self, member: &str) -> String {
        let mac: String = self.mac("member", &[member.as_bytes()]).iter().map(|b| format!("{b:02x}")).collect();
        format!("{member}#{mac}")
    }

    fn ignore(&self, what: &str) {
        if self.ignored.fetch_add(1, Ordering::Relaxed) == 0 {
            log::warn!(
                "the registry holds {what} that was not written with the job's token: ignored (someone who is not \
                 of the job can write to the registry)"
            );
        }
    }
}

impl Registry for Signed {
    fn join(&self, member: &str, ttl: Duration) -> Result<(), RegistryError> {
        self.inner.join(&self.signed_member(member), ttl)
    }

    fn leave(&self, member: &str) -> Result<(), RegistryError> {
        self.inner.leave(&self.signed_member(member))
    }

    fn members(&self) -> Result<Vec<String>, RegistryError> {
        let mut out = Vec::new();
        for entry in self.inner.members()? {
            match entry.rsplit_once('#') {
                Some((member, _)) if self.signed_member(member) == entry => out.push(member.to_string()),
                _ => self.ignore(&format!("the member {:?}", entry.chars().take(80).collect::<String>())),
            }
        }
        Ok(out)
    }

    fn put(&self, key: &str, value: &[u8], ttl: Option<Duration>) -> Result<(), RegistryError> {
        let mut signed = self.mac("value", &[key.as_bytes(), value]).to_vec();
        signed.extend_from_slice(value);
        self.inner.put(key, &signed, ttl)
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, RegistryError> {
        let Some(v) = self.inner.get(key)? else { return Ok(None) };
        match v.split_at_checked(MAC) {
            Some((mac, value))
                if blake3::Hash::from(pad(mac))
                    == blake3::Hash::from(pad(&self.mac("value", &[key.as_bytes(), value]))) =>
            {
                Ok(Some(value.to_vec()))
            }
            _ => {
                self.ignore(&format!("a value of {key:?}"));
                Ok(None)
            }
        }
    }

    fn remove(&self, key: &str) -> Result<bool, RegistryError> {
        self.inner.remove(key)
    }
}

/// A MAC in a 32-byte array, for blake3's constant-time comparison.
fn pad(mac: &[u8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    out[..mac.len().min(32)].copy_from_slice(&mac[..mac.len().min(32)]);
    out
}

#[cfg(test)]
mod tests {
    use super::super::Embedded;
    use super::*;

    const TOKEN: &[u8] = b"the-token-of-the-job-0123456789abcdef";

    #[test]
    fn signed_entries_come_back_and_forged_ones_are_ignored() {
        let inner = std::sync::Arc::new(Embedded::default());
        let job = Signed::new(Box::new(inner.clone()), "job", TOKEN);
        let ttl = Duration::from_secs(10);
        job.join("10.0.0.1:7078", ttl).unwrap();
        // Written straight into the registry, as anyone who can reach it could: ignored.
        inner.join("10.6.6.6:7078", ttl).unwrap();
        inner.join("10.6.6.7:7078#00000000000000000000000000000000", ttl).unwrap();
        // Signed with another token, or for another job: ignored too.
        Signed::new(Box::new(inner.clone()), "job", b"another token of another job, not ours")
            .join("10.6.6.8:1", ttl)
            .unwrap();
        Signed::new(Box::new(inner.clone()), "other", TOKEN).join("10.6.6.9:1", ttl).unwrap();
        assert_eq!(job.members().unwrap(), vec!["10.0.0.1:7078".to_string()]);
        assert_eq!(job.ignored.load(Ordering::Relaxed), 4);

        job.put("k", b"v1", None).unwrap();
        assert_eq!(job.get("k").unwrap().as_deref(), Some(&b"v1"[..]));
        inner.put("k", b"forged value with no mac at all", None).unwrap();
        assert_eq!(job.get("k").unwrap(), None);
        job.leave("10.0.0.1:7078").unwrap();
        assert!(job.members().unwrap().is_empty());
    }
}
