//! Registry entries under the job's token: any registry (an adapter, as object_store's `limit.rs` wraps
//! any store) whose members and values carry a MAC that only holders of the token can make, and whose
//! entries without a valid one are refused. Anyone who can write to the job's Redis key can add a line,
//! but not one the agents believe.
//!
//! A member is kept as `host:port#UNTIL#MAC`, a value as `MAC ‖ UNTIL ‖ value`: UNTIL is when the entry
//! ends (milliseconds since the epoch by the writer's clock; for a value kept for good, `u64::MAX`), and
//! the MAC a keyed blake3 of the job, the kind of entry, the entry and UNTIL, under a key derived from the
//! token. So the MAC covers the whole entry, its end included: what a registry keeps beside an entry (a
//! member's score in Redis, a key's expiry) decides only when the registry drops it, never how long the
//! agents believe it. The entry of a member that left, added again with a score far in the future, names
//! an end that has passed, and is refused; an entry that claims to last longer than any registration
//! does ([`LONGEST_REGISTRATION`]) is refused too. An entry replayed within its own lifetime names an
//! agent that must still prove the token on every connection; it gains nothing.
//!
//! Since a member's entry names its end, each renewal writes a new entry and removes the one before.
//! Every refused entry is counted once ([`Registry::refused`]: the agent's status shows it among its
//! registry errors) and the first is logged.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::{Registry, RegistryError};

/// The bytes of a MAC kept with each entry.
const MAC: usize = 16;

/// The longest a registration may last: a member's entry that ends further ahead is refused, and a
/// longer `ttl` given to [`Registry::join`] is cut to it. Far beyond an agent's own (10 s, renewed every
/// heartbeat) and any clock skew between the nodes of a job.
pub const LONGEST_REGISTRATION: Duration = Duration::from_secs(600);

/// How long after its end an entry may still be listed without counting as replayed: the registry's own
/// expiry (a member's score) is reckoned by the same clock a moment after the entry's end.
const LATE: Duration = Duration::from_secs(2);

/// Refused entries remembered so that each is counted once; past this many, memory starts over.
const REMEMBERED: usize = 4096;

/// A registry whose entries are signed with the job's token.
pub struct Signed {
    inner: Box<dyn Registry>,
    key: [u8; 32],
    job: String,
    /// The entry last written for each member this process registered, removed when it is renewed.
    written: Mutex<HashMap<String, String>>,
    /// A digest of each entry refused so far, so that a forgery listed at every heartbeat counts once.
    seen: Mutex<HashSet<[u8; 16]>>,
    /// Entries refused (see [`Registry::refused`]).
    refused: AtomicU64,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64
}

fn ms(d: Duration) -> u64 {
    d.as_millis().min(u64::MAX as u128) as u64
}

/// Whether two MACs are equal, compared in constant time (blake3's `Hash` equality).
fn same(a: &[u8], b: &[u8; MAC]) -> bool {
    let pad = |mac: &[u8]| {
        let mut out = [0u8; 32];
        out[..mac.len().min(32)].copy_from_slice(&mac[..mac.len().min(32)]);
        out
    };
    a.len() == MAC && blake3::Hash::from(pad(a)) == blake3::Hash::from(pad(b))
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok()).collect()
}

