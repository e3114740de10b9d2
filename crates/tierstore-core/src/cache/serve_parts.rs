//! Parts of a file this node's agent serves to a node that asked for them (the other half of `parts.rs`):
//! from the copy a tier holds whole, or else from the store by the blocks the agent keeps for the next
//! asker (`blocks.rs`). No whole copy is fetched for parts, and on a POSIX source the path is resolved
//! beneath the source, as for a whole file (`serve.rs`).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use super::blocks::{Version, BLOCK};
use super::engine::Inner;
use super::lookup::Look;
use super::serve::Beneath;
use crate::error::Error;
use crate::index::{key_of, SourceId};
use crate::source::SourceFile;

/// A file whose parts this node's agent serves to a node that asked
/// ([`Cache::open_parts_for_peer`](super::Cache::open_parts_for_peer)).
pub struct PartsServed {
    /// The version the parts come from.
    pub identity: SourceId,
    from: From,
    rel: String,
    inner: Arc<Inner>,
}

/// Where the parts are read.
enum From {
    /// The copy a tier holds whole.
    Copy(File),
    /// The store, by blocks kept for the next asker.
    Store(SourceFile),
}

impl PartsServed {
    /// See [`Cache::open_parts_for_peer`](super::Cache::open_parts_for_peer).
    pub(super) fn open(inner: &Arc<Inner>, rel: &str) -> Result<PartsServed, Error> {
        let key = key_of(rel);
        let mut beneath = Beneath::new(inner, rel);
        if let Some(sid) = inner.known_identity(&key, rel)? {
            if let Some(file) =
                inner.storage().hit(&key, rel, &sid, Look::Quiet).and_then(crate::reader::Reader::into_file)
            {
                if beneath.vouches(&sid)? {
                    let served =
                        PartsServed { identity: sid, from: From::Copy(file), rel: rel.into(), inner: inner.clone() };
                    return Ok(served);
                }
            }
        }
        let (sid, file) = if beneath.applies() {
            let (sid, file) = beneath.opened()?;
            (sid, SourceFile::Posix(file))
        } else {
            inner.storage().open_identified(rel)?
        };
        Ok(PartsServed { identity: sid, from: From::Store(file), rel: rel.into(), inner: inner.clone() })
    }

    /// The `len` bytes at `offset` (within one block: `offset % BLOCK + len <= BLOCK`), of a part that ends
    /// at `until`. Read from the store, a missing block comes with the missing ones after it up to the one
    /// holding `until - 1`.
    pub fn read(&self, offset: u64, len: usize, until: u64) -> Result<Vec<u8>, Error> {
        let path = || self.inner.storage().source().path_of(&self.rel);
        let short = || io::Error::new(io::ErrorKind::UnexpectedEof, "the file ended before the part did");
        match &self.from {
            From::Copy(file) => {
                let mut buf = vec![0u8; len];
                file.read_exact_at(&mut buf, offset).map_err(|e| Error::io(&path(), e))?;
                Ok(buf)
            }
            From::Store(file) => {
                let version =
                    Version { rel: self.rel.clone(), size: self.identity.size, mtime_ns: self.identity.mtime_ns };
                let (index, at) = (offset / BLOCK, (offset % BLOCK) as usize);
                let last = until.saturating_sub(1) / BLOCK;
                let block = self
                    .inner
                    .blocks()
                    .get(&version, index, last, |first, count| self.read_store(file, first, count))
                    .map_err(|e| Error::io(&path(), e))?;
                let bytes = block.get(at..at + len).ok_or_else(|| Error::io(&path(), short()))?;
                Ok(bytes.to_vec())
            }
        }
    }

    /// Blocks `first..first + count` from the store (the last one short at the end of the file).
    fn read_store(&self, file: &SourceFile, first: u64, count: u64) -> io::Result<Vec<u8>> {
        let start = first * BLOCK;
        let end = ((first + count) * BLOCK).min(self.identity.size);
        let mut buf = vec![0u8; end.saturating_sub(start) as usize];
        let mut done = 0;
        while done < buf.len() {
            match self.inner.storage().source().read_at(file, &mut buf[done..], start + done as u64)? {
                0 => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the store's file ended early")),
                n => done += n,
            }
        }
        Ok(buf)
    }

    /// Counts parts served.
    pub fn count_served(&self, bytes: u64) {
        self.inner.count_served(bytes);
    }
}
