"""`tierstore prefetch`, `status`, `clear` and `config show`: the node's cache."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click

from tierstore import _core
from tierstore.cache import Cache, check_jobs
from tierstore.cli.main import human, main, os_error
from tierstore.cli.writeback import print_writeback, writeback_status
from tierstore.types import CacheConfig, ClusterConfig, TierConfig


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
    cache: Cache = make()
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
    except FileNotFoundError as e:
        missing = os.fsdecode(e.filename) if e.filename is not None else " ".join(paths)
        raise click.ClickException(
            f"{missing} does not exist under the source {cache.source}; give files or directories of the "
            "source (`ls` it to check the name)"
        ) from e
    except OSError as e:
        raise click.ClickException(os_error(e)) from e
    except _core.TierstoreError as e:
        raise click.ClickException(str(e)) from e
    failed = result["files_failed"]
    click.echo(
        f"prefetched {result['files_done']} files ({human(result['bytes_done'])}): "
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
    """Show what the cache holds and did, node-wide: per tier and for the source, with the revalidate mode.
    With sharing on, every member of the job too (up or down, what it holds, read from the store, served
    and received); with write-back destinations, the files waiting for the store (files, bytes, oldest
    age, errors); for each running DataLoader with sampler-aware prefetch, where its files came from
    (the dataset's list, or learned from the first epoch), its epoch, how far its readers are and what
    its last epoch's prefetch did."""
    writeback = writeback_status(make)
    try:
        cache: Cache = make()
    except click.ClickException:
        if not writeback:  # a job that only writes back has no source
            raise
        print_writeback(writeback, as_json)
        return
    stats = cache.stats()
    config = cache.config()
    # The counters, and what else the command shows: printed whole by --json.
    report: dict[str, Any] = {**stats, "revalidate": config["revalidate"][0]}
    cluster = config.get("cluster")
    if cluster is not None and cluster[0].get("sharing", "off") != "off":
        from tierstore import agent as agent_mod

        env = {**os.environ, **make.env}
        members = list(cluster[0]["members"])
        if not members and cluster[0].get("registry"):
            # The members are whoever registered: this node's agent knows them.
            try:
                local = agent_mod.status(agent_mod.default_socket())
            except agent_mod.AgentError:
                local = None  # not this user's agent: its members are not to be believed
            known = json.loads(local)["members"] if local else []
            members = sorted({cluster[0]["node"], *(m["address"] for m in known)})
        report["cluster"] = {
            "sharing": cluster[0]["sharing"],
            "registry": cluster[0].get("registry"),
            "members": agent_mod.cluster_status(members, env),
        }
    if writeback:
        report["writeback"] = writeback
    from tierstore import prefetch_report

    report["loaders"] = prefetch_report.read_all(cache._core.order_dir())
    if as_json:
        click.echo(json.dumps(report, indent=2))
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
        used = "unavailable" if t["error"] else f"{human(t['bytes_used'])} / {human(t['quota'])}"
        tiers.add_row(
            t["path"],
            t["kind"],
            used,
            str(t["entries"]),
            str(t["hits"]),
            str(t["misses"]),
            rate,
            human(t["bytes_served"]),
            str(t["evictions"]),
            str(t["faults"]),
        )
    s = stats["source"]
    checked = {
        "always": "every open asks the store",
        "never": "copies are trusted, the store is never asked",
    }.get(report["revalidate"], f"a copy confirmed within {report['revalidate']} is trusted")
    source = Table(title=f"source {s['path']}", title_justify="left")
    for col in ("opens", "stats", "reads", "bytes read", "fallbacks", "uncached opens"):
        source.add_column(col, justify="right")
    source.add_row(
        str(s["opens"]),
        str(s["stats"]),
        str(s["reads"]),
        human(s["bytes_read"]),
        str(s["fallbacks"]),
        str(s["uncached"]),
    )
    # Piped output (CI logs, make) would be cut at 80 columns: give the table the room it needs.
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(tiers)
    console.print(source)
    console.print(f"revalidate {report['revalidate']}: {checked}", soft_wrap=True)
    if report["loaders"]:
        console.print(loaders_table(report["loaders"]))
    for t in stats["tiers"]:
        if t["error"]:
            console.print(f"[yellow]tier {t['path']} is unavailable: {t['error']}[/]")
        elif t["kind"] == "memory" and small_pages(t["path"]):
            console.print(
                f"tier {t['path']} is on a tmpfs mounted without huge pages, which reads a copy 4 KiB at a "
                "time: a warm read costs about twice the CPU of a local file's (docs/benchmarks/warm-read.md). "
                f"Mounted with huge=within_size (as root: mount -o remount,huge=within_size {mount_of(t['path'])}), "
                "it reads as the page cache does.",
                soft_wrap=True,
            )
    if "cluster" in report:
        c = report["cluster"]
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
                f"{human(view.get('cached_bytes', 0))} / {human(view.get('quota', 0))}",
                human(view.get("store_bytes", 0)),
                human(view.get("served_bytes", 0)),
                human(view.get("peer_bytes", 0)),
                str(view.get("peer_faults", 0)),
            )
        console.print(table)
        for m in c["members"]:
            if not m["up"]:
                # Whole, on a line of its own: the reason (an errno, a refusal) must not be cut or wrapped.
                console.print(f"[red]{m['address']} is down:[/] {m['error']}", soft_wrap=True)
            elif c["registry"] and m["report"].get("registry_errors"):
                console.print(
                    f"[yellow]{m['address']}: {m['report']['registry_errors']} registry errors[/] (calls to "
                    f"{c['registry']} that failed, and entries there not written with the job's token)",
                    soft_wrap=True,
                )
    if writeback:
        print_writeback(writeback, False)


