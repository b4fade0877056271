"""Applying per-layer precisions to a torch model: one autocast region plus exception hooks.

Mechanism (chosen by measurement, see below): the forward runs inside ONE `torch.autocast` region
whose dtype is the precision most non-norm layers were given (the "majority"; FP32 majority = no
autocast). Only the layers whose decision differs from the majority get a forward pre-hook/hook
pair, which switches autocast to their own dtype (FP32: autocast disabled and floating inputs cast
to FP32) and restores the enclosing state after the module. With a uniform decision no hook is installed,
so the step costs exactly what AMP costs; hooks are (re)installed only when the decision changes.

Why not hooks everywhere: measured on this project's CPU machine (tests/benchmarks note), a
pre/post hook pair entering autocast costs ~30-50 us per hooked module per forward; ResNet-18 has
21 conv/linear + 20 norm layers, i.e. ~1 ms on a 7.7 ms overhead-bound GPU step (> 3%).
Autocast also caches each weight's 16-bit cast inside the region, so weights are cast once per
forward exactly as under AMP.

Norm layers (decided FP32 by the core) keep FP32 parameters and, under a 16-bit majority, run with
autocast's own norm policy (FP32 weights and FP32 statistics/accumulation, 16-bit activations in
and out), as AMP does. `strict_norm=True` instead hooks them too so that their inputs and outputs
are FP32 (costs one hook pair per norm layer, see above).

The hooks act only while `PrecisionPlan.region()` is active, so curvature passes and user code
outside `opt.autocast()` run in plain FP32.

torch.compile (default mode and CUDA graphs): dynamo inlines the hooks (autocast's setters trace
without a graph break), but it does not guard on a module's hook dictionaries
(`torch._dynamo.config.skip_nnmodule_hook_guards`, on by default): hooks added or removed after a
compilation are not noticed and the first compiled policy would keep running (checked here: a
layer switched to FP32 still computed in BF16). So when the plan is given the model's `root`, it
installs one permanent forward pre-hook there that branches on `PrecisionPlan.key`, a string naming
the autocast majority and every hooked layer's dtype; dynamo guards on that value, so each policy
compiles once and a policy seen before reuses its compiled graph. The hook costs one Python call per
eager forward (no autocast switch). `keys_seen` lists the policies applied so far: the compiled
variants of one input shape are at most `len(keys_seen)` (see `triaccel.backends.torch.compile`).

Float64 layers (any float64 parameter) keep float64 whatever the controller decides: torch's autocast
never casts float64 tensors (its eligibility test excludes them: float64 inputs of a linear or conv
stay float64 inside a bf16/fp16 region, checked on CPU), and the plan installs no hook on them and
leaves them out of the majority; their applied precision is recorded as FP32 (never lower). To let
such a layer compute in 16-bit, convert it to float32 master weights (`model.float()`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from triaccel.precision import Precision

from .layers import TorchLayer

__all__ = ["TORCH_DTYPES", "torch_dtype", "PrecisionPlan"]

TORCH_DTYPES: dict[Precision, torch.dtype] = {
    Precision.FP16: torch.float16, Precision.BF16: torch.bfloat16, Precision.FP32: torch.float32,
}


def torch_dtype(p: Any) -> torch.dtype:
    """torch dtype of a precision (anything `Precision.parse` takes)."""
    return TORCH_DTYPES[Precision.parse(p)]


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    """Cast floating-point tensors in (nested tuples/lists/dicts of) `obj` to `dtype`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple):
        return tuple(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, list):
        return [_cast_floats(o, dtype) for o in obj]
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj


