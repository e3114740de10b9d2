"""`tierstore agent`: the node agent's lifecycle as a user drives it from the command line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.agents import exited
from tests.helpers.cli import agent_cli as cli
from tests.helpers.cluster import job_token


@pytest.fixture
def runtime(tmp_path: Path) -> dict[str, str]:
    """A private runtime directory, so the default socket is this test's own."""
    d = tmp_path / "run"
    d.mkdir()
    return {**os.environ, "XDG_RUNTIME_DIR": str(d)}


def test_start_status_stop_and_a_second_start_is_harmless(runtime: dict[str, str]) -> None:
    socket = Path(runtime["XDG_RUNTIME_DIR"]) / "tierstore" / "agent.sock"
    started = cli("start", "--node", "n1", env=runtime)
    assert started.returncode == 0, started.stderr
    assert str(socket) in started.stdout and socket.exists()
    again = cli("start", env=runtime)
    assert again.returncode == 0 and "already runs" in again.stdout
    status = cli("status", "--json", env=runtime)
    report = json.loads(status.stdout)
    assert report["node"] == "n1" and report["socket"] == str(socket)
    os.kill(report["pid"], 0)  # alive, and detached from us: its own session
    assert os.getsid(report["pid"]) == report["pid"]
    stopped = cli("stop", env=runtime)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stderr
    assert not socket.exists()
    gone = cli("status", env=runtime)
    assert gone.returncode != 0 and "no agent answers" in gone.stderr
    again = cli("stop", env=runtime)
    assert again.returncode == 0 and "nothing to stop" in again.stdout, again.stderr
    assert "start one" not in again.stdout + again.stderr
    log = (socket.parent / "agent.log").read_text()
    assert "serving on" in log and "stopped by a local client" in log


def test_an_agent_whose_queue_is_full_for_a_moment_still_answers(tmp_path: Path) -> None:
    """A busy agent (its socket's queue full until it accepts again) is one that answers, not a dead one:
    a connect that failed at once with EAGAIN had the caller start a second agent beside it."""
    import contextlib
    import socket as so
    import threading

    from tierstore import agent

    path = tmp_path / "agent.sock"
    with so.socket(so.AF_UNIX, so.SOCK_STREAM) as listener, so.socket(so.AF_UNIX, so.SOCK_STREAM) as waiting:
        listener.bind(str(path))
        listener.listen(0)  # one connection fills the queue
        waiting.connect(str(path))
        accepted: list[so.socket] = []

        def accept_later() -> None:
            time.sleep(0.3)
            listener.settimeout(5)  # the second connection never comes when the first try gave up
            with contextlib.suppress(TimeoutError):
                accepted.extend(listener.accept()[0] for _ in range(2))

        drain = threading.Thread(target=accept_later)
        drain.start()
        asked = time.monotonic()
        try:
            answered, took = agent.answers(path), time.monotonic() - asked
        finally:
            drain.join(timeout=10)
            for s in accepted:
                s.close()
    assert answered, "a busy agent taken for a dead one"
    assert took >= 0.25, f"answered in {took:.3f} s, before the queue had room"


def test_an_agent_started_on_demand_exits_when_idle(runtime: dict[str, str]) -> None:
    started = cli("start", "--idle-exit", "0.5", env=runtime)
    assert started.returncode == 0, started.stderr
    # The pid as `start` says it: a `status` after it may come after the half second (a busy machine).
    found = re.search(r"\(pid (\d+)\)", started.stdout)
    assert found, started.stdout
    pid = int(found.group(1))
    deadline = time.monotonic() + 20
    while not exited(pid):
        if time.monotonic() > deadline:
            pytest.fail("an idle agent did not exit")
        time.sleep(0.1)
    assert cli("status", env=runtime).returncode != 0


def test_listening_needs_a_private_random_token_on_loopback_too(
    runtime: dict[str, str], tmp_path: Path
) -> None:
    for address in ("0.0.0.0:0", "127.0.0.1:0"):
        refused = cli("start", "--listen", address, env=runtime)
        assert refused.returncode != 0
        assert "without a token" in refused.stderr and "--token-file" in refused.stderr
    for weak in ("abc", "a" * 32, "0123456789abcdef0123456789abcde"):
        short = tmp_path / "short"
        short.write_text(weak)
        short.chmod(0o600)
        bad = cli("start", "--listen", "127.0.0.1:0", "--token-file", str(short), env=runtime)
        assert bad.returncode != 0 and "does not hold a random secret" in bad.stderr, (weak, bad.stderr)
    token = job_token(tmp_path / "token")
    token.chmod(0o644)
    readable = cli("start", "--listen", "127.0.0.1:0", "--token-file", str(token), env=runtime)
    assert readable.returncode != 0 and f"chmod 600 {token}" in readable.stderr, readable.stderr
    token.chmod(0o600)
    ok = cli("start", "--listen", "127.0.0.1:0", "--token-file", str(token), env=runtime)
    assert ok.returncode == 0, ok.stderr
    report = json.loads(cli("status", "--json", env=runtime).stdout)
    assert report["listen"].startswith("127.0.0.1:") and not report["listen"].endswith(":0")
    assert cli("stop", env=runtime).returncode == 0


