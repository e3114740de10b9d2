"""An S3-compatible object store as the source, against a real SeaweedFS server on loopback.

Every guarantee of the POSIX source holds: each object is fetched once per node whatever the number of
processes, a changed object is never served stale (revalidate "always"), a half-fetched object is never
served or cached, errors name the bucket, key and endpoint, and a dead server never hangs a reader.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import tierstore
from tests.helpers.data import blob, odd_names
from tests.helpers.wait import wait_for
from tierstore.testing.s3server import LatencyProxy, S3Server


@pytest.fixture
def bucket(server: S3Server, request: pytest.FixtureRequest) -> str:
    """A fresh bucket for each test."""
    name = "t-" + hashlib.blake2b(request.node.nodeid.encode(), digest_size=6).hexdigest()
    server.create_bucket(name)
    return name


def put(server: S3Server, bucket: str, objects: dict[str, bytes]) -> None:
    c = server.client()
    for key, body in objects.items():
        c.put_object(Bucket=bucket, Key=key, Body=body)


def cache_of(server: S3Server, url: str, tier: str, **kwargs: Any) -> tierstore.Cache:
    s3 = server.settings(**kwargs.pop("s3", {}))
    return tierstore.Cache(source=url, tiers=[f"{tier}:1G"], s3=s3, **kwargs)


def gets(cache: tierstore.Cache) -> int:
    return cache.stats()["source"]["reads"]


def test_objects_read_whole_then_from_the_tier(server: S3Server, bucket: str, tier: str) -> None:
    small = {f"train/{i:03d}.bin": blob(f"object {i}", 1000 + 37 * i) for i in range(40)}
    large = {"train/big.bin": blob("object 99", 5 * 1024 * 1024 + 123)}
    put(server, bucket, {**small, **large, "other/x.bin": b"not under the prefix"})
    cache = cache_of(server, f"s3://{bucket}/train", tier, revalidate="never", s3={"range_size": "1M"})
    assert cache.source == f"s3://{bucket}/train"
    for key, body in {**small, **large}.items():
        name = key.removeprefix("train/")
        # Both spellings: a full URL and a key relative to the prefix.
        path = f"s3://{bucket}/{key}" if len(name) % 2 else name
        with cache.open(path) as f:
            assert f.read() == body, key
    cache.wait()
    s = cache.stats()
    # One GET per small object; the large one is its first range plus 5 more ranges of 1 MiB.
    assert s["source"]["reads"] == len(small) + 6
    assert s["source"]["bytes_read"] == sum(map(len, small.values())) + len(large["train/big.bin"])
    assert s["source"]["stats"] == 0
    assert s["tiers"][0]["entries"] == len(small) + 1
    cache.reset_counters()
    for key, body in {**small, **large}.items():
        with cache.open(key.removeprefix("train/")) as f:
            assert f.read() == body
    s = cache.stats()
    assert (s["source"]["reads"], s["source"]["stats"], s["source"]["opens"]) == (0, 0, 0)
    assert s["tiers"][0]["hits"] == len(small) + 1


def test_outside_the_prefix_is_refused(server: S3Server, bucket: str, tier: str) -> None:
    cache = cache_of(server, f"s3://{bucket}/train", tier)
    for outside in (f"s3://{bucket}/other/x", "s3://another-bucket/train/x", "/etc/passwd", "a/../../b"):
        with pytest.raises(tierstore.OutsideSourceError):
            cache.open(outside)


def test_a_changed_object_is_fetched_again(server: S3Server, bucket: str, tier: str) -> None:
    put(server, bucket, {"d/a.bin": b"version one" * 100})
    cache = cache_of(server, f"s3://{bucket}/d", tier, revalidate="always")
    assert cache.open("a.bin").read() == b"version one" * 100
    cache.wait()
    cache.reset_counters()
    assert cache.open("a.bin").read() == b"version one" * 100
    # revalidate "always": one HEAD per open, no GET.
    assert (cache.stats()["source"]["stats"], gets(cache)) == (1, 0)
    put(server, bucket, {"d/a.bin": b"version two, a different size"})
    assert cache.open("a.bin").read() == b"version two, a different size"
    cache.wait()
    # Same size, new ETag: still never stale.
    put(server, bucket, {"d/a.bin": b"version 3!!, a different size"})
    assert cache.open("a.bin").read() == b"version 3!!, a different size"


def test_errors_name_the_object_endpoint_and_fix(server: S3Server, bucket: str, tier: str) -> None:
    put(server, bucket, {"d/a.bin": b"x"})
    cache = cache_of(server, f"s3://{bucket}/d", tier)
    with pytest.raises(FileNotFoundError) as missing:
        cache.open("nope.bin")
    assert f"s3://{bucket}/d/nope.bin" in str(missing.value) and server.endpoint in str(missing.value)
    assert "check the path" in str(missing.value) and f"s3://{bucket}/d" in str(missing.value), missing.value

    no_bucket = cache_of(server, "s3://no-such-bucket-here/d", str(Path(tier).parent / "t2"))
    with pytest.raises(FileNotFoundError, match="bucket no-such-bucket-here does not exist"):
        no_bucket.open("a.bin")

    wrong = cache_of(
        server, f"s3://{bucket}/d", str(Path(tier).parent / "t3"), s3={"secret_access_key": "wrong"}
    )
    with pytest.raises(PermissionError, match="AWS_SECRET_ACCESS_KEY"):
        wrong.open("a.bin")

    with pytest.raises(tierstore.ConfigError, match=r"s3\.timeout"):
        cache_of(server, f"s3://{bucket}/d", tier, s3={"timeout": "soon"})
    with pytest.raises(tierstore.ConfigError, match="not a bucket name"):
        cache_of(server, "s3://Bad_Bucket/d", tier)
    with pytest.raises(tierstore.ConfigError, match="not supported"):
        cache_of(server, "ftp://bucket/d", tier)
    with pytest.raises(
        tierstore.ConfigError, match=r"object_store\.aws_regoin.*not an option of the S3 client"
    ):
        cache_of(server, f"s3://{bucket}/d", tier, object_store={"aws_regoin": "x"})


def test_an_unreachable_endpoint_fails_within_the_deadline(tier: str) -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    cache = tierstore.Cache(
        source="s3://bucket/d",
        tiers=[tier],
        s3={
            "endpoint": f"http://127.0.0.1:{port}",
            "access_key_id": "k",
            "secret_access_key": "s",
            "timeout": "2s",
            "retries": 1,
        },
    )
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=f"cannot reach S3 at http://127.0.0.1:{port}"):
        cache.open("a.bin")
    assert time.monotonic() - t0 < 15


def test_credentials_from_the_environment_and_profile(
    server: S3Server, bucket: str, tier: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    put(server, bucket, {"d/a.bin": b"from env"})
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    cache = tierstore.Cache(source=f"s3://{bucket}/d", tiers=[tier])
    assert cache.open("a.bin").read() == b"from env"

    for k in server.env():
        monkeypatch.delenv(k)
    aws = tmp_path / "aws"
    aws.mkdir()
    (aws / "credentials").write_text(
        f"[train]\naws_access_key_id = {server.settings()['access_key_id']}\n"
        f"aws_secret_access_key = {server.settings()['secret_access_key']}\n"
    )
    (aws / "config").write_text(f"[profile train]\nregion = us-east-1\nendpoint_url = {server.endpoint}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(aws / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(aws / "config"))
    monkeypatch.setenv("AWS_PROFILE", "train")
    other_tier = str(Path(tier).parent / "t-profile")
    assert tierstore.Cache(source=f"s3://{bucket}/d", tiers=[other_tier]).open("a.bin").read() == b"from env"


def test_the_s3_endpoint_variable_and_the_tables_endpoint_over_it(
    server: S3Server, bucket: str, tier: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$AWS_ENDPOINT_URL_S3, which the client prefers to $AWS_ENDPOINT_URL, is the endpoint tierstore
    checks and allows plain HTTP to; `[s3] endpoint` overrides it as it overrides $AWS_ENDPOINT_URL."""
    put(server, bucket, {"d/a.bin": b"s3 endpoint"})
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", server.endpoint)
    cache = tierstore.Cache(source=f"s3://{bucket}/d", tiers=[tier])
    assert cache.open("a.bin").read() == b"s3 endpoint"

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:1")
    other_tier = str(Path(tier).parent / "t-table")
    cache = tierstore.Cache(source=f"s3://{bucket}/d", tiers=[other_tier], s3={"endpoint": server.endpoint})
    assert cache.open("a.bin").read() == b"s3 endpoint"


