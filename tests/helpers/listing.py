"""What a listing shows, in a form two listings can be compared in (fsspec's `file` filesystem against
`tierstore://`, a store's backing directory against what a test expects)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def tree(root: Path) -> list[str]:
    """Every path under `root`, relative, directories with a trailing slash."""
    return sorted(
        str(p.relative_to(root)) + ("/" if p.is_dir() else "") for p in root.rglob("*") if p != root
    )


def described(infos: list[dict[str, Any]], root: str) -> list[tuple[str, str, int | None]]:
    """`ls` entries as (name relative to `root`, type, size of a file): what two listings share."""
    return sorted(
        (os.path.relpath(i["name"], root), i["type"], i["size"] if i["type"] == "file" else None)
        for i in infos
    )
