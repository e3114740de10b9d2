"""What the `tierstore` command says when something is wrong (issue #49): one line naming what, where and
the fix, never a traceback, and never a secret; and what it prints when all is well reads as words, not
as Python values."""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path

import pytest

import tierstore
from tests.helpers.cli import cli
from tests.helpers.cli import tierstore as run_tierstore

PASSWORD = "hunter2-never-printed"


def env_without_aws(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This process's environment without any AWS_* or GOOGLE_* variable, with a home of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "GOOGLE_"))}
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {**env, "HOME": str(home), **extra}


def one_line_error(r: object, *expected: str) -> str:
    """The error of a failed command: exit status non-zero, one `Error:` line naming `expected`."""
    assert r.returncode != 0, r.stdout  # type: ignore[attr-defined]
    err: str = r.stderr  # type: ignore[attr-defined]
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), err
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


# Item 0: config show and the engine agree; start-up failures are one line; no password is printed -------


def test_config_show_shows_the_object_store_variable_the_engine_uses(tmp_path: Path) -> None:
    """$TIERSTORE_OBJECT_STORE lays settings over the file's table for the engine: `config show` shows them,
    from the variable, and a secret given there only as set."""
    config = tmp_path / "tierstore.toml"
    config.write_text('source = "s3://bucket/train"\n[s3]\nregion = "eu-west-1"\nretries = 5\n')
    given = {
        "endpoint": "http://127.0.0.1:9000",
        "retries": 7,
        "access_key_id": "AKIATEST",
        "secret_access_key": PASSWORD,
    }
    env = env_without_aws(tmp_path, TIERSTORE_CONFIG=str(config), TIERSTORE_OBJECT_STORE=json.dumps(given))
    base = ["--tier", f"{tmp_path / 'tier'}:16M", "config", "show"]
    text = run_tierstore(*base, env=env)
    assert text.returncode == 0, text.stderr
    assert PASSWORD not in text.stdout + text.stderr
    shown = {ln.split()[0]: ln.strip() for ln in text.stdout.splitlines() if ln.startswith("  ")}
    assert shown["endpoint"] == "endpoint           http://127.0.0.1:9000  (from $TIERSTORE_OBJECT_STORE)"
    assert shown["retries"] == "retries            7  (from $TIERSTORE_OBJECT_STORE)"
    assert shown["region"] == f"region             eu-west-1  (from {config})"
    assert shown["secret_access_key"] == "secret_access_key  set  (from $TIERSTORE_OBJECT_STORE)"
    as_json = json.loads(run_tierstore(*base, "--json", env=env).stdout)
    assert as_json["object_store"]["from"] == f"$TIERSTORE_OBJECT_STORE, {config}"


def test_config_show_of_another_store_shows_the_variable_too(tmp_path: Path) -> None:
    key = '{"gcs_base_url":"http://127.0.0.1:1","disable_oauth":true,"client_email":"","private_key_id":"","private_key":""}'
    env = env_without_aws(
        tmp_path, TIERSTORE_OBJECT_STORE=json.dumps({"google_service_account_key": key, "timeout": "10s"})
    )
    r = run_tierstore(
        "--source", "gs://bucket/train", "--tier", f"{tmp_path / 'tier'}:16M", "config", "show", env=env
    )
    assert r.returncode == 0, r.stderr
    assert re.search(r"^\s+timeout\s+10s\s+\(from \$TIERSTORE_OBJECT_STORE\)$", r.stdout, re.M), r.stdout
    assert re.search(
        r"^\s+google_service_account_key\s+set\s+\(from \$TIERSTORE_OBJECT_STORE\)$", r.stdout, re.M
    )


@pytest.mark.parametrize("command", ["status", "clear --yes", "prefetch gs://bucket/x"])
def test_a_credential_that_cannot_be_read_is_one_line_not_a_traceback(tmp_path: Path, command: str) -> None:
    """GOOGLE_SERVICE_ACCOUNT naming a file that does not exist, or a key that is not one: the command says
    so in one line, names the file or setting, and exits 1."""
    tier = f"{tmp_path / 'tier'}:16M"
    missing = tmp_path / "nope.json"
    env = env_without_aws(tmp_path, GOOGLE_SERVICE_ACCOUNT=str(missing))
    r = run_tierstore("--source", "gs://bucket/train", "--tier", tier, *command.split(), env=env)
    one_line_error(r, str(missing))
    assert r.returncode == 1
    bad_key = tmp_path / "key.json"
    bad_key.write_text("{ not json")
    env = env_without_aws(tmp_path, GOOGLE_SERVICE_ACCOUNT=str(bad_key))
    r = run_tierstore("--source", "gs://bucket/train", "--tier", tier, *command.split(), env=env)
    one_line_error(r)
    assert r.returncode == 1


