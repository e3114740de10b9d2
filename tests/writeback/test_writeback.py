"""Write-back staging through the Python API and fsspec, against real processes, real files and the stand-in
store (FUSE): writes land on the node's stage, the agent migrates them in close order, a store outage
holds the data and resumes, an agent restart resumes promptly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import soak
from tests.helpers.data import blob
from tests.helpers.wait import wait_for
from tests.helpers.writeback import PART, setup, staged_copies_go
from tierstore.agent import answers


@pytest.mark.fuse
def test_a_job_that_only_stages_its_checkpoints_needs_no_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Write-back alone is one variable: `tierstore run` with no source configured stages the writes, and
    no process of the job warns about the missing source."""
    with setup(tmp_path, monkeypatch) as s:
        s.env.pop("TIERSTORE_SOURCE")
        s.env.pop("TIERSTORE_TIERS")
        code = (
            "import sys, subprocess; open(sys.argv[1], 'wb').write(b'ckpt' * 1000); subprocess.run(['true'])"
        )
        s.fail_file.touch()  # the store refuses writes: what reaches it later was staged
        p = s.python(code, str(s.dest / "a.bin"), run=True)
        assert p.returncode == 0, p.stderr
        assert "source" not in p.stderr, p.stderr
        from tierstore import writeback

        assert writeback.pending()[0]["files"] == 1, "the write was not staged"
        assert not (s.backing / "ckpt" / "a.bin").exists()
        s.fail_file.unlink()
        synced = s.cli("sync", str(s.dest), "--timeout", "60")
        assert synced.returncode == 0, synced.stderr
        assert (s.backing / "ckpt" / "a.bin").read_bytes() == b"ckpt" * 1000
        ordered = s.cli("run", "--order", str(tmp_path / "order.txt"), "--", "true")
        assert ordered.returncode != 0 and "no source" in ordered.stderr, ordered.stderr


