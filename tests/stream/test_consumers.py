"""The consumers of a stream and their lag, as `tierstore stream show|watch` print them: a real agent, two
consumer processes (`HotModel`s, which report each swap to the agent), one of them held back by a request
that does not end, and the CLI in a process of its own."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.agents import child
from tests.helpers.cli import stream_cli as cli
from tests.helpers.wait import until
from tierstore import stream

# A consumer process: serves version 1, then (when `hold` is set) keeps a request open until the file
# `release` exists. In place, an update waits for the requests in flight: this consumer stays behind.
CONSUMER = """
import os, time
import numpy as np
from tierstore import stream
label, mode, hold, release = {label!r}, {mode!r}, {hold!r}, {release!r}
hot = stream.HotModel({{"w": np.zeros(1000, dtype=np.float32)}}, "lag", mode=mode, deadline=120, label=label)
hot.wait_version(1, 60)
print("serving 1", flush=True)
if hold:
    with hot.serving():
        print("holding", flush=True)
        while not os.path.exists(release):
            time.sleep(0.01)
hot.wait_version(2, 60)
print("serving 2", flush=True)
time.sleep(600)
"""


def consumer(sock: Path, label: str, mode: str, hold: bool, release: Path) -> subprocess.Popen[str]:
    return child(CONSUMER.format(label=label, mode=mode, hold=hold, release=str(release)), sock)


def read_until(proc: subprocess.Popen[str], pattern: str) -> str:
    """The first line of `proc`'s output matching `pattern` (the lines before it are skipped)."""
    assert proc.stdout is not None
    for out in proc.stdout:
        if re.search(pattern, out):
            return out
    pytest.fail(f"the output ended before a line matching {pattern!r}")


def test_show_and_watch_list_each_consumer_with_the_version_it_serves_and_its_lag(
    sock: Path, tmp_path: Path
) -> None:
    release = tmp_path / "release"
    fast = consumer(sock, "fast", "double", False, release)
    held = consumer(sock, "held", "in-place", True, release)
    watch: subprocess.Popen[str] | None = None
    try:
        m = {"w": np.full(1000, 1.0, dtype=np.float32)}
        stream.publish("lag", m)
        for c in (fast, held):
            assert c.stdout is not None and c.stdout.readline().strip() == "serving 1"
        assert held.stdout is not None and held.stdout.readline().strip() == "holding"
        m["w"][:] = 2.0
        stream.publish("lag", m)
        assert fast.stdout is not None and fast.stdout.readline().strip() == "serving 2"

        def show() -> str:
            out = cli(sock, "show", "lag")
            assert out.returncode == 0, out.stderr
            return out.stdout

        shown = until(
            "show lists both consumers, one behind",
            show,
            lambda out: "serving lag@2, up to date" in out and "serving lag@1, 1 version behind" in out,
        )
        print(shown)
        assert "consumers: 2, newest version 2" in shown, shown
        fast_line = next(x for x in shown.splitlines() if "(fast, pid" in x)
        held_line = next(x for x in shown.splitlines() if "(held, pid" in x)
        assert f"pid {fast.pid})" in fast_line and fast_line.endswith("serving lag@2, up to date"), shown
        behind_s = float(re.search(r"1 version behind for ([0-9.]+) s", held_line).group(1))  # type: ignore[union-attr]
        assert f"pid {held.pid})" in held_line and behind_s >= 0.0, shown
        # The lag in seconds grows while the consumer stays behind.
        later = until(
            "the lag grows",
            show,
            lambda out: float(re.search(r"behind for ([0-9.]+) s", out).group(1)) > behind_s + 0.2,  # type: ignore[union-attr]
        )
        assert "(held, pid" in later

        watch = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tierstore.cli",
                "stream",
                "watch",
                "lag",
                "--count",
                "1",  # lag@3: lag@2, the latest already, is printed first and not counted
                "--socket",
                str(sock),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert read_until(watch, r"^lag@2 ").startswith("lag@2 step None")
        # With each version, every consumer but the watch itself.
        snapshot = [read_until(watch, r"^  consumer") for _ in range(2)]
        assert any("(fast, pid" in x and "serving lag@2, up to date" in x for x in snapshot), snapshot
        assert any("(held, pid" in x and "serving lag@1, 1 version behind" in x for x in snapshot), snapshot
        # The held consumer's request ends: it swaps, and the watch says so as the agent learns it.
        release.touch()
        assert held.stdout.readline().strip() == "serving 2"
        swapped = read_until(watch, r"\(held, pid")
        assert swapped.rstrip().endswith("serving lag@2, up to date"), swapped
        # A consumer that goes away is reported gone.
        fast.kill()
        fast.wait(timeout=20)
        assert re.match(r"^  consumer \d+: gone", read_until(watch, r"gone"))
        m["w"][:] = 3.0
        stream.publish("lag", m)
        assert read_until(watch, r"^lag@3 ").startswith("lag@3 step None")
        assert watch.wait(timeout=30) == 0
    finally:
        for p in (fast, held, watch):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=20)
