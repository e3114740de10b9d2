//! Reading a file from the agent of the node that owns it: the cluster cache's side of the read path
//! that runs in every process (DYAD's order: local tiers, then the owner, then the source).
//!
//! The owner of a file is found by rendezvous hashing over the job's members ([`super::owners`]), with no
//! network hop. A process talks to the owner's agent directly over TCP, with a deadline on the connection
//! and on every frame: a dead or silent peer costs at most those deadlines, is marked down in this
//! process for [`DOWN_FOR`], and its files go to the next heaviest member (or to the source) meanwhile.
//! Once the owner has said which version it sends, the bytes come as a [`Transfer`] (`transfer.rs`: the
//! receiving and the checking of them). The tests here play the owner for both halves.

use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use super::config::ClusterConfig;
use super::owners::Owners;
use super::session::{ClientHello, HandshakeError, KeyShare};
use super::transfer::{RemoteError, Transfer};
use super::wire::{self, ErrorCode, Frame};

/// How long a member that missed a deadline is left out of this process's owner choice; doubled at each
/// further miss in a row, up to [`DOWN_AT_MOST`], so a dead node costs its readers a deadline now and then
/// rather than every few seconds.
pub const DOWN_FOR: Duration = Duration::from_secs(2);

/// The longest a member is left out before it is tried again.
pub const DOWN_AT_MOST: Duration = Duration::from_secs(60);

/// Chunks a reader lets the owner send ahead of what it has taken (8 MiB in flight per transfer).
pub const WINDOW: u32 = 8;

/// Who owns what among the members this process knows of.
struct View {
    owners: Owners,
    /// This node's index in `owners.members()`, if it is a member.
    me: Option<usize>,
}

impl View {
    fn of(members: &[String], mine: &str) -> View {
        let owners = Owners::new(members);
        let me = owners.members().iter().position(|n| n == mine);
        View { owners, me }
    }
}

/// How often a process asks its node's agent for the members, where a registry keeps them.
pub const MEMBERS_EVERY: Duration = Duration::from_secs(2);

/// The members of a job as one process sees them: who owns what, who is down, how to reach them.
pub struct Remote {
    view: RwLock<Arc<View>>,
    /// This node's agent, which knows the members when a registry keeps them (a fixed list otherwise).
    agent_socket: Option<PathBuf>,
    /// When the members were last asked of the agent.
    asked: Mutex<Option<Instant>>,
    mine: String,
    node: String,
    /// The job's token: every agent this reads from must prove it (see [`super::session`]).
    token: Vec<u8>,
    /// Whether every connection is encrypted (`[cluster] encrypt`).
    encrypt: bool,
    source: String,
    /// Members that missed a deadline: until when they are left out, and how many misses in a row.
    down: Mutex<HashMap<String, (Instant, u32)>>,
    connect_deadline: Duration,
    deadline: Duration,
    /// How long a reader waits for an owner that keeps saying it is still fetching the file.
    fetch_wait: Duration,
}

impl Remote {
    /// The members of `cluster`, serving files of `source` (as every node mounts it). `token` is the
    /// job's shared secret, which both ends of every connection prove.
    pub fn new(cluster: &ClusterConfig, source: &str, token: Vec<u8>) -> Remote {
        let names: Vec<String> = cluster.members.iter().map(|m| m.address()).collect();
        let mine = cluster.my_address();
        let ms = |var: &str| Duration::from_millis(crate::config::settings::tuning(var));
        let from_registry = cluster.registry.is_some() && names.is_empty();
        Remote {
            view: RwLock::new(Arc::new(View::of(&names, &mine))),
            agent_socket: from_registry.then(super::config::default_socket),
            asked: Mutex::new(None),
            mine,
            node: cluster.node.clone(),
            token,
            encrypt: cluster.encrypt,
            source: source.to_string(),
            down: Mutex::new(HashMap::new()),
            connect_deadline: ms("TIERSTORE_PEER_CONNECT_MS"),
            deadline: ms("TIERSTORE_PEER_DEADLINE_MS"),
            fetch_wait: ms("TIERSTORE_PEER_FETCH_WAIT_MS"),
        }
    }

    /// The member (`host:port`) that owns `rel` among those not marked down, when it is another node:
    /// `None` when this node owns it (or no member is known or up), and the file is read from the source.
    pub fn owner(&self, rel: &str) -> Option<String> {
        self.pick(rel, false)
    }

