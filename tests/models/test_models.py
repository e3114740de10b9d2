"""The model repository against real torch models, real files and real crashes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from tierstore.models import IntegrityError, Repository, RepositoryError, layer_ids  # noqa: E402

ALL_DTYPES = [
    name
    for name in (
        "float32", "float64", "float16", "bfloat16", "complex64", "complex128", "complex32",
        "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
]  # fmt: skip


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(np.prod(shape)) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw[: int(np.prod(shape))] % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN patterns and float8 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(
        torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
        )
    )


@pytest.fixture
def repo(tmp_path: Path) -> Repository:
    return Repository(tmp_path / "repo")


def test_every_torch_dtype_and_odd_shapes_round_trip(repo: Repository) -> None:
    state = {}
    for i, name in enumerate(ALL_DTYPES):
        dtype = getattr(torch, name)
        state[f"{name}.matrix"] = random_tensor(dtype, (7, 13), seed=i)
        state[f"{name}.scalar"] = random_tensor(dtype, (), seed=100 + i)
        state[f"{name}.empty"] = random_tensor(dtype, (0, 5), seed=i)
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    state["transposed"] = base.t()  # non-contiguous
    state["view.head"] = base[:2]  # two views of one storage
    state["view.tail"] = base[1:, 3:7]
    state["strided"] = torch.arange(100, dtype=torch.int64)[::3]
    state["conj"] = torch.randn(4, dtype=torch.complex64).conj()
    v = repo.save("dtypes", state)
    loaded = repo.load("dtypes")
    assert set(loaded) == set(state) and v.tensors == len(state)
    for k, t in state.items():
        expected = t.resolve_conj().contiguous()
        assert same_bytes(loaded[k], expected), k
    assert len(ALL_DTYPES) >= 17, ALL_DTYPES


def test_numpy_dicts_round_trip_as_numpy(repo: Repository) -> None:
    arrays = {
        "f16": np.random.default_rng(0).normal(size=(3, 4)).astype(np.float16),
        "c128": np.arange(6, dtype=np.complex128) * 1j,
        "b": np.array([True, False, True]),
        "u64": np.arange(5, dtype=np.uint64) << 40,
        "fortran": np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4)),
        "zero_d": np.array(3.5),
    }
    repo.save("np", arrays)
    for mmap in (True, False):
        out = repo.load("np", mmap=mmap)
        for k, a in arrays.items():
            assert isinstance(out[k], np.ndarray) and out[k].dtype == a.dtype
            assert out[k].shape == a.shape, f"{k}: shape {out[k].shape}, saved {a.shape}"
            np.testing.assert_array_equal(out[k], a)
    with pytest.raises(TypeError, match="holds Python objects"):
        repo.save("bad", {"o": np.array([object()])})
    with pytest.raises(TypeError, match="not a tensor"):
        repo.save("bad", {"x": [1, 2, 3]})


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "copy"])
def test_zero_d_tensors_keep_their_shape(repo: Repository, mmap: bool) -> None:
    state = {
        "step": torch.tensor(7),
        "scale": torch.tensor(0.5, dtype=torch.bfloat16),
        "flag": torch.tensor(True),
        "vector": torch.arange(3.0),
    }
    repo.save("t", state)
    out = repo.load("t", mmap=mmap)
    for k, t in state.items():
        assert out[k].shape == t.shape and same_bytes(out[k], t), f"{k}: {out[k]!r}, saved {t!r}"
    target = {k: torch.zeros_like(t) for k, t in state.items()}
    repo.load("t", into=target)
    assert all(same_bytes(target[k], t) for k, t in state.items())
    arrays = {"zero_d": np.array(3.5), "int": np.array(-2, dtype=np.int16)}
    repo.save("n", arrays)
    out = repo.load("n", mmap=mmap)
    assert {k: out[k].shape for k in arrays} == {"zero_d": (), "int": ()}
    into = {k: np.zeros_like(a) for k, a in arrays.items()}
    repo.load("n", into=into)
    assert into["zero_d"].shape == () and into["zero_d"] == 3.5 and into["int"] == -2


def io_counter(name: str) -> int:
    """A counter of /proc/self/io: rchar counts bytes of read calls, read_bytes bytes fetched from the
    device (page faults of a mapping included)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {name} in /proc/self/io")


