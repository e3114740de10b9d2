"""The `tierstore` command line: `main` is the root (cli/main.py). Each group of commands is a module of its own
that adds its commands to the root when imported, which the root does when one of them is asked for."""

from __future__ import annotations

from tierstore.cli.main import main

__all__ = ["main"]
