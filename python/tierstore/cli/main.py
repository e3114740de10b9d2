"""The `tierstore` command line."""

from __future__ import annotations

import json
import os
import queue
import sys
import time
from pathlib import Path
from typing import Any

import click

import tierstore
from tierstore import _core
from tierstore.cache import Cache, check_jobs


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help="TOML configuration file (default: $TIERSTORE_CONFIG, then ./tierstore.toml).",
)
@click.option("--source", help="Source directory to cache (overrides the file and $TIERSTORE_SOURCE).")
@click.option(
    "--tier",
    "tiers",
    multiple=True,
    metavar="PATH[:QUOTA]",
    help="A cache tier, fastest first; repeat for more (overrides the file and $TIERSTORE_TIERS).",
)
@click.option("--policy", type=click.Choice(["fill", "lru", "lfu", "fifo"]), help="Placement policy.")
@click.version_option(tierstore.__version__, prog_name="tierstore")
@click.pass_context
def main(
    ctx: click.Context,
    config_file: str | None,
    source: str | None,
    tiers: tuple[str, ...],
    policy: str | None,
) -> None:
    """tierstore serves training data from the fastest tier of the node (RAM, local NVMe) instead of
    the shared store, fetching each file at most once per node and never serving stale bytes.

    \b
    Configuration comes from a TOML file, then TIERSTORE_* variables, then these options:
      source = "/lustre/datasets/imagenet"
      policy = "fill"            # fill | lru | lfu | fifo
      [[tiers]]
      path = "/dev/shm/tierstore"
      quota = "64G"

    \b
    Examples:
      tierstore --source /lustre/data --tier /dev/shm/ts:32G prefetch /lustre/data/train
      tierstore status
      tierstore config show
    """

    def make() -> Cache:
        try:
            # Commands that only inspect or manage the cache start no agent; `run` starts one itself.
            return Cache(source, list(tiers) or None, policy=policy, config=config_file, start_agent=False)
        except _core.ConfigError as e:
            raise click.ClickException(str(e)) from e

    # `run` hands the same options to the shim through the environment.
    make.env = {  # type: ignore[attr-defined]
        k: v
        for k, v in {
            "TIERSTORE_CONFIG": config_file and os.path.abspath(config_file),
            "TIERSTORE_SOURCE": source and os.path.abspath(source),
            "TIERSTORE_TIERS": ",".join(tiers) or None,
            "TIERSTORE_POLICY": policy,
        }.items()
        if v
    }
    ctx.obj = make


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option(
    "--progress/--no-progress", default=True, show_default=True, help="Show files, bytes, rate and ETA."
)
@click.option(
    "-j",
    "--jobs",
    type=int,
    metavar="N",
    help=f"Files (and directory listings) in flight at once, 1 to {_core.MAX_PREFETCH_JOBS} "
    f"[default: {_core.DEFAULT_PREFETCH_JOBS}].",
)
@click.pass_obj
def prefetch(make: Any, paths: tuple[str, ...], progress: bool, jobs: int | None) -> None:
    """Copy files or whole directories of the source into the cache, many at a time.

    A file that fails is reported by name and the others still land; the exit status is 1 if any failed.
    """
    try:
        check_jobs(jobs)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--jobs") from e
    cache = make()
    cluster = cache.config().get("cluster")
    if cluster is not None:
        from tierstore import agent as agent_mod

        # Files this node owns are served to its peers once prefetched: its agent must run.
        try:
            agent_mod.ensure(cluster[0], env={**os.environ, **make.env})
        except agent_mod.AgentError as e:
            raise click.ClickException(str(e)) from e
    try:
        result = cache.prefetch(list(paths), progress=progress, jobs=jobs)
    except (OSError, _core.TierstoreError) as e:
        raise click.ClickException(str(e)) from e
    failed = result["files_failed"]
    click.echo(
        f"prefetched {result['files_done']} files ({_human(result['bytes_done'])}): "
        f"{result['files_copied']} copied, {result['files_done'] - result['files_copied'] - failed} "
        f"already cached, {failed} not cached"
    )
    if failed:
        errors = result["errors"]
        for message in errors[:_SHOWN_ERRORS]:
            click.echo(f"error: {message}", err=True)
        if failed > _SHOWN_ERRORS:
            click.echo(f"... and {failed - _SHOWN_ERRORS} more", err=True)
        sys.exit(1)


