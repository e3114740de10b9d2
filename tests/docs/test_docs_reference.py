"""The reference pages are checked against the code, so that they cannot drift:

- docs/reference/configuration.md names every TOML key (the key lists of the Rust configuration: TOP_KEYS,
  STREAM_KEYS, S3_KEYS, and the `KEYS` of the tiers, cluster and write-back modules) in the table of its
  section, and every TIERSTORE_* and SLURM_* variable the Rust and Python sources read in its table of
  variables; and names nothing the code no longer accepts or reads;
- docs/reference/cli.md has a section for every command of `tierstore` naming each of its options;
- every test the documentation names (`test_...`) exists under tests/.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import click
import pytest


def _root() -> Path:
    """The repository: the first directory holding mkdocs.yml above this file, else above the cwd."""
    for start in (Path(__file__).resolve().parent, Path.cwd().resolve()):
        for d in (start, *start.parents):
            if (d / "mkdocs.yml").is_file() and (d / "crates").is_dir():
                return d
    raise RuntimeError("cannot find the repository (a directory with mkdocs.yml and crates/)")


ROOT = _root()
CONFIGURATION = ROOT / "docs" / "reference" / "configuration.md"
CLI = ROOT / "docs" / "reference" / "cli.md"


# The sources -------------------------------------------------------------------------------------------


def _rust_sources() -> dict[Path, str]:
    """Every Rust source of the crates, without its `#[cfg(test)]` part (tests spell typos on purpose)."""
    out = {}
    for p in sorted((ROOT / "crates").rglob("*.rs")):
        rel = p.relative_to(ROOT).parts
        if "tests" in rel or "benches" in rel or "target" in rel:
            continue
        text = p.read_text()
        cut = text.find("#[cfg(test)]")
        out[p] = text if cut < 0 else text[:cut]
    return out


def _python_sources() -> dict[Path, str]:
    return {p: p.read_text() for p in sorted((ROOT / "python" / "tierstore").rglob("*.py"))}


KEY_LISTS = re.compile(r"const\s+(?P<name>[A-Z0-9_]*KEYS)\s*:\s*&\[&str\]\s*=\s*&\[(?P<items>.*?)\];", re.S)

# Each key list of the code, and the section of configuration.md whose table documents it.
SECTIONS = {
    "TOP_KEYS": "Top-level keys",
    "TIER_KEYS": "[[tiers]]",
    "CLUSTER_KEYS": "[cluster]",
    "S3_KEYS": "[s3]",
    "WRITEBACK_KEYS": "[[writeback]]",
    "STREAM_KEYS": "[stream]",
}


# A section's own module may call its list plain `KEYS` (config/tiers.rs, cluster/config.rs,
# writeback/config.rs): the module's path says which section it is.
MODULE_LISTS = {
    "tiers": "TIER_KEYS",
    "cluster": "CLUSTER_KEYS",
    "writeback": "WRITEBACK_KEYS",
    "s3": "S3_KEYS",
    "stream": "STREAM_KEYS",
}


def code_keys() -> dict[str, set[str]]:
    """The TOML keys the configuration accepts, by list (see SECTIONS)."""
    found: dict[str, set[str]] = {}
    for path, text in _rust_sources().items():
        for m in KEY_LISTS.finditer(text):
            name = m["name"]
            if name == "KEYS":
                parts = path.relative_to(ROOT / "crates").with_suffix("").parts
                name = next((MODULE_LISTS[p] for p in reversed(parts) if p in MODULE_LISTS), name)
            if name in SECTIONS:
                found.setdefault(name, set()).update(re.findall(r'"([^"]+)"', m["items"]))
    return found


VARIABLE = re.compile(r"""["']((?:TIERSTORE|SLURM)_[A-Z0-9_]*[A-Z0-9])["']""")


def code_variables() -> dict[str, list[str]]:
    """Every TIERSTORE_* and SLURM_* variable named as a whole string literal in the sources: read with
    std::env, listed in ENV_VARS, passed to a child's environment, or a click `envvar`."""
    seen: dict[str, list[str]] = {}
    for path, text in {**_rust_sources(), **_python_sources()}.items():
        for name in VARIABLE.findall(text):
            seen.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return seen


# The pages ---------------------------------------------------------------------------------------------


def sections(page: Path) -> dict[str, str]:
    """`## ` and `### ` headings of a page (backticks and `{ #anchor }` removed) to the text under them."""
    out: dict[str, str] = {}
    title = ""
    lines: list[str] = []
    for line in page.read_text().splitlines():
        m = re.match(r"^#{2,3}\s+(.*?)\s*(\{[^}]*\})?\s*$", line)
        if m:
            out[title] = "\n".join(lines)
            title, lines = m[1].replace("`", "").strip(), []
        else:
            lines.append(line)
    out[title] = "\n".join(lines)
    return out


def first_cells(text: str) -> set[str]:
    """The backticked names in the first cell of each table row."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("| ---"):
            names.update(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return names


# Configuration -----------------------------------------------------------------------------------------


def test_every_key_list_of_the_code_was_found() -> None:
    missing = set(SECTIONS) - set(code_keys())
    assert not missing, (
        f"no key list {sorted(missing)} in crates/: the configuration's key lists moved or were renamed; "
        "point SECTIONS of this test at them"
    )


@pytest.mark.parametrize("listname", sorted(SECTIONS))
def test_configuration_documents_every_key(listname: str) -> None:
    keys = code_keys().get(listname, set())
    page = sections(CONFIGURATION)
    title = SECTIONS[listname]
    assert title in page, f"{CONFIGURATION.relative_to(ROOT)} has no section '{title}'"
    documented = first_cells(page[title])
    assert not keys - documented, (
        f"{CONFIGURATION.relative_to(ROOT)}, section '{title}': keys the code accepts and the page does not "
        f"document: {sorted(keys - documented)}"
    )
    assert not documented - keys, (
        f"{CONFIGURATION.relative_to(ROOT)}, section '{title}': documented keys the code does not accept: "
        f"{sorted(documented - keys)}"
    )


def test_configuration_documents_every_variable() -> None:
    read = code_variables()
    assert "TIERSTORE_SOURCE" in read, "the scan of the sources found no TIERSTORE_ variable"
    documented = {n for n in first_cells(sections(CONFIGURATION)["Environment variables"]) if "_" in n}
    missing = {n: read[n][:3] for n in sorted(set(read) - documented)}
    assert not missing, f"variables the code reads and configuration.md does not document: {missing}"
    stale = documented - set(read)
    assert not stale, f"configuration.md documents variables no source reads: {sorted(stale)}"


# Command line ------------------------------------------------------------------------------------------


def tierstore_command() -> click.Command:
    scripts = importlib.metadata.entry_points(group="console_scripts")
    (ep,) = [e for e in scripts if e.name == "tierstore"]
    command = ep.load()
    assert isinstance(command, click.Command), f"the tierstore script {ep.value} is not a click command"
    return command


def commands() -> list[tuple[str, click.Command]]:
    """Every command of `tierstore`, groups included, as (its path, the command)."""
    out: list[tuple[str, click.Command]] = []

    def walk(cmd: click.Command, path: str) -> None:
        out.append((path, cmd))
        if isinstance(cmd, click.Group):
            for name, sub in sorted(cmd.commands.items()):
                walk(sub, f"{path} {name}")

    walk(tierstore_command(), "tierstore")
    return out


def test_cli_documents_every_command_and_option() -> None:
    page = sections(CLI)
    problems = []
    for path, cmd in commands():
        if path not in page:
            problems.append(f"no section '{path}'")
            continue
        for param in cmd.params:
            if not isinstance(param, click.Option):
                continue
            for opt in (*param.opts, *param.secondary_opts):
                if not re.search(r"`" + re.escape(opt) + r"(?![\w-])", page[path]):
                    problems.append(f"section '{path}' does not name {opt}")
    main = tierstore_command()
    ctx = click.Context(main)
    for opt in ctx.help_option_names:
        if not re.search(r"`" + re.escape(opt) + r"(?![\w-])", page.get("tierstore", "")):
            problems.append(f"section 'tierstore' does not name {opt}")
    assert not problems, f"{CLI.relative_to(ROOT)}: " + "; ".join(problems)


def test_cli_documents_no_command_that_does_not_exist() -> None:
    known = {path for path, _ in commands()}
    documented = {t for t in sections(CLI) if t == "tierstore" or t.startswith("tierstore ")}
    assert not documented - known, (
        f"{CLI.relative_to(ROOT)} documents commands that do not exist: {sorted(documented - known)}"
    )


# Tests the documentation names --------------------------------------------------------------------------


def test_every_test_the_documentation_names_exists() -> None:
    defined = set()
    for p in (ROOT / "tests").rglob("*.py"):
        defined.update(re.findall(r"^\s*(?:async\s+)?def (test_\w+)", p.read_text(), re.M))
    named: dict[str, str] = {}
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for name in re.findall(r"`(test_\w+)`", page.read_text()):
            named.setdefault(name, str(page.relative_to(ROOT)))
    assert named, "the documentation names no test"
    missing = {n: p for n, p in named.items() if n not in defined}
    assert not missing, f"tests the documentation names that no longer exist: {missing}"
