//! A cache tier: a directory (RAM-backed or on a local disk) with a quota, its index and its counters.
//!
//! Layout of a tier's directory, per user (several users may give the same tier path, e.g.
//! `/dev/shm/tierstore`) and per source (two datasets can share one tier path):
//! ```text
//! <tier path>/<uid>/                  this user's own directory, 0700 (see `private`)
//!   <source name>-<hash>/             this source's namespace, 0700
//!     index/            LMDB index (entries, eviction ranks, bytes used)
//!     data/ab/abcd…     published copies, named by key
//!     tmp/              copies being written (published by rename, never served from here by path)
//!     counters          shared counters of the tier
//! ```

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

use crate::config::{TierConfig, TierKind};
use crate::counters::{tier as tier_slot, Counters};
use crate::hash::Hash;
use crate::index::{Index, IndexError, Key, SourceId};
use crate::placement::Policy;
use crate::usage::TierUsage;

/// One tier of the cache.
pub struct Tier {
    /// The tier as configured.
    pub config: TierConfig,
    /// The tier's directory for this source.
    pub root: PathBuf,
    /// The index, or why it could not be opened (the tier is then skipped and reads go on).
    pub index: Result<Index, String>,
    /// Counters of this tier, shared by the node.
    pub counters: Counters,
    /// What the user's other sources hold in this tier directory, which bounds this one's room (none when
    /// the table could not be opened: the quota then bounds this source alone).
    usage: Option<TierUsage>,
    /// A descriptor of `data/`: copies are opened relative to it (a short path walk on every hit).
    data_dir: File,
    /// `data/` with symlinks resolved, as /proc names the descriptors of copies.
    data_real: PathBuf,
    /// The device `data/` is on.
    data_dev: u64,
}

fn hex(key: &Key) -> String {
    hex_digits(key).iter().map(|&d| d as char).collect()
}

/// The 32 lowercase hex digits of `key`, as bytes.
fn hex_digits(key: &Key) -> [u8; 32] {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = [0u8; 32];
    for (i, b) in key.iter().enumerate() {
        out[2 * i] = DIGITS[(b >> 4) as usize];
        out[2 * i + 1] = DIGITS[(b & 15) as usize];
    }
    out
}

