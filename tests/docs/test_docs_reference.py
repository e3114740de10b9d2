"""The reference pages are checked against the code, so that they cannot drift:

- docs/reference/configuration.md names every TOML key of the settings table
  (crates/tierstore-core/src/config/settings.rs, through `_core.SETTINGS`) in the table of its section, with
  the table's default and choices, and every TIERSTORE_* and SLURM_* variable the Rust and Python sources
  read in its table of variables, and every AWS_* variable they name in its section "AWS variables"; and
  names nothing the code no longer accepts or reads;
- every variable the code reads is declared in the settings table; `tierstore.Cache`'s keywords and the
  options of `tierstore` are the table's;
- docs/reference/cli.md has a section for every command of `tierstore` with a row for each of its options
  that agrees with --help and the code on the value it takes and its default (see
  test_cli_reference_agrees_with_the_help); every command answers --help, `tierstore-agent` too;
- every test the documentation names (`test_...`) exists under tests/.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

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


# Each table of the settings table (crates/tierstore-core/src/config/settings.rs, read through
# `_core.SETTINGS`), and the section of configuration.md whose table documents its keys.
SECTIONS = {
    "": "Top-level keys",
    "tiers": "[[tiers]]",
    "cluster": "[cluster]",
    "object_store": "[object_store]",
    "s3": "[s3]",
    "writeback": "[[writeback]]",
    "stream": "[stream]",
}


def settings() -> tuple[dict[str, Any], ...]:
    from tierstore import _core

    return _core.SETTINGS


def code_keys() -> dict[str, set[str]]:
    """The TOML keys the configuration accepts, by table (see SECTIONS). `[s3]` takes its short names and
    every key of `[object_store]`."""
    found: dict[str, set[str]] = {}
    for s in settings():
        if s["table"] == "" and s["env"] == s["key"]:
            continue  # only the environment sets it
        found.setdefault(s["table"], set()).add(s["key"])
    found["s3"] |= found["object_store"]
    return found


def documented_default(s: dict[str, Any]) -> str:
    """A setting's default as the reference writes it: a number or a boolean bare, anything else quoted."""
    if s["type"] in ("count", "bool"):
        return f"`{s['default']}`"
    return f'`"{s["default"]}"`'


