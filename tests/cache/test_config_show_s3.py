"""`tierstore config show` of an object store source (s3://, and gs:// for the others): the settings it is
reached with as the engine resolves them (`StoreConfig::shown`: the `[s3]` or `[object_store]` table, the AWS
variables, the profile files, the defaults), each with where it came from; credentials only as set or not
set. No server is needed: nothing is sent to the store until a file is read."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from tests.docs.test_docs_reference import CONFIGURATION, sections
from tests.helpers.cli import tierstore
from tierstore import _core

# What an s3:// source with no other option keys shows, in order: the AWS settings, then tierstore's own keys.
S3_SHOWN = (
    "endpoint",
    "region",
    "profile",
    "access_key_id",
    "secret_access_key",
    "session_token",
    *_core.STORE_KEYS,
)

SECRET = "secret-value-never-printed"
TOKEN = "token-value-never-printed"


def environment(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This process's environment without any AWS_* variable, with a home of its own (no ~/.aws)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {**env, "HOME": str(home), **extra}


def show(tmp_path: Path, *args: str, env: dict[str, str]) -> tuple[str, dict]:
    """`config show` as text and as JSON; neither may print a secret."""
    base = ["--tier", f"{tmp_path / 'tier'}:16M", *args, "config", "show"]
    text = tierstore(*base, env=env)
    assert text.returncode == 0, text.stderr
    as_json = tierstore(*base, "--json", env=env)
    assert as_json.returncode == 0, as_json.stderr
    for out in (text.stdout, text.stderr, as_json.stdout, as_json.stderr):
        assert SECRET not in out and TOKEN not in out
    return text.stdout, json.loads(as_json.stdout)


def line(text: str, key: str) -> str:
    (found,) = [ln.strip() for ln in text.splitlines() if re.match(rf"\s+{key}\s", ln)]
    return found


def test_config_show_prints_the_s3_table_and_hides_the_credentials(tmp_path: Path) -> None:
    config = tmp_path / "tierstore.toml"
    config.write_text(
        'source = "s3://bucket/train"\n'
        "[s3]\n"
        'endpoint = "http://127.0.0.1:8333"\n'
        'region = "eu-west-1"\n'
        'access_key_id = "AKIATEST"\n'
        f'secret_access_key = "{SECRET}"\n'
        f'session_token = "{TOKEN}"\n'
        "retries = 5\n"
        'timeout = "10s"\n'
    )
    # The table overrides the variables, $AWS_ENDPOINT_URL_S3 (which the client prefers) included.
    env = environment(
        tmp_path,
        AWS_ENDPOINT_URL_S3="http://10.0.0.1:1",
        AWS_REGION="us-west-2",
        TIERSTORE_CONFIG=str(config),
    )
    text, shown = show(tmp_path, env=env)
    assert re.search(
        r"^object_store\s+s3://bucket/train\s+\(from " + re.escape(str(config)) + r"\)$", text, re.M
    ), text
    assert line(text, "endpoint") == f"endpoint           http://127.0.0.1:8333  (from {config})"
    assert line(text, "region") == f"region             eu-west-1  (from {config})"
    assert line(text, "access_key_id") == f"access_key_id      set  (from {config})"
    assert line(text, "secret_access_key") == f"secret_access_key  set  (from {config})"
    assert line(text, "session_token") == f"session_token      set  (from {config})"
    assert line(text, "retries") == f"retries            5  (from {config})"
    assert line(text, "timeout") == f"timeout            10s  (from {config})"
    assert line(text, "connect_timeout") == "connect_timeout    5s  (from default)"
    assert line(text, "profile") == "profile            default  (from default)"
    s3 = shown["object_store"]
    assert s3["from"] == str(config)
    assert list(s3["value"]["origins"]) == list(S3_SHOWN)
    assert {k: s3["value"][k] for k in S3_SHOWN} == {
        "endpoint": "http://127.0.0.1:8333",
        "region": "eu-west-1",
        "profile": "default",
        "access_key_id": "set",
        "secret_access_key": "set",
        "session_token": "set",
        "timeout": "10s",
        "connect_timeout": "5s",
        "retries": 5,
        "range_size": "8M",
        "ranges_in_flight": 8,
    }
    assert s3["value"]["origins"]["range_size"] == "default"
    assert s3["value"]["origins"]["endpoint"] == str(config)


def test_config_show_s3_from_the_variables_and_the_profile(tmp_path: Path) -> None:
    aws = tmp_path / "aws"
    aws.mkdir()
    (aws / "config").write_text(
        "[profile train]\nregion = ap-south-1\nendpoint_url = http://127.0.0.1:9000\n[default]\nregion = x\n"
    )
    (aws / "credentials").write_text(
        f"# keys\n[train]\naws_access_key_id = AKIAPROFILE\naws_secret_access_key = {SECRET}\n"
        f"aws_session_token = {TOKEN}\n"
    )
    files = {"AWS_CONFIG_FILE": str(aws / "config"), "AWS_SHARED_CREDENTIALS_FILE": str(aws / "credentials")}
    source = ("--source", "s3://bucket/train")

    text, shown = show(tmp_path, *source, env=environment(tmp_path, AWS_PROFILE="train", **files))
    assert shown["object_store"]["from"] == "default"  # no [s3] table
    assert line(text, "profile") == "profile            train  (from $AWS_PROFILE)"
    assert line(text, "region") == f"region             ap-south-1  (from profile train of {aws / 'config'})"
    assert (
        line(text, "endpoint")
        == f"endpoint           http://127.0.0.1:9000  (from profile train of {aws / 'config'})"
    )
    creds = f"profile train of {aws / 'credentials'}"
    assert line(text, "access_key_id") == f"access_key_id      set  (from {creds})"
    assert line(text, "session_token") == f"session_token      set  (from {creds})"

    # Variables before the profile: a region variable hides the profile's region, a key in the environment
    # hides every credential of the profile (the session token too); AWS when no endpoint is given.
    env = environment(
        tmp_path,
        AWS_PROFILE="train",
        AWS_DEFAULT_REGION="eu-north-1",
        AWS_ACCESS_KEY_ID="AKIAENV",
        AWS_SECRET_ACCESS_KEY=SECRET,
        AWS_CONFIG_FILE=str(tmp_path / "none"),
        AWS_SHARED_CREDENTIALS_FILE=str(aws / "credentials"),
    )
    text, shown = show(tmp_path, *source, env=env)
    assert line(text, "region") == "region             eu-north-1  (from $AWS_DEFAULT_REGION)"
    assert (
        line(text, "endpoint")
        == "endpoint           https://s3.eu-north-1.amazonaws.com  (from default: AWS)"
    )
    assert line(text, "access_key_id") == "access_key_id      set  (from $AWS_ACCESS_KEY_ID)"
    assert line(text, "secret_access_key") == "secret_access_key  set  (from $AWS_SECRET_ACCESS_KEY)"
    assert line(text, "session_token") == "session_token      not set  (from default)"
    assert shown["object_store"]["value"]["session_token"] == "not set"


def test_config_show_prints_no_s3_settings_for_a_directory(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    text, shown = show(tmp_path, "--source", str(tmp_path / "data"), env=environment(tmp_path))
    assert "object_store" not in shown and not re.search(r"^object_store\s", text, re.M)


def test_the_defaults_config_show_prints_are_the_references(tmp_path: Path) -> None:
    _, shown = show(tmp_path, "--source", "s3://bucket/train", env=environment(tmp_path))
    store = shown["object_store"]["value"]
    defaults = {k: store[k] for k in _core.STORE_KEYS if store["origins"][k] == "default"}
    assert set(defaults) == set(_core.STORE_KEYS)
    rows = {}
    for row in sections(CONFIGURATION)["[s3]"].splitlines():
        cells = [c.strip() for c in row.split("|")[1:-1]]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[2]
    for key, default in defaults.items():
        assert rows[key] == (f'`"{default}"`' if isinstance(default, str) else f"`{default}`"), (
            key,
            rows[key],
        )


def test_config_show_prints_the_object_store_table_of_another_store(tmp_path: Path) -> None:
    """A gs:// source: the `[object_store]` table's keys, a key as "set", and tierstore's own keys with
    their defaults; the `[s3]` name still read for an s3:// source is refused for another store."""
    config = tmp_path / "tierstore.toml"
    key = (
        f'{{"gcs_base_url":"http://127.0.0.1:1","disable_oauth":true,"client_email":"","private_key_id":"",'
        f'"private_key":"{SECRET}"}}'
    )
    config.write_text(
        'source = "gs://bucket/train"\n'
        "[object_store]\n"
        f"google_service_account_key = '{key}'\n"
        'timeout = "10s"\n'
    )
    text, shown = show(tmp_path, env=environment(tmp_path, TIERSTORE_CONFIG=str(config)))
    assert re.search(
        r"^object_store\s+gs://bucket/train\s+\(from " + re.escape(str(config)) + r"\)$", text, re.M
    )
    assert line(text, "google_service_account_key") == f"google_service_account_key  set  (from {config})"
    assert line(text, "timeout") == f"timeout                     10s  (from {config})"
    assert line(text, "retries") == "retries                     3  (from default)"
    assert shown["object_store"]["value"]["range_size"] == "8M"
    assert shown["object_store"]["from"] == str(config)

    config.write_text('source = "gs://bucket/train"\n[s3]\nregion = "x"\n')
    refused = tierstore(
        "--tier",
        f"{tmp_path / 'tier'}:16M",
        "config",
        "show",
        env=environment(tmp_path, TIERSTORE_CONFIG=str(config)),
    )
    assert refused.returncode != 0 and "[object_store]" in refused.stderr, refused.stderr
