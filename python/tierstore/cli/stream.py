"""`tierstore stream ls|show|watch`: the node agent's model streams and their consumers."""

from __future__ import annotations

import json
import os
import queue
import time
from pathlib import Path
from typing import Any

import click

from tierstore.cli.main import human, main, socket_option


@main.group()
def stream() -> None:
    """Model streams held by this node's agent (see `tierstore.stream`).

    \b
      tierstore stream ls
      tierstore stream show policy           # versions kept, consumers and their lag
      tierstore stream watch policy          # new versions and consumers' swaps, until Ctrl-C
    """


def _consumer_line(name: str, c: dict[str, Any]) -> str:
    """One consumer of stream `name` (an entry of the agent's `consumers`): what it serves, and its lag."""
    who = f"consumer {c['id']} ({c['label'] or '-'}, pid {c['pid'] if c['pid'] is not None else '?'})"
    if c["serving"] is None:
        told = f"told of {name}@{c['noticed']}" if c["noticed"] else "told of no version yet"
        return f"{who}: reports no version served ({told})"
    lag = (
        "up to date"
        if c["behind"] == 0
        else f"{c['behind']} version{'s' if c['behind'] != 1 else ''} behind for {c['behind_s'] or 0.0:.1f} s"
    )
    return f"{who}: serving {name}@{c['serving']}, {lag}"


def _consumers_of(socket: Path | None, name: str) -> list[dict[str, Any]]:
    """The consumers of stream `name` on this node (none when the agent has no such stream)."""
    for s in _streams(socket)["streams"]:
        if s["name"] == name:
            return list(s.get("consumers", []))
    return []


def _streams(socket: Path | None) -> dict[str, Any]:
    from tierstore import stream as stream_mod

    try:
        return stream_mod.streams(socket)
    except (stream_mod.StreamError, OSError) as e:
        raise click.ClickException(str(e)) from e


@stream.command("ls")
@socket_option
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def stream_ls(socket: Path | None, as_json: bool) -> None:
    """List the streams: latest version, versions kept, subscribers on this node."""
    report = _streams(socket)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"{'stream':<24} {'latest':>7} {'kept':>5} {'size':>10} {'subscribers':>11} {'pulled':>7}")
    for s in report["streams"]:
        size = s["versions"][-1]["nbytes"] if s["versions"] else 0
        click.echo(
            f"{s['name']:<24} {s['latest']:>7} {len(s['versions']):>5} {human(size):>10} "
            f"{s['subscribers']:>11} {s['pulled']:>7}"
        )
    spares = report.get("spare_bytes", 0)
    ahead = f", and {human(spares)} allocated ahead for the next publish" if spares else ""
    click.echo(
        f"shared memory held: {human(report['held_bytes'])} in {report['tensor_files']} tensor files{ahead}"
    )


@stream.command("show")
@socket_option
@click.argument("name")
def stream_show(socket: Path | None, name: str) -> None:
    """Show a stream's kept versions (size, bytes new in each, leases, age) and its consumers, each with
    the version it serves and its lag."""
    report = _streams(socket)
    found = [s for s in report["streams"] if s["name"] == name]
    if not found:
        names = ", ".join(s["name"] for s in report["streams"]) or "none"
        raise click.ClickException(f"no stream {name!r} on this node (streams: {names})")
    s = found[0]
    click.echo(
        f"{name}: latest {s['latest']}, {s['subscribers']} subscribers, {s['pulled']} versions pulled "
        f"({human(s['pulled_bytes'])}), {s['errors']} errors"
        + (f"; last: {s['last_error']}" if s["last_error"] else "")
    )
    click.echo(f"{'version':>8} {'step':>8} {'size':>10} {'new':>10} {'tensors':>8} {'leases':>7} {'age':>8}")
    now = time.time()
    for v in s["versions"]:
        step = "-" if v["step"] is None else v["step"]
        click.echo(
            f"{v['version']:>8} {step:>8} {human(v['nbytes']):>10} {human(v['new_bytes']):>10} "
            f"{v['tensors']:>8} {v['leases']:>7} {now - v['created']:>7.1f}s"
        )
    consumers = s.get("consumers", [])
    relayed = f", {s['relayed']} versions relayed without their tensors" if s.get("relayed") else ""
    click.echo(f"consumers: {len(consumers)}, newest version {s.get('newest', s['latest'])}{relayed}")
    for c in consumers:
        click.echo(f"  {_consumer_line(name, c)}")


@stream.command("watch")
@socket_option
@click.argument("name")
@click.option(
    "--count",
    type=click.IntRange(min=0),
    metavar="N",
    default=0,
    help="Exit after this many new versions, not counting the one already latest when the watch starts "
    "(default 0: until Ctrl-C).",
)
@click.option(
    "--interval", type=float, default=0.5, show_default=True, help="Seconds between looks at the consumers."
)
def stream_watch(socket: Path | None, name: str, count: int, interval: float) -> None:
    """Print each new version of a stream as the agent announces it, then every consumer's lag; and each
    consumer's swap (or departure) as the agent learns of it. The version already latest is printed first;
    --count counts only the versions after it."""
    from tierstore import stream as stream_mod

    # The versions there were before the watch: the subscription announces the latest of them first, and
    # --count waits for as many new ones. Read before subscribing, so that a version committed meanwhile
    # counts as new.
    try:
        before = _streams(socket)["streams"]
    except click.ClickException:
        before = []  # no agent yet: the subscription starts one
    existing = next((s["latest"] or 0 for s in before if s["name"] == name), 0)
    arrived: queue.Queue[Any] = queue.Queue()
    try:
        sub = stream_mod.Subscriber(
            name, socket=socket, on_update=arrived.put, label="tierstore stream watch"
        )
    except (stream_mod.StreamError, OSError) as e:
        raise click.ClickException(str(e)) from e
    streams = _streams(socket)["streams"]
    known = [s["name"] for s in streams if s["latest"]]
    if name not in known:
        # Not an error: a trainer may publish it later. But say what is being waited for.
        click.echo(
            f"no version of stream {name!r} yet (streams on this node: {', '.join(known) or 'none'}); "
            "waiting for its first, Ctrl-C to stop",
            err=True,
        )
    seen = 0
    # What was printed of each consumer (by id): a line is printed again when what it serves changes.
    shown: dict[int, tuple[Any, Any]] = {}

    def consumers(every: bool) -> None:
        try:
            listed = _consumers_of(socket, name)
        except click.ClickException:
            return  # the agent is away (restarting): the subscription reconnects, the next look lists them
        now = {c["id"]: c for c in listed if c["pid"] != os.getpid()}
        for cid, c in now.items():
            state = (c["serving"], c["behind"])
            if every or shown.get(cid) != state:
                click.echo(f"  {_consumer_line(name, c)}")
                shown[cid] = state
        for cid in [cid for cid in shown if cid not in now]:
            click.echo(f"  consumer {cid}: gone")
            del shown[cid]

    try:
        while not count or seen < count:
            try:
                v = arrived.get(timeout=interval)
            except queue.Empty:
                consumers(every=False)
                continue
            if v.version > existing:
                seen += 1
            click.echo(
                f"{v} step {v.step} {human(v.nbytes)} ({human(v.new_bytes)} new), "
                f"{(time.time() - v.created) * 1e3:.1f} ms after its commit"
                + (f"; {sub.skipped} skipped so far" if sub.skipped else "")
            )
            consumers(every=True)
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()
