//! The manifest of a version: its tensors (name, dtype, shape, blake3, size), the trainer's step and the
//! publisher's metadata. The publisher writes it as JSON beside the tensors it placed; the agent completes
//! it at commit (name, number, time) and hands its path to every consumer, on this node and on others.

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

/// Whether `h` is a blake3 in lowercase hex: the name of a tensor's file.
pub(super) fn check_hash(h: &str) -> bool {
    h.len() == 64 && h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}
