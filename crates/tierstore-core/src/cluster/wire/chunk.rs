//! The data frame's head on its own: an agent writes a chunk's head and then sends the bytes from a file
//! straight into the socket; a reader reads the head and then receives the bytes straight where they go.
//! Neither end copies a chunk through a frame value.

use std::io::{self, Read};

use super::parse::{body_len, invalid, parse};
use super::{kind, Frame, FrameError, CHUNK};

/// The bytes of a [`Frame::Chunk`] before its data, length prefix included.
pub const CHUNK_HEAD: usize = 4 + 1 + 4 + 8 + 4;

/// The wire form of a [`Frame::Chunk`] of `len` bytes up to its data, which follow it on the wire: how an
/// agent sends a chunk whose bytes go from a file straight into the socket, never through a `Vec`.
pub fn chunk_head(id: u32, offset: u64, len: usize) -> [u8; CHUNK_HEAD] {
    debug_assert!(len <= CHUNK);
    let mut h = [0u8; CHUNK_HEAD];
    h[..4].copy_from_slice(&((CHUNK_HEAD - 4 + len) as u32).to_be_bytes());
    h[4] = kind::CHUNK;
    h[5..9].copy_from_slice(&id.to_be_bytes());
    h[9..17].copy_from_slice(&offset.to_be_bytes());
    h[17..].copy_from_slice(&(len as u32).to_be_bytes());
    h
}

/// A frame as [`read_head`] reads it: a chunk's data is left in the stream for the caller.
#[derive(Debug, PartialEq, Eq)]
pub enum Head {
    /// A [`Frame::Chunk`] whose `len` bytes of data come next in the stream: the caller reads exactly
    /// them, into where they go.
    Chunk {
        /// The transfer.
        id: u32,
        /// Where the bytes go.
        offset: u64,
        /// How many bytes follow (checked: at most [`CHUNK`], and what the frame's length announced).
        len: usize,
    },
    /// Any other frame, read and parsed whole.
    Frame(Frame),
}

/// Reads one frame, but only the header of a chunk: its data can then be read straight into its
/// destination, with no buffer in between. `Ok(None)` at a clean end of stream (between frames).
pub fn read_head<R: Read>(r: &mut R) -> io::Result<Option<Head>> {
    let mut start = [0u8; 5];
    match r.read_exact(&mut start[..4]) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = body_len(start[..4].try_into().expect("4 bytes")).map_err(invalid)?;
    if len == 0 {
        return Err(invalid(FrameError::Empty));
    }
    r.read_exact(&mut start[4..])?;
    if start[4] == CHUNK_KIND {
        if len < CHUNK_FIELDS {
            return Err(invalid(FrameError::Truncated { field: "chunk" }));
        }
        let mut fields = [0u8; CHUNK_FIELDS];
        fields[0] = CHUNK_KIND;
        r.read_exact(&mut fields[1..])?;
        return chunk_of(len, &fields).map(Some);
    }
    let mut body = vec![0u8; len];
    body[0] = start[4];
    r.read_exact(&mut body[1..])?;
    parse(&body).map(|f| Some(Head::Frame(f))).map_err(invalid)
}

/// The kind byte of a [`Frame::Chunk`].
pub const CHUNK_KIND: u8 = kind::CHUNK;

/// The bytes of a chunk's body before its data: the kind, the transfer, the offset and the length.
pub const CHUNK_FIELDS: usize = CHUNK_HEAD - 4;

/// The [`Head::Chunk`] that `fields` (a chunk body's first [`CHUNK_FIELDS`] bytes) describe, in a body of
/// `len` bytes.
pub fn chunk_of(len: usize, fields: &[u8; CHUNK_FIELDS]) -> io::Result<Head> {
    let id = u32::from_be_bytes(fields[1..5].try_into().expect("4 bytes"));
    let offset = u64::from_be_bytes(fields[5..13].try_into().expect("8 bytes"));
    let n = u32::from_be_bytes(fields[13..].try_into().expect("4 bytes")) as usize;
    if n > CHUNK {
        return Err(invalid(FrameError::BigChunk(n)));
    }
    let announced = len - CHUNK_FIELDS;
    match announced.cmp(&n) {
        std::cmp::Ordering::Equal => Ok(Head::Chunk { id, offset, len: n }),
        std::cmp::Ordering::Less => Err(invalid(FrameError::Truncated { field: "data" })),
        std::cmp::Ordering::Greater => Err(invalid(FrameError::Trailing(announced - n))),
    }
}
