"""The stores `tierstore::` chains over (`tierstore.fs`), as their fsspec implementations name and configure
them: s3fs's, gcsfs's, adlfs's and fsspec's HTTP options translated into the engine's store settings for
`tierstore.Cache` (`s3=` or `object_store=`), and what has no equivalent refused with a message that names
it, rather than dropped."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tierstore import _core


def _strip_scheme(path: Any) -> str:
    """A path as s3fs, gcsfs and adlfs strip it: bucket/key, without the scheme."""
    path = str(path).removeprefix("tierstore://")
    return path.split("://", 1)[1] if "://" in path else path.lstrip("/")


def _strip_tierstore(path: Any) -> str:
    """A path as fsspec's HTTP filesystem strips it: the whole URL."""
    return str(path).removeprefix("tierstore://")


def _first(*values: Any) -> Any:
    """The first value that is set, as s3fs takes an option given both ways."""
    return next((v for v in values if v), None)


class _Options:
    """A chained target's fsspec options, taken one by one into its store's settings: what is left when the
    store's translation is done has no equivalent in the engine, and is refused rather than dropped (a
    requester-pays flag or a proxy left out would fail later, far from its cause)."""

    def __init__(self, protocol: str, store: _Store, options: Mapping[str, Any]) -> None:
        self.protocol = protocol
        self.store = store
        self.left = {
            name: value
            for name, value in options.items()
            if value is not None
            and name not in _FSSPEC_OWN
            and name not in store.ignored
            and not (name in store.defaults and store.defaults[name] == value)
        }

    def take(self, name: str) -> Any:
        """The option `name` (None when unset), taken: it is translated."""
        return self.left.pop(name, None)

    def refused(self, option: str, why: str) -> ValueError:
        return ValueError(
            f"tierstore::{self.protocol}:// cannot pass {self.store.implementation}'s option {option} to the "
            f"cache ({why}); leave it out, or give the store's own settings as "
            f"tierstore={{'object_store': {{...}}}}: tierstore's keys ({', '.join(_core.STORE_KEYS)}) and "
            f"object_store's for {self.store.name}, such as {self.store.examples} "
            "(docs/reference/configuration.md#object_store)"
        )

    def refuse_rest(self) -> None:
        for name in self.left:
            raise self.refused(name, _WHY_NOT.get(name, "the engine has no equivalent"))


@dataclass(frozen=True)
class _Store:
    """One kind of store the filesystem chains over, as its fsspec implementation names and configures it."""

    name: str  # as messages give it
    scheme: str | None  # of the source URLs the engine takes for it; None: the URL's own (http, https)
    implementation: str  # the fsspec implementation whose options are translated
    keyword: str  # the `tierstore.Cache` keyword of the store's settings
    examples: str  # object_store keys of the store, for messages (the engine's `option_examples`)
    translate: Callable[[_Options], dict[str, Any]]  # the settings; a key whose value is unset is dropped
    ignored: frozenset[str] = frozenset()  # the implementation's options the cache takes the place of
    defaults: Mapping[str, Any] = field(default_factory=dict)  # options that ask nothing at these values

    def settings(self, protocol: str, options: Mapping[str, Any]) -> dict[str, str]:
        """The target's fsspec options as the store's settings for `tierstore.Cache`.

        Raises:
            ValueError: An option has no equivalent in the engine; the message names it and what to
                write instead.
        """
        taken = _Options(protocol, self, options)
        settings = {k: str(v) for k, v in self.translate(taken).items() if v}
        taken.refuse_rest()
        return settings

    def strip(self, path: Any) -> str:
        return _strip_tierstore(path) if self.scheme is None else _strip_scheme(path)

    def url(self, path: str, protocol: str) -> str:
        """The object URL of `path` (as `strip` gives it), as the engine spells it."""
        if self.scheme is None:
            return path if "://" in path else f"{protocol}://{path.lstrip('/')}"
        return f"{self.scheme}://{_strip_scheme(path)}"


# Options of every fsspec filesystem, for its own instance and listing caches and its event loop.
_FSSPEC_OWN = frozenset(
    {
        "skip_instance_cache",
        "use_listings_cache",
        "listings_expiry_time",
        "max_paths",
        "asynchronous",
        "loop",
        "batch_size",
    }
)

# Why some options the implementations share have no equivalent, for the message that refuses one.
_WHY_NOT = {
    "version_aware": "the cache reads the current version of each object",
    **dict.fromkeys(
        ("timeout", "requests_timeout", "connection_timeout", "read_timeout"),
        "the cache's deadlines are its own: object_store={'timeout': '30s', 'connect_timeout': '5s'}",
    ),
    **dict.fromkeys(
        (
            "session",
            "session_kwargs",
            "client_kwargs",
            "config_kwargs",
            "request_session",
            "get_client",
            "credential",
        ),
        "it configures the implementation's Python client, which the cache does not use",
    ),
}


