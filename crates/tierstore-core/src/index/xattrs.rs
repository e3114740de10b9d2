//! What the store answered about a path's extended attributes, recorded per path under a trusted
//! source. Copying tools that keep attributes (`cp -a`, `shutil.copytree`, `rsync -X`) ask every path
//! they copy for its attribute list and for its ACLs (`system.posix_acl_access`, `..._default`); the
//! answer is nearly always "none", and a warm cache must not send those questions to the store.
//!
//! Each question is recorded as it was asked, with the store's whole answer (the full list or value, or
//! its errno), so a replay is exact for any buffer size the program passes: a size query, a buffer too
//! small (ERANGE) or a missing attribute (ENODATA) answer as the store's own call would. Nothing is
//! inferred: a name never asked is asked of the store, even when the recorded list lacks it (some
//! attributes, ACLs on some file systems among them, can be read without being listed).

/// A question about the extended attributes of a path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XattrQuery {
    /// `None`: the list of names (`listxattr`); else the value of this name (`getxattr`).
    pub name: Option<Vec<u8>>,
    /// Whether a symlink at the path was followed (`getxattr`, not `lgetxattr`). The two answers differ
    /// only for a symlink; the caller asks without following wherever it knows the path is no symlink, so
    /// one record serves both calls there.
    pub follow: bool,
}

/// The store's answer to an [`XattrQuery`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum XattrAnswer {
    /// The whole list (names, each with its NUL) or the whole value.
    Value(Vec<u8>),
    /// The call failed with this errno (ENODATA, EOPNOTSUPP, ...).
    Errno(i32),
}

/// The record of one path: its source-relative path, then per question a tag (bit 0: get, bit 1:
/// follow), the name's length and the name, the errno (0: a value follows) and the value's length and bytes.
pub(super) struct Record {
    pub(super) rel: String,
    pub(super) answers: Vec<(XattrQuery, XattrAnswer)>,
}

impl Record {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(4 + self.rel.len() + self.answers.len() * 16);
        v.extend_from_slice(&(self.rel.len() as u32).to_le_bytes());
        v.extend_from_slice(self.rel.as_bytes());
        for (q, a) in &self.answers {
            let name = q.name.as_deref().unwrap_or_default();
            v.push(u8::from(q.name.is_some()) | (u8::from(q.follow) << 1));
            v.extend_from_slice(&(name.len() as u16).to_le_bytes());
            v.extend_from_slice(name);
            let (errno, value): (i32, &[u8]) = match a {
                XattrAnswer::Value(value) => (0, value),
                XattrAnswer::Errno(e) => (*e, &[]),
            };
            v.extend_from_slice(&errno.to_le_bytes());
            v.extend_from_slice(&(value.len() as u32).to_le_bytes());
            v.extend_from_slice(value);
        }
        v
    }

    pub(super) fn decode(b: &[u8]) -> Option<Record> {
        let u32_at = |at: usize| Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?));
        let n = u32_at(0)? as usize;
        let rel = std::str::from_utf8(b.get(4..4 + n)?).ok()?.to_string();
        let mut at = 4 + n;
        let mut answers = Vec::new();
        while at < b.len() {
            let tag = *b.get(at)?;
            let len = u16::from_le_bytes(b.get(at + 1..at + 3)?.try_into().ok()?) as usize;
            let name = b.get(at + 3..at + 3 + len)?.to_vec();
            at += 3 + len;
            let errno = u32_at(at)? as i32;
            let len = u32_at(at + 4)? as usize;
            let value = b.get(at + 8..at + 8 + len)?.to_vec();
            at += 8 + len;
            if tag > 3 {
                return None;
            }
            let q = XattrQuery { name: (tag & 1 == 1).then_some(name), follow: tag & 2 == 2 };
            answers.push((q, if errno == 0 { XattrAnswer::Value(value) } else { XattrAnswer::Errno(errno) }));
        }
        Some(Record { rel, answers })
    }
}
