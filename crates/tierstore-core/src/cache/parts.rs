//! Parts of a file read through the agent of the node that owns it: a partial model load reads only the
//! tensors it needs, and when several nodes load the same few tensors, the owner's agent reads their
//! blocks from the store once and serves every node from them (its own node included). The caller
//! checks every byte against its own hashes (a tensor's); a mismatch is told to the owner, which drops
//! what it sent them from. Anything that goes wrong is counted and sends the caller to the store. The
//! agent's side is `serve_parts.rs`.

use std::sync::Arc;

use super::link::PeerLink;
use crate::cluster::transfer::Transfer;

/// Parts of a file on their way from the agent that owns it; the version they come from is known.
pub struct Parts {
    transfer: Transfer,
    who: String,
    rel: String,
    link: Arc<PeerLink>,
}

impl Parts {
    /// Parts coming by `transfer` from the member `who`, over `link` (see [`Peers::ask_parts`]).
    pub(super) fn new(transfer: Transfer, who: String, rel: String, link: Arc<PeerLink>) -> Parts {
        Parts { transfer, who, rel, link }
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
