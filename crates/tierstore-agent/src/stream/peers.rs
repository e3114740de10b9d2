//! What the agents of a job say to each other about streams, typed: the two asks of a pull (a version's
//! manifest, then each tensor's bytes), the offer that comes before a tensor's chunks, and the
//! announcement of a version in the job's Redis. Each is read from a stranger (another host, or anyone
//! who can write to that Redis), so a message that does not parse is refused or ignored, never guessed at.

use serde::{Deserialize, Serialize};

/// The most chunks in flight one tensor's transfer may ask for.
pub(super) const MAX_CREDIT: u32 = 64;

/// What an agent pulling a version asks the agent that holds it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(super) enum PeerAsk {
    /// The manifest of version `version` of stream `name`.
    Manifest { name: String, version: u64 },
    /// The bytes of the tensor file `hash`, with `credit` chunks in flight at most (1 to [`MAX_CREDIT`]).
    Blob {
        hash: String,
        #[serde(default = "one")]
        credit: u32,
    },
}

fn one() -> u32 {
    1
}

impl PeerAsk {
    /// The ask's JSON, as a `StreamRequest` frame carries it.
    pub(super) fn text(&self) -> String {
        serde_json::to_string(self).expect("an ask is plain JSON")
    }
}

/// The answer to [`PeerAsk::Blob`] before its chunks: the size of the tensor file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct BlobOffer {
    pub size: u64,
}

/// A version of a stream announced in the job's Redis by the agent that holds it, signed with the job's
/// token (`mac`, see `follow.rs`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Announcement {
    #[serde(default)]
    pub name: String,
    pub version: u64,
    /// The announcing agent's address (`host:port`), where its version is pulled from.
    pub agent: String,
    #[serde(default)]
    pub nbytes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
}

impl Announcement {
    /// The announcement's JSON, as it is written to Redis.
    pub(super) fn text(&self) -> String {
        serde_json::to_string(self).expect("an announcement is plain JSON")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_messages_keep_their_wire_shape() {
        let ask = serde_json::to_value(PeerAsk::Manifest { name: "policy".into(), version: 3 }).unwrap();
        assert_eq!(ask, serde_json::json!({"op": "manifest", "name": "policy", "version": 3}));
        let ask: PeerAsk = serde_json::from_str(r#"{"op": "blob", "hash": "ab"}"#).unwrap();
        assert_eq!(ask, PeerAsk::Blob { hash: "ab".into(), credit: 1 });
        let e = serde_json::from_str::<PeerAsk>(r#"{"op": "delete", "hash": "ab"}"#).unwrap_err().to_string();
        assert!(e.contains("unknown variant `delete`"), "{e}");
        let e = serde_json::from_str::<PeerAsk>(r#"{"op": "manifest", "name": "policy"}"#).unwrap_err().to_string();
        assert!(e.contains("missing field `version`"), "{e}");
        let a = Announcement { name: "p".into(), version: 7, agent: "10.0.0.1:7078".into(), nbytes: 1, mac: None };
        assert_eq!(a.text(), r#"{"name":"p","version":7,"agent":"10.0.0.1:7078","nbytes":1}"#);
    }
}
