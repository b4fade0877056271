"""Per-layer compute precision for Flax NNX models, and a compilation counter for the jitted step.

`precision_policy(model, decision)` sets each layer module's compute ``dtype`` (FP16/BF16/FP32) from
the controller's Decision; parameters stay FP32 (``param_dtype`` untouched: they are the master
weights the optimizer updates). In NNX ``dtype`` is a static attribute, so each distinct assignment
is a distinct graph: `nnx.jit` traces once per policy and reuses the compiled step when a policy
comes back. Decisions change only at control boundaries, so the number of traces is bounded by the
number of distinct policies (and batch sizes) seen — `CountingJit` counts them.

Linen modules are immutable, so `linen_precision(policy, layers)` applies a policy for the calls
made inside it (a `flax.linen.intercept_methods` interceptor that gives each layer's ``__call__``
its compute dtype): use it inside the jitted step with the policy as a static argument, so the step
is traced once per policy, as under NNX.

Float64 layers (a layer module owning a float64 parameter, e.g. ``param_dtype=jnp.float64`` under
``jax.enable_x64``) keep computing in float64 whatever the decision: both forms give them compute
``dtype`` float64 and `precision_policy` reports them as "fp32" (never lower). To let such a layer
compute in 16-bit, give it float32 parameters.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterable, Iterator, Mapping

import jax.numpy as jnp

from triaccel.precision import Precision

from .layers import LayerMap, layer_map_from_model

__all__ = ["DTYPES", "precision_policy", "applied_policy", "current_policy", "linen_precision", "policy_names", "CountingJit",
           "commit", "compiled_footprint", "counting_jit", "executable_footprint"]

DTYPES = {Precision.FP16: jnp.float16, Precision.BF16: jnp.bfloat16, Precision.FP32: jnp.float32}


def _modules_by_name(model: Any) -> dict[str, Any]:
    from flax import nnx

    return {".".join(str(p) for p in path): m for path, m in nnx.iter_modules(model)}


def _owns_float64(params: Iterable[Any]) -> bool:
    """True when any of a module's own parameters (arrays or NNX Params: anything with a dtype) is float64."""
    return any(jnp.dtype(v.dtype) == jnp.float64 for v in params if hasattr(v, "dtype"))


def precision_policy(model: Any, decision: Any, layers: LayerMap | None = None) -> tuple[str, ...]:
    """Set the compute dtype of every layer module of the NNX `model` from `decision`.

    decision: a core Decision (or any sequence of Precision/"bf16"-like values), one per layer in
    `layers.specs` order (default: `layer_map_from_model(model)`, the order the Controller uses).
    Returns the applied policy as a tuple of short names, e.g. ("bf16", "fp32", ...) — hashable,
    usable as a cache key; float64 layers compute in float64 and read "fp32". A layer module
    without a ``dtype`` attribute raises ValueError (its precision cannot be applied), as does a
    length mismatch.
    """
    from flax import nnx

    lm = layers if layers is not None else layer_map_from_model(model)
    names = list(_names_for(decision, lm, "decision"))
    mods = _modules_by_name(model)
    for i, spec in enumerate(lm.specs):
        mod = mods.get(spec.name)
        if mod is None:
            raise ValueError(f"layers: {spec.name!r} is not a module path of the model")
        if not hasattr(mod, "dtype"):
            raise ValueError(f"layer {spec.name!r} ({type(mod).__name__}) has no `dtype` attribute; "
                             "its compute precision cannot be set")
        if _owns_float64(v for v in vars(mod).values() if isinstance(v, nnx.Param)):
            want, names[i] = jnp.float64, Precision.FP32.short
        else:
            want = DTYPES[Precision.parse(names[i])]
        # Assign only on change: an identical assignment keeps the graph (and the jit cache key).
        if mod.dtype is None or jnp.dtype(mod.dtype) != jnp.dtype(want):
            mod.dtype = want
    return tuple(names)


def policy_names(decision: Any) -> tuple[str, ...]:
    """The per-layer precisions of a Decision (or a sequence of Precision / names) as short names:
    hashable, for a static jit argument."""
    return tuple(Precision.parse(p).short for p in getattr(decision, "precisions", decision))


def _names_for(policy: Any, layers: LayerMap, param: str) -> tuple[str, ...]:
    """`policy_names(policy)`, checked to hold one precision per layer of `layers`."""
    names = policy_names(policy)
    if len(names) != layers.num_layers:
        raise ValueError(f"{param}: {len(names)} precisions for {layers.num_layers} layers of the model")
    return names