    /// The member whose agent serves parts of `rel` ([`Remote::open_ranges`]): its owner among the
    /// members not marked down, this node's own agent included. Parts go through the owner's agent even
    /// on the owner's node, so that the blocks it reads from the store serve every node of the job.
    pub fn parts_owner(&self, rel: &str) -> Option<String> {
        self.pick(rel, true)
    }

    /// The owner of `rel` among the members up (this node always counts as up, unless `mine_too`, which
    /// also names this node rather than answering `None` for it).
    fn pick(&self, rel: &str, mine_too: bool) -> Option<String> {
        self.refresh();
        let view = self.view.read().expect("view lock").clone();
        let now = Instant::now();
        let down = self.down.lock().expect("down lock");
        let names = view.owners.members();
        let out = |m: usize| down.get(&names[m]).is_some_and(|(until, _)| *until > now);
        let up = |m: usize| (!mine_too && Some(m) == view.me) || !out(m);
        let owner = view.owners.owner(rel.as_bytes(), up)?;
        if log::log_enabled!(log::Level::Debug) && !down.is_empty() {
            // Said at -vv: which file is read elsewhere than at its owner, and why.
            if let Some(first) = view.owners.owner(rel.as_bytes(), |_| true).filter(|&m| m != owner && out(m)) {
                let (until, strikes) = down[&names[first]];
                let instead = if Some(owner) == view.me && !mine_too { "the store" } else { names[owner].as_str() };
                log::debug!(
                    "{rel}: its owner {} is marked down for {:.1} s more (failed {strikes} time(s)); reading from \
                     {instead} instead",
                    names[first],
                    until.saturating_duration_since(now).as_secs_f64()
                );
            }
        }
        (mine_too || Some(owner) != view.me).then(|| names[owner].clone())
    }

    /// Asks this node's agent for the members, at most every [`MEMBERS_EVERY`] (where a registry keeps
    /// them). An agent that does not answer leaves the list as it was.
    fn refresh(&self) {
        let Some(socket) = &self.agent_socket else { return };
        {
            let mut asked = self.asked.lock().expect("asked lock");
            if asked.is_some_and(|t| t.elapsed() < MEMBERS_EVERY) {
                return;
            }
            *asked = Some(Instant::now());
        }
        match members_from_agent(socket, self.connect_deadline) {
            Ok(members) => {
                let changed = self.view.read().expect("view lock").owners.members() != members.as_slice();
                if changed {
                    *self.view.write().expect("view lock") = Arc::new(View::of(&members, &self.mine));
                }
            }
            Err(e) => log::debug!("the members could not be asked of the agent on {}: {e}", socket.display()),
        }
    }

    /// Leaves `who` out of the owner choice for [`DOWN_FOR`], or twice as long as last time if it
    /// failed again since.
    pub fn mark_down(&self, who: &str) {
        let mut down = self.down.lock().expect("down lock");
        let strikes = down.get(who).map_or(0, |(_, s)| *s).saturating_add(1);
        let wait = DOWN_FOR.saturating_mul(1 << (strikes - 1).min(10)).min(DOWN_AT_MOST);
        down.insert(who.to_string(), (Instant::now() + wait, strikes));
    }

    /// `who` served a request: it is up again.
    pub fn mark_up(&self, who: &str) {
        let mut down = self.down.lock().expect("down lock");
        if !down.is_empty() {
            down.remove(who);
        }
    }

    /// Asks member `who` for `rel`; returns once the owner has said which version it sends. A `credit` of
    /// 0 only asks the owner to cache the file.
    pub fn open(&self, who: &str, rel: &str, credit: u32) -> Result<Transfer, RemoteError> {
        let fetch = Frame::Fetch { id: 1, source: self.source.clone(), rel: rel.to_string(), credit };
        let mut t = self.request(who, &fetch)?;
        t.report_to(Frame::Damaged { id: 1, source: self.source.clone(), rel: rel.to_string() });
        Ok(t)
    }

