//! The requests a client sends on a stream connection to its node's agent (the JSON of a
//! `StreamRequest` frame, tagged by `op`): one type, which the agent parses and which Python's requests
//! go through (`tierstore._core.AgentLink.send` checks each against it before it leaves the process), so
//! that a misspelt field fails in the client, naming it, rather than at the agent.

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
        assert!(e.contains("unknown variant `fecth`") && e.contains("`fetch`"), "{e}");
    }
}
