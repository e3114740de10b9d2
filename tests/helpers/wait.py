"""Polling until something holds: what a test does while another process gets there."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest


def wait_for(what: str, cond: Callable[[], object], timeout: float = 20.0) -> float:
    """Polls `cond` every 10 ms until it is true; returns the seconds that took. The test fails, naming
    `what`, if it is not true within `timeout` seconds."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            pytest.fail(f"{what}: not within {timeout} s")
        time.sleep(0.01)
    return time.monotonic() - start


def until(what: str, probe: Callable[[], str], ok: Callable[[str], bool], timeout: float = 30.0) -> str:
    """Polls `probe` every 50 ms until `ok` holds of its output (the agent learns of a swap a moment after
    it), and returns that output. The test fails with the last output if it does not within `timeout`."""
    end = time.monotonic() + timeout
    out = ""
    while time.monotonic() < end:
        out = probe()
        if ok(out):
            return out
        time.sleep(0.05)
    pytest.fail(f"{what}: not within {timeout} s; last output:\n{out}")