/// The key that `hex` wrote as `name`.
fn key_of_hex(name: &str) -> Option<Key> {
    if name.len() != 32 {
        return None;
    }
    let mut key = [0u8; 16];
    for (i, byte) in key.iter_mut().enumerate() {
        *byte = u8::from_str_radix(name.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(key)
}

/// The directory of `source` in the tier at `tier_path`, for this user: `<tier path>/<uid>/<namespace>`.
pub fn namespace_dir(tier_path: &Path, source: &Path) -> PathBuf {
    crate::private::user_dir(tier_path).join(namespace(source))
}

/// The namespace directory name of `source` inside a tier.
pub fn namespace(source: &Path) -> String {
    let name: String = source
        .file_name()
        .map(|n| {
            n.to_string_lossy()
                .chars()
                .map(|c| if c.is_alphanumeric() || c == '-' || c == '_' { c } else { '_' })
                .collect()
        })
        .unwrap_or_else(|| "root".into());
    let h = blake3::hash(source.as_os_str().as_encoded_bytes());
    format!("{name}-{}", &h.to_hex()[..12])
}

impl Tier {
    /// Opens the tier for `source`. Only a failure to create or trust the directories or the counters is
    /// an error; an index that cannot be opened leaves the tier unavailable.
    pub fn open(config: &TierConfig, source: &Path, policy: Policy) -> io::Result<Tier> {
        let root = namespace_dir(&config.path, source);
        // Checked private (owner, mode, no link, nothing above it another user can replace): every path
        // below is then this user's alone, and path-based opens beneath it cannot be redirected.
        let root_dir = crate::private::ensure_dir(&root)?;
        for sub in ["index", "tmp", "data", "shadow"] {
            crate::private::ensure_subdir(&root_dir, &root, sub)?;
        }
        let counters = Counters::open(&root.join("counters"))?;
        let index = Index::open(&root.join("index"), policy).map_err(|e: IndexError| e.to_string());
        let user_dir = root.parent().expect("a namespace has a parent");
        let usage = match TierUsage::open(user_dir, &namespace(source)) {
            Ok(u) => {
                if let Ok(used) = index.as_ref().map(Index::usage_bytes) {
                    u.set(used.unwrap_or(0));
                }
                Some(u)
            }
            Err(e) => {
                log::warn!(
                    "{}: the usage of its sources cannot be shared ({e}); its quota bounds each alone",
                    root.display()
                );
                None
            }
        };
        let data_dir = crate::interposer::lasting(|| crate::source::open_dir(&root.join("data")))?;
        let data_real = std::fs::canonicalize(root.join("data"))?;
        let data_dev = std::os::unix::fs::MetadataExt::dev(&data_dir.metadata()?);
        Ok(Tier { config: config.clone(), root, index, counters, usage, data_dir, data_real, data_dev })
    }

    /// This source's share of the tier's quota, given its `used` bytes: the quota less what the user's other
    /// sources hold in the tier directory. Records `used` for them in turn.
    pub fn quota_left_by_others(&self, used: u64) -> u64 {
        match &self.usage {
            Some(u) => {
                u.set(used);
                self.config.quota.saturating_sub(u.others())
            }
            None => self.config.quota,
        }
    }

    /// Records that this source now holds `used` bytes of the tier (see [`Tier::quota_left_by_others`]).
    pub fn record_usage(&self, used: u64) {
        if let Some(u) = &self.usage {
            u.set(used);
        }
    }

    /// Whether copies of this tier live on device `dev` (a cheap first test before [`Tier::key_of_copy`]).
    pub fn holds_device(&self, dev: u64) -> bool {
        self.data_dev == dev
    }

    /// The empty directory that stands for the listed source directory of `key` (see
    /// [`crate::index::Index::listing`]), created if needed.
    pub fn shadow_dir(&self, key: &Key) -> io::Result<PathBuf> {
        let p = self.root.join("shadow").join(hex(key));
        match std::fs::create_dir(&p) {
            Err(e) if e.kind() != io::ErrorKind::AlreadyExists => Err(e),
            _ => Ok(p),
        }
    }

    /// The key of the shadow directory at `path` (as /proc names an open descriptor of it), if it is one.
    pub fn key_of_shadow(&self, path: &Path) -> Option<Key> {
        let name = path.strip_prefix(self.data_real.with_file_name("shadow")).ok()?.to_str()?;
        key_of_hex(name)
    }

    /// The key of the published copy at `path` (as /proc names an open copy), if `path` is one.
    pub fn key_of_copy(&self, path: &Path) -> Option<Key> {
        let rest = path.strip_prefix(&self.data_real).ok()?.to_str()?;
        let (prefix, name) = rest.split_once('/')?;
        if !name.starts_with(prefix) || prefix.len() != 2 {
            return None;
        }
        key_of_hex(name)
    }

    /// Whether the tier holds data in RAM.
    pub fn in_memory(&self) -> bool {
        self.config.kind == TierKind::Memory
    }

    /// Where the published copy of `key` lives.
    pub fn data_path(&self, key: &Key) -> PathBuf {
        let h = hex(key);
        self.root.join("data").join(&h[..2]).join(h)
    }

    /// Opens the published copy of `key` for reading.
    pub fn open_copy(&self, key: &Key) -> io::Result<File> {
        // `data_path`'s last two parts, "ab/ab…" and a NUL, on the stack: every warm open comes here, and
        // the name's strings were a few percent of its CPU (`perf`).
        let digits = hex_digits(key);
        let mut name = [0u8; 36];
        name[..2].copy_from_slice(&digits[..2]);
        name[2] = b'/';
        name[3..35].copy_from_slice(&digits);
        // SAFETY: hex digits and '/' are not NUL, and the last byte (left 0) is. The checked constructor
        // would scan the name for a NUL again: 135 of a warm open's instructions (callgrind).
        let name = unsafe { std::ffi::CStr::from_bytes_with_nul_unchecked(&name) };
        crate::source::open_at_c(&self.data_dir, name)
    }

    /// Creates a new temporary file for a copy of `key`, unique to this process and attempt.
    pub fn create_temp(&self, key: &Key) -> io::Result<(PathBuf, File)> {
        static NONCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NONCE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = self.root.join("tmp").join(format!("{}.{}.{n}", hex(key), crate::process::pid()));
        let f = crate::interposer::lasting(|| crate::private::create_new(&path))?;
        Ok((path, f))
    }

    /// Moves a finished temporary copy to its published name (atomic; replaces an older copy).
    pub fn publish_file(&self, temp: &Path, key: &Key) -> io::Result<()> {
        let dest = self.data_path(key);
        match std::fs::rename(temp, &dest) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                use std::os::unix::fs::DirBuilderExt;
                let parent = dest.parent().expect("data path has a parent");
                std::fs::DirBuilder::new().recursive(true).mode(0o700).create(parent)?;
                std::fs::rename(temp, &dest)
            }
            r => r,
        }
    }

    /// Publishes the finished copy of version `sid` at `temp` (written through `file`) as `key`'s: its
    /// mtime set to the source's, renamed into place, its index entry made ready with its blake3 `sum`
    /// (when recorded), and counted. A reservation cleared meanwhile leaves no copy behind.
    pub fn publish_copy(
        &self,
        key: &Key,
        temp: &Path,
        file: &File,
        sid: SourceId,
        sum: Option<Hash>,
    ) -> io::Result<()> {
        set_mtime(file, sid.mtime_ns)?;
        self.publish_file(temp, key)?;
        let published = match &self.index {
            Ok(ix) => ix.publish(key, sum, crate::clock::now_ns()).unwrap_or(false),
            Err(_) => false,
        };
        if published {
            self.counters.add(tier_slot::INSERTS, 1);
            self.counters.add(tier_slot::BYTES_WRITTEN, sid.size);
        } else {
            // The reservation vanished (the cache was cleared meanwhile): leave no unaccounted copy.
            let _ = std::fs::remove_file(self.data_path(key));
        }
        Ok(())
    }

    /// The temporary copy of `key` that another live process of this node is writing now, if there is one
    /// (the newest, should there be several).
    pub fn temp_of_another(&self, key: &Key) -> Option<PathBuf> {
        let prefix = format!("{}.", hex(key));
        let mine = crate::process::pid() as i32;
        let dir = std::fs::read_dir(self.root.join("tmp")).ok()?;
        dir.flatten()
            .filter_map(|entry| {
                let name = entry.file_name().to_string_lossy().into_owned();
                let pid: i32 = name.strip_prefix(&prefix)?.split('.').next()?.parse().ok()?;
                // SAFETY: kill with signal 0 only checks whether the process exists.
                let alive = pid != mine && unsafe { libc::kill(pid, 0) } == 0;
                let written = entry.metadata().ok()?.modified().ok()?;
                alive.then(|| (written, entry.path()))
            })
            .max()
            .map(|(_, path)| path)
    }

    /// Removes temporary files left by processes that no longer exist (killed mid-copy).
    pub fn sweep_temps(&self) {
        let Ok(dir) = std::fs::read_dir(self.root.join("tmp")) else { return };
        for entry in dir.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let pid: Option<i32> = name.split('.').nth(1).and_then(|p| p.parse().ok());
            // SAFETY: kill with signal 0 only checks whether the process exists.
            let dead = pid.is_some_and(|pid| unsafe { libc::kill(pid, 0) } != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH));
            if dead {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

/// Sets a copy's modification time to the source's, so that a copy keeps the source's mtime and a
/// write into the copy (which changes its mtime) is detected on the next open.
fn set_mtime(file: &File, mtime_ns: i64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let ts = libc::timespec { tv_sec: mtime_ns.div_euclid(1_000_000_000), tv_nsec: mtime_ns.rem_euclid(1_000_000_000) };
    let times = [ts, ts];
    // SAFETY: futimens on an open descriptor with two valid timespecs.
    if unsafe { libc::futimens(file.as_raw_fd(), times.as_ptr()) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_is_opened_by_the_name_data_path_gives_it() {
        let dir = tempfile::tempdir().unwrap();
        let config = TierConfig { path: dir.path().join("tier"), quota: 1 << 20, kind: TierKind::Local };
        let tier = Tier::open(&config, dir.path(), Policy::Fill).unwrap();
        let key: Key = std::array::from_fn(|i| (i as u8).wrapping_mul(37).wrapping_add(0xa5));
        let path = tier.data_path(&key);
        assert_eq!(path.file_name().unwrap().to_str().unwrap(), hex(&key));
        assert_eq!(key_of_hex(&hex(&key)), Some(key));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, b"the copy").unwrap();
        let mut read = String::new();
        std::io::Read::read_to_string(&mut tier.open_copy(&key).unwrap(), &mut read).unwrap();
        assert_eq!(read, "the copy");
        let other: Key = [7; 16];
        assert_eq!(tier.open_copy(&other).unwrap_err().kind(), io::ErrorKind::NotFound);
    }
}
