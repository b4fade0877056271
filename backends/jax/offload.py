"""A swap plan of :mod:`triaccel.swap_plan` as `jax.checkpoint` policies over a sequential model.

```python
units = [block0, block1, ...]                 # fn(params_i, x) -> x, in forward order
seq = PlannedSequential(units)
table = seq.measure(params, x)                # CostTable: residual bytes, fwd/bwd times, host bandwidth
plan = plan_for_budget(CostModel((table,)).at(256), budget, actions=PlannedSequential.ACTIONS)
f = seq.apply(plan)                           # f(params, x) -> y; jit/grad it as usual
```

Per unit: "keep" is the function as is; "recompute" is `jax.checkpoint(fn, policy=nothing_saveable)`
(only its inputs stay); "swap" is `jax.checkpoint(fn, policy=save_and_offload_only_these_names(
[], [its name], offload_src="device", offload_dst="pinned_host"))`: the activations the unit tags
with `tag(x)` (a `jax.ad_checkpoint.checkpoint_name` with the unit's name) live in pinned host
memory between forward and backward, XLA schedules the copies, and untagged intermediates of that
unit are recomputed (tag the inputs of its convolutions/matmuls; elementwise results are cheap).
`apply` returns the same function object for the same plan, so a `jax.jit` of it compiles once
per plan. "recompute_swap" (inputs of a recomputed unit in host memory) has no mapping here: a
checkpoint's inputs are residuals of the enclosing computation, which a policy of the unit does
not reach, and a `jax.custom_vjp` with its input placed in `jax.memory.Space.Host` held far more
than recomputing (ResNet-152, bs 184, H100: 17.8 GiB compiled, 31.6 GiB with an optimization
barrier in its backward, against 10.8 GiB for recompute everywhere; docs/results.md). Plan with
`actions=PlannedSequential.ACTIONS`. On the GPU "swap" is not yet what the model assumes either:
a ResNet-152 plan (bs 136) with two swapped units compiled to 23.74 GiB against 7.92 GiB modelled,
while keep/recompute plans compiled 0.25-0.32 GiB above it (H100, docs/results.md); plan with
`actions=("keep", "recompute")` where the budget must hold.
"""

from __future__ import annotations

import contextvars
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from triaccel.swap_plan import ACTIONS, CostTable, LayerCost, SwapPlan

__all__ = ["PlannedSequential", "measure_bandwidth", "tag", "unit_name", "unit_policy"]

_UNIT: contextvars.ContextVar[str | None] = contextvars.ContextVar("triaccel_offload_unit", default=None)


def unit_name(i: int) -> str:
    """The checkpoint name of unit `i`'s tagged activations."""
    return f"triaccel_unit{i}"


def tag(x: Any) -> Any:
    """Mark `x` (an array or pytree) as an activation of the unit being traced: offloaded when the
    unit swaps. Outside a PlannedSequential unit it is the identity."""
    name = _UNIT.get()
    if name is None:
        return x
    return jax.tree_util.tree_map(lambda a: checkpoint_name(a, name), x)


def unit_policy(action: str, i: int) -> Callable[..., Any] | None:
    """The `jax.checkpoint` policy of unit `i` under `action` (None: no checkpoint, "keep")."""
    if action not in PlannedSequential.ACTIONS:
        raise ValueError(f"action={action!r} is invalid: allowed one of {PlannedSequential.ACTIONS} (plan with "
                         "plan_for_budget(..., actions=PlannedSequential.ACTIONS))")
    if action == "keep":
        return None
    if action == "recompute":
        return jax.checkpoint_policies.nothing_saveable
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[unit_name(i)],
        offload_src="device", offload_dst="pinned_host")