def evict(paths: list[Path]) -> None:
    """Drops the (clean, fsynced) pages of `paths` from the page cache, so the next access reads the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@pytest.mark.parametrize("mmap", [False, True], ids=["copy", "mmap"])
def test_partial_load_reads_only_the_chosen_bytes(repo: Repository, mmap: bool) -> None:
    state = {f"layer{i}.weight": torch.randn(256, 256) for i in range(20)}  # 256 KiB each
    repo.save("big", state)
    tensor_bytes = 256 * 256 * 4

    def cold_load(keys: list[str]) -> tuple[dict[str, torch.Tensor], int]:
        """The chosen tensors, and what loading them fetched from the disk (page faults included), once
        the pack is out of the page cache."""
        evict(list((repo.root / "packs").glob("*.pack")))
        before = io_counter("read_bytes")
        part = repo.load("big", keys=keys, mmap=mmap)
        return part, io_counter("read_bytes") - before

    # Tensors far apart: exactly their bytes.
    part, read = cold_load(["layer3.weight", "layer13.weight"])
    assert 2 * tensor_bytes <= read < 2 * tensor_bytes + (256 << 10), f"read {read} bytes"
    assert torch.equal(part["layer13.weight"], state["layer13.weight"])
    # A run of neighbours: a mapped load reads the 2 MiB blocks that are at least a third chosen whole,
    # which is faster and never more than 3x the chosen bytes. A copying load reads exactly their bytes
    # here, since those blocks would fetch more than 1.25x them.
    part, read = cold_load(["layer3.weight", "layer1?.*"])
    assert sorted(part) == ["layer10.weight", "layer11.weight", "layer12.weight", "layer13.weight",
                            "layer14.weight", "layer15.weight", "layer16.weight", "layer17.weight",
                            "layer18.weight", "layer19.weight", "layer3.weight"]  # fmt: skip
    nbytes = 11 * tensor_bytes
    most = 3 * nbytes if mmap else nbytes + (256 << 10)
    assert nbytes <= read <= most, f"read {read} bytes for {nbytes}"
    assert all(torch.equal(part[k], state[k]) for k in part)
    with pytest.raises(RepositoryError, match=r"matches 'decoder\.\*'"):
        repo.load("big", keys="decoder.*")


def test_mapped_loads_share_the_pack_and_never_change_it(repo: Repository) -> None:
    state = {"w": torch.randn(300, 300), "b": torch.randn(300), "same": None}
    state["same"] = state["w"].clone()  # one stored tensor under two names
    repo.save("m", state)
    first, second = repo.load("m"), repo.load("m")
    for k in state:
        assert torch.equal(first[k], state[k]), k
    # Copy-on-write: changing one loaded tensor changes neither the other load nor the stored bytes.
    first["w"].add_(1.0)
    first["same"].zero_()
    assert torch.equal(second["w"], state["w"]) and torch.equal(second["same"], state["w"])
    assert torch.equal(repo.load("m", mmap=False)["w"], state["w"])
    # The tensors keep their mapping: deleting the version and collecting its pack does not touch them.
    repo.delete("m", 1)
    assert repo.gc()["packs_removed"] == 1
    assert torch.equal(second["b"], state["b"])


def test_load_into_a_module_lands_in_its_memory(repo: Repository) -> None:
    src = nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32), nn.Linear(32, 8))
    repo.save("mlp", src)
    dst = nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32), nn.Linear(32, 8))
    ptrs = {k: p.data_ptr() for k, p in dst.state_dict().items()}
    out = repo.load("mlp", into=dst)
    for k, p in dst.state_dict().items():
        assert p.data_ptr() == ptrs[k], f"{k} was replaced, not filled"
        assert torch.equal(p, src.state_dict()[k])
    assert out["0.weight"] is dst.state_dict(keep_vars=True)["0.weight"]
    wrong = nn.Sequential(nn.Linear(64, 16))
    with pytest.raises(RepositoryError, match=r"stored float32\(32, 64\), target float32\(16, 64\)"):
        repo.load("mlp", into=wrong, keys="0.weight")


def test_non_contiguous_destinations_go_through_the_staging_buffer(repo: Repository) -> None:
    w = torch.randn(8, 16)
    repo.save("s", {"w": w})
    target = {"w": torch.empty(16, 8).t()}  # a transposed view: bytes cannot land in it directly
    repo.load("s", into=target)
    assert torch.equal(target["w"], w)


def test_dedup_writes_only_changed_tensors(repo: Repository) -> None:
    state = {f"t{i}": torch.randn(128, 128) for i in range(50)}
    v1 = repo.save("m", state)
    assert v1.written_bytes == v1.nbytes == 50 * 128 * 128 * 4
    for i in range(5):  # 10% of the tensors change
        state[f"t{i}"] = state[f"t{i}"] + 1
    v2 = repo.save("m", state)
    assert v2.written_bytes == 5 * 128 * 128 * 4 and v2.deduplicated_bytes == 45 * 128 * 128 * 4
    v3 = repo.save("m-copy", state)  # another model with the same weights stores nothing new
    assert v3.written_bytes == 0
    s = repo.stats()
    assert s["logical_bytes"] == 150 * 128 * 128 * 4
    assert s["stored_bytes"] - 55 * 128 * 128 * 4 < 64 * 55, "more than alignment padding on disk"
    assert [v.version for v in repo.versions("m")] == [1, 2]
    assert repo.info("m", 2)["deduplicated_bytes"] == v2.deduplicated_bytes


def test_every_version_records_the_hash_of_each_pack_it_reads_where_known(repo: Repository) -> None:
    """A save records the blake3 of the pack it writes, whole (padding included), and carries over those
    of the older packs its deduplicated tensors are in; a pack whose hash no manifest records (saved by a
    tierstore before they were) is left without one, never given an invented one."""
    from tierstore import _core

    def pack_hash(pack: Path) -> str:
        (h,) = _core.hash_buffers([np.fromfile(pack, dtype=np.uint8)])
        return h.hex()

    state = {f"t{i}": torch.randn(100 + 37 * i) for i in range(20)} | {"big": torch.randn(3 << 20)}
    repo.save("m", state)
    first = repo.manifest("m", 1)
    (pack1,) = {t["pack"] for t in first["tensors"]}
    assert first["pack_hashes"] == {pack1: pack_hash(repo.root / "packs" / pack1)}
    state["t0"] = state["t0"] + 1
    repo.save("m", state)
    second = repo.manifest("m", 2)
    (pack2,) = {t["pack"] for t in second["tensors"]} - {pack1}
    assert second["pack_hashes"] == {p: pack_hash(repo.root / "packs" / p) for p in (pack1, pack2)}
    # A version written before packs' hashes were recorded: the next save knows none for its pack.
    path = repo.root / "models" / "m" / "v1.json"
    old = json.loads(path.read_text())
    del old["pack_hashes"]
    path.write_text(json.dumps(old))
    path = repo.root / "models" / "m" / "v2.json"
    path.write_text(json.dumps(old | {"version": 2}))
    state["t1"] = state["t1"] + 1
    fresh = Repository(repo.root)
    fresh.save("m", state)
    third = fresh.manifest("m", 3)
    (pack3,) = {t["pack"] for t in third["tensors"]} - {pack1}
    assert third["pack_hashes"] == {pack3: pack_hash(repo.root / "packs" / pack3)}
    assert all(torch.equal(fresh.load("m", 3)[k], state[k]) for k in state)


def test_corrupted_pack_bytes_are_detected_and_named(repo: Repository) -> None:
    state = {"a": torch.randn(1000), "b": torch.randn(200_000), "c": torch.randn(10)}
    repo.save("c", state)
    t = next(t for t in repo.manifest("c")["tensors"] if t["name"] == "b")
    pack = repo.root / "packs" / t["pack"]
    with open(pack, "r+b") as f:
        f.seek(t["offset"] + 4321)
        byte = f.read(1)
        f.seek(t["offset"] + 4321)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(IntegrityError, match=r"tensor 'b' of c@1 is damaged") as e:
        repo.load("c")
    # The advice names the command that makes a new save write the tensor again.
    assert f"tierstore models --repo {repo.root} verify c@1 --repair" in str(e.value)
    target = {"b": torch.zeros(200_000)}
    with pytest.raises(IntegrityError):
        repo.load("c", keys="b", into=target)
    ok = repo.load("c", keys=["a", "c"])  # the rest of the version is still readable
    assert torch.equal(ok["a"], state["a"]) and torch.equal(ok["c"], state["c"])
    # Export names the tensor (not "tensor #0 at offset 4096") and leaves nothing beside its target,
    # although 'a' was written to the temporary file before 'b' failed.
    out_dir = repo.root.parent / "exports"
    out_dir.mkdir()
    with pytest.raises(IntegrityError, match=r"tensor 'b' of c@1 is damaged") as e:
        repo.export("c", 1, out_dir / "damaged.safetensors")
    assert "#0" not in str(e.value) and "offset" not in str(e.value)
    assert os.listdir(out_dir) == [], "a failed export left a file behind"
    r = subprocess.run([sys.executable, "-m", "tierstore.cli", "models", "--repo", str(repo.root), "export", "c",
                        str(out_dir / "cli.safetensors")], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 1 and "tensor 'b' of c@1 is damaged" in r.stderr and "Traceback" not in r.stderr
    assert os.listdir(out_dir) == []
    os.truncate(pack, t["offset"] + 100)
    with pytest.raises(IntegrityError, match="the pack is truncated"):
        repo.load("c", keys="b")


def flip_byte(repo: Repository, t: dict, at: int) -> None:
    """Damages the stored copy of manifest entry `t` at byte `at` of the tensor."""
    with open(repo.root / "packs" / t["pack"], "r+b") as f:
        f.seek(t["offset"] + at)
        byte = f.read(1)
        f.seek(t["offset"] + at)
        f.write(bytes([byte[0] ^ 0x40]))


def test_verify_repair_makes_the_next_save_write_damaged_tensors_anew(repo: Repository) -> None:
    state = {"a": torch.randn(1000), "b": torch.randn(200_000), "c": torch.randn(10)}
    other = Repository(repo.root)  # another process's view, whose index of stored tensors is already built
    other.save("c", state)
    assert repo.verify().ok
    b = next(t for t in repo.manifest("c")["tensors"] if t["name"] == "b")
    flip_byte(repo, b, 4321)
    with pytest.raises(IntegrityError, match="tensor 'b' of c@1 is damaged"):
        repo.load("c")
    # Before a repair, a save refers to the damaged copy: it writes nothing and is as broken.
    assert other.save("c", state).written_bytes == 0
    with pytest.raises(IntegrityError, match="tensor 'b' of c@2 is damaged"):
        repo.load("c", 2)
    report = repo.verify("c", 1)
    assert not report.ok and (report.versions, report.tensors, report.blobs) == (1, 3, 3)
    assert [(d.model, d.version, d.tensor, d.reason) for d in report.damaged] == [
        ("c", 1, "b", "corrupt"),
        ("c", 2, "b", "corrupt"),  # not asked, but it refers to the same damaged copy
    ]
    assert report.quarantined == 0 and not (repo.root / "quarantine").exists()  # no repair asked
    report = repo.verify(repair=True)
    assert report.quarantined == 1 and report.broken_versions == ["c@1", "c@2"]
    # The next save of the same tensors writes the damaged one anew (the other two are intact), and loads.
    v3 = other.save("c", state)
    assert v3.version == 3 and v3.written_bytes == b["nbytes"]
    for mmap in (True, False):
        out = repo.load("c", 3, mmap=mmap)
        assert all(torch.equal(out[k], state[k]) for k in state)
    # The versions that referred to the damaged copy stay broken, and say so.
    with pytest.raises(IntegrityError, match="quarantined: c@1 stays broken"):
        repo.load("c", 1)
    report = repo.verify(repair=True)
    assert report.broken_versions == ["c@1", "c@2"] and report.quarantined == 0
    assert repo.verify("c", 3).ok
    # gc keeps the new copy's pack although an older version refers to the same hash elsewhere.
    repo.gc()
    assert torch.equal(repo.load("c", 3, mmap=False)["b"], state["b"])
    # A pack restored from a backup: its copy is released from quarantine, and the versions load again.
    flip_byte(repo, b, 4321)
    report = repo.verify(repair=True)
    assert report.ok and report.released == 1 and os.listdir(repo.root / "quarantine") == []
    assert torch.equal(repo.load("c", 1)["b"], state["b"])


def test_verify_reports_a_missing_pack_and_refuses_a_version_without_a_name(repo: Repository) -> None:
    w = torch.randn(100)
    repo.save("m", {"w": w})
    repo.save("keep", {"k": torch.randn(100)})
    pack = repo.root / "packs" / repo.manifest("m")["tensors"][0]["pack"]
    pack.unlink()
    with pytest.raises(IntegrityError, match=r"m@1: pack .* which holds tensor 'w', is missing") as e:
        repo.load("m")
    assert "verify m@1 --repair" in str(e.value)
    report = repo.verify(repair=True)
    assert [(d.model, d.tensor, d.reason) for d in report.damaged] == [("m", "w", "missing")]
    assert (report.versions, report.quarantined) == (2, 1)
    assert repo.save("m", {"w": w}).written_bytes == 400  # not a reference to the missing pack
    assert torch.equal(repo.load("m")["w"], w)
    with pytest.raises(ValueError, match="without a model name"):
        repo.verify(None, 1)
    with pytest.raises(RepositoryError, match="no model named 'nope'"):
        repo.verify("nope")


def test_models_verify_cli(repo: Repository) -> None:
    state = {"a": torch.randn(1000), "b": torch.randn(200_000)}
    repo.save("v", state)
    repo.save("w", {"x": torch.randn(10)})

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tierstore.cli", "models", "--repo", str(repo.root), *args],
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    r = run("verify", "--progress")  # off a terminal only when asked
    assert r.returncode == 0 and "checked 3 tensors of 2 versions" in r.stdout and "no damage" in r.stdout
    assert "verify" in r.stderr and "KiB" in r.stderr  # rich's progress bar
    flip_byte(repo, next(t for t in repo.manifest("v")["tensors"] if t["name"] == "b"), 99)
    r = run("verify", "w")  # another model: its tensors are intact
    assert r.returncode == 0, r.stdout
    r = run("verify", "v@1", "--no-progress")
    assert r.returncode == 1 and r.stderr == ""
    assert "damaged: v@1 tensor 'b': its bytes do not match the recorded hash" in r.stdout
    assert f"tierstore models --repo {repo.root} verify v@1 --repair" in r.stdout
    r = run("verify", "v", "--repair", "--json")
    assert r.returncode == 1
    report = json.loads(r.stdout)
    assert report["quarantined"] == 1 and report["broken_versions"] == ["v@1"]
    assert [d["tensor"] for d in report["damaged"]] == ["b"]
    assert repo.save("v", state).written_bytes == 800_000
    r = run("verify", "v@latest")
    assert r.returncode == 0 and "no damage" in r.stdout
    r = run("verify", "v@7")
    assert r.returncode == 1 and "v has no version 7" in r.stderr


@pytest.mark.parametrize("mmap", [False, True], ids=["copy", "mmap"])
def test_a_manifest_whose_byte_count_disagrees_with_the_shape_is_refused(
    repo: Repository, mmap: bool
) -> None:
    repo.save("m", {"w": torch.randn(100, 100), "b": torch.randn(100)})
    path = repo.root / "models" / "m" / "v1.json"
    manifest = json.loads(path.read_text())
    entry = next(t for t in manifest["tensors"] if t["name"] == "w")
    entry["nbytes"] += 4096  # would read past the tensor, into its neighbour
    path.write_text(json.dumps(manifest))
    with pytest.raises(
        IntegrityError, match=r"'w': the manifest records 44096 bytes, but float32\(100, 100\)"
    ):
        repo.load("m", mmap=mmap)
    assert repo.load("m", keys="b", mmap=mmap)["b"].shape == (100,)  # the rest stays readable


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("pack", "../../../etc/passwd", 'names the pack "../../../etc/passwd", not a file of packs/'),
        ("hash", "not-a-hash", "has no blake3 hash"),
    ],
)
def test_a_manifest_that_points_outside_the_repository_is_refused_naming_the_file(
    repo: Repository, field: str, value: str, why: str
) -> None:
    """A manifest is a file another process (or user) wrote: a pack name with a directory in it would read
    outside `packs/`, a hash that is not one would name any file. Both are refused before anything is read,
    and the repository's other versions stay readable."""
    repo.save("m", {"w": torch.randn(10)})
    repo.save("other", {"w": torch.randn(10)})
    path = repo.root / "models" / "m" / "v1.json"
    manifest = json.loads(path.read_text())
    manifest["tensors"][0][field] = value
    path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=re.escape(f'v1.json: tensor "w" {why}')):
        repo.load("m")
    assert repo.load("other")["w"].shape == (10,)
    # A save goes through the same schema: a well-formed version is written, and is read back the same.
    v = repo.save("fresh", {"w": torch.zeros(3)})
    assert repo.manifest("fresh", v.version)["tensors"][0]["nbytes"] == 12


