"""Another user of the same node (issue #35, items 1-4): a throwaway user, made for each test, tries to read,
plant or redirect what tierstore keeps for the job's user (root here) in a directory both can reach, a
sticky one as /dev/shm and /tmp are. Every attempt is refused, and the job's bytes stay its own."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import tierstore
from tests.helpers.cli import agent_cli
from tests.helpers.users import User, shared_dir, throwaway_user

pytestmark = pytest.mark.root

SECRET = b"the job's private bytes: 7f3a9c"

# Every file under a directory, read as the user running it: what could be read, and how many files.
READ_ALL = """
import os, sys, json
got, seen = [], 0
for top, dirs, files in os.walk(sys.argv[1]):
    for name in files + dirs:
        seen += 1
        try:
            with open(os.path.join(top, name), "rb") as f:
                got.append(f.read().decode("latin-1"))
        except OSError:
            pass
print(json.dumps({"seen": seen, "read": got}))
"""


@pytest.fixture
def attacker() -> Iterator[User]:
    with throwaway_user("attacker") as u:
        yield u


@pytest.fixture
def shared() -> Iterator[Path]:
    with shared_dir() as d:
        yield d


def secret_source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "secret.bin").write_bytes(SECRET)
    (src / "secret.bin").chmod(0o600)
    return src


def test_another_user_reads_no_byte_of_a_tier(tmp_path: Path, shared: Path, attacker: User) -> None:
    src = secret_source(tmp_path)
    cache = tierstore.Cache(source=str(src), tiers=[f"{shared}/tier:64M"])
    with cache.open(str(src / "secret.bin")) as f:
        assert f.read() == SECRET
    cache.wait()
    copies = [p for p in (shared / "tier").rglob("*") if p.is_file() and p.read_bytes() == SECRET]
    assert copies, "the copy is in the tier"
    for p in copies:
        assert p.stat().st_mode & 0o777 == 0o600, p
    mine = shared / "tier" / str(os.geteuid())
    assert mine.stat().st_mode & 0o777 == 0o700
    out = attacker.python(READ_ALL, str(shared / "tier"))
    assert out.returncode == 0, out.stderr
    assert SECRET.decode() not in out.stdout
    assert '"read": []' in out.stdout, out.stdout


def test_a_tier_another_user_prepared_is_refused(tmp_path: Path, shared: Path, attacker: User) -> None:
    src = secret_source(tmp_path)
    # The attacker makes the tier path first, writable by all (as B did with 0777 namespaces)...
    planted = shared / "tier"
    assert attacker.run(["mkdir", "-m", "0777", str(planted)]).returncode == 0
    with pytest.raises(Exception) as refused:
        tierstore.Cache(source=str(src), tiers=[f"{planted}:64M"])
    message = str(refused.value)
    assert str(planted) in message and f"uid {attacker.uid}" in message, message
    # ... or this user's own directory under a tier root shares, with a copy of its choosing inside.
    root_shared = shared / "common"
    root_shared.mkdir()
    root_shared.chmod(0o1777)
    mine = root_shared / str(os.geteuid())
    assert attacker.run(["mkdir", "-m", "0777", str(mine)]).returncode == 0
    with pytest.raises(Exception) as refused:
        tierstore.Cache(source=str(src), tiers=[f"{root_shared}:64M"])
    assert str(mine) in str(refused.value) and f"uid {attacker.uid}" in str(refused.value), str(refused.value)
    assert not [p for p in mine.rglob("*") if p.is_file()], "nothing was written into the planted directory"


def test_a_shared_tier_path_keeps_each_user_apart(tmp_path: Path, shared: Path, attacker: User) -> None:
    """Root shares /dev/shm/tierstore (1777) as an administrator would: each user gets <path>/<uid>."""
    src = secret_source(tmp_path)
    common = shared / "tierstore"
    common.mkdir()
    common.chmod(0o1777)
    cache = tierstore.Cache(source=str(src), tiers=[f"{common}:64M"])
    with cache.open(str(src / "secret.bin")) as f:
        assert f.read() == SECRET
    cache.wait()
    # The other user can make a directory of its own beside it, and read nothing of this user's.
    theirs = common / str(attacker.uid)
    assert attacker.run(["mkdir", "-m", "0700", str(theirs)]).returncode == 0
    out = attacker.python(READ_ALL, str(common))
    assert out.returncode == 0 and SECRET.decode() not in out.stdout and '"read": []' in out.stdout, (
        out.stdout
    )
    assert sorted(p.name for p in common.iterdir()) == sorted([str(os.geteuid()), str(attacker.uid)])


def test_the_agent_directory_another_user_made_first_is_refused(shared: Path, attacker: User) -> None:
    """B makes the agent's runtime directory before A's first agent (as /tmp/tierstore-UID can be made
    by anyone when XDG_RUNTIME_DIR is unset): A's agent refuses it, and never binds, logs or lists there."""
    runtime = shared / "run"
    assert attacker.run(["mkdir", "-m", "0777", str(runtime), str(runtime / "tierstore")]).returncode == 0
    assert attacker.run(["ln", "-s", "/etc/passwd", str(runtime / "tierstore" / "agent.log")]).returncode == 0
    before = Path("/etc/passwd").read_bytes()
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    started = agent_cli("start", env=env)
    assert started.returncode != 0
    assert str(runtime / "tierstore") in started.stderr and f"uid {attacker.uid}" in started.stderr, (
        started.stderr
    )
    assert Path("/etc/passwd").read_bytes() == before
    assert not (runtime / "tierstore" / "agent.sock").exists()