class PrecisionPlan:
    """Holds the applied per-layer precisions of one model and the hooks that realise them.

    layers: the discovered layers (the controller's order); device_type: "cuda" | "cpu" | ...;
    strict_norm: hook norm layers to FP32 inputs/outputs (see the module docstring); root: the
    model the layers belong to; given, it carries the policy guard that makes the plan safe under
    torch.compile (module docstring). `key` names the policy in force, `keys_seen` every one applied.
    """

    def __init__(self, layers: Sequence[TorchLayer], device_type: str, *, strict_norm: bool = False,
                 root: nn.Module | None = None) -> None:
        self.layers = list(layers)
        self.device_type = device_type
        self.strict_norm = strict_norm
        self.precisions: tuple[Precision, ...] = ()
        self.majority: Precision = Precision.FP32
        self.hooked: tuple[str, ...] = ()
        self.key = ""
        self.keys_seen: dict[str, int] = {}   # policy key -> times applied (insertion order)
        self._handles: list[RemovableHandle] = []
        # One save stack per hook pair. The post-hooks are not `always_call`: dynamo guards on
        # the hook ids in a module's always-called set, which would recompile every re-installed
        # policy; a forward that raises leaves its saved state here, cleared when the region exits
        # (whose autocast exit restores the state the region was entered with).
        self._stacks: list[list[tuple[bool, torch.dtype]]] = []
        self._active = False
        self._guard: RemovableHandle | None = None
        if root is not None:
            if not isinstance(root, nn.Module):
                raise ValueError(f"root: expected a torch.nn.Module, got {type(root).__name__}")
            self._guard = root.register_forward_pre_hook(self._policy_guard)

    def _policy_guard(self, mod: nn.Module, args: Any) -> None:
        # Under dynamo this comparison installs an equality guard on `key` (a value that is only
        # read installs none), so a new policy recompiles and a known one reuses its graph.
        if self.key is None:
            raise RuntimeError("PrecisionPlan.key is None")

    # -- applying decisions -------------------------------------------------------------------
    def apply(self, precisions: Sequence[Any]) -> bool:
        """Install `precisions` (L,), anything `Precision.parse` takes; float64 layers are recorded
        as FP32 and left alone (module docstring). Returns True when the hooks or the majority changed."""
        if len(precisions) != len(self.layers):
            raise ValueError(f"precisions: expected {len(self.layers)} values (one per layer), got {len(precisions)}")
        precs = tuple(Precision.FP32 if layer.is_float64 else Precision.parse(p, f"precisions[{i}]")
                      for i, (p, layer) in enumerate(zip(precisions, self.layers)))
        if precs == self.precisions:
            return False
        compute = [p for p, layer in zip(precs, self.layers) if layer.spec.kind != "norm" and not layer.is_float64]
        if compute:
            counts = Counter(compute)
            # Most layers; ties go to the lower precision (cheaper region, fewer casts).
            majority = max(counts, key=lambda p: (counts[p], -int(p)))
        else:
            majority = Precision.FP32
        for h in self._handles:
            h.remove()
        self._handles, self._stacks = [], []
        hooked = []
        for p, layer in zip(precs, self.layers):
            if layer.is_float64:
                continue
            is_norm = layer.spec.kind == "norm"
            if is_norm and not (self.strict_norm and majority != Precision.FP32):
                continue  # norm layers follow autocast's norm policy (see module docstring)
            if not is_norm and p == majority:
                continue
            applied = Precision.FP32 if is_norm else p
            self._install(layer.module, applied, majority)
            hooked.append((layer.name, applied))
        self.precisions, self.majority, self.hooked = precs, majority, tuple(n for n, _ in hooked)
        self.key = "|".join([majority.short, *(f"{n}={p.short}" for n, p in hooked)])
        self.keys_seen[self.key] = self.keys_seen.get(self.key, 0) + 1
        return True

    def _install(self, module: nn.Module, prec: Precision, majority: Precision) -> None:
        dtype = torch_dtype(prec)
        dev = self.device_type
        # Per module: re-entrant for modules called several times. The hooks switch autocast's
        # state with its plain setters instead of entering a `torch.autocast` object: same effect
        # inside the region (the region's own exit clears the weight-cast cache) for a fraction of
        # the Python cost, which a launch-bound eager step pays per hooked module per forward.
        stack: list[tuple[bool, torch.dtype]] = []
        self._stacks.append(stack)
        outer_fp32 = majority == Precision.FP32
        is_enabled, get_dtype = torch.is_autocast_enabled, torch.get_autocast_dtype
        set_enabled, set_dtype = torch.set_autocast_enabled, torch.set_autocast_dtype

        if prec == Precision.FP32:
            def pre(mod: nn.Module, args: Any, kwargs: Any) -> Any:
                if not self._active:
                    return None
                stack.append((is_enabled(dev), get_dtype(dev)))
                set_enabled(dev, False)
                return _cast_floats(args, torch.float32), _cast_floats(kwargs, torch.float32)

            def post(mod: nn.Module, args: Any, kwargs: Any, out: Any) -> Any:
                if stack:
                    enabled, prev = stack.pop()
                    set_dtype(dev, prev)
                    set_enabled(dev, enabled)
                return None

            self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(post, with_kwargs=True))
            return

        def pre16(mod: nn.Module, args: Any) -> Any:
            if not self._active:
                return None
            stack.append((is_enabled(dev), get_dtype(dev)))
            set_dtype(dev, dtype)
            set_enabled(dev, True)
            return None

        def post16(mod: nn.Module, args: Any, out: Any) -> Any:
            if not stack:
                return None
            enabled, prev = stack.pop()
            set_dtype(dev, prev)
            set_enabled(dev, enabled)
            if outer_fp32:
                # Outside autocast the next module expects FP32 activations.
                return _cast_floats(out, torch.float32)
            return None

        self._handles.append(module.register_forward_pre_hook(pre16))
        self._handles.append(module.register_forward_hook(post16))

    def remove(self) -> None:
        """Remove every hook, the policy guard included (the model computes in FP32 outside autocast
        afterwards)."""
        for h in self._handles:
            h.remove()
        if self._guard is not None:
            self._guard.remove()
            self._guard = None
        self._handles, self._stacks = [], []
        self.precisions, self.hooked, self.key = (), (), ""

    # -- the region ---------------------------------------------------------------------------
    def region(self) -> "_Region":
        """Context manager for the forward pass: majority autocast + the exception hooks."""
        return _Region(self)


class _Region:
    def __init__(self, plan: PrecisionPlan) -> None:
        self.plan = plan
        self.ctx: torch.autocast | None = None
        self.prev_active = False

    def __enter__(self) -> "_Region":
        plan = self.plan
        if plan.majority == Precision.FP32:
            self.ctx = torch.autocast(plan.device_type, enabled=False)
        else:
            self.ctx = torch.autocast(plan.device_type, dtype=torch_dtype(plan.majority))
        self.ctx.__enter__()
        self.prev_active, plan._active = plan._active, True
        return self

    def __exit__(self, *exc: Any) -> None:
        self.plan._active = self.prev_active
        if exc[0] is not None:
            for stack in self.plan._stacks:   # states saved by pre-hooks whose module raised
                stack.clear()
        assert self.ctx is not None
        self.ctx.__exit__(*exc)


def iter_float_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Floating tensors in nested tuples/lists/dicts (helper for tests and reports)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from iter_float_tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from iter_float_tensors(o)
