"""Batch lever: the VRAM feedback law, OOM shrink, and the LR rule / accumulation when B changes."""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from .config import TriAccelConfig

__all__ = ["BatchLaw", "OOMAtMinimumBatch", "resolve_memory_limit", "short_step_weight"]


class OOMAtMinimumBatch(RuntimeError):
    """Out of memory with the batch already at `batch_min`: nothing smaller is allowed."""


def resolve_memory_limit(budget: int | None, device_total: int | None) -> int | None:
    """MemMax in bytes: the smaller of the device's memory and the user's budget.

    Raises ValueError when the budget exceeds the device (a budget the device cannot honour is
    almost always a unit mistake). Returns None when neither is known.
    """
    if device_total is not None and device_total <= 0:
        raise ValueError(f"device_total={device_total!r}: must be a positive number of bytes")
    if budget is not None and device_total is not None and budget > device_total:
        raise ValueError(f"memory_budget={budget} bytes exceeds the device's {device_total} bytes: "
                         f"allowed (0, {device_total}]")
    if budget is None:
        return device_total
    return budget


def short_step_weight(rule: str, samples: int, logical_batch: int) -> float:
    """Gradient weight of a step of `samples` real samples whose logical batch is `logical_batch`
    (config `short_step_lr`): "batch" 1; "linear" samples / logical_batch; "sqrt" its square root.

    The step's mean gradient times the weight, at the logical batch's LR, is the update that rule
    gives `samples` samples; a weight on the gradient (not the LR) also holds the step's share of
    the momentum it leaves behind. 1 for a full step. ValueError outside 1 <= samples <= logical_batch.
    """
    for name, v in (("samples", samples), ("logical_batch", logical_batch)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name}={v!r}: must be an integer >= 1")
    if samples > logical_batch:
        raise ValueError(f"samples={samples}: allowed [1, logical_batch] = [1, {logical_batch}]")
    if rule == "batch" or samples == logical_batch:
        return 1.0
    if rule == "linear":
        return samples / logical_batch
    if rule == "sqrt":
        return math.sqrt(samples / logical_batch)
    raise ValueError(f"short_step_lr={rule!r}: allowed 'batch', 'linear', 'sqrt'")


