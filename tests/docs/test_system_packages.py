"""The system packages `make setup` installs (the Makefile's SYSTEM_PACKAGES) are the ones the setup pages
name: docs/getting-started.md and docs/design/testing.md each list every one of them, so that a package
added to the Makefile (rclone, issue #49) cannot go unsaid."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def system_packages() -> list[str]:
    m = re.search(r"^SYSTEM_PACKAGES\s*:=\s*(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert m, "the Makefile sets no SYSTEM_PACKAGES"
    return m[1].split()


@pytest.mark.parametrize("page", ["docs/getting-started.md", "docs/design/testing.md"])
def test_the_setup_pages_name_every_system_package(page: str) -> None:
    text = (ROOT / page).read_text()
    # The paragraph that says what `make setup` installs with apt-get.
    (said,) = [
        p for p in re.split(r"\n\s*\n", text) if "apt-get" in p and ("make setup" in p or "installs" in p)
    ]
    named = set(re.findall(r"`([\w.+-]+)`", said))
    missing = [p for p in system_packages() if p not in named]
    assert not missing, f"{page} does not name {missing} among the packages `make setup` installs:\n{said}"
