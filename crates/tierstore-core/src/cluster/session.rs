//! The handshake every connection to an agent opens with, written once for every client and server (the
//! read path here, the agent's server and client, `_core.AgentLink`); each does only its own I/O.
//!
//! ```text
//! agent  → Challenge { version, nonce_s }
//! client → Hello     { version, node, nonce_c, proof_c = MAC(K, "client" ‖ agent ‖ nonce_c ‖ nonce_s) }
//! agent  → Welcome   { node,             proof_s = MAC(K, "server" ‖ agent ‖ nonce_c ‖ nonce_s) }
//! ```
//!
//! `K` is derived from the job's token, which never crosses the network; `agent` is the address the client
//! dialed (`host:port`, as the member list names the agent), which the agent checks against its own names.
//! Each side proves the token over both nonces, its own role and that address: a recorded proof is
//! worthless on another connection, a proof cannot be reflected back to its maker, a client refuses an
//! agent that has not proved the token (a squatted port or a forged member serves nothing), and a stranger
//! on one member's port cannot relay a reader's handshake to another member's agent (the address differs).
//! On the node's Unix socket there is no token: the kernel's `SO_PEERCRED` says which user is at the other
//! end (see [`crate::private::check_peer`]), and both proofs are zeros.
//!
//! A handshake over TCP ends with the keys of both directions of the connection, derived from the token,
//! the address dialed and both nonces ([`Seals`]): every frame after it carries a tag under them (see
//! [`super::seal`]), so that a relay on the network path between a reader and the very agent it dialed
//! can pass frames on but not change, drop or add one. On the Unix socket frames stay plain.

use super::seal::Seals;
use super::wire::{ErrorCode, Frame, VERSION};

/// Why a handshake failed, from the client's side.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HandshakeError {
    /// The agent speaks another protocol version.
    #[error("it speaks protocol {0}, this process {VERSION}: run the same tierstore on every node")]
    Version(u8),
    /// The agent refused the hello.
    #[error("{1}")]
    Refused(ErrorCode, String),
    /// The agent answered with a frame the handshake has no place for.
    #[error("expected {expected}, got {got}")]
    Unexpected {
        /// What the handshake waited for.
        expected: &'static str,
        /// What came instead.
        got: String,
    },
    /// The agent did not prove the job's token: it is not an agent of this job.
    #[error(
        "it did not prove the job's token, so it is not an agent of this job (a stranger on its port, or an agent \
         given another token): nothing is read from it"
    )]
    Unproven,
}

/// Fresh random bytes for a nonce.
pub fn nonce() -> [u8; 32] {
    let mut n = [0u8; 32];
    // SAFETY: getrandom writes at most `n.len()` bytes into the buffer.
    let got = unsafe { crate::sys::getrandom(n.as_mut_ptr() as *mut libc::c_void, n.len(), 0) };
    assert_eq!(got, n.len() as isize, "getrandom failed: {}", std::io::Error::last_os_error());
    n
}

#[derive(Clone, Copy)]
enum Role {
    Client,
    /// The agent, and whether it demands encryption (so that nobody on the path can clear the demand).
    Server {
        encrypt: bool,
    },
}

/// What a proof covers besides the token and the role: the agent's address as dialed, both nonces.
#[derive(Clone, Copy)]
struct Bound<'a> {
    agent: &'a str,
    client: &'a [u8; 32],
    server: &'a [u8; 32],
}

/// `MAC(K, role ‖ agent ‖ nonce_c ‖ nonce_s)` under the key derived from `token`.
fn proof(token: &[u8], role: Role, to: Bound<'_>) -> [u8; 32] {
    let key = blake3::derive_key("tierstore agent handshake v5", token);
    let mut mac = blake3::Hasher::new_keyed(&key);
    match role {
        Role::Client => mac.update(b"client"),
        Role::Server { encrypt } => mac.update(b"server").update(&[u8::from(encrypt)]),
    };
    mac.update(&(to.agent.len() as u64).to_be_bytes());
    mac.update(to.agent.as_bytes());
    mac.update(to.client);
    mac.update(to.server);
    *mac.finalize().as_bytes()
}

