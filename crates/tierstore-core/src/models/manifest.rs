//! The manifest of a model stream's version, the one definition of its schema: its tensors (name, dtype,
//! shape, blake3, size), the trainer's step and the publisher's metadata. The publisher (Python, through
//! `tierstore._core`) writes it as JSON beside the tensors it placed; the agent completes it at commit
//! (name, number, time) and hands its path to every consumer, on this node and on others, who read it
//! back through the same types.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One tensor of a manifest.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Tensor {
    /// The state-dict key.
    pub name: String,
    /// The dtype's name (torch's or numpy's).
    pub dtype: String,
    /// The shape.
    pub shape: Vec<u64>,
    /// blake3 of the bytes, lowercase hex: the name of its file in `blobs`.
    pub hash: String,
    /// The size in bytes.
    pub nbytes: u64,
}

/// A version's manifest: what the publisher writes, completed by the agent at commit.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    /// The stream (set by the agent).
    #[serde(default)]
    pub name: String,
    /// The version number (set by the agent).
    #[serde(default)]
    pub version: u64,
    /// Seconds since the epoch at commit (set by the agent).
    #[serde(default)]
    pub created: f64,
    /// The trainer's step, if it gave one.
    #[serde(default)]
    pub step: Option<i64>,
    /// The publisher's metadata.
    #[serde(default)]
    pub metadata: Value,
    /// The tensors, in the publisher's order.
    pub tensors: Vec<Tensor>,
}

impl Manifest {
    /// Reads and checks the manifest at `path`: a tensor's hash that is not a blake3 in lowercase hex
    /// (the name of its file) makes it invalid.
    pub fn read(path: &std::path::Path) -> std::io::Result<Manifest> {
        let text = std::fs::read(path)?;
        let m: Manifest = serde_json::from_slice(&text)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{}: {e}", path.display())))?;
        if let Some(t) = m.tensors.iter().find(|t| !check_hash(&t.hash)) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{}: tensor {:?} has no blake3 hash ({:?})", path.display(), t.name, t.hash),
            ));
        }
        Ok(m)
    }

    /// Writes the manifest as JSON at `path`.
    pub fn write(&self, path: &std::path::Path) -> std::io::Result<()> {
        let text = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        std::fs::write(path, text)
    }
}

/// Whether `h` is a blake3 in lowercase hex: the name of a tensor's file.
pub fn check_hash(h: &str) -> bool {
    h.len() == 64 && h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}
