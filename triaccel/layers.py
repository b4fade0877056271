"""Layer descriptions shared by the backends: names, kinds, and one deterministic order."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

__all__ = ["LayerSpec", "order_layers", "as_specs"]

LAYER_KINDS = ("other", "norm")


@dataclass(frozen=True)
class LayerSpec:
    """One parameter-owning module. kind "norm" (BatchNorm/LayerNorm/GroupNorm...) is pinned FP32."""

    name: str
    kind: str = "other"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"LayerSpec.name={self.name!r}: must be a non-empty string")
        if self.kind not in LAYER_KINDS:
            raise ValueError(f"LayerSpec.kind={self.kind!r}: allowed {LAYER_KINDS}")


def as_specs(layers: Iterable[LayerSpec | str]) -> tuple[LayerSpec, ...]:
    """Normalise names/specs to LayerSpecs; duplicate names raise ValueError."""
    specs = tuple(x if isinstance(x, LayerSpec) else LayerSpec(x) for x in layers)
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise ValueError(f"layers: duplicate layer name {s.name!r}")
        seen.add(s.name)
    return specs


def _natural_key(name: str) -> list[tuple[int, int | str]]:
    # "layer2.10.conv1" after "layer2.9.conv1": digit runs compare as numbers.
    return [(0, int(t)) if t.isdigit() else (1, t) for t in re.split(r"(\d+)", name) if t]


def order_layers(layers: Sequence[LayerSpec | str]) -> list[LayerSpec]:
    """Layers in natural name order, so that torch and JAX discover the same order."""
    return sorted(as_specs(layers), key=lambda s: _natural_key(s.name))
