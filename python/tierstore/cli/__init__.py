"""The `tierstore` command line: `main` is the root (cli/main.py); each group of commands is a module that
adds its commands to it when imported here."""

from __future__ import annotations

from tierstore.cli import agent, cache, models, run, stream, writeback
from tierstore.cli.main import main

__all__ = ["agent", "cache", "main", "models", "run", "stream", "writeback"]
