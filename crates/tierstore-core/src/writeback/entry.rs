//! One staged file waiting for migration, as the journal keeps it and the log of buffered closes
//! appends it: its fields and their byte layout (versioned, so that entries written by an older
//! tierstore still decode).

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// A staged file waiting for migration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Its place in the migration order.
    pub seq: u64,
    /// Where it goes on the shared store.
    pub dest: PathBuf,
    /// Its file in the stage's `data/` directory.
    pub staged: String,
    /// Its size.
    pub size: u64,
    /// blake3 of its bytes.
    pub hash: [u8; 32],
    /// When it was first closed (ns since the epoch): the age `tierstore status` shows.
    pub created_ns: u64,
    /// Failed migration attempts.
    pub attempts: u32,
    /// The last migration error, if any.
    pub error: String,
    /// With `durability = "buffered"`: the boot of the node (see [`crate::process::boot_id`]) in which
    /// `close()` returned with the bytes still in the page cache. After a crash of the node (another
    /// boot), bytes that do not match `hash` were torn by the crash, not changed by a program.
    pub unflushed_in: Option<[u8; 16]>,
}

/// Version 2 adds the boot of an unflushed close; version 1 entries (always fsynced) still decode.
const ENTRY_VERSION: u8 = 2;

impl Entry {
    /// The entry of `staged`, closed now for `dest`: no place in the order yet (the journal gives it
    /// one), no migration attempted. `unflushed_in`: see the field.
    pub fn closed(dest: &Path, staged: &str, size: u64, hash: [u8; 32], unflushed_in: Option<[u8; 16]>) -> Entry {
        Entry {
            seq: 0,
            dest: dest.to_path_buf(),
            staged: staged.to_string(),
            size,
            hash,
            created_ns: crate::clock::now_ns(),
            attempts: 0,
            error: String::new(),
            unflushed_in,
        }
    }

    pub(super) fn encode(&self) -> Vec<u8> {
        let mut out = vec![ENTRY_VERSION];
        out.extend_from_slice(&self.size.to_be_bytes());
        out.extend_from_slice(&self.hash);
        out.extend_from_slice(&self.created_ns.to_be_bytes());
        out.extend_from_slice(&self.attempts.to_be_bytes());
        out.extend_from_slice(&self.unflushed_in.unwrap_or_default());
        for b in [self.dest.as_os_str().as_bytes(), self.staged.as_bytes(), self.error.as_bytes()] {
            out.extend_from_slice(&(b.len() as u32).to_be_bytes());
            out.extend_from_slice(b);
        }
        out
    }

    pub(super) fn decode(seq: u64, b: &[u8]) -> Option<Entry> {
        let mut r = b;
        let mut take = |n: usize| -> Option<&[u8]> {
            let (head, rest) = (r.get(..n)?, r.get(n..)?);
            r = rest;
            Some(head)
        };
        let version = take(1)?[0];
        if !(1..=ENTRY_VERSION).contains(&version) {
            return None;
        }
        let size = u64::from_be_bytes(take(8)?.try_into().ok()?);
        let hash: [u8; 32] = take(32)?.try_into().ok()?;
        let created_ns = u64::from_be_bytes(take(8)?.try_into().ok()?);
        let attempts = u32::from_be_bytes(take(4)?.try_into().ok()?);
        let unflushed_in = match version {
            1 => None,
            _ => Some(<[u8; 16]>::try_from(take(16)?).ok()?).filter(|boot| *boot != [0; 16]),
        };
        let mut text = || -> Option<Vec<u8>> {
            let n = u32::from_be_bytes(take(4)?.try_into().ok()?) as usize;
            Some(take(n)?.to_vec())
        };
        let dest = PathBuf::from(<std::ffi::OsString as std::os::unix::ffi::OsStringExt>::from_vec(text()?));
        let staged = String::from_utf8(text()?).ok()?;
        let error = String::from_utf8(text()?).ok()?;
        Some(Entry { seq, dest, staged, size, hash, created_ns, attempts, error, unflushed_in })
    }
}
