"""Gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training").

For a mean gradient g_b over b samples, E|g_b|^2 = |G|^2 + tr(Sigma)/b, where G is the true gradient
and Sigma the per-sample gradient covariance. Two batch sizes b_small < b_big give unbiased
estimates of both terms (the paper's Appendix A):

    |G|^2     ~ (b_big |g_big|^2 - b_small |g_small|^2) / (b_big - b_small)
    tr(Sigma) ~ (|g_small|^2 - |g_big|^2) / (1/b_small - 1/b_big)

and the "simple" noise scale B_noise = tr(Sigma) / |G|^2 is the ratio of their EMAs (each estimate
alone is too noisy to divide). The backends get the two sizes for free from a step split into
micro-batches: each micro-batch's mean gradient is a small-batch sample, their weighted sum the
step's gradient; or (noise_split="steps", `HalfStepPairs`) from consecutive steps, a half-batch step
and the full ones on both sides of it, whose statistics rows every step writes anyway. Everything here is per
layer (L,), so the controller can also compare a layer's 16-bit rounding error with its sampling
noise; the network's B_noise sums over layers.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from .batching import short_step_weight

__all__ = ["GradientNoise", "HalfStepPairs", "is_noise_schedule_step", "max_noise_steps_per_window",
           "observe_split_step", "observe_tensor_noise", "split_measurement", "warm_count"]


def warm_count(beta: float) -> int:
    """Measurements an EMA of factor `beta` needs before its horizon 1/(1-beta) is filled."""
    return math.ceil(1.0 / (1.0 - beta) - 1e-9)


def is_noise_schedule_step(step: int, start: int, t_noise: int, t_warm: int | None, beta: float) -> bool:
    """Whether the noise-measurement schedule holds `step`: the first warm_count(beta) measurements
    every `t_warm` steps from `start` (the EMA warm that much sooner), then every `t_noise` steps
    (step % t_noise == 0) from `start` on; t_warm None: t_noise throughout. Steps are optimizer
    steps; the schedule depends on the step number only, so both backends split the same steps."""
    if step < start:
        return False
    if t_warm is not None and step < start + warm_count(beta) * t_warm and (step - start) % t_warm == 0:
        return True
    return step % t_noise == 0


def max_noise_steps_per_window(t_window: int, t_noise: int, t_warm: int | None, beta: float) -> int:
    """An upper bound on the schedule's noise steps among `t_window` consecutive steps (the size of
    a ring that holds every measurement between two control boundaries t_window apart): the
    regular ones, plus the warm-up ones where t_warm is set."""
    regular = -(-t_window // t_noise) + 1
    if t_warm is None:
        return regular
    return regular + min(warm_count(beta), -(-t_window // t_warm) + 1)


def split_measurement(sizes: Sequence[int], micro_sqnorms: Any, total_sqnorm: Any,
                      num_layers: int) -> tuple[float, np.ndarray, float, np.ndarray]:
    """(b_small, |g_small|^2, b_big, |g_big|^2) from one step split into micro-batches.

    sizes: samples per micro-batch (k >= 2). micro_sqnorms: (k, L) squared norms per layer of each
    micro-batch's MEAN gradient (unscaled: no loss scale, no accumulation weight). total_sqnorm:
    (L,) the step's mean gradient over all sum(sizes) samples. With unequal micro-batches the mean
    of their squared norms estimates |G|^2 + tr(Sigma) * mean(1/b_i), so b_small is the harmonic
    mean of the sizes.
    """
    n = np.asarray(sizes, dtype=np.float64)
    if n.ndim != 1 or n.size < 2 or (n <= 0).any():
        raise ValueError(f"sizes={list(sizes)!r}: need at least two positive micro-batch sizes")
    micro = np.asarray(micro_sqnorms, dtype=np.float64)
    total = np.asarray(total_sqnorm, dtype=np.float64)
    if micro.shape != (n.size, num_layers):
        raise ValueError(f"micro_sqnorms: expected shape ({n.size}, {num_layers}) (micro-batch x layer), "
                         f"got {micro.shape}")
    if total.shape != (num_layers,):
        raise ValueError(f"total_sqnorm: expected shape ({num_layers},) (one value per layer), got {total.shape}")
    return float(1.0 / np.mean(1.0 / n)), micro.mean(axis=0), float(n.sum()), total


class GradientNoise:
    """Bias-corrected EMAs of per-layer |G|^2 and tr(Sigma) estimates; B_noise from their ratio.

    beta: EMA factor in [0, 1) per measurement. A measurement with a non-finite value is refused
    (ValueError): such a step is skipped, not measured.
    """

    def __init__(self, num_layers: int, beta: float) -> None:
        self.beta = beta
        self.count = 0
        self._g2 = np.zeros(num_layers)      # EMA numerators (bias-corrected on read)
        self._trace = np.zeros(num_layers)
        self.last_batch: float | None = None  # b_big of the last measurement (samples)

    def observe(self, b_small: float, sq_small: np.ndarray, b_big: float, sq_big: np.ndarray) -> None:
        """Fold one measurement: squared gradient norms per layer (L,) at two batch sizes (samples)."""
        if not 0 < b_small < b_big:
            raise ValueError(f"b_small={b_small}, b_big={b_big}: need 0 < b_small < b_big")
        small = np.asarray(sq_small, dtype=np.float64)
        big = np.asarray(sq_big, dtype=np.float64)
        if not (np.isfinite(small).all() and np.isfinite(big).all()) or (small < 0).any() or (big < 0).any():
            raise ValueError("sq_small, sq_big: squared norms must be finite and >= 0 (a step with non-finite "
                             "gradients is skipped, not measured)")
        g2 = (b_big * big - b_small * small) / (b_big - b_small)
        trace = (small - big) / (1.0 / b_small - 1.0 / b_big)
        self._g2 = self.beta * self._g2 + (1.0 - self.beta) * g2
        self._trace = self.beta * self._trace + (1.0 - self.beta) * trace
        self.count += 1
        self.last_batch = float(b_big)

    @property
    def warm(self) -> bool:
        """At least 1/(1-beta) measurements folded in: the EMA's horizon is filled."""
        return self.count >= warm_count(self.beta)

    def _debias(self) -> float:
        return 1.0 - self.beta ** self.count if self.count else 1.0

    @property
    def g2(self) -> np.ndarray:
        """(L,) EMA estimate of |G_l|^2 (may be <= 0 while the signal is buried in noise)."""
        return self._g2 / self._debias()

    @property
    def trace(self) -> np.ndarray:
        """(L,) EMA estimate of tr(Sigma_l), per-sample gradient variance summed over elements."""
        return self._trace / self._debias()

    def b_noise(self) -> float | None:
        """Network B_noise = sum tr(Sigma_l) / sum |G_l|^2 in samples; None before a measurement or
        while either sum is not positive (no usable estimate yet)."""
        if self.count == 0:
            return None
        g2, tr = float(self.g2.sum()), float(self.trace.sum())
        if g2 <= 0.0 or tr <= 0.0:
            return None
        return tr / g2

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "g2": self._g2.tolist(), "trace": self._trace.tolist(),
                "last_batch": self.last_batch}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.count = int(sd["count"])
        self._g2 = np.asarray(sd["g2"], dtype=np.float64)
        self._trace = np.asarray(sd["trace"], dtype=np.float64)
        self.last_batch = sd["last_batch"]


