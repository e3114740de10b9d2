"""Object stores other than S3 as the source, each against a real server on loopback: Google Cloud Storage
(fake-gcs-server, `gs://`) and HTTP with WebDAV listings (`rclone serve webdav`, `http://`).

The S3 source's own suite (tests/s3) shows the guarantees in depth; the engine behind every store is the
same, so this one shows what could differ from store to store: the URL, the settings, the request counts,
the identity of a version (ETag, size, last-modified) from a read and from a listing alike, and the errors.
So do fsspec's chains over each (`tierstore::gs://`, `tierstore::http://`; the S3 one is in tests/s3): the
target's options as its fsspec implementation's, and adlfs's, for Azure, which has no server here.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import fsspec.core
import pytest

import tierstore
from tests.helpers.data import blob, odd_names
from tierstore.testing.gcsserver import GCSServer
from tierstore.testing.webdavserver import WebDAVServer


@pytest.fixture(scope="module")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GCSServer]:
    with GCSServer(tmp_path_factory.mktemp("fake-gcs")) as server:
        yield server


@pytest.fixture(scope="module")
def webdav_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDAVServer]:
    with WebDAVServer(tmp_path_factory.mktemp("webdav")) as server:
        yield server


@dataclass
class Store:
    """A fresh place on one store for one test: the URL of its prefix, a writer of its objects (keys below
    the prefix), and the options that reach the server."""

    kind: str
    url: str
    put: Callable[[str, bytes], Any]
    settings: dict[str, str]

    def cache(self, tier: str, **kwargs: Any) -> tierstore.Cache:
        options = {**self.settings, **kwargs.pop("object_store", {})}
        return tierstore.Cache(source=self.url, tiers=[f"{tier}:1G"], object_store=options, **kwargs)


@pytest.fixture(
    params=[pytest.param("gcs", marks=pytest.mark.gcs), pytest.param("http", marks=pytest.mark.webdav)]
)
def store(request: pytest.FixtureRequest) -> Store:
    tag = "t-" + hashlib.blake2b(request.node.nodeid.encode(), digest_size=6).hexdigest()
    if request.param == "gcs":
        gcs: GCSServer = request.getfixturevalue("gcs_server")
        gcs.create_bucket(tag)
        return Store("gcs", f"gs://{tag}/d", lambda k, b: gcs.put_object(tag, f"d/{k}", b), gcs.settings())
    dav: WebDAVServer = request.getfixturevalue("webdav_server")
    return Store(
        "http", f"{dav.endpoint}/{tag}/d", lambda k, b: dav.put_object(f"{tag}/d/{k}", b), dav.settings()
    )


def source_stats(cache: tierstore.Cache) -> dict[str, int]:
    return cache.stats()["source"]


def test_objects_are_read_once_then_served_from_the_tier(store: Store, tier: str) -> None:
    objects = {f"{i:02d}.bin": blob(f"object {i}", 1000 + 37 * i) for i in range(12)}
    objects["large.bin"] = blob("large", 3 << 20)  # three ranges of 1 MiB
    objects["empty.bin"] = b""
    for key, body in objects.items():
        store.put(key, body)
    cache = store.cache(tier, revalidate="never", object_store={"range_size": "1M", "ranges_in_flight": 2})
    for _epoch in range(3):
        for key, body in objects.items():
            with cache.open(key) as f:
                assert f.read() == body, key
        cache.wait()
    s = source_stats(cache)
    # One GET per object and two more for the large one's other ranges; the empty object costs a second
    # GET (its first range is refused as unsatisfiable). Nothing after the first epoch.
    assert s["reads"] == len(objects) + 2 + 1, s
    assert s["bytes_read"] == sum(len(b) for b in objects.values()), s
    assert s["stats"] == 0, s


def test_a_changed_object_is_never_served_stale(store: Store, tier: str) -> None:
    store.put("a.bin", b"version one")
    cache = store.cache(tier, revalidate="always")
    assert cache.open("a.bin").read() == b"version one"
    cache.wait()
    time.sleep(1.1)  # a new last-modified second, as well as a new ETag
    store.put("a.bin", b"version two, longer")
    assert cache.open("a.bin").read() == b"version two, longer"
    store.put("a.bin", b"version 3, longer!!")  # the same size
    assert cache.open("a.bin").read() == b"version 3, longer!!"


def test_expired_copies_are_confirmed_a_prefix_at_a_time(store: Store, tier: str) -> None:
    """With a duration, an expired directory's copies are confirmed by one listing of its prefix (the
    identities in it must equal those a read gives, or every copy would be fetched again)."""
    objects = {f"{i:02d}.bin": blob(f"object {i}", 700 + i) for i in range(20)}
    for key, body in objects.items():
        store.put(key, body)
    cache = store.cache(tier, revalidate="1s")
    for key, body in objects.items():
        assert cache.open(key).read() == body
    cache.wait()
    before = source_stats(cache)
    time.sleep(1.2)
    for key, body in objects.items():
        assert cache.open(key).read() == body
    cache.wait()
    after = source_stats(cache)
    sent = {k: after[k] - before[k] for k in ("reads", "stats", "lists")}
    assert sent == {"reads": 0, "stats": 0, "lists": 1}, sent
    time.sleep(1.1)
    store.put("05.bin", b"changed")
    time.sleep(1.2)
    assert cache.open("05.bin").read() == b"changed"


def test_a_dataloader_over_the_prefix(store: Store, tier: str) -> None:
    torch = pytest.importorskip("torch")
    from tierstore.torch import CachedDataset

    for i in range(32):
        store.put(f"imgs/{i:03d}.bin", blob(f"object {i}", 3000))
    cache = store.cache(tier, revalidate="never")
    ds = CachedDataset(f"{store.url}/imgs", cache=cache, decode=lambda f: len(f.read()))
    assert len(ds) == 32 and ds.paths[0] == f"{store.url}/imgs/000.bin"
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context="fork")
    for _epoch in range(2):
        assert sum(int(b.sum()) for b in loader) == 32 * 3000
    assert source_stats(cache)["reads"] == 32  # the second epoch came from the tier


def test_every_object_name_is_read_as_listed(store: Store, tier: str) -> None:
    """Names with characters a URL or object_store encodes are read by the name the listing gave."""
    from tierstore.torch import CachedDataset

    objects = {f"odd/{name}": blob(name, 500 + i) for i, name in enumerate(odd_names())}
    for key, body in objects.items():
        store.put(key, body)
    cache = store.cache(tier, revalidate="never")
    ds = CachedDataset(f"{store.url}/odd", cache=cache, decode=lambda f: f.read())
    assert sorted(ds.paths) == sorted(f"{store.url}/{key}" for key in objects)
    for path, body in zip(ds.paths, (ds[i] for i in range(len(ds))), strict=True):
        assert body == objects[path.removeprefix(f"{store.url}/")], path
    assert source_stats(cache)["reads"] == len(objects)


def test_errors_name_the_object_the_store_and_the_fix(store: Store, tier: str) -> None:
    store.put("a.bin", b"x")
    cache = store.cache(tier)
    with pytest.raises(FileNotFoundError) as missing:
        cache.open("nope.bin")
    name = {"gcs": "Google Cloud Storage", "http": "HTTP (WebDAV)"}[store.kind]
    assert f"{store.url}/nope.bin" in str(missing.value) and name in str(missing.value), missing.value
    with pytest.raises(tierstore.ConfigError, match=r"object_store\.timeout.*not a duration"):
        store.cache(str(Path(tier).parent / "t2"), object_store={"timeout": "soon"})
    with pytest.raises(tierstore.ConfigError, match=f"not an option of the {re_escape(name)} client"):
        store.cache(str(Path(tier).parent / "t3"), object_store={"no_such_option": "1"})
    with pytest.raises(tierstore.ConfigError, match=r"\[s3\].*\[object_store\]"):
        tierstore.Cache(source=store.url, tiers=[str(Path(tier).parent / "t4")], s3={"region": "x"})


@pytest.mark.webdav
def test_an_https_store_is_read_through_tls(tmp_path: Path, tier: str) -> None:
    """HTTPS end to end: object_store's client speaks TLS through rustls with ring (not aws-lc-rs; the
    provider is installed by the source, crates/tierstore-core/Cargo.toml says why), here to rclone with a
    self-signed certificate the client is told to take."""
    with WebDAVServer(tmp_path / "dav", tls=True) as dav:
        assert dav.endpoint.startswith("https://")
        dav.put_object("d/a.bin", blob("a", 70_000))
        cache = tierstore.Cache(source=f"{dav.endpoint}/d", tiers=[tier], object_store=dav.settings())
        with cache.open("a.bin") as f:
            assert f.read() == blob("a", 70_000)
        assert source_stats(cache)["reads"] == 1
        # Without the permission the certificate is refused: TLS is really checked, not skipped.
        strict = tierstore.Cache(source=f"{dav.endpoint}/d", tiers=[str(tmp_path / "t2")])
        with pytest.raises(OSError, match=r"TLS connection to HTTP .* was refused: .*certificate"):
            strict.open("a.bin")


def test_an_unreachable_store_fails_within_the_deadline(tmp_path: Path, tier: str) -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    key = f'{{"gcs_base_url":"http://127.0.0.1:{port}","disable_oauth":true,"client_email":"","private_key":"","private_key_id":""}}'
    cache = tierstore.Cache(
        source="gs://bucket/d",
        tiers=[tier],
        object_store={"google_service_account_key": key, "timeout": "2s", "retries": 1},
    )
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=f"cannot reach Google Cloud Storage at http://127.0.0.1:{port}"):
        cache.open("a.bin")
    assert time.monotonic() - t0 < 15


def test_gcs_without_credentials_is_refused_at_once(
    tmp_path: Path, tier: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No key, no gcloud default credentials, no Compute Engine: the client would ask the metadata server
    (its host, then its address, each with every retry); tierstore says what to set instead, at once, and
    sends nothing. A key file that is missing or malformed is named, not a bare OSError."""
    for var in [v for v in os.environ if v.startswith(("GOOGLE_", "GCE_"))]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.config/gcloud/application_default_credentials.json
    t0 = time.monotonic()
    with pytest.raises(PermissionError, match=r"no credentials for gs://bucket/d .*GOOGLE_SERVICE_ACCOUNT"):
        tierstore.Cache(source="gs://bucket/d", tiers=[tier])
    assert time.monotonic() - t0 < 2
    bad = tmp_path / "key.json"
    bad.write_text("this is no service account key")
    for key in (bad, tmp_path / "missing.json"):
        with pytest.raises(
            PermissionError, match=r"service account key could not be used.*GOOGLE_SERVICE_ACCOUNT"
        ):
            tierstore.Cache(
                source="gs://bucket/d", tiers=[tier], object_store={"google_service_account": str(key)}
            )


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def chained_cache(url: str, options: dict[str, Any]) -> tierstore.Cache:
    """The cache a chain with these options reads through: fsspec hands every path of a chain the same
    filesystem, which holds one cache per bucket or server (here, one)."""
    fs, _ = fsspec.core.url_to_fs(url, **options)
    (cache,) = fs.caches.values()
    return cache


