"""The wrapped optax transformation and its host-side hook.

Device side (inside ``jax.jit``; no host sync): `TriAccelState` carries a ring buffer of per-step
gradient moments (t_ctrl, n_tensors, 3), a step counter, the per-layer LR multipliers, the dynamic
loss-scale state and, for ``lr_rule="accumulate"``, the micro-batch accumulator. Each update

1. unscales the gradients by 1/loss_scale and takes per-tensor (sum, sumsq, nonfinite) in one
   `triaccel.kernels.grad_moments` pass;
2. skips the step when any value is non-finite (zero updates, inner state unchanged, loss scale
   backed off) — non-finite gradients never reach the parameters;
3. runs the inner optax transformation and multiplies each layer's updates by its multiplier
   (``Decision.lr_multipliers``: curvature LR scale x batch LR rule), so the inner LR and any
   schedule keep working;
4. writes the step's moments into the ring buffer row ``step % t_ctrl``.

With ``TriAccel(noise_in_update=True)`` the update also takes a gradient-noise step's two halves
as two calls (``noise_part=1`` then ``2``, with ``noise_samples`` each; `update_fn`): the first
holds its gradient on the device and changes nothing else, the second updates with the halves'
sample-weighted mean and logs the squared norms per tensor that the batch law's noise estimate
needs, read at the next control boundary. A fused train step (gradient and update in one
program) then measures the noise with no program of its own.

Host side: `TriAccel.control(step, opt_state, model, batch)` once per optimizer step, before the
step runs. Off boundaries it returns at once (no device work). At a control boundary it reads the
buffer (the only host sync), feeds the core `Controller` (variances; per-layer non-finite counts of
skipped steps and the loss scale while it is on, the evidence precision law's inputs; memory,
curvature), takes its
Decision and writes multipliers / loss-scale mode back into the state, and sets the NNX model's
per-layer dtypes. All decisions are the core's.
"""

from __future__ import annotations

import functools
import types
import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from triaccel import Controller, Decision, Precision, TriAccelConfig
from triaccel.noise import max_noise_steps_per_window, observe_tensor_noise
from triaccel.stats import feed_statistics

from .curvature import FisherTopK, HessianTopK, nnx_loss
from .layers import LayerMap, layer_map
from .memory import MemoryProbe, fit_batch, pool_capped
from .policy import CountingJit, policy_names, precision_policy

__all__ = ["TriAccelState", "TriAccel", "TriAccelTransformation", "wrap", "find_state", "loss_scale",
           "LossScaleConfig"]


class LossScaleConfig(NamedTuple):
    """Dynamic loss scaling (active only while some layer computes in FP16).

    init: scale when FP16 turns on; growth_interval: finite updates before the scale doubles;
    backoff: factor on a non-finite step; growth: factor after growth_interval finite steps;
    min_scale: floor of the scale. It lies below 1, as torch's GradScaler has no floor: a scale
    that falls below 1 is the loss-scale collapse the evidence precision law reads
    (`Controller.observe_loss_scale`), so a floor of 1 would hide it.
    """

    init: float = 2.0**15
    growth_interval: int = 2000
    backoff: float = 0.5
    growth: float = 2.0
    min_scale: float = 2.0**-24


class TriAccelState(NamedTuple):
    """State of the wrapped transformation (a pytree; checkpoint it with the rest of the opt state).

    inner: the inner transformation's state. count: int32 (), update calls that completed an
    optimizer step (skipped ones included). moments: float32 (t_ctrl, n_tensors, 3) ring buffer of
    [sum, sumsq, nonfinite] of the unscaled gradients; row_step: int32 (t_ctrl,) the step each row
    holds (-1: empty). lr_mult: float32 (L,) per-layer LR multipliers. loss_scale: float32 ();
    good_steps: int32 () finite steps since the last scale change; scaling: bool () whether dynamic
    loss scaling is on; skipped: int32 () non-finite steps skipped so far. acc: params-shaped float32
    accumulator (``()`` unless lr_rule="accumulate"); micro: int32 () micro-batches in acc;
    accum: int32 () micro-batches per optimizer step.
    Gradient-noise halves (``noise_in_update``; else ``()``): noise_acc: the first half's
    gradient x its samples, float32, in the stacked form of the gradient moments' small arrays
    (`triaccel.kernels.grad_moments.stacked_zeros`); noise_held: float32 (3 T + 1,) its squared norm,
    sum and non-finite count per tensor, then its samples; noise_rows: float32 (S, 3 T + 2) a ring
    of measurements, each the squared norms per tensor of the two halves' and the step's mean (unscaled) gradients, then
    the halves' samples; noise_steps: int32 (S,) the step of each row (-1: empty); noise_count:
    int32 () measurements logged so far.
    """

    inner: Any
    count: jax.Array
    moments: jax.Array
    row_step: jax.Array
    lr_mult: jax.Array
    loss_scale: jax.Array
    good_steps: jax.Array
    scaling: jax.Array
    skipped: jax.Array
    acc: Any
    micro: jax.Array
    accum: jax.Array
    noise_acc: Any = ()
    noise_held: Any = ()
    noise_rows: Any = ()
    noise_steps: Any = ()
    noise_count: Any = ()


def _kernels() -> types.ModuleType:
    """`triaccel.kernels`, imported on first use (it imports Triton when present)."""
    import triaccel.kernels as K

    return K


def _grad_moments_fn() -> Callable[..., Any]:
    f = getattr(_kernels(), "grad_moments", None)
    if isinstance(f, types.ModuleType) or f is None:  # package exports the module, not the function
        from triaccel.kernels.grad_moments import grad_moments as f
    return f


