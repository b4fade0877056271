"""Layer discovery for torch models: one layer = one module that owns parameters directly.

Layers are ordered with the core's `order_layers` (natural order by qualified name), so that the
torch and JAX backends hand the controller the same layer order. Normalisation modules are flagged
`kind="norm"` (the core pins them to FP32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import nn

from triaccel.layers import LayerSpec, order_layers

__all__ = ["TorchLayer", "NORM_TYPES", "ROOT_NAME", "discover_layers", "tensor_layer_index", "is_norm"]

# Modules whose parameters are affine terms of a normalisation: pinned FP32 by the core.
NORM_TYPES: tuple[type[nn.Module], ...] = tuple(
    t for t in (
        nn.modules.batchnorm._NormBase,  # BatchNorm1d/2d/3d, SyncBatchNorm, InstanceNorm*
        nn.LayerNorm,
        nn.GroupNorm,
        getattr(nn, "RMSNorm", None),
        nn.LocalResponseNorm,
    ) if t is not None
)

# Name given to parameters owned directly by the root module (its qualified name is "").
ROOT_NAME = "<root>"


def is_norm(module: nn.Module) -> bool:
    """True for normalisation modules (BatchNorm, LayerNorm, GroupNorm, InstanceNorm, RMSNorm)."""
    return isinstance(module, NORM_TYPES)


@dataclass(frozen=True)
class TorchLayer:
    """A discovered layer: its spec (name, kind), its module and the parameters it owns directly."""

    spec: LayerSpec
    module: nn.Module
    params: tuple[tuple[str, nn.Parameter], ...]  # (qualified parameter name, parameter)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.params)

    @property
    def is_float64(self) -> bool:
        """True when the layer owns a float64 parameter: it keeps computing in float64 whatever
        precision is decided (`PrecisionPlan`); convert it to float32 to let it go lower."""
        return any(p.dtype == torch.float64 for _, p in self.params)


def discover_layers(model: nn.Module, *, only: Iterable[torch.Tensor] | None = None) -> list[TorchLayer]:
    """Modules of `model` that own parameters directly, in the core's deterministic layer order.

    A parameter shared by several modules (tied weights) belongs to the first owner in that order.
    `only`: restrict to these parameters (e.g. those an optimizer updates); modules left without any
    are dropped. Frozen parameters (requires_grad=False) are skipped.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    keep = None if only is None else {id(p) for p in only}
    owners: dict[str, tuple[nn.Module, list[tuple[str, nn.Parameter]]]] = {}
    for mname, mod in model.named_modules():
        own = [(n, p) for n, p in mod.named_parameters(recurse=False)
               if p.requires_grad and (keep is None or id(p) in keep)]
        if own:
            name = mname or ROOT_NAME
            owners[name] = (mod, [(f"{mname}.{n}" if mname else n, p) for n, p in own])
    specs = order_layers([LayerSpec(n, "norm" if is_norm(owners[n][0]) else "other") for n in owners])
    seen: set[int] = set()
    layers: list[TorchLayer] = []
    for spec in specs:
        mod, params = owners[spec.name]
        mine = tuple((n, p) for n, p in params if id(p) not in seen)
        seen.update(id(p) for _, p in mine)
        if mine:
            layers.append(TorchLayer(spec, mod, mine))
    return layers


def tensor_layer_index(layers: Sequence[TorchLayer]) -> tuple[list[nn.Parameter], list[int]]:
    """Flatten layers to (parameters, layer index of each parameter), in layer order."""
    params: list[nn.Parameter] = []
    index: list[int] = []
    for i, layer in enumerate(layers):
        for _, p in layer.params:
            params.append(p)
            index.append(i)
    return params, index