def _reader(url: str, tier: str, settings: dict[str, Any], keys: list[str], start: Any, out: Any) -> None:
    cache = tierstore.Cache(source=url, tiers=[f"{tier}:1G"], s3=settings, revalidate="never")
    start.wait()
    digest = hashlib.sha256()
    for k in keys:
        with cache.open(k) as f:
            digest.update(f.read())
    cache.wait()
    out.put(digest.hexdigest())


def test_eight_processes_fetch_each_object_once(server: S3Server, bucket: str, tier: str) -> None:
    objects = {f"d/{i:03d}.bin": blob(f"object {i}", 20_000 + i) for i in range(60)}
    objects["d/large.bin"] = blob("object 1000", 3 * 1024 * 1024)
    put(server, bucket, objects)
    keys = [k.removeprefix("d/") for k in objects]
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    settings = server.settings(range_size="1M")
    procs = [
        ctx.Process(
            target=_reader, args=(f"s3://{bucket}/d", tier, settings, keys[i:] + keys[:i], start, out)
        )
        for i in range(8)
    ]
    for p in procs:
        p.start()
    start.set()
    expected = hashlib.sha256()
    for k in keys:
        expected.update(objects["d/" + k])
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    cache = cache_of(server, f"s3://{bucket}/d", tier)
    # Each process reads in its own rotated order, so digests differ; every byte matched its object.
    assert len(set(results)) == 8
    s = cache.stats()["source"]
    assert s["bytes_read"] == sum(map(len, objects.values()))
    assert s["reads"] == 60 + 3  # one GET per small object, three ranges of the large one
    # A process that finds another's fetch in flight waits for it without asking the store anything (a
    # HEAD costs a request as a GET does); the server's own counters agree with the cache's (SeaweedFS
    # counts a HEAD as a GET, so its "GET" is every request about one object).
    assert s["stats"] == 0
    served = server.requests(bucket)
    assert served.get("GET", 0) == 60 + 3, served


