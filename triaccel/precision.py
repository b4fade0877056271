"""Precision lever: per-layer FP16/BF16/FP32 from an EMA of gradient variance.

Levels are ordered (FP16 < BF16 < FP32) so that a promotion is "+1 level".
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

__all__ = ["Precision", "PrecisionLaw"]


class Precision(enum.IntEnum):
    """Compute precision of one layer, ordered by range/accuracy."""

    FP16 = 0
    BF16 = 1
    FP32 = 2

    @property
    def short(self) -> str:
        """"fp16" | "bf16" | "fp32"."""
        return ("fp16", "bf16", "fp32")[self]

    @property
    def dtype_name(self) -> str:
        """NumPy/torch/jax dtype name: "float16" | "bfloat16" | "float32"."""
        return ("float16", "bfloat16", "float32")[self]

    @classmethod
    def parse(cls, value: Any, param: str = "precision") -> "Precision":
        """Accept a Precision, its int, its short name ("bf16"), its dtype name ("bfloat16"), or a
        framework's dtype of one: torch.bfloat16, np.dtype("float16"), jnp.bfloat16, np.float32, ...
        Dtypes are read by duck typing (no framework is imported). ValueError naming `param` else."""
        if isinstance(value, Precision):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            if 0 <= value <= 2:
                return cls(value)
        else:
            key = value
            if isinstance(key, type):  # scalar types: jnp.bfloat16 (has .dtype), np.float16, ml_dtypes
                dt = getattr(key, "dtype", None)
                key = dt if isinstance(dt, np.dtype) else np.dtype(key) if issubclass(key, np.generic) else key
            if isinstance(key, np.dtype):  # NumPy and JAX dtypes (bfloat16 from ml_dtypes)
                key = key.name
            elif type(key).__module__ == "torch":  # torch.dtype: str() is "torch.float16"
                key = str(key).removeprefix("torch.")
            if isinstance(key, str):
                key = key.lower()
                for p in cls:
                    if key in (p.short, p.dtype_name, p.name.lower()):
                        return p
        raise ValueError(f"{param}={value!r}: allowed 'fp16', 'bf16', 'fp32', 'float16', 'bfloat16', "
                         "'float32' or a framework dtype of those (torch.float16, jnp.bfloat16, ...)")


_NEVER = -(2**62)  # "no change yet": any dwell is satisfied


class PrecisionLaw:
    """Per-layer variance EMA -> base level (thresholds, hysteresis, minimum dwell) + promotions.

    `pinned` (bool (L,)) marks layers held at FP32 (norm layers). The EMA starts at the first
    observed variance (no zero bias). Thresholds left as None are calibrated from the EMA of the
    non-pinned layers at the first decision after warm-up, and again every `recalibrate_every`
    steps when that is set (gradient variances drift over training; re-calibrating keeps the
    share of layers per level set by the quantiles while the ranking follows the variances).
    """

    def __init__(self, num_layers: int, pinned: np.ndarray, *, beta: float, tau_low: float | None,
                 tau_high: float | None, quantiles: tuple[float, float], hysteresis: float,
                 min_dwell: int, base: Precision, recalibrate_every: int | None = None) -> None:
        self.beta = beta
        self.quantiles = quantiles
        self.hysteresis = hysteresis
        self.min_dwell = min_dwell
        self.base = base
        self.pinned = np.asarray(pinned, dtype=bool)
        self.tau_low = tau_low
        self.tau_high = tau_high
        # Only thresholds the user left to calibration are re-calibrated.
        self.recalibrate_every = recalibrate_every if tau_low is None else None
        self.calibrated_at: int | None = None
        self.ema = np.full(num_layers, np.nan)
        self.level = np.full(num_layers, int(base), dtype=np.int64)
        self.last_change = np.full(num_layers, _NEVER, dtype=np.int64)
        self.promoted_until = np.full(num_layers, _NEVER, dtype=np.int64)
        self.adapting = False  # False until the first post-warm-up decision

    def observe(self, var: np.ndarray) -> None:
        """Fold one step's raw per-layer Var[grad] (shape (L,), finite, >= 0) into the EMA."""
        first = np.isnan(self.ema)
        self.ema = np.where(first, var, self.beta * self.ema + (1.0 - self.beta) * var)

    @property
    def calibrated(self) -> bool:
        return self.tau_low is not None and self.tau_high is not None

    def _calibrate(self) -> None:
        free = self.ema[~self.pinned]
        if free.size == 0:
            self.tau_low = self.tau_high = float("inf")
            return
        q_low, q_high = self.quantiles
        self.tau_low = float(np.quantile(free, q_low))
        self.tau_high = float(np.quantile(free, q_high))

    def target_levels(self) -> np.ndarray:
        """Variance level of each layer given its current level: thresholds widened by hysteresis.

        Moving up needs v >= tau*(1+h); moving down needs v < tau*(1-h); otherwise stay.
        """
        h = self.hysteresis
        v = self.ema
        up = (v >= self.tau_low * (1 + h)).astype(np.int64) + (v >= self.tau_high * (1 + h))
        down = (v >= self.tau_low * (1 - h)).astype(np.int64) + (v >= self.tau_high * (1 - h))
        cur = self.level
        return np.where(up > cur, up, np.where(down < cur, down, cur))

    def update_levels(self, step: int, warm: bool) -> None:
        """Re-take the base levels at a control boundary. `warm`: warm-up is over."""
        if not warm or np.isnan(self.ema[~self.pinned]).any():
            return  # warm-up, or some layer not yet observed: keep the base precision
        due = (self.recalibrate_every is not None and self.calibrated_at is not None
               and step - self.calibrated_at >= self.recalibrate_every)
        if not self.calibrated or due:
            self._calibrate()
            self.calibrated_at = step
        target = self.target_levels()
        may_change = (step - self.last_change) >= self.min_dwell
        if not self.adapting:  # leaving warm-up is not a "change" subject to dwell
            may_change[:] = True
            self.adapting = True
        new = np.where(may_change & ~self.pinned, target, self.level)
        changed = new != self.level
        self.last_change = np.where(changed, step, self.last_change)
        self.level = new

    def promote(self, step: int, mask: np.ndarray, window: int) -> None:
        """Promote `mask` layers one level until `step + window` (exclusive)."""
        self.promoted_until = np.where(mask, step + window, self.promoted_until)

    def effective(self, step: int) -> tuple[Precision, ...]:
        """Per-layer precision at `step`: base level + active promotion, norm layers FP32."""
        lvl = np.minimum(self.level + (step < self.promoted_until), int(Precision.FP32))
        lvl = np.where(self.pinned, int(Precision.FP32), lvl)
        return tuple(Precision(int(x)) for x in lvl)

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "tau_low": self.tau_low, "tau_high": self.tau_high, "adapting": self.adapting,
            "calibrated_at": self.calibrated_at,
            "ema": [None if np.isnan(x) else float(x) for x in self.ema],
            "level": self.level.tolist(), "last_change": self.last_change.tolist(),
            "promoted_until": self.promoted_until.tolist(),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.tau_low, self.tau_high, self.adapting = sd["tau_low"], sd["tau_high"], sd["adapting"]
        self.calibrated_at = sd["calibrated_at"]
        self.ema = np.array([np.nan if x is None else x for x in sd["ema"]], dtype=np.float64)
        self.level = np.array(sd["level"], dtype=np.int64)
        self.last_change = np.array(sd["last_change"], dtype=np.int64)
        self.promoted_until = np.array(sd["promoted_until"], dtype=np.int64)
