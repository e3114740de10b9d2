//! The agent's lifecycle and protocol against real instances: in-process on a temporary socket and on
//! 127.0.0.1:0, and as the real executable, killed with SIGKILL mid-conversation.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tierstore_agent::client::{Client, ClientError};
use tierstore_agent::protocol::{self, Frame};
use tierstore_agent::server::{Agent, AgentError, Options};

const TOKEN: &[u8] = b"a-token-of-the-job-0123456789abcdefghijklmnopqrstuvwxyz";

fn options(dir: &Path) -> Options {
    let mut o = Options::new("node-a", dir.join("agent.sock"));
    o.listen = Some("127.0.0.1:0".parse().unwrap());
    o.token = Some(TOKEN.to_vec());
    o.deadline = Duration::from_millis(300);
    o
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_clients_and_authenticated_peers_are_served_then_a_local_stop_ends_it() {
    let dir = tempfile::tempdir().unwrap();
    let o = options(dir.path());
    let agent = Agent::bind(o.clone()).await.unwrap();
    let peer = agent.peer_address().unwrap().to_string();
    let served = tokio::spawn(agent.serve(std::future::pending()));
    let d = Duration::from_secs(2);

    let mut local = Client::local(&o.socket, d).await.unwrap();
    assert_eq!(local.node, "node-a");
    assert_eq!(local.call(&Frame::Ping { nonce: 42 }).await.unwrap(), Frame::Pong { nonce: 42 });

    let mut p = Client::peer(&peer, "node-b", Some(TOKEN), d).await.unwrap();
    assert_eq!(p.call(&Frame::Ping { nonce: 7 }).await.unwrap(), Frame::Pong { nonce: 7 });
    let e = p.call(&Frame::Stop).await.unwrap_err();
    assert!(e.to_string().contains("only processes of the agent's node"), "{e}");

    for (token, said) in [(Some(&b"not-the-token-of-this-job"[..]), "wrong token"), (None, "no token")] {
        match Client::peer(&peer, "intruder", token, d).await {
            Err(ClientError::Refused { message, .. }) => assert!(message.contains(said), "{message}"),
            Err(other) => panic!("expected a refusal, got {other}"),
            Ok(_) => panic!("a peer without the token was let in"),
        }
    }
    // A hello far larger than a hello can be is refused before the agent allocates it.
    let mut raw = tokio::net::TcpStream::connect(&peer).await.unwrap();
    let _challenge = protocol::read_frame(&mut raw).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut raw, &((1u32 << 20).to_be_bytes())).await.unwrap();
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(d, tokio::io::AsyncReadExt::read_to_end(&mut raw, &mut rest)).await;
    assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "the agent kept a 1 MiB hello open: {closed:?}");
    let status: serde_json::Value = serde_json::from_str(&local.status().await.unwrap()).unwrap();
    assert_eq!(status["node"], "node-a");
    assert_eq!(status["refused"], 1);
    assert_eq!(status["listen"], peer.as_str());

    assert_eq!(local.call(&Frame::Stop).await.unwrap(), Frame::Stopping);
    tokio::time::timeout(Duration::from_secs(5), served).await.expect("the agent stopped").unwrap();
    assert!(!o.socket.exists(), "the socket file is removed on stop");
}

#[tokio::test]
async fn listening_without_a_token_is_refused_at_start_on_loopback_too() {
    for addr in ["0.0.0.0:0", "127.0.0.1:0"] {
        let dir = tempfile::tempdir().unwrap();
        let mut o = options(dir.path());
        o.listen = Some(addr.parse().unwrap());
        o.token = None;
        match Agent::bind(o).await {
            Err(e @ AgentError::NoToken(_)) => assert!(e.to_string().contains("--token-file"), "{e}"),
            Err(other) => panic!("wrong error: {other}"),
            Ok(_) => panic!("an unauthenticated listener on {addr} was started"),
        }
    }
}