impl Signed {
    /// `inner`'s entries of `job`, signed and checked with `token`.
    pub fn new(inner: Box<dyn Registry>, job: &str, token: &[u8]) -> Signed {
        // v2: the MAC covers the entry's end (v1 entries, which it did not, are refused).
        let key = blake3::derive_key("tierstore registry entry v2", token);
        Signed {
            inner,
            key,
            job: job.to_string(),
            written: Mutex::new(HashMap::new()),
            seen: Mutex::new(HashSet::new()),
            refused: AtomicU64::new(0),
        }
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

    /// The entry of `member` registered until `until` (ms since the epoch).
    fn member_entry(&self, member: &str, until: u64) -> String {
        let mac = self.mac("member", &[member.as_bytes(), &until.to_be_bytes()]);
        let hex: String = mac.iter().map(|b| format!("{b:02x}")).collect();
        format!("{member}#{until}#{hex}")
    }

    /// The entry of `value` at `key` kept until `until` (ms since the epoch; `u64::MAX`: for good).
    fn value_entry(&self, key: &str, value: &[u8], until: u64) -> Vec<u8> {
        let mut entry = self.mac("value", &[key.as_bytes(), &until.to_be_bytes(), value]).to_vec();
        entry.extend_from_slice(&until.to_be_bytes());
        entry.extend_from_slice(value);
        entry
    }

    /// The member an entry names, if it is to be believed at `now`: `Ok(None)` once it has ended, `Err`
    /// with why it is refused.
    fn member_of(&self, entry: &str, now: u64) -> Result<Option<String>, String> {
        let mut fields = entry.rsplitn(3, '#');
        let (Some(mac), Some(until), Some(member)) = (fields.next(), fields.next(), fields.next()) else {
            return Err("that was not written with the job's token".into());
        };
        let (Some(mac), Ok(until)) = (unhex(mac), until.parse::<u64>()) else {
            return Err("that was not written with the job's token".into());
        };
        if !same(&mac, &self.mac("member", &[member.as_bytes(), &until.to_be_bytes()])) {
            return Err("that was not written with the job's token".into());
        }
        if until.saturating_add(ms(LATE)) < now {
            return Err(format!(
                "that ended {} s ago but was listed again (an old entry put back into the registry)",
                (now - until) / 1000
            ));
        }
        if until > now.saturating_add(ms(LONGEST_REGISTRATION)) {
            return Err(format!(
                "that claims to last {} s more, longer than any registration ({} s)",
                (until - now) / 1000,
                LONGEST_REGISTRATION.as_secs()
            ));
        }
        Ok((until > now).then(|| member.to_string()))
    }

    /// Counts `entry` as refused, once however often it is listed; the first refusal is logged.
    fn refuse(&self, entry: &[u8], what: &str) {
        let mut digest = [0u8; 16];
        digest.copy_from_slice(&blake3::hash(entry).as_bytes()[..16]);
        {
            let mut seen = self.seen.lock().expect("refused entries lock");
            if seen.len() >= REMEMBERED {
                seen.clear();
            }
            if !seen.insert(digest) {
                return;
            }
        }
        if self.refused.fetch_add(1, Ordering::Relaxed) == 0 {
            log::warn!(
                "the registry holds {what}: refused (someone who is not of the job can write to the registry); \
                 further ones are counted in the agent's status, among its registry errors"
            );
        }
    }
}

impl Registry for Signed {
    fn join(&self, member: &str, ttl: Duration) -> Result<(), RegistryError> {
        let ttl = ttl.min(LONGEST_REGISTRATION);
        let entry = self.member_entry(member, now_ms().saturating_add(ms(ttl)));
        self.inner.join(&entry, ttl)?;
        let before = self.written.lock().expect("written lock").insert(member.to_string(), entry.clone());
        if let Some(before) = before.filter(|b| *b != entry) {
            // Renewed: the entry before goes now (if this fails, it ends on its own).
            let _ = self.inner.leave(&before);
        }
        Ok(())
    }

    fn leave(&self, member: &str) -> Result<(), RegistryError> {
        if let Some(entry) = self.written.lock().expect("written lock").remove(member) {
            self.inner.leave(&entry)?;
        }
        // Entries of the member that an earlier process wrote (an agent that was killed) go too.
        for entry in self.inner.members()? {
            if entry.rsplitn(3, '#').nth(2) == Some(member) {
                self.inner.leave(&entry)?;
            }
        }
        Ok(())
    }

    fn members(&self) -> Result<Vec<String>, RegistryError> {
        let now = now_ms();
        let mut out = BTreeSet::new();
        for entry in self.inner.members()? {
            match self.member_of(&entry, now) {
                Ok(Some(member)) => {
                    out.insert(member);
                }
                Ok(None) => {}
                Err(why) => {
                    let shown: String = entry.chars().take(80).collect();
                    self.refuse(entry.as_bytes(), &format!("the member {shown:?}, {why}"));
                }
            }
        }
        Ok(out.into_iter().collect())
    }

