//! The wire protocol of tierstore's agents: every byte that crosses a process or a node goes in these
//! frames. It lives in the core because both ends speak it: the agent serves files, and the read path
//! of every process asks a peer's agent for them (synchronous I/O here; the agent's async I/O is in
//! `tierstore_agent::protocol`).
//!
//! A frame is a 4-byte big-endian body length, then the body: one kind byte and the kind's fields.
//! Integers are big-endian; text is a 2-byte length then UTF-8. [`check`] reads only the length and
//! refuses a frame over [`MAX_FRAME`] before anything is allocated for it, so a hostile or confused peer
//! costs at most one bounded buffer; [`parse`] then decodes a complete body and refuses anything left
//! over, unknown or out of bounds.
//!
//! A connection opens with the agent's [`Frame::Challenge`] (the protocol version and a fresh nonce), the
//! client's [`Frame::Hello`] (its version, its name, a nonce of its own and, on TCP, its proof of the job's
//! token) and the agent's [`Frame::Welcome`] (its name and, on TCP, its own proof): see
//! [`super::session`], which both ends use. Every request after that gets exactly one answer.

use crate::index::SourceId;

mod chunk;
mod encode;
mod parse;

pub use chunk::{chunk_head, chunk_of, read_head, Head, CHUNK_FIELDS, CHUNK_HEAD, CHUNK_KIND};
pub use encode::{encode, write_frame};
pub use parse::{body_len, check, invalid, parse, read_frame};

/// The protocol version this build speaks. A peer with another one is refused with a clear error.
pub const VERSION: u8 = 5;

/// The largest frame body accepted (a data chunk of 1 MiB and its header, when data frames come).
pub const MAX_FRAME: usize = (1 << 20) + 4096;

/// The largest hello accepted: before a client has proved the token, an agent allocates no more than this
/// for it (a hello is a version, a node name, a nonce and a proof).
pub const MAX_HELLO: usize = 1024;

/// The longest text field.
pub const MAX_TEXT: usize = u16::MAX as usize;

/// The bytes of a file travel in chunks of at most this size.
pub const CHUNK: usize = 1 << 20;

/// The most ranges one [`Frame::FetchRanges`] may ask for (its frame stays well under [`MAX_FRAME`]).
pub const MAX_RANGES: usize = 16_384;

/// The longest source-relative path a request may name.
pub const MAX_PATH: usize = 4096;

/// Why a frame was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    /// The length prefix announces more than [`MAX_FRAME`].
    #[error("frame of {len} bytes announced, more than the limit of {max}")]
    TooLong {
        /// The announced length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The body ends inside a field.
    #[error("frame truncated inside its {field} field")]
    Truncated {
        /// The field being read.
        field: &'static str,
    },
    /// An unknown kind byte.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// Bytes left after the last field.
    #[error("{0} bytes after the end of a frame")]
    Trailing(usize),
    /// A path that is empty, absolute, too long, or climbs out of the source.
    #[error("path {0:?} does not name a file inside the source")]
    BadPath(String),
    /// A chunk longer than [`CHUNK`].
    #[error("a chunk of {0} bytes, more than the limit")]
    BigChunk(usize),
    /// A text field that is not UTF-8.
    #[error("{field} is not UTF-8")]
    BadText {
        /// The field.
        field: &'static str,
    },
    /// A frame with no kind byte.
    #[error("empty frame")]
    Empty,
    /// A [`Frame::FetchRanges`] asking for more than [`MAX_RANGES`] parts.
    #[error("{0} ranges asked for at once, more than the limit of {MAX_RANGES}")]
    TooManyRanges(usize),
    /// A frame of an authenticated connection whose tag does not match (see [`super::seal`]).
    #[error(
        "frame {seq} does not carry the tag of this connection's key: it was changed, dropped, replayed or \
         injected on the way, and the connection is closed"
    )]
    Forged {
        /// Where the frame stands in its direction of the connection.
        seq: u64,
    },
}