SAVE_BIG = """
import sys, torch
from tierstore.models import Repository
repo = Repository(sys.argv[1])
state = {f"w{i}": torch.full((16, 1024, 1024), float(i)) for i in range(12)}  # 768 MiB: the write takes time
print("saving", flush=True)
repo.save("victim", state)
print("saved", flush=True)
"""


def test_save_killed_mid_way_leaves_earlier_versions_intact(repo: Repository) -> None:
    first = {"w0": torch.randn(100, 100)}
    repo.save("victim", first)
    child = subprocess.Popen(
        [sys.executable, "-c", SAVE_BIG, str(repo.root)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "saving"
        deadline = time.monotonic() + 120
        while not any(
            p.name.endswith(".tmp") and p.stat().st_size > 64 << 20 for p in (repo.root / "packs").iterdir()
        ):
            assert time.monotonic() < deadline and child.poll() is None, "the save never got under way"
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        child.kill()
    assert [v.version for v in repo.versions("victim")] == [1]
    assert torch.equal(repo.load("victim")["w0"], first["w0"])
    r = repo.gc()
    assert r["packs_removed"] == 1 and r["bytes_freed"] > 64 << 20
    assert not [p for p in (repo.root / "packs").iterdir() if p.name.endswith(".tmp")]
    v2 = repo.save("victim", {"w0": first["w0"], "w1": torch.ones(3)})
    assert v2.version == 2 and v2.written_bytes == 12


# A writer of the test below, in a process of its own. numpy arrays, not torch tensors: four processes that
# each import torch take seconds of CPU (on 2 cores, most of the test), and the versions' numbering does not
# depend on the framework.
CONCURRENT_SAVER = """
import json, sys
import numpy as np
from tierstore.models import Repository
repo, worker = Repository(sys.argv[1]), int(sys.argv[2])
print("ready", flush=True)
sys.stdin.readline()  # all four start saving at once
out = []
for i in range(5):
    state = {"shared": np.arange(1000, dtype=np.float32), "own": np.full(500, worker * 100 + i, np.float32)}
    out.append(repo.save("shared-model", state, metadata={"worker": worker, "i": i}).version)
    repo.save(f"model-{worker}", state)
print(json.dumps(out))
"""


def test_concurrent_writers_from_several_processes(repo: Repository) -> None:
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", CONCURRENT_SAVER, str(repo.root), str(w)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(4)
    ]
    for p in writers:
        assert p.stdout is not None and p.stdout.readline() == "ready\n", p.communicate(timeout=60)[1]
    for p in writers:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    versions = []
    for p in writers:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        versions.append(json.loads(out))
    numbers = sorted(v for vs in versions for v in vs)
    assert numbers == list(range(1, 21)), "version numbers were lost or given twice"
    for v in repo.versions("shared-model"):
        w, i = v.metadata["worker"], v.metadata["i"]
        state = repo.load("shared-model", v.version)
        np.testing.assert_array_equal(state["own"], np.full(500, w * 100 + i, np.float32))
        np.testing.assert_array_equal(state["shared"], np.arange(1000, dtype=np.float32))
        assert state["own"].dtype == state["shared"].dtype == np.float32
    assert sorted(repo.models()) == ["model-0", "model-1", "model-2", "model-3", "shared-model"]


class Backbone(nn.Module):
    def __init__(self, order: str = "ab", names: tuple[str, str, str] = ("conv1", "conv2", "norm")) -> None:
        super().__init__()
        self.names = names
        layers = {
            names[0]: nn.Conv2d(3, 8, 3, padding=1),
            names[1]: nn.Conv2d(8, 16, 3, padding=1),
            names[2]: nn.BatchNorm2d(16),
        }
        for key in names if order == "ab" else reversed(names):  # registration order differs
            self.add_module(key, layers[key])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, n = (getattr(self, k) for k in self.names)
        return n(b(torch.relu(a(x))))


class Net(nn.Module):
    def __init__(self, backbone: Backbone, classes: int) -> None:
        super().__init__()
        self.features = backbone
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.features(x)), 1))


