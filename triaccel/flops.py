"""Share of the compute (conv/linear FLOPs) run at each precision over a run.

The backends measure each layer's forward FLOPs per sample once (`triaccel.backends.torch.flops`,
`triaccel.backends.jax.flops`); `FlopShare` weighs them by the samples each step ran under its
decided precisions. Framework-free, so both backends report the same figure the same way.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .precision import Precision

__all__ = ["FlopShare"]


class FlopShare:
    """Accumulates FLOPs per precision: `add(precisions, samples)` once per step.

    layer_flops: (L,) forward FLOPs per sample of each layer in the controller's order (0 for
    layers that are not conv/linear, e.g. norms). Training FLOPs are ~3x forward for every layer
    alike, so the shares are those of the whole step.
    """

    def __init__(self, layer_flops: Sequence[float]) -> None:
        f = np.asarray(layer_flops, dtype=np.float64)
        if f.ndim != 1 or f.size == 0 or not np.isfinite(f).all() or (f < 0).any() or f.sum() <= 0:
            raise ValueError("layer_flops: expected a non-empty (L,) vector of finite FLOPs >= 0, not all 0")
        self.layer_flops = f
        self.totals = np.zeros(len(Precision))          # FLOPs per Precision level
        self._by_policy: dict[tuple[Precision, ...], np.ndarray] = {}
        self._last_key: Any = None
        self._last = np.zeros(len(Precision))

    def _split(self, precisions: tuple[Precision, ...]) -> np.ndarray:
        v = self._by_policy.get(precisions)
        if v is None:
            if len(precisions) != self.layer_flops.size:
                raise ValueError(f"precisions: expected {self.layer_flops.size} values (one per layer), "
                                 f"got {len(precisions)}")
            lv = np.array([int(p) for p in precisions])
            v = self._by_policy[precisions] = np.bincount(lv, weights=self.layer_flops, minlength=len(Precision))
        return v

    def add(self, precisions: Sequence[Precision], samples: int) -> None:
        """One step: `samples` samples ran with per-layer `precisions` (L,). Called per step: the
        same object as last time (a decision's tuple) skips hashing the L enum members."""
        if precisions is not self._last_key:
            self._last_key, self._last = precisions, self._split(tuple(precisions))
        self.totals += samples * self._last

    def shares(self) -> dict[str, float]:
        """Fraction of conv/linear FLOPs per precision so far ({"fp16", "bf16", "fp32"}; zeros before any step)."""
        total = self.totals.sum()
        return {p.short: float(self.totals[p] / total) if total else 0.0 for p in Precision}

    def sixteen_bit(self) -> float:
        """Fraction of conv/linear FLOPs in FP16 or BF16 so far."""
        s = self.shares()
        return s["fp16"] + s["bf16"]

    def state_dict(self) -> dict[str, Any]:
        return {"layer_flops": self.layer_flops.tolist(), "totals": self.totals.tolist()}
