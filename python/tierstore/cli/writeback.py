"""`tierstore sync`, and what write-back staging shows in `tierstore status`."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import click

from tierstore import _core
from tierstore.cli.main import human, main
from tierstore.types import WritebackPending


class WritebackRow(WritebackPending):
    """A destination's row of `tierstore status`: what waits, and for how long."""

    oldest_age_s: float | None  # seconds since the oldest pending file was closed


def writeback_status(make: Any) -> list[WritebackRow]:
    """What waits for migration per write-back destination ([] when none is configured)."""

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
    return [
        WritebackRow(
            **r, oldest_age_s=None if r["oldest_ns"] is None else round((now - r["oldest_ns"]) / 1e9, 3)
        )
        for r in rows
    ]


def print_writeback(rows: list[WritebackRow], as_json: bool) -> None:
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
        table.add_row(r["path"], r["stage"], str(r["files"]), human(r["bytes"]), age, str(len(r["errors"])))
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
