"""`TriAccelConfig`: every knob of the control loop, validated at construction.

Units: steps are optimizer steps; memory is bytes; batch sizes are samples.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["TriAccelConfig", "parse_bytes"]

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

CURVATURE_MODES = ("fisher", "hessian", "off")
PRECISION_LAWS = ("evidence", "variance")
BATCH_LAWS = ("noise", "memory")
BATCH_GROWTHS = ("rung", "jump")
LR_RULES = ("linear", "sqrt", "none", "accumulate")
SHORT_STEP_LRS = ("batch", "linear", "sqrt")
NOISE_SPLITS = ("halves", "double", "steps")
PRECISIONS = ("fp16", "bf16", "fp32")
OFFLOAD_MODES = ("auto", "off")
KERNEL_IMPLS = ("auto", "triton", "reference", "xla")


def _finite(v: Any) -> bool:
    """math.isfinite for a number, False (not OverflowError) for an int beyond float range."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def parse_bytes(value: int | float | str, name: str = "memory_budget") -> int:
    """Parse a byte count: an int, or a string like "4GiB", "512 MiB", "3.5GB", "1e9".

    Raises ValueError naming `name` when the value is not a positive size.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: expected a positive number of bytes or a string like '4GiB'")
    if isinstance(value, (int, float)):
        n = value
    elif isinstance(value, str):
        m = _BYTES_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"{name}={value!r}: cannot parse; use bytes or a number with one of the units "
                "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. '4GiB')"
            )
        n = float(m.group(1)) * _UNITS[unit]
    else:
        raise ValueError(f"{name}={value!r}: expected int bytes or a string like '4GiB'")
    if not _finite(n) or n <= 0 or n != int(n):
        raise ValueError(f"{name}={value!r}: must be a positive whole number of bytes (finite)")
    return int(n)


def _check(cond: bool, name: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ValueError(f"{name}={value!r} is invalid: allowed {allowed}")


@dataclass(frozen=True)
class TriAccelConfig:
    """All knobs of the Tri-Accel loop. Frozen; use `replace(**changes)`.

    Precision lever:
      precision_law: "evidence" (default): every non-norm layer computes in `base_precision` and
        goes to FP32 only on evidence that 16-bit hurts it: non-finite gradient values in that
        layer (not loss-scaled), a loss-scale collapse (scale < 1) for FP16 layers, or a measured
        16-bit rounding error that is not small against its gradient sampling noise
        (u^2 (|G_l|^2 + tr(Sigma_l)/B) > rounding_noise_ratio * tr(Sigma_l)/B, u the unit roundoff,
        from the batch lever's noise measurements). It returns to 16-bit `min_dwell` steps after
        the evidence is gone. "variance": the paper's law, from the EMA `v` of Var[grad] below.
      rounding_noise_ratio: the evidence law's bound on rounding-error energy relative to
        sampling-noise energy, in (0, 1) (0.01: rounding noise under 10% of the noise's std).
    Variance law (precision_law="variance"; per layer, from the EMA `v` of Var[grad]):
      beta: EMA factor in [0, 1): v <- beta*v + (1-beta)*Var.
      tau_low, tau_high: thresholds on v (FP16 below tau_low, FP32 at/above tau_high, BF16 between).
        None -> calibrated at the end of warm-up as `calibration_quantiles` of the layers' v.
      calibration_quantiles: (q_low, q_high), 0 <= q_low <= q_high <= 1.
      recalibrate_every: steps between re-calibrations of thresholds left as None (default 1000;
        None: calibrate once, at the end of warm-up, as the paper does).
      hysteresis: relative band >= 0 around each threshold a layer must cross to change level.
      min_dwell: steps a layer keeps its variance-chosen level before it may change again (>= 0).
      base_precision: precision of every non-norm layer during warm-up and when
        `adaptive_precision` is off ("fp16" | "bf16" | "fp32"; a dtype name or a framework dtype,
        e.g. torch.bfloat16, is accepted and stored as its short name).
    Curvature lever (every t_curv steps, on b_curv samples, top_k eigenvalues per layer):
      curvature: "off" (default) | "fisher" (empirical Fisher from per-sample grads) | "hessian"
        (HVP). Off by default: in 3-seed CIFAR ablations the curvature LR scaling lowered accuracy
        (ResNet-18 85.08 vs 85.80 without it; EfficientNet-B0 66.48 vs 66.70, docs/results.md).
      alpha: LR scale is 1/(1 + alpha*max(lambda_max, 0)); None -> calibrated at the first curvature
        observation so that the layer with the largest lambda_max gets scale 1/2.
      tau_curv: lambda_max above it promotes the layer one precision level for `promotion_window`
        steps; None -> the 90th percentile of lambda_max over layers at the first observation.
      promotion_window: steps a promotion lasts; None -> t_curv.
    Batch lever (every t_ctrl steps):
      batch_law: "noise" (default): B grows (one bucket, or delta_up) only while the grown batch is
        at most noise_scale_c * B_noise, the gradient noise scale tr(Sigma)/|G|^2 (McCandlish et
        al. 2018) measured every t_noise steps from a step split into two micro-batches; memory is
        a ceiling (growth only if memory scaled by B_new/B stays <= rho_high*MemMax; shrink above
        rho_high*MemMax or on OOM). "memory": the paper's law, B grows whenever memory use is
        below rho_low*MemMax.
      batch_growth: how far one decision grows B: "rung" (default: one bucket, or delta_up) or "jump"
        (to the largest bucket, or B + k*delta_up, that every growth condition above allows at that
        decision: the noise bound, memory, batch_hold_steps). Under CUDA graphs or compiled shapes
        each size visited costs a capture or a compilation (EfficientNet-B0's graphed demo: host
        gaps of 0.37-0.49 s at each new size's first step, H200, 2026-11-28, docs/results.md): a
        jump skips the sizes in between. Not the default: with a short step weighted by its samples
        (short_step_lr="linear") it holds accuracy where it once lost a run (EfficientNet-B0 seed 2,
        61.83% -> 73.64%), but it was not faster (H200, 2026-11-28, graphed, seeds 0-2: 1.14-1.21x
        AMP bs 512's wall against the rung's 1.18-1.22x in the same call, 74.19% against 75.02% mean;
        ResNet-18 took the rung's steps; docs/results.md).
      noise_scale_c: growth bound factor c > 0 (samples per unit of B_noise). 2.0 by measurement (H200,
        CIFAR-10, torch, both sides `--compile graphs`, seeds 0-2, 2026-11-28, docs/results.md; c = 2 and
        c = 1 in one call on seed 2, in calls a few minutes apart on seeds 0-1): against
        c = 1 (McCandlish et al.'s critical batch B_crit ~ B_noise) ResNet-18 reached 87.45% mean
        against 87.27% in 11.3 s of training against 11.9 s, EfficientNet-B0 74.54% against 73.83% in
        22.8 s against 23.4 s; c = 4 took the same steps as c = 2 on EfficientNet-B0 seed 0 (the bound no
        longer binds there: growth then waits on the noise EMA's warm-up and moves one bucket per
        decision).
        Earlier, eager (H100, 2026-11-23): c = 0.5 spent two more epochs at bs 96 than c = 1.
      noise_beta: EMA factor in [0, 1) over noise measurements.
      t_noise: steps between noise measurements (None: t_ctrl), from warmup_steps on; they stop
        once B cannot grow, unless the evidence precision law (16-bit base) still uses them.
      t_noise_warm: steps between the first 1/(1-noise_beta) noise measurements (None, the default:
        t_noise), so that the EMA the batch law waits for is warm sooner; t_noise spacing after them
        (`triaccel.noise.is_noise_schedule_step`). Not the default: at 10 (H200, graphed, seeds 0-2,
        2026-11-28, docs/results.md) EfficientNet-B0 trained 0.3-1.1 s (1-5%) shorter at 75.30% mean
        against 75.02%, but ResNet-18 reached 87.02% against the default's 87.44-87.48%.
      noise_split: how a noise step gets its two gradients: "halves" (default: the step's B samples as
        two micro-batches of B/2) or "double" (the step takes 2B samples, as two micro-batches of B: no
        micro-batch shape beside the batch buckets, so no extra CUDA-graph capture or compilation for
        half batches; the step's update is then the mean gradient of its 2B samples at the LR of B, one
        step for two batches' samples) or "steps" (the noise step runs half the decided batch as an optimizer
        step of its own, weighted by short_step_lr, and the steps around it the whole batch: its statistics row
        and the mean of the n full rows right before it and the n right after it (n <= 4), which every step
        writes anyway, are the measurement at the two sizes (`triaccel.noise.HalfStepPairs`; centred on the
        noise step, so a drift of the norms along the run cancels): no micro-batch, program or gradient accumulator of its
        own; under a JAX pad floor the half step runs at the floor's program, so the step compiles as it does
        without the batch lever, where the in-program halves made most of the wrapper's extra compilation,
        H200, 2026-12-04, docs/results.md). Its two gradients share no samples, so its estimate is noisier: on
        a CPU (ResNet-18 width 1/4, bs 64 fixed, 2026-12-07, `benchmarks/noise_split_compare.py`) the median
        log B_noise jump between boundaries 0.25-0.28 (torch and JAX seeds 0-1) against the halves'
        0.16-0.97, levels 0.7-1.9x the halves', and on seed 2 missing (|G|^2 <= 0) at most boundaries in
        both backends (with rows after the step only: levels 1.4-3.7x the halves', jumps 0.37-0.65). Its two
        sizes' BatchNorm statistics span different batches (b and B), which the estimator does not model: on
        EfficientNet-B0 (width 1/2, 150 steps, CPU, `benchmarks/noise_bn_bias.py`) that pairing gave |G|^2 < 0
        where the halves' gave 35 (B_noise 295), on ResNet-18 without its classifier B_noise 3.8x the
        halves', and on the GPU its estimate ran above the halves' at 22 of 24 boundaries, median 2.85x
        (H100, 2026-12-07, docs/results.md). The JAX demo's default from 2026-12-04 to 2026-12-07.
        Both backends (JAX: with noise_step_fn too, its two programs at the decided size). The torch
        demo's default for triaccel, with a ladder without the rung
        between half the top and the top (96/192/512: three micro-batch sizes instead of six; each
        costs a first eager step and, graphed, a capture): EfficientNet-B0 1.06-1.14x AMP bs 512's wall
        against 1.13-1.23x, ResNet-18 0.98x AMP bs 192's over six seeds against 1.02x (H200, graphed,
        2026-12-02, docs/results.md); alone (the 384 rung kept) neutral on both (2026-12-01).
      rho_low, rho_high: fractions of MemMax (0 < rho_low < rho_high <= 1) below/above which B grows
        by delta_up / shrinks by delta_down (samples, multiples of batch_multiple). B grows only if
        memory scaled by the new B/B (an over-estimate: weights do not grow) stays <= rho_high*MemMax.
      batch_init, batch_min, batch_max: samples, multiples of batch_multiple, min <= init <= max.
      batch_buckets: optional sorted allowed batch sizes (bounds compiled shapes under JAX); the
        controller then moves between buckets instead of by delta_up/delta_down.
      memory_budget: bytes (int) or a string like "4GiB"; MemMax = min(device limit, budget).
      oom_shrink: factor in (0, 1) applied to B at once on out-of-memory.
      batch_hold_steps: optimizer steps during which B does not grow (it still shrinks under memory
        pressure or an OOM), so the first steps run at batch_init and its LR (a warm-up before
        growth; on the CIFAR ResNet-18 recipe it lowered accuracy, docs/results.md). 0: growth
        from the first decision.
      oom_cooldown: after an OOM, growth is capped below the size that failed; this many steps
        without another OOM lift the cap (None: the cap is permanent). Default 1000: a transient OOM
        (fragmentation, another process) does not hold a long run at a smaller batch for good, and a
        size that really does not fit costs one replayed micro-batch per 1000 steps.
      lr_rule: how optimisation stays consistent when B changes: "linear" (lr * B/batch_init),
        "sqrt" (lr * sqrt(B/batch_init)), "none", or "accumulate" (the logical batch stays
        batch_init; B is the micro-batch and gradients accumulate over ceil(batch_init/B) of them).
      lr_ramp_steps: optimizer steps over which the batch rule's LR multiplier moves linearly to
        its new value after B grows (0: at once). Applied at control boundaries, so the ramp moves
        in t_ctrl-step stairs. A shrinking B lowers the multiplier at once (a smaller batch at the
        larger LR is the unstable direction).
      short_step_lr: the update of a step with fewer real samples s than its logical batch B (an
        epoch's last step): "linear" (default: the gradient x s/B, the update the linear rule gives
        s samples, momentum included), "sqrt" (x sqrt(s/B)) or "batch" (as a plain loop: the s
        samples' mean gradient at B's LR). Independent of lr_rule (a static batch has lr_rule
        "none" and still a short last step). Applied by both backends' `elastic_step`
        (`triaccel.batching.short_step_weight`); a noise measurement on such a step sees the
        weighted gradient. Why (H200, 2026-11-28, docs/results.md): under "batch" an EfficientNet-B0
        run (seed 2, batch_growth="jump") took a 16-sample last step at the 512-sample LR and ended
        at 61.83%; under "linear" the same step left the loss at 1.97 and the run reached 73.64%.
        Triaccel's default on EfficientNet-B0 / ResNet-18, seeds 0-2: 75.02% / 87.47% mean under
        "linear", 74.54% / 87.45% under "batch" (EfficientNet-B0's from other calls of that day).
    Loop:
      t_ctrl: steps between control decisions (precision, batch); warmup_steps: steps before the
        first precision decision (thresholds are calibrated then) and the first curvature step.
      t_precision: steps between precision decisions, a multiple of t_ctrl (None: every t_ctrl).
        Each new per-layer dtype assignment costs a compilation under jit / torch.compile, so
        deciding rarely bounds them; curvature promotions still act at curvature steps.
      adaptive_precision, elastic_batch: switches for ablations (curvature="off" for the third).
      precision_groups: None (default: per layer) or G >= 1: the non-norm layers, in layer order,
        form G contiguous groups of near-equal size and each group computes at the highest
        precision the law decides for any of its layers. This bounds the distinct precision
        policies (each one a compilation under jit / torch.compile) by design: at most 3^G, 2^G
        under the evidence law (levels base or FP32); in any case at most 1 + the precision
        decisions taken (one per t_precision steps, plus curvature steps with promotions).
    Memory optimizer:
      offload: "off" (default) | "auto": under the budget, compare the modelled throughput of a larger
        batch whose saved activations partly go to host memory or are recomputed (triaccel.swap_plan)
        with the largest batch that fits without, and take the better; the LR follows lr_rule.
    Kernels:
      kernels: the gradient-moments implementation the backends call each step: "auto" (torch: the
        Triton kernel where it can run, CUDA or the interpreter, else torch's reductions; JAX: "xla"),
        "triton" (insist; under JAX the same kernel through jax-triton on a GPU), "reference" (the
        framework's own reductions: torch one tensor at a time; JAX segment sums over the concatenated
        gradients, measured 4.4x slower per bs-384 epoch on an H100: for debugging), or, JAX only,
        "xla": XLA's own
        reductions inside the jitted update, one per large gradient array and one per power-of-two
        length for arrays of at most 2^16 elements (no concatenation of the whole set, no written-back
        unscaled copy, no jax-triton; `triaccel.kernels.moments_reference_jnp_tree`). JAX's default
        by measurement (H200, ResNet-18 CIFAR-10 seed 2, cold runs, docs/results.md 2026-11-28):
        3.8-5.2 s less wall than the jax-triton kernel, whose first lowering imports torch and
        compiles the kernel; bs-512 epochs alike (0.80-0.82 s); alone the kernel is faster
        (43.5 vs 269.5 us on ResNet-18's gradients), inside the bs-96 step no difference resolved.
    """

    precision_law: str = "evidence"
    rounding_noise_ratio: float = 0.01
    beta: float = 0.9
    tau_low: float | None = None
    tau_high: float | None = None
    calibration_quantiles: tuple[float, float] = (0.25, 0.9)
    recalibrate_every: int | None = 1000
    hysteresis: float = 0.1
    min_dwell: int = 200
    base_precision: str = "bf16"
    curvature: str = "off"
    top_k: int = 5
    t_curv: int = 200
    b_curv: int = 32
    alpha: float | None = None
    tau_curv: float | None = None
    promotion_window: int | None = None
    batch_law: str = "noise"
    batch_growth: str = "rung"
    noise_scale_c: float = 2.0
    noise_beta: float = 0.8
    t_noise: int | None = None
    t_noise_warm: int | None = None
    noise_split: str = "halves"
    rho_low: float = 0.6
    rho_high: float = 0.85
    delta_up: int = 32
    delta_down: int = 32
    batch_init: int = 96
    batch_min: int = 8
    batch_max: int = 1024
    batch_multiple: int = 8
    batch_buckets: tuple[int, ...] | None = None
    memory_budget: int | str | None = None
    oom_shrink: float = 0.5
    oom_cooldown: int | None = 1000
    batch_hold_steps: int = 0
    lr_rule: str = "linear"
    lr_ramp_steps: int = 0
    short_step_lr: str = "linear"
    t_ctrl: int = 50
    t_precision: int | None = None
    warmup_steps: int = 100
    adaptive_precision: bool = True
    elastic_batch: bool = True
    precision_groups: int | None = None
    offload: str = "off"
    kernels: str = "auto"

    def __post_init__(self) -> None:
        # Normalise containers first so that the frozen instance is hashable/JSON-safe.
        for name, optional in (("calibration_quantiles", False), ("batch_buckets", True)):
            v = getattr(self, name)
            if v is None and optional:
                continue
            _check(isinstance(v, (tuple, list)), name, v, "a tuple or list of numbers"
                   + (" (or None)" if optional else ""))
            object.__setattr__(self, name, tuple(v))
        if self.memory_budget is not None:
            object.__setattr__(self, "memory_budget", parse_bytes(self.memory_budget, "memory_budget"))
        if not isinstance(self.base_precision, str) or self.base_precision not in PRECISIONS:
            # a framework dtype or a dtype name ("bfloat16", torch.bfloat16): kept as its short name
            from .precision import Precision

            object.__setattr__(self, "base_precision",
                               Precision.parse(self.base_precision, "base_precision").short)
        self._validate()

    # -- validation -------------------------------------------------------------------------
    def _validate(self) -> None:
        def real(name: str, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> None:
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and _finite(v)
            ok = ok and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
            rng = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
            _check(ok, name, v, f"a real number in {rng}")

        def integer(name: str, lo: int) -> None:
            v = getattr(self, name)
            _check(isinstance(v, int) and not isinstance(v, bool) and v >= lo, name, v, f"an integer >= {lo}")

        def choice(name: str, options: tuple[str, ...]) -> None:
            v = getattr(self, name)
            _check(v in options, name, v, "one of " + ", ".join(repr(o) for o in options))

        choice("precision_law", PRECISION_LAWS)
        real("rounding_noise_ratio", 0.0, 1.0, lo_open=True, hi_open=True)
        real("beta", 0.0, 1.0, hi_open=True)
        for name in ("tau_low", "tau_high", "alpha", "tau_curv"):
            if getattr(self, name) is not None:
                real(name, 0.0, math.inf, hi_open=True)
        if self.tau_low is not None and self.tau_high is not None:
            _check(self.tau_low <= self.tau_high, "tau_low", self.tau_low,
                   f"a value <= tau_high ({self.tau_high})")
        if (self.tau_low is None) != (self.tau_high is None):
            raise ValueError(
                f"tau_low={self.tau_low!r}, tau_high={self.tau_high!r}: give both thresholds or neither "
                "(None calibrates both at the end of warm-up)"
            )
        q = self.calibration_quantiles
        _check(len(q) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in q)
               and 0 <= q[0] <= q[1] <= 1,
               "calibration_quantiles", q, "(q_low, q_high) with 0 <= q_low <= q_high <= 1")
        if self.recalibrate_every is not None:
            integer("recalibrate_every", 1)
        real("hysteresis", 0.0, 1.0, hi_open=True)
        integer("min_dwell", 0)
        choice("base_precision", PRECISIONS)
        choice("curvature", CURVATURE_MODES)
        integer("top_k", 1)
        integer("t_curv", 1)
        integer("b_curv", 1)
        if self.promotion_window is not None:
            integer("promotion_window", 1)
        choice("batch_law", BATCH_LAWS)
        choice("batch_growth", BATCH_GROWTHS)
        real("noise_scale_c", 0.0, math.inf, lo_open=True, hi_open=True)
        real("noise_beta", 0.0, 1.0, hi_open=True)
        if self.t_noise is not None:
            integer("t_noise", 1)
        choice("noise_split", NOISE_SPLITS)
        if self.t_noise_warm is not None:
            integer("t_noise_warm", 1)
        real("rho_low", 0.0, 1.0, lo_open=True, hi_open=True)
        real("rho_high", 0.0, 1.0, lo_open=True)
        _check(self.rho_low < self.rho_high, "rho_low", self.rho_low, f"a value < rho_high ({self.rho_high})")
        integer("batch_multiple", 1)
        m = self.batch_multiple
        for name in ("batch_min", "batch_init", "batch_max", "delta_up", "delta_down"):
            integer(name, 1)
            v = getattr(self, name)
            _check(v % m == 0, name, v, f"a positive multiple of batch_multiple ({m})")
        _check(self.batch_min <= self.batch_max, "batch_min", self.batch_min,
               f"a value <= batch_max ({self.batch_max})")
        _check(self.batch_min <= self.batch_init <= self.batch_max, "batch_init", self.batch_init,
               f"[batch_min, batch_max] = [{self.batch_min}, {self.batch_max}]")
        if self.batch_buckets is not None:
            b = self.batch_buckets
            ok = len(b) > 0 and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in b)
            ok = ok and list(b) == sorted(set(b)) and b[0] >= self.batch_min and b[-1] <= self.batch_max
            _check(ok, "batch_buckets", b,
                   f"a strictly increasing tuple of ints within [batch_min, batch_max] = "
                   f"[{self.batch_min}, {self.batch_max}]")
            _check(self.batch_init in b, "batch_init", self.batch_init, f"one of batch_buckets {b}")
        real("oom_shrink", 0.0, 1.0, lo_open=True, hi_open=True)
        if self.oom_cooldown is not None:
            integer("oom_cooldown", 1)
        integer("batch_hold_steps", 0)
        choice("lr_rule", LR_RULES)
        integer("lr_ramp_steps", 0)
        choice("short_step_lr", SHORT_STEP_LRS)
        integer("t_ctrl", 1)
        integer("warmup_steps", 0)
        if self.t_precision is not None:
            integer("t_precision", 1)
            _check(self.t_precision % self.t_ctrl == 0, "t_precision", self.t_precision,
                   f"a multiple of t_ctrl ({self.t_ctrl})")
        choice("offload", OFFLOAD_MODES)
        choice("kernels", KERNEL_IMPLS)
        if self.precision_groups is not None:
            integer("precision_groups", 1)
        for name in ("adaptive_precision", "elastic_batch"):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "True or False")

    # -- conveniences -----------------------------------------------------------------------
    @property
    def curvature_enabled(self) -> bool:
        return self.curvature != "off"

    def replace(self, **changes: Any) -> "TriAccelConfig":
        """A copy with `changes` applied (validated)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (tuples become lists)."""
        d = dataclasses.asdict(self)
        d["calibration_quantiles"] = list(self.calibration_quantiles)
        if self.batch_buckets is not None:
            d["batch_buckets"] = list(self.batch_buckets)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TriAccelConfig":
        """Inverse of `to_dict`; unknown keys raise ValueError naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown TriAccelConfig field(s) {unknown}; known: {sorted(names)}")
        return cls(**dict(d))