def test_config_show_prints_the_settings_of_a_credential_that_cannot_be_read(tmp_path: Path) -> None:
    """`config show` reads the configuration only: it asks no store and reads no key, so it still shows
    what is set when the key cannot be read (`status` is what says so)."""
    env = env_without_aws(tmp_path, GOOGLE_SERVICE_ACCOUNT=str(tmp_path / "nope.json"))
    tier = f"{tmp_path / 'tier'}:16M"
    r = run_tierstore("--source", "gs://bucket/train", "--tier", tier, "config", "show", env=env)
    assert r.returncode == 0 and "object_store  gs://bucket/train" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize(
    "url",
    [
        f"https://ann:{PASSWORD}@dav.example.org/data",
        f"s3://ann:{PASSWORD}@bucket/train",
        f"gs://ann:{PASSWORD}@bucket/train",
        f"az://ann:{PASSWORD}@container/train",
        # A password holding an `@` and a `/` of its own is hidden whole.
        f"https://ann:{PASSWORD}@x/y@dav.example.org/data",
    ],
)
def test_a_password_in_the_source_url_is_never_printed(tmp_path: Path, url: str) -> None:
    r = run_tierstore("--source", url, "--tier", f"{tmp_path / 'tier'}:16M", "config", "show")
    said = one_line_error(r, "source = ", "ann:***@", "carries a password")
    for secret in (PASSWORD, PASSWORD[:8], "y@dav"):
        assert secret not in r.stdout + r.stderr, said
    with pytest.raises(tierstore.ConfigError) as e:
        tierstore.Cache(url, [f"{tmp_path / 'tier'}:16M"])
    assert PASSWORD not in str(e.value) and PASSWORD not in repr(e.value)
    assert PASSWORD not in e.value.value and e.value.key == "source"


def test_config_show_hides_the_password_of_the_registry(tmp_path: Path, source: Path, tier: str) -> None:
    env = {
        "TIERSTORE_SHARING": "partitioned",
        "TIERSTORE_REGISTRY": f"redis://:{PASSWORD}@head-node:6379",
        "TIERSTORE_TOKEN_FILE": str(token_file(tmp_path)),
    }
    for as_json in ([], ["--json"]):
        r = cli("--source", str(source), "--tier", f"{tier}:16M", "config", "show", *as_json, env=env)
        assert r.returncode == 0, r.stderr
        assert PASSWORD not in r.stdout + r.stderr and "redis://:***@head-node:6379" in r.stdout


def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(os.urandom(32).hex())
    path.chmod(0o600)
    return path


def test_a_refused_node_list_makes_no_token(tmp_path: Path, source: Path, tier: str) -> None:
    """A configuration refused for its members leaves no token behind: the token is checked after them."""
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "TIERSTORE_SHARING": "partitioned", "TIERSTORE_PEERS": "gpu[001-"}
    r = cli("--source", str(source), "--tier", f"{tier}:16M", "config", "show", env=env)
    assert r.returncode != 0 and "cluster.peers" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (home / ".tierstore").exists()


def test_config_show_makes_no_token(tmp_path: Path, source: Path) -> None:
    """`config show` reads the configuration only: with sharing on it names the token file the job would
    use, and does not make it (a cache makes it when it first asks a peer)."""
    home = tmp_path / "home"
    home.mkdir()
    tier = tmp_path / "tier"
    env = {
        "HOME": str(home),
        "TIERSTORE_SHARING": "partitioned",
        "TIERSTORE_PEERS": "127.0.0.1:7001,127.0.0.2:7001",
    }
    env["TIERSTORE_NODE"] = "127.0.0.1:7001"
    r = cli("--source", str(source), "--tier", f"{tier}:16M", "config", "show", env=env)
    assert r.returncode == 0, r.stderr
    assert f"token {home / '.tierstore' / 'token'}" in r.stdout and "2 members" in r.stdout, r.stdout
    assert not (home / ".tierstore").exists()


def test_the_help_and_the_readme_say_how_stale_a_copy_may_be() -> None:
    """The default revalidate trusts a copy confirmed within 60s: neither --help nor the README may say
    "never stale"; both say within how long a change is seen, the settings table's default."""
    default = next(s for s in tierstore._core.SETTINGS if s["name"] == "revalidate")["default"]
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text().split("\n\n")[1]
    shown = cli("--help").stdout
    for said in (" ".join(readme.split()), " ".join(shown.split())):
        assert not re.search(r"never serv\w* stale", said), said
        assert f"within {default}" in said and "partial" in said, said


