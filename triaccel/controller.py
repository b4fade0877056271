"""`Controller`: the one control loop over precision, curvature-scaled LR and batch size.

Backends observe numbers (variances, eigenvalues, memory, OOMs) and apply the `Decision`; the
controller never touches a framework. Same inputs -> same decisions, whichever backend fed them.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from .batching import BatchLaw, resolve_memory_limit
from .config import TriAccelConfig
from .curvature import CurvatureLaw
from .layers import LayerSpec, as_specs
from .noise import GradientNoise, HalfStepPairs, is_noise_schedule_step, split_measurement
from .precision import EvidenceLaw, Precision, PrecisionLaw
from .variants import group_precisions, precision_groups
from .stats import variance_from_moments
from .swap_plan import CostModel, CostTable, OffloadPlanner, SwapPlan, plan_for_budget, simulate
from .telemetry import Telemetry

__all__ = ["Controller", "Decision"]

CHANGES = ("precision", "lr", "batch")


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.array(a, dtype=np.float64)
    a.setflags(write=False)
    return a


@dataclass(frozen=True, eq=False)
class Decision:
    """What the backend applies until the next decision.

    precisions: per-layer compute precision, (L,). lr_scales: curvature LR multipliers (L,) in
    (0, 1]. lr_batch_scale: LR multiplier of the batch rule. batch_size: samples per micro-batch.
    accumulation: micro-batches per optimizer step. logical_batch: samples per optimizer step.
    offload_plan: under offload="auto", per swap unit (forward order) "keep" | "swap" | "recompute" |
    "recompute_swap" (`triaccel.swap_plan`); None while no cost table was observed (nothing swaps).
    changed: which of "precision", "lr", "batch", "offload" differ from the previous decision. Between
    boundaries `Controller.decide` returns the decision in force (the same object), so a backend
    applies a decision when it is not the one it applied last.
    """

    step: int
    precisions: tuple[Precision, ...]
    lr_scales: np.ndarray
    lr_batch_scale: float
    batch_size: int
    accumulation: int
    logical_batch: int
    changed: frozenset[str] = field(default_factory=frozenset)
    offload_plan: tuple[str, ...] | None = None

    @property
    def lr_multipliers(self) -> np.ndarray:
        """(L,) total multiplier on each layer's LR: curvature scale x batch-rule scale."""
        return self.lr_scales * self.lr_batch_scale

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "precisions": [p.short for p in self.precisions],
                "lr_scales": self.lr_scales.tolist(), "lr_batch_scale": self.lr_batch_scale,
                "batch_size": self.batch_size, "accumulation": self.accumulation,
                "logical_batch": self.logical_batch, "changed": sorted(self.changed),
                "offload_plan": None if self.offload_plan is None else list(self.offload_plan)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Decision":
        return cls(step=d["step"], precisions=tuple(Precision.parse(p) for p in d["precisions"]),
                   lr_scales=_frozen(d["lr_scales"]), lr_batch_scale=d["lr_batch_scale"],
                   batch_size=d["batch_size"], accumulation=d["accumulation"],
                   logical_batch=d["logical_batch"], changed=frozenset(d["changed"]),
                   offload_plan=None if d.get("offload_plan") is None else tuple(d["offload_plan"]))

    def same_as(self, other: "Decision") -> bool:
        """Equal in everything the backend applies (the step and `changed` aside)."""
        return (self.precisions == other.precisions and np.array_equal(self.lr_scales, other.lr_scales)
                and self.lr_batch_scale == other.lr_batch_scale and self.batch_size == other.batch_size
                and self.accumulation == other.accumulation and self.logical_batch == other.logical_batch
                and self.offload_plan == other.offload_plan)


def _check_bytes(name: str, v: Any, lo: int) -> None:
    """ValueError unless `v` is a finite number of bytes >= lo."""
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
            or not np.isfinite(v) or v < lo:
        raise ValueError(f"{name}={v!r}: must be a finite number of bytes >= {lo}")


