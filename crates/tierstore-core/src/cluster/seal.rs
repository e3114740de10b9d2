//! Frames that cannot be changed on the way, and with `[cluster] encrypt` cannot be read either: after the
//! handshake (see [`super::session`]) every frame of a TCP connection carries a tag, under a key of its
//! direction derived from the job's token, the address dialed and both nonces of this connection, over the
//! frame's place in its direction, its length and its body. A frame changed, dropped, reordered, replayed
//! from another connection or injected by anything on the path does not carry the tag its receiver
//! expects, and the receiver closes the connection.
//!
//! ```text
//! plain (the node's Unix socket):    len u32 ‖ body
//! tagged (TCP, after the handshake): len u32 ‖ tag[16] ‖ body
//!                                    tag = blake3_keyed(key of the direction, seq u64 ‖ len ‖ body)[..16]
//! encrypted ([cluster] encrypt):     len u32 ‖ tag[16] ‖ AES-256-GCM(body), nonce = seq, additional data = len
//! ```
//!
//! A tagged [`Frame::Chunk`]'s tag covers its header (kind, transfer, offset, length), not its data: the
//! data go from a copy's descriptor straight into the socket (`sendfile`), and the reader checks every
//! byte against the blake3 the transfer ends with ([`Frame::Done`]) or the chaining values vouched for its
//! pieces ([`Frame::Vouch`]), frames whose tags do cover them; data changed on the way fail that check and
//! are never used. Parts read without a hash are checked by the caller against a hash it already trusts.
//!
//! Encryption covers every byte of every body, chunks' data included, so an encrypted connection sends
//! no chunk with `sendfile`. Its keys come from an X25519 exchange of fresh keys ([`Frame::KeyShare`], see
//! [`Seals::encrypt`]) mixed with the tag keys: a recording of the connection stays unreadable to anyone
//! who learns the token later.

use std::io::{self, Read, Write};

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};

use super::wire::{self, Frame, FrameError, Head, CHUNK_FIELDS, CHUNK_KIND};

/// The bytes of a tag.
pub const TAG: usize = 16;

/// One direction of a connection: plain (the node's Unix socket, whose peer the kernel names), tagged
/// (TCP, after the handshake) or encrypted (`[cluster] encrypt`, after the key exchange).
#[derive(Default)]
pub struct Seal {
    mode: Mode,
    /// The place of the next frame in this direction.
    seq: u64,
    /// The data of the last chunk [`Seal::read_head`] decrypted, for [`Seal::take_data`].
    decrypted: Option<Vec<u8>>,
}

#[derive(Default)]
enum Mode {
    #[default]
    Plain,
    Tagged([u8; 32]),
    // Boxed: an AES key schedule is some 500 bytes, and most connections never encrypt.
    Encrypted(Box<LessSafeKey>),
}

/// Both directions of a connection, from one side's point of view.
#[derive(Debug, Default)]
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

    /// Switches both directions from tags to encryption, under keys mixed from their tag keys and
    /// `secret` (the X25519 secret both sides agreed on, over key shares sent under the tags). Both sides
    /// call it right after the key shares, so their frame counts agree. Plain seals stay plain.
    pub fn encrypt(&mut self, secret: &[u8]) {
        for seal in [&mut self.send, &mut self.recv] {
            if let Mode::Tagged(tag_key) = &seal.mode {
                let mut mix = blake3::Hasher::new_keyed(tag_key);
                mix.update(b"tierstore frame encryption v5");
                mix.update(secret);
                let key = UnboundKey::new(&AES_256_GCM, mix.finalize().as_bytes()).expect("a 32-byte key");
                seal.mode = Mode::Encrypted(Box::new(LessSafeKey::new(key)));
            }
        }
    }

    /// Whether frames are encrypted.
    pub fn encrypted(&self) -> bool {
        self.send.is_encrypted()
    }
}

impl Seal {
    /// Frames as they are, with no tag: the node's Unix socket.
    pub fn plain() -> Seal {
        Seal::default()
    }

    /// Frames tagged under `key`, from the first frame after the handshake.
    pub fn keyed(key: [u8; 32]) -> Seal {
        Seal { mode: Mode::Tagged(key), ..Seal::default() }
    }

    /// Whether frames carry tags (encrypted frames do too).
    pub fn is_keyed(&self) -> bool {
        !matches!(self.mode, Mode::Plain)
    }

    /// Whether frames are encrypted: no chunk may then go out with `sendfile`.
    pub fn is_encrypted(&self) -> bool {
        matches!(self.mode, Mode::Encrypted(_))
    }

    /// The bytes a frame's length prefix and tag take before its body.
    pub fn prefix_len(&self) -> usize {
        if self.is_keyed() {
            4 + TAG
        } else {
            4
        }
    }