    /// Asks member `who` for parts of `rel`: `(offset, length)` each, at most [`wire::MAX_RANGES`]; returns
    /// once the owner has said which version they come from. Take them with [`Transfer::receive_ranges`],
    /// with `hash` as here: without it, the owner hashes nothing (the caller checks every byte itself).
    pub fn open_ranges(
        &self,
        who: &str,
        rel: &str,
        ranges: &[(u64, u64)],
        hash: bool,
    ) -> Result<Transfer, RemoteError> {
        let (source, rel) = (self.source.clone(), rel.to_string());
        let (ranges, unhashed) = (ranges.to_vec(), !hash);
        let fetch =
            Frame::FetchRanges { id: 1, source: source.clone(), rel: rel.clone(), ranges, credit: WINDOW, unhashed };
        let mut t = self.request(who, &fetch)?;
        t.report_to(Frame::Damaged { id: 1, source, rel });
        Ok(t)
    }

    /// Asks member `who` for the staged copy of `path` (a file its node wrote under a write-back
    /// destination and has not yet put on the store); returns once it said which version it sends. A
    /// `credit` of 0 only asks whether it has one. `Refused` with [`ErrorCode::NotFound`]: it has none.
    pub fn open_staged(&self, who: &str, path: &str, credit: u32) -> Result<Transfer, RemoteError> {
        self.request(who, &Frame::StagedFetch { id: 1, path: path.to_string(), credit })
    }

    /// The members other than this node, leaving out those marked down.
    pub fn others(&self) -> Vec<String> {
        self.refresh();
        let view = self.view.read().expect("view lock").clone();
        let now = Instant::now();
        let down = self.down.lock().expect("down lock");
        let names = view.owners.members();
        (0..names.len())
            .filter(|m| Some(*m) != view.me && down.get(&names[*m]).is_none_or(|(until, _)| *until <= now))
            .map(|m| names[m].clone())
            .collect()
    }

    /// Connects to `who`, says hello and sends `request` (a transfer of id 1); returns once the file's
    /// identity came back.
    fn request(&self, who: &str, request: &Frame) -> Result<Transfer, RemoteError> {
        let at = who.to_string();
        let mut stream = self.connect(&at)?;
        let io_err = |at: &str, e: io::Error| match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                RemoteError::Deadline { at: at.to_string(), waited: self.deadline }
            }
            _ => RemoteError::Broken { at: at.to_string(), detail: e.to_string() },
        };
        let refused = |at: String, e: HandshakeError| match e {
            HandshakeError::Refused(code, message) => RemoteError::Refused { at, code, message },
            HandshakeError::Version(_) => RemoteError::Refused { at, code: ErrorCode::Version, message: e.to_string() },
            HandshakeError::Unproven => {
                RemoteError::Refused { at, code: ErrorCode::Unauthorized, message: e.to_string() }
            }
            HandshakeError::Unexpected { .. } => RemoteError::Broken { at, detail: e.to_string() },
        };
        let challenge = wire::read_frame(&mut stream).map_err(|e| io_err(&at, e))?;
        let challenge = challenge.ok_or_else(|| RemoteError::Broken { at: at.clone(), detail: "closed".into() })?;
        let (handshake, hello) =
            ClientHello::answer(challenge, &at, &self.node, Some(&self.token)).map_err(|e| refused(at.clone(), e))?;
        wire::write_frame(&mut stream, &hello).map_err(|e| io_err(&at, e))?;
        let answer = wire::read_frame(&mut stream).map_err(|e| io_err(&at, e))?;
        let answer = answer.ok_or_else(|| RemoteError::Broken { at: at.clone(), detail: "closed".into() })?;
        let welcomed = handshake.welcome(answer).map_err(|e| refused(at.clone(), e))?;
        let mut seals = welcomed.seals;
        if self.encrypt || welcomed.encrypt {
            let (share, frame) = KeyShare::new();
            seals.send.write_frame(&mut stream, &frame).map_err(|e| io_err(&at, e))?;
            let theirs = seals.recv.read_frame(&mut stream).map_err(|e| io_err(&at, e))?;
            let theirs = theirs.ok_or_else(|| RemoteError::Broken { at: at.clone(), detail: "closed".into() })?;
            share.finish(theirs, &mut seals).map_err(|e| refused(at.clone(), e))?;
        }
        seals.send.write_frame(&mut stream, request).map_err(|e| io_err(&at, e))?;
        // An owner that is still fetching a large file from the store says so (a ping) within every
        // deadline: a silent one costs a deadline, a busy one is waited for up to `fetch_wait`, which is
        // still much less than reading the store a second time.
        let asked = Instant::now();
        let found = loop {
            match seals.recv.read_frame(&mut stream).map_err(|e| io_err(&at, e))? {
                Some(Frame::Found { id: 1, identity }) => break identity,
                Some(Frame::Ping { .. }) if asked.elapsed() < self.fetch_wait => {}
                Some(Frame::Ping { .. }) => return Err(RemoteError::Deadline { at, waited: self.fetch_wait }),
                Some(Frame::Error { code, message }) => return Err(RemoteError::Refused { at, code, message }),
                other => {
                    return Err(RemoteError::Broken {
                        at,
                        detail: format!("expected the file's identity, got {other:?}"),
                    })
                }
            }
        };
        Ok(Transfer::new(stream, seals, at, found, self.deadline, self.fetch_wait))
    }

    fn connect(&self, at: &str) -> Result<TcpStream, RemoteError> {
        let addrs: Vec<SocketAddr> =
            at.to_socket_addrs().map_err(|source| RemoteError::Unreachable { at: at.to_string(), source })?.collect();
        let mut last = io::Error::new(io::ErrorKind::NotFound, "the name resolves to no address");
        for addr in addrs {
            match super::dial::dial(&addr, self.connect_deadline) {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    s.set_read_timeout(Some(self.deadline)).map_err(RemoteError::Sink)?;
                    s.set_write_timeout(Some(self.deadline)).map_err(RemoteError::Sink)?;
                    return Ok(s);
                }
                Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                    return Err(RemoteError::Deadline { at: at.to_string(), waited: self.connect_deadline })
                }
                Err(e) => last = e,
            }
        }
        Err(RemoteError::Unreachable { at: at.to_string(), source: last })
    }
}

