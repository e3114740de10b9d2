"""Another user of the same node (issue #35, items 1-4): a throwaway user, made for each test, tries to read,
plant or redirect what tierstore keeps for the job's user (root here) in a directory both can reach, a
sticky one as /dev/shm and /tmp are. Every attempt is refused, and the job's bytes stay its own."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import tierstore
from tests.helpers.agents import start_agent, stop_agent
from tests.helpers.cli import agent_cli
from tests.helpers.users import User, shared_dir, throwaway_user
from tests.helpers.wait import wait_for
from tierstore import stream

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


def test_a_stream_directory_another_user_made_first_leaves_the_agent_starting(
    tmp_path: Path, attacker: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B makes the stream directory of A's agent (/dev/shm/tierstore-UID-stream-TAG, a name anyone can
    foresee) before the agent starts (issue #49, item 2): the agent starts all the same, keeps its versions
    in a fresh directory beside it whose name B could not foresee, and never writes into B's."""
    # The directory's name comes from the socket's path: one no other run repeats (pytest's tmp_path is
    # the same in every CI run on a machine), so that a directory B planted in an earlier run that died
    # before its cleanup is not taken for this run's.
    run = tmp_path / f"run-{uuid.uuid4().hex[:8]}"
    sock = run / "tierstore" / "agent.sock"
    sock.parent.mkdir(parents=True)
    proc = start_agent(sock)
    default = Path(json.loads(agent_cli("status", "--json", "--socket", str(sock)).stdout)["stream_dir"])
    stop_agent(proc)
    assert not default.exists(), "a stopped agent removes its stream directory"
    assert attacker.run(["mkdir", "-m", "0777", str(default)]).returncode == 0
    proc = start_agent(sock)
    try:
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
        v = stream.publish("m", {"t": np.full(1000, 7.0, dtype=np.float32)}, step=1)
        assert isinstance(v, stream.StreamVersion) and v.version == 1
        assert not list(default.iterdir()), "the agent wrote into a directory another user made"
        (fresh,) = default.parent.glob(default.name + ".*")
        assert fresh.stat().st_uid == os.geteuid() and fresh.stat().st_mode & 0o777 == 0o700
        assert list((fresh / "blobs").iterdir()), "the version is not in the agent's own directory"
    finally:
        stop_agent(proc)
        # B's directory outlives B (the fixture removes the user, not what it made in /dev/shm).
        default.rmdir()
    wait_for("the agent's own stream directory removed when it stops", lambda: not fresh.exists(), timeout=10)


# Run in a mount namespace of its own, with a /tmp of its own (the machine's /tmp/tierstore-0 is left
# alone): B makes /tmp/tierstore-UID (0700) before A starts an agent with XDG_RUNTIME_DIR unset. A runs
# without root's power to enter other users' directories, as any other user would. Prints what each
# `tierstore agent` command did, as JSON.
PLANTED_TMP = """
import json, os, subprocess, sys
attacker, gid, home = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
import tierstore
old_tmp = os.open("/tmp", os.O_PATH)
subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/tmp"], check=True)
# A checkout or a venv under /tmp (a CI clone, say) stays where it was: bound back from the /tmp the new
# one covers (`--no-canonicalize`, or mount would resolve the old /tmp's descriptor to the new /tmp).
kept = {os.path.relpath(p, "/tmp").split(os.sep)[0] for p in (sys.prefix, tierstore.__file__)}
for top in kept - {".", ".."}:
    os.makedirs(f"/tmp/{top}", exist_ok=True)
    subprocess.run(["mount", "--no-canonicalize", "--bind", f"/proc/self/fd/{old_tmp}/{top}", f"/tmp/{top}"],
                   pass_fds=[old_tmp], check=True)
planted = f"/tmp/tierstore-{os.getuid()}"
subprocess.run(["mkdir", "-m", "0700", planted], user=attacker, group=gid, extra_groups=[], check=True)
as_a_user = ["setpriv", "--inh-caps=-dac_override,-dac_read_search", "--bounding-set=-dac_override,-dac_read_search"]
env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
def agent(*args, env=env):
    p = subprocess.run([*as_a_user, sys.executable, "-m", "tierstore.cli", "agent", *args], env=env,
                       capture_output=True, text=True, timeout=60)
    return {"rc": p.returncode, "out": p.stdout, "err": p.stderr}
out = {"homeless": agent("start", env={k: v for k, v in env.items() if k != "HOME"})}
out["start"] = agent("start", env={**env, "HOME": home})
out["status"] = agent("status", "--json", env={**env, "HOME": home})
out["stop"] = agent("stop", env={**env, "HOME": home})
out["planted"] = os.listdir(planted)
print(json.dumps(out))
"""


def test_a_runtime_directory_another_user_made_first_in_tmp_leaves_the_agent_starting(
    shared: Path, attacker: User
) -> None:
    """With XDG_RUNTIME_DIR unset the agent's directory is /tmp/tierstore-UID, which another user can make
    first (issue #49, item 2): `tierstore agent start` still starts an agent, in ~/.tierstore/run-HOST, and
    every command finds it there; without a home it says in one line what is wrong and what to do, and
    nothing is ever written into the planted directory."""
    home = shared / "home"
    home.mkdir(mode=0o700)
    unshared = ["unshare", "--mount", "--propagation", "private"]
    p = subprocess.run(
        [*unshared, sys.executable, "-c", PLANTED_TMP, str(attacker.uid), str(attacker.gid), str(home)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    planted = f"/tmp/tierstore-{os.getuid()}"
    homeless = out["homeless"]
    assert homeless["rc"] != 0 and "Traceback" not in homeless["err"], homeless
    assert f"{planted} belongs to uid {attacker.uid}" in homeless["err"], homeless
    assert len(homeless["err"].strip().splitlines()) == 1, homeless
    sock = home / ".tierstore" / f"run-{socket.gethostname()}" / "agent.sock"
    assert out["start"]["rc"] == 0 and str(sock) in out["start"]["out"], out["start"]
    assert out["status"]["rc"] == 0 and json.loads(out["status"]["out"])["socket"] == str(sock), out["status"]
    assert out["stop"]["rc"] == 0, out["stop"]
    assert out["planted"] == [], "something was written into the directory another user made"


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
