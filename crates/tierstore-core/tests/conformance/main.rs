//! The conformance suites: each is written against a contract and run for every implementation.
//! - The cache (below): every tier kind (RAM-backed and local disk) and every policy.
//! - The `Source` contract (`source.rs`): the POSIX source, and the object store source against real
//!   servers started here when the `object-store` feature is on: S3 on SeaweedFS (`seaweed.rs`), GCS on
//!   fake-gcs-server, HTTP on `rclone serve webdav` (`emulators.rs`). A server that is not installed is
//!   passed over, and the test says why. Azure has no run: no Azure Blob emulator installs on this
//!   machine (Azurite is on npm only).
//!
//! `cargo test -p tierstore-core --test conformance --features object-store`; `cargo test --workspace` turns the
//! feature on (the agent and the Python extension ask for it).

#[cfg(feature = "object-store")]
mod emulators;
#[cfg(feature = "object-store")]
mod seaweed;
mod source;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use tierstore_core::{Cache, Config, CopyState, Native, Overrides};

struct World {
    _dirs: Vec<tempfile::TempDir>,
    source: PathBuf,
    tier: PathBuf,
}

fn world(kind: &str) -> World {
    let base = tempfile::tempdir().unwrap();
    let tier_base = match kind {
        "memory" => tempfile::tempdir_in("/dev/shm").unwrap(),
        _ => tempfile::tempdir().unwrap(),
    };
    let source = base.path().join("source");
    std::fs::create_dir(&source).unwrap();
    let tier = tier_base.path().join("tier");
    World { source, tier, _dirs: vec![base, tier_base] }
}

fn cache(w: &World, policy: &str, quota: &str, kind: &str) -> Cache {
    let o = Overrides::default()
        .with_tiers(&[(w.tier.display().to_string(), Some(quota.to_string()))])
        .with("source", w.source.display().to_string())
        .with("policy", policy)
        .with("threads", "4")
        .with("inline_max", "64KiB")
        // The suite rewrites source files and expects the next open to see it: "always", not the default.
        .with("revalidate", "always");
    let c = Config::load_with_env(&o, &Default::default()).unwrap();
    assert_eq!(c.tiers[0].kind.name(), kind);
    Cache::new(c).unwrap()
}

fn content(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| ((i * 31 + j * 7) % 251) as u8).collect()
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, bytes).unwrap();
    p
}

fn read_all(c: &Cache, p: &Path) -> Vec<u8> {
    let mut r = c.open(p).unwrap();
    let mut buf = vec![0u8; r.size() as usize];
    assert_eq!(r.read_full(&mut buf).unwrap(), buf.len());
    buf
}