/// Error codes of [`Frame::Error`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum ErrorCode {
    /// The peer's proof of the token is wrong, or missing where one is required.
    Unauthorized = 1,
    /// The peer speaks another protocol version.
    Version = 2,
    /// The request is not valid here (a frame a client may not send, or sent out of order).
    BadRequest = 3,
    /// The agent is shutting down.
    ShuttingDown = 4,
    /// The file asked for does not exist at the source.
    NotFound = 5,
    /// The agent could not serve the file (the source failed, or its copy was damaged): read it
    /// from the source.
    Failed = 6,
    /// A code this build does not know (a newer peer).
    Other = 0xffff,
}

impl ErrorCode {
    fn from_u16(v: u16) -> ErrorCode {
        match v {
            1 => ErrorCode::Unauthorized,
            2 => ErrorCode::Version,
            3 => ErrorCode::BadRequest,
            4 => ErrorCode::ShuttingDown,
            5 => ErrorCode::NotFound,
            6 => ErrorCode::Failed,
            _ => ErrorCode::Other,
        }
    }
}

/// One message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// With `[cluster] encrypt`, the first frame each side sends after the welcome: a fresh X25519
    /// public key. Both are tagged under the handshake's keys, so nobody on the path can swap them; from
    /// the next frame on, every frame is encrypted (see [`super::seal`]).
    KeyShare {
        /// The sender's ephemeral public key.
        public: [u8; 32],
    },
    /// The agent's first frame on every connection.
    Challenge {
        /// The agent's protocol version.
        version: u8,
        /// Fresh random bytes both proofs are made of.
        nonce: [u8; 32],
    },
    /// The client's first frame.
    Hello {
        /// The client's protocol version.
        version: u8,
        /// Who the client is (a node name, or "local" for a process of this node).
        node: String,
        /// Fresh random bytes of the client's, which the agent's proof covers.
        nonce: [u8; 32],
        /// The client's proof of the token over both nonces (zeros on the local socket).
        proof: [u8; 32],
    },
    /// The agent accepted the hello.
    Welcome {
        /// The agent's node name.
        node: String,
        /// The agent's proof of the token over both nonces (zeros on the local socket).
        proof: [u8; 32],
        /// The agent encrypts every connection (`[cluster] encrypt`): the client sends a
        /// [`Frame::KeyShare`] before anything else. Covered by the proof, so nobody on the path can
        /// clear it.
        encrypt: bool,
    },
    /// Are you there?
    Ping {
        /// Echoed back.
        nonce: u64,
    },
    /// Yes.
    Pong {
        /// The ping's nonce.
        nonce: u64,
    },
    /// Asks for the agent's status.
    Status,
    /// The agent's status as JSON (see `server::Status`).
    StatusReport {
        /// The JSON text.
        json: String,
    },
    /// Asks the agent to shut down gracefully (local clients only).
    Stop,
    /// The agent is shutting down.
    Stopping,
    /// Asks for a file of a source, in chunks; the asker may hold `credit` chunks unacknowledged. The
    /// agent answers [`Frame::Found`], the chunks in order, then [`Frame::Done`] (or [`Frame::Error`] at
    /// any point). A `credit` of 0 asks only that the agent cache the file: `Found` then `Done`, no chunk.
    Fetch {
        /// The transfer's number, chosen by the asker.
        id: u32,
        /// The source directory, as every node mounts it.
        source: String,
        /// The file, relative to the source (checked by [`check_path`]).
        rel: String,
        /// How many chunks may be sent before the asker grants more.
        credit: u32,
    },
    /// The file's identity at the source, and the rest of its `stat`, sent before its bytes: the asker
    /// never mixes versions, and answers `stat` of its copy as the source would.
    Found {
        /// The transfer.
        id: u32,
        /// The version sent.
        identity: SourceId,
    },
    /// Bytes of the file at `offset`.
    Chunk {
        /// The transfer.
        id: u32,
        /// Where the bytes go.
        offset: u64,
        /// At most [`CHUNK`] bytes.
        data: Vec<u8>,
    },
    /// The asker can take `more` chunks (receiver-driven credit, as DYAD's transfers).
    Credit {
        /// The transfer.
        id: u32,
        /// Chunks granted.
        more: u32,
    },
    /// The blake3 chaining value of the chunk at `offset` (a subtree of the file's hash tree), sent just
    /// before that chunk when the agent sends a copy it is still making from the store: it recorded the
    /// value as it wrote the chunk, so the asker checks the chunk on its own and may use it at once, long
    /// before the copy (and the [`Frame::Done`] whose hash these values merge into) is complete. Sent
    /// for every chunk of such a transfer, or for none (a whole copy is checked at its `Done`).
    Vouch {
        /// The transfer.
        id: u32,
        /// The chunk's offset.
        offset: u64,
        /// Its chaining value.
        cv: [u8; 32],
    },
    /// Every byte was sent; the blake3 of the whole file, for the asker to check.
    Done {
        /// The transfer.
        id: u32,
        /// blake3 of the bytes sent.
        hash: [u8; 32],
    },
    /// Asks the agent of this node for the job's members (where a registry keeps them).
    Members,
    /// The job's members, as `host:port`, sorted (this node's agent included).
    MemberList {
        /// The members.
        members: Vec<String>,
    },
    /// A request failed.
    Error {
        /// What kind of failure.
        code: ErrorCode,
        /// What went wrong and what to do, for a person.
        message: String,
    },
    /// A request of model streaming (`tierstore.stream`), as a JSON object whose `op` names it (the
    /// requests and their fields are `tierstore_agent::stream::Request`). A connection that sends one is
    /// a stream connection from then on: the leases and the publish it holds end with it.
    StreamRequest {
        /// The JSON text.
        json: String,
    },
    /// An answer to a [`Frame::StreamRequest`], or a notice the agent pushes to a subscriber (a new
    /// version), as a JSON object.
    StreamEvent {
        /// The JSON text.
        json: String,
    },
    /// The reader's report that the bytes of transfer `id` (a `Fetch` of `rel`) do not hash to the blake3 the
    /// agent sent with them: the agent sends a copy's bytes without hashing them again, so it checks its
    /// copy against its record now, removes it if it is damaged, and answers [`Frame::Checked`].
    Damaged {
        /// The transfer whose bytes did not match.
        id: u32,
        /// The source directory, as in the `Fetch`.
        source: String,
        /// The file, as in the `Fetch`.
        rel: String,
    },
    /// The answer to [`Frame::Damaged`]: whether the agent found its copy damaged and removed it.
    Checked {
        /// The transfer reported.
        id: u32,
        /// The copy did not match its record and is gone.
        removed: bool,
    },
    /// Asks for parts of a file of a source (a partial model load: the tensors it reads, never the whole
    /// pack). Answered as a [`Frame::Fetch`] is: [`Frame::Found`] with the version the parts come from,
    /// then each range's bytes in the order asked, as chunks at their offsets in the file, then
    /// [`Frame::Done`] with the blake3 of all the bytes sent, in that order. The owner reads the parts from
    /// its whole copy when a tier holds one, else from the store by blocks it keeps for the next asker:
    /// the job reads each block from the store once, whichever nodes ask for it.
    FetchRanges {
        /// The transfer's number, chosen by the asker.
        id: u32,
        /// The source directory, as every node mounts it.
        source: String,
        /// The file, relative to the source (checked by [`check_path`]).
        rel: String,
        /// `(offset, length)` of each part, at most [`MAX_RANGES`] of them.
        ranges: Vec<(u64, u64)>,
        /// How many chunks may be sent before the asker grants more.
        credit: u32,
        /// The asker checks every byte itself (a model's tensors, against their hashes): the agent hashes
        /// nothing and its [`Frame::Done`] carries zeros.
        unhashed: bool,
    },
    /// Asks for a file written on the agent's node under a write-back destination and not yet on the
    /// shared store (its staged, journaled copy). Answered as a [`Frame::Fetch`] is: [`Frame::Found`]
    /// (size, and the time the program closed it as mtime), the chunks, [`Frame::Done`] with the blake3
    /// the journal recorded at close; or [`ErrorCode::NotFound`] when nothing is staged for `path` there
    /// (it is on the store, or was never written on that node). A `credit` of 0 asks only whether it is
    /// staged: `Found` then `Done`, no chunk.
    StagedFetch {
        /// The transfer's number, chosen by the asker.
        id: u32,
        /// The file's absolute path on the shared store (checked by [`check_abs_path`]).
        path: String,
        /// How many chunks may be sent before the asker grants more.
        credit: u32,
    },
}

