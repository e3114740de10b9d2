"""`make demo` (examples/demo.py), the README's first command: it runs end to end, says what its counts
mean, and leaves nothing behind."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_demo_runs_explains_its_reads_and_leaves_nothing_behind() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py")], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if re.match(r"\s+[123]\s+\d", line)]
    assert [r[0] for r in rows] == ["1", "2", "3"], proc.stdout
    opens = [int(r[3].replace(",", "")) for r in rows]
    # Epoch 1 opens each of the 1500 samples on the store once; epochs 2-3 none.
    assert opens == [1500, 0, 0], proc.stdout
    assert "one more that finds the file's end" in proc.stdout
    assert not Path("/tmp/tierstore-demo").exists(), "the demo left its dataset in /tmp"
    assert not Path("/dev/shm/tierstore-demo").exists(), "the demo left its tier in /dev/shm"