class Controller:
    """Collects per-step observations and re-decides at control boundaries.

    Boundaries: batch every `t_ctrl` steps (step % t_ctrl == 0), precision every `t_precision`
    (default t_ctrl); LR scales and
    curvature promotions at curvature steps (step % t_curv == 0, from warmup_steps on) once
    eigenvalues were observed.
    An OOM shrinks the batch immediately (`observe_oom`).

    offload="auto": once the backend observed cost tables (`observe_offload_costs`, when
    `wants_offload_costs` says) and memory, each batch boundary picks batch and swap plan together
    (`triaccel.swap_plan.choose_batch` over `BatchLaw.candidates`, for rho_high * MemMax less the
    planner's learned margin) instead of the memory/noise law's one-bucket move.
    """

    def __init__(self, config: TriAccelConfig, layers: Sequence[LayerSpec | str]) -> None:
        if not isinstance(config, TriAccelConfig):
            raise TypeError(f"config: expected TriAccelConfig, got {type(config).__name__}")
        self.config = config
        self.layers = as_specs(layers)
        if not self.layers:
            raise ValueError("layers: at least one layer is needed")
        L = len(self.layers)
        pinned = np.array([s.kind == "norm" for s in self.layers])
        base = Precision.parse(config.base_precision)
        self._precision: PrecisionLaw
        if config.precision_law == "evidence":
            self._precision = EvidenceLaw(L, pinned, base=base, min_dwell=config.min_dwell,
                                          hysteresis=config.hysteresis,
                                          rounding_ratio=config.rounding_noise_ratio, beta=config.beta)
        else:
            self._precision = PrecisionLaw(
                L, pinned, beta=config.beta, tau_low=config.tau_low, tau_high=config.tau_high,
                quantiles=config.calibration_quantiles, hysteresis=config.hysteresis,
                min_dwell=config.min_dwell, base=base, recalibrate_every=config.recalibrate_every)
        self._noise = GradientNoise(L, config.noise_beta)
        # noise_split="steps": what each step ran, and the measurement being gathered, until the rows are in
        self._pairs = HalfStepPairs(config.short_step_lr) if config.noise_split == "steps" else None
        self._curvature = CurvatureLaw(L, config.top_k, alpha=config.alpha, tau_curv=config.tau_curv)
        self._batch = BatchLaw(config)
        self._groups = precision_groups(pinned, config.precision_groups)
        self._mem_used: int | None = None   # peak bytes in use since the last batch decision
        # modelled peak bytes of a step at other batch sizes, since the last batch decision
        self._mem_at: dict[int, int] = {}
        self._mem_limit: int | None = None  # MemMax, bytes
        self._curv_pending = False
        # offload="auto": cost model from the backend, planner (built once MemMax is known), plan in force
        self._offload_model: CostModel | None = None
        self._planner: OffloadPlanner | None = None
        self._swap: SwapPlan | None = None
        self._offload_info: dict[str, Any] | None = None
        self._oom_in_window = False   # the window's memory peak holds a failed try: not the plan's
        self._remeasure = False
        self._moved_windows = 0   # consecutive step-time windows off the model
        self._remeasured_margin: int | None = None  # planner margin a target <= 0 asked new tables for
        self.telemetry = Telemetry()
        self._decision = self._make(step=-1, changed=frozenset(CHANGES))

    # -- observations -----------------------------------------------------------------------
    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.layers)

    def _vector(self, name: str, value: Any) -> np.ndarray:
        v = np.asarray(value, dtype=np.float64)
        if v.shape != (len(self.layers),):
            raise ValueError(f"{name}: expected shape ({len(self.layers)},) (one value per layer), got {v.shape}")
        return v

    def observe_grad_variance(self, step: int, var: Any) -> None:
        """Fold raw per-layer Var[grad] (shape (L,), unscaled gradients, finite, >= 0) of `step`."""
        v = self._vector("var", var)
        if not np.isfinite(v).all() or (v < 0).any():
            raise ValueError("var: must be finite and >= 0 (a step with non-finite gradients is skipped, "
                             "not observed)")
        self._precision.observe(v)

    def observe_grad_moments(self, step: int, sums: Any, sumsqs: Any, counts: Any) -> None:
        """Like `observe_grad_variance`, from per-layer sum, sum of squares and element count (L,)."""
        var = variance_from_moments(self._vector("sums", sums), self._vector("sumsqs", sumsqs),
                                    self._vector("counts", counts))
        self.observe_grad_variance(step, var)

    def observe_grad_moments_rows(self, steps: Sequence[int], sums: Any, sumsqs: Any, counts: Any) -> None:
        """`observe_grad_moments` for n steps at once, in order: sums and sumsqs (n, L), counts (L,)
        (the same for every row). The same EMA, folded row by row, as n single calls; the checks
        and the variances run once over the block (a control boundary feeds t_ctrl rows)."""
        L = len(self.layers)
        s, q = np.asarray(sums, dtype=np.float64), np.asarray(sumsqs, dtype=np.float64)
        if s.shape != (len(steps), L) or q.shape != s.shape:
            raise ValueError(f"sums, sumsqs: expected shape ({len(steps)}, {L}) (one row per step, one "
                             f"value per layer), got {s.shape} and {q.shape}")
        var = variance_from_moments(s, q, np.broadcast_to(self._vector("counts", counts), s.shape))
        if not np.isfinite(var).all():
            raise ValueError("sums, sumsqs: must give finite variances (a step with non-finite gradients "
                             "is skipped, not observed)")
        for v in var:
            self._precision.observe(v)

    def observe_curvature(self, step: int, eigvals: Any) -> None:
        """Top-k eigenvalues per layer, shape (L, top_k); LR scales follow at the next boundary.

        Promotions (lambda_max > tau_curv) start at `step` and last `promotion_window` steps.
        """
        if not self.config.curvature_enabled:
            raise ValueError('observe_curvature: curvature="off" in the config')
        promote = self._curvature.observe(eigvals)
        if self.config.adaptive_precision:
            window = self.config.promotion_window or self.config.t_curv
            self._precision.promote(step, promote, window)
        self._curv_pending = True

    def observe_nonfinite(self, step: int, counts: Any, loss_scaled: bool = False) -> None:
        """Non-finite gradient values per layer (L,) at `step` (a step the backend skipped or
        found non-finite). Evidence for the evidence precision law; no effect under "variance".
        loss_scaled: the step's gradients were loss-scaled (FP16 overflows then belong to the scaler)."""
        c = self._vector("counts", counts)
        if isinstance(self._precision, EvidenceLaw):
            self._precision.observe_nonfinite(step, c, loss_scaled)

    def observe_loss_scale(self, step: int, scale: float) -> None:
        """The dynamic loss scale in force (while any layer is FP16); below 1 is a collapse."""
        if not np.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale={scale!r}: must be finite and > 0")
        if isinstance(self._precision, EvidenceLaw):
            self._precision.observe_loss_scale(step, float(scale))

    def is_noise_step(self, step: int) -> bool:
        """Whether `step` measures the gradient noise scale (split into two micro-batches, or under
        noise_split="steps" run as half its batch, `triaccel.elastic.noise_samples`):
        batch_law="noise", elastic batch on, a single-micro-batch step, on the schedule
        from warmup_steps on (the first steps' estimates are a transient of the initialisation):
        the first 1/(1-noise_beta) every t_noise_warm steps, then every t_noise
        (`triaccel.noise.is_noise_schedule_step`), and only while the batch can still grow or the
        evidence precision law uses it. The batch law acts on the estimate once 1/(1-noise_beta)
        measurements are in."""
        c = self.config
        if (c.batch_law != "noise" or not c.elastic_batch or not is_noise_schedule_step(
                step, c.warmup_steps, c.t_noise or c.t_ctrl, c.t_noise_warm, c.noise_beta)):
            return False
        d = self._decision
        if d.accumulation != 1 or d.batch_size < 2:
            return False
        rounding = (c.adaptive_precision and isinstance(self._precision, EvidenceLaw)
                    and self._precision.base != Precision.FP32)
        return rounding or self._batch.can_grow()

    def observe_gradient_noise(self, step: int, sizes: Any, micro_sqnorms: Any, total_sqnorm: Any) -> None:
        """One step split into micro-batches: `sizes` (k >= 2,) samples each, `micro_sqnorms` (k, L)
        squared per-layer norms of each micro-batch's mean gradient and `total_sqnorm` (L,) of the
        step's mean gradient, all unscaled (see `triaccel.noise.split_measurement`)."""
        self._fold_noise(*split_measurement(sizes, micro_sqnorms, total_sqnorm, len(self.layers)))

    def observe_step_samples(self, step: int, samples: int, logical_batch: int, noise: bool) -> None:
        """noise_split="steps": `step` runs `samples` real samples of a `logical_batch` (`noise`: as a
        noise step's half batch). Both backends' `controlled_step` report each step before it runs;
        kept until its statistics row is in (`triaccel.noise.HalfStepPairs`). No-op otherwise."""
        if self._pairs is not None:
            self._pairs.ran(step, samples, logical_batch, noise)

    def observe_noise_rows(self, steps: Sequence[int], sumsqs: Any, finite: Any) -> None:
        """noise_split="steps": the statistics rows of `steps` (in order, each once): (n, L) per-layer
        squared norms of the unscaled gradients as applied, (n,) finite; each noise step's row with the
        mean of the full steps' rows after it is one gradient-noise measurement (`feed_statistics`
        calls it). No-op otherwise."""
        if self._pairs is not None:
            for m in self._pairs.rows(steps, sumsqs, finite):
                self._fold_noise(*m)

    def _fold_noise(self, b_small: float, small: np.ndarray, b_big: float, big: np.ndarray) -> None:
        self._noise.observe(b_small, small, b_big, big)
        if isinstance(self._precision, EvidenceLaw) and self.config.adaptive_precision:
            self._precision.observe_noise(self._noise.g2, self._noise.trace, b_big)

    @property
    def b_noise(self) -> float | None:
        """Gradient noise scale B_noise in samples (None while unknown)."""
        return self._noise.b_noise()

    def observe_memory(self, step: int, used_bytes: int, limit_bytes: int,
                       at_batch: Mapping[int, int] | None = None) -> None:
        """Device bytes in use (peak since the last observation) and the device's capacity.

        at_batch: optional {batch size (samples): modelled peak bytes of a step at that batch}, e.g.
        from the compiled programs a backend would run it with: where a backend pads micro-batches to
        a floor, a larger batch below the floor runs the same program and needs no more memory. The
        batch law uses these for a grown batch instead of scaling used_bytes by the batch ratio."""
        for name, v, lo in (("used_bytes", used_bytes, 0), ("limit_bytes", limit_bytes, 1)):
            _check_bytes(name, v, lo)
        for b, v in (at_batch or {}).items():
            if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1:
                raise ValueError(f"at_batch: key {b!r}: must be a batch size >= 1 (samples)")
            _check_bytes(f"at_batch[{b}]", v, 0)
        limit = resolve_memory_limit(self.config.memory_budget, int(limit_bytes))
        self._mem_limit = limit
        self._mem_used = used_bytes if self._mem_used is None else max(self._mem_used, used_bytes)
        for b, v in (at_batch or {}).items():
            self._mem_at[int(b)] = max(int(v), self._mem_at.get(int(b), 0))

    def observe_oom(self, step: int) -> Decision:
        """Out of memory at `step`: shrink the batch now and return the new decision. Under an
        offload plan the model under-estimated the peak: its margin grows (as for a peak of MemMax + 1
        byte) and the plan becomes the one for the smaller batch (all "keep" where none is needed)."""
        self._batch.oom(step)
        planner = self._planner
        if planner is not None and self._swap is not None:
            if self._mem_limit is not None and self._mem_limit + 1 > planner.budget:
                planner.observe_peak(self._swap, self._mem_limit + 1)
            self._swap = self._plan_for(self._batch.batch)
            self._oom_in_window = True
        return self._commit(step, event="oom")

    # -- offload (offload="auto") -----------------------------------------------------------
    def observe_offload_costs(self, step: int, tables: Sequence[CostTable]) -> None:
        """Cost tables (`triaccel.swap_plan.CostTable`, one or two batches, the same units in forward
        order) measured by the backend with no plan applied; the next batch boundary decides batch
        and plan from them."""
        if self.config.offload != "auto":
            raise ValueError(f"observe_offload_costs: offload={self.config.offload!r} in the config; "
                             "allowed only with offload='auto'")
        model = CostModel(tuple(tables))
        if self._offload_model is not None and model.tables[0].names != self._offload_model.tables[0].names:
            raise ValueError(f"tables: units {model.tables[0].names}, allowed the units observed before "
                             f"{self._offload_model.tables[0].names}")
        self._offload_model = model
        if self._planner is not None:
            self._planner.observe_tables(model.tables)
        self._remeasure, self._moved_windows = False, 0

    def wants_offload_costs(self, step: int) -> bool:
        """Whether the backend should measure cost tables now (no plan applied) and pass them to
        `observe_offload_costs`: offload="auto", a control step from warmup_steps on, and none
        observed yet, or the measured step times moved (`observe_step_time`)."""
        c = self.config
        if c.offload != "auto" or step < c.warmup_steps or not self.is_control_step(step):
            return False
        return self._offload_model is None or self._remeasure

    def observe_step_time(self, step: int, ms_per_step: float) -> None:
        """Mean wall time per optimizer step (ms) over a window run wholly under the decision in
        force. Under an active offload plan (some unit swaps or recomputes), two windows in a row off
        the first one under the same batch and plan by more than the planner's tolerance ask for new
        tables (`wants_offload_costs`); one alone is taken for a one-off (an evaluation, a checkpoint
        written in the window). With no plan in force step times ask for nothing."""
        if isinstance(ms_per_step, bool) or not isinstance(ms_per_step, (int, float, np.floating)) \
                or not np.isfinite(ms_per_step) or ms_per_step <= 0:
            raise ValueError(f"ms_per_step={ms_per_step!r}: allowed a finite number of milliseconds > 0")
        if self._planner is not None and self._swap is not None and self._swap.active:
            moved = self._planner.observe_step_time(self._swap, float(ms_per_step))
            self._moved_windows = self._moved_windows + 1 if moved else 0
            self._remeasure = self._remeasure or self._moved_windows >= 2

    @property
    def offload_swap_plan(self) -> SwapPlan | None:
        """The modelled plan in force (prefetch points, step time, peak), or None."""
        return self._swap

    def _plan_for(self, batch: int) -> SwapPlan:
        planner = self._planner
        assert planner is not None
        return plan_for_budget(planner.model.at(batch), max(planner.target, 1))

    def _decide_offload(self, step: int, b_noise: float | None, limit: int) -> None:
        """Batch and plan together at a batch boundary from the cost tables and MemMax `limit` (bytes)."""
        cfg, law = self.config, self._batch
        budget = max(int(cfg.rho_high * limit), 1)
        planner = self._planner
        if planner is None or planner.budget != budget:
            margin = 0 if planner is None else planner.margin
            planner = self._planner = OffloadPlanner(cfg, self._offload_model, budget)  # type: ignore[arg-type]
            planner.margin = margin
        if self._mem_used is not None and self._swap is not None and not self._oom_in_window:
            planner.observe_peak(self._swap, int(self._mem_used))
        self._oom_in_window = False
        grid = law.candidates(step, b_noise) if cfg.elastic_batch else [law.batch]
        planner.batches = tuple(grid)
        choice = None
        if planner.target > 0:
            try:
                choice = planner.decide(b_noise)
            except ValueError:  # not even the smallest candidate fits the model
                choice = None
        elif self._remeasured_margin != planner.margin:
            # the model under-estimates by the whole budget: measure it again, once per margin (new
            # tables that leave it so would otherwise be re-measured at every boundary)
            self._remeasured_margin = planner.margin
            self._remeasure = True
            try:
                planner.check_target()
            except ValueError as e:
                warnings.warn(f"offload: {e}. Until then: the smallest candidate batch, every unit recomputed",
                              RuntimeWarning, stacklevel=3)
        plan = choice.plan if choice is not None else self._plan_for(grid[0])
        if cfg.elastic_batch:
            law.move_to(plan.batch, step)
        self._swap = plan
        self._offload_info = {
            "target": planner.target, "margin": planner.margin, "modelled_peak": plan.peak_bytes,
            "modelled_step_ms": plan.step_ms, "fits": bool(plan.fits),
            "goodput": None if choice is None else choice.goodput,
            "baseline_batch": None if choice is None or choice.baseline is None else choice.baseline.batch,
            "candidates": [] if choice is None else [list(c) for c in choice.candidates]}

    # -- decisions --------------------------------------------------------------------------
    def is_control_step(self, step: int) -> bool:
        return step % self.config.t_ctrl == 0

    def is_curvature_step(self, step: int) -> bool:
        """step % t_curv == 0 once warm-up is over: curvature is measured in eval mode, and before
        warm-up BatchNorm running statistics are still near their initial values, so the
        eigenvalues are not those of the trained-for model (in a JAX ResNet-18 run most layers'
        lambda_max read 0.03-0.09 at step 0 and 0.15-40 at step 200), and the calibrated alpha
        and tau_curv would be set from them."""
        c = self.config
        return c.curvature_enabled and step >= c.warmup_steps and step % c.t_curv == 0

    @property
    def decision(self) -> Decision:
        """The decision in force."""
        return self._decision

    def decide(self, step: int) -> Decision:
        """Re-take decisions if `step` is a boundary; otherwise return the decision in force.

        Called again for the same step, it returns the same decision, unless eigenvalues of that
        (curvature) step were observed since: then LR scales and promotions are re-taken.
        """
        control = self.is_control_step(step)
        curvature = self.is_curvature_step(step) and self._curv_pending
        if step == self._decision.step and not curvature:
            return self._decision
        if step == self._decision.step:  # eigenvalues of this step arrived after its decision
            control = False
        if not (control or curvature):
            return self._decision
        cfg = self.config
        if control:
            if cfg.adaptive_precision and step % (cfg.t_precision or cfg.t_ctrl) == 0:
                self._precision.update_levels(step, warm=step >= cfg.warmup_steps)
            # the noise law acts only on a filled EMA (early estimates swing, docs/results.md)
            b_noise = self.b_noise if self._noise.warm else None
            # MemMax: measured, else the budget (a device whose memory cannot be read)
            limit = self._mem_limit if self._mem_limit is not None else cfg.memory_budget
            if self._offload_model is not None and limit is not None:
                self._decide_offload(step, b_noise, limit)
            elif cfg.elastic_batch and (cfg.batch_law == "noise" or (
                    self._mem_used is not None and self._mem_limit is not None)):
                self._batch.update(self._mem_used, self._mem_limit, step, b_noise, self._mem_at)
        if curvature:
            self._curv_pending = False
        decision = self._commit(step, event="decide")  # its record shows the memory it was taken on
        if control:
            self._mem_used, self._mem_at = None, {}
        return decision

    def _make(self, step: int, changed: frozenset[str]) -> Decision:
        b = self._batch
        return Decision(step=step, precisions=group_precisions(self._precision.effective(step), self._groups),
                        lr_scales=_frozen(self._curvature.scales), lr_batch_scale=b.lr_scale(step),
                        batch_size=b.batch, accumulation=b.accumulation(), logical_batch=b.logical_batch(),
                        changed=changed, offload_plan=None if self._swap is None else self._swap.actions)

    def _commit(self, step: int, event: str) -> Decision:
        new = self._make(step, frozenset())
        old = self._decision
        changed = set()
        if new.precisions != old.precisions:
            changed.add("precision")
        if not np.array_equal(new.lr_scales, old.lr_scales) or new.lr_batch_scale != old.lr_batch_scale:
            changed.add("lr")
        if (new.batch_size, new.accumulation) != (old.batch_size, old.accumulation):
            changed.add("batch")
        if new.offload_plan != old.offload_plan:
            changed.add("offload")
        new = Decision(**{**new.__dict__, "changed": frozenset(changed)})
        self._decision = new
        self._record(new, event)
        return new

    def _record(self, d: Decision, event: str) -> None:
        lam = self._curvature.lam_max
        self.telemetry.append({
            "event": event, **d.to_dict(),
            "var_ema": [None if np.isnan(x) else float(x) for x in self._precision.ema],
            "lambda_max": [None if np.isnan(x) else float(x) for x in lam],
            "tau_low": self._precision.tau_low, "tau_high": self._precision.tau_high,
            "mem_used": self._mem_used, "mem_limit": self._mem_limit, "ooms": self._batch.ooms,
            "b_noise": self.b_noise, "b_noise_warm": self._noise.warm,   # the noise law acts once warm
            **({"offload": self._offload_info} if self.config.offload == "auto" else {}),
        })

    def likely_next(self, step: int, reach: int = 1) -> tuple[tuple[Precision, ...], tuple[int, ...]]:
        """What the next decisions after `step` are likely to be, for backends that prepare
        (compile) variants ahead: the precisions the next precision boundary would decide if no new
        observation came (evidence that expires, promotions that end; the same law, on a copy),
        and the batch sizes up to `reach` (>= 1) grid steps down and up from the current one,
        ascending (the batch law moves one step per decision; under batch_growth="jump" a growth may
        reach any larger one, so all of those are listed; above only up to the OOM ceiling; empty
        when the batch lever is off). Changes nothing."""
        if isinstance(reach, bool) or not isinstance(reach, (int, np.integer)) or reach < 1:
            raise ValueError(f"reach={reach!r}: allowed an integer >= 1")
        cfg = self.config
        every = cfg.t_precision or cfg.t_ctrl
        nxt = (step // every + 1) * every
        law = copy.deepcopy(self._precision)
        if cfg.adaptive_precision:
            law.update_levels(nxt, warm=nxt >= cfg.warmup_steps)
        precisions = group_precisions(law.effective(nxt), self._groups)
        batches: tuple[int, ...] = ()
        if cfg.elastic_batch:
            grid = list(cfg.batch_buckets) if cfg.batch_buckets is not None else \
                list(range(cfg.batch_min, cfg.batch_max + 1, cfg.batch_multiple))
            b = self._decision.batch_size
            below, above = [g for g in grid if g < b], [g for g in grid if g > b and g <= self._batch.ceiling]
            batches = (*below[-int(reach):], *above[:None if cfg.batch_growth == "jump" else int(reach)])
        return precisions, batches

    # -- reporting & state ------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """Latest per-layer state by layer name, plus batch and memory (JSON-safe)."""
        d = self._decision
        lam = self._curvature.lam_max
        return {
            "step": d.step, "batch_size": d.batch_size, "accumulation": d.accumulation,
            "logical_batch": d.logical_batch, "lr_batch_scale": d.lr_batch_scale,
            "mem_limit": self._mem_limit, "ooms": self._batch.ooms, "b_noise": self.b_noise,
            "noise_measurements": self._noise.count,
            "offload_plan": None if d.offload_plan is None else list(d.offload_plan),
            "layers": {
                s.name: {"precision": d.precisions[i].short, "lr_scale": float(d.lr_scales[i]),
                         "lambda_max": None if np.isnan(lam[i]) else float(lam[i]),
                         "var_ema": None if np.isnan(self._precision.ema[i]) else float(self._precision.ema[i])}
                for i, s in enumerate(self.layers)},
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe; `load_state_dict` on a controller with the same config and layers resumes it."""
        return {
            "config": self.config.to_dict(),
            "layers": [[s.name, s.kind] for s in self.layers],
            "precision": self._precision.state_dict(),
            "curvature": self._curvature.state_dict(),
            "batch": self._batch.state_dict(),
            "noise": self._noise.state_dict(),
            "noise_pairs": None if self._pairs is None else self._pairs.state_dict(),
            "mem_used": self._mem_used, "mem_limit": self._mem_limit, "mem_at": dict(self._mem_at),
            "curv_pending": self._curv_pending,
            "decision": self._decision.to_dict(),
            "telemetry": list(self.telemetry.records),
            "offload": {
                "tables": None if self._offload_model is None else [t.to_dict() for t in self._offload_model.tables],
                "planner": None if self._planner is None else self._planner.state_dict(),
                "plan": None if self._swap is None else [self._swap.batch, list(self._swap.actions)],
                "info": self._offload_info, "oom_in_window": self._oom_in_window, "remeasure": self._remeasure,
                "moved_windows": self._moved_windows},
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd["config"] != self.config.to_dict():
            raise ValueError("state_dict: saved with a different TriAccelConfig; build the controller "
                             "with TriAccelConfig.from_dict(state['config'])")
        if [list(x) for x in sd["layers"]] != [[s.name, s.kind] for s in self.layers]:
            raise ValueError("state_dict: saved for different layers (names/kinds/order differ)")
        self._precision.load_state_dict(sd["precision"])
        self._curvature.load_state_dict(sd["curvature"])
        self._batch.load_state_dict(sd["batch"])
        self._noise.load_state_dict(sd["noise"])
        if self._pairs is not None and sd.get("noise_pairs") is not None:
            self._pairs.load_state_dict(sd["noise_pairs"])
        self._mem_used, self._mem_limit = sd["mem_used"], sd["mem_limit"]
        self._mem_at = {int(b): int(v) for b, v in sd.get("mem_at", {}).items()}   # (none in older states)
        self._curv_pending = sd["curv_pending"]
        self._decision = Decision.from_dict(sd["decision"])
        self.telemetry.records = list(sd["telemetry"])
        off = sd.get("offload") or {}
        tables = off.get("tables")
        self._offload_model = None if tables is None else CostModel(tuple(CostTable.from_dict(t) for t in tables))
        self._planner = None
        if off.get("planner") is not None:
            self._planner = OffloadPlanner(self.config, self._offload_model, int(off["planner"]["budget"]))
            self._planner.load_state_dict(off["planner"])
        plan = off.get("plan")
        self._swap = None  # re-modelled from its actions (the plan's numbers follow from the tables)
        if plan is not None and self._planner is not None:
            self._swap = simulate(self._planner.model.at(int(plan[0])), plan[1], budget=max(self._planner.target, 1))
        self._offload_info = off.get("info")
        self._oom_in_window, self._remeasure = bool(off.get("oom_in_window")), bool(off.get("remeasure"))
        self._moved_windows = int(off.get("moved_windows", 0))