def test_stable_ids_ignore_labels_and_order_but_see_shapes_and_edges() -> None:
    a = layer_ids(Net(Backbone("ab"), 10))
    b = layer_ids(Net(Backbone("ba", names=("first", "second", "bn")), 10))
    assert sorted(a.values()) == sorted(b.values())
    assert a["features.conv2"] == b["features.second"]
    c = layer_ids(Net(Backbone("ab"), 7))  # the head's shape changed
    assert c["head"] != a["head"] and c["features.conv1"] == a["features.conv1"]

    class Skip(Backbone):  # the same layers, wired differently: conv2 is fed by the input
        def __init__(self) -> None:
            super().__init__()
            self.conv2 = nn.Conv2d(3, 16, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.conv2(x) + 0 * self.conv1(x).sum())

    class Plain(Backbone):
        def __init__(self) -> None:
            super().__init__()
            self.conv2 = nn.Conv2d(3, 16, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.conv2(self.conv1(x)[:, :3]))

    skip, plain = layer_ids(Skip()), layer_ids(Plain())
    assert skip["conv1"] == plain["conv1"]
    assert skip["conv2"] != plain["conv2"] and skip["norm"] != plain["norm"]


def test_stable_ids_are_memoized_and_fast() -> None:
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(1000)])
    first = layer_ids(model)
    t = time.perf_counter()
    again = layer_ids(model)
    elapsed = time.perf_counter() - t
    assert again == first and len(first) == 1000
    assert elapsed < 1.0  # a sanity bound only; the 5 ms target is measured by bench/bench_models.py


