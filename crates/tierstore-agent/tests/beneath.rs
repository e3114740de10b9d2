//! A peer's request never reaches a file outside the source (issue #35, item 8): a symlink planted in the
//! source that leads out of it (an absolute target, `..`, a directory symlink) is refused with an error
//! frame and not one byte of its target is sent, over TCP to a real agent, whether its cache holds a copy
//! of the target (made by a local open, which follows the symlink) or not, for `Fetch` (whole files and
//! files followed as they are copied), `FetchRanges` and `Damaged`. A symlink inside the source to a file
//! inside it is served as before.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tierstore_agent::client::Client;
use tierstore_agent::protocol::{ErrorCode, Frame};
use tierstore_agent::server::{Agent, Options};
use tierstore_core::cluster::Sharing;
use tierstore_core::config::{Config, Overrides};
use tierstore_core::Cache;

const TOKEN: &[u8] = b"0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0";

/// The secret's bytes: a pattern no file of the source holds, so that any of it in a chunk shows.
fn secret(len: usize) -> Vec<u8> {
    b"SECRET-OF-A:id_rsa;".iter().copied().cycle().take(len).collect()
}

fn inside(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8).collect()
}

/// A source with files inside it and symlinks out of it, and the secret files outside it.
struct World {
    _dir: tempfile::TempDir,
    source: PathBuf,
    tier: PathBuf,
    small_secret: Vec<u8>,
    big_secret: Vec<u8>,
}

fn world() -> World {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().canonicalize().unwrap();
    let source = base.join("source");
    let outside = base.join("home-of-a");
    std::fs::create_dir_all(source.join("shared")).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    let (small_secret, big_secret) = (secret(3000), secret(3 << 20));
    std::fs::write(outside.join("id_rsa"), &small_secret).unwrap();
    std::fs::write(outside.join("big_secret"), &big_secret).unwrap();
    std::fs::write(source.join("inside.txt"), inside(5000)).unwrap();
    std::fs::write(source.join("big_inside.bin"), inside(3 << 20)).unwrap();
    let link = |target: &Path, name: &str| std::os::unix::fs::symlink(target, source.join(name)).unwrap();
    // Inside the source, to files inside it: served.
    link(Path::new("inside.txt"), "link_in");
    link(Path::new("../big_inside.bin"), "shared/big_link_in");
    // Out of it: an absolute target, `..` past the root, a directory symlink.
    link(&outside.join("id_rsa"), "shared/innocent.txt");
    link(Path::new("../home-of-a/id_rsa"), "up");
    link(Path::new("../../home-of-a/big_secret"), "shared/big_up");
    link(&outside, "shared/home");
    World { tier: base.join("tier"), source, _dir: dir, small_secret, big_secret }
}

fn config(w: &World, sharing: Sharing) -> Config {
    let o = Overrides::default()
        .with_tiers(&[(w.tier.display().to_string(), Some("256M".into()))])
        .with("source", w.source.display().to_string())
        .with("inline_max", "64KiB");
    let mut c = Config::load_with_env(&o, &Default::default()).unwrap();
    // The agent's cache asks no peer: no member list or token file is needed for it. Sharing on makes
    // its copies record their blake3, and a large file is then sent while its copy is still being made.
    c.cluster.sharing = sharing;
    c
}

/// What an agent answered to one request: the frames, and every byte its chunks carried.
struct Answer {
    frames: Vec<Frame>,
    bytes: Vec<u8>,
}

impl Answer {
    fn refusal(&self) -> Option<(&ErrorCode, &str)> {
        self.frames.iter().find_map(|f| match f {
            Frame::Error { code, message } => Some((code, message.as_str())),
            _ => None,
        })
    }
}

/// Sends `request` (a `Fetch` or `FetchRanges` with credit for the whole file) and collects the answer up
/// to its `Done` or `Error`.
async fn ask(c: &mut Client<tokio::net::TcpStream>, request: Frame) -> Answer {
    c.send_frame(&request).await.unwrap();
    let mut answer = Answer { frames: Vec::new(), bytes: Vec::new() };
    loop {
        let f = c.receive_frame().await.unwrap();
        if let Frame::Chunk { data, .. } = &f {
            answer.bytes.extend_from_slice(data);
        }
        let end = matches!(f, Frame::Done { .. } | Frame::Error { .. });
        if !matches!(f, Frame::Ping { .. } | Frame::Vouch { .. } | Frame::Chunk { .. }) {
            answer.frames.push(f);
        }
        if end {
            return answer;
        }
    }
}

fn fetch(source: &Path, rel: &str, id: u32) -> Frame {
    Frame::Fetch { id, source: source.display().to_string(), rel: rel.into(), credit: 64 }
}

fn ranges(source: &Path, rel: &str, id: u32) -> Frame {
    let ranges = vec![(0, 100), (1000, 1500)];
    Frame::FetchRanges {
        id,
        source: source.display().to_string(),
        rel: rel.into(),
        ranges,
        credit: 64,
        unhashed: false,
    }
}

/// The whole of `path`, read through the cache as a program of the node reads it.
fn read_locally(cache: &Cache, path: &Path) -> Vec<u8> {
    let mut r = cache.open(path).unwrap();
    let mut out = vec![0u8; r.size() as usize];
    assert_eq!(r.read_full(&mut out).unwrap(), out.len());
    out
}

/// Whether any 16 bytes of `secret` appear in `got`.
fn leaks(got: &[u8], secret: &[u8]) -> bool {
    !got.is_empty() && got.windows(16).any(|w| secret.windows(16).any(|s| s == w))
}

