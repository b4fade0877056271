"""A list of gradient arrays as one zero-padded vector, for the gradient-noise halves inside the
wrapped JAX update (`transform._noise_halves`).

A noise step holds its first half's gradient, then on the second half takes the halves' weighted
mean and its per-array statistics. Done per array, that is a select, a mean and a reduction per
parameter array in the step program, on every step (no `lax.cond`: see `_noise_halves`): on
EfficientNet-B0's 213 arrays it doubled the wrapped update's fusions (936 -> 1,872 on this
machine's CPU) and cost ~16 s of the train step's XLA compilation on an H200 (92.4 s against 76.5 s
without the halves, 2026-11-28, docs/results.md). Over one vector the select and the mean are one
elementwise op, and the statistics a row reduction over fixed-size chunks (no chunk straddles two
arrays) plus a sorted segment sum of the rows: a few kernels whatever the array count. On this
machine's CPU that cut the fusions (1,872 -> 1,173) but neither the compilation nor the call time
(`TriAccel`'s noise_layout); the GPU A/B is benchmarks/results/s43/next/next27_jax_noise_layout.sh.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["FlatLayout"]

CHUNK = 1024   # elements per row of the statistics; each array is zero-padded to a multiple of it


class FlatLayout:
    """Where each of n arrays (sizes in elements) lies in the padded vector: array i at
    ``offsets[i]``, padded to a multiple of `chunk`. size: the vector's length (elements)."""

    def __init__(self, sizes: Sequence[int], chunk: int = CHUNK) -> None:
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk={chunk!r}: allowed integers >= 1")
        self.sizes = tuple(int(s) for s in sizes)
        if any(s < 0 for s in self.sizes):
            raise ValueError(f"sizes={sizes!r}: allowed integers >= 0")
        self.chunk = chunk
        rows = np.array([-(-s // chunk) for s in self.sizes], np.int64)
        self.offsets = tuple(int(o) for o in np.concatenate([[0], np.cumsum(rows)[:-1]]) * chunk) if rows.size else ()
        self.size = int(rows.sum()) * chunk
        self._row_owner = np.repeat(np.arange(len(self.sizes), dtype=np.int32), rows)

    @staticmethod
    @functools.lru_cache(maxsize=32)
    def of(sizes: tuple[int, ...]) -> "FlatLayout":
        """The layout of arrays of these sizes (cached: traced once per program)."""
        return FlatLayout(sizes)

    def flatten(self, leaves: Sequence[Any]) -> jax.Array:
        """(size,) float32 (float64 if any array is): the arrays raveled and zero-padded, in order."""
        self._check(leaves)
        dt = jnp.float64 if any(x.dtype == jnp.float64 for x in leaves) else jnp.float32
        parts = [jnp.pad(x.reshape(-1).astype(dt), (0, -(-s // self.chunk) * self.chunk - s))
                 for x, s in zip(leaves, self.sizes) if s]
        return jnp.concatenate(parts) if parts else jnp.zeros((0,), dt)

    def unflatten(self, flat: jax.Array, like: Sequence[Any]) -> list[jax.Array]:
        """The arrays back from `flat`, each with the shape and dtype of its `like`."""
        self._check(like)
        return [flat[o:o + s].reshape(x.shape).astype(x.dtype) for x, o, s in zip(like, self.offsets, self.sizes)]

    def moments(self, flat: jax.Array) -> jax.Array:
        """(n, 3) float32 [sum, sumsq, nonfinite] of each array (non-finite values count, not sum)."""
        x = flat.reshape(-1, self.chunk)
        fin = jnp.isfinite(x)
        xf = jnp.where(fin, x, 0.0)
        rows = jnp.stack([jnp.sum(xf, 1), jnp.sum(xf * xf, 1), jnp.sum(~fin, 1, dtype=x.dtype)], axis=1)
        out = jax.ops.segment_sum(rows, jnp.asarray(self._row_owner), num_segments=len(self.sizes),
                                  indices_are_sorted=True)
        return out.astype(jnp.float32)

    def _check(self, leaves: Sequence[Any]) -> None:
        got = tuple(int(np.prod(x.shape)) for x in leaves)
        if got != self.sizes:
            raise ValueError(f"leaves: sizes {got} do not match the layout's {self.sizes}")