mod kind {
    pub const CHALLENGE: u8 = 1;
    pub const HELLO: u8 = 2;
    pub const WELCOME: u8 = 3;
    pub const PING: u8 = 4;
    pub const PONG: u8 = 5;
    pub const STATUS: u8 = 6;
    pub const STATUS_REPORT: u8 = 7;
    pub const STOP: u8 = 8;
    pub const STOPPING: u8 = 9;
    pub const ERROR: u8 = 10;
    pub const FETCH: u8 = 11;
    pub const FOUND: u8 = 12;
    pub const CHUNK: u8 = 13;
    pub const CREDIT: u8 = 14;
    pub const DONE: u8 = 15;
    pub const MEMBERS: u8 = 16;
    pub const MEMBER_LIST: u8 = 17;
    pub const DAMAGED: u8 = 18;
    pub const CHECKED: u8 = 19;
    pub const VOUCH: u8 = 20;
    pub const FETCH_RANGES: u8 = 21;
    pub const KEY_SHARE: u8 = 22;
    // Model streaming's frames are numbered from 40, apart from the kinds other jobs add.
    pub const STREAM_REQUEST: u8 = 40;
    pub const STREAM_EVENT: u8 = 41;
    // Write-back staging's frames are numbered from 30.
    pub const STAGED_FETCH: u8 = 30;
}

