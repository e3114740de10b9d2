"""The Python side's lines at `-v`, written as the engine writes its own."""

from __future__ import annotations

import os
import sys


def info(message: str) -> None:
    """One line on stderr at `-v` (`TIERSTORE_LOG` info or more)."""
    if os.environ.get("TIERSTORE_LOG", "").strip().lower() in ("info", "debug", "trace"):
        print(f"tierstore[{os.getpid()}] info: {message}", file=sys.stderr, flush=True)
