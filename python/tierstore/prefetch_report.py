"""What each DataLoader's sampler-aware prefetch tells `tierstore status` (which runs in another process):
a small JSON file beside the loader's read-marks file (`NAME.marks.json`), replaced whole as each epoch
starts, and the read-marks file itself, read as `status` runs for how far the epoch's readers are.

Both sit in the cache's private order directory (`Cache._core.order_dir()`); a report is shown only if it
is a regular file of this user, not a link, and its process still runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from array import array
from typing import Any

SUFFIX = ".json"


def write(marks_path: str, report: dict[str, Any]) -> None:
    """Replaces the report of the loader whose read-marks file is `marks_path`. Never raises: a report not
    written is a loader `status` does not show."""
    path = marks_path + SUFFIX
    temporary = f"{path}.{os.getpid()}.tmp"
    with contextlib.suppress(OSError, TypeError, ValueError):
        fd = os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, json.dumps(report).encode())
        finally:
            os.close(fd)
        os.replace(temporary, path)
    with contextlib.suppress(OSError):
        os.unlink(temporary)  # left only when the write or the rename failed


def remove(marks_path: str) -> None:
    """Removes the report of the loader whose read-marks file is `marks_path`."""
    with contextlib.suppress(OSError):
        os.unlink(marks_path + SUFFIX)


def read_all(order_dir: str) -> list[dict[str, Any]]:
    """The reports of this user's running loaders in `order_dir`, each with `read`: how many of the
    epoch's samples its readers have fetched so far (as the read marks say)."""
    try:
        names = sorted(n for n in os.listdir(order_dir) if n.endswith(".marks" + SUFFIX))
    except OSError:
        return []
    reports = []
    for name in names:
        path = os.path.join(order_dir, name)
        report = _load(path)
        if report is None or not _running(report.get("pid")):
            continue
        marks = _own_bytes(path.removesuffix(SUFFIX))
        tag = report.get("tag")
        if marks is not None and isinstance(tag, int) and len(marks) % 4 == 0:
            report["read"] = array("I", marks)[1:].count(tag)
        reports.append(report)
    return reports


def _load(path: str) -> dict[str, Any] | None:
    data = _own_bytes(path)
    if data is None:
        return None
    try:
        report = json.loads(data)
    except ValueError:
        return None
    return report if isinstance(report, dict) else None


def _own_bytes(path: str) -> bytes | None:
    """The bytes of `path` if it is a regular file of this user (never through a link); else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    except OSError:
        return None
    finally:
        os.close(fd)


def _running(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
