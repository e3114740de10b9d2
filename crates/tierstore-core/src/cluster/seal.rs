//! Frames that cannot be changed on the way: after the handshake (see [`super::session`]) every frame of
//! a TCP connection carries a tag, a keyed blake3 under a key of its direction, derived from the job's
//! token and both nonces of this connection, over the frame's place in its direction, its length and its
//! body. A frame changed, dropped, reordered, replayed from another connection or injected by anything on
//! the path does not carry the tag its receiver expects, and the receiver closes the connection.
//!
//! ```text
//! plain (the node's Unix socket):   len u32 ‖ body
//! sealed (TCP, after the handshake): len u32 ‖ tag[16] ‖ body
//! tag = blake3_keyed(key of the direction, seq u64 ‖ len ‖ body)[..16]
//! ```
//!
//! A [`Frame::Chunk`]'s tag covers its header (kind, transfer, offset, length), not its data: the data go
//! from a copy's descriptor straight into the socket (`sendfile`), and the reader checks every byte against
//! the blake3 the transfer ends with ([`Frame::Done`]) or the chaining values vouched for its pieces
//! ([`Frame::Vouch`]), frames whose tags do cover them; data changed on the way fail that check and are
//! never used. Parts read without a hash are checked by the caller against a hash it already trusts.
//!
//! This gives authenticity, not secrecy: the bytes are readable on the path (see
//! docs/reference/security.md).

use std::io::{self, Read, Write};

use super::wire::{self, Frame, FrameError, Head, CHUNK_FIELDS, CHUNK_HEAD, CHUNK_KIND};

/// The bytes of a tag.
pub const TAG: usize = 16;

/// One direction of a connection: keyed (TCP, after the handshake) or plain (the node's Unix socket,
/// whose peer the kernel names).
#[derive(Clone, Default)]
pub struct Seal {
    keyed: Option<Keyed>,
}

#[derive(Clone)]
struct Keyed {
    key: [u8; 32],
    /// The place of the next frame in this direction.
    seq: u64,
}

/// Both directions of a connection, from one side's point of view.
#[derive(Clone, Debug, Default)]
pub struct Seals {
    /// For the frames this side writes.
    pub send: Seal,
    /// For the frames this side reads.
    pub recv: Seal,
}

impl Seals {
    /// The keys of one side of a connection that proved the token: `send` for what it writes, `recv` for
    /// what it reads.
    pub fn keyed(send: [u8; 32], recv: [u8; 32]) -> Seals {
        Seals { send: Seal::keyed(send), recv: Seal::keyed(recv) }
    }
}

impl Seal {
    /// Frames as they are, with no tag: the node's Unix socket.
    pub fn plain() -> Seal {
        Seal { keyed: None }
    }

    /// Frames tagged under `key`, from the first frame after the handshake.
    pub fn keyed(key: [u8; 32]) -> Seal {
        Seal { keyed: Some(Keyed { key, seq: 0 }) }
    }

    /// Whether frames carry tags.
    pub fn is_keyed(&self) -> bool {
        self.keyed.is_some()
    }

    /// The bytes a frame's length prefix and tag take before its body.
    pub fn prefix_len(&self) -> usize {
        if self.is_keyed() {
            4 + TAG
        } else {
            4
        }
    }

    /// Appends the wire form of `frame` (prefix, tag where keyed, body) to `out`.
    pub fn encode(&mut self, frame: &Frame, out: &mut Vec<u8>) {
        if let Frame::Chunk { id, offset, data } = frame {
            // Built from its head, so that a 1 MiB chunk is not moved to make room for the tag.
            let data = &data[..data.len().min(wire::CHUNK)];
            out.extend_from_slice(&self.chunk_head(*id, *offset, data.len()));
            out.extend_from_slice(data);
            return;
        }
        let start = out.len();
        wire::encode(frame, out);
        if let Some(k) = &mut self.keyed {
            let prefix: [u8; 4] = out[start..start + 4].try_into().expect("4 bytes");
            let tag = k.next_tag(&prefix, &out[start + 4..]);
            out.splice(start + 4..start + 4, tag);
        }
    }