/// Checks a source-relative path from the network: not empty, not absolute, no `.` or `..` part, no NUL
/// and no empty part, at most [`MAX_PATH`] bytes. A request can never name a file outside its source.
pub fn check_path(rel: &str) -> Result<(), FrameError> {
    let bad = || FrameError::BadPath(rel.chars().take(200).collect());
    if rel.is_empty() || rel.len() > MAX_PATH || rel.starts_with('/') || rel.contains('\0') {
        return Err(bad());
    }
    if rel.split('/').any(|part| part.is_empty() || part == "." || part == "..") {
        return Err(bad());
    }
    Ok(())
}

/// Checks an absolute path from the network (a staged file's place on the shared store): absolute, no
/// `.` or `..` part, no NUL and no empty part, at most [`MAX_PATH`] bytes.
pub fn check_abs_path(path: &str) -> Result<(), FrameError> {
    let bad = || FrameError::BadPath(path.chars().take(200).collect());
    let rel = path.strip_prefix('/').ok_or_else(bad)?;
    check_path(rel).map_err(|_| bad())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::index::SourceAttrs;

    fn any_frame() -> impl Strategy<Value = Frame> {
        let text = "[a-zA-Z0-9 ./é-]{0,40}";
        prop_oneof![
            (any::<u8>(), any::<[u8; 32]>()).prop_map(|(version, nonce)| Frame::Challenge { version, nonce }),
            (any::<u8>(), text, any::<[u8; 32]>(), any::<[u8; 32]>())
                .prop_map(|(version, node, nonce, proof)| Frame::Hello { version, node, nonce, proof }),
            (text, any::<[u8; 32]>(), any::<bool>()).prop_map(|(node, proof, encrypt)| Frame::Welcome {
                node,
                proof,
                encrypt
            }),
            any::<u64>().prop_map(|nonce| Frame::Ping { nonce }),
            any::<u64>().prop_map(|nonce| Frame::Pong { nonce }),
            Just(Frame::Status),
            any::<[u8; 32]>().prop_map(|public| Frame::KeyShare { public }),
            "[ -~]{0,300}".prop_map(|json| Frame::StatusReport { json }),
            Just(Frame::Stop),
            Just(Frame::Stopping),
            (1u16..7, text).prop_map(|(c, message)| Frame::Error { code: ErrorCode::from_u16(c), message }),
            (any::<u32>(), "/[a-z/]{1,30}", "[a-z]{1,8}(/[a-z0-9_-][a-z0-9._-]{0,7}){0,3}", any::<u32>())
                .prop_map(|(id, source, rel, credit)| Frame::Fetch { id, source, rel, credit }),
            (
                any::<u32>(),
                "/[a-z/]{1,30}",
                "[a-z]{1,8}(/[a-z0-9_-][a-z0-9._-]{0,7}){0,3}",
                proptest::collection::vec((any::<u64>(), any::<u64>()), 0..20),
                any::<u32>(),
                any::<bool>()
            )
                .prop_map(|(id, source, rel, ranges, credit, unhashed)| Frame::FetchRanges {
                    id,
                    source,
                    rel,
                    ranges,
                    credit,
                    unhashed
                }),
            (any::<u32>(), any::<u64>(), any::<i64>(), any::<i64>(), any::<u64>(), any::<u64>()).prop_map(
                |(id, size, mtime_ns, ctime_ns, ino, dev)| Frame::Found {
                    id,
                    identity: SourceId { size, mtime_ns, ctime_ns, ino, dev, attrs: None }
                }
            ),
            (any::<u32>(), any::<u64>(), proptest::collection::vec(any::<u8>(), 0..300))
                .prop_map(|(id, offset, data)| Frame::Chunk { id, offset, data }),
            (any::<u32>(), any::<u32>()).prop_map(|(id, more)| Frame::Credit { id, more }),
            (any::<u32>(), any::<[u8; 32]>()).prop_map(|(id, hash)| Frame::Done { id, hash }),
            Just(Frame::Members),
            proptest::collection::vec(text, 0..20).prop_map(|members| Frame::MemberList { members }),
            "[ -~]{0,300}".prop_map(|json| Frame::StreamRequest { json }),
            "[ -~]{0,300}".prop_map(|json| Frame::StreamEvent { json }),
            (any::<u32>(), "/[a-z/]{1,30}", "[a-z]{1,8}(/[a-z0-9_-][a-z0-9._-]{0,7}){0,3}")
                .prop_map(|(id, source, rel)| Frame::Damaged { id, source, rel }),
            (any::<u32>(), any::<bool>()).prop_map(|(id, removed)| Frame::Checked { id, removed }),
            (any::<u32>(), any::<u64>(), any::<[u8; 32]>()).prop_map(|(id, offset, cv)| Frame::Vouch {
                id,
                offset,
                cv
            }),
            (any::<u32>(), "(/[a-z0-9_-][a-z0-9._-]{0,7}){1,4}", any::<u32>())
                .prop_map(|(id, path, credit)| Frame::StagedFetch { id, path, credit }),
        ]
    }

    proptest! {
        #[test]
        fn frames_round_trip(frame in any_frame()) {
            let mut wire = Vec::new();
            encode(&frame, &mut wire);
            prop_assert_eq!(check(&wire), Ok(Some(wire.len())));
            prop_assert_eq!(parse(&wire[4..]), Ok(frame));
        }

        #[test]
        fn any_bytes_parse_or_fail_cleanly(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = parse(&bytes);
            let _ = check(&bytes);
        }

        #[test]
        fn every_truncation_is_refused(frame in any_frame(), cut in 0usize..64) {
            let mut wire = Vec::new();
            encode(&frame, &mut wire);
            let body = &wire[4..];
            if cut < body.len() {
                prop_assert!(parse(&body[..cut]).is_err());
                prop_assert_eq!(check(&wire[..4 + cut]), Ok(None));
            }
        }
    }

    proptest! {
        #[test]
        fn read_head_reads_what_read_frame_reads(frame in any_frame()) {
            let mut wire = Vec::new();
            encode(&frame, &mut wire);
            let mut r = &wire[..];
            let head = read_head(&mut r).unwrap().unwrap();
            match (head, frame) {
                (Head::Chunk { id, offset, len }, Frame::Chunk { id: i, offset: o, data }) => {
                    prop_assert_eq!((id, offset, len), (i, o, data.len()));
                    prop_assert_eq!(r, &data[..]);
                }
                (Head::Frame(got), frame) => {
                    prop_assert_eq!(got, frame);
                    prop_assert!(r.is_empty());
                }
                (head, frame) => prop_assert!(false, "{:?} read as {:?}", frame, head),
            }
        }
    }

    #[test]
    fn a_chunk_head_is_the_start_of_its_chunk() {
        let data = vec![7u8; 300];
        let mut wire = Vec::new();
        encode(&Frame::Chunk { id: 9, offset: 1 << 40, data: data.clone() }, &mut wire);
        assert_eq!(chunk_head(9, 1 << 40, 300)[..], wire[..CHUNK_HEAD]);
        // A chunk whose length disagrees with its frame's is refused before its data is read.
        let mut bad = wire.clone();
        bad[CHUNK_HEAD - 1] ^= 1;
        assert!(read_head(&mut &bad[..]).is_err());
    }

    #[test]
    fn a_length_over_the_limit_is_refused_before_reading_the_body() {
        let mut wire = ((MAX_FRAME + 1) as u32).to_be_bytes().to_vec();
        wire.push(kind::PING);
        assert_eq!(check(&wire), Err(FrameError::TooLong { len: MAX_FRAME + 1, max: MAX_FRAME }));
        let mut r = &wire[..];
        let e = read_frame(&mut r).unwrap_err();
        assert!(e.to_string().contains("more than the limit"), "{e}");
    }

    #[test]
    fn trailing_bytes_and_unknown_kinds_are_refused() {
        let mut wire = Vec::new();
        encode(&Frame::Ping { nonce: 7 }, &mut wire);
        let mut body = wire[4..].to_vec();
        body.push(0);
        assert_eq!(parse(&body), Err(FrameError::Trailing(1)));
        assert_eq!(parse(&[200]), Err(FrameError::UnknownKind(200)));
        assert_eq!(parse(&[]), Err(FrameError::Empty));
    }

    #[test]
    fn requests_cannot_name_a_file_outside_their_source() {
        for bad in ["", "/etc/passwd", "../x", "a/../../x", "a/./b", "a//b", "a/", "a\0b", &"x".repeat(5000)] {
            assert!(check_path(bad).is_err(), "{bad:?} was accepted");
            let mut wire = Vec::new();
            encode(&Frame::Fetch { id: 1, source: "/s".into(), rel: bad.into(), credit: 4 }, &mut wire);
            assert!(parse(&wire[4..]).is_err(), "a Fetch of {bad:?} parsed");
        }
        for good in ["a", "train/n0144/0001.JPEG", "a..b/c.d", ".hidden/x"] {
            assert_eq!(check_path(good), Ok(()), "{good:?}");
        }
    }

    #[test]
    fn a_staged_fetch_names_an_absolute_path_and_nothing_that_climbs() {
        for bad in ["", "rel/x", "/", "/a/../x", "/a//b", "/a/./b", "/a\0b"] {
            assert!(check_abs_path(bad).is_err(), "{bad:?} was accepted");
            let mut wire = Vec::new();
            encode(&Frame::StagedFetch { id: 1, path: bad.into(), credit: 4 }, &mut wire);
            assert!(parse(&wire[4..]).is_err(), "a StagedFetch of {bad:?} parsed");
        }
        assert_eq!(check_abs_path("/lustre/ckpt/step_1/model.pt"), Ok(()));
    }

    #[test]
    fn a_chunk_longer_than_the_limit_is_refused() {
        let mut body = vec![kind::CHUNK];
        body.extend_from_slice(&1u32.to_be_bytes());
        body.extend_from_slice(&0u64.to_be_bytes());
        body.extend_from_slice(&((CHUNK + 1) as u32).to_be_bytes());
        assert_eq!(parse(&body), Err(FrameError::BigChunk(CHUNK + 1)));
    }

    #[test]
    fn a_found_carries_the_rest_of_the_stat() {
        let attrs = SourceAttrs {
            mode: 0o100644,
            uid: 7,
            gid: 8,
            nlink: 1,
            atime_ns: -5,
            blksize: 4096,
            blocks: 9,
            canonical: true,
        };
        let identity = SourceId { size: 10, mtime_ns: 11, ctime_ns: 12, ino: 13, dev: 14, attrs: Some(attrs) };
        let mut wire = Vec::new();
        encode(&Frame::Found { id: 3, identity }, &mut wire);
        match parse(&wire[4..]) {
            Ok(Frame::Found { id: 3, identity: got }) => {
                assert_eq!(got, identity);
                assert_eq!(got.attrs, Some(attrs));
            }
            other => panic!("{other:?}"),
        }
    }
}