def _placed_like(value: np.ndarray, old: Any) -> jax.Array:
    """The host value `value` with `old`'s dtype, on `old`'s devices and committed only if `old` is
    (a jitted step whose inputs change placement between calls is compiled again for the new
    placement): one transfer, no device-side conversion."""
    host = np.asarray(value, dtype=old.dtype)
    return jax.device_put(host, old.sharding) if getattr(old, "committed", False) else jnp.asarray(host)


# TriAccelState fields the host writes at control boundaries (`TriAccel._write`) besides the loss scale
_CONTROL_FIELDS = ("lr_mult", "scaling", "accum")


def _is_state(x: Any) -> bool:
    return isinstance(x, TriAccelState)


def _value(x: Any) -> Any:
    """Plain array of a leaf that may be wrapped in an nnx Variable (nnx.Optimizer's OptArray)."""
    return x.get_value() if hasattr(x, "get_value") else x


def find_state(tree: Any) -> TriAccelState:
    """The (single) TriAccelState inside an optax state tree (chain, inject_hyperparams, TrainState,
    nnx.Optimizer's opt_state...). Raises ValueError when there is none or more than one."""
    tree = getattr(tree, "opt_state", tree)
    found = [x for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_state) if _is_state(x)]
    if len(found) != 1:
        raise ValueError(f"opt_state: expected exactly one TriAccelState inside, found {len(found)}")
    return found[0]


def loss_scale(opt_state: Any) -> jax.Array:
    """float32 () loss scale to multiply the loss by before differentiating (1.0 unless some layer
    computes in FP16). Works inside jit and on nnx.Optimizer / TrainState / plain optax states."""
    return jnp.asarray(_value(find_state(opt_state).loss_scale))


class _Half(NamedTuple):
    """A gradient-noise half inside the update (`_noise_halves`): which half, its own moments, the
    held accumulator after it (`TriAccelState.noise_acc`), its real samples (float32 ())."""

    first: jax.Array
    second: jax.Array
    moments: Any
    acc: Any
    samples: jax.Array

    def log(self, state: TriAccelState, step_moments: Any) -> dict[str, Any]:
        """The state's noise fields after this half: the first one held, the second one's
        measurement logged in the ring (only when every value of it is finite)."""
        n, f32, m = self.samples, jnp.float32, self.moments
        held = jnp.where(self.first, jnp.concatenate([m.sumsq.astype(f32), m.sum.astype(f32),
                                                      m.nonfinite.astype(f32), n[None]]), state.noise_held)
        t = (state.noise_held.shape[0] - 1) // 3
        row = jnp.concatenate([state.noise_held[:t], m.sumsq.astype(f32), step_moments.sumsq.astype(f32),
                               state.noise_held[-1:], n[None]])
        ok = (self.second & (jnp.sum(self.moments.nonfinite) == 0) & (jnp.sum(step_moments.nonfinite) == 0)
              & jnp.all(jnp.isfinite(row)))
        slot = state.noise_count % state.noise_steps.shape[0]
        return {"noise_acc": self.acc, "noise_held": held,
                "noise_rows": jnp.where(ok, state.noise_rows.at[slot].set(row), state.noise_rows),
                "noise_steps": jnp.where(ok, state.noise_steps.at[slot].set(state.count), state.noise_steps),
                "noise_count": state.noise_count + ok.astype(jnp.int32)}


def _noise_halves(state: TriAccelState, m: Any, g: Any, grads: Any, inv: Any, part: Any,
                  samples: Any) -> tuple[Any, Any, _Half]:
    """(moments, gradient) the update goes on with, and the half: on the second half the two halves'
    sample-weighted mean gradient and its moments, else the micro-batch's own.

    No program of its own per half (`lax.cond` reads its predicate on the host: ResNet-18's bs-512
    epoch took 0.90-0.95 s on an H200 with it, 0.79 s without, 2026-11-27, docs/results.md), so
    this runs on every call of the update; it is kept to what fuses. The held gradient lives in the
    moments' stacked form (`stacked_dot`: the stacking is the moments' own), its dot product with
    this half's comes with it, and the mean's moments follow from the halves' own: sum (n1 s1 + n2 s2)
    / N, squared norm (n1^2 q1 + 2 n2 <acc, g2> + n2^2 q2) / N^2 (acc = n1 g1), non-finite counts
    added (a bound: the step is skipped either way). A second moments pass over the mean instead
    doubled the wrapped update's fusions (EfficientNet-B0 on the CPU: 936 to 1,872), and with it the
    fused bs-512 step took 15.95 ms against 13.15 ms without halves (H100, step records of
    2026-12-07, docs/results.md); this form has 880 (CPU, with the moments' rows in leaf order).
    One zero-padded vector for the whole held gradient compiled EfficientNet-B0's update in 24.4 s
    against 14.0 s per array (H200, 2026-12-02)."""
    part, n = jnp.asarray(part, jnp.int32), jnp.asarray(samples, jnp.float32)
    first, second = part == 1, part == 2
    gm = _kernels()
    leaves, treedef = jax.tree_util.tree_flatten(g)
    # from the scaled gradients and inv, as the moments took them: the same stacking, merged by XLA
    dots, stacks = gm.stacked_dot(jax.tree_util.tree_leaves(grads), state.noise_acc, inv_scale=inv)
    held = state.noise_held
    t = (held.shape[0] - 1) // 3
    n1 = held[-1]
    total = jnp.maximum(n1 + n, 1.0)
    per = 1.0 / total   # a product per element, not a division: XLA fuses it into the update's own kernels
    mean = [jnp.where(second, ((a + x.astype(jnp.float32) * n) * per).astype(x.dtype), x)
            for a, x in zip(gm.unstacked(state.noise_acc, leaves), leaves)]
    g_step = jax.tree_util.tree_unflatten(treedef, mean)
    f32 = jnp.float32
    both = gm.Moments((n1 * held[t:2 * t] + n * m.sum.astype(f32)) / total,
                      (n1 * n1 * held[:t] + 2.0 * n * dots + n * n * m.sumsq.astype(f32)) / (total * total),
                      held[2 * t:3 * t].astype(m.nonfinite.dtype) + m.nonfinite)
    m_step = jax.tree_util.tree_map(lambda a, b: jnp.where(second, a, b), both, m)
    acc = tuple(jnp.where(first, (x * n).astype(a.dtype), a) for a, x in zip(state.noise_acc, stacks))
    return m_step, g_step, _Half(first, second, m, acc, n)