    /// The wire form of `frame`.
    pub fn bytes_of(&mut self, frame: &Frame) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode(frame, &mut out);
        out
    }

    /// The wire form of a [`Frame::Chunk`] of `len` bytes up to its data (see [`wire::chunk_head`]), its
    /// tag included where keyed.
    pub fn chunk_head(&mut self, id: u32, offset: u64, len: usize) -> Vec<u8> {
        let head = wire::chunk_head(id, offset, len);
        let Some(k) = &mut self.keyed else { return head.to_vec() };
        let prefix: [u8; 4] = head[..4].try_into().expect("4 bytes");
        let tag = k.next_tag(&prefix, &head[4..]);
        let mut out = Vec::with_capacity(CHUNK_HEAD + TAG);
        out.extend_from_slice(&prefix);
        out.extend_from_slice(&tag);
        out.extend_from_slice(&head[4..]);
        out
    }

    /// Checks the tag of the next frame read: `prefix` is its length prefix and tag as read, `body` the
    /// body (for a chunk, what its tag covers: [`covered`]). Plain: nothing to check.
    pub fn check(&mut self, prefix: &[u8], body: &[u8]) -> Result<(), FrameError> {
        let Some(k) = &mut self.keyed else { return Ok(()) };
        let seq = k.seq;
        let len: [u8; 4] = prefix[..4].try_into().expect("a length prefix");
        let want = k.next_tag(&len, covered(body));
        // Compared without an early exit, so that the time taken says nothing about where they differ.
        let diff = want.iter().zip(&prefix[4..4 + TAG]).fold(0u8, |d, (a, b)| d | (a ^ b));
        if diff != 0 {
            return Err(FrameError::Forged { seq });
        }
        Ok(())
    }

    /// Writes one frame.
    pub fn write_frame<W: Write>(&mut self, w: &mut W, frame: &Frame) -> io::Result<()> {
        w.write_all(&self.bytes_of(frame))?;
        w.flush()
    }

    /// Reads one frame whole (a chunk's data too); `Ok(None)` at a clean end of stream (between frames).
    pub fn read_frame<R: Read>(&mut self, r: &mut R) -> io::Result<Option<Frame>> {
        match self.read_head(r)? {
            None => Ok(None),
            Some(Head::Frame(f)) => Ok(Some(f)),
            Some(Head::Chunk { id, offset, len }) => {
                let mut data = vec![0u8; len];
                r.read_exact(&mut data)?;
                Ok(Some(Frame::Chunk { id, offset, data }))
            }
        }
    }

    /// Reads one frame, but only the header of a chunk (see [`wire::read_head`]), once its tag is checked.
    pub fn read_head<R: Read>(&mut self, r: &mut R) -> io::Result<Option<Head>> {
        if !self.is_keyed() {
            return wire::read_head(r);
        }
        let mut prefix = [0u8; 4 + TAG];
        match r.read_exact(&mut prefix[..4]) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        }
        let len = wire::body_len(prefix[..4].try_into().expect("4 bytes")).map_err(wire::invalid)?;
        if len == 0 {
            return Err(wire::invalid(FrameError::Empty));
        }
        r.read_exact(&mut prefix[4..])?;
        let mut kind = [0u8; 1];
        r.read_exact(&mut kind)?;
        if kind[0] == CHUNK_KIND {
            if len < CHUNK_FIELDS {
                return Err(wire::invalid(FrameError::Truncated { field: "chunk" }));
            }
            let mut fields = [0u8; CHUNK_FIELDS];
            fields[0] = CHUNK_KIND;
            r.read_exact(&mut fields[1..])?;
            self.check(&prefix, &fields).map_err(wire::invalid)?;
            return wire::chunk_of(len, &fields).map(Some);
        }
        let mut body = vec![0u8; len];
        body[0] = kind[0];
        r.read_exact(&mut body[1..])?;
        self.open(&prefix, &body).map(|f| Some(Head::Frame(f)))
    }

    /// The frame a whole `body` read after `prefix` (length and tag) holds, once its tag is checked: how a
    /// reader that reads bodies itself (the agent's async I/O) takes a frame.
    pub fn open(&mut self, prefix: &[u8], body: &[u8]) -> io::Result<Frame> {
        self.check(prefix, body).map_err(wire::invalid)?;
        wire::parse(body).map_err(wire::invalid)
    }
}

impl std::fmt::Debug for Seal {
    /// The frame count, never the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.keyed {
            Some(k) => write!(f, "Seal::keyed(frame {})", k.seq),
            None => f.write_str("Seal::plain"),
        }
    }
}

