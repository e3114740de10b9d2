//! Parts of a file read through the agent of the node that owns it: a partial model load reads only the
//! tensors it needs, and when several nodes load the same few tensors, the owner's agent reads their
//! blocks from the store once and serves every node from them (its own node included). The caller
//! checks every byte against its own hashes (a tensor's); a mismatch is told to the owner, which drops
//! what it sent them from. Anything that goes wrong is counted and sends the caller to the store.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use super::blocks::{Version, BLOCK};
use super::engine::Inner;
use super::link::PeerLink;
use super::lookup::Look;
use super::peers::Beneath;
use crate::cluster::transfer::Transfer;
use crate::error::Error;
use crate::index::{key_of, SourceId};
use crate::source::SourceFile;

/// Parts of a file on their way from the agent that owns it; the version they come from is known.
pub struct Parts {
    transfer: Transfer,
    who: String,
    rel: String,
    link: Arc<PeerLink>,
}

impl Parts {
    /// See [`Cache::open_parts`](super::Cache::open_parts).
    pub(super) fn ask(inner: &Inner, path: &Path, ranges: &[(u64, u64)]) -> Result<Option<Parts>, Error> {
        let Some(link) = inner.link.as_ref() else { return Ok(None) };
        if ranges.len() > crate::cluster::wire::MAX_RANGES {
            return Ok(None);
        }
        let rel = inner.source.relative(path)?;
        let Some((who, transfer)) = link.ask_ranges(&rel, ranges) else { return Ok(None) };
        Ok(Some(Parts { transfer, who, rel, link: link.clone() }))
    }

    /// The size of the version the parts come from.
    pub fn size(&self) -> u64 {
        self.transfer.found.size
    }

    /// Receives the parts into `dests` (one buffer per range asked, in order, each of its range's length)
    /// and has `check` check them. `Ok(true)`: every byte is there and checked. `Ok(false)`: the owner
    /// failed (counted): read the store. `Err`: `check`'s error; the owner has been told that its bytes
    /// are wrong.
    pub fn receive<E>(
        mut self,
        dests: &mut [(u64, &mut [u8])],
        check: impl FnOnce(&mut [(u64, &mut [u8])]) -> Result<(), E>,
    ) -> Result<bool, E> {
        let link = &self.link;
        if let Err(e) = self.transfer.receive_ranges(dests, false) {
            link.failed(&self.who, &self.rel, &e);
            return Ok(false);
        }
        if let Err(e) = check(dests) {
            let said = self.transfer.damaged();
            link.parts_damaged(&self.who, &self.rel, &said);
            return Err(e);
        }
        link.served_whole(&self.who, &self.rel, dests.iter().map(|(_, d)| d.len() as u64).sum());
        Ok(true)
    }
}

impl crate::models::load::ReceivedParts for Parts {
    fn size(&self) -> u64 {
        Parts::size(self)
    }

    fn receive(
        self: Box<Self>,
        dests: &mut [(u64, &mut [u8])],
        check: &mut crate::models::load::CheckParts<'_>,
    ) -> Result<bool, crate::models::load::ReadError> {
        Parts::receive(*self, dests, check)
    }
}

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
            if let Some(file) = inner.hit(&key, rel, &sid, Look::Quiet).and_then(crate::reader::Reader::into_file) {
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
            inner.open_identified(rel)?
        };
        Ok(PartsServed { identity: sid, from: From::Store(file), rel: rel.into(), inner: inner.clone() })
    }

    /// The `len` bytes at `offset` (within one block: `offset % BLOCK + len <= BLOCK`), of a part that ends
    /// at `until`. Read from the store, a missing block comes with the missing ones after it up to the one
    /// holding `until - 1`.
    pub fn read(&self, offset: u64, len: usize, until: u64) -> Result<Vec<u8>, Error> {
        let path = || self.inner.source.path_of(&self.rel);
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
                    .blocks
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
            match self.inner.source.read_at(file, &mut buf[done..], start + done as u64)? {
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
