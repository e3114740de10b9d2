"""The code map (docs/design/code-map.md) and the architecture's layout (docs/design/architecture.md) are
checked against the tree, so that a move that forgets them fails here: every file either page names exists,
and every Rust source and every Python module lies in a file or a directory the code map names."""

from __future__ import annotations

import re

from tests.docs.test_docs_reference import ROOT

CODE_MAP = ROOT / "docs" / "design" / "code-map.md"
ARCHITECTURE = ROOT / "docs" / "design" / "architecture.md"

# Where the paths of each section of the code map are relative to.
SECTION_BASES = {
    "Rust: `crates/tierstore-core`": "crates/tierstore-core/",
    "Rust: the other crates": "",
    "Python: `python/tierstore`": "python/tierstore/",
}
# How a full path of each section starts; any other name in a cell is beside the cell's first path.
FULL = {"crates/tierstore-core/": "src/", "": "crates/", "python/tierstore/": ""}

NAME = re.compile(r"`([\w./{},-]+(?:\.rs|\.py|/))`")


def expand(name: str) -> list[str]:
    """`a/{b,c}.rs` as `a/b.rs` and `a/c.rs`."""
    m = re.search(r"\{([^}]*)\}", name)
    if m is None:
        return [name]
    return [x for part in m[1].split(",") for x in expand(name[: m.start()] + part + name[m.end() :])]


def code_map_names() -> set[str]:
    """Every file and directory the code map's tables name, relative to the repository. A bare name in a
    cell (`options.rs`) is beside the cell's first full path; names in a Python row's concept column
    (`repository.py` of `models/`) are in the file column's directory."""
    names: set[str] = set()
    base: str | None = None
    for line in CODE_MAP.read_text().splitlines():
        if line.startswith("## "):
            base = next((b for title, b in SECTION_BASES.items() if line[3:].startswith(title)), None)
            continue
        if (
            base is None
            or not line.startswith("| ")
            or line.startswith("| ---")
            or line.startswith("| concept")
        ):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        concept, where = " | ".join(cells[:-1]), cells[-1]
        found = [n for m in NAME.findall(where) for n in expand(m)]
        if not found:
            continue
        first = base + found[0]
        beside = first if first.endswith("/") else first.rsplit("/", 1)[0] + "/"
        for n in found:
            names.add(base + n if n.startswith(FULL[base]) else beside + n)
        for m in NAME.findall(concept) if base == "python/tierstore/" else []:
            for n in expand(m):
                if not n.startswith("src/") and n.endswith((".rs", ".py")) and "/" not in n:
                    names.add(beside + n)
    return names


def test_every_file_the_code_map_names_exists() -> None:
    names = code_map_names()
    assert len(names) > 80, sorted(names)  # the parser found the tables
    missing = sorted(n for n in names if not (ROOT / n).exists())
    assert not missing, f"docs/design/code-map.md names files that are not in the tree: {missing}"


def test_every_source_file_is_on_the_code_map() -> None:
    names = code_map_names()
    dirs = tuple(n for n in names if n.endswith("/"))
    sources = [p for p in (ROOT / "crates").glob("*/src/**/*.rs")]
    sources += [p for p in (ROOT / "python" / "tierstore").rglob("*.py") if "__pycache__" not in p.parts]
    unmapped = sorted(
        rel
        for rel in (str(p.relative_to(ROOT)) for p in sources)
        if rel not in names and not rel.startswith(dirs) and not rel.endswith("/__init__.py")
    )
    assert not unmapped, f"these files are on no line of docs/design/code-map.md; add them: {unmapped}"


def test_the_architectures_layout_names_the_cores_files() -> None:
    """The layout block of architecture.md lists tierstore-core's sources; each it names exists and each
    source is named (directly, or as a directory such as `index/`)."""
    text = ARCHITECTURE.read_text()
    start = text.index("  tierstore-core/src/")
    block = text[start : text.index("  tierstore-agent/src/", start)]
    core = ROOT / "crates" / "tierstore-core" / "src"
    named: set[str] = set()
    for line in block.splitlines()[1:]:
        files = line.strip().split("  ")[0]  # the names, before the comment column
        for token in re.findall(r"[\w/]+(?:\{[\w,]+\})?(?:\.rs|/)", files):
            named.update(expand(token))
    assert len(named) > 30, sorted(named)
    missing = sorted(n for n in named if not (core / n).exists())
    assert not missing, f"architecture.md's layout names files tierstore-core does not have: {missing}"
    dirs = tuple(n for n in named if n.endswith("/"))
    unnamed = sorted(
        rel
        for rel in (str(p.relative_to(core)) for p in core.rglob("*.rs"))
        if rel not in named and not rel.startswith(dirs)
    )
    assert not unnamed, f"architecture.md's layout misses these sources of tierstore-core: {unnamed}"
