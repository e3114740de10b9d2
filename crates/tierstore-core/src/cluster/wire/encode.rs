//! Frames into bytes: the one encoder both ends use ([`encode`]), and [`write_frame`] for a blocking stream.

use std::io::{self, Write};

use super::{kind, Frame, CHUNK, MAX_FRAME, MAX_RANGES, MAX_TEXT};

/// Appends the wire form of `frame` (length prefix included) to `out`.
// Long on purpose: one arm per frame kind, in the order of `kind`, so that each frame's layout reads in
// one place beside the others (and beside `parse`'s arm for it).
pub fn encode(frame: &Frame, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    let text = |out: &mut Vec<u8>, s: &str| {
        let b = &s.as_bytes()[..s.len().min(MAX_TEXT)];
        out.extend_from_slice(&(b.len() as u16).to_be_bytes());
        out.extend_from_slice(b);
    };
    match frame {
        Frame::Challenge { version, nonce } => {
            out.push(kind::CHALLENGE);
            out.push(*version);
            out.extend_from_slice(nonce);
        }
        Frame::Hello { version, node, nonce, proof } => {
            out.push(kind::HELLO);
            out.push(*version);
            text(out, node);
            out.extend_from_slice(nonce);
            out.extend_from_slice(proof);
        }
        Frame::Welcome { node, proof, encrypt } => {
            out.push(kind::WELCOME);
            text(out, node);
            out.extend_from_slice(proof);
            out.push(u8::from(*encrypt));
        }
        Frame::Ping { nonce } => {
            out.push(kind::PING);
            out.extend_from_slice(&nonce.to_be_bytes());
        }
        Frame::Pong { nonce } => {
            out.push(kind::PONG);
            out.extend_from_slice(&nonce.to_be_bytes());
        }
        Frame::Status => out.push(kind::STATUS),
        Frame::StatusReport { json } => {
            out.push(kind::STATUS_REPORT);
            // A report can be longer than a text field.
            let b = &json.as_bytes()[..json.len().min(MAX_FRAME - 5)];
            out.extend_from_slice(&(b.len() as u32).to_be_bytes());
            out.extend_from_slice(b);
        }
        Frame::Stop => out.push(kind::STOP),
        Frame::Stopping => out.push(kind::STOPPING),
        Frame::Fetch { id, source, rel, credit } => {
            out.push(kind::FETCH);
            out.extend_from_slice(&id.to_be_bytes());
            text(out, source);
            text(out, rel);
            out.extend_from_slice(&credit.to_be_bytes());
        }
        Frame::FetchRanges { id, source, rel, ranges, credit, unhashed } => {
            out.push(kind::FETCH_RANGES);
            out.extend_from_slice(&id.to_be_bytes());
            text(out, source);
            text(out, rel);
            let fit = &ranges[..ranges.len().min(MAX_RANGES)];
            out.extend_from_slice(&(fit.len() as u32).to_be_bytes());
            for (offset, len) in fit {
                out.extend_from_slice(&offset.to_be_bytes());
                out.extend_from_slice(&len.to_be_bytes());
            }
            out.extend_from_slice(&credit.to_be_bytes());
            out.push(u8::from(*unhashed));
        }
        Frame::Found { id, identity: i } => {
            out.push(kind::FOUND);
            out.extend_from_slice(&id.to_be_bytes());
            for x in [i.size, i.mtime_ns as u64, i.ctime_ns as u64, i.ino, i.dev] {
                out.extend_from_slice(&x.to_be_bytes());
            }
            match &i.attrs {
                None => out.push(0),
                Some(a) => {
                    out.push(if a.canonical { 2 } else { 1 });
                    out.extend_from_slice(&a.mode.to_be_bytes());
                    out.extend_from_slice(&a.uid.to_be_bytes());
                    out.extend_from_slice(&a.gid.to_be_bytes());
                    for x in [a.nlink, a.atime_ns as u64, a.blksize, a.blocks] {
                        out.extend_from_slice(&x.to_be_bytes());
                    }
                }
            }
        }
        Frame::Chunk { id, offset, data } => {
            out.push(kind::CHUNK);
            out.extend_from_slice(&id.to_be_bytes());
            out.extend_from_slice(&offset.to_be_bytes());
            let d = &data[..data.len().min(CHUNK)];
            out.extend_from_slice(&(d.len() as u32).to_be_bytes());
            out.extend_from_slice(d);
        }
        Frame::Credit { id, more } => {
            out.push(kind::CREDIT);
            out.extend_from_slice(&id.to_be_bytes());
            out.extend_from_slice(&more.to_be_bytes());
        }
        Frame::Done { id, hash } => {
            out.push(kind::DONE);
            out.extend_from_slice(&id.to_be_bytes());
            out.extend_from_slice(hash);
        }
        Frame::Members => out.push(kind::MEMBERS),
        Frame::MemberList { members } => {
            out.push(kind::MEMBER_LIST);
            // Whole names only, as many as fit in a frame.
            let mut room = MAX_FRAME - 5;
            let fit: Vec<&String> = members
                .iter()
                .take_while(|m| {
                    let need = 2 + m.len().min(MAX_TEXT);
                    let ok = need <= room;
                    room = room.saturating_sub(need);
                    ok
                })
                .collect();
            out.extend_from_slice(&(fit.len() as u32).to_be_bytes());
            for m in fit {
                text(out, m);
            }
        }
        Frame::Damaged { id, source, rel } => {
            out.push(kind::DAMAGED);
            out.extend_from_slice(&id.to_be_bytes());
            text(out, source);
            text(out, rel);
        }
        Frame::Vouch { id, offset, cv } => {
            out.push(kind::VOUCH);
            out.extend_from_slice(&id.to_be_bytes());
            out.extend_from_slice(&offset.to_be_bytes());
            out.extend_from_slice(cv);
        }
        Frame::Checked { id, removed } => {
            out.push(kind::CHECKED);
            out.extend_from_slice(&id.to_be_bytes());
            out.push(u8::from(*removed));
        }
        Frame::Error { code, message } => {
            out.push(kind::ERROR);
            out.extend_from_slice(&(*code as u16).to_be_bytes());
            text(out, message);
        }
        Frame::KeyShare { public } => {
            out.push(kind::KEY_SHARE);
            out.extend_from_slice(public);
        }
        Frame::StagedFetch { id, path, credit } => {
            out.push(kind::STAGED_FETCH);
            out.extend_from_slice(&id.to_be_bytes());
            text(out, path);
            out.extend_from_slice(&credit.to_be_bytes());
        }
        Frame::StreamRequest { json } | Frame::StreamEvent { json } => {
            out.push(if matches!(frame, Frame::StreamRequest { .. }) {
                kind::STREAM_REQUEST
            } else {
                kind::STREAM_EVENT
            });
            // Longer than a text field: a u32 length, as a status report.
            let b = &json.as_bytes()[..json.len().min(MAX_FRAME - 5)];
            out.extend_from_slice(&(b.len() as u32).to_be_bytes());
            out.extend_from_slice(b);
        }
    }
    let len = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&len.to_be_bytes());
}

/// Writes one frame.
pub fn write_frame<W: Write>(w: &mut W, frame: &Frame) -> io::Result<()> {
    let mut out = Vec::new();
    encode(frame, &mut out);
    w.write_all(&out)?;
    w.flush()
}
