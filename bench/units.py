"""What several benchmarks write and read alike: sizes for people, and the deterministic bytes of a
synthetic object."""

from __future__ import annotations

import hashlib


def human(n: float, digits: int = 1) -> str:
    """`n` bytes as B, KiB, MiB or GiB: a whole number of its unit without decimals, else `digits`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            whole = unit == "B" or float(n).is_integer()
            return f"{n:.0f} {unit}" if whole else f"{n:.{digits}f} {unit}"
        n /= 1024
    raise AssertionError("unreachable: GiB ends the loop")


def blob(i: int, n: int) -> bytes:
    """`n` bytes that differ for every `i` and are the same in every run (no compression or dedup helps)."""
    seed = hashlib.blake2b(str(i).encode(), digest_size=64).digest()
    return (seed * (n // 64 + 1))[:n]


def size(text: str) -> int:
    """A size argument ("128K", "64M", a number of bytes), read as tierstore reads sizes."""
    from tierstore import parse_size

    n = parse_size(text)
    if n is None:
        raise ValueError(f"{text!r} is not a size: give one like 128K, 64M or a number of bytes")
    return n