class HalfStepPairs:
    """noise_split="steps": a noise step runs half its logical batch as an optimizer step of its own;
    its statistics row against the rows of the full steps on both sides of it is one measurement at
    two batch sizes (the halves' estimator with its gradients from neighbouring steps).

    The rows hold per-layer squared norms of each step's unscaled gradient as applied, i.e. its mean
    gradient times the short-step weight w (`triaccel.batching.short_step_weight` by `rule`, the
    config's short_step_lr): w is divided out. The large-batch term is the mean over the n
    consecutive full steps (same samples, weight 1) right before the noise step and the n right
    after it, n at most `side_rows`: the squared norms drift along a run (down as the loss falls,
    up under an LR warm-up), and rows from after the step alone set the large-batch term at a later
    point than the small one; centred on the noise step, a linear drift cancels. On a CPU (ResNet-18
    width 1/4, bs 64 fixed, 2026-12-07, benchmarks/noise_split_compare.py, s53 `cpu/`) the median
    B_noise with up to 8 rows after was 328.6 / 1003.9 (torch seeds 0 / 1) and 316.4 / 341.1 (JAX
    seeds 0 / 1) against the halves' 99.5 / 539.0 and 85.6 / 240.0; with 4 + 4 rows around it 142.8 /
    391.8 and 160.1 / 292.7, its median log jump between boundaries 0.25-0.28 against 0.37-0.65. Steps
    do not share their samples as a step's halves do, so the difference stays noisier: on seed 2 (both
    backends) both pairings had an estimate (|G|^2 > 0) at 2-4 of 9-10 boundaries, the halves at 9.
    Under BatchNorm the two sizes are not one gradient distribution either (statistics over b against
    over B): on EfficientNet-B0 and on ResNet-18 without its classifier this pairing over-reads the
    noise (`benchmarks/noise_bn_bias.py`, CPU, 2026-12-07: no |G|^2, and B_noise 3.8x the halves').
    `ran` records what each step runs, before it runs (both backends' `controlled_step`: a row may
    come in while its step runs); `rows` takes the rows as they are fed
    (`triaccel.stats.feed_statistics`), in step order. A noise step with no full step of its
    logical batch right before it, or none right after it, measures nothing.
    """

    def __init__(self, rule: str, side_rows: int = 4) -> None:
        if isinstance(side_rows, bool) or not isinstance(side_rows, int) or side_rows < 1:
            raise ValueError(f"side_rows={side_rows!r}: allowed integers >= 1")
        self.rule, self.side_rows = rule, side_rows
        self._ran: dict[int, tuple[int, int, bool]] = {}   # step -> (samples, logical batch, noise step)
        # the last consecutive full steps (up to side_rows): (step, samples, per-layer |mean grad|^2)
        self._prev: list[tuple[int, int, np.ndarray]] = []
        # the measurement being gathered: the noise step's samples and |mean grad|^2, the full steps'
        # samples, their rows before and after it, the last step taken
        self._open: dict[str, Any] | None = None

    def ran(self, step: int, samples: int, logical_batch: int, noise: bool) -> None:
        """`step` runs `samples` real samples of a `logical_batch`; `noise`: as a noise step's half."""
        self._ran[int(step)] = (int(samples), int(logical_batch), bool(noise))

    def _close(self, out: list[tuple[float, np.ndarray, float, np.ndarray]]) -> None:
        o, self._open = self._open, None
        n = 0 if o is None else len(o["after"])
        if n and o["big"] > o["small"]:
            rows = o["before"][-n:] + o["after"]
            out.append((float(o["small"]), o["small_sq"], float(o["big"]), sum(rows) / len(rows)))

    def rows(self, steps: Sequence[int], sumsqs: Any, finite: Any) -> list[tuple[float, np.ndarray, float, np.ndarray]]:
        """The measurements (b_small, |g_small|^2, b_big, |g_big|^2) that rows complete. steps: (n,)
        in step order, each row once; sumsqs: (n, L) per-layer squared norms of the unscaled gradient
        as applied; finite: (n,) bool. A non-finite row, a step of another size, a missing step or the
        next noise step ends the full rows on either side; a measurement still gathering waits for
        the next call."""
        q = np.asarray(sumsqs, dtype=np.float64)
        out: list[tuple[float, np.ndarray, float, np.ndarray]] = []
        for t, row, ok in zip(steps, q, finite):
            t = int(t)
            info = self._ran.pop(t, None)
            if info is None or not ok:
                self._close(out)
                self._prev = []
                continue
            samples, logical, noise = info
            mean_sq = row / short_step_weight(self.rule, samples, logical) ** 2
            full = not noise and samples == logical
            o = self._open
            if o is not None and full and t == o["last"] + 1 and samples == o["big"]:
                o["after"].append(mean_sq)
                o["last"] = t
                if len(o["after"]) == len(o["before"]):
                    self._close(out)
            else:
                self._close(out)
            prev = self._prev
            if noise:
                before = [r for _, n, r in prev] if prev and prev[-1][0] == t - 1 and prev[-1][1] == logical else []
                if before:
                    self._open = {"small": samples, "small_sq": mean_sq, "big": logical, "before": before,
                                  "after": [], "last": t}
                self._prev = []
            elif full:
                run = prev if prev and prev[-1][0] == t - 1 and prev[-1][1] == samples else []
                self._prev = (run + [(t, samples, mean_sq)])[-self.side_rows:]
            else:
                self._prev = []
        last = int(steps[-1]) if len(steps) else None
        for t in [t for t in self._ran if last is not None and t <= last]:
            del self._ran[t]   # rows that never came (a step's row is fed once)
        return out

    def state_dict(self) -> dict[str, Any]:
        o = self._open
        return {"ran": [[t, *v] for t, v in self._ran.items()],
                "prev": [[t, n, r.tolist()] for t, n, r in self._prev],
                "open": None if o is None else {
                    **{k: o[k] for k in ("small", "big", "last")}, "small_sq": o["small_sq"].tolist(),
                    "before": [r.tolist() for r in o["before"]], "after": [r.tolist() for r in o["after"]]}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._ran = {int(t): (int(n), int(b), bool(z)) for t, n, b, z in sd["ran"]}
        self._prev = [(int(t), int(n), np.asarray(r, dtype=np.float64)) for t, n, r in sd.get("prev", [])]
        o = sd["open"]
        if o is not None and "before" not in o:
            o = None   # a measurement gathered by the older after-only pairing: dropped, the next one counts
        self._open = None if o is None else {
            **o, "small_sq": np.asarray(o["small_sq"], dtype=np.float64),
            "before": [np.asarray(r, dtype=np.float64) for r in o["before"]],
            "after": [np.asarray(r, dtype=np.float64) for r in o["after"]]}


def observe_split_step(controller: Any, step: int, sizes: Sequence[int], weights: Sequence[float],
                       sqnorms: Any, tensor_layer: Any, scale: float = 1.0) -> bool:
    """Feed `controller.observe_gradient_noise` from what an elastic step split into micro-batches
    measured, per tensor: the part both backends share.

    sqnorms: (k + 1, T) squared norms per gradient tensor; rows 0..k-1 each micro-batch's
    contribution as accumulated (its mean gradient x its weight len/total x the loss scale), row k
    the accumulated step gradient (x the loss scale). weights: (k,) the micro-batches' weights.
    tensor_layer: (T,) layer index per tensor. scale: the loss scale the gradients carry. Returns
    False (nothing observed) for a step with fewer than two micro-batches or non-finite values.
    """
    sq = np.asarray(sqnorms, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if len(sizes) < 2 or sq.shape[0] != len(sizes) + 1 or w.shape != (len(sizes),):
        return False
    sq = sq / (float(scale) ** 2)
    unweighted = np.concatenate([sq[:-1] / (w[:, None] ** 2), sq[-1:]], axis=0)
    return observe_tensor_noise(controller, step, sizes, unweighted, tensor_layer)


def observe_tensor_noise(controller: Any, step: int, sizes: Sequence[int], sqnorms: Any, tensor_layer: Any) -> bool:
    """`controller.observe_gradient_noise` from squared norms per gradient tensor, summed per layer.

    sqnorms: (k + 1, T) rows 0..k-1 each micro-batch's MEAN gradient, row k the step's mean
    gradient, all unscaled. tensor_layer: (T,) layer index per tensor. Returns False (nothing
    observed) for non-finite values."""
    from .stats import group_by_layer

    per_layer = group_by_layer(np.asarray(sqnorms, dtype=np.float64), tensor_layer, len(controller.layers))
    if not np.isfinite(per_layer).all():
        return False
    controller.observe_gradient_noise(step, sizes, per_layer[:-1], per_layer[-1])
    return True