#[tokio::test]
async fn a_server_that_cannot_prove_the_token_is_not_spoken_to() {
    use tierstore_core::cluster::session;
    // A stranger on a member's port, answering the hello as an agent would but without the token.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = l.local_addr().unwrap().to_string();
    let stranger = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let nonce = session::nonce();
        protocol::write_frame(&mut s, &Frame::Challenge { version: protocol::VERSION, nonce }).await.unwrap();
        let hello = protocol::read_frame(&mut s).await.unwrap().unwrap();
        // It cannot check the client's proof, and it makes its own under a token it guessed.
        let Frame::Hello { .. } = hello else { panic!("{hello:?}") };
        let unproven = session::AgentSide { token: None, names: &[], me: "owner", encrypt: false };
        let (forged, _) = session::welcome(&hello, &nonce, &unproven).unwrap();
        protocol::write_frame(&mut s, &forged).await.unwrap();
        protocol::read_frame(&mut s).await.ok().flatten()
    });
    match Client::peer(&at, "reader", Some(TOKEN), Duration::from_secs(2)).await {
        Err(ClientError::Refused { message, .. }) => assert!(message.contains("did not prove"), "{message}"),
        Err(other) => panic!("expected a refusal, got {other}"),
        Ok(_) => panic!("a server without the token was accepted"),
    }
    assert_eq!(stranger.await.unwrap(), None, "the client sent no request to the stranger");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_agent_on_a_live_socket_is_refused_and_a_stale_socket_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let o = options(dir.path());
    let first = Agent::bind(o.clone()).await.unwrap();
    let served = tokio::spawn(first.serve(std::future::pending()));
    match Agent::bind(o.clone()).await {
        Err(AgentError::AlreadyRunning(p)) => assert_eq!(p, o.socket),
        Err(other) => panic!("wrong error: {other}"),
        Ok(_) => panic!("two agents on one socket"),
    }
    served.abort();
    let _ = served.await;
    // The aborted agent left its socket file behind, with nobody listening: a new agent takes it over.
    assert!(o.socket.exists());
    let second = Agent::bind(o.clone()).await.unwrap();
    let served = tokio::spawn(second.serve(std::future::pending()));
    let mut c = Client::local(&o.socket, Duration::from_secs(2)).await.unwrap();
    assert_eq!(c.call(&Frame::Ping { nonce: 1 }).await.unwrap(), Frame::Pong { nonce: 1 });
    served.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_client_is_dropped_at_its_deadline_and_an_idle_agent_exits() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = options(dir.path());
    o.idle_exit = Some(Duration::from_millis(300));
    let agent = Agent::bind(o.clone()).await.unwrap();
    let started = Instant::now();
    let served = tokio::spawn(agent.serve(std::future::pending()));
    // Connects and never says hello: the agent closes it after its deadline, it does not wait forever.
    let mut silent = tokio::net::UnixStream::connect(&o.socket).await.unwrap();
    let challenge = protocol::read_frame(&mut silent).await.unwrap();
    assert!(matches!(challenge, Some(Frame::Challenge { .. })));
    let closed = tokio::time::timeout(Duration::from_secs(3), protocol::read_frame(&mut silent)).await;
    assert!(matches!(closed, Ok(Ok(None)) | Ok(Err(_))), "the silent client was not dropped: {closed:?}");
    drop(silent);
    tokio::time::timeout(Duration::from_secs(5), served).await.expect("the idle agent exited").unwrap();
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert!(!o.socket.exists());
}

#[test]
fn the_executable_starts_answers_and_a_killed_agent_never_hangs_its_client() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("a.sock");
    let mut child = Command::new(env!("CARGO_BIN_EXE_tierstore-agent"))
        .args(["run", "--socket", socket.to_str().unwrap(), "--node", "n1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert!(line.starts_with("ready"), "{line}");
    let status = Command::new(env!("CARGO_BIN_EXE_tierstore-agent"))
        .args(["status", "--json", "--socket", socket.to_str().unwrap()])
        .output()
        .unwrap();
    let s: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!((s["node"].as_str(), s["pid"].as_u64()), (Some("n1"), Some(u64::from(child.id()))));

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut c = Client::local(&socket, Duration::from_secs(1)).await.unwrap();
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
        let t = Instant::now();
        let e = c.call(&Frame::Ping { nonce: 3 }).await.unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(2), "the client waited {:?} for a dead agent", t.elapsed());
        assert!(matches!(e, ClientError::Broken { .. } | ClientError::Deadline { .. }), "{e}");
    });
    child.wait().unwrap();
    // A new agent takes over the socket the killed one left behind.
    let out = Command::new(env!("CARGO_BIN_EXE_tierstore-agent"))
        .args(["run", "--socket", socket.to_str().unwrap(), "--idle-exit", "0.2"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("idle for 0.2 s with nothing pending"), "{log}");
    // Each line starts with its time in RFC 3339, UTC: 2026-12-02T00:15:03.123Z.
    let line = log.lines().find(|l| l.contains("idle for")).unwrap();
    let stamp = line.split(' ').next().unwrap();
    assert!(stamp.len() == 24 && stamp.ends_with('Z') && stamp.as_bytes()[10] == b'T', "{line}");
}