@pytest.mark.s3
@pytest.mark.slow
def test_a_server_killed_mid_read_fails_the_reader_within_its_deadline(tmp_path: Path, tier: str) -> None:
    size = 48 * 1024 * 1024
    # 30 ms before each request (48 ranges, one at a time: about 1.5 s for the object), so that the kill
    # lands mid-read: straight to the server on loopback, the whole object could be fetched in the moment
    # between the first read and the kill, and nothing would fail (seen once in CI).
    with S3Server(tmp_path / "weed") as s3, LatencyProxy(s3.endpoint, latency=0.030) as proxy:
        s3.create_bucket("bkt")
        put(s3, "bkt", {"d/big.bin": blob("object 7", size)})
        settings = s3.settings(
            endpoint=proxy.endpoint, range_size="1M", ranges_in_flight=1, timeout="2s", retries=1
        )
        cache = tierstore.Cache(source="s3://bkt/d", tiers=[tier], s3=settings)
        f = cache.open("big.bin")
        first = f.read(1024 * 1024)
        assert first == blob("object 7", size)[: 1024 * 1024]
        s3.kill()
        t0 = time.monotonic()
        with pytest.raises(OSError):
            while f.read(1024 * 1024):
                pass
        assert time.monotonic() - t0 < 30
        cache.wait()
        # Nothing partial was published; with the server back, the object is whole.
        assert cache.lookup("s3://bkt/d/big.bin", validate=False) is None
        s3.start()
        # The gateway answers before its volume server has re-registered: wait until the object reads.
        deadline = time.monotonic() + 60
        while True:
            try:
                s3.client().head_object(Bucket="bkt", Key="d/big.bin")
                s3.client().get_object(Bucket="bkt", Key="d/big.bin", Range="bytes=0-0")["Body"].read()
                break
            except Exception:
                assert time.monotonic() < deadline, s3.log_tail()
                time.sleep(0.2)
        assert (
            hashlib.sha256(cache.open("big.bin").read()).digest()
            == hashlib.sha256(blob("object 7", size)).digest()
        )


