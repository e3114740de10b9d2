"""DStore's stable layer IDs: a layer is named by what it is and what feeds it, never by its label.

A leaf layer's ID hashes its structural configuration (class, `extra_repr()`, parameter and buffer shapes
and dtypes) together with the IDs of the layers its inputs come from, Merkle-style. The dependencies come
from a `torch.fx` trace when the model traces, and from module order otherwise. Two models built in a
different order or with different attribute names give their equal layers equal IDs; a changed shape or a
changed input edge changes the ID of that layer and of everything downstream.

Computing IDs is linear in layers plus edges. Per-layer signatures and each model's dependency structure
are cached in process, so hashing a model again after a save costs only the Merkle combination.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass
from typing import Any

INPUT = hashlib.blake2b(b"tierstore:input", digest_size=16).digest()


@dataclass(frozen=True)
class Structure:
    """The layers of a model in dependency order, with the positions of each layer's inputs."""

    paths: tuple[str, ...]
    deps: tuple[tuple[int, ...], ...]  # -1 stands for a model input
    traced: bool


# id(module) -> (weak reference, structural key, signature digest)
_signatures: dict[int, tuple[weakref.ref, tuple, bytes]] = {}
# id(model) -> (weak reference, ids of its layers, structure)
_structures: dict[int, tuple[weakref.ref, tuple[int, ...], Structure]] = {}


def _forget(cache: dict[int, Any], key: int) -> Any:
    """A weakref callback that drops a cache entry when its module is collected."""
    return lambda _: cache.pop(key, None)


def leaf_layers(model: Any) -> list[tuple[str, Any]]:
    """Modules with no children, or with parameters of their own: the units that hold weights."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if name and (not m._modules or m._parameters or m._buffers)
    ]


def _key(m: Any) -> tuple:
    tensors = [*m._parameters.items(), *m._buffers.items()]
    return tuple((k, tuple(v.shape), v.dtype) if v is not None else (k, None, None) for k, v in tensors)


def signature(m: Any) -> bytes:
    """The hash of one layer's structural configuration (memoized while the module lives unchanged)."""
    key = _key(m)
    hit = _signatures.get(id(m))
    if hit is not None and hit[0]() is m and hit[1] == key:
        return hit[2]
    cls = type(m)
    text = f"{cls.__module__}.{cls.__qualname__}({m.extra_repr()})|" + "|".join(
        f"{k}:{shape}:{dtype}" for k, shape, dtype in key
    )
    digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
    _signatures[id(m)] = (weakref.ref(m, _forget(_signatures, id(m))), key, digest)
    return digest


def _trace_structure(model: Any, layers: list[tuple[str, Any]]) -> Structure | None:
    try:
        import torch.fx

        class Tracer(torch.fx.Tracer):
            # Every layer we hash is a leaf of the trace, even a custom module that holds weights.
            def is_leaf_module(self, m: Any, qualname: str) -> bool:
                return qualname in index or super().is_leaf_module(m, qualname)

        index = {path: i for i, (path, _) in enumerate(layers)}
        graph = Tracer().trace(model)
    except Exception:  # models with data-dependent control flow do not trace: fall back to module order
        return None
    # For every node, the layers whose outputs reach it without passing through another layer.
    feeds: dict[Any, tuple[int, ...]] = {}
    order: list[int] = []
    deps: dict[int, tuple[int, ...]] = {}
    for node in graph.nodes:
        inputs: list[int] = []
        for arg in node.all_input_nodes:
            for d in feeds.get(arg, ()):
                if d not in inputs:
                    inputs.append(d)
        if node.op == "placeholder":
            feeds[node] = (-1,)
        elif node.op == "call_module" and node.target in index:
            i = index[node.target]
            if i not in deps:
                order.append(i)
                deps[i] = tuple(inputs) or (-1,)
            feeds[node] = (i,)
        else:
            feeds[node] = tuple(inputs)
    # Layers the forward pass never calls still get an ID, after the rest, fed by the model input.
    for i in range(len(layers)):
        if i not in deps:
            order.append(i)
            deps[i] = (-1,)
    pos = {layer: p for p, layer in enumerate(order)}
    return Structure(
        paths=tuple(layers[i][0] for i in order),
        deps=tuple(tuple(pos[d] if d >= 0 else -1 for d in deps[i]) for i in order),
        traced=True,
    )


def structure(model: Any) -> Structure:
    """The dependency structure of `model` (cached while its modules stay the same)."""
    layers = leaf_layers(model)
    ids = tuple(id(m) for _, m in layers)
    hit = _structures.get(id(model))
    if hit is not None and hit[0]() is model and hit[1] == ids:
        return hit[2]
    s = _trace_structure(model, layers)
    if s is None:
        s = Structure(
            paths=tuple(p for p, _ in layers),
            deps=tuple(((i - 1,) if i else (-1,)) for i in range(len(layers))),
            traced=False,
        )
    _structures[id(model)] = (weakref.ref(model, _forget(_structures, id(model))), ids, s)
    return s


def layer_ids(model: Any) -> dict[str, str]:
    """The stable ID (32 hex digits) of every leaf layer of `model`, by module path."""
    s = structure(model)
    modules = dict(model.named_modules())
    digests: list[bytes] = []
    for path, deps in zip(s.paths, s.deps, strict=True):
        h = hashlib.blake2b(signature(modules[path]), digest_size=16)
        for d in deps:
            h.update(digests[d] if d >= 0 else INPUT)
        digests.append(h.digest())
    return {path: d.hex() for path, d in zip(s.paths, digests, strict=True)}


def describe(model: Any) -> dict[str, Any]:
    """The compact architecture graph stored in a manifest: layers in dependency order."""
    s = structure(model)
    ids = layer_ids(model)
    modules = dict(model.named_modules())
    layers = []
    for path, deps in zip(s.paths, s.deps, strict=True):
        m = modules[path]
        params = [f"{path}.{k}" for k in [*m._parameters, *m._buffers] if getattr(m, k, None) is not None]
        layers.append(
            {
                "path": path,
                "class": type(m).__name__,
                "id": ids[path],
                "inputs": list(deps),
                "tensors": params,
            }
        )
    return {"traced": s.traced, "layers": layers}