    fn put(&self, key: &str, value: &[u8], ttl: Option<Duration>) -> Result<(), RegistryError> {
        let until = ttl.map_or(u64::MAX, |t| now_ms().saturating_add(ms(t)));
        self.inner.put(key, &self.value_entry(key, value, until), ttl)
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, RegistryError> {
        let Some(v) = self.inner.get(key)? else { return Ok(None) };
        let now = now_ms();
        let refused = |why: &str| {
            let mut entry = key.as_bytes().to_vec();
            entry.extend_from_slice(&v);
            self.refuse(&entry, &format!("a value of {key:?} {why}"));
            Ok(None)
        };
        let Some((mac, rest)) = v.split_at_checked(MAC) else {
            return refused("that was not written with the job's token");
        };
        let Some((until, value)) = rest.split_at_checked(8) else {
            return refused("that was not written with the job's token");
        };
        let until = u64::from_be_bytes(until.try_into().expect("8 bytes"));
        if !same(mac, &self.mac("value", &[key.as_bytes(), &until.to_be_bytes(), value])) {
            return refused("that was not written with the job's token");
        }
        if until.saturating_add(ms(LATE)) < now {
            return refused("that ended but is set again (an old value put back into the registry)");
        }
        Ok((until > now).then(|| value.to_vec()))
    }

    fn remove(&self, key: &str) -> Result<bool, RegistryError> {
        self.inner.remove(key)
    }

    fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::super::Embedded;
    use super::*;

    const TOKEN: &[u8] = b"the-token-of-the-job-0123456789abcdef";

    #[test]
    fn signed_entries_come_back_and_forged_ones_are_refused_and_counted_once() {
        let inner = std::sync::Arc::new(Embedded::default());
        let job = Signed::new(Box::new(inner.clone()), "job", TOKEN);
        let ttl = Duration::from_secs(10);
        job.join("10.0.0.1:7078", ttl).unwrap();
        // Written straight into the registry, as anyone who can reach it could: refused.
        inner.join("10.6.6.6:7078", ttl).unwrap();
        inner.join("10.6.6.7:7078#99999999999999#00000000000000000000000000000000", ttl).unwrap();
        // Signed with another token, or for another job: refused too.
        Signed::new(Box::new(inner.clone()), "job", b"another token of another job, not ours")
            .join("10.6.6.8:1", ttl)
            .unwrap();
        Signed::new(Box::new(inner.clone()), "other", TOKEN).join("10.6.6.9:1", ttl).unwrap();
        assert_eq!(job.members().unwrap(), vec!["10.0.0.1:7078".to_string()]);
        assert_eq!(job.refused(), 4);
        // Listed again at the next heartbeat, the same forgeries are not counted again.
        assert_eq!(job.members().unwrap(), vec!["10.0.0.1:7078".to_string()]);
        assert_eq!(job.refused(), 4);

        job.put("k", b"v1", None).unwrap();
        assert_eq!(job.get("k").unwrap().as_deref(), Some(&b"v1"[..]));
        inner.put("k", b"forged value with no mac at all", None).unwrap();
        assert_eq!(job.get("k").unwrap(), None);
        assert_eq!(job.refused(), 5);
        job.leave("10.0.0.1:7078").unwrap();
        assert_eq!(job.members().unwrap(), Vec::<String>::new());
    }

    #[test]
    fn a_renewal_replaces_the_entry_and_an_old_one_put_back_for_long_is_refused() {
        let inner = std::sync::Arc::new(Embedded::default());
        let job = Signed::new(Box::new(inner.clone()), "job", TOKEN);
        job.join("10.0.0.1:7078", Duration::from_secs(10)).unwrap();
        let first = inner.members().unwrap();
        std::thread::sleep(Duration::from_millis(5));
        job.join("10.0.0.1:7078", Duration::from_secs(10)).unwrap();
        let renewed = inner.members().unwrap();
        assert_eq!(renewed.len(), 1, "a renewal left the entry before it: {renewed:?}");
        assert_ne!(first, renewed);

        // A member that left: its entry, kept by someone who read the registry, is put back for a day.
        let old = job.member_entry("10.0.0.2:7078", now_ms() - 60_000);
        inner.join(&old, Duration::from_secs(86_400)).unwrap();
        // An entry signed with the token (a member's clock gone wrong) that claims to last a day.
        let long = job.member_entry("10.0.0.3:7078", now_ms() + 86_400_000);
        inner.join(&long, Duration::from_secs(86_400)).unwrap();
        assert_eq!(job.members().unwrap(), vec!["10.0.0.1:7078".to_string()]);
        assert_eq!(job.refused(), 2);
        // A longer registration than any is cut to the longest.
        job.join("10.0.0.4:7078", Duration::from_secs(86_400)).unwrap();
        assert_eq!(job.members().unwrap(), vec!["10.0.0.1:7078".to_string(), "10.0.0.4:7078".to_string()]);
        assert_eq!(job.refused(), 2);
    }

    #[test]
    fn a_value_put_back_after_it_ended_is_refused() {
        let inner = std::sync::Arc::new(Embedded::default());
        let job = Signed::new(Box::new(inner.clone()), "job", TOKEN);
        // A value that ended a minute ago, put back for good.
        let ended = job.value_entry("k", b"v", now_ms() - 60_000);
        inner.put("k", &ended, None).unwrap();
        assert_eq!(job.get("k").unwrap(), None);
        assert_eq!(job.refused(), 1);
        // Its end moved instead: the MAC no longer matches.
        let mut moved = ended.clone();
        moved[MAC..MAC + 8].copy_from_slice(&u64::MAX.to_be_bytes());
        inner.put("k", &moved, None).unwrap();
        assert_eq!(job.get("k").unwrap(), None);
        assert_eq!(job.refused(), 2);
        job.put("k", b"v", Some(Duration::from_secs(10))).unwrap();
        assert_eq!(job.get("k").unwrap().as_deref(), Some(&b"v"[..]));
    }
}
