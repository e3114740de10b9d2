//! What a stream connection carries between a client and its node's agent: the requests (the JSON of a
//! `StreamRequest` frame, tagged by `op`), one type, which the agent parses and which Python's requests
//! go through (`tierstore._core.AgentLink.send` checks each against it before it leaves the process), so
//! that a misspelt field fails in the client, naming it, rather than at the agent; the answers to
//! `begin`, `commit` and `subscribe`; and the notice of a version, which the agent pushes to subscribers
//! and answers `fetch` with.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// A request of a stream connection (the JSON of a `StreamRequest` frame, tagged by `op`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Starts publishing a version of `name`: answers the publish's number, its directory and the base.
    Begin {
        /// The stream.
        name: String,
    },
    /// Makes the version written under the publish's directory visible, and notifies.
    Commit {
        /// The publish.
        publish: u64,
    },
    /// Drops a publish in progress.
    Abort {
        /// The publish.
        publish: u64,
    },
    /// Pushes a notice of every version of `name` newer than `after` to this connection, from now on
    /// (starting with the latest, if it is newer).
    Subscribe {
        /// The stream.
        name: String,
        /// The newest version the subscriber already has (0: none).
        #[serde(default)]
        after: u64,
        /// Notices only: versions other nodes hold are relayed without pulling their tensors here.
        #[serde(default)]
        notices_only: bool,
        /// The subscriber's process id, for `tierstore stream show|watch`.
        #[serde(default)]
        pid: Option<u32>,
        /// What the subscriber calls itself, for `tierstore stream show|watch`.
        #[serde(default)]
        label: Option<String>,
    },
    /// The subscriber of this connection serves `version` from now on (no answer): its lag is listed.
    Serving {
        /// The version it swapped to.
        version: u64,
    },
    /// Answers the notice of version `version` of `name` and leases it to this connection, pulling it from
    /// the node that holds it when it was only relayed here.
    Fetch {
        /// The stream.
        name: String,
        /// The version.
        version: u64,
    },
    /// Ends one lease of this connection on a version (no answer).
    Release {
        /// The stream.
        name: String,
        /// The version.
        version: u64,
    },
    /// The streams of this agent, their versions, leases and subscribers.
    List,
}

/// The answer to `begin`: where the publish writes its version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Begun {
    /// The publish's number, which `commit` and `abort` name.
    pub publish: u64,
    /// The directory its new tensors and its manifest are written in.
    pub dir: PathBuf,
    /// The agent's tensor files, by hash: a tensor already there is not written again.
    pub blobs: PathBuf,
    /// The latest version, leased to the publish until it ends: what "changed" is measured against.
    pub base: Option<Base>,
    /// The agent's spare files, allocated ahead for the sizes the last publish wrote: a tensor of such a
    /// size is written into one instead of a new file (see `models::stream::Spares`). None from an agent
    /// that keeps none.
    #[serde(default)]
    pub spares: Option<PathBuf>,
}

/// The version a publish starts from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Base {
    /// Its number.
    pub version: u64,
    /// Its manifest.
    pub manifest: PathBuf,
}

/// The answer to `commit`: the version made visible.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Committed {
    /// Its number.
    pub version: u64,
    /// Bytes of its tensors.
    pub nbytes: u64,
    /// Bytes of the tensors this publish placed (those that changed).
    pub new_bytes: u64,
    /// Its manifest.
    pub manifest: PathBuf,
}

/// The answer to `abort`: the publish given up (its placed tensors are freed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Aborted {
    /// The publish's number, as `begin` gave it.
    pub aborted: u64,
}

/// The answer to `subscribe`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Subscribed {
    /// The stream.
    pub subscribed: String,
    /// Its latest version here (0: none yet).
    pub latest: u64,
    /// The agent's tensor files, by hash.
    pub blobs: PathBuf,
    /// What this agent does beyond the first protocol (`notices_only`, `serving`, `fetch`).
    pub features: Vec<String>,
}

/// The notice of a version (`"event": "version"`): pushed to each subscriber when a version is committed
/// here or relayed from another node, and the answer to `fetch`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename = "version")]
pub struct VersionNotice {
    /// The stream.
    pub name: String,
    /// The version.
    pub version: u64,
    /// Its manifest's path on this node.
    pub manifest: PathBuf,
    /// The trainer's step, if it gave one.
    pub step: Option<i64>,
    /// Bytes of its tensors.
    pub nbytes: u64,
    /// Bytes of the tensors that changed since the version before (0 for one relayed).
    pub new_bytes: u64,
    /// How many tensors it has.
    pub tensors: usize,
    /// Seconds since the epoch at commit.
    pub created: f64,
    /// Whether its tensors are held on this node; a relayed one's are on `agent`'s.
    pub held: bool,
    /// The agent holding a relayed version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_read_as_clients_write_them_and_a_wrong_one_names_its_fault() {
        let r: Request = serde_json::from_str(r#"{"op": "subscribe", "name": "policy", "after": 3}"#).unwrap();
        assert_eq!(
            r,
            Request::Subscribe { name: "policy".into(), after: 3, notices_only: false, pid: None, label: None }
        );
        let back: Request = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back, r);
        assert_eq!(serde_json::from_str::<Request>(r#"{"op": "list"}"#).unwrap(), Request::List);
        let e = serde_json::from_str::<Request>(r#"{"op": "fetch", "name": "p"}"#).unwrap_err().to_string();
        assert!(e.contains("missing field `version`"), "{e}");
        let e = serde_json::from_str::<Request>(r#"{"op": "fecth"}"#).unwrap_err().to_string();
        let notice = VersionNotice {
            name: "policy".into(),
            version: 7,
            manifest: "/dev/shm/s/versions/policy/7.json".into(),
            step: None,
            nbytes: 10,
            new_bytes: 4,
            tensors: 2,
            created: 1.5,
            held: true,
            agent: None,
        };
        let text = serde_json::to_string(&notice).unwrap();
        assert!(text.starts_with(r#"{"event":"version","name":"policy""#) && !text.contains("agent"), "{text}");
        assert_eq!(serde_json::from_str::<VersionNotice>(&text).unwrap(), notice);
        // A first publish has no base: the client reads `null` there, as it always has.
        let begun = Begun { publish: 1, dir: "/t/1".into(), blobs: "/t/blobs".into(), base: None, spares: None };
        let text = r#"{"publish":1,"dir":"/t/1","blobs":"/t/blobs","base":null,"spares":null}"#;
        assert_eq!(serde_json::to_string(&begun).unwrap(), text);
        // An agent from before spares says nothing of them: none.
        let older = r#"{"publish":1,"dir":"/t/1","blobs":"/t/blobs","base":null}"#;
        assert_eq!(serde_json::from_str::<Begun>(older).unwrap(), begun);
        assert!(e.contains("unknown variant `fecth`") && e.contains("`fetch`"), "{e}");
    }
}
