"""`tierstore models`: inspect and maintain a model repository."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any

import click

from tierstore.cli.main import human, main


class _RepoOption(click.Option):
    """`--repo`, which every command of the group needs: shown in their usage lines too
    (`tierstore models --repo DIRECTORY ls [OPTIONS]`), where click shows only a group's arguments."""

    def get_usage_pieces(self, ctx: click.Context) -> list[str]:
        return [f"{self.opts[0]} {self.metavar}"]


# The group's usage is its --repo and the command: `tierstore models --repo DIRECTORY COMMAND [ARGS]...`.
@main.group(options_metavar="")
@click.option(
    "--repo",
    cls=_RepoOption,
    envvar="TIERSTORE_MODELS",
    type=click.Path(file_okay=False),
    metavar="DIRECTORY",
    help="The model repository directory (or $TIERSTORE_MODELS). Required.",
)
@click.pass_context
def models(ctx: click.Context, repo: str | None) -> None:
    """Inspect and maintain a model repository (tierstore.models)."""

    # The repository is opened by the command, once its own arguments are parsed: checked here, a missing
    # --repo would answer `tierstore models ls --help` with an error instead of the help.
    def open_repository() -> Any:
        from tierstore.models import Repository, RepositoryError

        if repo is None:
            (param,) = [p for p in models.params if p.name == "repo"]
            raise click.MissingParameter(ctx=ctx, param=param)
        # Every command here works on a repository that exists: opening a mistyped path would create an
        # empty repository there and report no models instead of the mistake.
        try:
            return Repository(repo, create=False)
        except RepositoryError as e:
            raise click.BadParameter(str(e), ctx=ctx, param_hint="'--repo'") from e

    ctx.obj = open_repository


def _pass_repository(f: Callable[..., None]) -> Callable[..., None]:
    """Passes the command the repository of `--repo`, opened when the command runs (see `models`)."""

    @functools.wraps(f)
    @click.pass_obj
    def wrapper(open_repository: Callable[[], Any], *args: Any, **kwargs: Any) -> None:
        f(open_repository(), *args, **kwargs)

    return wrapper


def _count(n: int, noun: str) -> str:
    """`1 version`, `2 versions`."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _split_ref(ref: str) -> tuple[str, str]:
    name, _, version = ref.partition("@")
    return name, version or "latest"


def _models_errors() -> Any:
    from tierstore.models import IntegrityError, RepositoryError

    return (RepositoryError, IntegrityError, ValueError, OSError)


@models.command("ls")
@_pass_repository
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
            human(vs[-1].nbytes),
            human(written),
            human(total - written),
        )
    s = repo.stats()
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    click.echo(
        f"on disk {human(s['stored_bytes'])} for {human(s['logical_bytes'])} of versions "
        f"({human(s['saved_by_dedup'])} saved by dedup)"
    )


@models.command("show")
@click.argument("ref", metavar="NAME[@VERSION]")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@_pass_repository
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
        f"{name}@{info['version']}: {len(info['tensors'])} tensors, {human(info['nbytes'])}, "
        f"{info['layers']} layers, wrote {human(info['written_bytes'])} "
        f"({human(info['deduplicated_bytes'])} already stored)"
    )
    if info["metadata"]:
        click.echo(f"metadata: {json.dumps(info['metadata'])}")
    for t in info["tensors"]:
        click.echo(f"  {t['name']:<50} {t['dtype']:<14} {tuple(t['shape'])!s:<20} {human(t['nbytes'])}")


@models.command("export")
@click.argument("ref", metavar="NAME[@VERSION]")
@click.argument("path", type=click.Path(dir_okay=False))
@_pass_repository
def models_export(repo: Any, ref: str, path: str) -> None:
    """Write a version as a safetensors file."""
    name, version = _split_ref(ref)
    try:
        out = repo.export(name, version, path)
    except _models_errors() as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"wrote {out} ({human(out.stat().st_size)})")


@models.command("verify")
@click.argument("ref", metavar="[NAME[@VERSION]]", required=False)
@click.option(
    "--repair",
    is_flag=True,
    help="Quarantine damaged stored tensors, so that the next save of them writes them anew.",
)
@click.option(
    "--progress/--no-progress",
    default=None,
    help="Show bytes checked, rate and ETA on stderr (default: --progress on a terminal, else --no-progress).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_pass_repository
def models_verify(repo: Any, ref: str | None, repair: bool, progress: bool | None, as_json: bool) -> None:
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
            f"checked {_count(report.tensors, 'tensor')} of {_count(report.versions, 'version')} "
            f"({report.blobs} stored, {human(report.nbytes)}): "
            + (f"{_count(copies, 'stored tensor')} damaged, in {broken}" if copies else "no damage")
        )
        if report.released:
            click.echo(f"released {_count(report.released, 'quarantined tensor')} found intact again")
        if report.damaged:
            if repair:
                already = copies - report.quarantined
                click.echo(
                    f"quarantined {_count(report.quarantined, 'damaged stored tensor')}"
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
@_pass_repository
def models_gc(repo: Any) -> None:
    """Remove packs no version uses and leftovers of crashed saves."""
    r = repo.gc()
    kept = (
        f"; {human(r['bytes_of_deleted_versions'])} of deleted versions stay in packs still in use"
        if r["bytes_of_deleted_versions"]
        else ""
    )
    click.echo(
        f"removed {r['packs_removed']} packs, freed {human(r['bytes_freed'])}{kept}; "
        f"alignment padding {human(r['alignment_padding'])}"
    )