#[test]
fn help_after_a_command_that_does_not_exist_is_an_error() {
    let run = |args: &[&str]| Command::new(env!("CARGO_BIN_EXE_tierstore-agent")).args(args).output().unwrap();
    let out = run(&["start", "--help"]);
    assert_eq!(out.status.code(), Some(1), "tierstore-agent start --help");
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown command \"start\""));
    for args in [&["--help"][..], &["run", "--help"], &["status", "-h"]] {
        let out = run(args);
        assert!(out.status.success(), "{args:?}");
        assert!(String::from_utf8_lossy(&out.stdout).contains("run"), "{args:?}: the usage");
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn spawn_agent(dir: &Path, name: &str, port: u16, peers: &str, token_file: &Path) -> std::process::Child {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tierstore-agent"))
        .args(["run", "--node", name, "--socket"])
        .arg(dir.join(format!("{name}.sock")))
        .args(["--listen", &format!("127.0.0.1:{port}"), "--peers", peers, "--token-file"])
        .arg(token_file)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert!(line.starts_with("ready"), "{name}: {line}");
    child
}

fn members_seen_by(dir: &Path, name: &str) -> Vec<serde_json::Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_tierstore-agent"))
        .args(["status", "--json", "--socket"])
        .arg(dir.join(format!("{name}.sock")))
        .output()
        .unwrap();
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    s["members"].as_array().unwrap().clone()
}

fn wait_until(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !ok() {
        assert!(t.elapsed() < limit, "{what} did not happen within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    t.elapsed()
}

#[test]
fn agents_see_each_other_and_a_killed_peer_is_marked_down_within_two_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, TOKEN).unwrap();
    std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let peers = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect::<Vec<_>>().join(",");
    let mut agents: Vec<_> =
        ["a", "b", "c"].iter().zip(&ports).map(|(n, p)| spawn_agent(dir.path(), n, *p, &peers, &token)).collect();
    let all_up = |m: &[serde_json::Value]| m.len() == 2 && m.iter().all(|p| p["up"] == true);
    wait_until("every agent seeing both others up", Duration::from_secs(5), || {
        ["a", "b", "c"].iter().all(|n| all_up(&members_seen_by(dir.path(), n)))
    });
    let seen = members_seen_by(dir.path(), "a");
    // Listed in the order of their addresses, whose ports are whatever the system gave.
    let mut names: Vec<&str> = seen.iter().map(|p| p["node"].as_str().unwrap()).collect();
    names.sort_unstable();
    assert_eq!(names, ["b", "c"]);

    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(agents[1].id() as i32, libc::SIGKILL) };
    let killed = Instant::now();
    agents[1].wait().unwrap();
    let b = format!("127.0.0.1:{}", ports[1]);
    let b_down = |m: Vec<serde_json::Value>| m.iter().any(|p| p["address"] == b.as_str() && p["up"] == false);
    let took = wait_until("a marking b down", Duration::from_secs(2), || b_down(members_seen_by(dir.path(), "a")));
    eprintln!("a saw b down after {took:?}");
    // c pings on its own clock: it may notice a moment after a, but within the same two seconds of the kill.
    let left = Duration::from_secs(2).saturating_sub(killed.elapsed());
    wait_until("c marking b down", left, || b_down(members_seen_by(dir.path(), "c")));
    eprintln!("c saw b down after {:?}", killed.elapsed());
    let c_seen = members_seen_by(dir.path(), "a");
    assert!(c_seen.iter().any(|p| p["node"] == "c" && p["up"] == true), "a live peer was marked down: {c_seen:?}");

    // Back on the same port: up again on its first answer.
    agents[1] = spawn_agent(dir.path(), "b", ports[1], &peers, &token);
    wait_until("a seeing b up again", Duration::from_secs(3), || all_up(&members_seen_by(dir.path(), "a")));
    for a in &mut agents {
        a.kill().unwrap();
        a.wait().unwrap();
    }
}

#[tokio::test]
async fn a_stranger_on_one_port_cannot_relay_a_handshake_to_another_agent() {
    // The job's agent at `agent`; a stranger listens on a port the reader takes for another member's
    // (a member that is down, whose port anyone may bind) and relays every byte to the job's agent.
    let dir = tempfile::tempdir().unwrap();
    let o = options(dir.path());
    let bound = Agent::bind(o).await.unwrap();
    let agent = bound.peer_address().unwrap().to_string();
    let served = tokio::spawn(bound.serve(std::future::pending()));
    let squatted = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let member = squatted.local_addr().unwrap().to_string();
    let to = agent.clone();
    let relay = tokio::spawn(async move {
        let (mut reader, _) = squatted.accept().await.unwrap();
        let mut job = tokio::net::TcpStream::connect(&to).await.unwrap();
        let _ = tokio::io::copy_bidirectional(&mut reader, &mut job).await;
    });
    match Client::peer(&member, "reader", Some(TOKEN), Duration::from_secs(2)).await {
        Err(ClientError::Refused { message, .. }) => assert!(message.contains("does not go by"), "{message}"),
        Err(other) => panic!("expected a refusal, got {other}"),
        Ok(_) => panic!("a relayed handshake was welcomed"),
    }
    relay.abort();
    served.abort();
}

