"""The markers a fixture gives every test that uses it, directly or through another fixture.

A test that takes the stand-in store (`slow_store`) needs FUSE whether or not it says so; `@needs("fuse")`
on the fixture marks it `fuse` at collection (tests/conftest.py applies them), so `-m "not fuse"` leaves it
out. Markers a test needs for what it does itself (it mounts a tmpfs: `root`) are on the test.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., object])

# The markers of this suite (registered in pyproject.toml, where `--strict-markers` refuses any other).
MARKERS = ("slow", "root", "fuse", "s3", "gcs", "webdav", "redis", "netns")

# Fixture name -> the markers its tests get.
BY_FIXTURE: dict[str, tuple[str, ...]] = {}


def needs(*marks: str) -> Callable[[F], F]:
    """Registers the fixture below (by its function's name, which is the fixture's name) as needing
    `marks`. Put it under `@pytest.fixture`. Fixture names are the key: two fixtures of one name must need
    the same."""
    unknown = [m for m in marks if m not in MARKERS]
    if unknown:
        raise ValueError(f"unknown markers {unknown}: use {', '.join(MARKERS)}")

    def register(fixture: F) -> F:
        name = fixture.__name__
        if BY_FIXTURE.get(name, marks) != marks:
            raise ValueError(f"fixture {name!r} is registered twice with other markers; give it another name")
        BY_FIXTURE[name] = marks
        return fixture

    return register