/// The members the agent on `socket` knows of.
fn members_from_agent(socket: &Path, deadline: Duration) -> io::Result<Vec<String>> {
    let mut s = super::dial::dial_local(socket, deadline)?;
    crate::private::check_peer(&s, socket)?;
    s.set_read_timeout(Some(deadline))?;
    s.set_write_timeout(Some(deadline))?;
    let bad = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
    let closed = || bad("the agent closed the connection".into());
    let (handshake, hello) = ClientHello::answer(wire::read_frame(&mut s)?.ok_or_else(closed)?, "", "local", None)
        .map_err(|e| bad(e.to_string()))?;
    wire::write_frame(&mut s, &hello)?;
    handshake.welcome(wire::read_frame(&mut s)?.ok_or_else(closed)?).map_err(|e| bad(e.to_string()))?;
    wire::write_frame(&mut s, &Frame::Members)?;
    match wire::read_frame(&mut s)? {
        Some(Frame::MemberList { members }) => Ok(members),
        other => Err(bad(format!("expected the members, got {other:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;
    use crate::cluster::seal::Seals;
    use crate::cluster::transfer::Dest;
    use crate::cluster::wire::VERSION;
    use crate::index::SourceId;

    /// A fake owner's connection, after the handshake: its frames are tagged as an agent's are.
    struct Fake {
        s: TcpStream,
        seals: Seals,
    }

    impl Fake {
        fn send(&mut self, frame: &Frame) -> io::Result<()> {
            self.seals.send.write_frame(&mut self.s, frame)
        }

        fn recv(&mut self) -> io::Result<Option<Frame>> {
            self.seals.recv.read_frame(&mut self.s)
        }
    }

    /// A fake owner's side of a `Fetch` on `l`: the handshake and the `Fetch`, answered with a `Found`
    /// for a file of `size` bytes.
    fn found(l: &TcpListener, size: usize) -> Fake {
        found_with(l, size, false)
    }

    /// [`found`], by an owner that demands encryption (`[cluster] encrypt`) when `encrypt`.
    fn found_with(l: &TcpListener, size: usize, encrypt: bool) -> Fake {
        use crate::cluster::session::{welcome, AgentSide, KeyShare};
        let (mut s, _) = l.accept().unwrap();
        let nonce = crate::cluster::session::nonce();
        wire::write_frame(&mut s, &Frame::Challenge { version: VERSION, nonce }).unwrap();
        let hello = wire::read_frame(&mut s).unwrap().unwrap();
        let names = [l.local_addr().unwrap().to_string()];
        let agent = AgentSide { token: Some(TOKEN), names: &names, me: "owner", encrypt };
        let (welcome, seals) = welcome(&hello, &nonce, &agent).unwrap();
        wire::write_frame(&mut s, &welcome).unwrap();
        let mut fake = Fake { s, seals };
        if encrypt {
            let (share, frame) = KeyShare::new();
            let theirs = fake.recv().unwrap().unwrap();
            fake.send(&frame).unwrap();
            share.finish(theirs, &mut fake.seals).unwrap();
        }
        let asked = fake.recv().unwrap();
        assert!(matches!(asked, Some(Frame::Fetch { .. } | Frame::FetchRanges { .. })), "{asked:?}");
        let identity = SourceId { size: size as u64, mtime_ns: 1, ctime_ns: 1, ino: 1, dev: 1, attrs: None };
        fake.send(&Frame::Found { id: 1, identity }).unwrap();
        fake
    }

    /// A fake owner on 127.0.0.1:0 that sends `data` under the blake3 `vouched`, then answers a
    /// `Damaged` report with `Checked`; returns its address and the frames it received after the
    /// `Fetch`.
    fn owner(data: Vec<u8>, vouched: [u8; 32]) -> (String, std::thread::JoinHandle<Vec<Frame>>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap().to_string();
        let h = std::thread::spawn(move || {
            let mut s = found(&l, data.len());
            for (i, c) in data.chunks(wire::CHUNK).enumerate() {
                let offset = (i * wire::CHUNK) as u64;
                s.send(&Frame::Chunk { id: 1, offset, data: c.to_vec() }).unwrap();
            }
            s.send(&Frame::Done { id: 1, hash: vouched }).unwrap();
            let mut after = Vec::new();
            while let Ok(Some(f)) = s.recv() {
                if let Frame::Damaged { id, .. } = &f {
                    s.send(&Frame::Checked { id: *id, removed: true }).unwrap();
                }
                after.push(f);
            }
            after
        });
        (at, h)
    }

    /// A fake owner on 127.0.0.1:0 sending `data` as a copy it is still making: each chunk after its
    /// vouch (the chaining value of the bytes it read), a ping after the first, and the blake3 the vouches
    /// merge into. Piece `damaged`, if any, goes out with a flipped byte.
    fn vouching_owner(data: Vec<u8>, damaged: Option<usize>) -> (String, std::thread::JoinHandle<()>) {
        use crate::hash::{root_of_pieces, subtree, PIECE};
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap().to_string();
        let h = std::thread::spawn(move || {
            let mut s = found(&l, data.len());
            let mut cvs = Vec::new();
            for (k, c) in data.chunks(PIECE).enumerate() {
                let offset = (k * PIECE) as u64;
                let cv = subtree(offset, c);
                cvs.push(cv);
                s.send(&Frame::Vouch { id: 1, offset, cv }).unwrap();
                let mut sent = c.to_vec();
                if damaged == Some(k) {
                    sent[7] ^= 1;
                }
                if s.send(&Frame::Chunk { id: 1, offset, data: sent }).is_err() {
                    return;
                }
                if k == 0 {
                    let _ = s.send(&Frame::Ping { nonce: 1 });
                }
            }
            let hash = root_of_pieces(&cvs, data.len() as u64, PIECE);
            let _ = s.send(&Frame::Done { id: 1, hash });
            // Credit and a damage report may follow; answer the report, then wait for the close.
            while let Ok(Some(f)) = s.recv() {
                if let Frame::Damaged { id, .. } = f {
                    let _ = s.send(&Frame::Checked { id, removed: false });
                }
            }
        });
        (at, h)
    }

    #[test]
    fn each_vouched_chunk_is_usable_as_it_arrives_and_the_vouches_make_the_files_hash() {
        let data: Vec<u8> = (0..2 * wire::CHUNK + 5).map(|i| (i % 239) as u8).collect();
        let (at, h) = vouching_owner(data.clone(), None);
        let t = remote().open(&at, "a/b", WINDOW).unwrap();
        let file = tempfile::tempfile().unwrap();
        let mut usable = Vec::new();
        let hash = t.receive_into(Dest::Growing(&file, &mut |end| usable.push(end))).unwrap();
        h.join().unwrap();
        assert_eq!(hash, crate::hash::hash(&data));
        let c = wire::CHUNK as u64;
        assert_eq!(usable, vec![c, 2 * c], "each chunk but the last is usable once it is checked");
        let mut got = vec![0u8; data.len()];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut got, 0).unwrap();
        assert_eq!(got, data);
    }

    #[test]
    fn a_chunk_that_does_not_match_its_vouch_is_never_usable() {
        let data: Vec<u8> = (0..3 * wire::CHUNK).map(|i| (i % 233) as u8).collect();
        let (at, h) = vouching_owner(data, Some(1));
        let t = remote().open(&at, "a/b", WINDOW).unwrap();
        let file = tempfile::tempfile().unwrap();
        let mut usable = Vec::new();
        match t.receive_into(Dest::Growing(&file, &mut |end| usable.push(end))) {
            Err(RemoteError::Corrupt { detail, .. }) => assert!(detail.contains("vouched"), "{detail}"),
            other => panic!("{other:?}"),
        }
        h.join().unwrap();
        assert_eq!(usable, vec![wire::CHUNK as u64], "only the chunk before the damaged one was usable");
    }

    #[test]
    fn bytes_and_a_blake3_injected_on_the_way_are_never_taken() {
        // A stranger on the path replaces the file's bytes and the blake3 that vouches for them; it can
        // write a Done frame, but not under this connection's key.
        let (data, forged) = (vec![1u8; 1000], vec![2u8; 1000]);
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap().to_string();
        let h = std::thread::spawn(move || {
            let mut s = found(&l, data.len());
            s.send(&Frame::Chunk { id: 1, offset: 0, data: forged.clone() }).unwrap();
            let mut stranger = crate::cluster::seal::Seal::keyed([9; 32]);
            let _ = stranger.write_frame(&mut s.s, &Frame::Done { id: 1, hash: crate::hash::hash(&forged) });
            let _ = s.recv();
        });
        let mut got = Vec::new();
        match remote().open(&at, "a/b", WINDOW).unwrap().receive_into(Dest::Bytes(&mut got)) {
            Err(RemoteError::Broken { detail, .. }) => assert!(detail.contains("does not carry the tag"), "{detail}"),
            other => panic!("a forged transfer was taken: {other:?}"),
        }
        assert!(got.is_empty(), "no byte of a refused transfer is left for the caller");
        h.join().unwrap();
    }

    #[test]
    fn an_owner_that_demands_encryption_gets_only_encrypted_frames_and_serves_the_file_whole() {
        let data: Vec<u8> = (0..2 * wire::CHUNK + 77).map(|i| (i % 239) as u8).collect();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap().to_string();
        let sent = data.clone();
        let h = std::thread::spawn(move || {
            let mut s = found_with(&l, sent.len(), true);
            assert!(s.seals.encrypted());
            for (i, c) in sent.chunks(wire::CHUNK).enumerate() {
                s.send(&Frame::Chunk { id: 1, offset: (i * wire::CHUNK) as u64, data: c.to_vec() }).unwrap();
            }
            s.send(&Frame::Done { id: 1, hash: crate::hash::hash(&sent) }).unwrap();
            while let Ok(Some(_)) = s.recv() {}
        });
        // The reader is not configured to encrypt: the owner's welcome demands it.
        let mut got = Vec::new();
        let hash = remote().open(&at, "a/b", WINDOW).unwrap().receive_into(Dest::Bytes(&mut got)).unwrap();
        assert_eq!(hash, crate::hash::hash(&data));
        assert_eq!(got, data);
        h.join().unwrap();
    }

    const TOKEN: &[u8] = b"the-token-of-this-test-job-0123456789abcdef";

    fn remote() -> Remote {
        Remote::new(&ClusterConfig::default(), "/store", TOKEN.to_vec())
    }

    /// A fake owner on 127.0.0.1:0 sending the parts `ranges` of `data`, each in chunks that never cross
    /// a 1 MiB block, then the blake3 of all of them; the chunk at `misplaced`, if any, goes out one byte
    /// later than it should. Returns its address and the frames it received after the request.
    fn parts_owner(
        data: Vec<u8>,
        ranges: Vec<(u64, u64)>,
        misplaced: Option<u64>,
    ) -> (String, std::thread::JoinHandle<Vec<Frame>>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap().to_string();
        let h = std::thread::spawn(move || {
            let mut s = found(&l, data.len());
            let mut hasher = crate::hash::Hasher::new();
            for (offset, len) in ranges {
                let (mut at, end) = (offset, offset + len);
                while at < end {
                    let n = (end - at).min(wire::CHUNK as u64 - at % wire::CHUNK as u64);
                    let bytes = data[at as usize..(at + n) as usize].to_vec();
                    hasher.update(&bytes);
                    let sent_at = if misplaced == Some(at) { at + 1 } else { at };
                    if s.send(&Frame::Chunk { id: 1, offset: sent_at, data: bytes }).is_err() {
                        return Vec::new();
                    }
                    at += n;
                }
            }
            let _ = s.send(&Frame::Done { id: 1, hash: *hasher.finalize().as_bytes() });
            let mut after = Vec::new();
            while let Ok(Some(f)) = s.recv() {
                if let Frame::Damaged { id, .. } = &f {
                    let _ = s.send(&Frame::Checked { id: *id, removed: false });
                }
                after.push(f);
            }
            after
        });
        (at, h)
    }

    #[test]
    fn parts_land_in_their_buffers_in_the_order_asked_and_a_failed_check_is_reported() {
        let data: Vec<u8> = (0..5 * wire::CHUNK).map(|i| (i % 241) as u8).collect();
        // Out of file order, one crossing two block boundaries, one empty.
        let ranges =
            vec![(3 * wire::CHUNK as u64 + 10, 100), (wire::CHUNK as u64 - 7, wire::CHUNK as u64 + 14), (0, 0)];
        let (at, h) = parts_owner(data.clone(), ranges.clone(), None);
        let mut t = remote().open_ranges(&at, "a/b", &ranges, true).unwrap();
        let mut bufs: Vec<Vec<u8>> = ranges.iter().map(|(_, n)| vec![0u8; *n as usize]).collect();
        let mut dests: Vec<(u64, &mut [u8])> =
            ranges.iter().zip(bufs.iter_mut()).map(|((o, _), b)| (*o, b.as_mut_slice())).collect();
        t.receive_ranges(&mut dests, true).unwrap();
        for ((offset, len), got) in ranges.iter().zip(&bufs) {
            assert_eq!(got[..], data[*offset as usize..(*offset + *len) as usize]);
        }
        // The caller's own check failed: the owner is told.
        assert!(t.damaged().contains("matches its record"));
        drop(t);
        let after = h.join().unwrap();
        assert!(matches!(after.last(), Some(Frame::Damaged { .. })), "{after:?}");
    }

    #[test]
    fn a_part_sent_at_another_offset_than_asked_is_refused() {
        let data = vec![3u8; 3 * wire::CHUNK];
        let ranges = vec![(0, 3 * wire::CHUNK as u64)];
        let (at, h) = parts_owner(data, ranges.clone(), Some(wire::CHUNK as u64));
        let mut t = remote().open_ranges(&at, "a/b", &ranges, true).unwrap();
        let mut buf = vec![0u8; 3 * wire::CHUNK];
        match t.receive_ranges(&mut [(0, &mut buf[..])], true) {
            Err(RemoteError::Corrupt { detail, .. }) => assert!(detail.contains("expected one at"), "{detail}"),
            other => panic!("{other:?}"),
        }
        drop(t);
        h.join().unwrap();
    }

    #[test]
    fn the_bytes_land_in_the_buffer_when_they_match_the_owners_hash() {
        let data: Vec<u8> = (0..2 * wire::CHUNK + 5).map(|i| (i % 241) as u8).collect();
        let (at, h) = owner(data.clone(), crate::hash::hash(&data));
        let t = remote().open(&at, "a/b", WINDOW).unwrap();
        let mut got = Vec::with_capacity(data.len());
        assert_eq!(t.receive_into(Dest::Bytes(&mut got)).unwrap(), crate::hash::hash(&data));
        assert_eq!(got, data);
        // Credit for every chunk but the last; no report.
        let after = h.join().unwrap();
        assert!(after.iter().all(|f| matches!(f, Frame::Credit { .. })), "{after:?}");
    }

    #[test]
    fn a_mismatch_leaves_nothing_in_the_buffer_and_is_reported_to_the_owner() {
        let data = vec![9u8; wire::CHUNK + 1];
        let (at, h) = owner(data, [1; 32]);
        let t = remote().open(&at, "a/b", WINDOW).unwrap();
        let mut got = Vec::new();
        match t.receive_into(Dest::Bytes(&mut got)) {
            Err(RemoteError::Corrupt { detail, .. }) => assert!(detail.contains("removed"), "{detail}"),
            other => panic!("{other:?}"),
        }
        assert!(got.is_empty(), "unchecked bytes were left for the caller");
        let after = h.join().unwrap();
        assert_eq!(
            after.last(),
            Some(&Frame::Damaged { id: 1, source: "/store".into(), rel: "a/b".into() }),
            "{after:?}"
        );
    }
}