def test_config_show_lists_the_cluster_members(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TIERSTORE_", "SLURM_"))}
    run = [sys.executable, "-m", "tierstore.cli", "--source", str(src), "config", "show"]
    env = {**base, "TIERSTORE_SHARING": "partitioned", "SLURM_JOB_NODELIST": "gpu[001-016]"}
    shown = subprocess.run(run, capture_output=True, text=True, env=env, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "sharing partitioned" in shown.stdout and "16 members: gpu001:7078" in shown.stdout
    bad = subprocess.run(
        run, capture_output=True, text=True, env={**base, "TIERSTORE_SHARING": "on"}, timeout=60
    )
    assert bad.returncode != 0 and "cluster.sharing" in bad.stderr and '"partitioned"' in bad.stderr


def test_config_show_says_where_members_and_node_came_from(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    cfg = tmp_path / "ts.toml"
    cfg.write_text('[cluster]\nsharing = "inclusive"\n')
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TIERSTORE_", "SLURM_"))}
    env = {**base, "TIERSTORE_CONFIG": str(cfg), "TIERSTORE_PEERS": "n[1-3]", "TIERSTORE_NODE": "n2"}
    run = [sys.executable, "-m", "tierstore.cli", "--source", str(src), "config", "show"]
    shown = subprocess.run(run, capture_output=True, text=True, env=env, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert f"sharing inclusive  (from {cfg})" in shown.stdout
    assert "3 members: n1:7078, n2:7078, n3:7078  (from $TIERSTORE_PEERS)" in shown.stdout, shown.stdout
    assert "this node: n2:7078  (from $TIERSTORE_NODE)" in shown.stdout, shown.stdout


def test_a_missing_token_file_is_one_message_naming_the_key_the_path_and_the_fix(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    missing = tmp_path / "no" / "token"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TIERSTORE_", "SLURM_"))}
    env = {
        **base,
        "TIERSTORE_SOURCE": str(src),
        "TIERSTORE_TIERS": f"{tmp_path / 'tier'}:1G",
        "TIERSTORE_SHARING": "inclusive",
        "TIERSTORE_PEERS": "127.0.0.1:7700,127.0.0.2:7700",
        "TIERSTORE_TOKEN_FILE": str(missing),
    }
    for argv in (["config", "show"], ["run", "--", "true"], ["status"]):
        p = subprocess.run(
            [sys.executable, "-m", "tierstore.cli", *argv],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert p.returncode != 0, argv
        assert "Traceback" not in p.stderr, p.stderr
        assert "$TIERSTORE_TOKEN_FILE: cluster.token_file" in p.stderr and str(missing) in p.stderr, p.stderr
        assert "no such file" in p.stderr and "head -c 32 /dev/urandom" in p.stderr, p.stderr
    code = (
        "import tierstore\ntry:\n    tierstore.Cache()\nexcept tierstore.ConfigError as e:\n    print(e.key)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert p.stdout.strip() == "cluster.token_file", p.stdout + p.stderr
    # The agent, with the token named in the configuration only, names the key (not a flag never given).
    agent = subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "agent", "run"],
        capture_output=True,
        text=True,
        env={**env, "XDG_RUNTIME_DIR": str(tmp_path)},
        timeout=60,
    )
    assert agent.returncode != 0 and "--token-file" not in agent.stderr, agent.stderr
    assert "token_file" in agent.stderr and str(missing) in agent.stderr, agent.stderr


def test_the_stream_settings_of_an_agent_from_flags_and_configuration(
    runtime: dict[str, str], tmp_path: Path
) -> None:
    """`tierstore agent start` takes the stream flags the README names; `[stream]` and TIERSTORE_STREAM_*
    set the same for agents started on demand; a bad value is one message naming the key."""
    streams = tmp_path / "streams"
    started = cli("start", "--stream-keep", "3", "--stream-dir", str(streams), env=runtime)
    assert started.returncode == 0, started.stderr
    report = json.loads(cli("status", "--json", env=runtime).stdout)
    assert cli("stop", env=runtime).returncode == 0
    assert report["stream_keep"] == 3 and report["stream_dir"] == str(streams), report
    cfg = tmp_path / "ts.toml"
    cfg.write_text(f'[stream]\nkeep = 4\ndir = "{tmp_path / "s2"}"\n')
    env = {**runtime, "TIERSTORE_CONFIG": str(cfg)}
    assert cli("start", env=env).returncode == 0
    report = json.loads(cli("status", "--json", env=env).stdout)
    assert cli("stop", env=env).returncode == 0
    assert report["stream_keep"] == 4 and report["stream_dir"] == str(tmp_path / "s2"), report
    bad = cli("start", env={**env, "TIERSTORE_STREAM_REDIS": "localhost:6379"})
    assert bad.returncode != 0 and "stream.redis" in bad.stderr and "redis://HOST:6379" in bad.stderr
    help_text = cli("run", "--help").stdout
    assert "--stream-redis" in help_text and "--stream-keep" in help_text


def test_status_names_this_node_as_configured_when_a_peer_refuses_it(
    runtime: dict[str, str], tmp_path: Path
) -> None:
    """A peer that refuses this node (another token) is shown down with its whole reason, and the refusal
    names this node as the job knows it (`TIERSTORE_NODE`), not by its host name."""
    import socket

    theirs, mine = job_token(tmp_path / "theirs"), job_token(tmp_path / "mine")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    peer_env = {**runtime, "XDG_RUNTIME_DIR": str(tmp_path / "peer-run")}
    (tmp_path / "peer-run").mkdir()
    assert (
        cli("start", "--listen", f"127.0.0.1:{port}", "--token-file", str(theirs), env=peer_env).returncode
        == 0
    )
    try:
        src = tmp_path / "src"
        src.mkdir()
        env = {
            **runtime,
            "TIERSTORE_SOURCE": str(src),
            "TIERSTORE_TIERS": f"{tmp_path / 'tier'}:1G",
            "TIERSTORE_SHARING": "inclusive",
            "TIERSTORE_PEERS": f"127.0.0.1:{port},127.0.0.2:{port}",
            "TIERSTORE_NODE": f"127.0.0.2:{port}",
            "TIERSTORE_TOKEN_FILE": str(mine),
        }
        shown = subprocess.run(
            [sys.executable, "-m", "tierstore.cli", "status"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert shown.returncode == 0, shown.stderr
        assert f"127.0.0.1:{port} is down: " in shown.stdout, shown.stdout
        assert f'node "127.0.0.2:{port}": wrong token' in shown.stdout, shown.stdout
    finally:
        cli("stop", env=peer_env)


def test_an_agent_whose_port_is_taken_says_so_at_once_with_the_fix(tmp_path: Path) -> None:
    """The port is another process's: the start fails as soon as the agent exits, saying why and what to
    do, not after waiting out its deadline."""
    import socket as sockets

    from tierstore import agent as agent_mod

    taken = sockets.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    token = job_token(tmp_path / "token")
    run = tmp_path / "run"
    run.mkdir()
    socket = run / "tierstore" / "agent.sock"
    began = time.monotonic()
    with pytest.raises(agent_mod.AgentError) as e:
        agent_mod.start(socket, listen=f"127.0.0.1:{port}", token_file=str(token), deadline=10)
    took = time.monotonic() - began
    taken.close()
    message = str(e.value)
    assert "exited at once" in message and "another port" in message and "TIERSTORE_PORT" in message, message
    assert took < 5, f"the failed start took {took:.1f} s"


def test_an_agent_started_for_a_cache_reads_the_settings_the_cache_was_given(tmp_path: Path) -> None:
    """`Cache(object_store=..., s3=..., threads=...)` starts the node's agent with an environment it reads
    the same settings from: the store's as one JSON object in TIERSTORE_OBJECT_STORE, which the engine
    checks as it checks the file's (a bad endpoint is refused, naming the variable)."""
    from tierstore.cache import _agent_env

    def args(endpoint: str) -> tuple[str, list[str], dict[str, object]]:
        store = {"endpoint": endpoint, "retries": 2, "access_key_id": "k", "secret_access_key": "s"}
        return (
            "s3://bucket/p",
            [str(tmp_path / "t0")],
            {"threads": 3, "object_store": store, "s3": {"region": "r"}},
        )

    def engine(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        code = "import tierstore; c = tierstore.Cache(); print(c._core.config()['threads'][0])"
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )

    env = _agent_env(args("http://127.0.0.1:9"))
    assert json.loads(env["TIERSTORE_OBJECT_STORE"]) == {
        "region": "r",
        "endpoint": "http://127.0.0.1:9",
        "retries": "2",
        "access_key_id": "k",
        "secret_access_key": "s",
    }
    ok = engine(env)
    assert ok.returncode == 0 and ok.stdout.strip() == "3", ok.stderr[-2000:]
    refused = engine(_agent_env(args("ftp://127.0.0.1:9")))
    assert refused.returncode != 0
    assert "object_store.endpoint" in refused.stderr and "TIERSTORE_OBJECT_STORE" in refused.stderr, (
        refused.stderr
    )
