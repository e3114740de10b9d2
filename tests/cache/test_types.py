"""The dicts the engine hands to Python are what `tierstore.types` says, key for key: each one a real cache,
a prefetch, an ordered prefetch, write-back and the settings table return at runtime is checked against
the TypedDict that `_core.pyi` gives it (nested ones too), so a key added to or removed from the Rust code
that builds it (crates/tierstore-py/src) fails here until the types follow."""

from __future__ import annotations

import ast
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints, is_typeddict

import pytest

import tierstore
import tierstore.types
from tests.helpers.data import make_files
from tierstore import _core

STUB = Path(tierstore.__file__).with_name("_core.pyi")


def promised(name: str) -> Any:
    """The type `_core.pyi` says the function or method `name` returns ("Cache.stats"), resolved against
    `tierstore.types`: what mypy holds the Python code to is what the runtime value is held to here."""
    *classes, function = name.split(".")
    body = ast.parse(STUB.read_text()).body
    for cls in classes:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    node = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == function)
    assert node.returns is not None, f"{name} has no return type in {STUB}"
    # The annotation as the stub writes it, evaluated where the stub's TypedDicts come from.
    return eval(ast.unparse(node.returns), dict(vars(tierstore.types)))


def mismatches(value: object, hint: Any, where: str = "value") -> list[str]:
    """Where `value` is not of the type `hint`: a TypedDict's keys must be exactly those it declares
    (required and optional), and each value of its type, through lists, tuples and unions."""
    if is_typeddict(hint):
        if not isinstance(value, dict):
            return [f"{where}: a {type(value).__name__}, not a dict ({hint.__name__})"]
        declared = get_type_hints(hint)
        problems = []
        missing = sorted(hint.__required_keys__ - value.keys())
        if missing:
            problems.append(f"{where}: {hint.__name__} keys the engine did not give: {missing}")
        unknown = sorted(value.keys() - hint.__required_keys__ - hint.__optional_keys__)
        if unknown:
            problems.append(f"{where}: keys the engine gave that {hint.__name__} does not declare: {unknown}")
        for key in sorted(declared.keys() & value.keys()):
            problems += mismatches(value[key], declared[key], f"{where}[{key!r}]")
        return problems
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        if any(not mismatches(value, arm, where) for arm in args):
            return []
        return [f"{where}: {value!r} is none of {hint}"]
    if origin is Literal:
        return [] if value in args else [f"{where}: {value!r} is not one of {args}"]
    if origin is list:
        if not isinstance(value, list):
            return [f"{where}: a {type(value).__name__}, not a list"]
        return [p for i, item in enumerate(value) for p in mismatches(item, args[0], f"{where}[{i}]")]
    if origin is tuple:
        if not isinstance(value, tuple):
            return [f"{where}: a {type(value).__name__}, not a tuple"]
        arms = [args[0]] * len(value) if args[1:] == (...,) else list(args)
        if len(value) != len(arms):
            return [f"{where}: {len(value)} items, not {len(arms)}"]
        return [
            p
            for i, (item, arm) in enumerate(zip(value, arms, strict=True))
            for p in mismatches(item, arm, f"{where}[{i}]")
        ]
    if hint is type(None):
        return [] if value is None else [f"{where}: {value!r}, not None"]
    # int, float, str, bool exactly: a bool is an int to isinstance, an int is no float from Rust.
    return (
        [] if type(value) is hint else [f"{where}: {value!r} is {type(value).__name__}, not {hint.__name__}"]
    )


def test_every_row_of_the_settings_table_is_a_setting() -> None:
    # The stub types the rows as plain dicts (stubtest cannot check them as TypedDicts); they are Settings.
    assert len(_core.SETTINGS) > 10
    problems = [
        p
        for i, row in enumerate(_core.SETTINGS)
        for p in mismatches(row, tierstore.types.Setting, f"SETTINGS[{i}]")
    ]
    assert not problems, problems


def test_a_cache_and_its_prefetches_give_the_dicts_the_stub_promises(source: Path, tier: str) -> None:
    make_files(source / "walked", 5, size=1000)
    # A link to nothing fails in both prefetches: their errors are not empty.
    (source / "walked" / "dangling").symlink_to(source / "nowhere")
    ordered = sorted(make_files(source / "ordered", 4, size=1000))
    cache = tierstore.Cache(source, [f"{tier}:64M"])

    progress = cache.prefetch(source / "walked", progress=False)
    assert progress["files_copied"] == 5 and progress["first_error"] is not None
    with cache.prefetch_order([*ordered, source / "walked" / "dangling"], budget="16M") as handle:
        assert handle.wait(60)
        order_progress = handle.progress()
    assert order_progress["files_fetched"] == 4 and order_progress["errors"]

    returned = {
        "Prefetch.progress": progress,
        "OrderPrefetch.progress": order_progress,
        "Cache.stats": cache.stats(),
        "Cache.config": cache.config(),
        "effective_config": tierstore.cache.effective_config(source, [f"{tier}:64M"]),
    }
    problems = [p for name, value in returned.items() for p in mismatches(value, promised(name), name)]
    assert not problems, problems


def test_a_shared_configuration_gives_the_config_the_stub_promises(
    source: Path, tier: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With sharing on, the cluster part has members: each is checked too. Read without opening the cache,
    so no agent starts."""
    monkeypatch.setenv("TIERSTORE_SHARING", "inclusive")
    monkeypatch.setenv("TIERSTORE_PEERS", "127.0.0.1:7001,127.0.0.2:7001")
    monkeypatch.setenv("TIERSTORE_NODE", "127.0.0.1:7001")
    config = tierstore.cache.effective_config(source, [f"{tier}:64M"])
    assert config["cluster"][0]["members"] == ["127.0.0.1:7001", "127.0.0.2:7001"]
    problems = mismatches(config, promised("effective_config"), "effective_config")
    assert not problems, problems


def test_writeback_gives_the_dicts_the_stub_promises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dest").mkdir()
    monkeypatch.setenv("TIERSTORE_WRITEBACK", f"{tmp_path / 'dest'}:{tmp_path / 'stage'}:1G:local")
    wb = _core.Writeback()
    returned = {"Writeback.destinations": wb.destinations(), "Writeback.pending": wb.pending()}
    assert all(len(value) == 1 for value in returned.values()), returned
    problems = [p for name, value in returned.items() for p in mismatches(value, promised(name), name)]
    assert not problems, problems


def test_the_check_sees_a_key_added_removed_or_of_another_type(source: Path, tier: str) -> None:
    make_files(source, 2, size=100)
    stats = tierstore.Cache(source, [f"{tier}:64M"]).stats()
    hint = promised("Cache.stats")
    assert mismatches(stats, hint) == []

    added = {**stats, "tiers": [{**stats["tiers"][0], "new_counter": 0}]}
    assert mismatches(added, hint) == [
        "value['tiers'][0]: keys the engine gave that TierStats does not declare: ['new_counter']"
    ]
    removed = {**stats, "source": {k: v for k, v in stats["source"].items() if k != "lists"}}
    assert mismatches(removed, hint) == [
        "value['source']: SourceStats keys the engine did not give: ['lists']"
    ]
    retyped = {**stats, "tiers": [{**stats["tiers"][0], "quota": "64M"}]}
    assert mismatches(retyped, hint) == ["value['tiers'][0]['quota']: '64M' is str, not int"]
