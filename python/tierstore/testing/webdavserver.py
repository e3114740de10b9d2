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
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def rclone_binary() -> str:
    found = shutil.which("rclone")
    if found is None:
        raise FileNotFoundError("rclone is not installed; `apt-get install rclone`")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WebDAVServer:
    """One `rclone serve webdav` of `root/files` on a free loopback port (see the module's docstring).

    Args:
        root: A directory for the served files (`root/files`, which is `self.directory`) and the log.
        start: Start it now (else call `start()`).
    """

    def __init__(self, root: str | os.PathLike[str], *, start: bool = True) -> None:
        self.root = Path(root)
        self.directory = self.root / "files"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
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
        log = open(self.root / "rclone.log", "ab")  # noqa: SIM115 (the server keeps it)
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rclone exited at start: {self.log_tail()}")
            if self._answers():
                break
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"rclone did not answer on {self.endpoint} in {timeout:.0f} s: {self.log_tail()}"
                )
            time.sleep(0.05)

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/", timeout=2) as r:
                return r.status == 200
        except urllib.error.HTTPError:
            return True  # it answered, if not with a listing
        except OSError:
            return False

    def log_tail(self, n: int = 2000) -> str:
        try:
            return (self.root / "rclone.log").read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def settings(self, **extra: Any) -> dict[str, str]:
        """object_store's HTTP options that reach this server (`HttpBuilder::with_config` keys)."""
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

    def kill(self) -> None:
        """SIGKILLs the server, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOPs the server: it keeps its connections and answers nothing, as a hung store does."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONTs a paused server."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def __enter__(self) -> WebDAVServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
