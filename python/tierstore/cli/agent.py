"""`tierstore agent run|start|status|stop`: the node agent."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click

from tierstore.cli.main import main, socket_option


@main.group()
def agent() -> None:
    """The node agent: one process per node that moves bytes between nodes.

    \b
      tierstore agent run                       # foreground, e.g. under srun --ntasks-per-node=1
      tierstore agent start --idle-exit 600     # a detached daemon that exits when idle
      tierstore agent status
      tierstore agent stop
    """


def _agent_settings(f: Any) -> Any:
    for option in reversed(
        [
            socket_option,
            click.option(
                "--node",
                help="This node's name as peers know it (default: [cluster] node, else the host name).",
            ),
            click.option(
                "--listen",
                metavar="ADDR:PORT",
                help="Serve peers on this TCP address (default: with sharing on, [cluster] listen and port; "
                "else no TCP listener).",
            ),
            click.option(
                "--token-file",
                type=click.Path(exists=True, dir_okay=False),
                help="The job's shared secret (default: [cluster] token_file); required to listen beyond loopback.",
            ),
            click.option("--idle-exit", type=float, metavar="SECONDS", help="Exit after this long unused."),
            click.option(
                "--metrics", metavar="ADDR:PORT", help="Serve Prometheus metrics over HTTP here (/metrics)."
            ),
            click.option(
                "--stream-redis",
                metavar="URL",
                help="Announce model stream versions in this Redis and follow other nodes' there "
                "(redis://HOST:PORT; default: [stream] redis, TIERSTORE_STREAM_REDIS, else [cluster] registry).",
            ),
            click.option(
                "--stream-keep",
                type=click.IntRange(min=1),
                metavar="N",
                help="Model stream versions kept per stream besides those a consumer holds (default: "
                "[stream] keep, TIERSTORE_STREAM_KEEP, else 2).",
            ),
            click.option(
                "--stream-dir",
                type=click.Path(file_okay=False),
                help="Where stream versions are kept (default: [stream] dir, TIERSTORE_STREAM_DIR, else /dev/shm).",
            ),
        ]
    ):
        f = option(f)
    return f


@agent.command("run")
@_agent_settings
@click.pass_obj
def agent_run(make: Any, socket: Path | None, **settings: Any) -> None:
    """Run the agent in the foreground until stopped (SIGTERM, `tierstore agent stop`).

    It serves the files of the source configured for the job (--source and --tier before `agent`,
    tierstore.toml or TIERSTORE_*) to the other nodes, as [cluster] says."""
    from tierstore import agent as agent_mod

    args = agent_mod.run_args(socket or agent_mod.default_socket(), **settings)
    os.environ.update(make.env)
    os.execv(args[0], args)


@agent.command("start")
@_agent_settings
@click.pass_obj
def agent_start(make: Any, socket: Path | None, **settings: Any) -> None:
    """Start the agent as a detached daemon, and return once it answers."""
    from tierstore import agent as agent_mod

    socket = socket or agent_mod.default_socket()
    try:
        if agent_mod.status(socket) is not None:
            click.echo(f"an agent already runs on {socket}")
            return
        pid, log = agent_mod.start(socket, env={**os.environ, **make.env}, **settings)
    except agent_mod.AgentError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"started the agent (pid {pid}) on {socket}; log: {log}")


@agent.command("status")
@socket_option
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def agent_status(socket: Path | None, as_json: bool) -> None:
    """Show the agent's node, uptime, listeners and connections."""
    from tierstore import agent as agent_mod

    socket = socket or agent_mod.default_socket()
    try:
        report = agent_mod.status(socket)
    except agent_mod.AgentError as e:
        raise click.ClickException(str(e)) from e
    if report is None:
        raise click.ClickException(f"no agent answers on {socket}; start one with `tierstore agent start`")
    if as_json:
        click.echo(report.strip())
        return
    for key, value in json.loads(report).items():
        click.echo(f"{key:<18} {value}")


@agent.command("stop")
@socket_option
def agent_stop(socket: Path | None) -> None:
    """Stop the agent gracefully: it finishes the requests it is serving, then exits."""
    from tierstore import agent as agent_mod

    try:
        click.echo(agent_mod.stop(socket or agent_mod.default_socket()))
    except agent_mod.AgentError as e:
        raise click.ClickException(str(e)) from e