def test_prefetch_of_a_prefix(server: S3Server, bucket: str, tier: str) -> None:
    objects = {f"ds/sub{i % 3}/{i:04d}.bin": blob(f"object {i}", 4096 + i) for i in range(150)}
    put(server, bucket, objects)
    cache = cache_of(server, f"s3://{bucket}/ds", tier, revalidate="never")
    progress = cache.prefetch([f"s3://{bucket}/ds"], progress=False)
    assert progress["files_done"] == progress["files_total"] == 150
    assert progress["files_copied"] == 150 and progress["files_failed"] == 0
    s = cache.stats()["source"]
    assert (s["lists"], s["reads"]) == (1, 150)
    cache.reset_counters()
    for key, body in objects.items():
        assert cache.open(key.removeprefix("ds/")).read() == body
    assert gets(cache) == 0
    # A prefix below the source, and a single object.
    other = cache_of(server, f"s3://{bucket}/ds", str(Path(tier).parent / "t-sub"))
    assert other.prefetch(["sub1"], progress=False)["files_copied"] == 50
    assert other.prefetch(["sub2/0002.bin"], progress=False)["files_copied"] == 1


def test_files_named_as_files_are_fetched_with_one_get_and_no_listing(
    server: S3Server, bucket: str, tier: str
) -> None:
    # What the shard read-ahead asks for: shards by their full names, each one GET, never listed as a
    # prefix (a LIST each, before).
    objects = {f"ds/shard-{i}.tar": blob(f"shard {i}", 70_000 + i) for i in range(3)}
    objects["ds/shard-1.tar.idx"] = b"a name that the prefix shard-1.tar would also list"
    put(server, bucket, objects)
    cache = cache_of(server, f"s3://{bucket}/ds", tier, revalidate="never")
    started = cache._core.prefetch_files([f"s3://{bucket}/ds/shard-{i}.tar" for i in range(3)], 2)
    wait_for("the shards fetched", lambda: started.done, 30)
    progress = started.progress()
    assert (progress["files_copied"], progress["files_failed"]) == (3, 0), progress
    s = cache.stats()["source"]
    assert (s["lists"], s["reads"]) == (0, 3), s
    cache.reset_counters()
    for i in range(3):
        assert cache.open(f"shard-{i}.tar").read() == objects[f"ds/shard-{i}.tar"]
    assert gets(cache) == 0
    assert cache._core.lookup(f"s3://{bucket}/ds/shard-1.tar.idx", False) is None  # not fetched
    # A name with no object is a failure of its own in the progress, not an error of the call.
    missing = cache._core.prefetch_files([f"s3://{bucket}/ds/shard-9.tar"], 1)
    wait_for("the missing shard's end", lambda: missing.done, 30)
    assert missing.progress()["files_failed"] == 1


def test_a_dataloader_over_a_prefix(server: S3Server, bucket: str, tier: str) -> None:
    torch = pytest.importorskip("torch")
    from tierstore.torch import CachedDataset

    objects = {f"imgs/{i:03d}.bin": blob(f"object {i}", 3000) for i in range(64)}
    put(server, bucket, objects)
    cache = cache_of(server, f"s3://{bucket}/imgs", tier, revalidate="never")
    ds = CachedDataset(f"s3://{bucket}/imgs", cache=cache, decode=lambda f: len(f.read()))
    assert len(ds) == 64 and ds.paths[0] == f"s3://{bucket}/imgs/000.bin"
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context="fork")
    for _epoch in range(2):
        assert sum(int(b.sum()) for b in loader) == 64 * 3000
    assert gets(cache) == 64  # the second epoch came from the tier


