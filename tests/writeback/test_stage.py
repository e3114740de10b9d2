"""A stage that fills up: a full stage writes through to the store in order and under a hidden name until the
file is whole, a small stage keeps only its reserve free, and a file that overflows the stage frees it at
once and never reaches the store."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.data import blob
from tests.helpers.writeback import Setup, setup


@pytest.mark.fuse
def test_a_full_stage_writes_through_and_keeps_the_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tierstore

    with setup(tmp_path, monkeypatch, quota="1M", write_bandwidth="1MiB/s") as s:
        s.start_agent()
        names = [f"f{i}.bin" for i in range(4)]
        for n in names[:3]:
            with tierstore.open(s.dest / n, "wb") as f:
                f.write(blob(n, 700_000))
        # f0 and f1 were staged and filled the 1 MiB stage (the store takes 0.7 s for each): f2 waited for
        # them to reach the store, then went straight there. No ENOSPC, never more staged than the quota.
        for n in names[:3]:
            assert s.stored(n).read_bytes() == blob(n, 700_000), n
        assert not (s.stage / "data").exists() or list((s.stage / "data").iterdir()) == []
        # The stage is empty again: the next file is staged.
        with tierstore.open(s.dest / names[3], "wb") as f:
            f.write(blob(names[3], 700_000))
        assert not s.stored(names[3]).exists()
        tierstore.sync(timeout=30)
        assert s.stored(names[3]).read_bytes() == blob(names[3], 700_000)


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `path` (root only: CI runs as root), for a stage that fills up."""
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def hidden_through(s: Setup, name: str) -> list[str]:
    """The hidden names a file written through a full stage has on the store while it is written."""
    return [
        p.name for p in (s.backing / "ckpt").iterdir() if p.name.startswith(f".{name}.tierstore-through-")
    ]


@pytest.mark.fuse
@pytest.mark.root
@pytest.mark.skipif(
    os.geteuid() != 0, reason="mounts a small tmpfs for the stage: needs root (CI runs as root)"
)
def test_a_small_stage_stages_and_a_full_one_writes_through_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 16 MiB stage keeps an eighth of itself free (not 64 MiB, which sent every file of a small stage to
    the store); once it is full, a file goes to the store under a hidden name and appears under its own
    only whole, through the Python API and under `tierstore run` alike."""
    import tierstore

    with (
        small_disk(tmp_path / "small", "16m") as disk,
        setup(tmp_path, monkeypatch, stage=disk / "stage") as s,
    ):
        s.start_agent()
        with tierstore.open(s.dest / "staged.bin", "wb") as f:
            f.write(blob("staged.bin", 4 << 20))
        assert not s.stored("staged.bin").exists(), "a file that fits a small stage is staged"
        tierstore.sync(timeout=30)
        assert s.stored("staged.bin").read_bytes() == blob("staged.bin", 4 << 20)
        filler = disk / "filler"
        filler.write_bytes(b"\0" * (15 << 20))  # leaves less than the stage's reserve free

        body = blob("through.bin", 3 << 20)
        with tierstore.open(s.dest / "through.bin", "wb") as f:
            f.write(body[: len(body) // 2])
            f.flush()
            assert not s.stored("through.bin").exists(), "half a file is visible under its name"
            assert len(hidden_through(s, "through.bin")) == 1
            f.write(body[len(body) // 2 :])
        assert s.stored("through.bin").read_bytes() == body
        assert hidden_through(s, "through.bin") == []

        code = (
            "import sys\n"
            "f = open(sys.argv[1], 'wb')\n"
            "f.write(bytes(1 << 20)); f.flush()\n"
            "print('half', flush=True); sys.stdin.readline()\n"
            "f.write(b'x' * (1 << 20)); f.close()\n"
        )
        child = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tierstore.cli",
                "run",
                "--",
                sys.executable,
                "-c",
                code,
                str(s.dest / "run.bin"),
            ],
            env=s.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "half"
        assert not s.stored("run.bin").exists(), "half a file is visible under its name"
        assert len(hidden_through(s, "run.bin")) == 1
        child.stdin.write("go\n")
        child.stdin.close()
        assert child.wait(60) == 0
        assert s.stored("run.bin").read_bytes() == bytes(1 << 20) + b"x" * (1 << 20)
        assert hidden_through(s, "run.bin") == []


@pytest.mark.fuse
@pytest.mark.root
@pytest.mark.skipif(
    os.geteuid() != 0, reason="mounts a small tmpfs for the stage: needs root (CI runs as root)"
)
def test_a_file_that_overflows_the_stage_frees_it_at_once_and_never_reaches_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tierstore

    with (
        small_disk(tmp_path / "small", "16m") as disk,
        setup(tmp_path, monkeypatch, stage=disk / "stage") as s,
    ):
        s.start_agent()
        f = tierstore.open(s.dest / "big.bin", "wb")
        with pytest.raises(OSError, match="No space left"):
            for _ in range(24):
                f.write(bytes(1 << 20))
        with pytest.raises(OSError, match="nothing of it reaches the store") as failed:
            f.close()
        assert failed.value.errno == 28  # ENOSPC
        data = s.stage / "data"
        assert not data.exists() or list(data.iterdir()) == [], "the failed file still holds the stage"
        # The next file is staged, not written through.
        with tierstore.open(s.dest / "next.bin", "wb") as f:
            f.write(b"next")
        assert not s.stored("next.bin").exists()
        tierstore.sync(timeout=30)
        assert s.stored("next.bin").read_bytes() == b"next"
        assert not s.stored("big.bin").exists()