def _s3_settings(options: _Options) -> dict[str, Any]:
    """s3fs's options as `tierstore.Cache`'s `s3=`: its short names, and object_store's `aws_*` keys."""
    take = options.take
    client = {k: v for k, v in (take("client_kwargs") or {}).items() if v is not None}
    settings = {
        "access_key_id": _first(take("key"), take("username"), client.pop("aws_access_key_id", None)),
        "secret_access_key": _first(
            take("secret"), take("password"), client.pop("aws_secret_access_key", None)
        ),
        "session_token": _first(take("token"), client.pop("aws_session_token", None)),
        "endpoint": _first(take("endpoint_url"), client.pop("endpoint_url", None)),
        "region": client.pop("region_name", None),
        "profile": take("profile"),
        "aws_skip_signature": "true" if take("anon") else None,
        "aws_request_payer": "true" if take("requester_pays") else None,
    }
    for name in client:
        raise options.refused(f"client_kwargs['{name}']", "only the endpoint, region and keys are translated")
    if take("use_ssl") is False and not str(settings["endpoint"] or "").startswith("http://"):
        raise options.refused("use_ssl", "give an endpoint_url that starts with http:// instead")
    return settings


_GCSFS_TOKEN_MODES = ("google_default", "cloud", "cache", "browser", "anon")


def _gcs_settings(options: _Options) -> dict[str, Any]:
    """gcsfs's options as object_store's Google Cloud Storage settings (`GoogleConfigKey`)."""
    settings = {"google_base_url": options.take("endpoint_url")}
    token = options.take("token")
    if token == "anon":
        settings["google_skip_signature"] = "true"
    elif isinstance(token, dict):
        if token.get("type") == "authorized_user":
            raise options.refused(
                "token", "a user's credentials reach object_store as a file only: give its path"
            )
        settings["google_service_account_key"] = json.dumps(token)
    elif isinstance(token, (str, os.PathLike)) and token not in _GCSFS_TOKEN_MODES:
        settings[_google_credentials_key(os.fspath(token))] = os.fspath(token)
    elif token not in (None, "google_default", "cloud"):
        # gcsfs's own token cache or browser sign-in, or a Python credentials object: nothing the engine
        # can read. "google_default" and "cloud" ask for what it does without a token: the gcloud default
        # credentials, else the metadata server of a Compute Engine VM.
        raise options.refused(
            "token",
            "give the path of a service account key or of gcloud's application default credentials, a "
            "key as a dict, 'anon', 'google_default' or 'cloud'",
        )
    return settings


def _google_credentials_key(path: str) -> str:
    """object_store's key for a credentials file gcsfs takes as `token`: a service account's key, or a
    user's default credentials (`gcloud auth application-default login`), which object_store reads only
    as application credentials."""
    try:
        with open(path) as f:
            kind = json.load(f).get("type")
    except (OSError, ValueError, AttributeError):
        kind = None  # the engine names the file and what is wrong with it
    return "google_application_credentials" if kind == "authorized_user" else "google_service_account"


def _azure_settings(options: _Options) -> dict[str, Any]:
    """adlfs's options as object_store's Azure Blob Storage settings (`AzureConfigKey`)."""
    take = options.take
    host = take("account_host")
    settings = {
        "azure_storage_account_name": take("account_name"),
        "azure_storage_account_key": take("account_key"),
        "azure_storage_sas_key": (take("sas_token") or "").lstrip("?"),
        "azure_storage_client_id": take("client_id"),
        "azure_storage_client_secret": take("client_secret"),
        "azure_storage_tenant_id": take("tenant_id"),
        "azure_skip_signature": "true" if take("anon") else None,
        "azure_storage_endpoint": f"https://{host}" if host else None,
    }
    connection = take("connection_string")
    if connection:
        # As adlfs does, the connection string overrides the other options.
        settings.update(_azure_connection_settings(str(connection), options))
    return settings


# The parts of an Azure Storage connection string that are object_store keys as they are.
_CONNECTION_STRING_KEYS = {
    "AccountName": "azure_storage_account_name",
    "AccountKey": "azure_storage_account_key",
    "SharedAccessSignature": "azure_storage_sas_key",
    "BlobEndpoint": "azure_storage_endpoint",
}


