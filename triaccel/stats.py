"""Gradient statistics maths shared by the backends (host side, float64)."""

from __future__ import annotations

import numpy as np

__all__ = ["group_by_layer", "variance_from_moments"]


def variance_from_moments(sums: np.ndarray, sumsqs: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Population variance per layer from its moments: E[g^2] - E[g]^2, in float64.

    sums, sumsqs, counts: shape (..., L). Layers with count 0 raise ValueError (a layer without
    gradient elements has no variance); tiny negative round-off is reported as 0.
    """
    s = np.asarray(sums, dtype=np.float64)
    q = np.asarray(sumsqs, dtype=np.float64)
    n = np.asarray(counts, dtype=np.float64)
    if not (s.shape == q.shape == n.shape):
        raise ValueError(f"sums, sumsqs, counts: shapes differ ({s.shape}, {q.shape}, {n.shape})")
    if (n <= 0).any():
        raise ValueError("counts: every layer needs at least one gradient element")
    mean = s / n
    return np.maximum(q / n - mean * mean, 0.0)


def group_by_layer(values: np.ndarray, tensor_layer: np.ndarray, num_layers: int) -> np.ndarray:
    """Sum per-tensor values (..., n_tensors) into per-layer values (..., num_layers).

    tensor_layer: int (n_tensors,), the layer index of each tensor (moments are additive, so a
    layer's sum/sumsq/count is the sum over its tensors).
    """
    v = np.asarray(values, dtype=np.float64)
    idx = np.asarray(tensor_layer, dtype=np.int64)
    if idx.ndim != 1 or v.shape[-1] != idx.shape[0]:
        raise ValueError(f"tensor_layer: expected shape ({v.shape[-1]},) matching values' last axis, "
                         f"got {idx.shape}")
    if idx.size and (idx.min() < 0 or idx.max() >= num_layers):
        raise ValueError(f"tensor_layer: indices must lie in [0, {num_layers - 1}]")
    out = np.zeros(v.shape[:-1] + (num_layers,))
    np.add.at(out, (..., idx), v)
    return out
