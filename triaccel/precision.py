"""Precision lever: per-layer FP16/BF16/FP32 from an EMA of gradient variance.

Levels are ordered (FP16 < BF16 < FP32) so that a promotion is "+1 level".
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

__all__ = ["EvidenceLaw", "Precision", "PrecisionLaw", "UNIT_ROUNDOFF"]


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


# Unit roundoff (half the spacing of 1.0 to the next value) of each 16-bit format: the relative
# error of rounding one value to it.
UNIT_ROUNDOFF: dict[Precision, float] = {Precision.FP16: 2.0**-11, Precision.BF16: 2.0**-8}


class EvidenceLaw(PrecisionLaw):
    """16-bit by default; a layer goes to FP32 only on evidence that 16-bit hurts it.

    Evidence, per layer: non-finite gradient values seen without loss scaling (`observe_nonfinite`;
    it lasts `min_dwell` steps past the event), a loss-scale collapse while the layer is FP16
    (`observe_loss_scale`, same duration), or a 16-bit rounding error that is not small against
    the gradient's sampling noise (`observe_noise`: the rounding-error energy u^2 (|G|^2 +
    tr(Sigma)/B) above `rounding_ratio` x the sampling-noise energy tr(Sigma)/B; it enters above
    rounding_ratio*(1+hysteresis) and leaves below rounding_ratio*(1-hysteresis)). A layer whose
    gradient variance is high is noisy, not fragile: variance alone never promotes it. FP32 is
    taken at once; the way back waits `min_dwell` steps since the last change. The variance EMA is
    still kept (telemetry). Norm layers stay FP32 (`pinned`).
    """

    def __init__(self, num_layers: int, pinned: np.ndarray, *, base: Precision, min_dwell: int,
                 hysteresis: float, rounding_ratio: float, beta: float) -> None:
        super().__init__(num_layers, pinned, beta=beta, tau_low=None, tau_high=None, quantiles=(0.0, 1.0),
                         hysteresis=hysteresis, min_dwell=min_dwell, base=base)
        self.rounding_ratio = rounding_ratio
        self.evidence_until = np.full(num_layers, _NEVER, dtype=np.int64)
        self.rounding = np.zeros(num_layers, dtype=bool)   # rounding evidence in force
        self.rounding_level = np.full(num_layers, np.nan)  # last u^2 (|G|^2 + S/B) / (S/B)

    def observe_nonfinite(self, step: int, counts: np.ndarray, loss_scaled: bool) -> None:
        """Per-layer counts (L,) of non-finite gradient values at `step`. Under loss scaling, FP16
        layers' overflows are the scaler's business (it backs off), not evidence."""
        hit = np.asarray(counts) > 0
        if loss_scaled:
            hit &= self.level != int(Precision.FP16)
        self._evidence(step, hit)

    def observe_loss_scale(self, step: int, scale: float) -> None:
        """Loss scale in force at `step`; below 1 the FP16 range has failed the FP16 layers."""
        if scale < 1.0:
            self._evidence(step, self.level == int(Precision.FP16))

    def _evidence(self, step: int, mask: np.ndarray) -> None:
        self.evidence_until = np.where(mask & ~self.pinned,
                                       np.maximum(self.evidence_until, step + self.min_dwell),
                                       self.evidence_until)

    def observe_noise(self, g2: np.ndarray, trace: np.ndarray, batch: float) -> None:
        """Per-layer |G|^2 and tr(Sigma) estimates (L,) at batch `batch` (samples)."""
        u = UNIT_ROUNDOFF.get(self.base)
        if u is None:  # an FP32 base has no 16-bit rounding to weigh
            return
        sampling = np.asarray(trace, dtype=np.float64) / batch
        signal = np.maximum(np.asarray(g2, dtype=np.float64), 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            level = np.where(sampling > 0, u * u * (signal + sampling) / sampling, np.nan)
        h = self.hysteresis
        known = np.isfinite(level)  # no positive noise estimate: no evidence either way
        enter = known & (level > self.rounding_ratio * (1 + h))
        leave = known & (level < self.rounding_ratio * (1 - h))
        self.rounding = np.where(enter, True, np.where(leave, False, self.rounding))
        self.rounding_level = level

    def update_levels(self, step: int, warm: bool) -> None:
        """Base level unless evidence holds; up at once, down after `min_dwell` steps."""
        if not warm:
            return
        self.adapting = True
        target = np.where((step < self.evidence_until) | self.rounding, int(Precision.FP32), int(self.base))
        may_change = (target > self.level) | ((step - self.last_change) >= self.min_dwell)
        new = np.where(may_change & ~self.pinned, target, self.level)
        self.last_change = np.where(new != self.level, step, self.last_change)
        self.level = new

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "evidence_until": self.evidence_until.tolist(),
                "rounding": self.rounding.tolist(),
                "rounding_level": [None if np.isnan(x) else float(x) for x in self.rounding_level]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        super().load_state_dict(sd)
        self.evidence_until = np.array(sd["evidence_until"], dtype=np.int64)
        self.rounding = np.array(sd["rounding"], dtype=bool)
        self.rounding_level = np.array([np.nan if x is None else x for x in sd["rounding_level"]])
