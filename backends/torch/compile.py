"""torch.compile for models trained under `wrap`: a bounded number of compiled variants.

```python
opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True), model, config)
cmodel = compile_model(model, opt, mode="reduce-overhead")   # or mode=None (default), backend=...
for x, y in loader:
    with opt.autocast():
        loss = F.cross_entropy(cmodel(x), y)
    opt.backward(loss)
    opt.step(); opt.zero_grad()
```

What is compiled: the model's forward (and, through AOT autograd, its backward). The loss, the
loss scaling, the statistics kernel and the inner optimizer step run eagerly, outside the compiled
region; the step only reads and writes parameters and gradients in place, which CUDA graphs allow.

Variants (compilations of the forward), bounded by what the run visits:

- precision policy: `PrecisionPlan.key` (the autocast majority and each hooked layer's dtype) is
  guarded, so each policy compiles once and a policy seen again reuses its graph. A plain
  `torch.compile(model)` of a wrapped model gets the same guard (the plan's root pre-hook), but
  dynamo may hand it a graph traced for another instance of the model's class compiled in the same
  process, hooks ignored (`PolicyGuarded`); `compile_model` rules that out. The number of
  distinct policies is bounded by design: the controller changes precisions only at precision
  decisions (every `t_precision` steps), at curvature steps and when a curvature promotion expires,
  so a run of S steps visits at most 1 + S / t_precision policies without curvature (+ 2 per
  curvature event with it), and `TriAccelConfig.precision_groups = G` caps them at 2^G under the
  evidence law (3^G under the variance law) whatever the run's length; `opt.plan.keys_seen` lists
  them. Policies that differ only in norm or float64 layers share a key (those layers' computation
  does not change).
- batch: `dynamic_batch=True` (default) marks dim 0 of every tensor input dynamic, so one graph per
  policy serves every batch size (the elastic buckets, the half batches of noise-measurement steps,
  an epoch's short last batch); a batch of one sample specialises once more (dynamo specialises
  sizes 0 and 1). `dynamic_batch=False` compiles once per (input shape, policy) pair instead, with
  kernels specialised to the shape. `static_batches=(...)` (e.g. the config's `batch_buckets`)
  compiles once per listed batch size and policy visited, specialised, and runs any other size (an
  epoch's short last batch, a half batch off the list) eagerly on the uncompiled module
  (`BatchDispatch`): the specialised kernels without a compilation per odd size. Measured on an
  H100 (2026-11-24, `benchmarks/compiled.py`, ResNet-18 CIFAR bs 384, CUDA graphs, one run per
  setting): 5.86 ms per step specialised (0.502x that run's eager step) against 7.83 ms (0.632x)
  with the batch dim dynamic. Under CUDA graphs each batch size is
  also one graph recording (no compilation: a replay-time capture), whichever setting.

So the forward compiles at most (policies visited) x (batch shapes visited) times: a recompilation
happens only for a (shape, policy) pair no compiled variant covers. With `dynamic_batch=True` that is
typically once per policy, but inductor may add size-range guards while it lowers the graph (checked
on CPU: ResNet-18 compiled at batch 32 guarded 17 <= batch <= 64 and recompiled for 16), so a far
batch bucket can cost one more. Eval mode and
no-grad calls are variants of their own: evaluate with the uncompiled model (`uncompiled(cmodel)`)
to keep them out. dynamo's `recompile_limit` (8 by default; past it dynamo runs the forward
eagerly, with a warning) is raised to `max_variants`.

CUDA graphs (`mode="reduce-overhead"`): a compiled backward's outputs live in the graphs' memory
pool and are overwritten when the next iteration's forward replays. The wrapper keeps gradients in
ordinary memory whenever a step spans several micro-batches (accumulation, noise-measurement splits:
`TriAccelOptimizer.zero_grad`), so no `torch.compiler.cudagraph_mark_step_begin()` call is needed in
a loop that runs forward, backward and `step()` in order; curvature passes run eagerly on the
uncompiled module (`torch.compiler.set_stance("force_eager")`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from .distributed import unwrap_parallel

__all__ = ["COMPILE_MODES", "BatchDispatch", "PolicyGuarded", "compile_model", "uncompiled", "mark_batch_dynamic"]

COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


class PolicyGuarded(nn.Module):
    """`module` behind its precision plan's policy guard: what `compile_model` compiles for a model
    trained under `wrap`.

    dynamo keeps one cache per code object, and every `torch.compile(module)` compiles the same
    `nn.Module` call code: a graph traced for another instance of the same class (e.g. a plain AMP
    copy of the model) passes the guards of a wrapped instance, whose hooks dynamo does not guard
    on, and would run without its precision hooks (checked here: an FP32 output layer ran in BF16).
    This class's own type is guarded, so the wrapped model's graphs stay apart, and its forward
    branches on `plan.key`, so each policy gets its own graph."""

    def __init__(self, module: nn.Module, plan: Any) -> None:
        super().__init__()
        self.module = module
        self.plan = plan

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.plan.key is None:   # the branch is the guard (see PrecisionPlan._policy_guard)
            raise RuntimeError("PrecisionPlan.key is None")
        return self.module(*args, **kwargs)


class BatchDispatch(nn.Module):
    """Calls whose batch size (dim 0 of the first tensor argument) is one of `sizes` run `compiled`
    (graphs specialised to each size); other calls run `module`, the uncompiled model, eagerly.

    `module` is the registered submodule (parameters, buffers, train/eval modes: the model's own);
    `compiled` compiles that same module, so both see one set of weights."""

    def __init__(self, compiled: nn.Module, module: nn.Module, sizes: frozenset[int]) -> None:
        super().__init__()
        self.module = module
        object.__setattr__(self, "compiled", compiled)   # not a submodule: its parameters are module's
        self.sizes = sizes

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        batch = next((a.shape[0] for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() > 0),
                     None)
        return (self.compiled if batch in self.sizes else self.module)(*args, **kwargs)


def uncompiled(model: nn.Module) -> nn.Module:
    """The module under `BatchDispatch`, `torch.compile(module)` (`OptimizedModule`) and
    `PolicyGuarded` wrappers, else `model` itself."""
    if isinstance(model, BatchDispatch):
        model = model.module
    inner = getattr(model, "_orig_mod", None)
    if isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule":
        model = inner
    return model.module if isinstance(model, PolicyGuarded) else model


def mark_batch_dynamic(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Forward pre-hook (on the compiled wrapper, so it runs before dynamo sees the call): dim 0 of
    every tensor argument with at least one dim may vary without a recompilation."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(a, 0)


def compile_model(model: nn.Module, optimizer: Any = None, *, mode: str | None = None,
                  backend: str | Callable[..., Any] = "inductor", dynamic_batch: bool | None = None,
                  static_batches: Sequence[int] | None = None, max_variants: int = 32,
                  **compile_kwargs: Any) -> nn.Module:
    """`torch.compile(model)` set up for training under `wrap` (or a plain loop; see module docstring).

    model: the module (or an already `torch.compile`d one: its module is compiled afresh).
    optimizer: the `TriAccelOptimizer` that wraps `model` (None for a plain loop); it must have been
      built on this very module (or on the `DistributedDataParallel` around it, whose inner module
      `Distributed.training_module()` gives), whose policy guard then keeps the compiled graphs in
      step with the precision decisions.
    mode: torch.compile's mode, one of COMPILE_MODES ("default" = None); "reduce-overhead" uses CUDA
      graphs. backend: torch.compile's backend ("inductor"; "eager"/"aot_eager" for tests).
    dynamic_batch: one graph for every batch size (True; the default without static_batches, except
      with backend="cudagraphs", which needs static shapes) or one per shape (False).
    static_batches: batch sizes (ints >= 1) that each get a graph specialised to them; calls at any
      other size run the uncompiled model eagerly (`BatchDispatch`). Not with dynamic_batch=True.
    max_variants: compiled variants allowed per compiled model (>= 1); dynamo's recompile_limit is
      raised to it (never lowered).
    compile_kwargs: passed to torch.compile (e.g. fullgraph=True, options=...).
    Returns the compiled module (parameters, buffers and hooks shared with `model`; `uncompiled`
    gives `model` back); with an optimizer it compiles `PolicyGuarded(model, optimizer.plan)`; with
    static_batches, a `BatchDispatch` around the compiled module.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"mode={mode!r}: allowed {list(COMPILE_MODES)}")
    if isinstance(max_variants, bool) or not isinstance(max_variants, int) or max_variants < 1:
        raise ValueError(f"max_variants={max_variants!r}: allowed integers >= 1")
    if dynamic_batch is not None and not isinstance(dynamic_batch, bool):
        raise ValueError(f"dynamic_batch={dynamic_batch!r}: allowed True, False or None")
    sizes = None
    if static_batches is not None:
        try:
            sizes = frozenset(static_batches)
        except TypeError:
            sizes = frozenset()
        ints = all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in sizes)
        if isinstance(static_batches, (str, bytes)) or not sizes or not ints:
            raise ValueError(f"static_batches={static_batches!r}: allowed a non-empty collection of ints >= 1")
        if dynamic_batch:
            raise ValueError("dynamic_batch=True with static_batches: the listed sizes are compiled specialised, "
                             "other sizes run eagerly; leave dynamic_batch unset or False")
    if backend == "cudagraphs" and dynamic_batch:
        # its CUDA graph trees replay a recording made at one batch size for another (pytorch#131009)
        raise ValueError("dynamic_batch=True with backend='cudagraphs': that backend needs static shapes; "
                         "leave dynamic_batch unset (one graph per shape) or pass static_batches")
    dynamic_batch = sizes is None and backend != "cudagraphs" if dynamic_batch is None else dynamic_batch
    if mode not in (None, "default") and backend != "inductor":
        raise ValueError(f"mode={mode!r}: only with backend='inductor' (got {backend!r})")
    if "dynamic" in compile_kwargs:
        raise ValueError("dynamic: set through dynamic_batch (True marks dim 0 of the inputs dynamic)")
    base = uncompiled(model)
    if not isinstance(base, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None:
        plan = getattr(optimizer, "plan", None)
        wrapped = getattr(optimizer, "model", None)
        # data parallel: the optimizer wraps the DDP module, the forward runs its inner module
        if plan is None or wrapped is None or unwrap_parallel(wrapped) is not base:
            raise ValueError("optimizer: expected the TriAccelOptimizer that wraps this model "
                             "(wrap(inner, model, ...) with the same module, or with the DDP module around it)")
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(int(cfg.recompile_limit), max_variants)
    target = base if optimizer is None else PolicyGuarded(base, optimizer.plan)
    compiled = torch.compile(target, mode=None if mode == "default" else mode, backend=backend,
                             dynamic=None if dynamic_batch else False, **compile_kwargs)
    if dynamic_batch:
        # a hook on the wrapper runs eagerly before the compiled call (hooks of `base` are traced)
        compiled.register_forward_pre_hook(mark_batch_dynamic, with_kwargs=True)
    return compiled if sizes is None else BatchDispatch(compiled, base, sizes)