def loaders_table(loaders: list[dict[str, Any]]) -> Any:
    """The running DataLoaders' sampler-aware prefetches: where each found its files, its epoch, how far
    its readers are, and what the epoch before did."""
    from rich.table import Table

    table = Table(title="sampler-aware prefetch (DataLoaders)", title_justify="left")
    for col in (
        "process",
        "loader",
        "files from",
        "epoch",
        "samples read",
        "files ahead",
        "budget",
        "last epoch",
    ):
        table.add_column(col, justify="right" if col in ("process", "epoch", "samples read") else "left")
    for r in loaders:
        last = r.get("last_epoch") or {}
        table.add_row(
            str(r.get("pid")),
            str(r.get("loader")),
            str(r.get("found")),
            str(r.get("epoch")),
            (
                f"{r['shards_opened']} shards opened"
                if "shards_opened" in r
                else f"{r.get('read', '?')} / {r.get('samples')}"
            ),
            f"{r.get('files')} files"
            if r.get("files")
            else "none yet"
            if "shards_opened" in r
            else "none yet (learning)",
            human(r["budget"]) if isinstance(r.get("budget"), int) else "-",
            (
                f"{last['files_fetched']} of {last['files_total']} fetched, {last['files_read_first']} read first, "
                f"{last.get('files_no_room', 0)} no room, {last['files_failed']} failed"
                if last
                else "-"
            ),
        )
    return table


@main.command()
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--counters", is_flag=True, help="Reset the counters too.")
@click.pass_obj
def clear(make: Any, yes: bool, counters: bool) -> None:
    """Remove every cached copy of the source from every tier, asking first on a terminal (--yes does not)."""
    cache = make()
    if not yes and sys.stdin.isatty():
        click.confirm(f"remove every cached copy of {cache.source}?", abort=True)
    cache.clear()
    if counters:
        cache.reset_counters()
    click.echo(f"cleared the cache of {cache.source}")


@main.group()
def config() -> None:
    """Inspect the configuration."""