_SHOWN_ERRORS = 20


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the counters as JSON.")
@click.pass_obj
def status(make: Any, as_json: bool) -> None:
    """Show what the cache holds and did: per tier and for the source, node-wide; with sharing on, every
    member of the job too (up or down, what it holds, read from the store, served and received); with
    write-back destinations, the files waiting for the store (files, bytes, oldest age, errors)."""
    writeback = _writeback_status(make)
    try:
        cache = make()
    except click.ClickException:
        if not writeback:  # a job that only writes back has no source
            raise
        _print_writeback(writeback, as_json)
        return
    stats = cache.stats()
    config = cache.config()
    stats["revalidate"] = config["revalidate"][0]
    cluster = config.get("cluster")
    if cluster is not None and cluster[0].get("sharing", "off") != "off":
        from tierstore import agent as agent_mod

        env = {**os.environ, **make.env}
        members = list(cluster[0]["members"])
        if not members and cluster[0].get("registry"):
            # The members are whoever registered: this node's agent knows them.
            local = agent_mod.status(agent_mod.default_socket())
            known = json.loads(local)["members"] if local else []
            members = sorted({cluster[0]["node"], *(m["address"] for m in known)})
        stats["cluster"] = {
            "sharing": cluster[0]["sharing"],
            "registry": cluster[0].get("registry"),
            "members": agent_mod.cluster_status(members, env),
        }
    if writeback:
        stats["writeback"] = writeback
    if as_json:
        click.echo(json.dumps(stats, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    tiers = Table(title="cache tiers", title_justify="left")
    for col in (
        "tier",
        "kind",
        "used / quota",
        "entries",
        "hits",
        "misses",
        "hit rate",
        "served",
        "evictions",
        "faults",
    ):
        tiers.add_column(col, justify="left" if col in ("tier", "kind") else "right")
    for t in stats["tiers"]:
        lookups = t["hits"] + t["misses"]
        rate = f"{100 * t['hits'] / lookups:.1f}%" if lookups else "-"
        used = "unavailable" if t["error"] else f"{_human(t['bytes_used'])} / {_human(t['quota'])}"
        tiers.add_row(
            t["path"],
            t["kind"],
            used,
            str(t["entries"]),
            str(t["hits"]),
            str(t["misses"]),
            rate,
            _human(t["bytes_served"]),
            str(t["evictions"]),
            str(t["faults"]),
        )
    s = stats["source"]
    checked = {
        "always": "every open asks the store",
        "never": "copies are trusted, the store is never asked",
    }.get(stats["revalidate"], f"a copy confirmed within {stats['revalidate']} is trusted")
    source = Table(title=f"source {s['path']}", title_justify="left")
    for col in ("opens", "stats", "reads", "bytes read", "fallbacks", "uncached opens"):
        source.add_column(col, justify="right")
    source.add_row(
        str(s["opens"]),
        str(s["stats"]),
        str(s["reads"]),
        _human(s["bytes_read"]),
        str(s["fallbacks"]),
        str(s["uncached"]),
    )
    # Piped output (CI logs, make) would be cut at 80 columns: give the table the room it needs.
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(tiers)
    console.print(source)
    console.print(f"revalidate {stats['revalidate']}: {checked}", soft_wrap=True)
    for t in stats["tiers"]:
        if t["error"]:
            console.print(f"[yellow]tier {t['path']} is unavailable: {t['error']}[/]")
    if "cluster" in stats:
        c = stats["cluster"]
        table = Table(title=f"cluster ({c['sharing']})", title_justify="left")
        for col in (
            "member",
            "agent",
            "cached / quota",
            "from the store",
            "served",
            "received",
            "peer faults",
        ):
            table.add_column(col, justify="left" if col in ("member", "agent") else "right")
        for m in c["members"]:
            view = m.get("report", {}).get("cache") or {}
            if not m["up"]:
                table.add_row(m["address"], "[red]down[/] (below)", "", "", "", "", "")
                continue
            table.add_row(
                m["address"],
                "[green]up[/]",
                f"{_human(view.get('cached_bytes', 0))} / {_human(view.get('quota', 0))}",
                _human(view.get("store_bytes", 0)),
                _human(view.get("served_bytes", 0)),
                _human(view.get("peer_bytes", 0)),
                str(view.get("peer_faults", 0)),
            )
        console.print(table)
        for m in c["members"]:
            if not m["up"]:
                # Whole, on a line of its own: the reason (an errno, a refusal) must not be cut or wrapped.
                console.print(f"[red]{m['address']} is down:[/] {m['error']}", soft_wrap=True)
    if writeback:
        _print_writeback(writeback, False)


def _writeback_status(make: Any) -> list[dict[str, Any]]:
    """What waits for migration per write-back destination ([] when none is configured)."""
    import time

    saved = dict(os.environ)
    # Only the configuration file matters here; the cache's own options stay arguments.
    if "TIERSTORE_CONFIG" in make.env:
        os.environ["TIERSTORE_CONFIG"] = make.env["TIERSTORE_CONFIG"]
    try:
        rows = _core.Writeback().pending()
    except _core.ConfigError as e:
        raise click.ClickException(str(e)) from e
    finally:
        os.environ.clear()
        os.environ.update(saved)
    now = time.time_ns()
    for r in rows:
        r["oldest_age_s"] = None if r["oldest_ns"] is None else round((now - r["oldest_ns"]) / 1e9, 3)
    return rows


def _print_writeback(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps({"writeback": rows}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    table = Table(title="write-back (files not yet on the shared store)", title_justify="left")
    for col in ("destination", "stage", "pending files", "pending bytes", "oldest", "errors"):
        table.add_column(col, justify="left" if col in ("destination", "stage") else "right")
    for r in rows:
        age = "-" if r["oldest_age_s"] is None else f"{r['oldest_age_s']:.1f} s"
        table.add_row(r["path"], r["stage"], str(r["files"]), _human(r["bytes"]), age, str(len(r["errors"])))
    console.print(table)
    for r in rows:
        for path, attempts, error in r["errors"][:5]:
            console.print(f"[yellow]{path}: {attempts} failed attempt(s): {error}[/]")


@main.command()
@click.argument("path", required=False, type=click.Path())
@click.option(
    "--timeout", type=float, metavar="S", help="Seconds to wait at most (default: the destination's)."
)
@click.pass_obj
def sync(make: Any, path: str | None, timeout: float | None) -> None:
    """Wait until every file written so far under PATH (every write-back destination when omitted) is
    fsynced and checked on the shared store; exit 1, saying what is left and why, if it cannot be."""
    from tierstore import writeback

    if "TIERSTORE_CONFIG" in make.env:
        os.environ["TIERSTORE_CONFIG"] = make.env["TIERSTORE_CONFIG"]
    try:
        writeback.sync(path, timeout)
        dests = [d["path"] for d in _core.Writeback().destinations()]
    except (TimeoutError, _core.TierstoreError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"on the shared store: {path or ', '.join(dests) or 'nothing to sync'}")


@main.command()
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--counters", is_flag=True, help="Reset the counters too.")
@click.pass_obj
def clear(make: Any, yes: bool, counters: bool) -> None:
    """Remove every cached copy of the source from every tier."""
    cache = make()
    if not yes and sys.stdin.isatty():
        click.confirm(f"remove every cached copy of {cache.source}?", abort=True)
    cache.clear()
    if counters:
        cache.reset_counters()
    click.echo(f"cleared the cache of {cache.source}")


def preload_library() -> str:
    """The path of the LD_PRELOAD shim installed with the package."""
    import glob

    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_preload*.so")))
    if not found:
        raise click.ClickException(
            f"the LD_PRELOAD shim is missing from {here}; reinstall tierstore with `pip install .`"
        )
    return found[0]


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option(
    "--revalidate",
    type=click.Choice(["always", "never"]),
    help="never: trust the cache for a read-only dataset (no source operation after epoch 1).",
)
@click.option(
    "--order",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="TIERSTORE_ORDER",
    help="A file listing the files the job will read, one per line, in order: prefetch them ahead of the "
    "reads (also $TIERSTORE_ORDER).",
)
@click.option(
    "--budget",
    default="2G",
    envvar="TIERSTORE_ORDER_BUDGET",
    show_default=True,
    help="With --order: bytes fetched ahead of the reads at most (also $TIERSTORE_ORDER_BUDGET).",
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_obj
def run(make: Any, revalidate: str | None, order: Path | None, budget: str, command: tuple[str, ...]) -> None:
    """Run COMMAND with its reads of the source served from the cache, unchanged.

    \b
    Any program works (Python, C, h5py, PyTorch DataLoader workers): reads of files under the source
    come from the fastest tier holding a copy, each file is fetched once per node, and writes, renames
    and deletes through the source invalidate what they change.

    \b
      tierstore --source /lustre/data --tier /dev/shm/ts:64G run -- python train.py --epochs 90
      tierstore run --order epoch1.txt --budget 4G -- python train.py   # prefetch in the job's order
    """
    env = dict(os.environ)
    env.update(make.env)
    if revalidate:
        env["TIERSTORE_REVALIDATE"] = revalidate
    # Validate here, where the error can be reported well; the shim would only warn and run uncached.
    saved = dict(os.environ)
    os.environ.update(env)
    cache: Cache | None
    try:
        writeback_dests = _core.Writeback().destinations()
        try:
            cache = make()
        except click.ClickException as e:
            # A job that only stages its checkpoints needs no source to read from.
            cause = e.__cause__
            no_source = isinstance(cause, _core.ConfigError) and (cause.key, cause.value) == (
                "source",
                "(unset)",
            )
            if not writeback_dests or not no_source:
                raise
            cache = None
            env["TIERSTORE_WRITEBACK_ONLY"] = "1"  # the shim then stages writes and reads nothing through
    except _core.ConfigError as e:
        raise click.ClickException(str(e)) from e
    finally:
        os.environ.clear()
        os.environ.update(saved)
    if cache is not None and "://" in cache.source:
        raise click.ClickException(
            f"the source {cache.source} is an object store, which programs cannot open as files: "
            "`tierstore run` serves sources on a file system. Read objects with tierstore.open, "
            "tierstore.torch.CachedDataset or fsspec (tierstore::s3://...) instead"
        )
    if cache is None and order is not None:
        raise click.ClickException("--order prefetches from the source, and no source is configured")
    if cache is not None:
        # The source is checked and its symlinks resolved here, once for the whole job: every process the
        # command starts (DataLoader workers, each epoch) would otherwise ask the store again.
        env.update(cache._core.resolved_env())
    cluster = cache.config().get("cluster") if cache is not None else None
    if cluster is not None:
        from tierstore import agent as agent_mod

        try:
            agent_mod.ensure(cluster[0], env=env)
        except agent_mod.AgentError as e:
            raise click.ClickException(str(e)) from e
    if writeback_dests:
        # Files the job writes under a destination are migrated by the node's agent, also after it exits.
        from tierstore import agent as agent_mod

        socket = agent_mod.default_socket()
        if not agent_mod.answers(socket):
            try:
                agent_mod.start(socket, env=env, idle_exit=agent_mod.ON_DEMAND_IDLE_EXIT)
            except agent_mod.AgentError as e:
                if not agent_mod.answers(socket):
                    raise click.ClickException(str(e)) from e
    env["LD_PRELOAD"] = " ".join(p for p in (preload_library(), env.get("LD_PRELOAD")) if p)
    if cache is not None and order is not None:
        sys.exit(_run_ordered(cache, order, budget, command, env))
    try:
        os.execvpe(command[0], list(command), env)
    except OSError as e:
        raise click.ClickException(f"cannot run {command[0]!r}: {e.strerror}") from e


def _run_ordered(cache: Any, order: Path, budget: str, command: tuple[str, ...], env: dict[str, str]) -> int:
    """Runs `command` as a child while this process prefetches the files of `order` ahead of its reads.

    The child's opens (through the shim, in any of its processes) mark what they read in the prefetch's
    read-marks file, named to them by $TIERSTORE_ORDER_MARKS; each read frees its bytes from the budget.
    Returns the child's exit status.
    """
    import signal
    import subprocess

    from tierstore.order import parse_budget

    try:
        n = parse_budget(budget)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--budget") from e
    try:
        lines = order.read_text().splitlines()
    except OSError as e:
        raise click.BadParameter(
            f"{order}: {e.strerror}; give a file listing the job's files one per line, in reading order",
            param_hint="--order",
        ) from e
    paths = [os.path.abspath(line) for line in lines if line.strip()]
    try:
        handle = cache.prefetch_order(paths, budget=n)
    except ValueError as e:  # OutsideSourceError names the path and the source
        raise click.BadParameter(f"{order}: {e}", param_hint="--order") from e
    env["TIERSTORE_ORDER_MARKS"] = handle.marks_path
    try:
        child = subprocess.Popen(list(command), env=env)
    except OSError as e:
        raise click.ClickException(f"cannot run {command[0]!r}: {e.strerror}") from e
    # The job is the child: signals meant for it (Ctrl-C, a scheduler's SIGTERM) are passed on.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    rc = child.wait()
    handle.stop()
    p = handle.progress()
    click.echo(
        f"tierstore run: prefetched {p['files_fetched']} of {p['files_total']} files of the order "
        f"({p['files_cached']} already cached, {p['files_read_first']} read before the prefetch reached "
        f"them, {p['files_failed']} failed; at most {p['max_bytes_ahead']} bytes ahead, budget {n})",
        err=True,
    )
    for message in p["errors"][:5]:
        click.echo(f"tierstore run: {message}", err=True)
    return rc if rc >= 0 else 128 - rc


@main.group()
def agent() -> None:
    """The node agent: one process per node that moves bytes between nodes.

    \b
      tierstore agent run                       # foreground, e.g. under srun --ntasks-per-node=1
      tierstore agent start --idle-exit 600     # a detached daemon that exits when idle
      tierstore agent status
      tierstore agent stop
    """


_socket_option = click.option(
    "--socket",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The agent's Unix socket (default: $XDG_RUNTIME_DIR/tierstore/agent.sock or /tmp/tierstore-UID/).",
)


def _agent_settings(f: Any) -> Any:
    for option in reversed(
        [
            _socket_option,
            click.option("--node", help="This node's name as peers know it (default: the host name)."),
            click.option("--listen", metavar="ADDR:PORT", help="Serve peers on this TCP address."),
            click.option(
                "--token-file",
                type=click.Path(exists=True, dir_okay=False),
                help="The job's shared secret; required to listen beyond loopback.",
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
    if agent_mod.status(socket) is not None:
        click.echo(f"an agent already runs on {socket}")
        return
    try:
        pid, log = agent_mod.start(socket, env={**os.environ, **make.env}, **settings)
    except agent_mod.AgentError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"started the agent (pid {pid}) on {socket}; log: {log}")


@agent.command("status")
@_socket_option
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def agent_status(socket: Path | None, as_json: bool) -> None:
    """Show the agent's node, uptime, listeners and connections."""
    from tierstore import agent as agent_mod

    socket = socket or agent_mod.default_socket()
    report = agent_mod.status(socket)
    if report is None:
        raise click.ClickException(f"no agent answers on {socket}; start one with `tierstore agent start`")
    if as_json:
        click.echo(report.strip())
        return
    for key, value in json.loads(report).items():
        click.echo(f"{key:<18} {value}")


@agent.command("stop")
@_socket_option
def agent_stop(socket: Path | None) -> None:
    """Stop the agent gracefully: it finishes the requests it is serving, then exits."""
    from tierstore import agent as agent_mod

    try:
        click.echo(agent_mod.stop(socket or agent_mod.default_socket()))
    except agent_mod.AgentError as e:
        raise click.ClickException(str(e)) from e


@main.group()
def config() -> None:
    """Inspect the configuration."""


@config.command("show")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@click.pass_obj
def config_show(make: Any, as_json: bool) -> None:
    """Print the effective configuration and where each value came from."""
    cfg = make().config()
    if as_json:
        click.echo(json.dumps({k: {"value": v, "from": o} for k, (v, o) in cfg.items()}, indent=2))
        return
    width = max(len(k) for k in cfg)
    for key, (value, origin) in cfg.items():
        if key == "tiers":
            click.echo(f"{key:<{width}}  (from {origin})")
            for i, t in enumerate(value):
                click.echo(f"  [{i}] {t['path']}  quota {_human(t['quota'])}  {t['kind']}")
        elif key == "cluster":
            click.echo(f"{key:<{width}}  sharing {value['sharing']}  (from {origin})")
            came = value.get("origins", {})
            node = f"  this node: {value['node']}  (from {_node_origin(came.get('node', 'default'))})"
            if value["sharing"] != "off" and value.get("registry") and not value["members"]:
                click.echo(
                    f"  members: whoever registers in {value['registry']} as job {value['job']!r}  "
                    f"(registry from {came.get('registry')}, job from {came.get('job')})"
                )
                click.echo(node)
            elif value["sharing"] != "off":
                members = value["members"]
                shown = ", ".join(members[:4]) + (f" and {len(members) - 4} more" if len(members) > 4 else "")
                click.echo(f"  {len(members)} members: {shown}  (from {came.get('peers')})")
                click.echo(node)
                click.echo(
                    f"  agents listen on {value['listen']}:{value['port']}, token {value['token_file']}"
                )
        else:
            shown = _human(value) if key == "inline_max" else value
            click.echo(f"{key:<{width}}  {shown}  (from {origin})")


def _node_origin(origin: str) -> str:
    return "default: the host name" if origin == "default" else origin


@main.group()
@click.option(
    "--repo",
    envvar="TIERSTORE_MODELS",
    required=True,
    type=click.Path(file_okay=False),
    help="The model repository directory (or $TIERSTORE_MODELS).",
)
@click.pass_context
def models(ctx: click.Context, repo: str) -> None:
    """Inspect and maintain a model repository (tierstore.models)."""
    from tierstore.models import Repository, RepositoryError

    # Every command here works on a repository that exists: opening a mistyped path would create an empty
    # repository there and report no models instead of the mistake.
    try:
        ctx.obj = Repository(repo, create=False)
    except RepositoryError as e:
        raise click.BadParameter(str(e), param_hint="'--repo'") from e


def _split_ref(ref: str) -> tuple[str, str]:
    name, _, version = ref.partition("@")
    return name, version or "latest"


def _models_errors() -> Any:
    from tierstore.models import IntegrityError, RepositoryError

    return (RepositoryError, IntegrityError, ValueError, OSError)


@models.command("ls")
@click.pass_obj
def models_ls(repo: Any) -> None:
    """List models with their versions, sizes and bytes saved by dedup."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"models in {repo.root}", title_justify="left")
    for col in ("model", "versions", "latest", "size", "written", "saved by dedup"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name in repo.models():
        vs = repo.versions(name)
        total = sum(v.nbytes for v in vs)
        written = sum(v.written_bytes for v in vs)
        table.add_row(
            name,
            str(len(vs)),
            str(vs[-1].version),
            _human(vs[-1].nbytes),
            _human(written),
            _human(total - written),
        )
    s = repo.stats()
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    click.echo(
        f"on disk {_human(s['stored_bytes'])} for {_human(s['logical_bytes'])} of versions "
        f"({_human(s['saved_by_dedup'])} saved by dedup)"
    )


@models.command("show")
@click.argument("ref", metavar="NAME[@VERSION]")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@click.pass_obj
def models_show(repo: Any, ref: str, as_json: bool) -> None:
    """Show one version: sizes, dedup, metadata and its tensors."""
    name, version = _split_ref(ref)
    try:
        info = repo.info(name, version)
    except _models_errors() as e:
        raise click.ClickException(str(e)) from e
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(
        f"{name}@{info['version']}: {len(info['tensors'])} tensors, {_human(info['nbytes'])}, "
        f"{info['layers']} layers, wrote {_human(info['written_bytes'])} "
        f"({_human(info['deduplicated_bytes'])} already stored)"
    )
    if info["metadata"]:
        click.echo(f"metadata: {json.dumps(info['metadata'])}")
    for t in info["tensors"]:
        click.echo(f"  {t['name']:<50} {t['dtype']:<14} {tuple(t['shape'])!s:<20} {_human(t['nbytes'])}")


@models.command("export")
@click.argument("ref", metavar="NAME[@VERSION]")
@click.argument("path", type=click.Path(dir_okay=False))
@click.pass_obj
def models_export(repo: Any, ref: str, path: str) -> None:
    """Write a version as a safetensors file."""
    name, version = _split_ref(ref)
    try:
        out = repo.export(name, version, path)
    except _models_errors() as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"wrote {out} ({_human(out.stat().st_size)})")


@models.command("verify")
@click.argument("ref", metavar="[NAME[@VERSION]]", required=False)
@click.option(
    "--repair",
    is_flag=True,
    help="Quarantine damaged stored tensors, so that the next save of them writes them anew.",
)
@click.option(
    "--progress/--no-progress", default=True, show_default=True, help="Show bytes checked, rate and ETA."
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_obj
def models_verify(repo: Any, ref: str | None, repair: bool, progress: bool, as_json: bool) -> None:
    """Check the hash of every stored tensor: of every model, of every version of NAME, or of NAME@VERSION.

    \b
    Exits with status 1 when a tensor is damaged. A damaged copy stays the one a save of the same tensor
    refers to (dedup) until --repair quarantines it; the versions that refer to it stay broken.
      tierstore models --repo /lustre/models verify resnet50@3 --repair
    """
    name, version = (None, None) if ref is None else ref.partition("@")[::2]
    try:
        report = repo.verify(name or None, version or None, repair=repair, progress=progress)
    except _models_errors() as e:
        raise click.ClickException(str(e)) from e
    if as_json:
        from dataclasses import asdict

        click.echo(json.dumps({**asdict(report), "broken_versions": report.broken_versions}, indent=2))
    else:
        for d in report.damaged:
            click.echo(f"damaged: {d}")
        copies = len({(d.pack, d.offset, d.hash) for d in report.damaged})
        broken = ", ".join(report.broken_versions)
        click.echo(
            f"checked {report.tensors} tensors of {report.versions} versions ({report.blobs} stored, "
            f"{_human(report.nbytes)}): "
            + (f"{copies} stored tensors damaged, in {broken}" if copies else "no damage")
        )
        if report.released:
            click.echo(f"released {report.released} quarantined tensors found intact again")
        if report.damaged:
            if repair:
                already = copies - report.quarantined
                click.echo(
                    f"quarantined {report.quarantined} damaged stored tensors"
                    + (f" ({already} already were)" if already else "")
                    + ": the next save of these tensors writes them anew"
                )
                click.echo(
                    f"these versions stay broken: {broken}; restore their packs from a backup, or save "
                    "the models again and delete these versions (Repository.delete)"
                )
            else:
                again = f" {ref}" if ref else ""
                click.echo(
                    f"broken versions: {broken}; to repair, restore their packs from a backup, or run "
                    f"`tierstore models --repo {repo.root} verify{again} --repair` and save the models again"
                )
    if report.damaged:
        sys.exit(1)


@models.command("gc")
@click.pass_obj
def models_gc(repo: Any) -> None:
    """Remove packs no version uses and leftovers of crashed saves."""
    r = repo.gc()
    kept = (
        f"; {_human(r['bytes_of_deleted_versions'])} of deleted versions stay in packs still in use"
        if r["bytes_of_deleted_versions"]
        else ""
    )
    click.echo(
        f"removed {r['packs_removed']} packs, freed {_human(r['bytes_freed'])}{kept}; "
        f"alignment padding {_human(r['alignment_padding'])}"
    )


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
@_socket_option
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
            f"{s['name']:<24} {s['latest']:>7} {len(s['versions']):>5} {_human(size):>10} "
            f"{s['subscribers']:>11} {s['pulled']:>7}"
        )
    click.echo(f"shared memory held: {_human(report['held_bytes'])} in {report['tensor_files']} tensor files")


@stream.command("show")
@_socket_option
@click.argument("name")
def stream_show(socket: Path | None, name: str) -> None:
    """Show a stream's kept versions: size, bytes new in each, leases (consumers still using it)."""
    report = _streams(socket)
    found = [s for s in report["streams"] if s["name"] == name]
    if not found:
        names = ", ".join(s["name"] for s in report["streams"]) or "none"
        raise click.ClickException(f"no stream {name!r} on this node (streams: {names})")
    s = found[0]
    click.echo(
        f"{name}: latest {s['latest']}, {s['subscribers']} subscribers, {s['pulled']} versions pulled "
        f"({_human(s['pulled_bytes'])}), {s['errors']} errors"
        + (f"; last: {s['last_error']}" if s["last_error"] else "")
    )
    click.echo(f"{'version':>8} {'step':>8} {'size':>10} {'new':>10} {'tensors':>8} {'leases':>7} {'age':>8}")
    now = time.time()
    for v in s["versions"]:
        step = "-" if v["step"] is None else v["step"]
        click.echo(
            f"{v['version']:>8} {step:>8} {_human(v['nbytes']):>10} {_human(v['new_bytes']):>10} "
            f"{v['tensors']:>8} {v['leases']:>7} {now - v['created']:>7.1f}s"
        )
    consumers = s.get("consumers", [])
    relayed = f", {s['relayed']} versions relayed without their tensors" if s.get("relayed") else ""
    click.echo(f"consumers: {len(consumers)}, newest version {s.get('newest', s['latest'])}{relayed}")
    for c in consumers:
        click.echo(f"  {_consumer_line(name, c)}")


@stream.command("watch")
@_socket_option
@click.argument("name")
@click.option("--count", type=int, default=0, help="Exit after this many versions (0: until Ctrl-C).")
@click.option(
    "--interval", type=float, default=0.5, show_default=True, help="Seconds between looks at the consumers."
)
def stream_watch(socket: Path | None, name: str, count: int, interval: float) -> None:
    """Print each new version of a stream as the agent announces it, then every consumer's lag; and each
    consumer's swap (or departure) as the agent learns of it."""
    from tierstore import stream as stream_mod

    arrived: queue.Queue[Any] = queue.Queue()
    try:
        sub = stream_mod.Subscriber(
            name, socket=socket, on_update=arrived.put, label="tierstore stream watch"
        )
    except (stream_mod.StreamError, OSError) as e:
        raise click.ClickException(str(e)) from e
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
            seen += 1
            click.echo(
                f"{v} step {v.step} {_human(v.nbytes)} ({_human(v.new_bytes)} new), "
                f"{(time.time() - v.created) * 1e3:.1f} ms after its commit"
                + (f"; {sub.skipped} skipped so far" if sub.skipped else "")
            )
            consumers(every=True)
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()


if __name__ == "__main__":
    main()