/// Whether `given` is `token`'s proof for `role` over `to`, compared in constant time.
fn proves(token: &[u8], role: Role, to: Bound<'_>, given: &[u8; 32]) -> bool {
    blake3::Hash::from(proof(token, role, to)) == blake3::Hash::from(*given)
}

/// The frame keys of a connection whose handshake proved `token` over `to`, as `role` holds them. Each
/// direction has its own key, so that a frame cannot be reflected back to its sender.
fn seals(token: &[u8], role: Role, to: Bound<'_>) -> Seals {
    let base = blake3::derive_key("tierstore agent frames v5", token);
    let key = |direction: &[u8]| {
        let mut mac = blake3::Hasher::new_keyed(&base);
        mac.update(direction);
        mac.update(&(to.agent.len() as u64).to_be_bytes());
        mac.update(to.agent.as_bytes());
        mac.update(to.client);
        mac.update(to.server);
        *mac.finalize().as_bytes()
    };
    let (up, down) = (key(b"client to server"), key(b"server to client"));
    match role {
        Role::Client => Seals::keyed(up, down),
        Role::Server { .. } => Seals::keyed(down, up),
    }
}

/// The client's half of a handshake in progress: what it must see in the agent's welcome.
pub struct ClientHello {
    token: Option<Vec<u8>>,
    agent: String,
    client: [u8; 32],
    server: [u8; 32],
}

impl ClientHello {
    /// The hello that answers the challenge of the agent dialed at `agent` (`host:port`, as the members
    /// name it), as node `node`; with `token` (TCP) the agent must then prove it too, without (the local
    /// socket) it need not.
    pub fn answer(
        challenge: Frame,
        agent: &str,
        node: &str,
        token: Option<&[u8]>,
    ) -> Result<(ClientHello, Frame), HandshakeError> {
        let server = match challenge {
            Frame::Challenge { version, nonce } if version == VERSION => nonce,
            Frame::Challenge { version, .. } => return Err(HandshakeError::Version(version)),
            other => return Err(unexpected("a challenge", &other)),
        };
        let client = nonce();
        let proof =
            token.map_or([0; 32], |t| proof(t, Role::Client, Bound { agent, client: &client, server: &server }));
        let hello = Frame::Hello { version: VERSION, node: node.to_string(), nonce: client, proof };
        Ok((ClientHello { token: token.map(<[u8]>::to_vec), agent: agent.to_string(), client, server }, hello))
    }

    /// The agent's node name, the frame keys of the connection and whether the agent demands
    /// encryption, once its `answer` to the hello is a welcome that proves the token (when the client has
    /// one; without, frames stay plain).
    pub fn welcome(&self, answer: Frame) -> Result<Welcomed, HandshakeError> {
        match answer {
            Frame::Welcome { node, proof, encrypt } => {
                let to = Bound { agent: &self.agent, client: &self.client, server: &self.server };
                match &self.token {
                    Some(t) if !proves(t, Role::Server { encrypt }, to, &proof) => Err(HandshakeError::Unproven),
                    Some(t) => Ok(Welcomed { node, seals: seals(t, Role::Client, to), encrypt }),
                    None => Ok(Welcomed { node, seals: Seals::default(), encrypt: false }),
                }
            }
            Frame::Error { code, message } => Err(HandshakeError::Refused(code, message)),
            other => Err(unexpected("a welcome", &other)),
        }
    }
}

/// One side's half of `[cluster] encrypt`'s key exchange, right after the handshake: a fresh X25519 key
/// whose public half goes to the other side in a [`Frame::KeyShare`] (tagged, so nobody on the path can
/// swap it). The secret both sides then agree on switches the connection to encrypted frames (see
/// [`Seals::encrypt`]); it lives only as long as the connection, so a recording stays unreadable to
/// anyone who learns the token later.
pub struct KeyShare {
    private: ring::agreement::EphemeralPrivateKey,
}

