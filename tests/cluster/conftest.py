"""The dataset the cluster tests read, on the stand-in store."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.cluster import dataset


@pytest.fixture
def store(slow_store: tuple[Path, Path]) -> tuple[Path, dict[str, str]]:
    """The dataset on the stand-in store: (mount, digests by relative path)."""
    backing, mount = slow_store
    return mount, dataset(backing)