@pytest.mark.fuse
def test_sync_without_the_jobs_configuration_never_says_on_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file is staged (the store refuses writes, no agent runs); `tierstore sync DEST` in a shell without
    the job's write-back configuration exits 1 and names the stage that holds files for DEST, instead of
    saying DEST is on the store. With the configuration it waits as always; a path under no destination at
    all is refused too."""
    with setup(tmp_path, monkeypatch) as s:
        s.fail_file.touch()
        p = s.python(
            "import sys; open(sys.argv[1], 'wb').write(b'ckpt' * 1000)", str(s.dest / "a.bin"), run=True
        )
        assert p.returncode == 0, p.stderr
        assert not (s.backing / "ckpt" / "a.bin").exists()
        bare = {k: v for k, v in s.env.items() if k not in ("TIERSTORE_WRITEBACK", "TIERSTORE_CONFIG")}
        for args in (["sync", str(s.dest)], ["sync", str(s.dest / "a.bin")], ["sync"]):
            p = subprocess.run(
                [sys.executable, "-m", "tierstore.cli", *args, "--timeout", "1"],
                env=bare,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert p.returncode == 1, f"{args}: {p.stdout}"
            assert "on the shared store:" not in p.stdout, p.stdout
            assert "this node stages files for" in p.stderr and "job's configuration" in p.stderr, p.stderr
        elsewhere = tmp_path / "not-a-destination"
        elsewhere.mkdir()
        p = s.cli("sync", str(elsewhere), "--timeout", "1")
        assert p.returncode == 1 and "under no [[writeback]] destination" in p.stderr, p.stderr
        # With the configuration: the file is pending, and the agent is missing.
        p = s.cli("sync", str(s.dest), "--timeout", "1")
        assert p.returncode == 1 and "on the shared store:" not in p.stdout, p.stdout


def test_configuration_errors_name_the_key_and_the_fix(tmp_path: Path) -> None:
    env = {**os.environ, "TIERSTORE_WRITEBACK": f"{tmp_path}/nowhere:{tmp_path}/stage"}
    p = subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "sync"], env=env, capture_output=True, text=True
    )
    assert p.returncode == 1
    assert "writeback[0].path" in p.stderr and "mkdir" in p.stderr, p.stderr
    (tmp_path / "d").mkdir()
    env["TIERSTORE_WRITEBACK"] = f"{tmp_path}/d:{tmp_path}/stage:1G:eventually"
    p = subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "sync"], env=env, capture_output=True, text=True
    )
    assert p.returncode == 1 and "writeback[0].durability" in p.stderr and '"remote"' in p.stderr, p.stderr


@pytest.mark.fuse
def test_python_writes_stage_read_back_and_sync_to_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tierstore
    from tierstore import writeback

    with setup(tmp_path, monkeypatch, write_bandwidth="4MiB/s") as s:
        s.start_agent()
        data = blob("model.bin", 3 << 20)
        start = time.monotonic()
        with tierstore.open(s.dest / "model.bin", "wb") as f:
            f.write(data)
        closed = time.monotonic() - start
        # Staged, not yet on the store (which takes 3 MiB in about 0.75 s): read-your-writes from the stage.
        assert not s.stored("model.bin").exists()
        with tierstore.open(s.dest / "model.bin", "rb") as f:
            assert f.read() == data
        pending = writeback.pending()
        assert pending[0]["files"] == 1 and pending[0]["bytes"] == len(data)
        status = json.loads(s.cli("status", "--json").stdout)
        assert status["writeback"][0]["files"] == 1 and status["writeback"][0]["oldest_age_s"] >= 0
        tierstore.sync(timeout=30)
        assert s.stored("model.bin").read_bytes() == data
        assert closed < 0.75, f"close waited for the store ({closed:.2f} s)"
        staged_copies_go(s.stage)
        assert not list(s.stored("").glob(f"*{PART}"))
        # Once migrated, reads go to the store; `tierstore sync` has nothing left.
        assert tierstore.open(s.dest / "model.bin", "rb").read() == data
        p = s.cli("sync", str(s.dest), "--timeout", "5")
        assert p.returncode == 0, p.stderr


@pytest.mark.fuse
def test_fsspec_writes_stage_read_back_and_sync_to_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fsspec

    import tierstore

    with setup(tmp_path, monkeypatch, write_bandwidth="4MiB/s") as s:
        s.start_agent()
        data = blob("fs.bin", 2 << 20)
        with fsspec.open(f"tierstore://{s.dest}/fs.bin", "wb") as f:
            f.write(data)
        with fsspec.open(f"tierstore://{s.dest}/notes.txt", "w") as f:
            f.write("written as text")
        # Staged (the store takes 2 MiB in about 0.5 s); fsspec reads it back from the stage.
        assert not s.stored("fs.bin").exists()
        with fsspec.open(f"tierstore://{s.dest}/fs.bin", "rb") as f:
            assert f.read() == data
        fs = fsspec.filesystem("tierstore")
        with fs.open(str(s.dest / "notes.txt"), "a") as f:
            f.write(", then appended")
        tierstore.sync(timeout=30)
        assert s.stored("fs.bin").read_bytes() == data
        assert s.stored("notes.txt").read_text() == "written as text, then appended"
        staged_copies_go(s.stage)
        with pytest.raises(ValueError, match="reads only outside"):
            fs.open(str(tmp_path / "elsewhere.bin"), "wb")


@pytest.mark.fuse
def test_remote_durability_returns_once_on_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tierstore

    with setup(tmp_path, monkeypatch, durability="remote") as s:
        data = blob("r.bin", 1 << 20)
        with tierstore.open(s.dest / "r.bin", "wb") as f:
            f.write(data)
        assert s.stored("r.bin").read_bytes() == data, "close returned before the store had the file"


@pytest.mark.fuse
def test_files_reach_the_store_in_close_and_rename_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tierstore
    from tierstore import writeback

    with setup(tmp_path, monkeypatch, write_bandwidth="8MiB/s") as s:
        seen: list[tuple[float, str]] = []
        stop = threading.Event()

        def watch() -> None:
            known: set[str] = set()

            def look() -> None:
                for p in (s.backing / "ckpt" / "step").glob("*"):
                    if p.name not in known and not p.name.endswith(PART):
                        known.add(p.name)
                        seen.append((time.monotonic(), p.name))

            while not stop.is_set():
                look()
                time.sleep(0.002)
            # A last look once sync() has returned: a file that reached the store during the last sleep
            # (the last one, most often) is seen rather than lost to the stop.
            look()

        (s.dest / "step").mkdir()
        t = threading.Thread(target=watch)
        t.start()
        names = [f"shard{i}.bin" for i in range(4)]
        for n in names:
            with tierstore.open(s.dest / "step" / n, "wb") as f:
                f.write(blob(n, 512 << 10))
        with tierstore.open(s.dest / "step" / "meta.tmp", "wb") as f:
            f.write(b"commit")
        writeback.rename(s.dest / "step" / "meta.tmp", s.dest / "step" / "meta")
        tierstore.sync(timeout=30)
        stop.set()
        t.join()
        order = [n for _, n in sorted(seen)]
        assert order == [*names, "meta"], order
        for n in names:
            assert s.stored(f"step/{n}").read_bytes() == blob(n, 512 << 10)
        assert not s.stored("step/meta.tmp").exists()


@pytest.mark.fuse
@pytest.mark.slow  # it waits out the outage (TIERSTORE_TEST_WRITEBACK_OUTAGE_S, 6 s)
def test_a_store_outage_holds_the_data_and_resumes_by_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tierstore
    from tierstore import writeback

    outage = soak.WRITEBACK_OUTAGE_S
    with setup(tmp_path, monkeypatch) as s:
        s.start_agent()
        s.fail_file.touch()
        files = {f"o{i}.bin": blob(f"o{i}.bin", 200_000) for i in range(5)}
        began = time.monotonic()
        for name, data in files.items():
            with tierstore.open(s.dest / name, "wb") as f:
                f.write(data)
        # The store fails; the closes returned anyway (buffered durability), the data wait on the stage.
        wait_for("the failure is recorded", lambda: any(p["errors"] for p in writeback.pending()), 5)
        p = s.cli("sync", "--timeout", "1")
        assert (
            p.returncode == 1 and "not on the shared store" in p.stderr and "Input/output error" in p.stderr
        ), p.stderr
        status = s.cli("status")
        assert "errors" in status.stdout and "5" in status.stdout, status.stdout
        time.sleep(max(0.0, outage - (time.monotonic() - began)))
        s.fail_file.unlink()
        ended = time.monotonic()
        tierstore.sync(timeout=30)
        took = time.monotonic() - ended
        for name, data in files.items():
            assert s.stored(name).read_bytes() == data
        assert took < 4, f"migration resumed {took:.1f} s after the outage ended (back-off cap 2 s)"


@pytest.mark.fuse
def test_a_file_renamed_while_it_migrates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tierstore
    from tierstore import writeback

    with setup(tmp_path, monkeypatch, write_bandwidth="2MiB/s") as s:
        data = blob("big", 4 << 20)
        with tierstore.open(s.dest / "big.tmp", "wb") as f:
            f.write(data)
        part = s.stored(f".big.tmp{PART}")
        wait_for("the upload started", lambda: part.exists() and part.stat().st_size > 0, 10)
        writeback.rename(s.dest / "big.tmp", s.dest / "big")
        tierstore.sync(timeout=60)
        assert s.stored("big").read_bytes() == data
        assert not s.stored("big.tmp").exists(), "the old name never reaches the store"
        assert not list(s.stored("").glob(f"*{PART}"))


@pytest.mark.fuse
def test_resume_after_an_agent_restart_is_prompt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tierstore
    from tierstore import _core

    with setup(tmp_path, monkeypatch) as s:
        pid = s.start_agent()
        s.fail_file.touch()
        for i in range(3):
            with tierstore.open(s.dest / f"r{i}", "wb") as f:
                f.write(blob(f"r{i}", 100_000))
        os.kill(pid, signal.SIGKILL)
        wait_for("the killed agent is gone", lambda: not answers(s.socket), 10)
        s.fail_file.unlink()
        # No agent: the files wait in the journal, and a wait says so instead of hanging.
        with pytest.raises(_core.TierstoreError, match="no agent answers"):
            _core.Writeback().wait(None, 30)
        assert not s.stored("r0").exists()
        s.start_agent()
        took = wait_for("migration after the restart", lambda: s.stored("r2").exists(), 5)
        for i in range(3):
            assert s.stored(f"r{i}").read_bytes() == blob(f"r{i}", 100_000)
        print(f"migrated 3 files {took:.2f} s after the agent restarted")


def test_a_forked_child_makes_its_own_write_back_and_finds_the_same_destinations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`destination` trusts the write-back it read once in this process, without asking the process id
    on every call: a fork makes the child forget the parent's (its engine state is not the child's to
    use), and the child reads the configuration again, under a lock of its own."""
    from tierstore import writeback

    (tmp_path / "d").mkdir()
    monkeypatch.setenv("TIERSTORE_WRITEBACK", f"{tmp_path}/d:{tmp_path}/stage:1G:buffered")
    writeback.reload()
    assert writeback.destination(tmp_path / "d" / "x.bin") is not None
    parents = writeback._state["wb"]
    assert parents is not None
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 only if every check holds
        ok = writeback._state["wb"] is None
        ok = ok and writeback.destination(tmp_path / "d" / "x.bin") is not None
        ok = ok and writeback.destination(tmp_path / "elsewhere.bin") is None
        ok = ok and writeback._state["wb"] is not None and writeback._state["wb"] is not parents
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert writeback._state["wb"] is parents  # the parent's is untouched
    writeback.reload()