class BatchLaw:
    """batch_law="memory": B + delta_up if mem < rho_low*MemMax; B - delta_down if mem >
    rho_high*MemMax; else B. batch_law="noise": B - delta_down if mem > rho_high*MemMax, else B +
    delta_up while the grown B is at most noise_scale_c * B_noise; else B.

    Growth is held when mem * B_new/B (memory assumed proportional to B, which over-estimates)
    would exceed rho_high*MemMax, so one step up does not overshoot into the shrink band.

    B stays within [batch_min, min(batch_max, ceiling)] and on the grid (multiples of batch_multiple,
    or `batch_buckets` when given, where a step moves one bucket). batch_growth="jump": a growth goes
    to the largest grid batch that every hold allows, not one step up. B does not grow before step
    `batch_hold_steps`. An OOM multiplies B by oom_shrink at once and lowers the ceiling below the
    size that failed, so growth does not retry it until `oom_cooldown` steps pass without another
    OOM (never, when it is None). Under lr_rule="accumulate", B is a micro-batch of the fixed
    logical batch `batch_init`.
    """

    def __init__(self, cfg: TriAccelConfig) -> None:
        self.cfg = cfg
        self.batch = cfg.batch_init
        upper = cfg.batch_max
        if cfg.lr_rule == "accumulate":
            upper = min(upper, cfg.batch_init)  # a micro-batch never exceeds the logical batch
        self.upper = upper
        self.ceiling = upper
        self.ooms = 0
        self.last_oom_step: int | None = None
        # LR ramp: multiplier at the last batch change and that change's step.
        self.ramp_from = self._target_scale()
        self.ramp_start = 0

    # -- grid -------------------------------------------------------------------------------
    def _grid(self) -> list[int]:
        c = self.cfg
        if c.batch_buckets is not None:
            return [b for b in c.batch_buckets if b <= self.ceiling]
        return list(range(c.batch_min, self.ceiling + 1, c.batch_multiple))

    def _clip(self, b: int) -> int:
        """Largest grid value <= b, but at least batch_min (the grid's first value)."""
        grid = self._grid()
        below = [g for g in grid if g <= b]
        return below[-1] if below else grid[0]

    # -- law --------------------------------------------------------------------------------
    def _set_batch(self, b: int, step: int) -> None:
        """Move to batch `b` at `step`; an LR ramp starts from the multiplier in force then."""
        if b != self.batch:
            self.ramp_from = self.lr_scale(step)
            self.ramp_start = step
            self.batch = b

    def can_grow(self) -> bool:
        """Whether the grid holds a batch larger than the current one (below the ceiling)."""
        return self._grid()[-1] > self.batch

    def update(self, used: int | None, mem_max: int | None, step: int, b_noise: float | None = None,
               mem_at: Mapping[int, int] | None = None) -> int:
        """One control decision at `step` from memory use `used` (bytes) against MemMax (bytes),
        either None when memory is not measured, and the gradient noise scale `b_noise` (samples,
        None while unknown) under batch_law="noise". mem_at: {batch: modelled peak bytes} for
        batches whose memory the backend knows (`Controller.observe_memory`); a grown batch not in
        it is assumed to need `used` x its ratio to the current batch."""
        c = self.cfg
        self._lift_cap(step)
        b = self.batch
        mem = used is not None and mem_max is not None
        pressure = mem and used > c.rho_high * mem_max
        if c.batch_law == "noise":
            want_up = not pressure and b_noise is not None
        else:
            want_up = mem and used < c.rho_low * mem_max
        if pressure:
            if c.batch_buckets is not None:
                grid = self._grid()
                b = grid[max(grid.index(self._clip(b)) - 1, 0)]
            else:
                b = max(b - c.delta_down, c.batch_min)
        elif want_up:
            # candidates in ascending order; every hold below only tightens as B grows, so the scan
            # stops at the first held one
            for up in self._larger(b)[:None if c.batch_growth == "jump" else 1]:
                held = step < c.batch_hold_steps
                # the grown batch would likely land above rho_high (memory as modelled, else proportional to B)
                grown = (mem_at or {}).get(up, used * up / self.batch if mem else None)
                held = held or (mem and grown > c.rho_high * mem_max)
                # a larger batch no longer buys progress per sample beyond c x the noise scale
                held = held or (c.batch_law == "noise" and up > c.noise_scale_c * b_noise)
                if held:
                    break
                b = up
        self._set_batch(self._clip(b), step)
        return self.batch

    def _larger(self, b: int) -> list[int]:
        """Grid batches above `b` a growth may reach, ascending: the larger buckets, or b + k*delta_up
        (k >= 1) up to the ceiling, each on the grid."""
        c = self.cfg
        grid = self._grid()
        if c.batch_buckets is not None:
            return grid[grid.index(self._clip(b)) + 1:]
        ups = {self._clip(min(b + k * c.delta_up, self.ceiling))
               for k in range(1, max(self.ceiling - b, 0) // c.delta_up + 2)}
        return sorted(u for u in ups if u > b)

    def _lift_cap(self, step: int) -> None:
        c = self.cfg
        if (c.oom_cooldown is not None and self.last_oom_step is not None
                and step - self.last_oom_step >= c.oom_cooldown):
            self.ceiling, self.last_oom_step = self.upper, None

    def candidates(self, step: int, b_noise: float | None = None) -> list[int]:
        """Grid batches another rule (the offload planner, `triaccel.swap_plan.choose_batch`) may
        pick at `step`: every one up to the current batch, and larger ones only where this law
        would let B grow (from batch_hold_steps on; under batch_law="noise" once `b_noise` is known
        and up to noise_scale_c * b_noise), all below the OOM ceiling."""
        c = self.cfg
        self._lift_cap(step)
        grow = step >= c.batch_hold_steps and (c.batch_law != "noise" or b_noise is not None)
        cap = c.noise_scale_c * b_noise if c.batch_law == "noise" and b_noise is not None else math.inf
        return [g for g in self._grid() if g <= self.batch or (grow and g <= cap)]

    def move_to(self, b: int, step: int) -> int:
        """Set B to `b` (a grid batch below the ceiling) at `step`, the LR rule following."""
        if b not in self._grid():
            raise ValueError(f"b={b!r} is invalid: allowed one of the grid batches {self._grid()}")
        self._set_batch(b, step)
        return self.batch

    def oom(self, step: int) -> int:
        """Shrink at once after an out-of-memory error at `step`; raises OOMAtMinimumBatch at the
        smallest allowed batch (batch_min, or the smallest of batch_buckets)."""
        c = self.cfg
        self.ooms += 1
        self.last_oom_step = step
        lowest = c.batch_buckets[0] if c.batch_buckets is not None else c.batch_min
        if self.batch <= lowest:
            raise OOMAtMinimumBatch(
                f"out of memory at the smallest allowed batch {lowest} (batch_min={c.batch_min}, "
                f"batch_buckets={c.batch_buckets}): lower batch_min (and the smallest bucket), the model "
                "size or the input size; no smaller batch is allowed")
        failed = self.batch
        self.ceiling = max(c.batch_min, self._clip(failed - 1))
        self._set_batch(self._clip(min(math.floor(failed * c.oom_shrink), self.ceiling)), step)
        return self.batch

    # -- consistency ------------------------------------------------------------------------
    def accumulation(self) -> int:
        """Micro-batches per optimizer step (1 unless lr_rule="accumulate")."""
        if self.cfg.lr_rule != "accumulate":
            return 1
        return math.ceil(self.cfg.batch_init / self.batch)

    def logical_batch(self) -> int:
        """Samples per optimizer step."""
        return self.cfg.batch_init if self.cfg.lr_rule == "accumulate" else self.batch

    def lr_scale(self, step: int) -> float:
        """LR multiplier at `step` for the current batch: the lr_rule's value, reached after
        `lr_ramp_steps` steps of a linear ramp when the batch grew; at once when it shrank."""
        target = self._target_scale()
        ramp = self.cfg.lr_ramp_steps
        if target <= self.ramp_from or ramp == 0 or step - self.ramp_start >= ramp:
            return target
        return self.ramp_from + (target - self.ramp_from) * max(step - self.ramp_start, 0) / ramp

    def _target_scale(self) -> float:
        """The lr_rule's multiplier for the current batch."""
        ratio = self.batch / self.cfg.batch_init
        rule = self.cfg.lr_rule
        if rule == "linear":
            return ratio
        if rule == "sqrt":
            return math.sqrt(ratio)
        return 1.0  # "none", and "accumulate" (the logical batch does not change)

    def state_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "ceiling": self.ceiling, "ooms": self.ooms, "last_oom_step": self.last_oom_step,
                "ramp_from": self.ramp_from, "ramp_start": self.ramp_start}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.batch, self.ceiling, self.ooms = int(sd["batch"]), int(sd["ceiling"]), int(sd["ooms"])
        self.last_oom_step = sd["last_oom_step"]
        self.ramp_from, self.ramp_start = float(sd["ramp_from"]), int(sd["ramp_start"])
