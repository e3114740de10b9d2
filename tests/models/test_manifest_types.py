"""The manifests Python reads are what `tierstore.types` says, key for key: a version saved to a real
repository and one published to a real agent are read back through the functions the repository and the
stream read them with, and each key of the file, a tensor's included, is one the TypedDict declares and
the other way round, so a field added to or removed from `crates/tierstore-core/src/models/manifest.rs`
fails here until the types follow."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints, is_typeddict

import pytest

from tierstore import _core, stream
from tierstore.models import Repository
from tierstore.models.files import read_manifest
from tierstore.types import RepositoryManifest, StreamManifest

torch = pytest.importorskip("torch")


def key_mismatches(value: dict[str, Any], hint: Any, where: str = "manifest") -> list[str]:
    """Where the keys of `value` differ from those TypedDict `hint` declares, and of the TypedDicts it
    holds in lists (the tensors)."""
    declared = get_type_hints(hint)
    problems = []
    undeclared = sorted(value.keys() - declared.keys())
    if undeclared:
        problems.append(f"{where}: keys the file has that {hint.__name__} does not declare: {undeclared}")
    absent = sorted(declared.keys() - value.keys())
    if absent:
        problems.append(f"{where}: keys {hint.__name__} declares that the file lacks: {absent}")
    for key, arm in declared.items():
        if get_origin(arm) is list and is_typeddict(get_args(arm)[0]):
            for i, item in enumerate(value.get(key, [])):
                problems += key_mismatches(item, get_args(arm)[0], f"{where}[{key!r}][{i}]")
    return problems


def test_a_saved_versions_manifest_has_exactly_the_keys_of_its_type(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    repo = Repository(tmp_path / "repo")
    v = repo.save("m", model, metadata={"step": 7})
    manifest = read_manifest(tmp_path / "repo" / "models" / "m" / f"v{v.version}.json")
    assert len(manifest["tensors"]) == 4 and manifest["graph"], "the checks below saw tensors and a graph"
    assert key_mismatches(manifest, RepositoryManifest) == []


def test_a_published_versions_manifest_has_exactly_the_keys_of_its_type(sock: Path) -> None:
    model = torch.nn.Linear(4, 3)
    v = stream.publish("m", model, step=10, metadata={"lr": 0.1})
    assert isinstance(v, stream.StreamVersion)
    manifest = json.loads(_core.stream_manifest_read(v.manifest))  # as the stream's subscribers read it
    assert manifest["step"] == 10 and len(manifest["tensors"]) == 2
    assert key_mismatches(manifest, StreamManifest) == []


def test_the_check_sees_a_key_added_or_removed(tmp_path: Path) -> None:
    repo = Repository(tmp_path / "repo")
    repo.save("m", {"w": torch.zeros(2)})
    manifest = dict(repo.manifest("m"))
    tensor = {k: v for k, v in manifest["tensors"][0].items() if k != "offset"}
    changed = {**manifest, "new_key": 1, "tensors": [tensor]}
    assert key_mismatches(changed, RepositoryManifest) == [
        "manifest: keys the file has that RepositoryManifest does not declare: ['new_key']",
        "manifest['tensors'][0]: keys StoredTensor declares that the file lacks: ['offset']",
    ]
