"""Configuration layers and their errors, and the `tierstore` command line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import tierstore
from tests.helpers.cli import cli


def test_layers_file_then_env_then_arguments(
    source: Path, tier: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "ts.toml"
    cfg.write_text(
        f'source = "{source}"\npolicy = "lru"\nthreads = 3\n[[tiers]]\npath = "{tier}"\nquota = "1G"\n'
    )
    monkeypatch.setenv("TIERSTORE_CONFIG", str(cfg))
    monkeypatch.setenv("TIERSTORE_THREADS", "5")
    c = tierstore.Cache(policy="fifo").config()
    assert c["policy"] == ("fifo", "argument")
    assert c["threads"] == (5, "$TIERSTORE_THREADS")
    assert c["source"] == (str(source), str(cfg))
    assert c["tiers"][0] == [{"path": tier, "quota": 1 << 30, "kind": "memory"}]


def test_tierstore_toml_in_the_working_directory(
    source: Path, tier: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "tierstore.toml").write_text(
        f'source = "{source}"\n[[tiers]]\npath = "{tier}"\nquota = 1048576\n'
    )
    monkeypatch.chdir(tmp_path)
    assert tierstore.Cache().config()["tiers"][0][0]["quota"] == 1 << 20


def test_a_quota_as_a_share_of_the_file_system_fits_any_node(source: Path, tier: str, tmp_path: Path) -> None:
    """`"50%"` is half of the file system the tier is on, from a tier string or a TOML file."""
    st = os.statvfs(Path(tier).parent)
    total = st.f_blocks * st.f_bsize
    assert tierstore.Cache(source, [f"{tier}:50%"]).config()["tiers"][0][0]["quota"] == total // 2
    cfg = tmp_path / "share.toml"
    cfg.write_text(f'source = "{source}"\n[[tiers]]\npath = "{tier}"\nquota = "12.5%"\n')
    assert tierstore.Cache(config=cfg).config()["tiers"][0][0]["quota"] == int(total * 0.125)


def test_no_file_gives_a_default_tier_from_free_space(source: Path, tmp_path: Path) -> None:
    c = tierstore.Cache(source).config()
    (tiers, origin) = c["tiers"]
    assert origin == "default" and tiers[0]["path"] == str(tmp_path / "xdg-cache" / "tierstore")
    assert tiers[0]["quota"] > 0 and c["policy"] == ("fill", "default")


@pytest.mark.parametrize(
    ("kwargs", "env", "expected"),
    [
        ({"tiers": ["{tier}:80X"]}, {}, ['tiers[0].quota = "80X"', "use a size like"]),
        ({"tiers": ["{tier}:0"]}, {}, ["caches nothing"]),
        ({"tiers": ["{tier}:1000T"]}, {}, ["exceeds the size of the file system"]),
        ({"tiers": ["{tier}:150%"]}, {}, ['tiers[0].quota = "150%"', "not a share", 'like "50%"']),
        ({}, {"TIERSTORE_TIERS": "/tmp/x:0%"}, ["$TIERSTORE_TIERS", "not a size or a share"]),
        ({"policy": "lfru"}, {}, ['policy = "lfru"', '"fill"']),
        ({"threads": 0}, {}, ["threads = 0", "from 1 to 256"]),
        ({"verify": "crc"}, {}, ['verify = "crc"', '"checksum"']),
        ({}, {"TIERSTORE_POLCY": "lru"}, ["$TIERSTORE_POLCY", "did you mean TIERSTORE_POLICY"]),
        ({}, {"TIERSTORE_TIERS": "/tmp/x:12Q"}, ["$TIERSTORE_TIERS", "not a size"]),
        ({"tiers": ["{source}/inside:1M"]}, {}, ["overlaps the source"]),
        ({"tiers": ["{tier}:1M", "{tier}:2M"]}, {}, ["same directory as tiers[0]"]),
        ({"tiers": ["/proc/forbidden:1M"]}, {}, ["tiers[0].path", "cannot be created"]),
    ],
)
def test_invalid_values_fail_at_start_naming_key_value_and_fix(
    source: Path, tier: str, kwargs: dict, env: dict, expected: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    kwargs = {
        k: [t.format(tier=tier, source=source) for t in v] if k == "tiers" else v for k, v in kwargs.items()
    }
    with pytest.raises(tierstore.ConfigError) as e:
        tierstore.Cache(source, **kwargs)
    for text in expected:
        assert text in str(e.value), str(e.value)


def test_every_keyword_of_one_value_reaches_the_engine_by_its_type(source: Path, tier: str) -> None:
    # The keywords go to the engine by the settings table, each read by its type: a path, a count given as
    # an int or a string, a size, words.
    c = tierstore.Cache(
        source, [tier], policy="lru", threads="3", inline_max=4096, verify="checksum", revalidate="5s"
    ).config()
    assert c["source"] == (str(source), "argument")
    assert (c["policy"], c["threads"], c["inline_max"]) == (
        ("lru", "argument"),
        (3, "argument"),
        (4096, "argument"),
    )
    assert (c["verify"][0], c["revalidate"][0]) == ("checksum", "5s")
    with pytest.raises(TypeError, match="policy= takes a string, not int"):
        tierstore.Cache(source, [tier], policy=3)
    with pytest.raises(TypeError, match="threads= takes a whole number"):
        tierstore.Cache(source, [tier], threads=2.5)
    with pytest.raises(TypeError, match=r'no keyword "polcy".*policy'):
        tierstore._core.Cache(settings={"polcy": "lru"})


def test_config_file_errors(source: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('polcy = "lru"\n')
    with pytest.raises(tierstore.ConfigError, match='unknown key; did you mean "policy"'):
        tierstore.Cache(source, config=bad)
    bad.write_text("[[tiers]]\npath = '/tmp/t'\nquota = '1G'\nsize = 3\n")
    with pytest.raises(tierstore.ConfigError, match=r"tiers\[0\]\.size = 3: unknown key"):
        tierstore.Cache(source, config=bad)
    bad.write_text("[[tiers]]\npath = 3\nquota = '1G'\n")
    with pytest.raises(tierstore.ConfigError, match=r"tiers\[0\]\.path = 3: is not a path \(a string\)"):
        tierstore.Cache(source, config=bad)
    bad.write_text("source = [\n")
    with pytest.raises(tierstore.ConfigError, match="not valid TOML"):
        tierstore.Cache(source, config=bad)
    bad.write_text('policy = "lru"\nthreads = = 4\n')
    with pytest.raises(tierstore.ConfigError) as e:
        tierstore.Cache(source, config=bad)
    said = str(e.value)
    assert 'line 2 = "threads = = 4": is not valid TOML at column' in said, said
    assert said.count(str(bad)) == 1, f"the path is named more than once: {said}"
    with pytest.raises(tierstore.ConfigError, match="no such file"):
        tierstore.Cache(source, config=tmp_path / "missing.toml")
    with pytest.raises(tierstore.ConfigError, match="no source directory is configured") as e:
        tierstore.Cache()
    # The parts of the error are attributes too: a caller tells the unset source from a bad one.
    assert (e.value.key, e.value.value) == ("source", "(unset)") and "TIERSTORE_SOURCE" in e.value.fix
    with pytest.raises(tierstore.ConfigError, match=r"source = .*cannot be read") as e:
        tierstore.Cache(tmp_path / "nope")
    assert e.value.key == "source" and e.value.value.endswith("nope")


def test_cli_help_reads_well() -> None:
    r = cli("--help")
    assert r.returncode == 0
    for command in ("prefetch", "status", "clear", "config"):
        assert command in r.stdout
    assert "fastest tier" in r.stdout
    assert cli("prefetch", "--help").returncode == 0


def test_each_command_is_found_by_the_module_named_for_it() -> None:
    # The root imports a command's module only when the command is asked for, by its own table: a command
    # added to a module and not to the table would be missing from `tierstore --help` and unknown to run.
    import importlib
    import pkgutil

    import tierstore.cli
    from tierstore.cli.main import COMMAND_MODULES, main

    for m in pkgutil.iter_modules(tierstore.cli.__path__):
        if m.name != "__main__":  # runs the command line
            importlib.import_module(f"tierstore.cli.{m.name}")
    assert set(main.commands) == set(COMMAND_MODULES)
    for name, command in main.commands.items():
        assert command.callback is not None
        assert command.callback.__module__ == f"tierstore.cli.{COMMAND_MODULES[name]}", name


def test_run_imports_no_other_command() -> None:
    # `tierstore run` starts every job: the models, stream, agent and cache commands' imports are not its cost.
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from tierstore.cli import main\n"
        "try:\n"
        "    main(['run', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('tierstore.cli.'))))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Run COMMAND with its reads of the source served from the cache" in r.stdout
    assert r.stdout.split("\n")[-2].split() == ["tierstore.cli.main", "tierstore.cli.run"]


def test_cli_prefetch_status_clear_and_config(source: Path, tier: str) -> None:
    for i in range(30):
        (source / f"{i}.bin").write_bytes(os.urandom(1000))
    base = ["--source", str(source), "--tier", f"{tier}:10M"]
    r = cli(*base, "prefetch", "--no-progress", str(source))
    assert r.returncode == 0, r.stderr
    assert "prefetched 30 files" in r.stdout and "30 copied" in r.stdout
    r = cli(*base, "status", "--json")
    stats = json.loads(r.stdout)
    assert stats["tiers"][0]["entries"] == 30 and stats["source"]["bytes_read"] == 30_000
    r = cli(*base, "status")
    assert r.returncode == 0 and "cache tiers" in r.stdout and "bytes read" in r.stdout
    assert "revalidate 60s: a copy confirmed within 60s is trusted" in r.stdout, r.stdout
    r = cli(*base, "status", "--json", env={"TIERSTORE_REVALIDATE": "45s"})
    assert json.loads(r.stdout)["revalidate"] == "45s"
    r = cli(*base, "config", "show")
    assert r.returncode == 0 and f"{tier}" in r.stdout and "(from argument)" in r.stdout
    r = cli(*base, "clear", "--yes")
    assert r.returncode == 0
    assert json.loads(cli(*base, "status", "--json").stdout)["tiers"][0]["entries"] == 0


def test_cli_reports_config_errors_without_a_traceback(source: Path, tier: str) -> None:
    r = cli("--source", str(source), "--tier", f"{tier}:80X", "status")
    assert r.returncode != 0
    assert 'tiers[0].quota = "80X"' in r.stderr and "Traceback" not in r.stderr


def test_cli_prefetch_outside_the_source_is_a_clear_error(source: Path, tier: str) -> None:
    r = cli("--source", str(source), "--tier", f"{tier}:1M", "prefetch", "/etc")
    assert r.returncode != 0 and "outside the cached source" in r.stderr and "Traceback" not in r.stderr
