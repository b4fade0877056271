"""Bounded precision variants: layers grouped so that few distinct policies (compilations) exist.

Under `jax.jit` and `torch.compile` each distinct per-layer precision assignment is one compiled
step. With `TriAccelConfig.precision_groups = G` the non-norm layers, in layer order, form G
contiguous groups of near-equal size, and every layer of a group computes at the highest precision
the law decides for any of them: a policy is then a choice per group, so at most 3^G policies exist
(2^G under the evidence law, whose levels are the base precision or FP32), whatever the depth of
the model. Norm layers stay FP32 and belong to no group. Both backends take the grouped decision
from the `Controller`, so their policies are identical.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .precision import Precision

__all__ = ["precision_groups", "group_precisions"]


def precision_groups(pinned: Sequence[bool] | np.ndarray, groups: int | None) -> np.ndarray | None:
    """(L,) group index of each layer (-1 for pinned layers), or None for per-layer precision.

    pinned: bool (L,), layers held at FP32 (norm layers). groups: None or G >= 1 (more groups than
    free layers leaves one layer per group)."""
    if groups is None:
        return None
    if isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups < 1:
        raise ValueError(f"groups={groups!r}: allowed None or an integer >= 1")
    pinned = np.asarray(pinned, dtype=bool)
    free = np.flatnonzero(~pinned)
    out = np.full(pinned.shape, -1, dtype=np.int64)
    for g, members in enumerate(np.array_split(free, min(int(groups), max(len(free), 1)))):
        out[members] = g
    return out


def group_precisions(precisions: Sequence[Precision], groups: np.ndarray | None) -> tuple[Precision, ...]:
    """Each grouped layer at the highest precision of its group (`precision_groups`); pinned
    layers (group -1) keep theirs. groups None: `precisions` unchanged."""
    precisions = tuple(precisions)
    if groups is None:
        return precisions
    if len(groups) != len(precisions):
        raise ValueError(f"precisions: {len(precisions)} values for {len(groups)} layers")
    levels = np.array([int(p) for p in precisions], dtype=np.int64)
    top = {g: int(levels[groups == g].max()) for g in np.unique(groups[groups >= 0])}
    return tuple(Precision(top[g]) if g >= 0 else p for g, p in zip(groups.tolist(), precisions))
