"""tierstore: the I/O layer between deep-learning jobs and a cluster's storage.

Files of a slow shared store are served from the fastest tier of the node that holds a copy (RAM, then
local disks), fetched from the store at most once per node, never partially; a file changed on the store
is seen within 60s by default (`revalidate`).

    import tierstore
    tierstore.configure(source="/lustre/datasets/imagenet", tiers=["/dev/shm/tierstore:50%"])
    with tierstore.open("/lustre/datasets/imagenet/train/n01440764/img_0001.JPEG") as f:
        data = f.read()
"""

import atexit
import importlib
from typing import TYPE_CHECKING

from tierstore import _core
from tierstore._core import ConfigError, OutsideSourceError, TierstoreError, __version__, parse_size

# Registered before any other hook of tierstore's, so it runs after all of them: from then on a daemon
# thread coming back from the engine waits for the end instead of aborting the process (see
# crates/tierstore-py/src/exiting.rs).
atexit.register(_core.interpreter_exiting)

# Every DataLoader of this process prefetches its epochs in its sampler's order, where its dataset names
# its files (tierstore.auto_order; TIERSTORE_SAMPLER_PREFETCH=off turns it off).
from tierstore import auto_order  # noqa: E402

auto_order.install()

# The rest of the face is imported when first asked for: under `tierstore run` every Python process of the
# job imports this package as torch's DataLoader loads, and most of them never open a file through it.
if TYPE_CHECKING:
    from tierstore._file import CachedFile
    from tierstore.cache import Cache, configure, default_cache, open, prefetch, stats
    from tierstore.writeback import sync
else:
    _LAZY = {
        "CachedFile": "tierstore._file",
        **dict.fromkeys(
            ("Cache", "configure", "default_cache", "open", "prefetch", "stats"), "tierstore.cache"
        ),
        "sync": "tierstore.writeback",
    }

    # The modules that were imported with the package before (`tierstore.cache.X` after `import tierstore`).
    _SUBMODULES = ("cache", "writeback", "_file", "types")

    def __getattr__(name: str) -> object:
        if name in _SUBMODULES:
            return importlib.import_module(f"tierstore.{name}")  # which sets it here, as any import does
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module 'tierstore' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *_LAZY, *_SUBMODULES})


__all__ = [
    "Cache",
    "CachedFile",
    "ConfigError",
    "OutsideSourceError",
    "TierstoreError",
    "__version__",
    "configure",
    "default_cache",
    "open",
    "parse_size",
    "prefetch",
    "stats",
    "sync",
]
