//! One conformance suite for every registry: the embedded one, and Redis on a real `redis-server`
//! started on a free loopback port (`make setup` installs it).

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tierstore_agent::registry::{Embedded, Redis, Registry, Signed};

const TOKEN: &[u8] = b"the-token-of-the-job-0123456789abcdef";

/// A redis-server of this test's own, stopped when dropped.
struct Server {
    child: Child,
    port: u16,
}

impl Server {
    fn start() -> Server {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server is not installed: `make setup` installs it (apt-get install redis-server)");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        Server { child, port }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn conformance(r: &dyn Registry) {
    // Members: join, renew, expire, leave.
    assert_eq!(r.members().unwrap(), Vec::<String>::new());
    r.join("b:7078", Duration::from_secs(30)).unwrap();
    r.join("a:7078", Duration::from_millis(300)).unwrap();
    assert_eq!(r.members().unwrap(), vec!["a:7078", "b:7078"]);
    std::thread::sleep(Duration::from_millis(150));
    r.join("a:7078", Duration::from_millis(300)).unwrap(); // a heartbeat renews
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(r.members().unwrap(), vec!["a:7078", "b:7078"], "a renewed member expired");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(r.members().unwrap(), vec!["b:7078"], "an expired member is still listed");
    r.leave("b:7078").unwrap();
    assert!(r.members().unwrap().is_empty());
    r.leave("never-joined:1").unwrap();
    // Keys: set, overwrite, expire, remove; binary values.
    assert_eq!(r.get("k").unwrap(), None);
    r.put("k", b"v1", None).unwrap();
    r.put("k", &[0, 255, 7], None).unwrap();
    assert_eq!(r.get("k").unwrap(), Some(vec![0, 255, 7]));
    r.put("short", b"x", Some(Duration::from_millis(100))).unwrap();
    assert_eq!(r.get("short").unwrap(), Some(b"x".to_vec()));
    std::thread::sleep(Duration::from_millis(250));
    assert_eq!(r.get("short").unwrap(), None, "an expired key is still set");
    assert!(r.remove("k").unwrap());
    assert!(!r.remove("k").unwrap());
    assert_eq!(r.get("k").unwrap(), None);
}

#[test]
fn the_embedded_registry_conforms() {
    conformance(&Embedded::default());
}

#[test]
fn the_redis_registry_conforms_on_a_real_server() {
    let server = Server::start();
    conformance(&Redis::connect(&server.url(), "job-a", Duration::from_secs(1)).unwrap());
}

#[test]
fn signed_registries_conform_and_ignore_what_a_stranger_writes_into_redis() {
    conformance(&Signed::new(Box::new(Embedded::default()), "job", TOKEN));
    let server = Server::start();
    let signed = || Box::new(Redis::connect(&server.url(), "job-s", Duration::from_secs(1)).unwrap());
    conformance(&Signed::new(signed(), "job-s", TOKEN));
    // One ZADD of a stranger's into the job's key, as anyone who reaches the Redis can do.
    let job = Signed::new(signed(), "job-s", TOKEN);
    job.join("10.0.0.1:7078", Duration::from_secs(10)).unwrap();
    signed().join("10.6.6.6:7078", Duration::from_secs(10)).unwrap();
    assert_eq!(job.members().unwrap(), vec!["10.0.0.1:7078".to_string()]);
}

/// What a stranger writes into the job's registry is never a member, and the agent's status counts each
/// such entry once among its registry errors, however many heartbeats list it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_counts_each_refused_registry_entry_once_in_its_status() {
    use std::sync::Arc;
    use tierstore_agent::client::Client;
    use tierstore_agent::server::{Agent, Options};

    let dir = tempfile::tempdir().unwrap();
    let registry = Arc::new(Embedded::default());
    for i in 0..5 {
        registry.join(&format!("10.6.6.{i}:7078"), Duration::from_secs(30)).unwrap();
    }
    let mut o = Options::new("node-a", dir.path().join("agent.sock"));
    o.token = Some(TOKEN.to_vec());
    o.me = "127.0.0.1:7078".into();
    o.heartbeat = Duration::from_millis(20);
    o.registry = Some(Arc::new(Signed::new(Box::new(registry.clone()), "job", TOKEN)));
    let agent = Agent::bind(o.clone()).await.unwrap();
    let served = tokio::spawn(agent.serve(std::future::pending()));
    let mut local = Client::local(&o.socket, Duration::from_secs(2)).await.unwrap();
    let status = |text: String| serde_json::from_str::<serde_json::Value>(&text).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let s = status(local.status().await.unwrap());
        if s["registry_errors"] == 5 {
            break;
        }
        assert!(Instant::now() < deadline, "the refused entries are not counted: {s}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await; // ten heartbeats more
    let s = status(local.status().await.unwrap());
    assert_eq!(s["registry_errors"], 5, "{s}");
    assert_eq!(s["members"], serde_json::json!([]), "{s}");
    served.abort();
}

#[test]
fn jobs_sharing_a_redis_do_not_see_each_other() {
    let server = Server::start();
    let a = Redis::connect(&server.url(), "job-a", Duration::from_secs(1)).unwrap();
    let b = Redis::connect(&server.url(), "job-b", Duration::from_secs(1)).unwrap();
    a.join("n1:7078", Duration::from_secs(30)).unwrap();
    a.put("k", b"a", None).unwrap();
    assert!(b.members().unwrap().is_empty());
    assert_eq!(b.get("k").unwrap(), None);
}

#[test]
fn a_stopped_redis_fails_each_call_within_the_deadline_and_a_restarted_one_is_reconnected() {
    let mut server = Server::start();
    let port = server.port;
    let r = Redis::connect(&server.url(), "job", Duration::from_millis(500)).unwrap();
    r.join("n1:7078", Duration::from_secs(30)).unwrap();
    let _ = server.child.kill();
    let _ = server.child.wait();
    let t = Instant::now();
    let e = r.members().unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(3), "a call to a dead registry took {:?}", t.elapsed());
    assert!(e.to_string().contains(&port.to_string()), "{e}");
    // The same port again: the registry reconnects on its own (the new server is empty).
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let _restarted = Server { child, port };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match r.join("n1:7078", Duration::from_secs(30)) {
            Ok(()) => break,
            Err(e) => assert!(Instant::now() < deadline, "never reconnected: {e}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(r.members().unwrap(), vec!["n1:7078"]);
}

#[test]
fn a_bad_url_says_how_to_write_one() {
    let e = Redis::connect("redis//nope", "job", Duration::from_secs(1)).err().expect("accepted");
    assert!(e.to_string().contains("redis://HOST:6379"), "{e}");
}