impl Keyed {
    /// The tag of the next frame in this direction, which it moves past.
    fn next_tag(&mut self, len: &[u8; 4], covered: &[u8]) -> [u8; TAG] {
        let mut mac = blake3::Hasher::new_keyed(&self.key);
        mac.update(&self.seq.to_be_bytes());
        mac.update(len);
        mac.update(covered);
        self.seq += 1;
        mac.finalize().as_bytes()[..TAG].try_into().expect("TAG bytes")
    }
}

/// What a frame's tag covers of its `body`: all of it, but only the header of a chunk.
pub fn covered(body: &[u8]) -> &[u8] {
    if body.first() == Some(&CHUNK_KIND) {
        &body[..body.len().min(CHUNK_FIELDS)]
    } else {
        body
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (Seal, Seal) {
        (Seal::keyed([7; 32]), Seal::keyed([7; 32]))
    }

    fn sent(seal: &mut Seal, frames: &[Frame]) -> Vec<u8> {
        let mut out = Vec::new();
        for f in frames {
            seal.encode(f, &mut out);
        }
        out
    }

    fn received(seal: &mut Seal, mut wire: &[u8]) -> io::Result<Vec<Frame>> {
        let mut frames = Vec::new();
        while let Some(f) = seal.read_frame(&mut wire)? {
            frames.push(f);
        }
        Ok(frames)
    }

    fn some_frames() -> Vec<Frame> {
        vec![
            Frame::Found { id: 1, identity: crate::index::SourceId::default() },
            Frame::Vouch { id: 1, offset: 0, cv: [3; 32] },
            Frame::Chunk { id: 1, offset: 0, data: vec![5; 1000] },
            Frame::Done { id: 1, hash: [9; 32] },
        ]
    }

    #[test]
    fn tagged_frames_are_read_back_as_sent() {
        let (mut a, mut b) = pair();
        let wire = sent(&mut a, &some_frames());
        assert_eq!(received(&mut b, &wire).unwrap(), some_frames());
        // The same frames plain: no tag, as the node's socket has always had them.
        let plain = sent(&mut Seal::plain(), &some_frames());
        assert_eq!(plain.len() + 4 * TAG, wire.len());
        assert_eq!(received(&mut Seal::plain(), &plain).unwrap(), some_frames());
    }

    #[test]
    fn a_changed_byte_is_refused_except_in_a_chunks_data() {
        let wire = sent(&mut pair().0, &some_frames());
        let data_at = {
            let mut s = Seal::keyed([7; 32]);
            let mut first_two = Vec::new();
            s.encode(&some_frames()[0], &mut first_two);
            s.encode(&some_frames()[1], &mut first_two);
            first_two.len() + CHUNK_HEAD + TAG
        };
        for at in 0..wire.len() {
            let mut changed = wire.clone();
            changed[at] ^= 0x40;
            let got = received(&mut pair().1, &changed);
            if (data_at..data_at + 1000).contains(&at) {
                // Left to the blake3 of the transfer, which its Done frame carries under a tag.
                assert_ne!(got.unwrap(), some_frames(), "byte {at}");
            } else {
                assert!(got.is_err(), "a change of byte {at} went through");
            }
        }
    }

    #[test]
    fn a_replayed_reordered_or_dropped_frame_is_refused() {
        let (mut a, _) = pair();
        let one = a.bytes_of(&Frame::Credit { id: 1, more: 1 });
        let two = a.bytes_of(&Frame::Credit { id: 1, more: 2 });
        let forged = |wire: Vec<u8>| {
            let e = received(&mut pair().1, &wire).unwrap_err();
            assert!(e.to_string().contains("does not carry the tag"), "{e}");
        };
        forged([one.clone(), one.clone()].concat());
        forged([two.clone(), one.clone()].concat());
        forged(two.clone());
        // Under another connection's key, the same frame is a stranger's.
        let other = Seal::keyed([8; 32]).bytes_of(&Frame::Credit { id: 1, more: 1 });
        forged(other);
        // An untagged frame on a keyed connection.
        let plain = Seal::plain().bytes_of(&Frame::Credit { id: 1, more: 1 });
        assert!(received(&mut pair().1, &plain).is_err());
    }

    #[test]
    fn a_chunk_head_sent_on_its_own_reads_as_the_chunk() {
        let (mut a, mut b) = pair();
        let mut wire = a.chunk_head(4, 1 << 20, 3);
        wire.extend_from_slice(b"abc");
        assert_eq!(
            received(&mut b, &wire).unwrap(),
            vec![Frame::Chunk { id: 4, offset: 1 << 20, data: b"abc".to_vec() }]
        );
    }
}