@config.command("show")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@click.pass_obj
def config_show(make: Any, as_json: bool) -> None:
    """Print the effective configuration and where each value came from.

    It reads the configuration only: it asks no store, prints no credential and makes no job token
    (`tierstore status` opens the cache and says what is wrong with the source).
    """
    config: CacheConfig = make.settings()
    registry = config["cluster"][0]["registry"]
    if registry:
        # A Redis URL may carry the server's password: shown as ***, like every secret here.
        config["cluster"][0]["registry"] = without_password(registry)
    # Each key as (value, origin); an object store's settings as the engine resolves them.
    cfg: dict[str, Any] = {**config}
    if as_json:
        click.echo(json.dumps({k: {"value": v, "from": o} for k, (v, o) in cfg.items()}, indent=2))
        return
    width = max(len(k) for k in cfg)
    for key, (value, origin) in cfg.items():
        if key == "tiers":
            tiers: list[TierConfig] = value
            click.echo(f"{key:<{width}}  (from {origin})")
            for i, t in enumerate(tiers):
                click.echo(f"  [{i}] {t['path']}  quota {human(t['quota'])}  {t['kind']}")
        elif key == "cluster":
            _echo_cluster(value, origin, width)
        elif key == "object_store":
            click.echo(f"{key:<{width}}  {cfg['source'][0]}  (from {origin})")
            pad = max(len(k) for k in value["origins"])
            for k, where in value["origins"].items():
                click.echo(f"  {k:<{pad}}  {value[k]}  (from {where})")
        else:
            shown = human(value) if key == "inline_max" else value
            click.echo(f"{key:<{width}}  {shown}  (from {origin})")


def _echo_cluster(cluster: ClusterConfig, origin: str, width: int) -> None:
    """The `cluster` lines of `config show`: how the nodes share, who the members are, this node."""
    click.echo(f"{'cluster':<{width}}  sharing {cluster['sharing']}  (from {origin})")
    came = cluster["origins"]
    node = f"  this node: {cluster['node']}  (from {_node_origin(came['node'])})"
    if cluster["sharing"] != "off" and cluster["registry"] and not cluster["members"]:
        click.echo(
            f"  members: whoever registers in {cluster['registry']} as job {cluster['job']!r}  "
            f"(registry from {came['registry']}, job from {came['job']})"
        )
        click.echo(node)
    elif cluster["sharing"] != "off":
        members = cluster["members"]
        shown = ", ".join(members[:4]) + (f" and {len(members) - 4} more" if len(members) > 4 else "")
        click.echo(f"  {len(members)} members: {shown}  (from {came['peers']})")
        click.echo(node)
        frames = "encrypted" if cluster["encrypt"] else "tagged, not encrypted"
        click.echo(
            f"  agents listen on {cluster['listen']}:{cluster['port']}, token {cluster['token_file']}, "
            f"frames {frames}"
        )


def mount_of(path: str) -> str:
    """The mount point `path` is on (the longest that holds it)."""
    return _mount(path)[0]


def small_pages(path: str) -> bool:
    """Whether `path` is on a tmpfs that reads its files a 4 KiB page at a time: mounted without `huge=`,
    or with `huge=never` (Debian's /dev/shm)."""
    _, fstype, options = _mount(path)
    huge = next((o for o in options.split(",") if o.startswith("huge=")), "huge=never")
    return fstype == "tmpfs" and huge in ("huge=never", "huge=deny")


def _mount(path: str) -> tuple[str, str, str]:
    """The mount `path` is on, the longest that holds it (the latest, where one was mounted over another):
    mount point, file system type, options."""
    holding = [m for m in _mounts() if path == m[0] or path.startswith(m[0].rstrip("/") + "/")]
    return max(reversed(holding), key=lambda m: len(m[0]), default=("/", "", ""))


def _mounts() -> list[tuple[str, str, str]]:
    """Every mount of this process's namespace: mount point, file system type, options."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return []
    return [(f[1], f[2], f[3]) for f in (ln.split() for ln in lines) if len(f) >= 4]


def without_password(url: str) -> str:
    """`url` with the password of its userinfo (`redis://user:password@host`) written `***`, hidden up to
    the last `@` as the engine hides it (`without_password`, crates/tierstore-core/src/config/values.rs)."""
    scheme, sep, rest = url.partition("://")
    user, colon, _ = rest.partition("@")[0].partition(":")
    if not sep or "@" not in rest or not colon or "/" in user:
        return url
    return f"{scheme}://{user}:***@{rest.rpartition('@')[2]}"


def _node_origin(origin: str) -> str:
    return "default: the host name" if origin == "default" else origin