    /// Appends the wire form of `frame` (prefix, tag where keyed, body, encrypted where encrypting) to
    /// `out`.
    pub fn encode(&mut self, frame: &Frame, out: &mut Vec<u8>) {
        if !self.is_keyed() {
            return wire::encode(frame, out);
        }
        // Room for the tag first, then the frame; the length prefix then goes in front of the room (a
        // move of 20 bytes, where making room after it would move the whole body).
        let start = out.len();
        out.resize(start + TAG, 0);
        wire::encode(frame, out);
        out[start..start + 4 + TAG].rotate_left(TAG);
        let (prefix, body) = out[start..].split_at_mut(4 + TAG);
        let len: [u8; 4] = prefix[..4].try_into().expect("4 bytes");
        let tag = self.next_tag(&len, body);
        prefix[4..].copy_from_slice(&tag);
    }

    /// The wire form of `frame`.
    pub fn bytes_of(&mut self, frame: &Frame) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode(frame, &mut out);
        out
    }

    /// The wire form of a [`Frame::Chunk`] of `len` bytes up to its data (see [`wire::chunk_head`]), its
    /// tag included where keyed: how a chunk goes out with `sendfile`. Not for an encrypted connection,
    /// whose chunks go out whole through [`Seal::encode`].
    pub fn chunk_head(&mut self, id: u32, offset: u64, len: usize) -> Vec<u8> {
        assert!(!self.is_encrypted(), "an encrypted connection sends no chunk with sendfile");
        let head = wire::chunk_head(id, offset, len);
        if !self.is_keyed() {
            return head.to_vec();
        }
        let mut out = Vec::with_capacity(head.len() + TAG);
        out.extend_from_slice(&head[..4]);
        out.extend_from_slice(&[0; TAG]);
        out.extend_from_slice(&head[4..]);
        let (prefix, fields) = out.split_at_mut(4 + TAG);
        let len: [u8; 4] = prefix[..4].try_into().expect("4 bytes");
        let tag = self.next_tag(&len, fields);
        prefix[4..].copy_from_slice(&tag);
        out
    }

    /// The tag of the next frame in this direction, which it moves past: the blake3 tag of what `body`
    /// covers, or, encrypting, the AEAD's tag of `body` encrypted in place.
    fn next_tag(&mut self, len: &[u8; 4], body: &mut [u8]) -> [u8; TAG] {
        let seq = self.seq;
        self.seq += 1;
        match &self.mode {
            Mode::Plain => [0; TAG],
            Mode::Tagged(key) => blake3_tag(key, seq, len, covered(body)),
            Mode::Encrypted(key) => {
                let tag = key.seal_in_place_separate_tag(nonce(seq), Aad::from(len), body).expect("a frame's size");
                tag.as_ref().try_into().expect("TAG bytes")
            }
        }
    }

    /// Checks the tag of the next frame read, and decrypts it where encrypted: `prefix` is its length
    /// prefix and tag as read, `body` the body (for a tagged chunk, at least what its tag covers:
    /// [`covered`]). Plain: nothing to check.
    pub fn check(&mut self, prefix: &[u8], body: &mut [u8]) -> Result<(), FrameError> {
        let seq = self.seq;
        let len: [u8; 4] = prefix[..4].try_into().expect("a length prefix");
        let ok = match &self.mode {
            Mode::Plain => return Ok(()),
            Mode::Tagged(key) => {
                let want = blake3_tag(key, seq, &len, covered(body));
                // Compared without an early exit, so that the time taken says nothing of where they differ.
                want.iter().zip(&prefix[4..4 + TAG]).fold(0u8, |d, (a, b)| d | (a ^ b)) == 0
            }
            Mode::Encrypted(key) => {
                let tag: [u8; TAG] = prefix[4..4 + TAG].try_into().expect("TAG bytes");
                key.open_in_place_separate_tag(nonce(seq), Aad::from(len), tag.into(), body, 0..).is_ok()
            }
        };
        self.seq += 1;
        if !ok {
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
                self.take_data(r, &mut data)?;
                Ok(Some(Frame::Chunk { id, offset, data }))
            }
        }
    }

    /// Reads one frame, but only the header of a chunk (see [`wire::read_head`]), once its tag is checked:
    /// its data are then taken with [`Seal::take_data`] (or, where [`Seal::take_decrypted`] has none,
    /// straight from the stream).
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
        if self.is_encrypted() {
            // Decrypted whole; a chunk's data wait in `decrypted` for the caller.
            let mut body = vec![0u8; len];
            r.read_exact(&mut body)?;
            self.check(&prefix, &mut body).map_err(wire::invalid)?;
            if body[0] == CHUNK_KIND && len >= CHUNK_FIELDS {
                let fields: [u8; CHUNK_FIELDS] = body[..CHUNK_FIELDS].try_into().expect("chunk fields");
                let head = wire::chunk_of(len, &fields)?;
                body.drain(..CHUNK_FIELDS);
                self.decrypted = Some(body);
                return Ok(Some(head));
            }
            return wire::parse(&body).map(|f| Some(Head::Frame(f))).map_err(wire::invalid);
        }
        let mut kind = [0u8; 1];
        r.read_exact(&mut kind)?;
        if kind[0] == CHUNK_KIND {
            if len < CHUNK_FIELDS {
                return Err(wire::invalid(FrameError::Truncated { field: "chunk" }));
            }
            let mut fields = [0u8; CHUNK_FIELDS];
            fields[0] = CHUNK_KIND;
            r.read_exact(&mut fields[1..])?;
            self.check(&prefix, &mut fields).map_err(wire::invalid)?;
            return wire::chunk_of(len, &fields).map(Some);
        }
        let mut body = vec![0u8; len];
        body[0] = kind[0];
        r.read_exact(&mut body[1..])?;
        self.open(&prefix, &mut body).map(|f| Some(Head::Frame(f)))
    }

    /// The data of the chunk whose head [`Seal::read_head`] just returned, where it decrypted them; `None`
    /// where they are still in the stream.
    pub fn take_decrypted(&mut self) -> Option<Vec<u8>> {
        self.decrypted.take()
    }

    /// Takes the data of the chunk whose head [`Seal::read_head`] just returned into `to` (its length).
    pub fn take_data<R: Read>(&mut self, r: &mut R, to: &mut [u8]) -> io::Result<()> {
        match self.decrypted.take() {
            Some(d) if d.len() == to.len() => {
                to.copy_from_slice(&d);
                Ok(())
            }
            Some(d) => {
                Err(wire::invalid(FrameError::Truncated { field: if d.len() < to.len() { "data" } else { "chunk" } }))
            }
            None => r.read_exact(to),
        }
    }

    /// The frame a whole `body` read after `prefix` (length and tag) holds, once its tag is checked (and
    /// the body decrypted, in place): how a reader that reads bodies itself (the agent's async I/O) takes
    /// a frame.
    pub fn open(&mut self, prefix: &[u8], body: &mut [u8]) -> io::Result<Frame> {
        self.check(prefix, body).map_err(wire::invalid)?;
        wire::parse(body).map_err(wire::invalid)
    }
}

