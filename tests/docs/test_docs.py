"""The Python code blocks of README.md and of every page under docs/ run as tests, so that the examples
cannot rot.

The convention (docs/design/testing.md): a block fenced as ```python with nothing after the language runs;
a block with anything after it (```python title="needs an S3 store") shows on the site but does not run,
and is only checked to be valid Python. ```sh, ```toml and ```text blocks never run.

Each running block runs in a fresh Python process of its own, in an empty temporary directory, with every
TIERSTORE_* variable removed, XDG_CACHE_HOME and XDG_RUNTIME_DIR inside that directory (the block's cache and
node agent are its own), and this Python's scripts first on PATH (`tierstore` is the one under test). An
agent the block started is stopped when it ends.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest


def _root() -> Path:
    """The repository: the first directory holding mkdocs.yml above this file, else above the cwd."""
    for start in (Path(__file__).resolve().parent, Path.cwd().resolve()):
        for d in (start, *start.parents):
            if (d / "mkdocs.yml").is_file() and (d / "docs").is_dir():
                return d
    raise RuntimeError("cannot find the repository (a directory with mkdocs.yml and docs/)")


ROOT = _root()
DOCS = ROOT / "docs"
FENCE = re.compile(r"^(?P<indent>\s*)(?P<ticks>`{3,})(?P<lang>[\w+-]*)(?P<rest>.*)$")
TIMEOUT_S = 300


@dataclass
class Block:
    page: str
    line: int
    lang: str
    rest: str
    code: str

    @property
    def runs(self) -> bool:
        return self.lang == "python" and not self.rest.strip()

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, with the line each opens on."""
    out: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks = m["indent"], m["ticks"]
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not (
            lines[j].strip().startswith(ticks) and lines[j].strip().strip("`") == ""
        ):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        if j == len(lines):
            raise AssertionError(f"{path.relative_to(ROOT)}:{i + 1}: a code block is never closed")
        out.append(Block(str(path.relative_to(ROOT)), i + 1, m["lang"], m["rest"], "\n".join(body) + "\n"))
        i = j + 1
    return out


PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
ALL = [b for page in PAGES for b in blocks(page)]
RUNNING = [b for b in ALL if b.runs]
SHOWN = [b for b in ALL if b.lang == "python" and not b.runs]


def _marks(block: Block, registered: set[str]) -> list[pytest.MarkDecorator]:
    """The markers of what a block needs, where the suite registers them."""
    wanted = []
    if "tierstore.testing.s3server" in block.code:
        wanted.append("s3")
    if "tierstore.testing.gcsserver" in block.code:
        wanted.append("gcs")
    if "tierstore.testing.webdavserver" in block.code:
        wanted.append("webdav")
    if "tierstore.slowfs" in block.code or "tierstore.testing.slowfs" in block.code:
        wanted.append("fuse")
    return [getattr(pytest.mark, name) for name in wanted if name in registered]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "block" in metafunc.fixturenames:
        registered = {line.split(":")[0].split("(")[0].strip() for line in metafunc.config.getini("markers")}
        chosen = RUNNING if metafunc.function.__name__ == "test_block_runs" else SHOWN
        metafunc.parametrize("block", [pytest.param(b, id=b.id, marks=_marks(b, registered)) for b in chosen])


def test_the_pages_have_running_examples() -> None:
    assert RUNNING, f"no running ```python block under {DOCS}"
    guides = {b.page for b in RUNNING if b.page.startswith("docs/guide/")}
    every = {str(p.relative_to(ROOT)) for p in (DOCS / "guide").glob("*.md")}
    assert guides == every, f"guide pages without a running example: {sorted(every - guides)}"


def _environment(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERSTORE_")}
    runtime = tmp / "run"
    runtime.mkdir(mode=0o700)
    env["XDG_RUNTIME_DIR"] = str(runtime)
    env["XDG_CACHE_HOME"] = str(tmp / "cache")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _stop_agent(env: dict[str, str]) -> None:
    socket = Path(env["XDG_RUNTIME_DIR"]) / "tierstore" / "agent.sock"
    if not socket.exists():
        return
    tierstore = shutil.which("tierstore", path=env["PATH"])
    if tierstore is not None:
        subprocess.run(
            [tierstore, "agent", "stop", "--socket", str(socket)], env=env, capture_output=True, timeout=60
        )


def test_block_runs(block: Block, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    script = tmp_path / "block.py"
    script.write_text(block.code)
    env = _environment(tmp_path)
    try:
        done = subprocess.run(
            [sys.executable, str(script)],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    finally:
        _stop_agent(env)
    assert done.returncode == 0, (
        f"{block.id}: the example failed (exit status {done.returncode})\n"
        f"--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"
    )


def test_shown_block_is_python(block: Block) -> None:
    try:
        ast.parse(block.code)
    except SyntaxError as e:
        pytest.fail(f"{block.id}: a ```python block that does not run is not valid Python either: {e}")
