//! Bytes from a stranger into frames: the length is checked before anything is allocated ([`check`],
//! [`body_len`]), then a complete body is decoded by a cursor that refuses to read past its end, and
//! anything left over, unknown or out of bounds is an error ([`parse`]).

use std::io::{self, Read};

use super::{check_abs_path, check_path, kind, ErrorCode, Frame, FrameError, CHUNK, MAX_FRAME, MAX_RANGES};
use crate::index::{SourceAttrs, SourceId};

/// Whether `buf` starts with a whole frame: `Ok(Some(n))` with its length on the wire, `Ok(None)` when
/// more bytes are needed, an error when its announced length is over the limit.
pub fn check(buf: &[u8]) -> Result<Option<usize>, FrameError> {
    let Some(prefix) = buf.get(..4) else { return Ok(None) };
    let len = body_len(prefix.try_into().expect("4 bytes"))?;
    Ok((buf.len() >= 4 + len).then_some(4 + len))
}

/// The body length a prefix announces, if it is within the limit.
pub fn body_len(prefix: [u8; 4]) -> Result<usize, FrameError> {
    let len = u32::from_be_bytes(prefix) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::TooLong { len, max: MAX_FRAME });
    }
    Ok(len)
}

/// A cursor over a frame body that refuses to read past its end.
struct Body<'a> {
    b: &'a [u8],
}

impl<'a> Body<'a> {
    fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], FrameError> {
        if self.b.len() < n {
            return Err(FrameError::Truncated { field });
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }

    fn u8(&mut self, field: &'static str) -> Result<u8, FrameError> {
        Ok(self.take(1, field)?[0])
    }

    fn u16(&mut self, field: &'static str) -> Result<u16, FrameError> {
        Ok(u16::from_be_bytes(self.take(2, field)?.try_into().expect("2 bytes")))
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, FrameError> {
        Ok(u32::from_be_bytes(self.take(4, field)?.try_into().expect("4 bytes")))
    }

    fn u64(&mut self, field: &'static str) -> Result<u64, FrameError> {
        Ok(u64::from_be_bytes(self.take(8, field)?.try_into().expect("8 bytes")))
    }

    fn bytes32(&mut self, field: &'static str) -> Result<[u8; 32], FrameError> {
        Ok(self.take(32, field)?.try_into().expect("32 bytes"))
    }

    fn text_of(&mut self, n: usize, field: &'static str) -> Result<String, FrameError> {
        let b = self.take(n, field)?;
        std::str::from_utf8(b).map(str::to_owned).map_err(|_| FrameError::BadText { field })
    }

    fn text(&mut self, field: &'static str) -> Result<String, FrameError> {
        let n = self.u16(field)? as usize;
        self.text_of(n, field)
    }

    fn end(self) -> Result<(), FrameError> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(FrameError::Trailing(self.b.len()))
        }
    }
}