impl KeyShare {
    /// A fresh key, and the frame that shares its public half.
    pub fn new() -> (KeyShare, Frame) {
        let rng = ring::rand::SystemRandom::new();
        let private = ring::agreement::EphemeralPrivateKey::generate(&ring::agreement::X25519, &rng)
            .expect("the system's random source");
        let public = private.compute_public_key().expect("an X25519 public key");
        let public: [u8; 32] = public.as_ref().try_into().expect("32 bytes");
        (KeyShare { private }, Frame::KeyShare { public })
    }

    /// Agrees with the other side's key share `theirs` and switches `seals` to encryption.
    pub fn finish(self, theirs: Frame, seals: &mut Seals) -> Result<(), HandshakeError> {
        let public = match theirs {
            Frame::KeyShare { public } => public,
            Frame::Error { code, message } => return Err(HandshakeError::Refused(code, message)),
            other => return Err(unexpected("a key share", &other)),
        };
        let theirs = ring::agreement::UnparsedPublicKey::new(&ring::agreement::X25519, public);
        ring::agreement::agree_ephemeral(self.private, &theirs, |secret| seals.encrypt(secret))
            .map_err(|_| HandshakeError::Unexpected { expected: "an X25519 key share", got: "another key".into() })
    }
}

fn unexpected(expected: &'static str, got: &Frame) -> HandshakeError {
    let got = format!("{got:?}");
    HandshakeError::Unexpected { expected, got: got.chars().take(120).collect() }
}

/// What a client knows once an agent welcomed it.
#[derive(Debug)]
pub struct Welcomed {
    /// The agent's node name.
    pub node: String,
    /// The connection's frame keys.
    pub seals: Seals,
    /// The agent demands encryption: the client's next frame is its [`KeyShare`].
    pub encrypt: bool,
}

/// The agent's side of a handshake, as [`welcome`] needs it.
pub struct AgentSide<'a> {
    /// The job's token where the connection must prove it (TCP), `None` on the local socket.
    pub token: Option<&'a [u8]>,
    /// The addresses a client may have dialed this agent at (as the members name it, its listening
    /// address).
    pub names: &'a [String],
    /// The agent's node name.
    pub me: &'a str,
    /// Whether the agent demands encryption on TCP (`[cluster] encrypt`).
    pub encrypt: bool,
}

