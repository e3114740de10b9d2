"""tierstore: the I/O layer between deep-learning jobs and a cluster's storage.

Files of a slow shared store are served from the fastest tier of the node that holds a copy (RAM, then
local disks), fetched from the store at most once per node, and never served stale.

    import tierstore
    tierstore.configure(source="/lustre/datasets/imagenet", tiers=["/dev/shm/tierstore:64G"])
    with tierstore.open("/lustre/datasets/imagenet/train/n01440764/img_0001.JPEG") as f:
        data = f.read()
"""

from tierstore._core import ConfigError, OutsideSourceError, TierstoreError, __version__, parse_size
from tierstore._file import CachedFile
from tierstore.cache import Cache, configure, default_cache, open, prefetch, stats
from tierstore.writeback import sync

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
