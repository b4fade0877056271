"""`wrap`: a torch optimizer under the Tri-Accel control loop (precision, curvature LR, elastic batch).

```python
opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, config,
           curvature_data=(x_c, y_c))          # or an iterable of (x, y) batches
for x, y in loader:                             # loader follows opt.decision.batch_size
    with opt.autocast():
        loss = loss_fn(model(x), y)
    opt.backward(loss)
    opt.step(); opt.zero_grad()
```

What the wrapper does per optimizer step (no control law here: every decision is `Controller.decide`):

1. `backward`: divides the loss by the accumulation count and multiplies it by the dynamic loss scale
   when any layer is FP16.
2. `step`: one `triaccel.kernels.grad_moments` launch over all gradients unscales them in place and
   writes per-tensor (sum, sumsq, non-finite) into row r of a preallocated (t_ctrl, n_tensors, 3)
   device buffer. No host sync: the loss scale lives on the device (`torch._amp_update_scale_`),
   and fused optimizers (and any `torch.optim.SGD`, stepped with the fused SGD kernel) skip a
   non-finite step on the device via `found_inf`; see `TriAccelOptimizer.step` for the other cases.
   The inner optimizer steps with the per-layer LR multipliers (see below).
3. At control boundaries only: the buffer is read once, grouped per layer (`triaccel.stats`), and fed
   to `observe_grad_moments` step by step; memory is probed; curvature is computed on curvature
   steps; `decide` is called and its decision applied (precision hooks, multipliers, accumulation).

LR multipliers: the user's param groups stay untouched (schedulers keep writing their lr). A uniform
multiplier scales every group's lr just around the inner step and restores it. Per-layer multipliers
scale each parameter's UPDATE: p <- p_old + m_l (p_new - p_old). For SGD (momentum, nesterov,
weight decay), Adam, AdamW, RMSprop, Adagrad the update is linear in lr, so this equals stepping
with lr * m_l (the state, e.g. momentum buffers and Adam moments, does not depend on lr) while
keeping one param group (splitting groups per layer would multiply the inner optimizer's foreach
launches by the number of layers). Cost: one parameter-sized buffer and two foreach launches (copy,
lerp), only while the multipliers differ across layers. Optimizers whose update is not linear in lr (e.g.
LBFGS) are refused.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from triaccel import Controller, Decision, Precision, TriAccelConfig
from triaccel.elastic import splits_for_noise
from triaccel.stats import feed_statistics

from .compile import uncompiled
from .distributed import local_tensor, unwrap_parallel
from .curvature import (DEFAULT_HESSIAN_ITERS, DEFAULT_LAYERS_PER_EVENT, DEFAULT_PACK, CurvatureEstimator,
                        split_batch)
from .layers import TorchLayer, discover_layers, tensor_layer_index
from .memory import MemoryProbe, MemoryReading
from .precision import PrecisionPlan, torch_dtype

__all__ = ["TriAccelOptimizer", "wrap", "LossScaler"]

# Optimizers whose parameter update is linear in lr (per-layer update scaling == per-layer lr).
LR_LINEAR_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, n) for n in ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "NAdam",
                                      "RAdam", "Adadelta") if hasattr(torch.optim, n))


# Guard codes of the statistics ring's rows (how the step dealt with non-finite gradients).
_ROW_SKIPPED = 0    # checked on the host: non-finite, the inner step was skipped
_ROW_FINITE = 1     # checked on the host: finite, the inner step ran
_ROW_DEVICE = 2     # fused optimizer guarded on the device (skipped iff the row is non-finite)
_ROW_UNGUARDED = 3  # no check (no FP16, non-fused): a non-finite row reached the weights


class LossScaler:
    """Dynamic loss scale (as `torch.amp.GradScaler`): x backoff on overflow, x growth after
    `growth_interval` consecutive finite steps.

    The scale and the growth counter live on the training device as 1-element tensors and are
    updated there by `torch._amp_update_scale_` (GradScaler's own op) from a device-side
    non-finite flag, so keeping the scale costs no host sync. `scale` (a float) reads it back
    (one sync; for reports and tests). `bind(device)` is called by the wrapper.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        if not (init_scale > 0 and math.isfinite(init_scale)):
            raise ValueError(f"init_scale={init_scale}: must be finite and > 0")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor={growth_factor}: must be > 1")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor={backoff_factor}: must be in (0, 1)")
        if growth_interval < 1:
            raise ValueError(f"growth_interval={growth_interval}: must be >= 1")
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.scale_tensor = torch.full((1,), float(init_scale), dtype=torch.float32)   # (1,) fp32
        self._growth = torch.zeros((1,), dtype=torch.int32)                           # (1,) int32

    def bind(self, device: torch.device) -> None:
        """Move the scale state to `device` (where the gradients and the non-finite flag live)."""
        self.scale_tensor = self.scale_tensor.to(device)
        self._growth = self._growth.to(device)

    @property
    def scale(self) -> float:
        """Current loss scale (reads the device value: one host sync)."""
        return float(self.scale_tensor.item())

    @property
    def good_steps(self) -> int:
        """Consecutive finite steps since the last change of the scale (one host sync)."""
        return int(self._growth.item())

    def update(self, found_inf: torch.Tensor) -> None:
        """One step's outcome; found_inf: (1,) float32 on the scale's device, 1.0 = non-finite, 0.0 = finite."""
        torch._amp_update_scale_(self.scale_tensor, self._growth, found_inf, self.growth_factor,
                                 self.backoff_factor, self.growth_interval)

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.scale_tensor.fill_(float(sd["scale"]))
        self._growth.fill_(int(sd["good_steps"]))
        self.growth_factor, self.backoff_factor = sd["growth_factor"], sd["backoff_factor"]
        self.growth_interval = sd["growth_interval"]