/// The agent's side: the welcome for `hello`, sent on a connection whose challenge carried `server`, and
/// the connection's frame keys; or the refusal to send instead.
pub fn welcome(hello: &Frame, server: &[u8; 32], agent: &AgentSide<'_>) -> Result<(Frame, Seals), (ErrorCode, String)> {
    let AgentSide { token, names, me, encrypt } = *agent;
    let (node, client, given) = match hello {
        Frame::Hello { version, .. } if *version != VERSION => {
            return Err((
                ErrorCode::Version,
                format!(
                    "this agent speaks protocol {VERSION}, you sent {version}: run the same tierstore on every node"
                ),
            ))
        }
        Frame::Hello { node, nonce, proof, .. } => (node, nonce, proof),
        _ => return Err((ErrorCode::BadRequest, "the first frame must be a hello".to_string())),
    };
    let Some(t) = token else {
        return Ok((Frame::Welcome { node: me.to_string(), proof: [0; 32], encrypt: false }, Seals::default()));
    };
    let dialed =
        names.iter().map(|n| Bound { agent: n, client, server }).find(|to| proves(t, Role::Client, *to, given));
    match dialed {
        Some(to) => {
            let role = Role::Server { encrypt };
            Ok((Frame::Welcome { node: me.to_string(), proof: proof(t, role, to), encrypt }, seals(t, role, to)))
        }
        // What a stranger may be told, no more: the name its own hello gave, never this agent's host name
        // or addresses (the agent logs them with the refusal).
        None => Err((
            ErrorCode::Unauthorized,
            format!(
                "node {node:?}: wrong token, or dialed at an address this agent does not go by; every agent of a \
                 job must be given the same token"
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &[u8] = b"0123456789abcdef0123456789abcdef-the-job";

    fn agent<'a>(token: Option<&'a [u8]>, names: &'a [String]) -> AgentSide<'a> {
        AgentSide { token, names, me: "b", encrypt: false }
    }

    fn names() -> Vec<String> {
        vec!["b:7078".to_string(), "10.0.0.2:7078".to_string()]
    }

    fn challenge() -> ([u8; 32], Frame) {
        let n = nonce();
        (n, Frame::Challenge { version: VERSION, nonce: n })
    }

    #[test]
    fn both_sides_holding_the_token_complete_the_handshake_at_any_of_the_agents_names() {
        for dialed in names() {
            let (server, c) = challenge();
            let (client, hello) = ClientHello::answer(c, &dialed, "a", Some(TOKEN)).unwrap();
            let (w, mut agent) = welcome(&hello, &server, &agent(Some(TOKEN), &names())).unwrap();
            let Welcomed { node, seals: mut reader, .. } = client.welcome(w).unwrap();
            assert_eq!(node, "b");
            // Both sides derived the same key for each direction, and a different one for each.
            let ask = Frame::Credit { id: 1, more: 3 };
            let up = reader.send.bytes_of(&ask);
            assert_eq!(agent.recv.read_frame(&mut &up[..]).unwrap(), Some(ask.clone()));
            let down = agent.send.bytes_of(&ask);
            assert_eq!(reader.recv.read_frame(&mut &down[..]).unwrap(), Some(ask.clone()));
            let reflected = reader.send.bytes_of(&ask);
            assert!(reader.recv.read_frame(&mut &reflected[..]).is_err(), "a frame was taken back by its sender");
        }
    }

    #[test]
    fn an_agent_that_demands_encryption_gets_it_and_the_demand_cannot_be_cleared_on_the_way() {
        let (server, c) = challenge();
        let (client, hello) = ClientHello::answer(c, "b:7078", "a", Some(TOKEN)).unwrap();
        let names = names();
        let side = AgentSide { token: Some(TOKEN), names: &names, me: "b", encrypt: true };
        let (w, mut agent) = welcome(&hello, &server, &side).unwrap();
        let Frame::Welcome { node, proof, encrypt } = w.clone() else { unreachable!() };
        assert!(encrypt);
        let cleared = Frame::Welcome { node, proof, encrypt: false };
        assert_eq!(client.welcome(cleared).err(), Some(HandshakeError::Unproven));
        let mut reader = client.welcome(w).unwrap();
        assert!(reader.encrypt);
        // The key exchange, each share under the tags.
        let (mine, share) = KeyShare::new();
        let up = reader.seals.send.bytes_of(&share);
        let (theirs, answer) = KeyShare::new();
        let got = agent.recv.read_frame(&mut &up[..]).unwrap().unwrap();
        let down = agent.send.bytes_of(&answer);
        theirs.finish(got, &mut agent).unwrap();
        mine.finish(reader.seals.recv.read_frame(&mut &down[..]).unwrap().unwrap(), &mut reader.seals).unwrap();
        assert!(agent.encrypted() && reader.seals.encrypted());
        let ask = Frame::Fetch { id: 1, source: "/store".into(), rel: "a/b".into(), credit: 4 };
        let frame = reader.seals.send.bytes_of(&ask);
        assert_eq!(agent.recv.read_frame(&mut &frame[..]).unwrap(), Some(ask));
    }

    #[test]
    fn each_connection_has_keys_of_its_own() {
        let mut connections = Vec::new();
        for _ in 0..2 {
            let (server, c) = challenge();
            let (client, hello) = ClientHello::answer(c, "b:7078", "a", Some(TOKEN)).unwrap();
            let (w, agent) = welcome(&hello, &server, &agent(Some(TOKEN), &names())).unwrap();
            connections.push((client.welcome(w).unwrap().seals, agent));
        }
        let ask = Frame::Credit { id: 1, more: 1 };
        let frame = connections[0].0.send.bytes_of(&ask);
        let replayed = connections[1].1.recv.read_frame(&mut &frame[..]);
        assert!(replayed.is_err(), "a frame of one connection was taken on another");
        assert_eq!(connections[0].1.recv.read_frame(&mut &frame[..]).unwrap(), Some(ask));
    }

    #[test]
    fn a_wrong_token_is_refused_either_way() {
        let (server, c) = challenge();
        let (_, hello) = ClientHello::answer(c, "b:7078", "a", Some(b"another token, not the job's one!")).unwrap();
        let refused = welcome(&hello, &server, &agent(Some(TOKEN), &names())).unwrap_err();
        assert_eq!(refused.0, ErrorCode::Unauthorized);
        assert!(refused.1.contains("wrong token"), "{}", refused.1);
        // A stranger learns nothing of the agent: neither its names nor its addresses.
        assert!(!refused.1.contains("7078") && !refused.1.contains("10.0.0.2"), "{}", refused.1);
        // An agent without the token cannot make a welcome the client accepts.
        let (server, c) = challenge();
        let (client, hello) = ClientHello::answer(c, "b:7078", "a", Some(TOKEN)).unwrap();
        let Frame::Hello { nonce: theirs, .. } = hello else { unreachable!() };
        let to = Bound { agent: "b:7078", client: &theirs, server: &server };
        let forged = proof(b"a stranger's token, not the job's", Role::Server { encrypt: false }, to);
        assert_eq!(
            client.welcome(Frame::Welcome { node: "b".into(), proof: forged, encrypt: false }).err(),
            Some(HandshakeError::Unproven)
        );
        let unproved = Frame::Welcome { node: "b".into(), proof: [0; 32], encrypt: false };
        assert_eq!(client.welcome(unproved).err(), Some(HandshakeError::Unproven));
    }

    #[test]
    fn a_proof_is_bound_to_both_nonces_a_role_and_the_agent_dialed() {
        let (server, c) = challenge();
        let (client, hello) = ClientHello::answer(c, "b:7078", "a", Some(TOKEN)).unwrap();
        // Replayed on a connection with another challenge: refused.
        let (other_server, _) = challenge();
        assert!(welcome(&hello, &other_server, &agent(Some(TOKEN), &names())).is_err());
        // Relayed by a stranger on c's port to b's agent: b does not go by c's address.
        let (server_b, relayed) = challenge();
        let (_, hello_for_c) = ClientHello::answer(relayed, "c:7078", "a", Some(TOKEN)).unwrap();
        assert!(welcome(&hello_for_c, &server_b, &agent(Some(TOKEN), &names())).is_err());
        // The client's own proof reflected back as the agent's: refused.
        let Frame::Hello { proof, .. } = hello else { unreachable!() };
        assert_eq!(
            client.welcome(Frame::Welcome { node: "b".into(), proof, encrypt: false }).err(),
            Some(HandshakeError::Unproven)
        );
        let _ = server;
    }

    #[test]
    fn the_local_socket_needs_no_token() {
        let (server, c) = challenge();
        let (client, hello) = ClientHello::answer(c, "", "local", None).unwrap();
        let (w, agent) =
            welcome(&hello, &server, &AgentSide { token: None, names: &[], me: "n", encrypt: false }).unwrap();
        let Welcomed { node, seals: reader, .. } = client.welcome(w).unwrap();
        assert_eq!(node, "n");
        assert!(!agent.send.is_keyed() && !reader.recv.is_keyed(), "frames on the node's socket stay plain");
    }

    #[test]
    fn another_version_is_named() {
        let e = ClientHello::answer(Frame::Challenge { version: 1, nonce: [0; 32] }, "b:1", "a", None).err().unwrap();
        assert!(e.to_string().contains("protocol 1"), "{e}");
    }
}