@pytest.mark.gcs
def test_fsspec_chained_over_gcs(gcs_server: GCSServer, tier: str, tmp_path: Path) -> None:
    """`tierstore::gs://bucket/key` as gcsfs users write it: gcsfs's `token` (a key as a dict, or its file)
    and `endpoint_url` reach the engine; each object is read from the store once, then from the tier; the
    prefix lists."""
    bucket = "chained-gcs"
    gcs_server.create_bucket(bucket)
    objects = {f"d/{i}.bin": blob(f"object {i}", 5000 + i) for i in range(5)}
    for name, body in objects.items():
        gcs_server.put_object(bucket, name, body)
    key = json.loads(gcs_server.settings()["google_service_account_key"])  # names the emulator, no OAuth
    options = {
        # `project` and `block_size` are gcsfs's own business: taken, and left out.
        "gs": {"token": key, "endpoint_url": gcs_server.endpoint, "project": "p", "block_size": 1 << 20},
        "tierstore": {"tiers": [f"{tier}:1G"], "revalidate": "never"},
    }
    for _round in range(2):
        for name, body in objects.items():
            with fsspec.open(f"tierstore::gs://{bucket}/{name}", "rb", **options) as f:
                assert f.read() == body
        cache = chained_cache(f"tierstore::gs://{bucket}/d", options)
        cache.wait()
    s = cache.stats()
    assert s["source"]["reads"] == len(objects) and s["tiers"][0]["hits"] == len(objects), s
    fs, path = fsspec.core.url_to_fs(f"tierstore::gs://{bucket}/d", **options)
    assert path == f"{bucket}/d"  # as gcsfs strips it
    assert sorted(fs.ls(path, detail=False)) == sorted(f"gs://{bucket}/{k}" for k in objects)
    # The key as gcsfs users mostly give it, the path of its file; and gcsfs's other name, gcs://.
    key_file = tmp_path / "key.json"
    key_file.write_text(json.dumps(key))
    from_file = {
        "gcs": {"token": str(key_file), "endpoint_url": gcs_server.endpoint},
        "tierstore": {"tiers": [str(tmp_path / "t2")]},
    }
    with fsspec.open(f"tierstore::gcs://{bucket}/d/0.bin", "rb", **from_file) as f:
        assert f.read() == objects["d/0.bin"]


