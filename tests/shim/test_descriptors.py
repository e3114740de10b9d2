"""The shim's own descriptors under `tierstore run` (its index, lock files, directories, the copies it is
making) survive a program that closes descriptors it never opened, as a daemon does: the program's next
files get other numbers, the engine never writes into them or closes them, and every read stays right."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tierstore
from tests.helpers.cli import tierstore_run
from tests.helpers.data import content

# Reads some files (one large, left open mid-copy and kept), closes every other descriptor above stderr
# one of three ways, then writes files of its own and reads the rest of the dataset.
CLOSER = textwrap.dedent(
    """
    import ctypes, errno, hashlib, json, os, sys
    root, tier, way = sys.argv[1], sys.argv[2], sys.argv[3]
    want = json.loads(sys.argv[4])
    def digest(p):
        with open(p, "rb") as f: return hashlib.sha256(f.read()).hexdigest()
    def engines():  # the engine's lasting descriptors on the tier (its index, locks, directories; the
        fds = []    # program opened none there, and the copies being made come and go)
        for n in os.listdir("/proc/self/fd"):
            try: fds.append([int(n), os.readlink(f"/proc/self/fd/{n}")])
            except OSError: pass
        return sorted(p for p in fds if p[1].startswith(tier) and "/tmp/" not in p[1])
    for name in ("f0", "f1", "f2"):
        assert digest(os.path.join(root, name)) == want[name]
    kept = os.open(os.path.join(root, "big"), os.O_RDONLY)
    head = os.read(kept, 4096)
    before = engines()
    top = os.sysconf("SC_OPEN_MAX")
    if way == "closerange":                # os.closerange: glibc's close_range
        os.closerange(3, kept); os.closerange(kept + 1, top)
    elif way == "close each":             # a daemon's loop, which ignores the numbers that are not open
        refused = 0
        for fd in range(3, min(top, 4096)):
            if fd == kept: continue
            try: os.close(fd)
            except OSError as e: refused += e.errno == errno.EBADF
    else:                                  # closefrom (glibc 2.34) above the kept one, then below it
        libc = ctypes.CDLL(None)
        for fd in range(3, kept): os.closerange(fd, fd + 1)
        libc.closefrom(kept + 1)
    after = engines()
    outs = []
    for k in range(24):
        f = open(os.path.join(sys.argv[5], f"out{k}"), "wb")
        f.write(bytes([k]) * 40_000); f.flush()
        outs.append(f)
    bad = [n for n in sorted(want) if n != "big" and digest(os.path.join(root, n)) != want[n]]
    rest = head + b"".join(iter(lambda: os.read(kept, 1 << 20), b""))
    if hashlib.sha256(rest).hexdigest() != want["big"]: bad.append("big, read on the kept descriptor")
    if digest(os.path.join(root, "big")) != want["big"]: bad.append("big, opened again")
    for k, f in enumerate(outs):
        f.close()
        with open(f.name, "rb") as g:
            if g.read() != bytes([k]) * 40_000: bad.append(f.name)
    print(json.dumps({"before": before, "after": after, "bad": bad}))
    """
)


@pytest.mark.parametrize("way", ["closerange", "close each", "closefrom"])
def test_a_program_that_closes_every_descriptor_it_did_not_open_still_reads_and_writes_right(
    slow_store: tuple[Path, Path], tier: str, tmp_path: Path, way: str
) -> None:
    backing, mount = slow_store
    files = {f"f{i}": content(i, 200_000) for i in range(12)}
    files["big"] = content(99, 48 << 20)
    for name, data in files.items():
        (backing / name).write_bytes(data)
    want = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    job, outs = tmp_path / "closer.py", tmp_path / "outs"
    job.write_text(CLOSER)
    outs.mkdir()
    p = tierstore_run(
        mount, f"{tier}:256M", sys.executable, str(job), str(mount), tier, way, json.dumps(want), str(outs)
    )
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err
    seen = json.loads(out)
    assert seen["before"], "the engine held no descriptor on the tier, so nothing was tested"
    assert seen["after"] == seen["before"], f"{way} closed the engine's descriptors"
    assert seen["bad"] == [], f"{way}: wrong bytes or a lost write: {seen['bad']}\n{err}"


def test_a_program_started_by_a_process_holding_a_cache_inherits_no_descriptor_of_its_index(
    tmp_path: Path, tier: str
) -> None:
    # LMDB opens its data file without O_CLOEXEC: `tierstore run` itself holds a cache when it starts the
    # job, and the job used to inherit a writable descriptor of the index, as did every subprocess.
    source = tmp_path / "src"
    source.mkdir()
    (source / "a").write_bytes(content(1, 10_000))
    cache = tierstore.Cache(source, [f"{tier}:64M"])
    with cache.open(source / "a") as f:
        assert f.read() == content(1, 10_000)
    open_here = [Path(f"/proc/self/fd/{n}").resolve() for n in os.listdir("/proc/self/fd")]
    assert any(p.name == "data.mdb" for p in open_here), "the cache holds no index here: nothing was tested"
    # As `os.system`, `exec` and C programs start one (Python's subprocess closes all but 0-2 by default).
    ls = ["ls", "-l", "/proc/self/fd"]
    listing = subprocess.run(ls, capture_output=True, text=True, check=True, close_fds=False).stdout
    assert "data.mdb" not in listing and tier not in listing, listing


def test_a_shell_that_redirects_low_descriptors_of_its_own_gets_its_files_intact(
    slow_store: tuple[Path, Path], tier: str, tmp_path: Path
) -> None:
    # `exec 5>log` is a dup2 onto 5, which replaces whatever is there. The engine of a shell that looked at
    # the source held its index's data file on such a number, and its next index write went into the log.
    backing, mount = slow_store
    files = {f"f{i}": content(i, 150_000) for i in range(8)}
    for name, data in files.items():
        (backing / name).write_bytes(data)
    outs = tmp_path / "outs"
    outs.mkdir()
    script = textwrap.dedent(
        f"""
        set -e
        [ -f {mount}/f0 ]                                 # the engine opens its cache in the shell
        cd {outs}
        exec 3>o3 4>o4 5>o5 6>o6 7>o7 8>o8 9>o9
        for f in {" ".join(sorted(files))}; do
            read -r -N 4 head < {mount}/$f                # the shell's own opens of the source
            sha256sum < {mount}/$f | cut -d' ' -f1 > $f.sum
        done
        for n in 3 4 5 6 7 8 9; do echo "fd $n" >&$n; done
        """
    )
    p = tierstore_run(mount, f"{tier}:256M", "bash", "-c", script)
    _, err = p.communicate(timeout=180)
    assert p.returncode == 0, err
    for name, data in files.items():
        assert (outs / f"{name}.sum").read_text().strip() == hashlib.sha256(data).hexdigest(), name
    for n in range(3, 10):
        assert (outs / f"o{n}").read_bytes() == f"fd {n}\n".encode(), f"the shell's file on descriptor {n}"
