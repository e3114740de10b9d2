"""Deterministic bytes of test files: any file a test wrote can be checked by its name alone."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def blob(name: str, size: int, *, seed_bytes: int = 64) -> bytes:
    """`size` bytes that depend on `name` only: its blake2b digest (`seed_bytes` long), repeated.

    The write-back tests name a file's bytes by its path (their writer process runs this very function's
    source), the S3 tests by `f"object {i}"`, and `content(i, size)` is `blob(str(i), size, seed_bytes=32)`."""
    seed = hashlib.blake2b(name.encode(), digest_size=seed_bytes).digest()
    return (seed * (size // seed_bytes + 1))[:size]


def content(i: int, size: int) -> bytes:
    """Deterministic, file-specific bytes."""
    return blob(str(i), size, seed_bytes=32)


def make_files(root: Path, n: int, size: int = 4096, prefix: str = "f") -> dict[Path, bytes]:
    """`n` files under `root`, 50 to a directory (`f0/00000.bin`...), each `size` bytes plus `i % 7`;
    returns their bytes by path."""
    files = {}
    for i in range(n):
        p = root / f"{prefix}{i // 50}" / f"{i:05d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        b = content(i, size + i % 7)
        p.write_bytes(b)
        files[p] = b
    return files


def odd_names(changed_by_server: str = "") -> list[str]:
    """Object names a dataset may hold that a URL or an object store client treats as special: every
    printable ASCII character but `/` in one name, `%`, `#`, `?`, `~`, `[`, `]`, `+` and spaces, text that
    already looks percent-encoded, and names outside ASCII. A store must list, open and read each by itself.
    `changed_by_server`: characters the server under test stores as others (SeaweedFS: a backslash becomes
    `/`), left out."""
    printable = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) not in "/" + changed_by_server)
    return [
        printable,
        "hash#1.bin",
        "50%.bin",
        "a%2Fb%20c.bin",
        "what?.bin",
        "~home.bin",
        "[0-9].bin",
        "one + two.bin",
        "naïve café.bin",
        "日本語/クラス.bin",
        "🙂.bin",
    ]


def flip_byte(path: Path, at: int) -> None:
    """Flips one bit of the byte at `at` of the file, keeping its size and times: nothing but its bytes
    says it changed (silent damage, which only a hash finds)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
