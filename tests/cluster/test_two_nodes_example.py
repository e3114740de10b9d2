"""examples/two_nodes.py, the runnable demo of docs/guide/across-nodes.md ("Try it on one machine"), runs
as a newcomer types it: two nodes share their caches over loopback, and nothing is left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "two_nodes.py"


def _alive(pid: int) -> bool:
    """Whether `pid` is still a tierstore agent (not a process that reused the pid)."""
    try:
        return b"tierstore" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_two_nodes_example_shares_the_cache_and_cleans_up(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, str(EXAMPLE)], cwd=tmp_path, capture_output=True, text=True, timeout=180
    )
    assert p.returncode == 0, f"the example failed:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    (line,) = [ln for ln in p.stdout.splitlines() if ln.startswith("summary: ")]
    summary = json.loads(line.removeprefix("summary: "))
    assert summary["files"] == 201 and summary["sharing"] == "inclusive", summary
    # Node 1 received the files node 0 owns from node 0, and read nothing from the store ...
    assert summary["node1_peer_hits"] > 0 and summary["node1_store_bytes"] == 0, summary
    # ... and what it received is what node 0 had read from the store: each file left the store once.
    assert summary["node1_peer_bytes"] == summary["node0_store_bytes"] > 0, summary
    # Node 0's read was the job's first: every look in every tier of the job missed (hit rate 0), and
    # node 1, which fetched from the store the files it sent node 0, counted each as a miss and an open.
    cold = summary["cold"]
    assert cold["node0"]["hits"] == cold["node1"]["hits"] == 0, cold
    assert cold["node0"]["misses"] == summary["files"], cold
    assert cold["node1"]["misses"] == summary["node0_peer_hits"] > 0, cold
    assert cold["node1"]["store_opens"] >= cold["node1"]["misses"], cold
    assert "cluster (inclusive)" in p.stdout, "no cluster table in `tierstore status`"
    # Nothing outlives the demo: its temporary directory and both agents are gone.
    assert not Path(summary["root"]).exists(), f"{summary['root']} was left behind"
    assert len(summary["agents"]) == 2
    assert not [pid for pid in summary["agents"] if _alive(pid)], "an agent still runs"
