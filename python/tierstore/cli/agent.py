"""`tierstore agent run|start|status|stop`: the node agent."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click

from tierstore.cli.main import main, socket_option
from tierstore.types import ClusterConfig


@main.group()
def agent() -> None:
    """The node agent: one process per node that serves the node's tiers to its peers, migrates staged
    files and holds model streams.

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
            click.option(
                "--idle-exit", type=float, metavar="SECONDS", help="Exit after this long without a client."
            ),
            click.option(
                "--metrics", metavar="ADDR:PORT", help="Serve Prometheus metrics over HTTP at /metrics."
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

    check_ports(make, settings)
    args = agent_mod.run_args(socket or agent_mod.default_socket(), **settings)
    os.environ.update(make.env)
    os.execv(args[0], args)


def _in_use(addr: str) -> bool:
    """Whether TCP address `addr` (HOST:PORT) is taken on this node: bound as the agent binds (with
    SO_REUSEADDR, so that a port left in TIME_WAIT counts as free). Any other failure (an address of
    another node, a bad port) is left to the agent, whose message names it."""
    import errno
    import socket as sockets

    host, _, port = addr.rpartition(":")
    host = host.strip("[]")
    if not port.isdigit():
        return False
    family = sockets.AF_INET6 if ":" in host else sockets.AF_INET
    with sockets.socket(family, sockets.SOCK_STREAM) as s:
        s.setsockopt(sockets.SOL_SOCKET, sockets.SO_REUSEADDR, 1)
        try:
            s.bind((host or "0.0.0.0", int(port)))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def check_ports(make: Any, settings: dict[str, Any]) -> None:
    """Refuses, naming the flag or setting to change, the TCP addresses the agent would listen on that are
    in use: said here, before the agent starts, a port in use is one line with its fix."""
    taken = "the port is in use (by another agent of this node, or another program): stop that, or"
    listen = settings.get("listen")
    if listen is None:
        cluster: ClusterConfig | None
        try:
            cluster = make().config()["cluster"][0]
        except click.ClickException:
            cluster = None  # no cache configured: the agent reports what it needs
        if cluster is not None and cluster["sharing"] != "off":
            listen = f"{cluster['listen']}:{cluster['port']}"
            if _in_use(listen):
                raise click.ClickException(
                    f"cannot listen on {listen} for peers: {taken} give another port with [cluster] port or "
                    f"$TIERSTORE_PORT (now from {cluster['origins']['port']}), or --listen ADDR:PORT"
                )
    elif _in_use(listen):
        host = listen.rpartition(":")[0]
        raise click.ClickException(
            f"cannot listen on {listen} for peers: {taken} give another port with --listen {host}:PORT"
        )
    metrics = settings.get("metrics")
    if metrics is not None and _in_use(metrics):
        host = metrics.rpartition(":")[0]
        raise click.ClickException(
            f"cannot serve metrics on {metrics}: {taken} give another port with --metrics {host}:PORT"
        )


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
        check_ports(make, settings)
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
    for line in status_lines(json.loads(report)):
        click.echo(line)


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"


def _member_line(m: dict[str, Any]) -> str:
    """One member as this agent sees it (a `PeerView`)."""
    node, address = m.get("node"), m["address"]
    who = address + (f" ({node})" if node and address.rpartition(":")[0] not in (node, "") else "")
    if not m.get("up"):
        seen = (
            "never answered"
            if m.get("last_seen_s") is None
            else f"last seen {_seconds(m['last_seen_s'])} ago"
        )
        return f"{who}: down, {seen}" + (f": {m['last_error']}" if m.get("last_error") else "")
    rtt = f", round trip {m['rtt_ms']:.2f} ms" if m.get("rtt_ms") is not None else ""
    downs = f", down {m['downs']} times before" if m.get("downs") else ""
    return f"{who}: up{rtt}{downs}"


def status_lines(report: dict[str, Any]) -> list[str]:
    """The agent's status report (crates/tierstore-agent/src/status.rs) as lines for a person: a setting
    left unset says what that means, counts read as sentences, nothing is shown as a Python value."""
    from tierstore.cli.main import human

    r = dict(report)
    lines: list[tuple[str, str]] = []

    def say(label: str, text: str) -> None:
        lines.append((label, text))

    say("node", str(r.pop("node", "?")))
    say("pid", str(r.pop("pid", "?")))
    say("protocol", str(r.pop("protocol", "?")))
    say("uptime", _seconds(r.pop("uptime_s", 0.0)))
    say("socket", str(r.pop("socket", "?")))
    listen = r.pop("listen", None)
    say("listen", listen or "no TCP listener: serves this node's processes only (peers need --listen)")
    say(
        "connections",
        f"{r.pop('connections', 0)} open, {r.pop('connections_total', 0)} since start, "
        f"{r.pop('refused', 0)} refused (token or protocol), {r.pop('timeouts', 0)} timed out",
    )
    idle = r.pop("idle_exit_s", None)
    say(
        "idle exit",
        "never: runs until stopped" if idle is None else f"after {_seconds(idle)} without a client",
    )
    members = r.pop("members", None) or []
    say("members", f"{len(members)} other members" if members else "none: no other member is known")
    lines.extend(("", f"  {_member_line(m)}") for m in members)
    job = r.pop("registry_job", None)
    errors = r.pop("registry_errors", 0)
    say("registry", "none" if job is None else f"job {job!r}, {errors} failed calls")
    cache = r.pop("cache", None)
    if cache is None:
        say("cache", "none: the agent serves no source")
    else:
        say("cache", f"{cache.get('source', '?')}")
        say(
            "", f"  {human(cache.get('cached_bytes', 0))} cached of a quota of {human(cache.get('quota', 0))}"
        )
        say("", f"  {human(cache.get('store_bytes', 0))} read from the store")
        say(
            "",
            f"  {cache.get('served_files', 0)} files ({human(cache.get('served_bytes', 0))}) served to peers",
        )
        say(
            "",
            f"  {cache.get('peer_hits', 0)} files ({human(cache.get('peer_bytes', 0))}) received from peers, "
            f"{cache.get('peer_faults', 0)} peer reads failed and went to the store",
        )
    redis = r.pop("stream_redis", None)
    say(
        "streams",
        f"kept in {r.pop('stream_dir', '?')}, {r.pop('stream_keep', '?')} versions per stream besides leased "
        "ones; " + (f"announced in {redis}" if redis else "this node only (no Redis)"),
    )
    wb = r.pop("writeback", None)
    if wb is None:
        say("write-back", "none: the agent migrates no staged file")
    else:
        say(
            "write-back",
            f"{wb.get('migrated_files', 0)} files ({human(wb.get('migrated_bytes', 0))}) migrated, "
            f"{wb.get('failures', 0)} failed attempts, {wb.get('refused_entries', 0)} journal entries and "
            f"{wb.get('refused_stages', 0)} stages refused",
        )
    # What a newer agent reports that this command does not know yet: shown as it came, never as a repr.
    for key, value in r.items():
        text = "none" if value is None else value if isinstance(value, str) else json.dumps(value)
        say(key.replace("_", " "), text)
    width = max(len(label) for label, _ in lines)
    return [f"{label:<{width}}  {text}".rstrip() for label, text in lines]


@agent.command("stop")
@socket_option
def agent_stop(socket: Path | None) -> None:
    """Stop the agent gracefully: it finishes the requests it is serving, then exits."""
    from tierstore import agent as agent_mod

    try:
        click.echo(agent_mod.stop(socket or agent_mod.default_socket()))
    except agent_mod.AgentError as e:
        raise click.ClickException(str(e)) from e
