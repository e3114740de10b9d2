"""What the tests of streaming through a torch.distributed process group share (tests/stream: test_group on
one node, test_group_nodes across two): the model the ranks publish and how a rank's output is read."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

# The model the group tests publish (several dtypes: one tensor larger than the tests' 64 KiB buckets, and
# small ones packed together), and its tensors' hashes: source code a rank runs after its prelude (which
# imports torch and tierstore's `_core`).
MODEL = """
def weights(zero=False):
    g = torch.Generator().manual_seed(0)
    m = {"big": torch.randn(100_000, generator=g), "small0": torch.randn(100, generator=g),
         "small1": torch.randint(0, 100, (50,), generator=g),
         "half": torch.randn(3000, generator=g).to(torch.bfloat16), "flag": torch.zeros(7, dtype=torch.bool)}
    if zero:
        for t in m.values():
            t.zero_()
    return m

def hashes(m):
    return {k: _core.hash_buffers([v.reshape(-1).view(torch.uint8).numpy()])[0].hex() for k, v in m.items()}
"""


def line(proc: subprocess.Popen[str], log: Path | None = None) -> str:
    """The rank's next line of output; the test fails with its stderr (or `log`, where that went) if it
    exited instead."""
    assert proc.stdout is not None
    out = proc.stdout.readline()
    if not out:
        proc.wait(timeout=20)
        err = log.read_text() if log is not None else proc.stderr.read() if proc.stderr else ""
        pytest.fail(f"rank exited {proc.returncode}: {err}")
    return out