def measure_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 3, device: Any = None) -> tuple[float, float]:
    """(device->pinned host, pinned host->device) copy bandwidth in bytes/s, best of `repeats`."""
    if nbytes < 4 or repeats < 1:
        raise ValueError(f"nbytes={nbytes!r}, repeats={repeats!r} are invalid: allowed nbytes >= 4, repeats >= 1")
    dev = device or jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    on_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    a = jax.device_put(jnp.zeros(nbytes // 4, jnp.float32), on_dev).block_until_ready()

    def best(fn: Callable[[], Any]) -> float:
        fn().block_until_ready()
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn().block_until_ready()
            out.append(time.perf_counter() - t0)
        return max(min(out), 1e-9)

    h = jax.device_put(a, host).block_until_ready()
    d2h = best(lambda: jax.device_put(a, host))
    h2d = best(lambda: jax.device_put(h, on_dev))
    return (nbytes // 4) * 4 / d2h, (nbytes // 4) * 4 / h2d


class PlannedSequential:
    """A model as units applied in sequence, `x <- units[i](params[i], x)`, under a swap plan.

    units: callables fn(params_i, x) -> x (their activations tagged with `tag`); names: unit names
    for plans and tables (default "unit<i>").
    """

    ACTIONS = tuple(a for a in ACTIONS if a != "recompute_swap")  # the actions this backend applies

    def __init__(self, units: Sequence[Callable[[Any, Any], Any]], names: Sequence[str] | None = None) -> None:
        self.units = tuple(units)
        if not self.units or not all(callable(u) for u in self.units):
            raise ValueError("units: allowed a non-empty sequence of callables fn(params, x) -> x")
        self.names = tuple(names) if names is not None else tuple(f"unit{i}" for i in range(len(self.units)))
        if len(self.names) != len(self.units):
            raise ValueError(f"names={self.names!r} is invalid: allowed {len(self.units)} names")
        self._cache: dict[tuple[str, ...], Callable[[Sequence[Any], Any], Any]] = {}

    def _actions(self, plan: SwapPlan | Sequence[str] | None) -> tuple[str, ...]:
        if plan is None:
            return ("keep",) * len(self.units)
        if isinstance(plan, SwapPlan):
            if plan.names != self.names:
                raise ValueError(f"plan names units {plan.names}, this model has {self.names}")
            return tuple(plan.actions)
        acts = tuple(plan)
        if len(acts) != len(self.units) or any(a not in self.ACTIONS for a in acts):
            raise ValueError(f"plan={acts!r} is invalid: allowed {len(self.units)} actions from {self.ACTIONS}")
        return acts

    def _unit(self, i: int, action: str) -> Callable[[Any, Any], Any]:
        fn, name = self.units[i], unit_name(i)

        def traced(p: Any, x: Any) -> Any:
            token = _UNIT.set(name)
            try:
                return fn(p, x)
            finally:
                _UNIT.reset(token)

        policy = unit_policy(action, i)
        return traced if policy is None else jax.checkpoint(traced, policy=policy)

    def apply(self, plan: SwapPlan | Sequence[str] | None = None) -> Callable[[Sequence[Any], Any], Any]:
        """f(params, x) -> y under `plan` (None: no plan); the same object for the same plan."""
        acts = self._actions(plan)
        if acts not in self._cache:
            wrapped = [self._unit(i, a) for i, a in enumerate(acts)]

            def forward(params: Sequence[Any], x: Any) -> Any:
                if len(params) != len(wrapped):
                    raise ValueError(f"params: {len(params)} entries, allowed one per unit ({len(wrapped)})")
                for f, p in zip(wrapped, params):
                    x = f(p, x)
                return x
            self._cache[acts] = forward
        return self._cache[acts]

    @property
    def plans_built(self) -> int:
        """Distinct plans turned into functions (each is one compilation under jit)."""
        return len(self._cache)

    def measure(self, params: Sequence[Any], x: Any, repeats: int = 3,
                bandwidth: tuple[float, float] | None = None) -> CostTable:
        """The cost table at x's leading dimension: per unit, the bytes of its vjp residuals that
        are not its arguments (saved_bytes), its input bytes, and the median times of its jitted
        forward and backward; bandwidth (d2h, h2d) bytes/s from `measure_bandwidth` when None.
        static_bytes / transient_bytes are 0 (XLA plans its own buffers; read peaks with
        `device.memory_stats()`)."""
        if not (isinstance(repeats, int) and repeats >= 1):
            raise ValueError(f"repeats={repeats!r} is invalid: allowed an integer >= 1")
        batch = int(jax.tree_util.tree_leaves(x)[0].shape[0])
        layers = []
        for i, (fn, p) in enumerate(zip(self.units, params)):
            unit = self._unit(i, "keep")
            out, vjp = jax.vjp(unit, p, x)
            args = {id(a) for a in jax.tree_util.tree_leaves((p, x))}
            saved = sum(r.nbytes for r in jax.tree_util.tree_leaves(vjp) if id(r) not in args)
            inp = sum(a.nbytes for a in jax.tree_util.tree_leaves(x))
            fwd = jax.jit(unit)
            bwd = jax.jit(lambda p_, x_, g_: jax.vjp(unit, p_, x_)[1](g_))
            g = jax.tree_util.tree_map(jnp.ones_like, out)
            t_fwd = _median_ms(lambda: fwd(p, x), repeats)
            t_both = _median_ms(lambda: bwd(p, x, g), repeats)  # a jitted vjp reruns the forward
            layers.append(LayerCost(self.names[i], int(saved), t_fwd, max(t_both - t_fwd, 0.0), input_bytes=int(inp)))
            x = out
        d2h, h2d = bandwidth if bandwidth is not None else measure_bandwidth()
        return CostTable(batch, tuple(layers), d2h, h2d)


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    jax.block_until_ready(fn())  # compile
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)
