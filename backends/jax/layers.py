"""Layer discovery for JAX/Flax: parameter-owning modules by path, in the core's deterministic order.

A layer is the module that owns a parameter leaf: the leaf's path minus its last key
(``layer1.0.conv1.kernel`` -> layer ``layer1.0.conv1``). NNX paths are used as they are; for linen
parameter dicts the leading ``params`` collection is dropped. Norm layers (kind ``"norm"``) are
recognised from the module type for NNX models, and from the parameter names for plain pytrees
(a Flax norm layer owns ``scale``/``bias`` and no ``kernel``/``embedding``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import jax
import numpy as np

from triaccel.layers import LayerSpec, order_layers

__all__ = ["LayerMap", "layer_map", "layer_map_from_model", "layer_map_from_params", "leaf_names",
           "module_kind", "NORM_TYPE_NAMES"]

# Flax norm module class names (nnx and linen share them); matched by name so that no optional
# Flax module is imported here.
NORM_TYPE_NAMES = frozenset({"BatchNorm", "LayerNorm", "GroupNorm", "RMSNorm", "InstanceNorm",
                             "SpectralNorm", "WeightNorm"})
_NORM_PARAM_NAMES = frozenset({"scale", "bias", "mean", "var"})


def _key_str(k: Any) -> str | None:
    """One path entry as a string; None for entries that are not part of a module path."""
    if isinstance(k, jax.tree_util.DictKey):
        return str(k.key)
    if isinstance(k, jax.tree_util.SequenceKey):
        return str(k.idx)
    if isinstance(k, jax.tree_util.GetAttrKey):
        # nnx.Variable leaves flatten through `.value`; that is not a module attribute.
        return None if k.name in ("value", "raw_value", "_raw_value") else k.name
    if isinstance(k, jax.tree_util.FlattenedIndexKey):
        return str(k.key)
    return str(k)


def leaf_names(tree: Any) -> list[tuple[str, str]]:
    """(layer name, parameter name) of every leaf of `tree`, in `jax.tree_util` flatten order.

    A leading linen ``params`` collection key is dropped. A leaf at the root (no module) raises
    ValueError: it has no owning layer.
    """
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = [s for s in (_key_str(k) for k in path) if s is not None]
        if parts and parts[0] == "params" and len(parts) > 2:
            parts = parts[1:]
        if len(parts) < 2:
            raise ValueError(f"tree: leaf at path {jax.tree_util.keystr(path)!r} has no owning module "
                             "(expected <module path>.<param name>)")
        out.append((".".join(parts[:-1]), parts[-1]))
    return out


def module_kind(module: Any) -> str:
    """LayerSpec kind of a Flax module: "norm" for norm layers (pinned FP32), else "other".

    Subclasses count (e.g. a torch-semantics ``BatchNorm2d(nnx.BatchNorm)``)."""
    return "norm" if any(c.__name__ in NORM_TYPE_NAMES for c in type(module).__mro__) else "other"


@dataclass(frozen=True)
class LayerMap:
    """Layers in the core's order and which parameter leaf belongs to which layer.

    specs: the ordered layers (pass them to `Controller`). tensor_layer: int64 (n_tensors,), the
    layer index of each leaf of the parameter tree in flatten order. tensor_sizes: int64
    (n_tensors,), elements per leaf.
    """

    specs: tuple[LayerSpec, ...]
    tensor_names: tuple[str, ...]
    tensor_layer: np.ndarray
    tensor_sizes: np.ndarray
    _index: dict[str, int] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._index.update({s.name: i for i, s in enumerate(self.specs)})

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    @property
    def num_layers(self) -> int:
        return len(self.specs)

    @property
    def num_tensors(self) -> int:
        return len(self.tensor_names)

    @property
    def layer_counts(self) -> np.ndarray:
        """int64 (L,): gradient elements per layer."""
        out = np.zeros(self.num_layers, dtype=np.int64)
        np.add.at(out, self.tensor_layer, self.tensor_sizes)
        return out

    def index(self, name: str) -> int:
        if name not in self._index:
            raise ValueError(f"layer name {name!r}: not a layer of this model (known: {list(self._index)[:8]}...)")
        return self._index[name]

    def tensor_layer_of(self, tree: Any) -> np.ndarray:
        """int64 (n_leaves,) layer index of every leaf of `tree` (a params-shaped tree, e.g. grads).

        Works from paths, so a tree of another container type (nnx.State vs dict) maps the same way.
        """
        return np.array([self.index(layer) for layer, _ in leaf_names(tree)], dtype=np.int64)


def _build(names: list[tuple[str, str]], sizes: list[int], kinds: Mapping[str, str]) -> LayerMap:
    layer_names = list(dict.fromkeys(n for n, _ in names))
    specs = tuple(order_layers([LayerSpec(n, kinds.get(n, "other")) for n in layer_names]))
    index = {s.name: i for i, s in enumerate(specs)}
    return LayerMap(specs=specs,
                    tensor_names=tuple(f"{l}.{p}" for l, p in names),
                    tensor_layer=np.array([index[l] for l, _ in names], dtype=np.int64),
                    tensor_sizes=np.array(sizes, dtype=np.int64))


def layer_map_from_params(params: Any, kinds: Mapping[str, str] | None = None) -> LayerMap:
    """LayerMap of a parameter pytree (NNX State, linen ``{'params': ...}`` dict, any nested dict).

    kinds: optional {layer name: kind} overriding the name-based guess (a layer whose parameters
    are all among scale/bias is a norm layer).
    """
    names = leaf_names(params)
    sizes = [int(np.prod(np.shape(x))) for x in jax.tree_util.tree_leaves(params)]
    owned: dict[str, set[str]] = {}
    for layer, p in names:
        owned.setdefault(layer, set()).add(p)
    guessed = {l: ("norm" if ps <= _NORM_PARAM_NAMES and "scale" in ps else "other") for l, ps in owned.items()}
    if kinds:
        unknown = set(kinds) - set(owned)
        if unknown:
            raise ValueError(f"kinds: layer names {sorted(unknown)} are not layers of params")
        guessed.update(kinds)
    return _build(names, sizes, guessed)


def layer_map_from_model(model: Any, wrt: Any = None) -> LayerMap:
    """LayerMap of a Flax NNX module: layers = modules owning `wrt` variables (default nnx.Param).

    Kinds come from the module types (BatchNorm/LayerNorm/GroupNorm/RMSNorm -> "norm").
    """
    from flax import nnx  # lazy: the layer maths above works without flax

    state = nnx.as_pure(nnx.state(model, nnx.Param if wrt is None else wrt))
    kinds = {".".join(str(p) for p in path): module_kind(m) for path, m in nnx.iter_modules(model)}
    names = leaf_names(state)
    sizes = [int(np.prod(np.shape(x))) for x in jax.tree_util.tree_leaves(state)]
    return _build(names, sizes, {n: kinds.get(n, "other") for n, _ in names})


def layer_map(model_or_params: Any) -> LayerMap:
    """LayerMap from an NNX module (precise kinds) or any parameter pytree (name-based kinds)."""
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is a dependency of this backend
        nnx = None
    if nnx is not None and isinstance(model_or_params, nnx.Module):
        return layer_map_from_model(model_or_params)
    return layer_map_from_params(model_or_params)
