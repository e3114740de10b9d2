"""The stand-in store's own promises, which every benchmark's baseline rests on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.marks import needs
from tierstore.testing import slowfs


class Clock:
    """A clock that only moves when the code under test sleeps or the test says time passed."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.mark.parametrize(("overhead", "expected"), [(0.0, 100.0), (0.005, 100.0), (0.02, 50.0)])
def test_a_bandwidth_cap_bounds_the_rate_and_adds_nothing_below_it(
    monkeypatch: pytest.MonkeyPatch, overhead: float, expected: float
) -> None:
    """A client that spends `overhead` seconds of its own per 1 MiB request, under a 100 MiB/s cap: it gets
    the cap when its own pace is faster (0 and 5 ms per MiB), and its own pace when that is slower (20 ms
    per MiB is 50 MiB/s): the cap never adds its time to the client's."""
    clock = Clock()
    monkeypatch.setattr(slowfs.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(slowfs.time, "sleep", clock.sleep)
    throttle = slowfs.Throttle(100 * 2**20)
    start = clock.now
    for _ in range(500):
        clock.now += overhead
        throttle.take(2**20)
    rate = 500 / (clock.now - start)
    # Within the burst the timeline may lag the clock by (50 ms over a 5 s run, at most 1%).
    assert expected * 0.99 <= rate <= expected * 1.01, rate


def test_no_cap_never_sleeps(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(slowfs.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(slowfs.time, "sleep", clock.sleep)
    throttle = slowfs.Throttle(0)
    for _ in range(10):
        throttle.take(2**30)
    assert clock.now == 1000.0


@needs("fuse")
@pytest.mark.skipif(
    os.geteuid() != 0, reason="the kernel's FUSE queue is set through fusectl, which takes root"
)
def test_the_store_can_be_mounted_with_a_deeper_kernel_queue(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    with slowfs.mounted(tmp_path / "src", tmp_path / "mnt", queue=48) as mnt:
        conn = Path("/sys/fs/fuse/connections") / str(os.minor(os.stat(mnt).st_dev))
        assert (conn / "max_background").read_text().split() == ["48"]
        assert (conn / "congestion_threshold").read_text().split() == ["36"]
    with slowfs.mounted(tmp_path / "src", tmp_path / "mnt") as mnt:  # the kernel's own, unless asked
        conn = Path("/sys/fs/fuse/connections") / str(os.minor(os.stat(mnt).st_dev))
        assert (conn / "max_background").read_text().split() == ["12"]
