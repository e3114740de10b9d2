"""What the demo (examples/demo.py) tells the user to run after it ends: its `tierstore status` stands only
while its tier and source directory do, which it removes unless --keep (issue #49). Checked without running
the demo, which test_demo.py does (slowly)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo() -> ModuleType:
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("tierstore_demo", ROOT / "examples" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demo_offers_its_status_command_again_only_when_it_keeps_what_it_needs(demo: ModuleType) -> None:
    source = demo.STORE
    command = demo.status_command(source)
    assert command == f"tierstore --source {source} --tier {demo.TIER_SPEC} status"
    removed = demo.rerun_hint(source, keep=False)
    assert command not in removed and "--keep" in removed and "removes its dataset and tier" in removed
    kept = demo.rerun_hint(source, keep=True)
    assert f"`{command}`" in kept