@pytest.mark.webdav
def test_fsspec_chained_over_http(webdav_server: WebDAVServer, tier: str) -> None:
    """`tierstore::http://HOST:PORT/prefix/key`: one cache for the server, each object read from it once,
    then from the tier; the prefix lists (through WebDAV)."""
    objects = {f"chained/d/{i}.bin": blob(f"object {i}", 5000 + i) for i in range(5)}
    for name, body in objects.items():
        webdav_server.put_object(name, body)
    options = {"http": {"block_size": 1 << 20}, "tierstore": {"tiers": [f"{tier}:1G"], "revalidate": "never"}}
    for _round in range(2):
        for name, body in objects.items():
            with fsspec.open(f"tierstore::{webdav_server.endpoint}/{name}", "rb", **options) as f:
                assert f.read() == body
        cache = chained_cache(f"tierstore::{webdav_server.endpoint}/chained/d", options)
        cache.wait()
    assert cache.source == webdav_server.endpoint
    s = cache.stats()
    assert s["source"]["reads"] == len(objects) and s["tiers"][0]["hits"] == len(objects), s
    fs, url = fsspec.core.url_to_fs(f"tierstore::{webdav_server.endpoint}/chained/d", **options)
    assert url == f"{webdav_server.endpoint}/chained/d"  # fsspec's HTTP paths are whole URLs
    assert sorted(fs.ls(url, detail=False)) == sorted(f"{webdav_server.endpoint}/{k}" for k in objects)


