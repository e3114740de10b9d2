"""The file object returned by `tierstore.open`: `tierstore.CachedFile`, built in Rust
(crates/tierstore-py/src/file.rs) so that a warm open, read and close is a call each, with no Python frame
of ours around them. Registered here as an `io.RawIOBase`, which it behaves as, so that libraries checking
`isinstance(f, io.IOBase)` take it."""

from __future__ import annotations

import io

from tierstore._core import CachedFile

io.RawIOBase.register(CachedFile)

__all__ = ["CachedFile"]
