"""`tierstore run`: any command with its reads of the source served from the cache (the LD_PRELOAD shim)."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from tierstore import _core
from tierstore.cache import Cache
from tierstore.cli.main import human, main


def preload_library() -> str:
    """The path of the LD_PRELOAD shim installed with the package."""
    import tierstore

    here = os.path.dirname(os.path.abspath(tierstore.__file__))  # the shim sits beside the package's face
    found = sorted(n for n in os.listdir(here) if n.startswith("_preload") and n.endswith(".so"))
    if not found:
        raise click.ClickException(
            f"the LD_PRELOAD shim is missing from {here}; reinstall tierstore with `pip install .`"
        )
    return os.path.join(here, found[0])


def site_directory() -> str:
    """The directory whose `sitecustomize` hooks torch's DataLoader in every Python process of the job."""
    import tierstore

    return os.path.join(os.path.dirname(os.path.abspath(tierstore.__file__)), "_site")


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option(
    "--revalidate",
    metavar="always|never|DURATION",
    help="always: ask the store per open; a duration such as 60s: trust a copy confirmed within it; never: "
    "trust the cache for a read-only dataset (no source operation after epoch 1). Overrides revalidate of "
    "the configuration (default: 60s).",
)
@click.option(
    "--order",
    type=click.Path(dir_okay=False),
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
def run(make: Any, revalidate: str | None, order: str | None, budget: str, command: tuple[str, ...]) -> None:
    """Run COMMAND with its reads of the source served from the cache, unchanged.

    \b
    Any program works (Python, C, h5py, PyTorch DataLoader workers): reads of files under the source
    come from the fastest tier holding a copy, each file is fetched once per node, and writes, renames
    and deletes through the source invalidate what they change.

    \b
    Every PyTorch DataLoader of the job prefetches each epoch in its sampler's order when its dataset
    names its files (TIERSTORE_SAMPLER_PREFETCH=off turns it off; -v says what it found). --order gives
    the order of any other program.

    \b
      tierstore --source /lustre/data --tier /dev/shm/ts:50% run -- python train.py --epochs 90
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
            if revalidate and isinstance(cause, _core.ConfigError) and cause.key == "revalidate":
                # The option reached the cache as $TIERSTORE_REVALIDATE: name the option the user gave.
                raise click.BadParameter(
                    f"{revalidate!r}: {cause.problem}; {cause.fix}", param_hint="--revalidate"
                ) from cause
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
    cluster = cache._sharing() if cache is not None else None
    if cluster is not None:
        from tierstore import agent as agent_mod

        try:
            agent_mod.ensure(cluster, env=env)
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
    if cache is not None:
        # Python processes of the job hook torch's DataLoader for sampler-aware prefetch (tierstore.auto_order).
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site_directory(), env.get("PYTHONPATH")) if p)
    if cache is not None and order is not None:
        sys.exit(_run_ordered(cache, order, budget, command, env))
    try:
        os.execvpe(command[0], list(command), env)
    except OSError as e:
        raise click.ClickException(f"cannot run {command[0]!r}: {e.strerror}") from e


def _run_ordered(cache: Cache, order: str, budget: str, command: tuple[str, ...], env: dict[str, str]) -> int:
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
        with open(order, encoding="utf-8") as f:
            lines = f.read().splitlines()
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
        f"them, {p['files_no_room']} left to the readers for want of room, {p['files_failed']} failed; at most {human(p['max_bytes_ahead'])} ahead, budget {human(n)})",
        err=True,
    )
    for message in p["errors"][:5]:
        click.echo(f"tierstore run: {message}", err=True)
    return rc if rc >= 0 else 128 - rc
