"""A read-only WebDAV server of a local directory on loopback, for object_store's HTTP store in tests:
`rclone serve webdav` (Debian's `rclone` package), on a free port of 127.0.0.1. object_store's HttpStore
reads with GET/HEAD and lists with PROPFIND, which a plain static file server does not answer.

    with WebDAVServer(tmp_dir) as dav:
        dav.put_object("data/a.bin", b"...")   # a file under dav.directory, seen at once
        options = dav.settings()  # object_store HTTP options, for a source at f"{dav.endpoint}/data"

What object_store's HTTP client sees (rclone 1.60):
- get, ranged get, head, list and list_with_delimiter work; a ranged get of a 0-byte file answers 416
  Range Not Satisfiable (object_store: a Generic error), as one starting past the end does. Writes answer 404/405 (the server is
  read-only on purpose: tests write into the directory instead).
- The ETag is the file's modification time in nanoseconds and its size, so a rewrite changes it even
  within the same second; Last-Modified (head and list) has whole-second resolution.
- list leaves out directories; list_with_delimiter gives them as common prefixes.
- List paths are the server's whole URL path, whatever path the store's URL has: build the store on the
  origin (`http://127.0.0.1:PORT`, as object_store's `parse_url_opts` does, keeping the URL's path as a
  key prefix). An HttpStore built on `http://127.0.0.1:PORT/data` gets `data/a.bin` while it reads
  `a.bin`, and its list_with_delimiter reports the base directory itself as a common prefix.
"""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tierstore.testing.server import LoopbackServer, free_ports


def rclone_binary() -> str:
    found = shutil.which("rclone")
    if found is None:
        raise FileNotFoundError("rclone is not installed; `apt-get install rclone`")
    return found


class WebDAVServer(LoopbackServer):
    """One `rclone serve webdav` of `root/files` on a free loopback port (see the module's docstring).

    Args:
        root: A directory for the served files (`root/files`, which is `self.directory`) and the log.
        start: Start it now (else call `start()`).
        tls: Serve HTTPS with a self-signed certificate for 127.0.0.1, made here with the `openssl`
            command (`settings()` then tells the client to take it: `allow_invalid_certificates`).
    """

    name = "rclone"
    log_name = "rclone.log"

    def __init__(self, root: str | os.PathLike[str], *, start: bool = True, tls: bool = False) -> None:
        self.root = Path(root)
        self.directory = self.root / "files"
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.port,) = free_ports(1)
        self.tls = tls
        self.endpoint = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        if start:
            self.start()

    def start(self, timeout: float = 30.0) -> None:
        """Starts the server and waits until it answers; about 0.15 s."""
        args = [
            rclone_binary(),
            "serve", "webdav", str(self.directory),
            "--addr", f"127.0.0.1:{self.port}",
            "--read-only",
            # rclone caches directory listings for 5 minutes by default: a file a test writes after the
            # start would be missing from lists and answer 404.
            "--dir-cache-time", "0s",
            # No user configuration: the run must not depend on (or read remotes from) ~/.config/rclone.
            "--config", "/dev/null",
        ]  # fmt: skip
        if self.tls:
            args += self._make_certificate()
        self._launch(args, timeout)

    def _make_certificate(self) -> list[str]:
        """Writes the key and the certificate under `root`; rclone's arguments that serve them."""
        openssl = shutil.which("openssl")
        if openssl is None:
            raise FileNotFoundError("openssl is not installed; `apt-get install openssl`")
        key, cert = str(self.root / "key.pem"), str(self.root / "cert.pem")
        subject = ["-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"]
        subprocess.run(
            [
                openssl,
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "2",
                *subject,
                "-keyout",
                key,
                "-out",
                cert,
            ],
            check=True,
            capture_output=True,
        )
        return ["--cert", cert, "--key", key]

    def _answers(self) -> bool:
        # The self-signed certificate is ours: the probe only asks whether the server answers.
        context = ssl._create_unverified_context() if self.tls else None
        try:
            with urllib.request.urlopen(f"{self.endpoint}/", timeout=2, context=context) as r:
                return r.status == 200
        except urllib.error.HTTPError:
            return True  # it answered, if not with a listing
        except OSError:
            return False

    def settings(self, **extra: Any) -> dict[str, str]:
        """object_store's HTTP options that reach this server (`HttpBuilder::with_config` keys)."""
        if self.tls:
            return {"allow_invalid_certificates": "true", **extra}
        return {"allow_http": "true", **extra}

    def put_object(self, key: str, data: bytes) -> Path:
        """Writes `key` (a `/`-separated path) under the served directory, atomically (written beside the
        served directory, then renamed in), so that a concurrent read or list sees the old file or the new
        one, never a half-written or temporary one."""
        path = self.directory / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".put-{os.getpid()}-{time.monotonic_ns()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return path