fn suite(kind: &str, policy: &str) {
    // Round trip, small (inline) and large (streamed) files; the second epoch is served by the tier.
    let w = world(kind);
    let files: Vec<(PathBuf, Vec<u8>)> = (0..20)
        .map(|i| {
            let len = if i % 5 == 0 { 300_000 + i } else { 1000 + i * 10 };
            let b = content(i, len);
            (write(&w.source, &format!("d{}/f{i}.bin", i % 3), &b), b)
        })
        .collect();
    let c = cache(&w, policy, "100M", kind);
    for (p, b) in &files {
        assert_eq!(&read_all(&c, p), b, "{kind}/{policy}: first read of {}", p.display());
    }
    c.wait_idle();
    let before = c.stats();
    for (p, b) in &files {
        assert_eq!(&read_all(&c, p), b, "{kind}/{policy}: cached read of {}", p.display());
        assert!(c.lookup(p, true).unwrap().is_some());
    }
    let after = c.stats();
    assert_eq!(after.source.bytes_read, before.source.bytes_read, "{kind}/{policy}: epoch 2 read the source");
    assert_eq!(after.tiers[0].hits - before.tiers[0].hits, files.len() as u64);
    let total: u64 = files.iter().map(|(_, b)| b.len() as u64).sum();
    assert_eq!(after.source.bytes_read, total, "{kind}/{policy}: each source byte read once");

    // A rewritten source file is fetched again, never served stale.
    let (p0, _) = &files[1];
    std::fs::write(p0, b"new contents").unwrap();
    assert_eq!(read_all(&c, p0), b"new contents");
    c.wait_idle();
    assert_eq!(read_all(&c, p0), b"new contents");

    // A truncated copy falls back to the source and is repaired.
    let (p1, b1) = &files[2];
    let copy = c.lookup(p1, true).unwrap().unwrap();
    std::fs::OpenOptions::new().write(true).open(&copy).unwrap().set_len(10).unwrap();
    let faults = c.stats().tiers[0].faults;
    assert_eq!(&read_all(&c, p1), b1);
    c.wait_idle();
    assert_eq!(c.stats().tiers[0].faults, faults + 1);
    assert_eq!(std::fs::metadata(c.lookup(p1, true).unwrap().unwrap()).unwrap().len(), b1.len() as u64);

    // Concurrent readers: every file is read from the source exactly once.
    let w2 = world(kind);
    let files: Vec<(PathBuf, Vec<u8>)> = (0..40)
        .map(|i| {
            let b = content(i, if i % 10 == 0 { 200_000 } else { 5000 });
            (write(&w2.source, &format!("f{i}"), &b), b)
        })
        .collect();
    let c2 = Arc::new(cache(&w2, policy, "100M", kind));
    let files = Arc::new(files);
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let (c2, files) = (c2.clone(), files.clone());
            std::thread::spawn(move || {
                for k in 0..files.len() {
                    let (p, b) = &files[(k + t * 5) % files.len()];
                    assert_eq!(&read_all(&c2, p), b);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    c2.wait_idle();
    let s = c2.stats();
    let total: u64 = files.iter().map(|(_, b)| b.len() as u64).sum();
    assert_eq!(s.source.bytes_read, total, "{kind}/{policy}: read amplification above 1.0");

    // A quota smaller than the data: never exceeded; `fill` never evicts, the others do.
    let w3 = world(kind);
    let files: Vec<(PathBuf, Vec<u8>)> = (0..30)
        .map(|i| {
            let b = content(i, 10_000);
            (write(&w3.source, &format!("f{i}"), &b), b)
        })
        .collect();
    let c3 = cache(&w3, policy, "100000B", kind);
    for _ in 0..2 {
        for (p, b) in &files {
            assert_eq!(&read_all(&c3, p), b);
            c3.wait_idle();
            assert!(c3.stats().tiers[0].usage.used <= 100_000, "{kind}/{policy}: over quota");
        }
    }
    let s = c3.stats();
    assert_eq!(s.tiers[0].usage.entries, 10);
    if policy == "fill" {
        assert_eq!(s.tiers[0].evictions, 0);
        assert_eq!(s.tiers[0].hits, 10, "fill keeps the first files and serves them every epoch");
    } else {
        assert!(s.tiers[0].evictions >= 20, "{kind}/{policy}: {} evictions", s.tiers[0].evictions);
    }

    // Prefetch warms everything that fits.
    let w4 = world(kind);
    for i in 0..25 {
        write(&w4.source, &format!("p/{i}"), &content(i, 20_000 + i));
    }
    let c4 = cache(&w4, policy, "100M", kind);
    let progress = c4.prefetch(std::slice::from_ref(&w4.source)).unwrap();
    c4.wait_idle();
    assert!(progress.finished());
    assert_eq!(progress.files_copied.load(std::sync::atomic::Ordering::Relaxed), 25);
    let read_before = c4.stats().source.bytes_read;
    assert_eq!(read_all(&c4, &w4.source.join("p/3")), content(3, 20_003));
    assert_eq!(c4.stats().source.bytes_read, read_before);

    // Native opens (the shim's): a small miss is a complete copy at once; a large miss is the source
    // plus the growing copy, which finishes and serves the next open. The source is read once.
    let w5 = world(kind);
    let small = write(&w5.source, "n/small", &content(1, 10_000));
    let large = write(&w5.source, "n/large", &content(2, 3 << 20));
    let c5 = cache(&w5, policy, "100M", kind);
    let Native::Whole(f) = c5.open_native(&small).unwrap() else { panic!("a small miss streamed") };
    assert!(std::fs::read_link(format!("/proc/self/fd/{}", f.as_raw_fd())).unwrap().starts_with(&w5.tier));
    let Native::Copying { source, copy } = c5.open_native(&large).unwrap() else { panic!("a large miss waited") };
    let mut via_copy = vec![0u8; 3 << 20];
    let mut done = 0;
    while done < via_copy.len() {
        done += copy.read_at(&mut via_copy[done..], done as u64).expect("the copy failed").unwrap();
    }
    assert_eq!(via_copy, content(2, 3 << 20));
    let mut via_source = vec![0u8; 4096];
    source.read_exact_at(&mut via_source, 1 << 20).unwrap();
    assert_eq!(via_source, content(2, 3 << 20)[1 << 20..(1 << 20) + 4096]);
    c5.wait_idle();
    assert_eq!(copy.state(), CopyState::Finished);
    let Native::Whole(f) = c5.open_native(&large).unwrap() else { panic!("a finished copy missed") };
    assert!(std::fs::read_link(format!("/proc/self/fd/{}", f.as_raw_fd())).unwrap().starts_with(&w5.tier));
    assert_eq!(c5.stats().source.bytes_read, 10_000 + (3 << 20));
}

macro_rules! conformance {
    ($($name:ident: $kind:expr, $policy:expr;)*) => {$(
        #[test]
        fn $name() { suite($kind, $policy) }
    )*};
}

conformance! {
    memory_fill: "memory", "fill";
    memory_lru: "memory", "lru";
    memory_lfu: "memory", "lfu";
    memory_fifo: "memory", "fifo";
    local_fill: "local", "fill";
    local_lru: "local", "lru";
    local_lfu: "local", "lfu";
    local_fifo: "local", "fifo";
}

/// A peer's read of a file is one look of the job's at this node's tiers, as a local open is: a miss when
/// the file is fetched from the store for it (one open), a hit when a tier holds it. A peer that only asks
/// this node to hold a file (a partitioned prefetch) counts nothing, as a prefetch does not. Both ways a
/// node serves a peer: with blake3s recorded (sharing on: a large file is served as it is copied) and
/// without.
#[test]
fn a_peers_read_is_one_miss_cold_and_one_hit_warm_on_the_node_that_serves_it() {
    for verify in ["checksum", "metadata"] {
        let w = world("local");
        write(&w.source, "peer/small", &content(6, 10_000));
        write(&w.source, "peer/large", &content(7, 3 << 20));
        write(&w.source, "peer/held", &content(8, 10_000));
        let o = Overrides::default()
            .with_tiers(&[(w.tier.display().to_string(), Some("100M".to_string()))])
            .with("source", w.source.display().to_string())
            .with("verify", verify);
        let c = Cache::serving(Config::load_with_env(&o, &Default::default()).unwrap()).unwrap();
        let counted = |c: &Cache| {
            let s = c.stats();
            (s.tiers[0].hits, s.tiers[0].misses, s.source.opens)
        };
        let before = counted(&c);
        c.open_for_peer("peer/small", true).unwrap();
        c.wait_idle();
        let cold = counted(&c);
        assert_eq!((cold.0 - before.0, cold.1 - before.1, cold.2 - before.2), (0, 1, 1), "{verify}: a cold read");
        c.open_for_peer("peer/small", true).unwrap();
        let warm = counted(&c);
        assert_eq!((warm.0 - cold.0, warm.1 - cold.1), (1, 0), "{verify}: a warm read");
        c.open_for_peer("peer/large", true).unwrap();
        c.wait_idle();
        let large = counted(&c);
        assert_eq!((large.0 - warm.0, large.1 - warm.1), (0, 1), "{verify}: a large cold read");
        c.open_for_peer("peer/held", false).unwrap();
        c.wait_idle();
        let held = counted(&c);
        assert_eq!((held.0 - large.0, held.1 - large.1), (0, 0), "{verify}: held for a peer's prefetch");
    }
}

/// The POSIX source over a directory.
struct PosixStore {
    dir: tempfile::TempDir,
    root: PathBuf,
    source: tierstore_core::source::PosixSource,
}

impl PosixStore {
    fn new() -> PosixStore {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap().join("source");
        std::fs::create_dir(&root).unwrap();
        std::fs::create_dir(dir.path().join("scratch")).unwrap();
        let counters = Arc::new(tierstore_core::counters::Counters::open(&dir.path().join("counters")).unwrap());
        let source = tierstore_core::source::PosixSource::new(&root, None, counters);
        PosixStore { dir, root, source }
    }
}

impl source::Store for PosixStore {
    fn source(&self) -> &dyn tierstore_core::source::Source {
        &self.source
    }

    fn put(&self, rel: &str, bytes: &[u8]) {
        // Written beside it and renamed into place, as a writer of a shared store replaces a file.
        let path = self.root.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let tmp = self.dir.path().join("scratch").join("put.tmp");
        std::fs::write(&tmp, bytes).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
    }

    fn outside(&self) -> PathBuf {
        self.dir.path().canonicalize().unwrap().join("elsewhere/a.bin")
    }

    fn has_directories(&self) -> bool {
        true
    }

    fn scratch(&self) -> PathBuf {
        self.dir.path().join("scratch")
    }
}

#[test]
fn posix_source() {
    source::conforms("posix", &PosixStore::new());
}

/// The S3 source over a bucket prefix of a SeaweedFS server of this test's own.
/// Writes an object of the store behind a source (full key, bytes), as another writer does.
#[cfg(feature = "object-store")]
type Put = Box<dyn Fn(&str, &[u8])>;

/// An object store source over a bucket prefix of a real server, and the means to change the objects
/// behind it (the "other writer" of the contract).
#[cfg(feature = "object-store")]
struct ObjectStore {
    // Dropped in this order: the source (its runtime), then the writer, then the server.
    source: tierstore_core::source::ObjectSource,
    put: Put,
    prefix: String,
    outside: PathBuf,
    scratch: tempfile::TempDir,
    /// SeaweedFS keeps its objects in a file tree and stores a backslash in a key as a `/`; the others keep both.
    changes_in_names: &'static str,
    _server: Box<dyn std::any::Any>,
}

#[cfg(feature = "object-store")]
impl ObjectStore {
    /// The source over `url` with the server's `settings`.
    fn new(url: &str, settings: &[(&str, &str)], put: Put, server: Box<dyn std::any::Any>) -> ObjectStore {
        let mut config = tierstore_core::source::store_config::StoreConfig::parse(url).unwrap();
        for (key, value) in settings {
            config.settings.insert(key.to_string(), value.to_string());
        }
        // Small ranges, so that files of a few hundred KiB are fetched as a first range and parallel
        // ranges after it, as large objects are.
        config.range_size = 64 << 10;
        config.ranges_in_flight = 3;
        let scratch = tempfile::tempdir().unwrap();
        let counters = Arc::new(tierstore_core::counters::Counters::open(&scratch.path().join("counters")).unwrap());
        let prefix = config.prefix.clone();
        let scheme = url.split_once("://").unwrap().0;
        let outside = PathBuf::from(format!("{scheme}://another-bucket/data/set/a.bin"));
        let source = tierstore_core::source::ObjectSource::new(config, counters).unwrap();
        ObjectStore { source, put, prefix, outside, scratch, changes_in_names: "", _server: server }
    }

    /// The S3 source over a SeaweedFS server started here.
    fn s3(weed: &Path) -> ObjectStore {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let mut server = seaweed::Seaweed::start(weed);
        let bucket = "conformance";
        server.create_bucket(&rt, bucket);
        let endpoint = server.endpoint.clone();
        let settings = [
            ("endpoint", endpoint.as_str()),
            ("region", seaweed::REGION),
            ("access_key_id", seaweed::ACCESS_KEY),
            ("secret_access_key", seaweed::SECRET_KEY),
        ];
        let client = server.client(bucket);
        let put: Put = Box::new(move |key, bytes| {
            // The key as written, byte for byte (`Path::from` would percent-encode some characters).
            let key = object_store::path::Path::parse(key).unwrap();
            rt.block_on(object_store::ObjectStoreExt::put(client.as_ref(), &key, bytes.to_vec().into())).unwrap();
        });
        let store = ObjectStore::new(&format!("s3://{bucket}/data/set"), &settings, put, Box::new(server));
        ObjectStore { changes_in_names: "\\", ..store }
    }

    /// The GCS source over a fake-gcs-server started here, reached as an emulator is: a service account
    /// key that names the server and turns OAuth off.
    fn gcs(bin: &Path) -> ObjectStore {
        let server = Arc::new(emulators::Server::gcs(bin));
        server.gcs_create_bucket("conformance");
        let key = format!(
            r#"{{"gcs_base_url":"{}","disable_oauth":true,"client_email":"","private_key":"","private_key_id":""}}"#,
            server.endpoint
        );
        let writer = server.clone();
        let put: Put = Box::new(move |key, bytes| writer.gcs_put("conformance", key, bytes));
        let settings = [("google_service_account_key", key.as_str())];
        ObjectStore::new("gs://conformance/data/set", &settings, put, Box::new(server))
    }

    /// The HTTP source over `rclone serve webdav` of a directory, which the writer writes into.
    fn webdav(bin: &Path) -> ObjectStore {
        let server = Arc::new(emulators::Server::webdav(bin));
        let writer = server.clone();
        let put: Put = Box::new(move |key, bytes| writer.webdav_put(key, bytes));
        let url = format!("{}/data/set", server.endpoint);
        ObjectStore::new(&url, &[], put, Box::new(server))
    }
}

#[cfg(feature = "object-store")]
impl source::Store for ObjectStore {
    fn source(&self) -> &dyn tierstore_core::source::Source {
        &self.source
    }

    fn put(&self, rel: &str, bytes: &[u8]) {
        (self.put)(&format!("{}/{rel}", self.prefix), bytes);
    }

    fn outside(&self) -> PathBuf {
        self.outside.clone()
    }

    fn has_directories(&self) -> bool {
        false
    }

    fn scratch(&self) -> PathBuf {
        self.scratch.path().to_path_buf()
    }

    fn changes_in_names(&self) -> &'static str {
        self.changes_in_names
    }
}

/// Runs the suite against a store whose server `binary` finds, or says why it passes over it.
#[cfg(feature = "object-store")]
fn conforms_if_installed(name: &str, binary: Result<PathBuf, String>, store: fn(&Path) -> ObjectStore) {
    match binary {
        Ok(bin) => source::conforms(name, &store(&bin)),
        Err(why) => eprintln!("{name}_source: skipped: {why}"),
    }
}

#[cfg(feature = "object-store")]
#[test]
fn s3_source() {
    conforms_if_installed("s3", seaweed::weed_binary(), ObjectStore::s3);
}

#[cfg(feature = "object-store")]
#[test]
fn gcs_source() {
    conforms_if_installed("gcs", emulators::fake_gcs_binary(), ObjectStore::gcs);
}

#[cfg(feature = "object-store")]
#[test]
fn http_source() {
    conforms_if_installed("http", emulators::rclone_binary(), ObjectStore::webdav);
}

#[cfg(not(feature = "object-store"))]
#[test]
fn object_store_sources() {
    eprintln!(
        "s3_source, gcs_source, http_source: skipped: tierstore-core is built without its \
         `object-store` feature (cargo test -p tierstore-core --test conformance --features object-store, or \
         cargo test --workspace)"
    );
}