impl std::fmt::Debug for Seal {
    /// The mode and the frame count, never a key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mode = match self.mode {
            Mode::Plain => "plain",
            Mode::Tagged(_) => "tagged",
            Mode::Encrypted(_) => "encrypted",
        };
        write!(f, "Seal({mode}, frame {})", self.seq)
    }
}

/// `blake3_keyed(key, seq ‖ len ‖ covered)[..TAG]`.
fn blake3_tag(key: &[u8; 32], seq: u64, len: &[u8; 4], covered: &[u8]) -> [u8; TAG] {
    let mut mac = blake3::Hasher::new_keyed(key);
    mac.update(&seq.to_be_bytes());
    mac.update(len);
    mac.update(covered);
    mac.finalize().as_bytes()[..TAG].try_into().expect("TAG bytes")
}

/// The AEAD nonce of frame `seq`: never the same twice under one key (each key is one direction of one
/// connection, and `seq` only grows).
fn nonce(seq: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&seq.to_be_bytes());
    Nonce::assume_unique_for_key(n)
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
            first_two.len() + wire::CHUNK_HEAD + TAG
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

    fn encrypted_pair() -> (Seals, Seals) {
        let (mut a, mut b) = (Seals::keyed([1; 32], [2; 32]), Seals::keyed([2; 32], [1; 32]));
        a.encrypt(b"the secret both sides agreed on");
        b.encrypt(b"the secret both sides agreed on");
        (a, b)
    }

    #[test]
    fn encrypted_frames_read_back_as_sent_and_show_nothing_of_their_bodies() {
        let (mut a, mut b) = encrypted_pair();
        let frames =
            [some_frames(), vec![Frame::Chunk { id: 2, offset: 0, data: b"a secret tensor".repeat(50) }]].concat();
        let wire = sent(&mut a.send, &frames);
        assert!(!wire.windows(15).any(|w| w == b"a secret tensor"), "plaintext on the wire");
        assert_eq!(received(&mut b.recv, &wire).unwrap(), frames);
        // Chunk data too: every byte of every frame is covered, so any change is refused.
        for at in (0..wire.len()).step_by(7) {
            let mut changed = wire.clone();
            changed[at] ^= 0x01;
            assert!(received(&mut encrypted_pair().1.recv, &changed).is_err(), "a change of byte {at} went through");
        }
    }

    #[test]
    fn another_secret_reads_nothing() {
        let (mut a, _) = encrypted_pair();
        let mut other = Seals::keyed([2; 32], [1; 32]);
        other.encrypt(b"a secret a stranger guessed");
        let wire = a.send.bytes_of(&Frame::Credit { id: 1, more: 1 });
        assert!(received(&mut other.recv, &wire).is_err());
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