# A fake agent of the attacker's on a Unix socket: it welcomes whoever connects and would serve anything.
FAKE_AGENT = """
import os, socket, struct, sys
path = sys.argv[1]
s = socket.socket(socket.AF_UNIX)
s.bind(path)
os.chmod(path, 0o777)
s.listen(8)
print("ready", flush=True)
def frame(kind, body):
    return struct.pack(">I", 1 + len(body)) + bytes([kind]) + body
while True:
    c, _ = s.accept()
    try:
        c.sendall(frame(1, bytes([4]) + b"\\0" * 32))
        c.recv(4096)
        c.sendall(frame(3, struct.pack(">H", 4) + b"fake" + b"\\0" * 32))
        c.recv(4096)
    except OSError:
        pass
    c.close()
"""


def test_a_socket_another_user_serves_is_not_spoken_to(shared: Path, attacker: User) -> None:
    home = shared / "theirs"
    assert attacker.run(["mkdir", "-m", "0755", str(home)]).returncode == 0
    sock = home / "agent.sock"
    fake = subprocess.Popen(
        ["/usr/bin/python3", "-c", FAKE_AGENT, str(sock)],
        user=attacker.uid,
        group=attacker.gid,
        extra_groups=[],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert fake.stdout is not None and fake.stdout.readline().startswith("ready")
        status = agent_cli("status", "--socket", str(sock))
        assert status.returncode != 0
        assert f"served by uid {attacker.uid}" in status.stderr, status.stderr
        assert not tierstore.agent.answers(sock)
        with pytest.raises(Exception) as refused:
            tierstore._core.AgentLink(str(sock), 2.0)
        assert f"uid {attacker.uid}" in str(refused.value)
    finally:
        fake.kill()
        fake.wait(timeout=10)


def test_a_directory_readable_by_others_is_narrowed_and_one_they_can_write_refused(tmp_path: Path) -> None:
    """An older tierstore's 0755 directories become 0700; a 0777 one is never trusted."""
    src = secret_source(tmp_path)
    tier = tmp_path / "tier"
    (tier / str(os.geteuid())).mkdir(parents=True)
    (tier / str(os.geteuid())).chmod(0o755)
    tierstore.Cache(source=str(src), tiers=[f"{tier}:64M"])
    assert (tier / str(os.geteuid())).stat().st_mode & 0o777 == 0o700
    (tier / str(os.geteuid())).chmod(0o777)
    with pytest.raises(Exception) as refused:
        tierstore.Cache(source=str(src), tiers=[f"{tier}:64M"])
    assert "writable by other users (mode 0777)" in str(refused.value)