/// Decodes one frame body (the bytes after the length prefix).
// Long on purpose: one arm per frame kind, each bounded by `Body`'s checked reads, so that a reviewer
// of what a stranger's bytes can do reads every frame's parse in one place.
pub fn parse(body: &[u8]) -> Result<Frame, FrameError> {
    let mut r = Body { b: body };
    let k = r.u8("kind").map_err(|_| FrameError::Empty)?;
    let frame = match k {
        kind::CHALLENGE => Frame::Challenge { version: r.u8("version")?, nonce: r.bytes32("nonce")? },
        kind::HELLO => Frame::Hello {
            version: r.u8("version")?,
            node: r.text("node")?,
            nonce: r.bytes32("nonce")?,
            proof: r.bytes32("proof")?,
        },
        kind::WELCOME => {
            Frame::Welcome { node: r.text("node")?, proof: r.bytes32("proof")?, encrypt: r.u8("encrypt")? != 0 }
        }
        kind::PING => Frame::Ping { nonce: r.u64("nonce")? },
        kind::PONG => Frame::Pong { nonce: r.u64("nonce")? },
        kind::STATUS => Frame::Status,
        kind::STATUS_REPORT => {
            let n = r.u32("json")? as usize;
            Frame::StatusReport { json: r.text_of(n, "json")? }
        }
        kind::STOP => Frame::Stop,
        kind::STOPPING => Frame::Stopping,
        kind::ERROR => Frame::Error { code: ErrorCode::from_u16(r.u16("code")?), message: r.text("message")? },
        kind::FETCH => {
            let (id, source, rel) = (r.u32("id")?, r.text("source")?, r.text("rel")?);
            check_path(&rel)?;
            Frame::Fetch { id, source, rel, credit: r.u32("credit")? }
        }
        kind::FETCH_RANGES => {
            let (id, source, rel) = (r.u32("id")?, r.text("source")?, r.text("rel")?);
            check_path(&rel)?;
            let n = r.u32("ranges")? as usize;
            if n > MAX_RANGES {
                return Err(FrameError::TooManyRanges(n));
            }
            let ranges = (0..n).map(|_| Ok((r.u64("offset")?, r.u64("len")?))).collect::<Result<Vec<_>, _>>()?;
            Frame::FetchRanges { id, source, rel, ranges, credit: r.u32("credit")?, unhashed: r.u8("unhashed")? != 0 }
        }
        kind::FOUND => {
            let id = r.u32("id")?;
            let (size, mtime_ns, ctime_ns) = (r.u64("size")?, r.u64("mtime")? as i64, r.u64("ctime")? as i64);
            let (ino, dev) = (r.u64("ino")?, r.u64("dev")?);
            let attrs = match r.u8("attrs")? {
                0 => None,
                flag @ (1 | 2) => Some(SourceAttrs {
                    mode: r.u32("mode")?,
                    uid: r.u32("uid")?,
                    gid: r.u32("gid")?,
                    nlink: r.u64("nlink")?,
                    atime_ns: r.u64("atime")? as i64,
                    blksize: r.u64("blksize")?,
                    blocks: r.u64("blocks")?,
                    canonical: flag == 2,
                }),
                _ => return Err(FrameError::Truncated { field: "attrs" }),
            };
            Frame::Found { id, identity: SourceId { size, mtime_ns, ctime_ns, ino, dev, attrs } }
        }
        kind::CHUNK => {
            let (id, offset, n) = (r.u32("id")?, r.u64("offset")?, r.u32("data")? as usize);
            if n > CHUNK {
                return Err(FrameError::BigChunk(n));
            }
            Frame::Chunk { id, offset, data: r.take(n, "data")?.to_vec() }
        }
        kind::CREDIT => Frame::Credit { id: r.u32("id")?, more: r.u32("more")? },
        kind::DONE => Frame::Done { id: r.u32("id")?, hash: r.bytes32("hash")? },
        kind::MEMBERS => Frame::Members,
        kind::MEMBER_LIST => {
            let n = r.u32("count")? as usize;
            // Each name takes at least its 2-byte length: a count the body cannot hold is refused
            // before anything is allocated for it.
            if n > r.b.len() / 2 {
                return Err(FrameError::Truncated { field: "members" });
            }
            let mut members = Vec::with_capacity(n);
            for _ in 0..n {
                members.push(r.text("member")?);
            }
            Frame::MemberList { members }
        }
        kind::DAMAGED => {
            let (id, source, rel) = (r.u32("id")?, r.text("source")?, r.text("rel")?);
            check_path(&rel)?;
            Frame::Damaged { id, source, rel }
        }
        kind::VOUCH => Frame::Vouch { id: r.u32("id")?, offset: r.u64("offset")?, cv: r.bytes32("cv")? },
        kind::CHECKED => Frame::Checked { id: r.u32("id")?, removed: r.u8("removed")? != 0 },
        kind::KEY_SHARE => Frame::KeyShare { public: r.bytes32("public")? },
        kind::STAGED_FETCH => {
            let (id, path) = (r.u32("id")?, r.text("path")?);
            check_abs_path(&path)?;
            Frame::StagedFetch { id, path, credit: r.u32("credit")? }
        }
        kind::STREAM_REQUEST => {
            let n = r.u32("json")? as usize;
            Frame::StreamRequest { json: r.text_of(n, "json")? }
        }
        kind::STREAM_EVENT => {
            let n = r.u32("json")? as usize;
            Frame::StreamEvent { json: r.text_of(n, "json")? }
        }
        other => return Err(FrameError::UnknownKind(other)),
    };
    r.end()?;
    Ok(frame)
}

/// A refused frame as an I/O error.
pub fn invalid(e: FrameError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// Reads one frame; `Ok(None)` at a clean end of stream (between frames).
pub fn read_frame<R: Read>(r: &mut R) -> io::Result<Option<Frame>> {
    let mut prefix = [0u8; 4];
    match r.read_exact(&mut prefix) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = body_len(prefix).map_err(invalid)?;
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    parse(&body).map(Some).map_err(invalid)
}