#[tokio::test]
async fn a_relay_on_the_path_to_the_agent_can_pass_frames_on_but_not_change_one() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // The members name the agent at an address whose traffic a stranger on the path relays (as a router
    // or an ARP spoofer would): the handshake goes through untouched, and then it changes one frame.
    let relay = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let member = relay.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let mut o = options(dir.path());
    o.me = member.clone();
    let bound = Agent::bind(o).await.unwrap();
    let agent = bound.peer_address().unwrap().to_string();
    let served = tokio::spawn(bound.serve(std::future::pending()));
    let relaying = tokio::spawn(async move {
        let (reader, _) = relay.accept().await.unwrap();
        let job = tokio::net::TcpStream::connect(&agent).await.unwrap();
        let (mut from_reader, mut to_agent) = (reader.into_split(), job.into_split());
        let up = tokio::spawn(async move { tokio::io::copy(&mut from_reader.0, &mut to_agent.1).await });
        // Down: the challenge and the welcome as they are, then the first frame after them changed.
        for frame in 0..3 {
            let mut len = [0u8; 4];
            to_agent.0.read_exact(&mut len).await.unwrap();
            let tag = if frame == 2 { protocol::TAG } else { 0 };
            let mut rest = vec![0u8; tag + u32::from_be_bytes(len) as usize];
            to_agent.0.read_exact(&mut rest).await.unwrap();
            if frame == 2 {
                *rest.last_mut().unwrap() ^= 1;
            }
            from_reader.1.write_all(&len).await.unwrap();
            from_reader.1.write_all(&rest).await.unwrap();
        }
        let _ = tokio::io::copy(&mut to_agent.0, &mut from_reader.1).await;
        up.abort();
    });
    let mut p = Client::peer(&member, "reader", Some(TOKEN), Duration::from_secs(2)).await.unwrap();
    match p.call(&Frame::Ping { nonce: 7 }).await {
        Err(ClientError::Broken { source, .. }) => {
            assert!(source.to_string().contains("does not carry the tag"), "{source}")
        }
        other => panic!("a frame changed on the way was taken: {other:?}"),
    }
    relaying.abort();
    served.abort();
}

#[tokio::test]
async fn an_agent_that_encrypts_is_read_only_through_the_cipher_and_refuses_a_peer_that_skips_it() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let relay = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let member = relay.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let mut o = options(dir.path());
    o.me = member.clone();
    o.encrypt = true;
    let bound = Agent::bind(o).await.unwrap();
    let agent = bound.peer_address().unwrap().to_string();
    let served = tokio::spawn(bound.serve(std::future::pending()));
    // A listener on the path keeps a copy of everything the agent sends.
    let to = agent.clone();
    let recording = tokio::spawn(async move {
        let (reader, _) = relay.accept().await.unwrap();
        let job = tokio::net::TcpStream::connect(&to).await.unwrap();
        let (mut from_reader, mut to_agent) = (reader.into_split(), job.into_split());
        let up = tokio::spawn(async move { tokio::io::copy(&mut from_reader.0, &mut to_agent.1).await });
        let mut seen = Vec::new();
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match to_agent.0.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    seen.extend_from_slice(&buf[..n]);
                    if from_reader.1.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            }
        }
        up.abort();
        seen
    });
    // The reader is not told to encrypt: the agent's welcome demands it.
    let mut p = Client::peer(&member, "reader", Some(TOKEN), Duration::from_secs(2)).await.unwrap();
    let status = p.status().await.unwrap();
    assert!(status.len() > 64, "{status}");
    drop(p);
    let seen = recording.await.unwrap();
    let plain = &status.as_bytes()[..48];
    assert!(!seen.windows(plain.len()).any(|w| w == plain), "the status crossed the wire readable");

    // A peer that sends a request before its key share is refused, and told why.
    let mut raw = tokio::net::TcpStream::connect(&agent).await.unwrap();
    let challenge = protocol::read_frame(&mut raw).await.unwrap().unwrap();
    let (hello_state, hello) =
        tierstore_core::cluster::session::ClientHello::answer(challenge, &member, "reader", Some(TOKEN)).unwrap();
    protocol::write_frame(&mut raw, &hello).await.unwrap();
    let welcomed = hello_state.welcome(protocol::read_frame(&mut raw).await.unwrap().unwrap()).unwrap();
    assert!(welcomed.encrypt);
    let mut seals = welcomed.seals;
    protocol::write_sealed(&mut raw, &mut seals.send, &Frame::Status).await.unwrap();
    match protocol::read_sealed(&mut raw, &mut seals.recv).await.unwrap() {
        Some(Frame::Error { message, .. }) => assert!(message.contains("encrypts every connection"), "{message}"),
        other => panic!("a peer that skipped the key exchange was answered: {other:?}"),
    }
    served.abort();
}
