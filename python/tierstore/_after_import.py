"""Run code right after a module is imported, without importing it: a hook on a module the process may never
load (torch's DataLoader, multiprocessing) costs that process nothing. `tierstore run` starts every job with
`import tierstore`, so what the package imports before it is asked for is paid by every start."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


class AfterImport:
    """A meta path finder that lets the module `name` load as usual, then calls `then(module)`."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.name:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None  # found by another finder (frozen, say): the hook waits for a load it can follow
        with contextlib.suppress(ValueError):  # one load, one call
            sys.meta_path.remove(self)
        loader = spec.loader
        run = loader.exec_module
        then = self.then

        def exec_module(module: ModuleType) -> None:
            run(module)
            then(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def when_imported(name: str, then: Callable[[ModuleType], None]) -> None:
    """Calls `then(module)` now if the module `name` is imported, else as soon as it is."""
    module = sys.modules.get(name)
    if module is not None:
        then(module)
    else:
        wait_for_import(name, then)


def wait_for_import(name: str, then: Callable[[ModuleType], None]) -> None:
    """Calls `then(module)` once the module `name` is next imported; waiting already, nothing more."""
    if not any(isinstance(f, AfterImport) and f.name == name and f.then == then for f in sys.meta_path):
        sys.meta_path.insert(0, AfterImport(name, then))