def rows(text: str) -> dict[str, list[str]]:
    """The rows of the tables in `text`, by each name backticked in the first cell, as their cells."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("| ---"):
            cells = [c.strip() for c in line.split("|")[1:-1]]
            for name in re.findall(r"`([^`]+)`", cells[0]):
                out[name] = cells
    return out


VARIABLE = re.compile(r"""["']((?:TIERSTORE|SLURM)_[A-Z0-9_]*[A-Z0-9])["']""")


def code_variables() -> dict[str, list[str]]:
    """Every TIERSTORE_* and SLURM_* variable named as a whole string literal in the sources: read with
    std::env, declared in the settings table, passed to a child's environment, or a click `envvar`."""
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


def test_every_table_of_the_settings_has_keys() -> None:
    missing = set(SECTIONS) - set(code_keys())
    assert not missing, (
        f"no setting of the tables {sorted(missing)} in _core.SETTINGS: the settings table lost a table, or "
        "SECTIONS of this test names one it no longer has"
    )


@pytest.mark.parametrize("table", sorted(SECTIONS))
def test_configuration_documents_every_key(table: str) -> None:
    keys = code_keys().get(table, set())
    page = sections(CONFIGURATION)
    title = SECTIONS[table]
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


def test_configuration_gives_the_default_and_the_choices_the_settings_table_gives() -> None:
    """Each default the table gives as a value is the one the reference's row shows, and each choice of a
    setting that takes a few words is in its type cell. A variable only the environment sets is checked in
    the table of variables."""
    page = sections(CONFIGURATION)
    wrong = []
    for s in settings():
        only_env = s["table"] == "" and s["env"] == s["key"]
        titles = ["Environment variables"] if only_env else [SECTIONS[s["table"]]]
        if s["table"] == "object_store":
            titles.append("[s3]")
        for title in titles:
            row = rows(page[title]).get(s["key"])
            if row is None:
                wrong.append(f"{title}: no row for {s['key']}")
                continue
            kind, default = row[1], row[2]
            if s["default"] is not None and documented_default(s).strip('`"') not in default:
                wrong.append(
                    f"{title}: {s['key']}'s default is {documented_default(s)}, the page says {default}"
                )
            for word in s["choices"] or ():
                if f"`{word}`" not in kind and f'`"{word}"`' not in kind and not only_env:
                    wrong.append(f"{title}: {s['key']} takes {word!r}, its type cell says {kind}")
    reference = CONFIGURATION.relative_to(ROOT)
    assert not wrong, f"{reference} disagrees with the settings table:\n" + "\n".join(wrong)


def test_each_variable_row_names_the_key_it_sets() -> None:
    variables = rows(sections(CONFIGURATION)["Environment variables"])
    wrong = []
    for s in settings():
        if not s["env"] or s["key"] == s["env"]:
            continue
        row = variables.get(s["env"])
        if row is None:
            wrong.append(f"{s['env']}: no row")
            continue
        if s["table"]:
            names = {f"`[{s['table']}] {s['key']}`"}
        else:  # a key at the top of the file, or a table of it (`[object_store]`, `[[writeback]]`)
            names = {f"`{s['key']}`", f"`[{s['key']}]`", f"`[[{s['key']}]]`"}
        if not any(n in row[3] for n in names):
            wrong.append(f"{s['env']} sets {s['name']}, its row says {row[3]!r}")
    assert not wrong, "configuration.md's variables:\n" + "\n".join(wrong)


# Variables the code names that are not settings: the job's resolved source (set by `tierstore run`), Slurm's
# and the test suite's tools.
NOT_SETTINGS = {"TIERSTORE_RESOLVED_SOURCE_OF", "TIERSTORE_RESOLVED_SOURCE", "SLURM_JOB_NODELIST", "SLURM_JOB_ID",
                "TIERSTORE_WEED"}  # fmt: skip


def test_every_variable_the_code_reads_is_a_setting() -> None:
    declared = {s["env"] for s in settings() if s["env"]}
    read = {n for n in code_variables() if not n.startswith("TIERSTORE_TEST_")}
    undeclared = read - declared - NOT_SETTINGS
    assert not undeclared, (
        f"variables the code reads that crates/tierstore-core/src/config/settings.rs does not declare: "
        f"{sorted(undeclared)}; add each to SETTINGS (a variable that is not, fails the configuration as a typo)"
    )


def test_the_keywords_of_cache_are_the_settings_arguments() -> None:
    import inspect

    import tierstore

    params = inspect.signature(tierstore.Cache.__init__).parameters
    keywords = {n for n in params if n not in ("self", "start_agent")}
    arguments = {s["argument"] for s in settings() if s["argument"]}
    assert keywords == arguments, (
        f"Cache's keywords {sorted(keywords ^ arguments)} are not (or not only) the settings table's arguments"
    )
    # None leaves the file's and the environment's value in place: any other default would hide them.
    assert all(params[n].default is None for n in keywords), {n: params[n].default for n in keywords}
    doc = tierstore.Cache.__doc__ or ""
    assert all(f"\n        {n}: " in doc for n in keywords), "Cache's docstring misses an argument"


def test_the_options_of_tierstore_are_the_settings_flags() -> None:
    command = tierstore_command()
    flags = {o for p in command.params for o in p.opts}
    missing = {s["flag"] for s in settings() if s["flag"]} - flags
    assert not missing, f"flags the settings table gives that `tierstore` does not take: {sorted(missing)}"
    (policy,) = [p for p in command.params if "--policy" in p.opts]
    (setting,) = [s for s in settings() if s["name"] == "policy"]
    assert isinstance(policy.type, click.Choice) and list(policy.type.choices) == list(setting["choices"])


def test_configuration_documents_every_variable() -> None:
    read = code_variables()
    assert "TIERSTORE_SOURCE" in read, "the scan of the sources found no TIERSTORE_ variable"
    documented = {n for n in first_cells(sections(CONFIGURATION)["Environment variables"]) if "_" in n}
    missing = {n: read[n][:3] for n in sorted(set(read) - documented)}
    assert not missing, f"variables the code reads and configuration.md does not document: {missing}"
    stale = documented - set(read)
    assert not stale, f"configuration.md documents variables no source reads: {sorted(stale)}"


AWS_VARIABLE = re.compile(r"""["'](AWS_[A-Z0-9_]*[A-Z0-9])["']""")

# AWS variables the S3 client (the object_store crate's AmazonS3Builder::from_env, which takes every AWS_*
# variable naming one of its settings) reads that no source of ours names.
CLIENT_READS = {"AWS_SESSION_TOKEN"}


def code_aws_variables() -> dict[str, list[str]]:
    """Every AWS_* variable named as a whole string literal in the Rust and Python sources."""
    seen: dict[str, list[str]] = {}
    for path, text in {**_rust_sources(), **_python_sources()}.items():
        for name in AWS_VARIABLE.findall(text):
            seen.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return seen


def test_configuration_documents_every_aws_variable() -> None:
    read = code_aws_variables()
    assert {"AWS_PROFILE", "AWS_CONFIG_FILE"} <= set(read), "the scan of the sources found no AWS_ variable"
    page = sections(CONFIGURATION)
    assert "AWS variables" in page, f"{CONFIGURATION.relative_to(ROOT)} has no section 'AWS variables'"
    documented = {n for n in first_cells(page["AWS variables"]) if n.startswith("AWS_")}
    missing = {n: read[n][:3] for n in sorted(set(read) - documented)}
    assert not missing, f"AWS variables the code reads and configuration.md does not document: {missing}"
    stale = documented - set(read) - CLIENT_READS
    assert not stale, f"configuration.md documents AWS variables nothing reads: {sorted(stale)}"


# Command line ------------------------------------------------------------------------------------------


def tierstore_command() -> click.Command:
    scripts = importlib.metadata.entry_points(group="console_scripts")
    (ep,) = [e for e in scripts if e.name == "tierstore"]
    command = ep.load()
    assert isinstance(command, click.Command), f"the tierstore script {ep.value} is not a click command"
    return command


def commands() -> list[tuple[str, click.Command]]:
    """Every command of `tierstore`, groups included, as (its path, the command)."""
    return [(path, cmd) for path, cmd, _ in _contexts()]


def _contexts() -> list[tuple[str, click.Command, click.Context]]:
    """Every command of `tierstore` with the context --help renders it in (its parents' included)."""
    out: list[tuple[str, click.Command, click.Context]] = []

    def walk(cmd: click.Command, path: str, parent: click.Context | None) -> None:
        ctx = click.Context(cmd, info_name=path.split()[-1], parent=parent, **cmd.context_settings)
        out.append((path, cmd, ctx))
        if isinstance(cmd, click.Group):
            # Through click's own lookup, as --help finds them: the root imports a command's module only
            # when the command is asked for, so its `commands` holds only those asked for so far.
            for name in sorted(cmd.list_commands(ctx)):
                sub = cmd.get_command(ctx, name)
                assert sub is not None, f"{path} lists {name} and does not find it"
                walk(sub, f"{path} {name}", ctx)

    walk(tierstore_command(), "tierstore", None)
    return out


def table_cells(line: str) -> list[str]:
    """The cells of a table row. As Python-Markdown reads a row (mkdocs' `tables`), a `|` inside backticks
    is text, not a cell's end: `--policy [fill|lru]` needs no escape (and `\\|` there shows the backslash)."""
    cells, cell, code = [], "", False
    for i, ch in enumerate(line):
        if ch == "`":
            code = not code
        if ch == "|" and not code and (i == 0 or line[i - 1] != "\\"):
            cells.append(cell)
            cell = ""
        else:
            cell += ch
    return cells[1:]


class Row:
    """A row of an options table of cli.md: the options its first cell names, with the value each is shown
    taking (`--jobs N`: N; None for a flag), and the meaning cell."""

    def __init__(self, line: str) -> None:
        cells = [c.strip() for c in table_cells(line)]
        self.line = line
        self.values: dict[str, str | None] = {}
        for token in re.findall(r"`([^`]+)`", cells[0]):
            m = re.fullmatch(r"(--?[\w-]+)(?:\s+(.+))?", token.strip())
            if m:
                self.values[m[1]] = m[2]
        self.meaning = cells[1] if len(cells) > 1 else ""


def option_rows(text: str) -> list[Row]:
    return [
        Row(line)
        for line in text.splitlines()
        if line.startswith("|") and not line.startswith("| ---") and re.search(r"^\|\s*`-", line)
    ]


def default_clause(text: str) -> str | None:
    """What a help text or a cell of the page says the default is: click's `[default: X]`, else the words
    after "default" up to the closing parenthesis or semicolon; None when it says nothing of a default."""
    m = re.search(r"\[default:\s*([^\]]*)\]", text)
    if m:
        return m[1]
    m = re.search(r"\bdefault\b:?\s*([^);]*)", text, re.I)
    return m[1] if m else None


def values_of(clause: str, words: frozenset[str] = frozenset()) -> set[str]:
    """The values a default clause names, without its wording: numbers and sizes (`32`, `0.5`, `60s`,
    `2G`), paths, variables (`$TIERSTORE_CONFIG`, `TIERSTORE_STREAM_KEEP`), configuration keys
    (`[cluster] node`), options (`--progress`) and `words`, the values the option's metavar lists
    (`always` of `always|never|DURATION`). "the host name" and "the host's name" agree; `60s` and `30s`
    do not."""
    text = clause.replace("`", "")
    found = set()
    for token in re.findall(r"\[\w+\]\s+\w+|[^\s,;()]+", text):
        token = token.rstrip(".:").removeprefix("$")
        if (
            token.startswith(("[", "--"))
            or "/" in token
            or re.search(r"\d", token)
            or re.fullmatch(r"[A-Z][A-Z0-9_]{2,}", token)
            or token in words
        ):
            found.add(token)
    return found


def _given(default: object) -> bool:
    """Whether an option's `default` is a value (not None, a callable, or click 8.2+'s UNSET sentinel)."""
    return not (default is None or callable(default) or getattr(default, "name", None) == "UNSET")


def click_default(param: click.Option, help_text: str, words: frozenset[str]) -> tuple[set[str] | None, bool]:
    """The default of an option as the code and --help give it, as `values_of` names it, and whether it is
    the code's own value (`param.default`) rather than words of the help (a default that the configuration
    or the agent decides)."""
    if param.is_flag and param.secondary_opts and _given(param.default):
        return {param.opts[0] if param.default else param.secondary_opts[0]}, True
    if (param.is_flag and not param.secondary_opts) or param.count:
        return None, False
    if _given(param.default):
        given = param.default if isinstance(param.default, (list, tuple)) else [param.default]
        return values_of(" ".join(str(v) for v in given), words), True
    clause = default_clause(help_text)
    return (None if clause is None else values_of(clause, words)), False


def cli_problems() -> list[str]:
    """Where cli.md and the command line disagree: see test_cli_reference_agrees_with_the_help."""
    page = sections(CLI)
    problems = []
    for path, cmd, ctx in _contexts():
        if path not in page:
            problems.append(f"no section '{path}'")
            continue
        rows = option_rows(page[path])
        options = [p for p in cmd.params if isinstance(p, click.Option)]
        known = {o for p in options for o in (*p.opts, *p.secondary_opts)} | set(ctx.help_option_names)
        for row in rows:
            for opt in set(row.values) - known:
                problems.append(f"'{path}' documents {opt}, which it does not take")
        for param in options:
            names = [*param.opts, *param.secondary_opts]
            record = param.get_help_record(ctx)
            assert record is not None, f"{path}: {names} is hidden from --help"
            shown, help_text = record
            matching = [r for r in rows if set(names) & set(r.values)]
            if not matching:
                problems.append(f"'{path}' has no row for {' / '.join(names)}")
                continue
            row = matching[0]
            who = f"'{path}' {param.opts[-1]}"
            if missing := [n for n in names if n not in row.values]:
                problems.append(f"{who}: the row does not name {', '.join(missing)}")
            # The value the option takes, as --help shows it (its metavar; a Choice's choices).
            metavars = {part.split(" ", 1)[1] for part in re.split(r", | / ", shown) if " " in part}
            expected = metavars.pop() if metavars else None
            stated = {v for v in row.values.values() if v is not None}
            if expected is None and stated:
                problems.append(f"{who} is a flag, the page shows it taking {sorted(stated)}")
            elif expected is not None and stated != {expected}:
                problems.append(
                    f"{who}: --help shows {names[-1]} {expected}, the page {sorted(stated) or 'no value'}"
                )
            if isinstance(param.type, click.Choice):
                for choice in param.type.choices:
                    if str(choice) not in row.line:
                        problems.append(f"{who}: the page does not list the choice {choice!r}")
            # The default, where the page states one (a row "As for `agent run`" defers to that row).
            if row.meaning.startswith("As for"):
                continue
            words = frozenset(w for w in re.split(r"[\[\]|]", expected or "") if w)
            code, concrete = click_default(param, help_text, words)
            clause = default_clause(row.meaning)
            if clause is None:
                if concrete and code:
                    problems.append(f"{who}: the page states no default; the code's is {sorted(code)}")
                continue
            page_values = values_of(clause, words)
            if code is None:
                problems.append(f"{who}: the page states a default ({clause.strip()}), --help states none")
            elif page_values != code:
                problems.append(
                    f"{who}: the page's default is {sorted(page_values) or repr(clause.strip())}, "
                    f"--help's {sorted(code) or repr(default_clause(help_text))}"
                )
            if concrete and not (param.is_flag or param.count):
                # The help's own words about the default must agree with the code's value too.
                said = default_clause(help_text)
                if said is not None and values_of(said, words) != code:
                    problems.append(
                        f"{who}: --help says the default is {said!r}, the code's is {param.default!r}"
                    )
        # The arguments, as --help's usage line shows them, in the section's usage line.
        for param in cmd.params:
            if isinstance(param, click.Argument):
                metavar = param.make_metavar(ctx)
                if not re.search(r"```text\n[^`]*" + re.escape(metavar) + r"(?!\S)", page[path]):
                    problems.append(f"'{path}': its usage line does not show the argument {metavar}")
    for title, text in page.items():
        for span in [c for c in re.findall(r"`[^`\n]*`", text) if "\\|" in c]:
            problems.append(f"'{title}': {span} shows its backslash: a | inside backticks needs no escape")
    for opt in click.Context(tierstore_command()).help_option_names:
        if opt not in {o for r in option_rows(page.get("tierstore", "")) for o in r.values}:
            problems.append(f"section 'tierstore' does not name {opt}")
    return problems


def test_cli_reference_agrees_with_the_help() -> None:
    """cli.md has a section for every command and subcommand of `tierstore` with a row for each of its
    options naming every spelling (`-j`, `--jobs`; `--progress` / `--no-progress`), showing the value it
    takes as --help does (its metavar, a Choice's choices; none for a flag), and, where the row states a
    default, the default of the code (`param.default`) or, where the code leaves it to the configuration
    or the agent, the one --help states. Defaults are compared by the values they name (numbers, sizes,
    paths, variables, configuration keys, options), not their wording. A row naming an option the command
    does not take, and a usage line without the command's arguments, are errors too."""
    problems = cli_problems()
    assert not problems, f"{CLI.relative_to(ROOT)} disagrees with the command line:\n  " + "\n  ".join(
        problems
    )


def test_the_reference_check_sees_a_wrong_default_and_metavar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above fails on the disagreements of issue #37: `--revalidate [always|never]` and a stale
    default."""
    text = CLI.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `--revalidate"))
    stale = "| `--revalidate [always|never]` | Overrides `revalidate` for the job (default `always`). |"
    wrong = tmp_path / "cli.md"
    wrong.write_text(text.replace(row, stale))
    monkeypatch.setattr(sys.modules[__name__], "CLI", wrong)
    problems = [p for p in cli_problems() if "--revalidate" in p]
    assert any("--help shows --revalidate always|never|DURATION" in p for p in problems), problems
    assert any("default is ['always'], --help's ['60s']" in p for p in problems), problems


def test_every_command_answers_help() -> None:
    """`--help` and `-h` answer for every command, whatever it requires (`models --repo`): exit 0 and the
    usage, never an error about a missing option."""
    from click.testing import CliRunner

    runner = CliRunner()
    for path, cmd, ctx in _contexts():
        for flag in ("--help", "-h"):
            args = [*path.split()[1:], flag]
            r = runner.invoke(
                tierstore_command(), args, prog_name="tierstore", env={"TIERSTORE_MODELS": None}
            )
            assert r.exit_code == 0, f"{path} {flag}: exit {r.exit_code}\n{r.output}"
            assert r.output.startswith(f"Usage: {usage_line(cmd, ctx)}"), f"{path} {flag}:\n{r.output}"


def test_tierstore_agent_answers_help() -> None:
    """`tierstore-agent --help` (and `-h`, and after a command) prints its usage and exits 0; the usage
    names every option the reference's `tierstore-agent` section shows, and the section every option of
    the usage."""
    from tierstore import agent

    exe = agent.executable()
    documented = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", sections(CLI)["tierstore-agent"]))
    assert {"--peers", "--peer", "--socket"} <= documented
    for args in (["--help"], ["-h"], ["run", "--help"], ["status", "-h"]):
        r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, f"tierstore-agent {' '.join(args)}: exit {r.returncode}: {r.stderr}"
        shown = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", r.stdout))
        assert shown - {"--help"} == documented - {"--help"}, (
            f"tierstore-agent {' '.join(args)} shows {sorted(shown)}, cli.md's section {sorted(documented)}"
        )


def usage_line(cmd: click.Command, ctx: click.Context) -> str:
    """The usage --help prints for a command, without `Usage: `."""
    return " ".join([ctx.command_path, *cmd.collect_usage_pieces(ctx)])


def page_usage(text: str) -> str | None:
    """The first line of a section's first ```text block, its spaces collapsed; None when it has none."""
    m = re.search(r"```text\n([^\n]*)", text)
    return None if m is None else " ".join(m[1].split())


def _stem(word: str) -> str:
    """A word without the ending of a verb's third person or a plural: the page says "Copies files", the
    help "Copy files"."""
    w = word.lower()
    if w.endswith("ies") and len(w) > 4:
        return w[:-3] + "y"
    if w.endswith("es") and w[:-2].endswith(("sh", "ch", "ss", "x")):
        return w[:-2]
    if w.endswith("s") and not w.endswith("ss") and len(w) > 3:
        return w[:-1]
    return w


def first_sentence(text: str) -> list[str]:
    """The first sentence of the first paragraph of prose (not a code block, a table or a heading) of
    `text`, as stemmed words, without what it says in parentheses (where the page may say more than the
    help, and the help name its defaults) and without Markdown; [] when there is no prose."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"\s*\[default: [^\]]*\]", "", text)  # click's show_default
    for para in re.split(r"\n\s*\n", text):
        para = para.replace("\b", "").strip()
        if not para or para.startswith(("|", "#", ":::")):
            continue
        para = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", para).replace("`", "")
        while re.search(r"\([^()]*\)", para):
            para = re.sub(r"\s*\([^()]*\)", "", para)
        sentence = re.split(r"(?<=[.!?])\s", " ".join(para.split()), maxsplit=1)[0]
        return [_stem(w.rstrip(".")) for w in re.findall(r"[\w$.@/-]+", sentence) if w.rstrip(".")]
    return []


def says(page: list[str], helps: list[str]) -> bool:
    """Whether the page's words begin with all of the help's: the page may say more, not less."""
    return page[: len(helps)] == helps


def wording_problems() -> list[str]:
    """Where cli.md and --help say different things: each command's usage line; the first sentence of
    what it does (the page in the third person, "Copies", the help in the imperative, "Copy"), which the
    page's begins with; and each option's row, which begins with what --help says of the option."""
    page = sections(CLI)
    problems = []
    for path, cmd, ctx in _contexts():
        text = page.get(path)
        if text is None:
            continue  # test_cli_reference_agrees_with_the_help says so
        shown, usage = usage_line(cmd, ctx), page_usage(text)
        if usage is None and not isinstance(cmd, click.Group):
            problems.append(f"'{path}' has no usage line; --help's: {shown}")
        elif usage is not None and usage != shown:
            problems.append(f"'{path}': the usage is {usage!r}, --help's {shown!r}")
        said, helps = first_sentence(text), first_sentence(cmd.help or "")
        if not says(said, helps):
            problems.append(f"'{path}' begins {' '.join(said)!r}, --help {' '.join(helps)!r}")
        rows = option_rows(text)
        for param in [p for p in cmd.params if isinstance(p, click.Option)]:
            names = {*param.opts, *param.secondary_opts}
            row = next((r for r in rows if names & set(r.values)), None)
            if row is None or row.meaning.startswith("As for") or not param.help:
                continue
            meaning, helps = first_sentence(row.meaning), first_sentence(param.help)
            if not says(meaning, helps):
                problems.append(
                    f"'{path}' {param.opts[-1]}: the row says {' '.join(meaning)!r}, --help {' '.join(helps)!r}"
                )
    return problems


def test_cli_reference_says_what_the_help_says() -> None:
    """cli.md and --help agree in wording, not only in values (issue #49: `--source` takes URLs, `clear`
    asks first, the agent also migrates and streams, the `models` usage needs --repo): each command's
    usage line is --help's, its first sentence says what --help's says, and each option's row begins with
    what --help says of it."""
    problems = wording_problems()
    assert not problems, f"{CLI.relative_to(ROOT)} and --help say different things:\n  " + "\n  ".join(
        problems
    )


def test_the_wording_check_sees_a_drift(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above fails on the drifts of issue #49, put back into a copy of the page."""
    text = CLI.read_text()
    source = next(x for x in text.splitlines() if x.startswith("| `--source TEXT` |"))
    drifts = [
        (source, "| `--source TEXT` | The source directory to cache. |", "'tierstore' --source"),
        (
            "Removes every cached copy of the source from every tier, asking first on a terminal",
            "Removes every cached copy of the source from every tier",
            "'tierstore clear' begins",
        ),
        ("tierstore models --repo DIRECTORY ls [OPTIONS]", "tierstore models ls [OPTIONS]", "usage"),
    ]
    for i, (right, wrong, named) in enumerate(drifts):
        assert right in text, right
        page = tmp_path / f"cli{i}.md"
        page.write_text(text.replace(right, wrong))
        monkeypatch.setattr(sys.modules[__name__], "CLI", page)
        assert any(named in p for p in wording_problems()), (named, wording_problems())


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


# Python API --------------------------------------------------------------------------------------------

PYTHON_API = ROOT / "docs" / "reference" / "python-api.md"


def directives() -> dict[str, list[str]]:
    """The mkdocstrings directives of python-api.md: each object (`::: tierstore.integrations`) with the
    members its options list ([] when it lists none: every public member)."""
    out: dict[str, list[str]] = {}
    current = None
    listing = False
    for line in PYTHON_API.read_text().splitlines():
        m = re.match(r"^:::\s+(\S+)", line)
        if m:
            current, listing = m[1], False
            out[current] = []
        elif current and re.match(r"^\s+members:\s*$", line):
            listing = True
        elif current and listing and (m := re.match(r"^\s+-\s+(\S+)", line)):
            out[current].append(m[1])
        elif line.strip() and not line.startswith(" "):
            current = None
    return out


def test_the_api_reference_finds_what_it_lists() -> None:
    """Every member the API reference's directives list is found as mkdocstrings finds it: by reading the
    code (griffe), without importing it. A class built at run time (inside a function, or on first access
    of a module's `__getattr__`) is not, and the page leaves it out without a word."""
    griffe = pytest.importorskip("griffe")
    package = griffe.load("tierstore", search_paths=[str(ROOT / "python")], allow_inspection=False)
    listed = directives()
    assert "tierstore.integrations" in listed, (
        f"{PYTHON_API.relative_to(ROOT)} does not render tierstore.integrations"
    )
    assert {"LightningCallback", "TransformersCallback"} <= set(listed["tierstore.integrations"])
    problems = []
    for path, members in listed.items():
        module = package[path.removeprefix("tierstore.")] if path != "tierstore" else package
        for name in members:
            obj = module.members.get(name)
            if obj is None:
                problems.append(f"{path}.{name}: not found in the code")
                continue
            try:
                target = obj.final_target if obj.is_alias else obj
            except Exception as e:  # griffe's AliasResolutionError, CyclicAliasError
                problems.append(f"{path}.{name}: {obj.target_path} is not found in the code ({e})")
                continue
            if name.endswith("Callback") and not (target.is_class and target.docstring):
                problems.append(f"{path}.{name}: not a class with a docstring in the code")
    assert not problems, f"{PYTHON_API.relative_to(ROOT)}: " + "; ".join(problems)


def test_the_documented_callbacks_are_the_ones_imported() -> None:
    """The callbacks the reference renders (read from the code) are the classes tierstore.integrations
    gives at run time."""
    from tierstore import integrations

    for name, framework in (
        ("LightningCallback", "lightning.pytorch"),
        ("TransformersCallback", "transformers"),
    ):
        pytest.importorskip(framework)
        cls = getattr(integrations, name)
        assert cls.__name__ == name and cls.__module__ == integrations._LAZY[name][1]
        assert cls.__doc__ and "publishes" in cls.__doc__
