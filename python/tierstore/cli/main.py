"""The root of the `tierstore` command: its options (the cache they describe) and the formatting every command
shares. Each group of commands is a module of its own beside this one."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar, cast

import click

import tierstore
from tierstore import _core
from tierstore.cache import Cache, effective_config

if TYPE_CHECKING:
    from tierstore.types import Setting

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., object])


def human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def os_error(e: OSError) -> str:
    """An OSError as one line: the file and what is wrong with it, without Python's `[Errno N]`."""
    what = e.strerror or str(e)
    if e.filename is None:
        return what
    return f"{os.fsdecode(e.filename)}: {what[:1].lower()}{what[1:]}"


def _setting(name: str) -> Setting:
    """The setting `name` of the settings table (`_core.SETTINGS`): what its option takes and says."""
    # The stub gives the rows as plain dicts (see _core.pyi); each is a Setting.
    return cast("Setting", next(s for s in _core.SETTINGS if s["name"] == name))


def _choices(name: str) -> list[str]:
    """The words the setting `name` takes, for its option's `click.Choice`."""
    choices = _setting(name)["choices"]
    if choices is None:
        raise TypeError(f"the setting {name} is not a choice in the settings table (config/settings.rs)")
    return choices


# The level of $TIERSTORE_LOG each -v asks for.
VERBOSITY = ("info", "debug", "trace")


# The module of `tierstore.cli` that adds each command to the root as it is imported (`@main.command`).
COMMAND_MODULES = {
    "agent": "agent",
    "clear": "cache",
    "config": "cache",
    "models": "models",
    "prefetch": "cache",
    "run": "run",
    "status": "cache",
    "stream": "stream",
    "sync": "writeback",
}


class _Commands(click.Group):
    """The root group. Each command's module is imported only when the command is asked for: `tierstore run`
    starts every job, and should not first import the models, stream, agent and cache commands."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMAND_MODULES)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        module = COMMAND_MODULES.get(name)
        if module is not None and name not in self.commands:
            importlib.import_module(f"tierstore.cli.{module}")
        return super().get_command(ctx, name)


@click.group(
    cls=_Commands, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}
)
@click.option(
    "--config",
    "config_file",
    # Checked here, where the message can name the flag (the engine would blame $TIERSTORE_CONFIG, which
    # `status` and `run` pass the file on in).
    type=click.Path(exists=True, dir_okay=False),
    help="The TOML configuration file (default: $TIERSTORE_CONFIG, then ./tierstore.toml).",
)
@click.option(
    "--source",
    help="The source to cache: a directory, or an object store URL (s3://, gs://, az://, http(s)://) "
    "(overrides the file and $TIERSTORE_SOURCE).",
)
@click.option(
    "--tier",
    "tiers",
    multiple=True,
    metavar="PATH[:QUOTA]",
    help="A cache tier, fastest first; repeat for more (overrides the file and $TIERSTORE_TIERS).",
)
@click.option("--policy", type=click.Choice(_choices("policy")), help=_setting("policy")["doc"])
@click.option(
    "-v",
    "--verbose",
    count=True,
    help="Say more on stderr: -v what the agent and write-back do, -vv what the cache decides for each file "
    "and why (hit, miss, fetch, peer, confirm, fallback), -vvv everything. Sets $TIERSTORE_LOG for the "
    "commands `run` starts.",
)
@click.version_option(tierstore.__version__, prog_name="tierstore")
@click.pass_context
def main(
    ctx: click.Context,
    config_file: str | None,
    source: str | None,
    tiers: tuple[str, ...],
    policy: str | None,
    verbose: int,
) -> None:
    """tierstore serves training data from the fastest tier of the node (RAM, local NVMe) instead of
    the shared store, fetching each file at most once per node. It never serves partial bytes, and sees
    a file changed on the store within 60s by default (revalidate).

    \b
    Configuration comes from a TOML file, then TIERSTORE_* variables, then these options:
      source = "/lustre/datasets/imagenet"
      policy = "fill"            # fill | lru | lfu | fifo
      [[tiers]]
      path = "/dev/shm/tierstore"
      quota = "50%"              # a size ("64G") or a share of the file system

    \b
    Examples:
      tierstore --source /lustre/data --tier /dev/shm/ts:50% prefetch /lustre/data/train
      tierstore status
      tierstore config show
    """

    if verbose:
        level = VERBOSITY[min(verbose, len(VERBOSITY)) - 1]
        os.environ["TIERSTORE_LOG"] = level
        _core.set_log_level(level)

    def engine_errors(call: Callable[[], T]) -> T:
        try:
            return call()
        except _core.TierstoreError as e:
            # A value refused (ConfigError), or a source its settings cannot reach (credentials that are
            # missing or unreadable): the engine's message says which and what to do.
            raise click.ClickException(str(e)) from e
        except OSError as e:
            raise click.ClickException(os_error(e)) from e

    def make() -> Cache:
        # Commands that only inspect or manage the cache start no agent; `run` starts one itself.
        return engine_errors(
            lambda: Cache(source, list(tiers) or None, policy=policy, config=config_file, start_agent=False)
        )

    # What `make()` would open, read without opening it: `config show` makes nothing on disk.
    make.settings = lambda: engine_errors(  # type: ignore[attr-defined]
        lambda: effective_config(source, list(tiers) or None, policy=policy, config=config_file)
    )
    # `run` hands the same options to the shim through the environment.
    make.env = {  # type: ignore[attr-defined]
        k: v
        for k, v in {
            "TIERSTORE_CONFIG": config_file and os.path.abspath(config_file),
            "TIERSTORE_SOURCE": source and (source if "://" in source else os.path.abspath(source)),
            "TIERSTORE_TIERS": ",".join(tiers) or None,
            "TIERSTORE_POLICY": policy,
        }.items()
        if v
    }
    ctx.obj = make


def socket_option(f: F) -> F:
    """The agent's socket, for every command that talks to this node's agent. (pathlib is imported by
    those commands only: `tierstore run` starts every job, and takes no path that needs it.)"""
    from pathlib import Path

    return click.option(
        "--socket",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="The agent's Unix socket (default: $XDG_RUNTIME_DIR/tierstore/agent.sock, or "
        "/tmp/tierstore-UID/agent.sock, or ~/.tierstore/run-HOST/agent.sock where another user made "
        "/tmp/tierstore-UID first).",
    )(f)