def _azure_connection_settings(connection: str, options: _Options) -> dict[str, str]:
    """An Azure Storage connection string ("AccountName=...;AccountKey=...;...") as object_store keys."""
    parts: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in connection.split(";"))):
        name, equals, value = part.partition("=")
        if not equals:
            raise options.refused("connection_string", "it has a part that is no NAME=VALUE")
        parts[name] = value
    settings = {key: parts.pop(name) for name, key in _CONNECTION_STRING_KEYS.items() if name in parts}
    if parts.pop("UseDevelopmentStorage", "").lower() == "true":
        settings["azure_storage_use_emulator"] = "true"
    scheme = parts.pop("DefaultEndpointsProtocol", "https")
    suffix = parts.pop("EndpointSuffix", "core.windows.net")
    account = settings.get("azure_storage_account_name")
    if (
        "azure_storage_endpoint" not in settings
        and account
        and (scheme, suffix) != ("https", "core.windows.net")
    ):
        settings["azure_storage_endpoint"] = f"{scheme}://{account}.blob.{suffix}"
    for service in ("QueueEndpoint", "TableEndpoint", "FileEndpoint", "DfsEndpoint"):
        parts.pop(service, None)  # the account's other services: the cache reads blobs only
    for name in parts:
        raise options.refused(f"connection_string (its part {name}=)", "the engine has no equivalent")
    return settings


def _http_settings(options: _Options) -> dict[str, Any]:
    """fsspec's HTTP options: none has an equivalent (the HTTP source sends no credentials or headers of
    its own), and those that matter are refused."""
    del options
    return {}


_S3 = _Store(
    name="S3",
    scheme="s3",
    implementation="s3fs",
    keyword="s3",
    examples="endpoint, region, aws_access_key_id, aws_secret_access_key, aws_virtual_hosted_style_request",
    translate=_s3_settings,
    # How s3fs blocks and caches reads, finds a bucket's region and uploads: the cache reads by ranges of
    # its own, with the region it is given, and writes nothing.
    ignored=frozenset(
        {
            "default_block_size",
            "default_fill_cache",
            "default_cache_type",
            "cache_regions",
            "max_concurrency",
            "fixed_upload_size",
        }
    ),
    defaults={"anon": False, "use_ssl": True, "requester_pays": False, "version_aware": False},
)
_GCS = _Store(
    name="Google Cloud Storage",
    scheme="gs",
    implementation="gcsfs",
    keyword="object_store",
    examples="google_service_account, google_service_account_key, google_base_url, google_skip_signature",
    translate=_gcs_settings,
    # `project` names who pays for listing buckets and making them; `access` and `consistency` matter to
    # writes: the cache lists no buckets and writes nothing.
    ignored=frozenset(
        {
            "project",
            "access",
            "block_size",
            "consistency",
            "cache_timeout",
            "secure_serialize",
            "check_connection",
            "default_location",
        }
    ),
    defaults={"requester_pays": False, "version_aware": False},
)
_AZURE = _Store(
    name="Azure Blob Storage",
    scheme="az",
    implementation="adlfs",
    keyword="object_store",
    examples="azure_storage_account_name, azure_storage_account_key, azure_storage_sas_key, "
    "azure_storage_endpoint, azure_storage_use_emulator",
    translate=_azure_settings,
    # `socket_timeout` does nothing in adlfs any more; `assume_container_exists` spares adlfs a look at
    # the container that the cache never takes.
    ignored=frozenset(
        {
            "blocksize",
            "default_fill_cache",
            "default_cache_type",
            "max_concurrency",
            "socket_timeout",
            "assume_container_exists",
        }
    ),
    defaults={"anon": False, "location_mode": "primary", "version_aware": False},
)
_HTTP = _Store(
    name="HTTP (WebDAV)",
    scheme=None,
    implementation="fsspec's HTTP filesystem",
    keyword="object_store",
    examples="allow_http, allow_invalid_certificates, proxy_url, user_agent",
    translate=_http_settings,
    # How fsspec's HTTP filesystem blocks, caches and finds links in HTML listings: the cache reads by
    # ranges of its own and lists with WebDAV.
    ignored=frozenset(
        {"block_size", "cache_type", "cache_options", "simple_links", "same_scheme", "size_policy", "encoded"}
    ),
)

# The target protocols of a chain, as fsspec's registry names them (`fsspec.registry.known_implementations`;
# adlfs registers `abfss`), and the store each names.
_CHAINED = {
    "s3": _S3,
    "s3a": _S3,
    "gs": _GCS,
    "gcs": _GCS,
    "az": _AZURE,
    "abfs": _AZURE,
    "abfss": _AZURE,
    "http": _HTTP,
    "https": _HTTP,
}


def chained_store(protocol: str | None) -> _Store | None:
    """The store a chain's target protocol names; None for files (no chain, or `file`).

    Raises:
        ValueError: A protocol of no store the engine reads; the message names those it does.
    """
    if protocol in (None, "file", "local"):
        return None
    store = _CHAINED.get(str(protocol))
    if store is None:
        raise ValueError(
            f"tierstore:: chains over {', '.join(p + '://' for p in _CHAINED)} (the stores tierstore reads), "
            f"not {protocol}://; for files on a mount use tierstore:///path"
        )
    return store