async fn the_agent_serves_only_beneath_the_source(sharing: Sharing) {
    let w = world();
    let agent_cache = Arc::new(Cache::serving(config(&w, sharing)).unwrap());
    // A local program of the node reads the secrets through the symlinks first: a local open follows the
    // file system's rules, so its bytes are right and the node's tier holds copies of the targets.
    let local = Cache::new(config(&w, Sharing::Off)).unwrap();
    for (rel, want) in [("shared/innocent.txt", &w.small_secret), ("shared/big_up", &w.big_secret)] {
        assert_eq!(&read_locally(&local, &w.source.join(rel)), want, "a local open of {rel} follows the symlink");
    }
    local.wait_idle();

    let run = tempfile::tempdir().unwrap();
    let mut o = Options::new("node-a", run.path().join("agent.sock"));
    o.listen = Some("127.0.0.1:0".parse().unwrap());
    o.token = Some(TOKEN.to_vec());
    o.deadline = Duration::from_secs(10);
    o.cache = Some(agent_cache.clone());
    let agent = Agent::bind(o).await.unwrap();
    let addr = agent.peer_address().unwrap().to_string();
    tokio::spawn(agent.serve(std::future::pending()));
    let mut c = Client::peer(&addr, "node-b", Some(TOKEN), Duration::from_secs(10)).await.unwrap();

    // Inside the source: served, through a symlink too, and twice (the second time from the copy).
    for round in 0..2 {
        for (rel, want) in [
            ("inside.txt", inside(5000)),
            ("link_in", inside(5000)),
            ("big_inside.bin", inside(3 << 20)),
            ("shared/big_link_in", inside(3 << 20)),
        ] {
            let opens = agent_cache.stats().source.opens;
            let a = ask(&mut c, fetch(&w.source, rel, 1)).await;
            assert!(a.refusal().is_none(), "round {round}: {rel} refused: {:?}", a.refusal());
            assert!(matches!(a.frames.first(), Some(Frame::Found { .. })), "{:?}", a.frames);
            assert_eq!(a.bytes, want, "round {round}: the bytes of {rel}");
            // The store is opened once for a file's first request (its copy is made from the file opened
            // beneath the source), and a copy of a file named by its own path (no symlink) is served later
            // with no request to the store at all; one named through a symlink is opened beneath again.
            let opened = agent_cache.stats().source.opens - opens;
            let want_opens = if round == 0 || rel.contains("link") { 1 } else { 0 };
            assert_eq!(opened, want_opens, "round {round}: {rel} opened the store {opened} times");
            let a = ask(&mut c, ranges(&w.source, rel, 2)).await;
            assert!(a.refusal().is_none(), "round {round}: parts of {rel} refused: {:?}", a.refusal());
            let mut parts = want[..100].to_vec();
            parts.extend_from_slice(&want[1000..2500]);
            assert_eq!(a.bytes, parts, "round {round}: the parts of {rel}");
        }
    }

    // Out of it: refused with an error that says why, and not one byte of a secret sent, whether a tier
    // holds a copy of the target (innocent.txt, big_up) or not (up, home/…).
    let secrets: Vec<u8> = [w.small_secret.clone(), w.big_secret.clone()].concat();
    for rel in ["shared/innocent.txt", "up", "shared/big_up", "shared/home/id_rsa", "shared/home/big_secret"] {
        for (what, request) in [("Fetch", fetch(&w.source, rel, 3)), ("FetchRanges", ranges(&w.source, rel, 4))] {
            let a = ask(&mut c, request).await;
            assert!(!leaks(&a.bytes, &secrets), "{what} of {rel} sent bytes of a secret");
            assert!(a.bytes.is_empty(), "{what} of {rel} sent {} bytes", a.bytes.len());
            assert!(!a.frames.iter().any(|f| matches!(f, Frame::Found { .. })), "{what} of {rel}: {:?}", a.frames);
            let (code, message) = a.refusal().unwrap_or_else(|| panic!("{what} of {rel} was not refused"));
            assert_eq!(*code, ErrorCode::Failed, "{what} of {rel}: {message}");
            assert!(message.contains("resolves outside the source"), "{what} of {rel}: {message}");
        }
        // A report of damage names no copy of a file outside the source: nothing is checked or removed.
        let damaged = Frame::Damaged { id: 5, source: w.source.display().to_string(), rel: rel.into() };
        assert_eq!(c.call(&damaged).await.unwrap(), Frame::Checked { id: 5, removed: false });
    }
    // The agent counts what it served after its `Done`: every count is in once an answer that follows has come.
    let served = agent_cache.stats().source.served_bytes;
    let inside_bytes = 2 * (2 * 5000 + 2 * (3 << 20) + 4 * 1600);
    assert_eq!(served, inside_bytes as u64, "the agent served only the files beneath the source");
    // The connection is still good, and the local copies of the secrets still serve their local readers.
    let a = ask(&mut c, fetch(&w.source, "link_in", 6)).await;
    assert_eq!(a.bytes, inside(5000));
    assert_eq!(read_locally(&local, &w.source.join("shared/innocent.txt")), w.small_secret);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_symlink_out_of_the_source_is_refused_to_a_peer_and_one_inside_is_served() {
    the_agent_serves_only_beneath_the_source(Sharing::Off).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_sharing_on_a_large_file_followed_as_it_is_copied_stays_beneath_the_source_too() {
    the_agent_serves_only_beneath_the_source(Sharing::Inclusive).await;
}
