"""The agent migrates only what its configuration names, and a stage is its user's alone (issue 35): a
journal entry whose destination is outside its stage's destinations is never written by the real agent, and
the staged bytes, their directories and the journal are the user's only."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.data import blob
from tests.helpers.wait import wait_for
from tests.helpers.writeback import setup

# A writer that journals `dest` in the stage of its configuration's first destination, and starts no
# agent: what a journal entry planted in a stage looks like to the agent.
PLANT = """
import sys
from tierstore import _core
wb = _core.Writeback()
name, staged = wb.begin(sys.argv[1])
with open(staged, "wb") as f:
    f.write(b"planted by another configuration")
wb.commit(sys.argv[1], name)
"""


def mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


@pytest.mark.fuse
def test_an_entry_outside_the_configured_destination_is_never_migrated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stage's journal names a file of the user's outside the destination (as a hostile list of
    stages or a forged journal would have the agent write it): the real agent refuses and counts it, leaves
    it in the journal, and the victim is untouched; the checkpoint beside it migrates as usual."""
    import tierstore

    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    victim = victim_dir / ".bashrc"
    victim.write_bytes(b"the user's own")
    with setup(tmp_path, monkeypatch) as s:
        # The same stage, configured for the victim's directory, and a runtime directory of its own, so
        # that the list of stages this test's agent reads never names the victim.
        elsewhere = tmp_path / "elsewhere-run"
        elsewhere.mkdir()
        env = {
            **s.env,
            "XDG_RUNTIME_DIR": str(elsewhere),
            "TIERSTORE_WRITEBACK": f"{victim_dir}:{s.stage.parent}:1G:local",
        }
        p = subprocess.run(
            [sys.executable, "-c", PLANT, str(victim)], env=env, capture_output=True, text=True, timeout=60
        )
        assert p.returncode == 0, p.stderr
        staged = list((s.stage / "data").iterdir())
        assert len(staged) == 1, "the entry is in this test's stage"
        s.start_agent()
        data = blob("model.bin", 1 << 20)
        with tierstore.open(s.dest / "model.bin", "wb") as f:
            f.write(data)
        tierstore.sync(timeout=30)
        assert s.stored("model.bin").read_bytes() == data

        from tierstore import agent

        def writeback_status() -> dict[str, int]:
            report = agent.status(s.socket)
            return json.loads(report)["writeback"] if report else {}

        wait_for(
            "the agent reports the refused entry", lambda: writeback_status().get("refused_entries") == 1
        )
        assert victim.read_bytes() == b"the user's own", "the agent wrote outside the destination"
        assert sorted(p.name for p in victim_dir.iterdir()) == [".bashrc"], "nothing beside it either"
        assert list((s.stage / "data").iterdir()) == staged, "the refused entry stays, with its bytes"
        log = (s.socket.parent / "agent.log").read_text(errors="replace")
        assert "refusing to migrate" in log and str(victim) in log and str(s.dest) in log, log[-2000:]
        # Refused entries keep no agent up and hold no sync of the destination.
        assert writeback_status()["migrated_files"] == 1
        p2 = s.cli("sync", str(s.dest), "--timeout", "5")
        assert p2.returncode == 0, p2.stderr


@pytest.mark.fuse
def test_the_stage_and_its_files_are_the_users_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tierstore

    with setup(tmp_path, monkeypatch) as s:
        s.fail_file.touch()  # the store takes nothing: the file stays staged
        with tierstore.open(s.dest / "secret.bin", "wb") as f:
            f.write(b"the checkpoint")
        assert s.stage == tmp_path / "stage" / str(os.geteuid())
        for d in (s.stage, s.stage / "journal", s.stage / "data"):
            assert mode(d) == 0o700, d
        files = [*(s.stage / "data").iterdir(), *(s.stage / "journal").iterdir()]
        assert files and all(mode(f) == 0o600 for f in files), {f.name: oct(mode(f)) for f in files}
        stages = s.socket.parent / "writeback-stages"
        assert mode(stages) == 0o600
        assert stages.read_text() == f"{s.stage}\t{s.dest}\n"
        s.fail_file.unlink()
        tierstore.sync(timeout=30)
        assert s.stored("secret.bin").read_bytes() == b"the checkpoint"