# Item 5 -------------------------------------------------------------------------------------------------


def test_a_missing_config_file_given_by_the_flag_names_the_flag(tmp_path: Path) -> None:
    for command in (["status"], ["config", "show"], ["run", "--", "true"]):
        r = cli("--config", str(tmp_path / "nope.toml"), *command)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "--config" in r.stderr and "nope.toml" in r.stderr and "does not exist" in r.stderr, r.stderr
        assert "TIERSTORE_CONFIG" not in r.stderr, r.stderr


def test_prefetch_of_a_missing_path_names_it_and_the_source(source: Path, tier: str) -> None:
    missing = source / "missing"
    r = cli("--source", str(source), "--tier", f"{tier}:16M", "prefetch", "--no-progress", str(missing))
    one_line_error(r, str(missing), "does not exist under the source", str(source))
    assert "Errno" not in r.stderr


def test_agent_run_on_a_port_in_use_names_the_flag_to_change(tmp_path: Path, source: Path, tier: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        sock = str(tmp_path / "agent.sock")
        r = cli("agent", "run", "--socket", sock, "--listen", f"127.0.0.1:{port}")
        one_line_error(r, f"127.0.0.1:{port}", "in use", "--listen 127.0.0.1:PORT")
        r = cli("agent", "run", "--socket", sock, "--metrics", f"127.0.0.1:{port}")
        one_line_error(r, f"127.0.0.1:{port}", "in use", "--metrics 127.0.0.1:PORT")
        # The port of the configuration, with sharing on: the setting is named, and where it came from.
        env = {
            "TIERSTORE_SOURCE": str(source),
            "TIERSTORE_TIERS": f"{tier}:16M",
            "TIERSTORE_SHARING": "partitioned",
            "TIERSTORE_PEERS": f"127.0.0.1:{port}",
            "TIERSTORE_PORT": str(port),
            "TIERSTORE_TOKEN_FILE": str(token_file(tmp_path)),
        }
        r = cli("agent", "run", "--socket", sock, env=env)
        one_line_error(r, f"127.0.0.1:{port}", "in use", "[cluster] port", "from $TIERSTORE_PORT", "--listen")


# Item 6 -------------------------------------------------------------------------------------------------


def test_agent_status_prints_words_not_python_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from tierstore import agent as agent_mod
    from tierstore.cli import main

    report = {
        "node": "gpu001",
        "pid": 4242,
        "protocol": 3,
        "uptime_s": 12.5,
        "socket": "/run/user/1000/tierstore/agent.sock",
        "listen": None,
        "connections": 1,
        "connections_total": 9,
        "refused": 0,
        "timeouts": 0,
        "idle_exit_s": None,
        "members": [
            {
                "address": "gpu002:7078",
                "node": "gpu002",
                "up": True,
                "last_seen_s": 0.4,
                "rtt_ms": 0.25,
                "downs": 0,
                "last_error": None,
            },
            {
                "address": "gpu003:7078",
                "node": None,
                "up": False,
                "last_seen_s": None,
                "rtt_ms": None,
                "downs": 1,
                "last_error": "connection refused",
            },
        ],
        "cache": {
            "source": "/lustre/data",
            "cached_bytes": 3 << 30,
            "quota": 8 << 30,
            "store_bytes": 5 << 30,
            "peer_hits": 2,
            "peer_bytes": 1 << 20,
            "peer_faults": 0,
            "served_files": 4,
            "served_bytes": 2 << 20,
        },
        "registry_job": None,
        "registry_errors": 0,
        "stream_dir": "/dev/shm",
        "stream_keep": 2,
        "stream_redis": None,
        "writeback": None,
        "something_new": {"a": 1},
    }
    monkeypatch.setattr(agent_mod, "status", lambda socket, timeout=10.0: json.dumps(report))
    out = CliRunner().invoke(main, ["agent", "status"]).output
    for python in ("None", "{'", "': ", "[{", "True", "False"):
        assert python not in out, out
    assert re.search(r"^listen\s+no TCP listener", out, re.M), out
    assert "3.0 GiB cached of a quota of 8.0 GiB" in out and "5.0 GiB read from the store" in out, out
    assert "gpu002:7078: up, round trip 0.25 ms" in out and "gpu003:7078: down, never answered" in out, out
    assert re.search(r"^idle exit\s+never", out, re.M) and re.search(
        r'^something new\s+\{"a": 1\}', out, re.M
    )


def test_stream_watch_counts_only_new_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--count 1` on a stream whose version 2 exists: version 2 is printed, not counted; the watch ends
    with version 3."""
    from click.testing import CliRunner

    import tierstore.stream as stream_mod
    from tierstore.cli import main
    from tierstore.stream.version import StreamVersion

    def version(n: int) -> StreamVersion:
        return StreamVersion("m", n, None, 10, 10, 0.0, Path("/nonexistent"))

    class FakeSubscriber:
        skipped = 0

        def __init__(self, name: str, *, on_update: object, **_: object) -> None:
            for n in (2, 3, 4):  # the latest at subscription, then two new ones
                on_update(version(n))  # type: ignore[operator]

        def close(self) -> None:
            pass

    listing = {"streams": [{"name": "m", "latest": 2, "consumers": []}]}
    monkeypatch.setattr(stream_mod, "Subscriber", FakeSubscriber)
    monkeypatch.setattr(stream_mod, "streams", lambda socket=None: listing)
    out = CliRunner().invoke(main, ["stream", "watch", "m", "--count", "1"]).output
    assert [line.split()[0] for line in out.splitlines() if line.startswith("m@")] == ["m@2", "m@3"], out


def test_run_order_summary_says_sizes_in_words(source: Path, tier: str, tmp_path: Path) -> None:
    for i in range(3):
        (source / f"{i}.bin").write_bytes(os.urandom(3000))
    order = tmp_path / "order.txt"
    order.write_text("".join(f"{source / f'{i}.bin'}\n" for i in range(3)))
    r = cli(
        "--source",
        str(source),
        "--tier",
        f"{tier}:16M",
        "run",
        "--order",
        str(order),
        "--budget",
        "4M",
        "--",
        "true",
    )
    assert r.returncode == 0, r.stderr
    (summary,) = [line for line in r.stderr.splitlines() if "of the order" in line]
    assert "budget 4.0 MiB" in summary and re.search(r"at most \d[\d.]* (B|KiB) ahead", summary), summary
    assert "4194304" not in summary


def test_a_quota_without_a_unit_below_a_mebibyte_is_refused(source: Path, tier: str) -> None:
    r = cli("--source", str(source), "--tier", f"{tier}:50", "status")
    one_line_error(r, 'tiers[0].quota = "50"', 'did you mean "50%" or "50G"?', '"50B" if bytes are meant')
    r = cli("--source", str(source), "--tier", f"{tier}:50000B", "status", "--json")
    assert r.returncode == 0, r.stderr
    with pytest.raises(tierstore.ConfigError, match=r'"500000".*did you mean "500000G"\?'):
        tierstore.Cache(source, [f"{tier}:500000"])
    assert tierstore.Cache(source, [(tier, 1 << 20)]).config()["tiers"][0][0]["quota"] == 1 << 20


def test_models_verify_draws_no_bar_off_a_terminal_and_counts_in_words(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    from tierstore.models import Repository

    repo = Repository(tmp_path / "repo")
    repo.save("m", {"w": np.zeros(10, dtype=np.float32)})
    r = cli("models", "--repo", str(repo.root), "verify")
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr  # no progress bar: stderr is not a terminal
    assert "checked 1 tensor of 1 version (" in r.stdout, r.stdout


def test_status_says_when_a_memory_tier_reads_4_kib_at_a_time(tmp_path: Path) -> None:
    """A memory tier on a tmpfs mounted without huge pages (Debian's /dev/shm) reads a copy page by page,
    at about twice a local read's CPU (docs/benchmarks/warm-read.md): `status` says so and how to mount
    it; a tier that reads in large folios (a local disk's page cache) gets no such line."""
    import tempfile

    from tierstore.cli.cache import small_pages

    (tmp_path / "data").mkdir()
    shm = Path(tempfile.mkdtemp(prefix="tierstore-test-", dir="/dev/shm"))
    try:
        for tier, expected in ((shm / "tier", small_pages(str(shm))), (tmp_path / "tier", False)):
            r = run_tierstore("--source", str(tmp_path / "data"), "--tier", f"{tier}:16M", "status")
            assert r.returncode == 0, r.stderr
            said = "mounted without huge pages" in r.stdout
            assert said == expected, r.stdout
            if said:
                assert "mount -o remount,huge=within_size /dev/shm" in r.stdout.replace("\n", ""), r.stdout
    finally:
        import shutil

        shutil.rmtree(shm, ignore_errors=True)