class TriAccelTransformation(optax.GradientTransformationExtraArgs):
    """An optax GradientTransformationExtraArgs that also carries its host hook: ``tx.host`` is the
    `TriAccel` object, and ``tx.control(...)`` forwards to ``tx.host.control(...)``."""

    host: "TriAccel"

    def control(self, step: int, opt_state: Any, model: Any = None, batch: Any = None) -> Any:
        return self.host.control(step, opt_state, model=model, batch=batch)


class TriAccel:
    """Host side of the JAX backend: builds the wrapped transformation and runs the control hook.

    config: the TriAccelConfig. model: the Flax NNX model (layers with exact norm kinds, and the
    target of the precision policy); None -> layers from the parameter paths at ``tx.init``.
    loss_fn: for curvature, ``loss_fn(model, batch) -> scalar`` with a model, else
    ``loss_fn(params, batch) -> scalar``. hessian_iters: subspace iterations per curvature pass
    (warm-started); hessian_layers_per_event: refresh only this many layers' Hessian blocks per
    curvature step, round-robin (None: all; bounds the Hessian cost on deep models). loss_scaling: the dynamic loss-scale parameters. device: for the memory probe.
    mesh: data parallelism over a `jax.sharding.Mesh` (`sharding.data_mesh`): every batch size must
    divide by its data shards (ValueError), the memory probe reads the tightest device, and a
    `SplitStep` given this TriAccel runs on the mesh (state replicated, batch split; the statistics
    the controller reads are the global batch's, `backends.jax.sharding`).
    noise_in_update: the update accepts a gradient-noise step's halves (``noise_part``, module
    docstring), at the cost of a float32 copy of the parameters in the state; the measurements go
    to the controller at the next control boundary (`control`, `report`), before its decision.
    """

    def __init__(self, config: TriAccelConfig, model: Any = None, *, loss_fn: Callable[..., Any] | None = None,
                 hessian_iters: int = 3, hessian_layers_per_event: int | None = None,
                 loss_scaling: LossScaleConfig = LossScaleConfig(), device: Any = None,
                 mesh: Any = None, noise_in_update: bool = False) -> None:
        if not isinstance(config, TriAccelConfig):
            raise ValueError(f"config={config!r}: expected a TriAccelConfig")
        if config.offload == "auto":  # see backends/jax/offload.py: units must be pure fn(params, x)
            raise ValueError("config.offload='auto' is not supported by the JAX wrapper: its Flax NNX models update "
                             "BatchNorm state in place, which PlannedSequential's units fn(params, x) -> x do not "
                             "express. Use offload='off', or run a PlannedSequential model and pass its measured "
                             "tables to Controller.observe_offload_costs, applying Decision.offload_plan with "
                             "PlannedSequential.apply")
        if hessian_iters < 1:
            raise ValueError(f"hessian_iters={hessian_iters}: must be >= 1")
        if loss_scaling.init <= 0 or loss_scaling.growth_interval < 1 or not 0 < loss_scaling.backoff < 1 \
                or loss_scaling.growth <= 1 or loss_scaling.min_scale <= 0:
            raise ValueError(f"loss_scaling={loss_scaling}: need init>0, growth_interval>=1, 0<backoff<1, "
                             "growth>1, min_scale>0")
        if not isinstance(noise_in_update, bool):
            raise ValueError(f"noise_in_update={noise_in_update!r}: allowed True or False")
        if noise_in_update and config.noise_split == "steps":
            raise ValueError("noise_in_update=True: under noise_split='steps' the noise comes from two steps' "
                             "statistics rows and the update's halves would never run (their float32 copy of the "
                             "parameters for nothing); pass noise_in_update=False")
        self.config = config
        self.noise_in_update = noise_in_update
        self.model = model
        self.loss_fn = loss_fn
        self.hessian_iters = hessian_iters
        self.hessian_layers_per_event = hessian_layers_per_event
        self.loss_scaling = loss_scaling
        self.layers: LayerMap | None = layer_map(model) if model is not None else None
        self.controller: Controller | None = Controller(config, self.layers.specs) if self.layers else None
        self.mesh = mesh
        if mesh is not None:
            from .sharding import MeshMemoryProbe, check_config

            if device is not None:
                raise ValueError("device: give either device= (one device) or mesh=, not both")
            check_config(config, mesh)
            self.probe: Any = MeshMemoryProbe(mesh, config.memory_budget)
        else:
            self.probe = MemoryProbe(device)
        self._tensor_layer: np.ndarray | None = None  # of the tree the wrapped tx sees
        self._tensor_counts: np.ndarray | None = None
        self.last_fed = -1          # last device step whose moments went to the controller
        # Optimizer steps counted on the device at this process's last control boundary (None before
        # one): memory is read only when a step ran in this process since then.
        self._count_at_boundary: int | None = None
        # Bytes the curvature pass needs beyond its arguments (once known), and whether a pass ran
        # since the last memory reading: that reading then covers its peak too, as torch's peak
        # counter does.
        self._curv_footprint: int | None = None
        self._curv_ran = False
        self._warned_pool = False
        self.curvature_batch: int | None = None   # samples of the curvature pass (fit to the budget)
        self.rows_lost = 0          # steps overwritten in the ring before a boundary read them
        self.rows_skipped = 0       # non-finite steps fed (-> observe_nonfinite, not observe_grad_moments)
        self.last_noise_fed = -1    # last step whose in-update noise measurement went to the controller
        self.noise_logged = 0       # in-update noise measurements seen on the device (read at boundaries)
        self.noise_lost = 0         # ... overwritten in their ring before a boundary read them
        # Read from the device at each read of the ring (boundaries and report()): non-finite
        # steps skipped (all of them, also those lost from the ring), steps counted, loss scale.
        self.skipped_steps = 0
        self._device_count = 0
        self._loss_scale: float | None = None   # while loss scaling is on
        # The control fields (lr_mult, scaling, accum) as the last ring read found them: {name: (the
        # device array read, its host value)}; `_write` writes only the fields whose value changes.
        self._fields_read: dict[str, tuple[Any, np.ndarray]] = {}
        self._live: Any = None      # the nnx.Optimizer last given to control() (updated in place)
        self._curv: Any = None
        self._jits: list[CountingJit] = []
        self._applied: tuple[Any, tuple[str, ...]] | None = None  # (model, policy) last applied
        self.policy_version = 0     # precision policies applied to a model so far

    # -- device side -------------------------------------------------------------------------
    @property
    def accumulate(self) -> bool:
        return self.config.lr_rule == "accumulate"

    def _bind(self, params: Any) -> None:
        if self.layers is None:
            self.layers = layer_map(params)
            self.controller = Controller(self.config, self.layers.specs)
        tl = self.layers.tensor_layer_of(params)
        missing = sorted(set(range(self.layers.num_layers)) - set(tl.tolist()))
        if missing:
            raise ValueError(f"params: the wrapped transformation sees no parameters of layers "
                             f"{[self.layers.specs[i].name for i in missing]}; wrap the optimizer of all layers")
        sizes = np.array([int(np.prod(np.shape(x))) for x in jax.tree_util.tree_leaves(params)], np.int64)
        self._tensor_layer = tl
        self._tensor_counts = sizes

    def wrap(self, inner: optax.GradientTransformation) -> TriAccelTransformation:
        """The wrapped optax transformation (usable in jit, optax.chain, nnx.Optimizer, TrainState)."""
        inner = optax.with_extra_args_support(inner)
        cfg, ls = self.config, self.loss_scaling
        # "auto" under JAX is XLA's own per-array reductions: no jax-triton lowering in a cold run
        # (ResNet-18, H200, 2026-11-28: 3.8-5.2 s of wall), steady steps alike; "triton" insists
        grad_moments = functools.partial(_grad_moments_fn(), impl="xla" if cfg.kernels == "auto" else cfg.kernels)
        if self.mesh is not None:
            # The GPU kernel ("triton") is a custom call that XLA's automatic partitioning cannot
            # split; every impl runs per device on its whole copy of the (already all-reduced,
            # replicated) gradients, so all impls see the same arrays.
            from .sharding import on_every_device

            grad_moments = on_every_device(grad_moments, self.mesh)

        def init_fn(params: Any) -> TriAccelState:
            self._bind(params)
            n = len(self._tensor_layer)
            L = self.layers.num_layers
            # Plain arrays even when params holds nnx Variables (nnx.Optimizer passes nnx.state(...)).
            acc = jax.tree_util.tree_map(lambda p: jnp.zeros(jnp.shape(_value(p)), jnp.float32), params,
                                         is_leaf=lambda x: hasattr(x, "get_value")) if self.accumulate else ()
            return TriAccelState(
                inner=inner.init(params), count=jnp.zeros((), jnp.int32),
                moments=jnp.asarray(np.zeros((cfg.t_ctrl, n, 3), np.float32)),   # (as in _noise_init)
                row_step=jnp.asarray(np.full((cfg.t_ctrl,), -1, np.int32)),
                lr_mult=jnp.asarray(np.ones((L,), np.float32)), loss_scale=jnp.ones((), jnp.float32),
                good_steps=jnp.zeros((), jnp.int32), scaling=jnp.zeros((), bool),
                skipped=jnp.zeros((), jnp.int32), acc=acc, micro=jnp.zeros((), jnp.int32),
                accum=jnp.ones((), jnp.int32), **(self._noise_init(params, n) if self.noise_in_update else {}))

        def update_fn(grads: Any, state: TriAccelState, params: Any = None, *, noise_part: Any = None,
                      noise_samples: Any = None, **extra: Any) -> tuple[Any, TriAccelState]:
            """noise_part: None or int32 () 0 (a plain step), 1 (a noise step's first half: held, no
            update) or 2 (its second half: the halves' mean applied, the measurement logged);
            noise_samples: float32 () the micro-batch's real samples (with noise_part)."""
            tl = self.layers.tensor_layer_of(grads)  # static: from the tree's paths
            inv = (1.0 / state.loss_scale).astype(jnp.float32).reshape(1)
            m, g = grad_moments(grads, inv_scale=inv)
            held = None
            if noise_part is not None:
                if not self.noise_in_update:
                    raise ValueError("noise_part: the update takes noise halves only with TriAccel(noise_in_update=True)")
                if self.accumulate:
                    raise ValueError("noise_part: not with lr_rule='accumulate' (a noise step runs at accumulation 1)")
                m, g, held = _noise_halves(state, m, g, grads, inv, noise_part, noise_samples)
            m0 = m
            finite_micro = jnp.sum(m.nonfinite) == 0
            if self.accumulate:
                acc = jax.tree_util.tree_map(lambda a, x: a + jnp.where(finite_micro, x, 0).astype(jnp.float32),
                                             state.acc, g)
                micro = state.micro + 1
                emit = micro >= state.accum
                g = jax.tree_util.tree_map(lambda a, x: (a / state.accum.astype(jnp.float32)).astype(x.dtype), acc, g)
                m = grad_moments(g)
                # A micro-batch with non-finite values poisons its optimizer step: remembered in `micro`
                # as a negative offset would be opaque, so the accumulator is zeroed and the step restarts.
                acc = jax.tree_util.tree_map(lambda a: jnp.where(emit | ~finite_micro, 0.0, a), acc)
                micro = jnp.where(emit | ~finite_micro, 0, micro)
                emit = emit & finite_micro
                finite = finite_micro
            else:
                acc, micro, emit, finite = state.acc, state.micro, jnp.ones((), bool), finite_micro

            if self.accumulate:  # the row counts the values that made the step non-finite, per tensor
                m = m._replace(nonfinite=jnp.where(finite_micro, m.nonfinite, m0.nonfinite))

            if held is not None:   # a first half completes no step: no update, no row, no scale change
                emit = emit & ~held.first
            inner_updates, inner_state = inner.update(g, state.inner, params, **extra)
            mult = state.lr_mult
            apply = emit & finite
            updates = jax.tree_util.tree_map(
                lambda u, i: jnp.where(apply, u * mult[i].astype(u.dtype), jnp.zeros_like(u)),
                inner_updates, jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(inner_updates),
                                                            [int(i) for i in tl]))
            inner_state = jax.tree_util.tree_map(lambda new, old: jnp.where(apply, new, old),
                                                 inner_state, state.inner)

            # Ring buffer: one row per optimizer step (finite or not; the host skips non-finite rows).
            step_done = emit | (~finite & (True if held is None else ~held.first))
            row = state.count % cfg.t_ctrl
            stats = jnp.stack([m.sum, m.sumsq, m.nonfinite.astype(jnp.float32)], axis=1)
            moments = jnp.where(step_done, state.moments.at[row].set(stats), state.moments)
            row_step = jnp.where(step_done, state.row_step.at[row].set(state.count), state.row_step)
            count = state.count + step_done.astype(jnp.int32)

            # Dynamic loss scale (only while scaling is on; otherwise pinned at exactly 1).
            good = jnp.where(finite, state.good_steps + 1, 0)
            grow = good >= ls.growth_interval
            scale = jnp.where(finite, jnp.where(grow, state.loss_scale * ls.growth, state.loss_scale),
                              jnp.maximum(state.loss_scale * ls.backoff, ls.min_scale))
            good = jnp.where(grow, 0, good)
            scale = jnp.where(state.scaling, scale, 1.0).astype(jnp.float32)
            good = jnp.where(state.scaling, good, 0).astype(jnp.int32)
            noise: dict[str, Any] = {}
            if held is not None:
                scale = jnp.where(held.first, state.loss_scale, scale)
                good = jnp.where(held.first, state.good_steps, good)
                noise = held.log(state, m)

            return updates, state._replace(
                inner=inner_state, count=count, moments=moments, row_step=row_step, loss_scale=scale,
                good_steps=good, skipped=state.skipped + (step_done & ~finite).astype(jnp.int32), acc=acc,
                micro=micro, **noise)

        tx = TriAccelTransformation(init_fn, update_fn)
        tx.host = self
        return tx

    def _noise_init(self, params: Any, n: int) -> dict[str, Any]:
        """The noise fields of a new state for `n` gradient tensors: a ring of as many
        measurements as can fall between two boundaries (`max_noise_steps_per_window`)."""
        c = self.config
        slots = max_noise_steps_per_window(c.t_ctrl, c.t_noise or c.t_ctrl, c.t_noise_warm, c.noise_beta)
        is_var = lambda x: hasattr(x, "get_value")   # noqa: E731
        # from host arrays: an eager jnp.zeros of a new shape is one XLA compilation each, in set-up
        leaves = [_value(p) for p in jax.tree_util.tree_leaves(params, is_leaf=is_var)]
        acc = tuple(map(jnp.asarray, _kernels().stacked_zeros(leaves)))
        return {"noise_acc": acc, "noise_held": jnp.asarray(np.zeros((3 * n + 1,), np.float32)),
                "noise_rows": jnp.asarray(np.zeros((slots, 3 * n + 2), np.float32)),
                "noise_steps": jnp.asarray(np.full((slots,), -1, np.int32)),
                "noise_count": jnp.asarray(np.zeros((), np.int32))}

    # -- host side ---------------------------------------------------------------------------
    @property
    def decision(self) -> Decision:
        if self.controller is None:
            raise ValueError("decision: no layers yet; call tx.init(params) or pass model= to TriAccel")
        return self.controller.decision

    def jit(self, fn: Callable[..., Any], **jit_kwargs: Any) -> CountingJit:
        """`nnx.jit` of a train step that counts its traces (one per precision policy / batch shape);
        `report()["compilations"]` sums them."""
        j = CountingJit(fn, **jit_kwargs)
        self._jits.append(j)
        return j

    def footprint(self, batch: int) -> int | None:
        """Bytes the jitted steps (`TriAccel.jit`) need beyond their arguments at micro-batch `batch`:
        the largest compiled footprint among them (`CountingJit.footprint`); None before one is known."""
        known = [fp for j in self._jits if (fp := j.footprint(batch)) is not None]
        return max(known) if known else None

    def _feed(self, ts: TriAccelState) -> int:
        """Give the controller the ring's rows not fed yet; returns the device's step count.

        Finite rows -> `observe_grad_moments`; rows with non-finite values (skipped steps) ->
        `observe_nonfinite` with their per-layer counts (the ring keeps a count per tensor), with
        loss_scaled = whether loss scaling was on for them; while it is on, the loss scale ->
        `observe_loss_scale`. One device->host read (the ring, the counters and the scale)."""
        fields = {k: _value(getattr(ts, k)) for k in _CONTROL_FIELDS}
        moments, row_step, count, skipped, scale, read = jax.device_get(
            (_value(ts.moments), _value(ts.row_step), _value(ts.count), _value(ts.skipped),
             _value(ts.loss_scale), fields))
        self._fields_read = {k: (fields[k], np.asarray(read[k])) for k in _CONTROL_FIELDS}
        scaling = read["scaling"]
        self.skipped_steps, self._device_count = int(skipped), int(count)
        self._loss_scale = float(scale) if bool(scaling) else None
        # Loss scaling switches only at boundaries (`_write`), so the rows not fed yet all ran under it.
        scaled = bool(scaling)
        order = np.argsort(row_step)
        rows = [(int(row_step[i]), moments[i]) for i in order if row_step[i] > self.last_fed]
        if rows and rows[0][0] != self.last_fed + 1:
            lost = rows[0][0] - self.last_fed - 1
            self.rows_lost += lost
            warnings.warn(f"triaccel: the moments of {lost} step(s) before step {rows[0][0]} were overwritten "
                          f"before a control boundary read them; call control() every step (t_ctrl="
                          f"{self.config.t_ctrl})", RuntimeWarning, stacklevel=3)
        if rows:
            self.last_fed = rows[-1][0]
            bad = feed_statistics(self.controller, [st for st, _ in rows], np.stack([r for _, r in rows]),
                                  self._tensor_layer, self._tensor_counts, float(scale) if scaled else None)
            self.rows_skipped += int(bad.sum())
        if self.noise_in_update:
            self._feed_noise(*jax.device_get((_value(ts.noise_rows), _value(ts.noise_steps),
                                              _value(ts.noise_count))))
        return int(count)

    def _feed_noise(self, rows: np.ndarray, steps: np.ndarray, logged: Any) -> None:
        """The in-update noise measurements not fed yet -> `Controller.observe_gradient_noise`, in
        step order (rows: (S, 3 T + 2), steps: (S,), logged: measurements so far)."""
        new, self.noise_logged = int(logged) - self.noise_logged, int(logged)
        if new > len(steps):
            self.noise_lost += new - len(steps)
            warnings.warn(f"triaccel: {new - len(steps)} gradient-noise measurement(s) were overwritten before a "
                          f"control boundary read them (the ring holds {len(steps)}, one boundary's worth and one "
                          "more); call control() every step", RuntimeWarning, stacklevel=4)
        t = len(self._tensor_layer)
        for i in np.argsort(steps):
            step = int(steps[i])
            if step <= self.last_noise_fed:
                continue
            row = np.asarray(rows[i], dtype=np.float64)
            observe_tensor_noise(self.controller, step, [int(round(row[-2])), int(round(row[-1]))],
                                 row[:3 * t].reshape(3, t), self._tensor_layer)
            self.last_noise_fed = step

    def _curvature(self, step: int, params: Any, model: Any, batch: Any) -> None:
        cfg = self.config
        if batch is None:
            raise ValueError(f"batch=None at curvature step {step}: pass b_curv={cfg.b_curv} samples "
                             f"(or set curvature='off')")
        if self.loss_fn is None:
            raise ValueError(f"loss_fn=None: curvature={cfg.curvature!r} needs TriAccel(..., loss_fn=...)")
        if model is not None:
            pure = nnx_loss(model, self.loss_fn)
            fn, params, aux, key = pure.fn, pure.params, pure.aux, pure.graphdef
        else:
            if params is None:
                raise ValueError("params=None: without a model, control() needs params= for curvature")
            user = self.loss_fn
            fn, aux, key = (lambda p, b, _aux: user(p, b)), None, "pure"
        # One estimator per static graph (the eval-FP32 graph does not change with the policy, so
        # normally one compile); the Hessian warm-start vectors carry over.
        if self._curv is None or self._curv[0] != key:
            est = (FisherTopK(fn, self.layers, cfg.top_k) if cfg.curvature == "fisher"
                   else HessianTopK(fn, self.layers, cfg.top_k, iters=self.hessian_iters,
                               layers_per_event=self.hessian_layers_per_event))
            if self._curv is not None and isinstance(est, HessianTopK):
                old = self._curv[1]
                est.vectors, est.eigvals, est._cursor = old.vectors, old.eigvals, old._cursor
            self._curv = (key, est)
            self._curv_footprint = None
        est = self._curv[1]
        batch = self._fit_curvature_batch(est, params, batch, aux)
        self.controller.observe_curvature(step, est(params, batch, aux))
        if self._curv_footprint is None:
            self._curv_footprint = est.footprint(params, batch, aux)  # compiled by the call above
        self._curv_ran = True

    def _fit_curvature_batch(self, est: Any, params: Any, batch: Any, aux: Any) -> Any:
        """`batch`, or its first n samples where the pass over all of them would take the device past
        `memory_budget`: n = the largest of b_curv/2^i whose modelled peak (bytes in use now + the
        pass's compiled footprint) fits (`memory.fit_batch`). Decided once per estimator, with a
        warning naming the size (``curvature_batch`` holds it); no budget or no allocator
        statistics (CPU): the whole batch."""
        size = int(jax.tree_util.tree_leaves(batch)[0].shape[0])
        if self.curvature_batch is None:
            budget, stats = self.config.memory_budget, self.probe.stats()
            n = size
            if budget is not None and stats and "bytes_in_use" in stats:
                def footprint_at(k: int) -> int | None:
                    return est.footprint(params, _take(batch, k), aux)

                n = fit_batch(size, footprint_at, int(stats["bytes_in_use"]), int(budget))
                if n < size:
                    warnings.warn(f"triaccel: the curvature pass over b_curv={size} samples would exceed "
                                  f"memory_budget={budget} bytes; it runs on {n} samples", RuntimeWarning,
                                  stacklevel=3)
            self.curvature_batch = n
        return batch if self.curvature_batch >= size else _take(batch, self.curvature_batch)

    def control(self, step: int, opt_state: Any, model: Any = None, batch: Any = None,
                params: Any = None, run_size: Callable[[int], int] | None = None) -> Any:
        """The host hook: call once per optimizer step, before step `step` runs (step 0, 1, ...).

        opt_state: the optax state tree containing the TriAccelState (or an nnx.Optimizer, updated in
        place, or a TrainState). model: the NNX model (default: the one given to TriAccel) whose
        layer dtypes follow the decision. batch: b_curv samples for the curvature pass (needed only
        at curvature steps). params: the parameters for curvature when there is no NNX model.
        run_size: the micro-batch size a step of b samples runs at (default b; a loader that pads to
        buckets or a floor runs larger ones, `SplitStep.control` passes it): memory is read, and
        modelled for the batch buckets, at those sizes (`Controller.observe_memory(at_batch=...)`).
        Returns opt_state with the new multipliers / loss-scale mode (same object when off a boundary).
        The model's layer dtypes are set when the decided precisions change (dtypes set by hand in
        between stay until then).
        """
        if self.controller is None:
            raise ValueError("control: no layers yet; call tx.init(params) first")
        ctl, cfg = self.controller, self.config
        model = model if model is not None else self.model
        control, curv = ctl.is_control_step(step), ctl.is_curvature_step(step)
        if not (control or curv):
            return opt_state
        ts = find_state(opt_state)
        if hasattr(opt_state, "opt_state") and hasattr(ts.count, "get_value"):
            self._live = opt_state  # nnx.Optimizer: report() reads its current state
        if control:
            count = self._feed(ts)
            # Before a step of this process ran (step 0, or the first boundary after a resume),
            # memory holds no step's peak: no reading (as torch, whose peak counter is per process).
            if self._count_at_boundary is not None and count > self._count_at_boundary:
                run = run_size or (lambda b: b)
                curv_fp = self._curv_footprint if self._curv_ran else None

                def footprint_at(b: int) -> int | None:
                    fp = self.footprint(run(b))
                    return fp if fp is None or curv_fp is None else max(fp, curv_fp)   # (else the probe's fallback)

                footprint = footprint_at(ctl.decision.batch_size)
                self._curv_ran = False
                sample = self.probe.read(batch=run(ctl.decision.batch_size), footprint=footprint)
                if sample is not None:
                    # the compiled peaks of the buckets' steps, where known: bytes in use + footprint
                    at = {} if footprint is None else {
                        b: sample.used - footprint + fp for b in (cfg.batch_buckets or ())
                        if (fp := footprint_at(b)) is not None}
                    ctl.observe_memory(step, sample.used, sample.limit, at_batch=at or None)
                    budget = cfg.memory_budget
                    if (budget is not None and sample.limit > budget and not self._warned_pool
                            and not pool_capped()):
                        self._warned_pool = True
                        warnings.warn(f"triaccel: the XLA allocator may use {sample.limit} bytes, more than "
                                      f"memory_budget={budget}: the batch follows the budget, but compilation "
                                      "scratch (autotuning) can take the peak above it; call "
                                      "triaccel.backends.jax.limit_device_memory(budget) before JAX starts",
                                      RuntimeWarning, stacklevel=2)
            self._count_at_boundary = count
        if curv:
            self._curvature(step, params, model, batch)
        d = ctl.decide(step)
        self._apply_policy(model, d)
        return self._write(opt_state, ts, d)

    def _apply_policy(self, model: Any, d: Decision) -> None:
        """Set the model's layer dtypes from `d` when its precisions differ from the last ones applied
        to this model: walking the module graph costs milliseconds per boundary, and the decision
        rarely changes. `policy_version` counts the applications (a split state must be re-split)."""
        if model is None:
            return
        names = policy_names(d)
        if self._applied is not None and self._applied[0] is model and self._applied[1] == names:
            return
        precision_policy(model, names, self.layers)  # assigns only changed dtypes: no needless retrace
        self._applied = (model, names)
        self.policy_version += 1

    def observe_oom(self, step: int, opt_state: Any, model: Any = None) -> Any:
        """Out of memory at `step` (e.g. XLA RESOURCE_EXHAUSTED): the controller shrinks the batch at
        once; returns opt_state with the new decision written (read it from `decision`), so the
        caller can replay the same samples at the smaller batch."""
        if self.controller is None:
            raise ValueError("observe_oom: no layers yet; call tx.init(params) first")
        d = self.controller.observe_oom(step)
        self._apply_policy(model if model is not None else self.model, d)
        return self._write(opt_state, find_state(opt_state), d)

    def _write(self, opt_state: Any, ts: TriAccelState, d: Decision) -> Any:
        """`d`'s LR multipliers, loss-scale mode and accumulation into the state: only the fields whose
        value changes (a boundary's host time, JAX at bs 96: each written array is a transfer and, for a
        split step, a program writing it back into the packed state); opt_state itself when none does."""
        fp16 = any(p == Precision.FP16 for p in d.precisions)
        want = {"lr_mult": np.asarray(d.lr_multipliers, np.float32), "scaling": np.asarray(fp16),
                "accum": np.asarray(d.accumulation, np.int32)}
        have = {}
        for k in _CONTROL_FIELDS:
            arr, host = self._fields_read.get(k, (None, None))
            # the host copy is the state's value only while the state holds the array it was read from
            have[k] = host if arr is not None and arr is _value(getattr(ts, k)) else None
        missing = [k for k in _CONTROL_FIELDS if have[k] is None]
        if missing:
            for k, v in zip(missing, jax.device_get([_value(getattr(ts, k)) for k in missing])):
                have[k] = np.asarray(v)
        new = {k: v for k, v in want.items() if not np.array_equal(have[k], v)}
        if fp16 != bool(have["scaling"]):  # scaling switches on at the initial scale, off at exactly 1
            new["loss_scale"] = np.asarray(self.loss_scaling.init if fp16 else 1.0, np.float32)
            new["good_steps"] = np.zeros((), np.int32)
        if not new:
            return opt_state
        if hasattr(opt_state, "opt_state") and hasattr(ts.count, "get_value"):
            # nnx.Optimizer: its opt_state leaves are OptArray Variables; update them in place.
            for k, v in new.items():
                getattr(ts, k).set_value(_placed_like(v, _value(getattr(ts, k))))
            return opt_state
        replaced = ts._replace(**{k: _placed_like(v, _value(getattr(ts, k))) for k, v in new.items()})
        if _is_state(opt_state):
            return replaced
        if hasattr(opt_state, "opt_state") and hasattr(opt_state, "replace"):  # flax TrainState
            return opt_state.replace(opt_state=self._swap(opt_state.opt_state, replaced))
        return self._swap(opt_state, replaced)

    @staticmethod
    def _swap(tree: Any, new: TriAccelState) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_state)
        return jax.tree_util.tree_unflatten(treedef, [new if _is_state(x) else x for x in leaves])

    # -- reporting & checkpoints -------------------------------------------------------------
    def report(self, opt_state: Any = None) -> dict[str, Any]:
        """Controller report plus compilations (traces of `jit` steps), lost and skipped rows, steps
        and skipped (non-finite) steps counted on the device, and the loss scale (None while off).

        Current at read time: the wrapper's device state is read first (one host sync) and the
        steps not fed yet go to the controller, as at a boundary. opt_state: where to read it (an
        optax state tree, a TrainState, an nnx.Optimizer, or a `SplitStep`, synced first); default:
        the nnx.Optimizer last given to `control` (updated in place). A functional optax state is
        not kept between calls (that would keep its arrays alive): pass it, or the figures are
        those of the last boundary.
        """
        ts = self._readable_state(opt_state)
        if ts is not None and self.controller is not None and self._tensor_layer is not None:
            self._feed(ts)
        out = self.controller.report() if self.controller is not None else {}
        out.update(compilations=sum(j.traces for j in self._jits), rows_lost=self.rows_lost,
                   rows_skipped=self.rows_skipped, noise_lost=self.noise_lost, optimizer_step=self._device_count,
                   skipped_steps=self.skipped_steps, loss_scale=self._loss_scale)
        return out

    def _readable_state(self, opt_state: Any) -> TriAccelState | None:
        """The TriAccelState to read for `report`, or None when there is none whose arrays are alive."""
        if opt_state is None:
            opt_state = self._live
        elif hasattr(opt_state, "sync") and hasattr(opt_state, "objects"):  # a SplitStep
            opt_state.sync()
            opt_state = opt_state.objects[1]
        if opt_state is None:
            return None
        ts = find_state(opt_state)
        arrays = [_value(x) for x in (ts.moments, ts.row_step, ts.count, ts.skipped, ts.scaling, ts.loss_scale)]
        if any(getattr(a, "is_deleted", lambda: False)() for a in arrays):
            # e.g. the optimizer of a SplitStep that donated them: its current values live in the step
            warnings.warn("triaccel: report() found the optimizer's state donated (a SplitStep between sync() "
                          "calls?); pass report(opt_state=<the SplitStep>) for current figures", RuntimeWarning,
                          stacklevel=3)
            return None
        return ts

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe host state (the device state lives in the optax state: checkpoint both).

        The Hessian estimator's warm-start vectors are not included: after a resume the first
        Hessian pass starts from random vectors (one pass of `hessian_iters` less accurate)."""
        return {"controller": self.controller.state_dict() if self.controller else None,
                "last_fed": self.last_fed, "rows_lost": self.rows_lost, "rows_skipped": self.rows_skipped,
                "last_noise_fed": self.last_noise_fed, "noise_logged": self.noise_logged,
                "noise_lost": self.noise_lost}

    def load_state_dict(self, sd: dict[str, Any], model: Any = None) -> None:
        """Resume the host state; re-applies the decision's precision policy to `model` (or the
        TriAccel's model) so the compute dtypes match the restored decision."""
        if sd["controller"] is not None:
            if self.controller is None:
                raise ValueError("load_state_dict: no layers yet; call tx.init(params) first")
            self.controller.load_state_dict(sd["controller"])
        self.last_fed, self.rows_lost, self.rows_skipped = sd["last_fed"], sd["rows_lost"], sd["rows_skipped"]
        # (absent from states saved before in-update noise existed: none was logged then)
        self.last_noise_fed = sd.get("last_noise_fed", -1)
        self.noise_logged, self.noise_lost = sd.get("noise_logged", 0), sd.get("noise_lost", 0)
        model = model if model is not None else self.model
        if model is not None and self.controller is not None:
            precision_policy(model, self.controller.decision, self.layers)


def _take(batch: Any, n: int) -> Any:
    """The first `n` samples of every array of `batch` (leading axis)."""
    return jax.tree_util.tree_map(lambda a: a[:n], batch)


def wrap(tx: optax.GradientTransformation, config: TriAccelConfig, model: Any = None,
         **kwargs: Any) -> TriAccelTransformation:
    """One-liner: ``tx = wrap(optax.sgd(0.1), config)``. The returned transformation works alone;
    for the loop to adapt, call ``opt_state = tx.control(step, opt_state, model, batch)`` once per
    optimizer step before it runs (a no-op off control/curvature boundaries). kwargs go to TriAccel."""
    return TriAccel(config, model, **kwargs).wrap(tx)
