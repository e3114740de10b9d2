"""The machine a benchmark ran on, as its page states it: cores, processor, memory and kernel."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path


def describe() -> str:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return f"{os.cpu_count()} cores ({cpu}), {mem / (1 << 30):.1f} GiB of memory, Linux {platform.release()}"
