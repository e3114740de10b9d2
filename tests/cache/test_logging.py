"""`TIERSTORE_LOG` and `tierstore -v`: what the cache decided for each file, and why, on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.helpers.cli import tierstore_run

READ_TWICE = textwrap.dedent(
    """
    import os, sys, tierstore
    cache = tierstore.Cache(sys.argv[1], [sys.argv[2]])
    for _ in range(2):
        with cache.open(os.path.join(sys.argv[1], "a.bin")) as f:
            assert f.read() == b"x" * 5000
        cache.wait()
    """
)


def _read_twice(source: Path, tier: str, level: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TIERSTORE_LOG"}
    if level is not None:
        env["TIERSTORE_LOG"] = level
    proc = subprocess.run(
        [sys.executable, "-c", READ_TWICE, str(source), f"{tier}:16M"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_debug_says_what_the_cache_decided_for_each_file_and_the_default_says_nothing(
    tmp_path: Path, tier: str
) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "a.bin").write_bytes(b"x" * 5000)
    err = _read_twice(source, tier, "debug")
    lines = [line for line in err.splitlines() if "a.bin" in line]
    # The cold open: a miss, then the fetch into the tier; the warm one: a hit in that tier.
    assert any("debug: a.bin: miss" in line for line in lines), err
    assert any(f"debug: a.bin: fetching 5000 B from the store into {tier}" in line for line in lines), err
    assert any(f"debug: a.bin: hit in {tier}" in line for line in lines), err
    assert all(line.startswith("tierstore[") for line in lines), err
    # The default (warn) and off: a clean run says nothing.
    assert _read_twice(source, tier, None) == ""
    assert _read_twice(source, tier, "off") == ""


def test_a_level_that_is_not_one_names_the_levels_and_keeps_the_default(tmp_path: Path, tier: str) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "a.bin").write_bytes(b"x" * 5000)
    err = _read_twice(source, tier, "loud")
    assert 'TIERSTORE_LOG="loud" is not a level: give one of off, error, warn, info, debug, trace' in err, err
    assert "debug:" not in err


def test_tierstore_vv_shows_the_decisions_of_the_command_run_starts(tmp_path: Path, tier: str) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "a.bin").write_bytes(b"y" * 3000)
    env = {k: v for k, v in os.environ.items() if k != "TIERSTORE_LOG"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tierstore.cli",
            "-vv",
            "--source",
            str(source),
            "--tier",
            f"{tier}:16M",
            "run",
            "--",
            "cat",
            str(source / "a.bin"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "y" * 3000
    assert "debug: a.bin: miss" in proc.stderr and "debug: a.bin: fetching 3000 B" in proc.stderr, proc.stderr
    # Without -v the same warm run says nothing.
    quiet = tierstore_run(source, f"{tier}:16M", "cat", str(source / "a.bin"), env=env)
    out, err = quiet.communicate(timeout=60)
    assert quiet.returncode == 0 and out == "y" * 3000
    assert "debug:" not in err, err