def test_fsspec_chains_refuse_what_they_cannot_pass_on() -> None:
    """A protocol of no store, and an option with no equivalent, are refused as the chain is made, with
    what to write instead; nothing is asked of a store."""
    with pytest.raises(
        ValueError, match=r"chains over s3://, s3a://, gs://.*az://.*https:// .*not memory://"
    ):
        fsspec.core.url_to_fs("tierstore::memory://x/y")
    refused = {
        "gs": ({"requester_pays": True}, r"gcsfs's option requester_pays"),
        "http": ({"client_kwargs": {"headers": {"a": "b"}}}, r"option client_kwargs .*Python client"),
        "s3": ({"client_kwargs": {"verify": False}}, r"s3fs's option client_kwargs\['verify'\]"),
    }
    for protocol, (target, message) in refused.items():
        with pytest.raises(ValueError, match=message + r".*tierstore=\{'object_store': \{\.\.\.\}\}"):
            fsspec.core.url_to_fs(f"tierstore::{protocol}://127.0.0.1/b/k", **{protocol: target})
    with pytest.raises(ValueError, match=r"version_aware .*current version"):
        fsspec.core.url_to_fs("tierstore::gs://bucket/k#1700000000")  # gcsfs: a generation


def test_fsspec_adlfs_options_are_azure_settings(tier: str) -> None:
    """adlfs's options as object_store's Azure keys, which the engine takes. Only the translation is tested:
    no Azure Blob server installs here (docs/guide/object-stores.md), and fsspec resolves az:// only with
    adlfs installed, so no chain over Azure runs."""
    from tierstore.fs import TierstoreFileSystem

    def settings(options: dict[str, Any]) -> dict[str, str]:
        fs = TierstoreFileSystem(target_protocol="abfs", target_options=options, skip_instance_cache=True)
        return fs.store_settings

    given = {"account_name": "lab", "sas_token": "?sv=2024&sig=x", "anon": False, "max_concurrency": 4}
    assert settings(given) == {"azure_storage_account_name": "lab", "azure_storage_sas_key": "sv=2024&sig=x"}
    emulator = (
        "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=a2V5MQ==;"
        "BlobEndpoint=http://127.0.0.1:10000/devstoreaccount1;QueueEndpoint=http://127.0.0.1:10001/x"
    )
    # As in adlfs, the connection string overrides the other options.
    assert settings({"connection_string": emulator, "account_name": "other"}) == {
        "azure_storage_account_name": "devstoreaccount1",
        "azure_storage_account_key": "a2V5MQ==",
        "azure_storage_endpoint": "http://127.0.0.1:10000/devstoreaccount1",
    }
    sovereign = "AccountName=lab;AccountKey=a2V5MQ==;EndpointSuffix=core.chinacloudapi.cn"
    assert settings({"connection_string": sovereign})["azure_storage_endpoint"] == (
        "https://lab.blob.core.chinacloudapi.cn"
    )
    principal = {"account_name": "lab", "client_id": "c", "client_secret": "s", "tenant_id": "t"}
    assert settings(principal) == {
        "azure_storage_account_name": "lab",
        "azure_storage_client_id": "c",
        "azure_storage_client_secret": "s",
        "azure_storage_tenant_id": "t",
    }
    # The engine takes every key: a misspelt one would be refused here, before any request.
    for i, options in enumerate((given, {"connection_string": emulator}, {"connection_string": sovereign})):
        tierstore.Cache(source="az://weights", tiers=[f"{tier}{i}"], object_store=settings(options))
    tierstore.Cache(source="az://weights", tiers=[f"{tier}-sp"], object_store=settings(principal))
    with pytest.raises(ValueError, match=r"adlfs's option credential .*Python client"):
        settings({"account_name": "lab", "credential": object()})
    with pytest.raises(ValueError, match=r"connection_string \(its part Bogus=\)"):
        settings({"connection_string": "AccountName=lab;Bogus=1"})
