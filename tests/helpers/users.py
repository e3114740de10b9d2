"""Throwaway users of this machine, for tests that play another user of a shared node (tests/security):
created with `useradd` for one test and removed after it, with a home of their own. Needs root."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class User:
    """A user of this machine that a test made."""

    name: str
    uid: int
    gid: int
    home: Path

    def run(
        self, argv: list[str], env: dict[str, str] | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """`argv` run as this user (no other group), in its home, with `env` over a minimal environment."""
        base = {"HOME": str(self.home), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "USER": self.name}
        return subprocess.run(
            argv,
            user=self.uid,
            group=self.gid,
            extra_groups=[],
            cwd=self.home,
            env={**base, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def python(
        self, code: str, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """The system's Python 3 (no tierstore: an attacker brings nothing of ours) running `code`."""
        return self.run(["/usr/bin/python3", "-c", textwrap.dedent(code), *args], env=env)


@contextmanager
def throwaway_user(role: str) -> Iterator[User]:
    """A new user named after `role`, removed (with its home and its processes) when the test ends."""
    name = f"ts-{role[:8]}-{uuid.uuid4().hex[:8]}"
    home = Path(tempfile.mkdtemp(prefix=f"{name}-", dir="/tmp"))
    subprocess.run(
        [
            "useradd",
            "--no-create-home",
            "--home-dir",
            str(home),
            "--shell",
            "/usr/sbin/nologin",
            "--user-group",
            name,
        ],
        check=True,
        capture_output=True,
    )
    entry = pwd.getpwnam(name)
    os.chown(home, entry.pw_uid, entry.pw_gid)
    home.chmod(0o700)
    try:
        yield User(name, entry.pw_uid, entry.pw_gid, home)
    finally:
        subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True)
        subprocess.run(["userdel", name], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


@contextmanager
def shared_dir() -> Iterator[Path]:
    """A fresh directory every user may write in, sticky as /tmp and /dev/shm are (mode 1777, root's)."""
    d = Path(tempfile.mkdtemp(prefix="tierstore-shared-", dir="/dev/shm"))
    d.chmod(0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