class TriAccelOptimizer(torch.optim.Optimizer):
    """A torch optimizer driven by a triaccel `Controller`; build it with `wrap(...)`.

    `param_groups`, `state` and `defaults` are the inner optimizer's own objects, so schedulers
    and user code read and write the user's groups. `decision` is the decision in force;
    `controller` the core controller; `layers` the discovered layers (controller order).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, config: TriAccelConfig, *,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 curvature_data: Any = None, strict_norm: bool = False,
                 loss_scaler: LossScaler | None = None, hessian_iters: int = DEFAULT_HESSIAN_ITERS,
                 hessian_iters_cold: int = 8,
                 hessian_layers_per_event: int | None = DEFAULT_LAYERS_PER_EVENT,
                 hessian_pack: int = DEFAULT_PACK, memory_probe: MemoryProbe | None = None,
                 host_check: bool = False, distributed: Any = None,
                 offload_options: dict[str, Any] | None = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, TriAccelOptimizer):
            raise ValueError("optimizer: already wrapped")
        if not isinstance(config, TriAccelConfig):
            raise ValueError(f"config: expected a TriAccelConfig, got {type(config).__name__}")
        model = uncompiled(model)  # a torch.compile'd model: its module (names, hooks, curvature)
        model = unwrap_parallel(model)  # DDP: its module (layer names as in a single process)
        if not isinstance(optimizer, LR_LINEAR_OPTIMIZERS):
            raise ValueError(f"optimizer: {type(optimizer).__name__} is not supported; per-layer LR "
                             f"multipliers need an update linear in lr, allowed: "
                             f"{[t.__name__ for t in LR_LINEAR_OPTIMIZERS]}")
        opt_params = [p for g in optimizer.param_groups for p in g["params"]]
        layers = discover_layers(model, only=opt_params)
        if not layers:
            raise ValueError("model: no trainable parameter of the optimizer belongs to a module of the model")
        params, index = tensor_layer_index(layers)
        known = {id(p) for p in params}
        stray = [i for i, p in enumerate(opt_params) if p.requires_grad and id(p) not in known]
        if stray:
            raise ValueError(f"optimizer: parameters at positions {stray} of its param groups are not "
                             "parameters of `model`; wrap the model that owns them")
        # What torch.optim.Optimizer.__init__ sets up (hook registries, step patching), minus its own
        # param groups and state: those are the inner optimizer's objects.
        self._optimizer_step_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Any] = OrderedDict()
        self._patch_step_function()
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        self.model, self.config = model, config
        self.layers: list[TorchLayer] = layers
        self.controller = Controller(config, [layer.spec for layer in layers])
        self.loss_fn = loss_fn if loss_fn is not None else F.cross_entropy
        self._params = params
        self._tensor_layer = np.asarray(index, dtype=np.int64)
        self._tensor_numel = np.array([p.numel() for p in params], dtype=np.float64)
        self.device = params[0].device
        self.plan = PrecisionPlan(layers, self.device.type, strict_norm=strict_norm, root=model)
        self.scaler = loss_scaler if loss_scaler is not None else LossScaler()
        self.scaler.bind(self.device)
        self.memory = memory_probe if memory_probe is not None else MemoryProbe(self.device)
        self.offload = None  # offload="auto": measures cost tables, applies Decision.offload_plan
        if config.offload == "auto":
            if distributed is not None:
                raise ValueError("config.offload='auto' is not supported with distributed= yet; use offload='off'")
            from .offload import OffloadDriver
            self.offload = OffloadDriver(model, self.controller, self.plan.region, **(offload_options or {}))
        self.curvature = (CurvatureEstimator(model, layers, self.loss_fn, config.curvature, config.top_k,
                                             hessian_iters=hessian_iters, hessian_iters_cold=hessian_iters_cold,
                                             hessian_layers_per_event=hessian_layers_per_event,
                                             hessian_pack=hessian_pack)
                          if config.curvature_enabled else None)
        self._curv_source = curvature_data
        self._curv_iter: Iterator[Any] | None = None
        self._curv_next: Any = None
        self._curv_warned = False
        self.last_eigvals: np.ndarray | None = None
        self.last_memory: MemoryReading | None = None
        # Statistics ring: one row per optimizer step since the last flush (read at boundaries only).
        # Each row (and each row's flag below) starts on a 16-byte boundary: the statistics kernel is
        # specialised on its output pointers' alignment, and rows of 3 x len(params) floats at odd
        # offsets compiled it up to three times in a run's first steps (~0.5 s each, ResNet-18 on an
        # H200, 2026-11-28, docs/results.md).
        n = len(params)
        self._buf = torch.zeros((config.t_ctrl, -(-n // 4) * 4, 3), dtype=torch.float32, device=self.device)[:, :n]
        from triaccel.kernels.grad_moments import JAX_ONLY_IMPLS, FixedMoments  # Triton on CUDA, torch reference on CPU

        if config.kernels in JAX_ONLY_IMPLS:
            raise ValueError(f"config.kernels={config.kernels!r}: JAX only (XLA's own reductions in the jitted "
                             "update); torch takes 'auto', 'triton' or 'reference'")

        # the gradients of a fixed parameter list: a launch reads only their addresses (Triton)
        self._moments = FixedMoments(impl=config.kernels)
        self._rows: list[tuple[int, int]] = []  # (step, _ROW_* guard code) per filled row
        # noise measurements copied to the host without a wait, fed at the next flush (`defer_noise`)
        self._noise_reads: list[Callable[[], None]] = []
        self._zeros: dict[int, torch.Tensor] = {}
        self._inv_scale = torch.ones(1, dtype=torch.float32, device=self.device)
        # One non-finite flag per ring row (1.0 = non-finite step), set by the statistics launch
        # itself and zeroed at each flush, so a step adds no launch to zero or to compute it. Views
        # made once: a view costs a few us of host time, and a step at small batches is host-bound.
        self._found_ring = torch.zeros((config.t_ctrl, 4), dtype=torch.float32, device=self.device)[:, 0]
        self._buf_rows = list(self._buf.unbind(0))
        self._found_slots = [self._found_ring[i:i + 1] for i in range(config.t_ctrl)]   # (1,) each
        self._found_0d = list(self._found_ring.unbind(0))   # 0-dim, as fused optimizers take it
        # Fused torch optimizers skip their update on the device when `found_inf` is 1.0 (the
        # GradScaler protocol): the sync-free guard. The first inner step is still checked on the
        # host: a fused SGD skipped on its very first step leaves its momentum buffers uninitialised.
        self._device_guard = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        # A non-fused torch SGD is stepped with torch's fused SGD kernel (same state: momentum
        # buffers; same update formula) so that it gets the same sync-free device-side skip.
        self._sgd_as_fused = (not self._device_guard and type(optimizer) is torch.optim.SGD and all(
            "fused" in g and not g.get("differentiable", False) for g in optimizer.param_groups)
            and all(p.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64) for p in params))
        self._device_guard = self._device_guard or self._sgd_as_fused
        self._device_guard_ready = False
        self.host_check = bool(host_check)
        # data parallelism (backends/torch/distributed.py): the ranks' statistics are combined at
        # boundaries so that every rank's controller takes the same decisions
        self.distributed = distributed
        if distributed is not None:
            distributed.bind(config)
            if distributed.sharded:   # fused kernels would get a plain found_inf next to DTensors
                self._device_guard = self._sgd_as_fused = False
        self.nonfinite_steps = 0   # unguarded steps found non-finite at a flush (see step())
        self._nonfinite_warned = False
        self._prev: list[torch.Tensor] | None = None
        self._param_layer: dict[int, int] | None = None
        self._lerp_ok = True
        self.step_count = 0        # optimizer steps taken or skipped (the controller's step)
        self.micro_count = 0       # micro-batches accumulated towards the current step
        self._owned_grads: list[weakref.ref | None] = [None] * len(params)   # see _own_gradients
        self.skipped_steps = 0     # guarded non-finite steps (device-guarded ones: counted at flushes)
        self._mults_uniform: float | None = 1.0
        self._mults_per_tensor: list[float] = [1.0] * len(params)
        self.decision: Decision = self.controller.decide(0)
        self._applied: Decision | None = None
        self._apply(self.decision)

    # -- decisions ---------------------------------------------------------------------------
    @property
    def fp16_active(self) -> bool:
        """True while any layer computes in FP16 (then the loss is scaled)."""
        return Precision.FP16 in self.plan.precisions

    def _apply(self, d: Decision) -> None:
        self.plan.apply(d.precisions)
        mult = np.asarray(d.lr_multipliers, dtype=np.float64)
        if not np.isfinite(mult).all() or (mult <= 0).any():
            raise ValueError(f"decision.lr_multipliers: must be finite and > 0, got {mult}")
        if np.all(mult == mult[0]):
            self._mults_uniform = float(mult[0])
        else:
            self._mults_uniform = None
            self._mults_per_tensor = mult[self._tensor_layer].tolist()
        self.decision = d
        self._applied = d
        if self.offload is not None:
            self.offload.sync(d, self.step_count)

    def layer_index(self, params: Iterable[torch.Tensor]) -> np.ndarray:
        """(len(params),) the controller's layer index of each parameter (ValueError for a foreign one)."""
        if self._param_layer is None:
            self._param_layer = {id(p): int(i) for p, i in zip(self._params, self._tensor_layer)}
        try:
            return np.array([self._param_layer[id(p)] for p in params], dtype=np.int64)
        except KeyError:
            raise ValueError("params: a tensor is not a parameter of the wrapped model's layers") from None

    def autocast(self) -> Any:
        """Context manager for the forward pass: each layer computes in its decided dtype."""
        if self.offload is not None:  # with the swap hooks of the plan in force (an OOM may change it)
            return self.offload.context(self.plan.region(), self.controller.decision, self.step_count)
        return self.plan.region()

    # -- backward / step ---------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """loss.backward() with 1/accumulation and, when any layer is FP16, the loss scale.

        The loss scale is a device tensor: scaling costs one multiply launch and no host sync.
        """
        if self.fp16_active:
            loss = loss * self.scaler.scale_tensor.view(())
        acc = self.decision.accumulation
        if acc != 1 and self.micro_count == 0:
            for p in self._params:   # accumulation buffers outside CUDA graphs (see zero_grad)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        (loss * (1.0 / acc) if acc != 1 else loss).backward(**kwargs)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the dynamic loss scale while any layer is FP16 (else `loss` itself).

        GradScaler-compatible, so `triaccel.backends.torch.data.elastic_step(..., scaler=opt)` can
        scale the micro-batch losses it weights and accumulates itself.
        """
        return loss * self.scaler.scale_tensor.view(()) if self.fp16_active else loss

    def step_accumulated(self) -> None:
        """One optimizer step from gradients already summed over the whole logical batch.

        For drivers that accumulate micro-batches themselves (`elastic_step(...,
        optimizer_step=lambda d: opt.step_accumulated())`), whatever `decision.accumulation` says.
        """
        self.micro_count = self.decision.accumulation - 1
        self.step()

    @torch.no_grad()
    def prepare_kernels(self) -> None:
        """Compile and load the per-step statistics kernel before the first step needs it: one launch
        over the parameters (the gradients' shapes and dtypes, so the same plan and specialisation) into
        a scratch row, with the arguments the next step will pass. The state is untouched. On CUDA with
        Triton this moves the kernel's first compilation (and Triton's start-up) out of the first
        step; it may run on a thread beside set-up work, but not while another thread captures a CUDA
        graph (loading a module then breaks the capture): join it before the first forward."""
        if self.distributed is not None and self.distributed.sharded:
            return   # FSDP: the step launches over the local shards, which the parameters are not
        scaled = self.fp16_active
        # an unscaling launch writes its input back: then copies, not the parameters
        tensors = [p.detach().clone() if scaled else p.detach() for p in self._params]
        # fresh allocations: aligned as the ring's rows and flags are
        scratch, flag = torch.zeros_like(self._buf_rows[0]), torch.zeros_like(self._found_slots[0])
        guarded = scaled or self._device_guard or self.host_check
        inv_scale = torch.ones(1, dtype=torch.float32, device=self.device) if scaled else None
        self._moments(tensors, inv_scale=inv_scale, out=scratch, found_inf=flag if guarded else None)

    def _grad_list(self) -> list[torch.Tensor]:
        grads = [p.grad for p in self._params]
        if any(g is None for g in grads):
            grads = [g if g is not None else self._zero_like(i, p)
                     for i, (p, g) in enumerate(zip(self._params, grads))]
        if self.distributed is not None and self.distributed.sharded:
            grads = [local_tensor(g) for g in grads]   # FSDP: this rank's slice (summed at boundaries)
        return grads

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One micro-batch done; every `decision.accumulation` of them, one optimizer step.

        closure: optional, re-evaluates the model and calls `opt.backward` itself; its value is returned.

        Non-finite gradients (NaN/Inf in the unscaled gradients of any layer), per case; in every
        case the step's statistics never reach the controller:

        - fused inner optimizer (`fused=True`), or any `torch.optim.SGD` (stepped with torch's fused
          SGD kernel, same state and update formula): the update is skipped ON THE DEVICE (weights
          and optimizer state untouched), no host sync; counted in `skipped_steps` at the next
          flush. The very first inner step is checked on the host once.
        - non-fused inner optimizer while any layer is FP16, or `host_check=True`: one host sync per
          step (as `GradScaler`); the step is skipped and `skipped_steps` counts it at once.
        - non-fused inner optimizer, no FP16 layer, `host_check=False` (default): no per-step check,
          as under AMP-bf16: the non-finite update reaches the weights. It is found at the next
          flush (`nonfinite_steps`, one RuntimeWarning). Pass a fused optimizer for a free guard.

        With FP16 the loss scale backs off (on the device) after a non-finite step.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.micro_count += 1
        if self.micro_count < self.decision.accumulation:
            return loss
        self.micro_count = 0
        step = self.step_count
        scaled = self.fp16_active  # how this step's backward ran: decide before a re-decision
        if self.curvature is not None and self.controller.is_curvature_step(step):
            # Measured on the weights this step starts from (the update has not run yet), as the
            # JAX backend does; the LR scales apply to this very update, promotions from the next
            # forward pass.
            self._curvature_event(step)
            d = self.controller.decide(step)
            if d is not self._applied:
                self._apply(d)
        inv_scale = None
        if scaled:
            inv_scale = torch.reciprocal(self.scaler.scale_tensor, out=self._inv_scale)
        slot = len(self._rows)
        guarded = scaled or self._device_guard or self.host_check
        # exactly 0.0 / 1.0: fused kernels skip only on == 1.0, Adam subtracts it from its step count
        found = self._found_slots[slot]
        try:
            self._moments(self._grad_list(), inv_scale=inv_scale, out=self._buf_rows[slot],
                          found_inf=found if guarded else None)
            if guarded and self.distributed is not None:
                self.distributed.reduce_found_inf(found)   # FSDP: any rank's slice
            if self._device_guard and self._device_guard_ready:
                code = _ROW_DEVICE
                # the GradScaler protocol of fused optimizers: 0-dim, as GradScaler passes it (fused
                # Adam subtracts it from its 0-dim step counts and rejects a (1,) tensor)
                self.optimizer.found_inf = self._found_0d[slot]
                groups = self.param_groups
                saved = [(g["fused"], g["foreach"]) for g in groups] if self._sgd_as_fused else None
                try:
                    if saved is not None:
                        for g in groups:
                            g["fused"], g["foreach"] = True, False
                    self._inner_step()
                finally:
                    if saved is not None:
                        for g, (fu, fe) in zip(groups, saved):
                            g["fused"], g["foreach"] = fu, fe
                    del self.optimizer.found_inf
            elif guarded:
                finite = bool(found.item() == 0.0)   # the one host sync of this path
                code = _ROW_FINITE if finite else _ROW_SKIPPED
                if finite:
                    self._inner_step()
                    self._device_guard_ready = self._device_guard
                else:
                    self.skipped_steps += 1
                    if not scaled and self.skipped_steps == 1:
                        warnings.warn(f"step {step}: non-finite gradients without FP16 loss scaling; the step "
                                      "was skipped (weights and optimizer state untouched)", RuntimeWarning,
                                      stacklevel=2)
            else:
                code = _ROW_UNGUARDED
                self._inner_step()
            if scaled:
                self.scaler.update(found)
        except BaseException:
            # an aborted step (e.g. OOM in the inner step) must not leave its flag to the step that
            # reuses this ring row: the launch sets the flag but never clears it
            found.zero_()
            raise
        self._rows.append((step, code))
        self.step_count = step + 1
        self._boundary(self.step_count)
        return loss

    def _zero_like(self, i: int, p: torch.Tensor) -> torch.Tensor:
        z = self._zeros.get(i)
        if z is None:
            z = self._zeros[i] = torch.zeros_like(p)
        return z

    def _inner_step(self) -> None:
        m = self._mults_uniform
        if m is not None:
            if m == 1.0:
                self.optimizer.step()
                return
            saved = [g["lr"] for g in self.param_groups]
            try:
                for g in self.param_groups:
                    g["lr"] = g["lr"] * m
                self.optimizer.step()
            finally:
                for g, lr in zip(self.param_groups, saved):
                    g["lr"] = lr
            return
        params = self._params
        if self._prev is None:
            self._prev = [torch.empty_like(p) for p in params]
        prev = self._prev
        torch._foreach_copy_(prev, params)
        self.optimizer.step()
        # p <- p_new + (1 - m) (p_old - p_new)  ==  p_old + m (p_new - p_old): one foreach lerp
        weights = [1.0 - m_i for m_i in self._mults_per_tensor]
        if self._lerp_ok:
            try:
                torch._foreach_lerp_(params, prev, weights)
                return
            except (RuntimeError, TypeError):  # a torch without the scalar-list lerp overload
                self._lerp_ok = False
        torch._foreach_sub_(prev, params)
        torch._foreach_mul_(prev, weights)
        torch._foreach_add_(params, prev)

    def _boundary(self, step: int) -> None:
        ctl = self.controller
        control = ctl.is_control_step(step)
        reading = self.memory.read() if control else None
        if control or len(self._rows) == self._buf.shape[0]:
            self._flush(memory=reading, exchange=self.distributed is not None)
        if control:
            self.last_memory = reading
            if self.distributed is None and reading is not None:
                ctl.observe_memory(step, reading.used_bytes, reading.limit_bytes)
            if self.offload is not None:
                self.offload.boundary(step)
        d = ctl.decide(step)
        if d is not self._applied:
            self._apply(d)

    def defer_noise(self, feed: Callable[[], None]) -> None:
        """Hold a gradient-noise measurement's feed (`elastic_step`: its device->host copy already
        started, `feed()` waits for it and calls the controller) until the next flush of the
        statistics ring, which runs it before the ring's rows: the order an immediate read gives,
        so the decisions are the same, without the measured step's wait for the GPU. Single
        process only (data parallel combines the ranks' measurements at the step)."""
        self._noise_reads.append(feed)

    def _feed_noise(self) -> None:
        reads, self._noise_reads = self._noise_reads, []
        for feed in reads:
            feed()

    def _flush(self, memory: MemoryReading | None = None, exchange: bool = False) -> None:
        """Feed the held noise measurements, then read the statistics ring (one device->host copy)
        and feed it to the controller.

        exchange (data parallel, at boundaries on every rank): one all-gather combines the ranks'
        rings, loss scales, memory readings and OOM counts (`Distributed.exchange_boundary`)."""
        self._feed_noise()
        n = len(self._rows)
        if n == 0 and not exchange:
            return
        host = self._buf[:n].double().cpu().numpy()               # (n, tensors, 3)
        # rows of this window ran under the policy in force (it changes only at boundaries)
        scale = self.scaler.scale if self.fp16_active else None
        if exchange:
            dist = self.distributed
            view = dist.exchange_boundary(host, scale, None if memory is None else
                                          (memory.used_bytes, memory.limit_bytes), len(self._params), self.step_count)
            host = view.ring if view.ring is not None else host
            scale = view.loss_scale if scale is not None else None
            dist.observe_boundary(self.controller, self.step_count, view)
            if n == 0:
                return
        bad = feed_statistics(self.controller, [step for step, _ in self._rows], host, self._tensor_layer,
                              self._tensor_numel, scale)
        for i, (step, code) in enumerate(self._rows):
            if not bad[i]:
                continue
            if code == _ROW_DEVICE:
                self.skipped_steps += 1
            elif code == _ROW_UNGUARDED:
                self.nonfinite_steps += 1
                if not self._nonfinite_warned:
                    self._nonfinite_warned = True
                    warnings.warn(f"step {step}: non-finite gradients reached the weights (no FP16 layer and "
                                  "a non-fused optimizer: no per-step check, as under AMP-bf16). Pass "
                                  "fused=True to the optimizer (free device-side skip) or host_check=True "
                                  "to wrap() (one sync per step) to skip such steps.", RuntimeWarning,
                                  stacklevel=4)
        self._rows = []
        self._found_ring.zero_()   # stream order: after every step that read a flag

    # -- curvature ---------------------------------------------------------------------------
    def curvature_batch(self, batch: Any) -> None:
        """Supply the (inputs, targets) batch for the next curvature step (overrides `curvature_data`)."""
        split_batch(batch)
        self._curv_next = batch

    def _next_curvature_batch(self) -> Any:
        if self._curv_next is not None:
            b, self._curv_next = self._curv_next, None
            return b
        src = self._curv_source
        if src is None:
            return None
        if isinstance(src, (tuple, list, dict)):
            return src
        if self._curv_iter is None:
            self._curv_iter = iter(src)
        try:
            return next(self._curv_iter)
        except StopIteration:
            if iter(src) is src:  # a one-shot iterator is exhausted
                return None
            self._curv_iter = iter(src)
            return next(self._curv_iter, None)

    def _curvature_event(self, step: int) -> None:
        assert self.curvature is not None
        batch = self._next_curvature_batch()
        if batch is None:
            if not self._curv_warned:
                self._curv_warned = True
                warnings.warn(f"step {step}: curvature={self.config.curvature!r} but no curvature data; pass "
                              "curvature_data= to wrap() or call opt.curvature_batch(batch) before the step. "
                              "Curvature is skipped.", RuntimeWarning, stacklevel=3)
            if self.distributed is not None:   # the other ranks wait for this rank's (empty) part
                self.distributed.reduce_eigvals(None, (len(self.layers), self.config.top_k), step)
            return
        x, y = split_batch(batch)
        b = self.config.b_curv
        x, y = x[:b].to(self.device, non_blocking=True), y[:b].to(self.device, non_blocking=True)
        # eagerly, whether or not the model was compiled (double backward, functorch transforms)
        with torch.enable_grad(), torch.compiler.set_stance("force_eager"):
            if self.offload is not None:  # torch.func transforms: no recompute checkpoints
                with self.offload.suspended():
                    eig = self.curvature((x, y))
            else:
                eig = self.curvature((x, y))
        if self.distributed is not None:   # every rank observes the mean over ranks
            eig = self.distributed.reduce_eigvals(eig, (len(self.layers), self.config.top_k), step)
        if not np.isfinite(eig).all():
            warnings.warn(f"step {step}: non-finite curvature eigenvalues; not observed", RuntimeWarning,
                          stacklevel=3)
            return
        self.last_eigvals = eig
        self.controller.observe_curvature(step, eig)

    # -- OOM ---------------------------------------------------------------------------------
    def observe_oom(self) -> Decision:
        """Out of memory during the current step: drop its gradients, free cached memory, shrink.

        Returns the new decision (smaller batch); the data side replays the failed samples.
        """
        self.zero_grad(set_to_none=True)
        self.micro_count = 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        d = self.controller.observe_oom(self.step_count)
        self._apply(d)
        return d

    # -- optimizer protocol ------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        """Zero gradients, except in the middle of an accumulation (then they keep accumulating).

        set_to_none=True (default, as torch): measured faster on the GPU (H200, ResNet-18 bs 96)
        than keeping zeroed buffers: backward then hands its gradient tensors over instead of
        adding into the old ones (one add launch per parameter), and the caching allocator gives
        them the same addresses step after step, so the statistics kernel's table stays cached.
        set_to_none=False zeroes all gradients in place with one foreach launch (torch's default
        optimizers zero them one tensor at a time unless built with foreach=True) and allocates
        the missing ones. set_to_none=True before a step of several micro-batches
        (`_next_step_splits`) zeroes buffers allocated here instead, for CUDA-graph safety: a
        gradient that backward handed over (possibly in a CUDA graph's pool) is replaced by new
        zeros, once; later such steps reuse the buffers.
        """
        if self.micro_count != 0:
            return
        if set_to_none:
            if not self._next_step_splits():
                self.optimizer.zero_grad(set_to_none=True)
                return
            kept = self._own_gradients(copy=False)
        else:   # torch's meaning: the same tensors, zeroed in place
            kept = []
            for p in self._params:
                g = p.grad
                if g is not None:
                    if g.grad_fn is not None:
                        g.detach_()
                    else:
                        g.requires_grad_(False)
                    kept.append(g)
                else:
                    p.grad = torch.zeros_like(p)
        if kept:
            torch._foreach_zero_(kept)

    def own_gradients(self) -> None:
        """Hold every gradient in a buffer this optimizer allocated (a copy where backward handed
        one over; a missing gradient stays missing). Before a step's second micro-batch that was
        not planned (an OOM replay): under torch.compile(mode="reduce-overhead") a backward into empty
        gradients hands over tensors in the CUDA graphs' pool, which the next replay overwrites
        (torch's cudagraph trees). Buffers already owned are kept as they are."""
        self._own_gradients(copy=True)

    def _own_gradients(self, copy: bool) -> list[torch.Tensor]:
        """Replace each gradient not allocated here by an owned buffer (copy=True: a copy of it,
        none where there is none; copy=False: zeros) and return the owned gradients that were kept."""
        kept = []
        owned = self._owned_grads
        for i, p in enumerate(self._params):
            g = p.grad
            ref = owned[i]
            if g is not None and ref is not None and ref() is g:
                kept.append(g)
                continue
            if copy and g is None:
                continue
            new = g.detach().clone() if copy else torch.zeros_like(p)
            p.grad = new
            owned[i] = weakref.ref(new)   # weak: a step that sets them to None frees them
        return kept

    def _next_step_splits(self) -> bool:
        """The next step runs several micro-batches (accumulation or a noise-measurement split; under
        noise_split="steps" a noise step runs whole, at half the batch).

        Its gradients must then accumulate in buffers allocated here, outside any CUDA graph: a
        backward under torch.compile(mode="reduce-overhead") hands over gradients in the graphs'
        pool, which the next micro-batch's forward overwrites (torch's cudagraph trees). Zeroed
        buffers cost one foreach launch, on these steps only; the sums are the same."""
        return self.decision.accumulation > 1 or splits_for_noise(self.controller, self.step_count)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ValueError("add_param_group: the controller's layers are fixed at wrap(); add every param "
                         "group to the optimizer before wrapping it")

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Inner optimizer state + controller + loss scale + counters + pending statistics (the
        held noise measurements are fed to the controller first)."""
        self._feed_noise()
        n = len(self._rows)
        return {
            "optimizer": self.optimizer.state_dict(),
            "controller": self.controller.state_dict(),
            "loss_scaler": self.scaler.state_dict(),
            "step_count": self.step_count, "micro_count": self.micro_count,
            "skipped_steps": self.skipped_steps, "nonfinite_steps": self.nonfinite_steps,
            "pending_rows": list(self._rows),
            "pending_stats": self._buf[:n].detach().cpu().clone(),
            "curvature": None if self.curvature is None else self.curvature.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        sd = state_dict
        missing = {"optimizer", "controller", "loss_scaler", "step_count"} - set(sd)
        if missing:
            raise ValueError(f"state_dict: missing keys {sorted(missing)}; expected a TriAccelOptimizer state")
        self.optimizer.load_state_dict(sd["optimizer"])
        self.param_groups = self.optimizer.param_groups
        self.controller.load_state_dict(sd["controller"])
        self.scaler.load_state_dict(sd["loss_scaler"])
        self.step_count, self.micro_count = int(sd["step_count"]), int(sd["micro_count"])
        self.skipped_steps = int(sd.get("skipped_steps", 0))
        self.nonfinite_steps = int(sd.get("nonfinite_steps", 0))
        rows = [(int(s), int(f)) for s, f in sd.get("pending_rows", [])]  # older checkpoints: bool
        if len(rows) > self._buf.shape[0]:
            raise ValueError(f"state_dict: {len(rows)} pending statistics rows, buffer holds {self._buf.shape[0]}")
        self._rows = rows
        self._noise_reads = []   # held measurements of the trajectory the loaded state replaces
        self._found_ring.zero_()
        if rows:
            self._buf[: len(rows)].copy_(sd["pending_stats"].to(self._buf.device))
        if self.curvature is not None and sd.get("curvature") is not None:
            self.curvature.load_state_dict(sd["curvature"], self.device)
        self._apply(self.controller.decision)

    # -- reporting ---------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """Latest per-layer precision, LR scale, eigenvalues, variance EMA; batch; memory; loss scale.

        Current at read time: pending statistics are read first (one host sync), so
        `skipped_steps` and `nonfinite_steps` count every step taken so far (data parallel: as of the
        last boundary, since reading the ring there is a collective and this may run on one rank)."""
        if self.distributed is None:
            self._flush()
        rep = self.controller.report()
        for i, layer in enumerate(self.layers):
            entry = rep["layers"][layer.name]
            # the dtype the layer computes in: float64 layers keep theirs whatever the decision
            entry["dtype"] = "float64" if layer.is_float64 else str(torch_dtype(self.plan.precisions[i])).replace(
                "torch.", "")
            entry["eigvals"] = None if self.last_eigvals is None else [float(v) for v in self.last_eigvals[i]]
            entry["lr_multiplier"] = float(self.decision.lr_multipliers[i])
        rep.update({
            "optimizer_step": self.step_count, "skipped_steps": self.skipped_steps,
            "nonfinite_steps": self.nonfinite_steps,
            "loss_scale": self.scaler.scale if self.fp16_active else None,   # one host sync
            "autocast_dtype": self.plan.majority.short, "hooked_layers": list(self.plan.hooked),
            "memory": None if self.last_memory is None else self.last_memory.to_dict(),
        })
        return rep

    def __repr__(self) -> str:
        return (f"TriAccelOptimizer({type(self.optimizer).__name__}, layers={len(self.layers)}, "
                f"step={self.step_count}, batch={self.decision.batch_size})")


def wrap(optimizer: torch.optim.Optimizer, model: nn.Module, config: TriAccelConfig | None = None,
         **kwargs: Any) -> TriAccelOptimizer:
    """Wrap `optimizer` (over `model`'s parameters) with the Tri-Accel loop; see `TriAccelOptimizer`.

    kwargs: loss_fn (outputs, targets) -> scalar mean loss for curvature (default cross-entropy);
    curvature_data: an (inputs, targets) batch, or an iterable of them, used every t_curv steps
    (first b_curv samples); strict_norm: FP32 inputs/outputs for norm layers (extra hooks);
    loss_scaler: a LossScaler; hessian_iters / hessian_iters_cold / hessian_layers_per_event /
    hessian_pack: the Hessian estimator's options (see `CurvatureEstimator`);
    memory_probe: a MemoryProbe; host_check: check every step for non-finite gradients on the host
    (one sync per step) even when no layer is FP16 and the optimizer is not fused (see `step`);
    distributed: a `triaccel.backends.torch.distributed.Distributed` whose model (DDP or FSDP2) is
    `model`: the ranks' statistics are combined at each boundary, so all ranks decide alike.
    offload_options: with config.offload="auto", keyword arguments of
    `triaccel.backends.torch.offload.OffloadDriver` (units, min_bytes, bandwidth, repeats).
    """
    return TriAccelOptimizer(optimizer, model, config if config is not None else TriAccelConfig(), **kwargs)