@contextlib.contextmanager
def linen_precision(policy: Any, layers: LayerMap) -> Iterator[tuple[str, ...]]:
    """Within the block, each linen layer module of `layers` computes in its policy's dtype.

    policy: a Decision or a sequence of precisions in `layers.specs` order (`policy_names`).
    layers: the layer map of the linen parameters (`layer_map_from_params`); a layer is the module
    at that path (``"block.Dense_0"`` = path ("block", "Dense_0")). Parameters stay FP32. A layer
    module without a ``dtype`` attribute raises ValueError when it is called; a float64 layer computes
    in float64 (module docstring). Yields the policy's short names.
    """
    import flax.linen as nn

    names = _names_for(policy, layers, "policy")
    want = {spec.name: DTYPES[Precision.parse(n)] for spec, n in zip(layers.specs, names)}

    def interceptor(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        mod = context.module
        name = ".".join(str(p) for p in getattr(mod, "path", ()))
        if context.method_name != "__call__" or name not in want:
            return next_fun(*args, **kwargs)
        if not hasattr(mod, "dtype"):
            raise ValueError(f"layer {name!r} ({type(mod).__name__}) has no `dtype` attribute; its compute "
                             "precision cannot be set")
        # The bound module is this apply's own clone: setting its dtype for the call changes no
        # other call (linen dataclasses are frozen, hence object.__setattr__).
        own = mod.variables.get("params", {}).values()  # its own leaves, and submodules' dicts
        old = mod.dtype
        object.__setattr__(mod, "dtype", jnp.float64 if _owns_float64(own) else want[name])
        try:
            return next_fun(*args, **kwargs)
        finally:
            object.__setattr__(mod, "dtype", old)

    with nn.intercept_methods(interceptor):
        yield names


@contextlib.contextmanager
def applied_policy(model: Any, policy: Any, layers: LayerMap | None = None) -> Iterator[tuple[str, ...]]:
    """Within the block, the NNX `model` computes under `policy` (`precision_policy`); after it, each
    layer module gets back its exact previous ``dtype`` (None included), so the model's graph
    definition is the one before the block. Yields the policy's short names."""
    lm = layers if layers is not None else layer_map_from_model(model)
    mods = _modules_by_name(model)
    saved = [(mods[s.name], getattr(mods[s.name], "dtype", None)) for s in lm.specs if s.name in mods]
    try:
        yield precision_policy(model, policy, lm)
    finally:
        for mod, dtype in saved:
            if mod.dtype is not dtype:
                mod.dtype = dtype


def current_policy(model: Any, layers: LayerMap | None = None) -> tuple[str, ...]:
    """The compute precision of every layer now ("fp32" for dtype None: Flax then infers from inputs
    and FP32 parameters)."""
    lm = layers if layers is not None else layer_map_from_model(model)
    mods = _modules_by_name(model)
    names = {jnp.dtype(v): Precision(k).short for k, v in DTYPES.items()}
    out = []
    for spec in lm.specs:
        dt = getattr(mods[spec.name], "dtype", None)
        out.append("fp32" if dt is None else names.get(jnp.dtype(dt), str(jnp.dtype(dt))))
    return tuple(out)


def commit(tree: Any) -> Any:
    """`tree` with every uncommitted JAX array committed to the device it is on. A jitted step's
    outputs are committed as soon as one input is (data placed with `jax.device_put(x, device)`),
    and an input whose placement changes between calls makes the step compile again: commit a
    state before its first call."""
    import jax

    return jax.tree_util.tree_map(
        lambda a: jax.device_put(a, a.sharding) if isinstance(a, jax.Array) and not a.committed else a, tree)


def compiled_footprint(jitted: Any, *args: Any, **kwargs: Any) -> int | None:
    """Bytes a call of `jitted` (a `jax.jit` / `nnx.jit` function) with these arguments needs beyond
    them, from XLA's compiled memory analysis: temporaries + outputs - outputs aliased to donated
    inputs. Lowering and compiling are cache hits after a call with the same shapes and the same
    input placements; where an input's placement differs (an uncommitted array where the call had
    a committed one, as after an `nnx.jit` call that replaced the objects' arrays with its outputs)
    the step is lowered and compiled once more. None where the platform or version offers no
    analysis (callers then fall back to allocator counters)."""
    try:
        compiled = jitted.lower(*args, **kwargs).compile()
    except Exception:  # no lowering for these arguments on this platform/version
        return None
    return executable_footprint(compiled)


def executable_footprint(compiled: Any) -> int | None:
    """Bytes one run of a compiled executable (`jax.stages.Compiled`) needs beyond its arguments:
    temporaries + outputs - outputs aliased to donated inputs (XLA's memory analysis); None where
    the platform offers no analysis."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # no analysis on this platform/version
        return None
    if stats is None:
        return None
    return int(stats.temp_size_in_bytes) + max(int(stats.output_size_in_bytes) - int(stats.alias_size_in_bytes), 0)


class CountingJit:
    """`nnx.jit` (or `jax.jit`) of `fn` that counts its traces (= compilations of new variants)
    and records each variant's device-memory footprint.

    A trace happens for every new static configuration: a new precision policy (module dtypes),
    a new batch shape, a new train/eval mode. ``traces`` is the total; `report()` a short dict.

    ``footprints`` maps a micro-batch size to the bytes one call needs on top of its arguments,
    from XLA's compiled memory analysis: temporaries + outputs - outputs aliased to donated inputs
    (the largest over the variants compiled at that size). The micro-batch is the leading axis of
    the first positional array argument (None when there is none: such a footprint holds for every
    batch). Read once per new variant, where the lowering and compilation are cache hits if the
    inputs keep their placement across calls (`commit` the initial model and optimizer state, as
    the CIFAR demo does; see `compiled_footprint`); XLA has no resettable peak, so this
    is how the memory probe sees a step's peak before it happens.
    """

    def __init__(self, fn: Callable[..., Any], *, use_nnx: bool = True, **jit_kwargs: Any) -> None:
        self.traces = 0
        self.fn = fn
        self.footprints: dict[int | None, int] = {}
        # Traces may run on a background compiler's thread (`compile`): the counter is locked and
        # the footprint analysis' own lowering is excluded per thread.
        self._local = threading.local()
        self._lock = threading.Lock()

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if not getattr(self._local, "analysing", False):
                with self._lock:
                    self.traces += 1  # runs only while tracing: a compiled call never executes Python
            return fn(*args, **kwargs)

        if use_nnx:
            from flax import nnx

            self._jitted = nnx.jit(counted, **jit_kwargs)
        else:
            import jax

            self._jitted = jax.jit(counted, **jit_kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        before = self.traces
        out = self._jitted(*args, **kwargs)
        if self.traces != before:
            self._record_footprint(args, kwargs)
        return out

    def _record_footprint(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._local.analysing = True
        try:
            fp = compiled_footprint(self._jitted, *args, **kwargs)
        finally:
            self._local.analysing = False
        self._store_footprint(args, fp)

    def _store_footprint(self, args: tuple[Any, ...], fp: int | None) -> None:
        if fp is None:
            return
        key = next((int(a.shape[0]) for a in args if hasattr(a, "shape") and hasattr(a, "dtype")
                    and len(a.shape) > 0), None)
        with self._lock:
            self.footprints[key] = max(fp, self.footprints.get(key, 0))

    def compile(self, *args: Any, compiler_options: Mapping[str, Any] | None = None,
                after_lowering: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Lower and compile the variant for `args` (arrays, or `jax.ShapeDtypeStruct`s for a call
        not made yet) and return the executable (`jax.stages.Compiled`): calling it runs the
        variant with no trace and no compilation. Its trace is counted as a call's, its footprint
        recorded (class docstring). after_lowering: called between lowering and XLA's compilation
        (which releases the GIL: a background thread's tracing then costs this one nothing).
        Thread-safe: a background compiler may call it."""
        lowered = self._jitted.lower(*args, **kwargs)
        if after_lowering is not None:
            after_lowering()
        compiled = lowered.compile(dict(compiler_options)) if compiler_options else lowered.compile()
        self._store_footprint(args, executable_footprint(compiled))
        return compiled

    def footprint(self, batch: int) -> int | None:
        """Bytes a call at micro-batch `batch` needs beyond its arguments (see the class docstring),
        or None when no variant at that size (nor a batch-free one) has been compiled yet."""
        known = [self.footprints[k] for k in (batch, None) if k in self.footprints]
        return max(known) if known else None

    def report(self) -> Mapping[str, Any]:
        return {"traces": self.traces, "footprints": dict(self.footprints)}


def counting_jit(fn: Callable[..., Any] | None = None, **jit_kwargs: Any) -> Any:
    """Decorator form of CountingJit: ``@counting_jit`` or ``@counting_jit(donate_argnums=...)``."""
    if fn is None:
        return lambda f: CountingJit(f, **jit_kwargs)
    return CountingJit(fn, **jit_kwargs)