def test_load_matching_transfers_a_backbone_under_a_new_head(repo: Repository) -> None:
    torch.manual_seed(0)
    pretrained = Net(Backbone("ab"), 1000)
    repo.save("imagenet-net", pretrained)
    new = Net(Backbone("ba", names=("stem", "block", "bn")), 5)  # renamed, re-ordered, new head
    head_before = new.head.weight.clone()
    report = repo.load_matching(new, "imagenet-net")
    assert sorted(report.matched) == [
        ("features.block", "features.conv2"),
        ("features.bn", "features.norm"),
        ("features.stem", "features.conv1"),
    ]
    assert report.unmatched == ["head"]
    assert torch.equal(new.features.block.weight, pretrained.features.conv2.weight)
    assert torch.equal(new.features.bn.running_mean, pretrained.features.norm.running_mean)
    assert torch.equal(new.head.weight, head_before)
    x = torch.randn(2, 3, 8, 8)
    pretrained.eval(), new.eval()
    assert torch.allclose(new.features(x), pretrained.features(x))


def test_safetensors_export_and_import(repo: Repository, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    state = {"w": torch.randn(3, 4), "b": torch.randn(4).to(torch.bfloat16), "i": torch.arange(5)}
    for fnuz in ("float8_e4m3fnuz", "float8_e5m2fnuz"):  # AMD's float8 types, which safetensors knows
        state[fnuz] = torch.randn(6).to(getattr(torch, fnuz))
    repo.save("st", state, metadata={"epoch": 3})
    out = repo.export("st", "latest", tmp_path / "st.safetensors")
    loaded = load_file(out)
    assert all(
        loaded[k].dtype == v.dtype and torch.equal(loaded[k].view(torch.uint8), v.view(torch.uint8))
        for k, v in state.items()
    )
    v = repo.import_safetensors(out, "st-imported")
    assert v.written_bytes == 0  # the same tensors: deduplicated against the original
    back = repo.load("st-imported")
    assert all(
        back[k].dtype == state[k].dtype and torch.equal(back[k].view(torch.uint8), state[k].view(torch.uint8))
        for k in state
    )
    assert repo.info("st-imported")["metadata"]["epoch"] == "3"


def test_every_safetensors_dtype_round_trips_through_export_and_import(
    repo: Repository, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    from tierstore.models.safetensors_io import TO_SAFETENSORS

    names = [n for n in TO_SAFETENSORS if isinstance(getattr(torch, n, None), torch.dtype)]
    assert {"float8_e4m3fnuz", "float8_e5m2fnuz"} <= set(names)  # AMD's float8 types, in safetensors 0.4+
    state = {}
    for i, name in enumerate(names):
        dtype = getattr(torch, name)
        state[f"{name}.matrix"] = random_tensor(dtype, (5, 7), seed=i)  # every bit pattern: NaNs included
        state[f"{name}.scalar"] = random_tensor(dtype, (), seed=50 + i)
        state[f"{name}.empty"] = random_tensor(dtype, (0, 3), seed=i)
    repo.save("all", state)
    exported = load_file(repo.export("all", 1, tmp_path / "ours.safetensors"))  # read by safetensors itself
    assert set(exported) == set(state) and all(same_bytes(exported[k], t) for k, t in state.items())
    save_file(state, tmp_path / "theirs.safetensors")  # written by safetensors itself
    v = repo.import_safetensors(tmp_path / "theirs.safetensors", "imported")
    assert v.written_bytes == 0  # byte for byte the tensors already stored
    back = repo.load("imported", mmap=False)
    assert set(back) == set(state) and all(same_bytes(back[k], t) for k, t in state.items())


def test_gc_tells_alignment_padding_from_bytes_of_deleted_versions(repo: Repository) -> None:
    """A repository where nothing was deleted holds no bytes "of deleted versions": the gaps that align
    its tensors are padding. A version deleted while a pack it shares is still in use holds some."""
    repo.save("p", {"a": torch.randn(10), "b": torch.randn(100_000), "c": torch.randn(3)})
    r = repo.gc()
    assert r["bytes_of_deleted_versions"] == 0 and r["alignment_padding"] > 0, r
    assert r["bytes_unused_in_live_packs"] == r["alignment_padding"]
    # v2 shares "b" with v1 (dedup) and adds "d" to a pack of its own; v3 keeps only "b".
    repo.save("p", {"b": repo.load("p")["b"], "d": torch.randn(50_000)})
    repo.save("p", {"b": repo.load("p")["b"]})
    repo.delete("p", 1)
    r = repo.gc()
    # v1's pack still holds "b": its "a" and "c" are bytes of a deleted version now; v2's pack is whole.
    assert r["packs_removed"] == 0 and r["bytes_of_deleted_versions"] >= 4 * 3, r
    repo.delete("p", 2)
    r = repo.gc()
    assert r["packs_removed"] == 1 and r["bytes_of_deleted_versions"] >= 4 * 13, r


def test_delete_and_gc(repo: Repository) -> None:
    repo.save("g", {"a": torch.randn(1000)})
    repo.save("g", {"a": torch.randn(1000)})
    repo.delete("g", 1)
    r = repo.gc()
    assert r["packs_removed"] == 1 and r["bytes_freed"] >= 4000
    assert [v.version for v in repo.versions("g")] == [2]
    with pytest.raises(RepositoryError, match="no version 1"):
        repo.load("g", 1)
    with pytest.raises(RepositoryError, match="no model named 'nope'"):
        repo.load("nope")
    with pytest.raises(ValueError, match="model name"):
        repo.save("../escape", {"a": torch.zeros(1)})


def test_models_cli(repo: Repository, tmp_path: Path) -> None:
    repo.save("cli-model", {"a": torch.randn(100)})
    repo.save("cli-model", {"a": torch.randn(100), "b": torch.randn(10)})

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tierstore.cli", "models", "--repo", str(repo.root), *args],
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    r = run("ls")
    assert r.returncode == 0 and "cli-model" in r.stdout and "saved by dedup" in r.stdout
    r = run("show", "cli-model@1", "--json")
    assert json.loads(r.stdout)["version"] == 1
    r = run("show", "cli-model@9")
    assert r.returncode != 0 and "no version 9" in r.stderr
    r = run("export", "cli-model", str(tmp_path / "x.safetensors"))
    assert r.returncode == 0 and (tmp_path / "x.safetensors").exists()
    assert run("gc").returncode == 0
    # A mistyped --repo is reported, and no empty repository appears there.
    missing = tmp_path / "no-repo"
    r = subprocess.run([sys.executable, "-m", "tierstore.cli", "models", "--repo", str(missing), "ls"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "is not a tierstore model repository" in r.stderr
    assert not missing.exists()