def test_every_object_name_is_read_as_listed(server: S3Server, bucket: str, tier: str) -> None:
    """Names with characters a URL or object_store encodes are keys byte for byte, not encoded twice."""
    from tierstore.torch import CachedDataset

    # SeaweedFS stores a backslash in a key as `/` (its objects are a file tree): a limit of that server.
    objects = {f"odd/{name}": blob(name, 500 + i) for i, name in enumerate(odd_names("\\"))}
    put(server, bucket, objects)
    cache = cache_of(server, f"s3://{bucket}/odd", tier, revalidate="never")
    ds = CachedDataset(f"s3://{bucket}/odd", cache=cache, decode=lambda f: f.read())
    assert sorted(ds.paths) == sorted(f"s3://{bucket}/{key}" for key in objects)
    for path, body in zip(ds.paths, (ds[i] for i in range(len(ds))), strict=True):
        assert body == objects[path.removeprefix(f"s3://{bucket}/")], path
    assert gets(cache) == len(objects)


@pytest.mark.slow
def test_prefetching_gets_each_object_once(server: S3Server, bucket: str, tier: str) -> None:
    """The sampler-ordered prefetch with a budget smaller than what the loader keeps in flight: a worker
    often reaches an object the prefetch is about to fetch, and still each object costs one GET (an
    object's open is its GET, so the prefetch waits for room before it opens, never after)."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, RandomSampler

    from tierstore.torch import CachedDataset, prefetching

    size = 16 << 10
    objects = {f"p/{i:04d}.bin": blob(f"object {i}", size) for i in range(240)}
    put(server, bucket, objects)
    cache = cache_of(server, f"s3://{bucket}/p", tier, revalidate="never")
    ds = CachedDataset(f"s3://{bucket}/p", cache=cache, decode=lambda f: len(f.read()))
    sampler = RandomSampler(ds, generator=torch.Generator().manual_seed(3))
    loader = DataLoader(ds, batch_size=8, sampler=sampler, num_workers=2, multiprocessing_context="fork")
    wrapped = prefetching(loader, budget=8 * size, jobs=8)
    assert sum(int(b.sum()) for b in wrapped) == len(objects) * size
    assert wrapped.ordered_sampler.prefetch.wait(30)
    cache.wait()
    progress = wrapped.ordered_sampler.progress()
    assert progress["files_failed"] == 0, progress["errors"]
    assert gets(cache) == len(objects), (gets(cache), progress)
    assert server.requests(bucket).get("GET", 0) == len(objects), server.requests(bucket)


def test_tierstore_run_refuses_an_object_store(server: S3Server, bucket: str, tier: str) -> None:
    import subprocess
    import sys

    env = {**os.environ, **server.env(), "TIERSTORE_SOURCE": f"s3://{bucket}/d", "TIERSTORE_TIERS": tier}
    p = subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "run", "--", "true"], env=env, capture_output=True, text=True
    )
    assert p.returncode != 0
    assert "object store" in p.stderr and "tierstore.open" in p.stderr


def test_reads_while_a_large_object_streams_in(server: S3Server, bucket: str, tier: str) -> None:
    body = blob("object 3", 12 * 1024 * 1024)
    put(server, bucket, {"d/big.bin": body})
    cache = cache_of(server, f"s3://{bucket}/d", tier, s3={"range_size": "1M", "ranges_in_flight": 4})
    results: list[bytes] = []

    def read() -> None:
        with cache.open("big.bin") as f:
            results.append(f.read())

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [body] * 4
    assert gets(cache) == 12  # one flight for four readers


def test_fsspec_chained_over_s3(server: S3Server, bucket: str, tier: str) -> None:
    fsspec = pytest.importorskip("fsspec")
    objects = {f"d/{i}.bin": blob(f"object {i}", 5000) for i in range(5)}
    put(server, bucket, objects)
    s3_options = {
        "key": server.settings()["access_key_id"],
        "secret": server.settings()["secret_access_key"],
        "client_kwargs": {"endpoint_url": server.endpoint, "region_name": "us-east-1"},
    }
    opts = {"s3": s3_options, "tierstore": {"tiers": [tier], "revalidate": "never"}}
    for key, body in objects.items():
        with fsspec.open(f"tierstore::s3://{bucket}/{key}", "rb", **opts) as f:
            assert f.read() == body
    fs, _ = fsspec.core.url_to_fs(f"tierstore::s3://{bucket}/d", **opts)
    assert sorted(fs.ls(f"{bucket}/d", detail=False)) == sorted(f"s3://{bucket}/{k}" for k in objects)
    # A small object is handed to its reader before its copy is written (by the copy pool): the copies
    # of the bucket's cache, the one every open above went through (fsspec keeps one instance per
    # options), are waited for before another cache counts them.
    assert list(fs.caches) == [f"s3://{bucket}"], fs.caches
    fs.caches[f"s3://{bucket}"].wait()
    cache = tierstore.Cache(source=f"s3://{bucket}", tiers=[tier], s3=server.settings())
    assert cache.stats()["tiers"][0]["entries"] == len(objects)
    # And tierstore:// with a cache whose source is the bucket.
    with fsspec.open(f"tierstore://s3://{bucket}/d/0.bin", "rb", cache=cache) as f:
        assert f.read() == objects["d/0.bin"]


def _drop_in_child(holder: list[tierstore.Cache]) -> None:
    import gc

    holder.clear()  # the last reference to the parent's cache, and its S3 runtime, dies here
    gc.collect()


def test_a_forked_child_never_waits_for_the_parents_s3_threads(
    server: S3Server, bucket: str, tier: str
) -> None:
    put(server, bucket, {"d/a.bin": b"parent"})
    holder = [cache_of(server, f"s3://{bucket}/d", tier)]
    assert holder[0].open("a.bin").read() == b"parent"  # the runtime's threads run in this process
    child = multiprocessing.get_context("fork").Process(target=_drop_in_child, args=(holder,))
    child.start()
    child.join(30)
    assert child.exitcode == 0, "the child hung dropping an S3 source it inherited"


def test_the_prefetch_command_over_a_prefix(server: S3Server, bucket: str, tier: str) -> None:
    """`tierstore prefetch s3://...` with the endpoint and keys from the standard AWS variables."""
    import subprocess
    import sys

    objects = {f"cli/{i:03d}.bin": blob(f"object {i}", 10_000 + i) for i in range(40)}
    put(server, bucket, objects)
    s = server.settings()
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": s["endpoint"],
        "AWS_ACCESS_KEY_ID": s["access_key_id"],
        "AWS_SECRET_ACCESS_KEY": s["secret_access_key"],
        "AWS_REGION": "us-east-1",
    }
    cli_tier = str(Path(tier).parent / "t-cli")
    args = [
        sys.executable,
        "-m",
        "tierstore.cli",
        "--source",
        f"s3://{bucket}/cli",
        "--tier",
        f"{cli_tier}:1G",
    ]
    p = subprocess.run(
        [*args, "prefetch", f"s3://{bucket}/cli"], env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    assert "prefetched 40 files" in p.stdout and "40 copied" in p.stdout, p.stdout
    again = subprocess.run(
        [*args, "prefetch", f"s3://{bucket}/cli"], env=env, capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0 and "0 copied, 40 already cached" in again.stdout, (
        again.stdout + again.stderr
    )
    missing = subprocess.run(
        [*args, "prefetch", f"s3://{bucket}/cli/nope.bin"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 1 and "nope.bin" in missing.stderr, missing.stdout + missing.stderr


@pytest.mark.parametrize("revalidate", ["always", "never", "60s"])
def test_a_cold_object_costs_one_get_in_every_mode(
    server: S3Server, bucket: str, tier: str, revalidate: str
) -> None:
    """The GET's response carries the object's identity: no HEAD before it, whatever `revalidate` says."""
    objects = {f"d/{i:02d}.bin": blob(f"object {i}", 3000 + i) for i in range(12)}
    put(server, bucket, objects)
    cache = cache_of(server, f"s3://{bucket}/d", tier, revalidate=revalidate)
    before = server.requests(bucket)
    for key, body in objects.items():
        assert cache.open(key.removeprefix("d/")).read() == body
    after = server.requests(bucket)
    sent = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    # SeaweedFS counts a HEAD as a GET: one "GET" per object means no HEAD was sent.
    assert sent.get("GET", 0) == len(objects), sent
    s = cache.stats()["source"]
    assert (s["reads"], s["stats"]) == (len(objects), 0)


@pytest.mark.s3
@pytest.mark.slow
def test_a_stalled_server_fails_the_reader_within_its_deadline(tmp_path: Path, tier: str) -> None:
    """A server that stops answering (SIGSTOP: connections stay open, nothing comes back) fails a reader
    following a large object's copy within one request's deadline and its retries, not twice that: the
    copy's failure is the reader's, rather than a reason to ask the store again."""
    size = 48 * 1024 * 1024
    timeout, retries = 2.0, 1
    with S3Server(tmp_path / "weed") as s3:
        s3.create_bucket("bkt")
        put(s3, "bkt", {"d/big.bin": blob("object 8", size)})
        cache = tierstore.Cache(
            source="s3://bkt/d",
            tiers=[tier],
            s3=s3.settings(range_size="1M", ranges_in_flight=1, timeout=f"{timeout:g}s", retries=retries),
        )
        f = cache.open("big.bin")
        s3.pause()
        try:
            t0 = time.monotonic()
            with pytest.raises(OSError) as failed:
                while f.read(1024 * 1024):
                    pass
            waited = time.monotonic() - t0
        finally:
            s3.resume()
        # Each try waits `timeout`; the back-off between them is 0.1 s, and the margin is this machine's.
        assert waited < (retries + 1) * timeout + 1.5, f"waited {waited:.1f} s: {failed.value}"
        assert "s3://bkt/d/big.bin" in str(failed.value)
        cache.wait()
        assert cache.lookup("s3://bkt/d/big.bin", validate=False) is None, "a partial copy was published"
        assert (
            hashlib.sha256(cache.open("big.bin").read()).digest()
            == hashlib.sha256(blob("object 8", size)).digest()
        )


def test_revalidate_within_a_duration_confirms_a_prefix_with_one_listing(
    server: S3Server, bucket: str, tier: str
) -> None:
    """`revalidate = "2s"`: a copy confirmed within 2 s is served without a request; an older one is
    confirmed with the rest of its prefix by one LIST (ETag, size and last-modified of every key), so a
    warm epoch costs a request per prefix, not per object, and a change is seen within the duration."""
    top = {f"d/{i:02d}.bin": blob(f"object {i}", 2000 + i) for i in range(30)}
    sub = {f"d/sub/{i}.bin": blob(f"object {100 + i}", 500) for i in range(4)}
    objects = {**top, **sub}
    put(server, bucket, objects)
    cache = cache_of(server, f"s3://{bucket}/d", tier, revalidate="2s")

    def epoch() -> dict[str, int]:
        before = server.requests(bucket)
        for key in objects:
            with cache.open(key.removeprefix("d/")) as f:
                assert f.read() == objects[key], key
        after = server.requests(bucket)
        return {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}

    assert epoch() == {"GET": len(objects)}
    cache.wait()
    assert epoch() == {}, "copies confirmed within the duration cost the store nothing"
    changed = {"d/03.bin": b"a new version of three", "d/sub/1.bin": blob("object 7", 500)}
    put(server, bucket, changed)
    server.client().delete_object(Bucket=bucket, Key="d/07.bin")
    deleted = top.pop("d/07.bin")
    objects.pop("d/07.bin")
    objects.update(changed)
    # Within the duration the old copies may still be served: bounded staleness, not "never stale".
    assert cache.open("07.bin").read() == deleted
    time.sleep(2.1)
    sent = epoch()
    # One LIST for each prefix (d/ and d/sub/) and a GET for each changed object; no HEAD (SeaweedFS
    # counts a HEAD as a GET, and tierstore's own counters tell them apart).
    assert sent == {"LIST": 2, "GET": len(changed)}, sent
    s = cache.stats()["source"]
    assert (s["lists"], s["stats"]) == (2, 0), s
    with pytest.raises(FileNotFoundError):
        cache.open("07.bin")
