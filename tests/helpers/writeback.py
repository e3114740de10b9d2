"""A write-back destination on the stand-in store, a stage, an agent socket of the test's own, and the
environment that names them: what every write-back test starts from (`setup`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers.cli import tierstore
from tests.helpers.stores import mounted_store
from tests.helpers.wait import wait_for

PART = ".tierstore-part"


def staged_copies_go(stage: Path) -> None:
    """Waits until the stage holds no staged copy. `sync` returns once the store has every file; the
    agent removes a staged copy just after it drops the file's journal entry (an unlink the crash-safe
    order puts last), which a busy machine can delay past `sync`'s return."""
    wait_for("the staged copies to go", lambda: not list((stage / "data").iterdir()), timeout=10)


def user_stage(dest: Path) -> Path:
    """The stage directory this user's files of `dest` land in, as tierstore computes it from the
    configuration in the environment: this user's own directory under the configured stage path."""
    from tierstore import _core

    return Path(next(d["stage"] for d in _core.Writeback().destinations() if d["path"] == str(dest)))


@dataclass
class Setup:
    """A destination on the stand-in store, a stage, this test's own agent socket, and the environment."""

    backing: Path
    mount: Path
    dest: Path
    # This user's stage directory (`<configured stage>/<uid>`): its `data/` holds the staged files.
    stage: Path
    env: dict[str, str]
    fail_file: Path
    started: list[int] = field(default_factory=list)

    @property
    def socket(self) -> Path:
        return Path(self.env["XDG_RUNTIME_DIR"]) / "tierstore" / "agent.sock"

    def stored(self, rel: str) -> Path:
        """The file as the store's backing directory holds it (what a reader of the store gets)."""
        return self.backing / "ckpt" / rel

    def start_agent(self) -> int:
        from tierstore import agent

        try:
            pid, _ = agent.start(self.socket, env=self.env, idle_exit=600)
        except agent.AgentError:
            # A writer started one on demand meanwhile.
            found = self.agent_pid()
            if found is None:
                raise
            pid = found
        self.started.append(pid)
        return pid

    def agent_pid(self) -> int | None:
        from tierstore import agent

        report = agent.status(self.socket)
        return json.loads(report)["pid"] if report else None

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return tierstore(*args, env=self.env, timeout=timeout)

    def python(
        self, code: str, *args: str, run: bool = False, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-c", code, *args]
        if run:
            cmd = [sys.executable, "-m", "tierstore.cli", "run", "--", *cmd]
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def setup(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    quota: str = "1G",
    durability: str = "buffered",
    stage: Path | None = None,
    **store: str,
) -> Iterator[Setup]:
    fail_file = tmp_path / "store-outage"
    with mounted_store(tmp_path, fail_file=fail_file, **store) as (backing, mount):  # type: ignore[arg-type]
        dest = mount / "ckpt"
        dest.mkdir()
        stage = stage or tmp_path / "stage"
        data = tmp_path / "data"
        data.mkdir()
        run = tmp_path / "run"
        run.mkdir()
        env = {
            **os.environ,
            "XDG_RUNTIME_DIR": str(run),
            "TIERSTORE_WRITEBACK": f"{dest}:{stage}:{quota}:{durability}",
            "TIERSTORE_SOURCE": str(data),
            "TIERSTORE_TIERS": f"{tmp_path / 'tier'}:64M",
        }
        for k in ("XDG_RUNTIME_DIR", "TIERSTORE_WRITEBACK"):
            monkeypatch.setenv(k, env[k])
        import tierstore.writeback

        tierstore.writeback.reload()
        s = Setup(backing, mount, dest, user_stage(dest), env, fail_file)
        try:
            yield s
        finally:
            from tierstore import agent

            with contextlib.suppress(Exception):
                agent.stop(s.socket)
            for pid in s.started:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            tierstore.writeback.reload()
