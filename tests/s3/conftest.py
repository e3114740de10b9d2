"""One SeaweedFS server (`weed server -s3`, on free loopback ports) for the S3 tests of a module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.marks import needs
from tierstore.testing.s3server import S3Server


@pytest.fixture(scope="module")
@needs("s3")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with S3Server(tmp_path_factory.mktemp("seaweedfs")) as s3:
        yield s3
