"""The test helpers' own promises: the bytes they make are the ones each suite made before they were shared,
the soak variables are read as documented, and a fixture's markers reach its tests."""

from __future__ import annotations

import hashlib
import importlib

import pytest

from tests.helpers import data, soak
from tests.helpers.marks import BY_FIXTURE, needs


def test_one_blob_makes_the_bytes_of_the_four_it_replaced() -> None:
    """`content` (the cache tests), the S3 tests' `blob(i)`, and the write-back tests' `blob(name)` in the
    test and in its writer process were four copies of one recipe; the shared `blob` gives their bytes."""

    def content(i: int, size: int) -> bytes:
        seed = hashlib.blake2b(str(i).encode(), digest_size=32).digest()
        return (seed * (size // len(seed) + 1))[:size]

    def s3_blob(i: int, size: int) -> bytes:
        seed = hashlib.blake2b(f"object {i}".encode(), digest_size=64).digest()
        return (seed * (size // len(seed) + 1))[:size]

    def writeback_blob(name: str, size: int) -> bytes:
        seed = hashlib.blake2b(name.encode(), digest_size=64).digest()
        return (seed * (size // 64 + 1))[:size]

    for size in (0, 1, 31, 32, 33, 64, 65, 4096 + 5, 300_001):
        for i in (0, 7, 1000):
            assert data.content(i, size) == content(i, size)
            assert data.blob(f"object {i}", size) == s3_blob(i, size)
        for name in ("step00001/data2", "meta", "r.bin"):
            assert data.blob(name, size) == writeback_blob(name, size)


def test_soak_sizes_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        monkeypatch.setenv("TIERSTORE_TEST_WRITEBACK_KILLS", "7")
        monkeypatch.setenv("TIERSTORE_TEST_WRITEBACK_OUTAGE_S", "0.5")
        importlib.reload(soak)
        assert (soak.WRITEBACK_KILLS, soak.WRITEBACK_OUTAGE_S) == (7, 0.5)
        assert soak.WRITEBACK_RUN_KILLS == 20 and soak.STREAM_SOAK_UPDATES == 10_000
        monkeypatch.setenv("TIERSTORE_TEST_STREAM_SOAK_UPDATES", "1")
        with pytest.raises(ValueError, match=r"STREAM_SOAK_UPDATES = '1': give a whole number of at least 2"):
            importlib.reload(soak)
        monkeypatch.setenv("TIERSTORE_TEST_STREAM_SOAK_UPDATES", "many")
        with pytest.raises(ValueError, match="at least 2 \\(default 10000\\)"):
            importlib.reload(soak)
    finally:
        monkeypatch.undo()
        importlib.reload(soak)
    assert soak.WRITEBACK_KILLS == 100


def test_a_fixture_marks_the_tests_that_use_it(request: pytest.FixtureRequest) -> None:
    """Every collected test that takes the stand-in store, directly or through another fixture, is marked
    `fuse`; a marker this suite does not know, or one fixture name with two sets of markers, is refused."""
    using = [i for i in request.session.items if "slow_store" in getattr(i, "fixturenames", ())]
    assert all(i.get_closest_marker("fuse") is not None for i in using), [i.nodeid for i in using]
    assert BY_FIXTURE["slow_store"] == ("fuse",)
    with pytest.raises(ValueError, match="unknown markers"):
        needs("gpu")

    def slow_store() -> None:
        pass

    with pytest.raises(ValueError, match="registered twice"):
        needs("s3")(slow_store)
