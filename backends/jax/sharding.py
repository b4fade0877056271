"""Data parallelism over several devices with `jax.sharding`: one set of decisions for all of them.

A `jax.sharding.Mesh` with a data axis (`data_mesh`): every micro-batch is split along its leading
axis across the data axis (`batch_sharding`), parameters and optimizer state are replicated
(`replicated`). The train step stays one `jax.jit` program (SPMD): XLA inserts the all-reduces, so
inside the step the gradients, the wrapper's moments and non-finite flags, BatchNorm's batch
statistics and the gradient-noise norms are those of the *global* batch (jit's results do not
depend on how its inputs are sharded). The host reads them from a replicated array, and the
controller decides exactly as on one device fed the same global batch: per-device batch =
global / number of data shards.

```python
mesh = data_mesh()                                   # all devices (or data_mesh(2), data_mesh([d0, d1]))
ta = TriAccel(config, model, loss_fn=..., mesh=mesh) # checks that every batch bucket divides
opt = nnx.Optimizer(model, ta.wrap(optax.sgd(0.1)), wrt=nnx.Param)
step = SplitStep(train_step, model, opt, ta=ta)      # the mesh comes from ta: state replicated
loader = ElasticLoader(replicate((x, y), mesh), batch_size=..., device=batch_sharding(mesh))
```

Several hosts: call `jax.distributed.initialize()` first in every process; `data_mesh()` then spans
every process's devices, each process runs the same program on the same global indices (same seed),
and the memory reading is reduced across processes (`MeshMemoryProbe`). Tested on one host only.

`per_device_value_and_grad` is the other choice, torch DDP's: each device runs the forward and
backward pass on its own part of the batch (BatchNorm's batch statistics are then the device's) and
only the gradients and the running statistics cross devices, once per step; global statistics cost
one all-reduce per BatchNorm layer in each pass (76 in the 2-device ResNet-18 step's HLO on the CPU).
It is the torch backend's semantics, not a speed-up: two H200s trained at the same rate with either
(docs/results.md, 2026-11-24).

A batch size must divide by the number of data shards: `check_config` (the elastic batch's buckets,
reusing `triaccel.distributed.check_world_divides`) and `check_divides` (one batch) raise ValueError.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from triaccel.distributed import check_world_divides, tightest_memory

from .memory import MemoryProbe, MemorySample

__all__ = ["DATA_AXIS", "MeshMemoryProbe", "batch_sharding", "check_config", "check_divides", "data_axis",
           "data_mesh", "num_shards", "on_every_device", "per_device_value_and_grad", "replicate", "replicated",
           "shard_batch", "shard_indices", "take"]

DATA_AXIS = "data"


def data_mesh(devices: int | Sequence[Any] | None = None, *, axis: str = DATA_AXIS) -> Mesh:
    """A one-axis mesh named `axis` for data parallelism.

    devices: None -> every device (`jax.devices()`: this host's on one host, all processes' after
    `jax.distributed.initialize`); an int N -> the first N of them (1 <= N <= available); or a
    sequence of distinct `jax.Device`s. The axis type is Auto (sharding propagated by XLA), whatever
    the JAX default, so a jitted step needs no sharding annotations inside."""
    if not isinstance(axis, str) or not axis:
        raise ValueError(f"axis={axis!r}: must be a non-empty string")
    every = jax.devices()
    if devices is None:
        devs = list(every)
    elif isinstance(devices, (int, np.integer)) and not isinstance(devices, bool):
        if not 1 <= int(devices) <= len(every):
            raise ValueError(f"devices={devices}: allowed [1, {len(every)}] (the devices JAX sees: {every})")
        devs = list(every[: int(devices)])
    else:
        devs = list(devices)
        if not devs or not all(isinstance(d, jax.Device) for d in devs):
            raise ValueError(f"devices={devices!r}: expected None, an int or a non-empty sequence of jax.Device")
        if len({id(d) for d in devs}) != len(devs):
            raise ValueError(f"devices={devices!r}: a device appears more than once")
    auto = (jax.sharding.AxisType.Auto,) if hasattr(jax.sharding, "AxisType") else None
    kw = {} if auto is None else {"axis_types": auto}
    return Mesh(np.array(devs, dtype=object), (axis,), **kw)


def data_axis(mesh: Mesh) -> str:
    """The mesh's data axis: the one named "data", else the only axis; ValueError otherwise."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh={mesh!r}: expected a jax.sharding.Mesh")
    names = tuple(mesh.axis_names)
    if DATA_AXIS in names:
        return DATA_AXIS
    if len(names) == 1:
        return str(names[0])
    raise ValueError(f"mesh: axes {names}; name the data-parallel axis {DATA_AXIS!r} (or use a one-axis mesh)")


def num_shards(mesh: Mesh) -> int:
    """How many parts a batch is split into: the size of the mesh's data axis."""
    return int(mesh.shape[data_axis(mesh)])


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (sample) axis split across the data axis, the rest whole (and replicated across any
    other mesh axis)."""
    return NamedSharding(mesh, PartitionSpec(data_axis(mesh)))


def replicated(mesh: Mesh) -> NamedSharding:
    """A whole copy on every device of the mesh."""
    return NamedSharding(mesh, PartitionSpec())


def _shards_of(target: Mesh | NamedSharding) -> tuple[int, NamedSharding]:
    if isinstance(target, Mesh):
        return num_shards(target), batch_sharding(target)
    if isinstance(target, NamedSharding):
        spec = tuple(target.spec)
        axes = spec[0] if spec and spec[0] is not None else ()
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        return int(np.prod([target.mesh.shape[a] for a in axes], dtype=np.int64)), target
    raise ValueError(f"sharding={target!r}: expected a jax.sharding.Mesh or NamedSharding")


def check_divides(batch: int, target: Mesh | NamedSharding, name: str = "batch") -> int:
    """Samples per data shard of a `batch` of samples split by `target` (a mesh: its data axis, or a
    NamedSharding: the axes of its leading dimension); ValueError naming `name` when it does not
    divide."""
    n, _ = _shards_of(target)
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ValueError(f"{name}={batch!r}: must be an integer >= 1")
    if batch % n:
        raise ValueError(f"{name}={batch}: must be a multiple of the {n} data shards (devices) it is split "
                         f"across; choose batch sizes / batch_buckets that divide by {n}")
    return int(batch) // n


def check_config(config: Any, mesh: Mesh) -> None:
    """ValueError unless every micro-batch the controller and the elastic loader can produce splits
    evenly across the mesh's data shards: with more than one shard, `batch_buckets` must be set
    (an epoch's short last step and the gradient-noise half batches are padded up to a bucket) and,
    as on torch ranks, `batch_init` and every bucket must divide (`check_world_divides`)."""
    n = num_shards(mesh)
    if n > 1 and config.batch_buckets is None:
        raise ValueError(f"batch_buckets=None: with {n} data shards every micro-batch is padded to a bucket so "
                         f"that it splits evenly (an epoch's last step need not divide); give batch_buckets "
                         f"whose sizes are multiples of {n}")
    check_world_divides(config, n)


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Every array leaf of `tree` (JAX or NumPy) as a whole copy on each device of `mesh`; other
    leaves unchanged."""
    s = replicated(mesh)
    return jax.tree_util.tree_map(
        lambda a: jax.device_put(a, s) if isinstance(a, (jax.Array, np.ndarray, np.generic)) else a, tree)


def shard_batch(tree: Any, mesh: Mesh) -> Any:
    """Every array leaf of `tree` split along its leading (sample) axis across the data shards;
    ValueError when a leaf has no leading axis or its length does not divide."""
    s = batch_sharding(mesh)

    def put(a: Any) -> Any:
        if np.ndim(a) == 0:
            raise ValueError(f"tree: a leaf of shape {np.shape(a)} has no sample axis to split")
        check_divides(int(np.shape(a)[0]), mesh, "batch")
        return jax.device_put(a, s)

    return jax.tree_util.tree_map(put, tree)


def _shard_map() -> Any:
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # jax < 0.6
        from jax.experimental.shard_map import shard_map
    return shard_map


def _unchecked() -> dict[str, bool]:
    return {"check_vma": False} if hasattr(jax, "shard_map") else {"check_rep": False}


def per_device_value_and_grad(fn: Callable[..., tuple[jax.Array, jax.Array]], mesh: Mesh
                              ) -> Callable[..., tuple[jax.Array, Any]]:
    """Data parallel as torch's DistributedDataParallel does it, for use inside a jitted step: every
    device of `mesh` runs `fn` on its own part of the batch (so BatchNorm normalises by the device's
    batch statistics, not the global batch's), then one all-reduce sums the gradients and one
    averages the model's other floating state (BatchNorm's running statistics).

    fn(model, *shard) -> (loss_sum, weight): the sum of the per-sample losses of the device's
    samples (padding masked out) and their number, scalars. Returns
    ``call(model, *batch, scale=None) -> (loss, grads)`` with loss = sum over devices of loss_sum /
    sum of weight, and grads = `nnx.State` of d(scale x loss)/d(nnx.Param) (scale: e.g. a loss
    scale; None: 1), replicated; the model's non-parameter state is updated in place. `batch`
    leaves are split along their leading axis over the mesh's data axis (`batch_sharding`); the
    model is replicated. On one device it equals `nnx.value_and_grad` of the loss."""
    from flax import nnx

    if not callable(fn):
        raise ValueError(f"fn={fn!r}: expected a callable fn(model, *shard) -> (loss_sum, weight)")
    axis = data_axis(mesh)
    shard = PartitionSpec(axis)

    def call(model: Any, *batch: Any, scale: Any = None) -> tuple[jax.Array, Any]:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        factor = jnp.ones((), jnp.float32) if scale is None else jnp.asarray(scale, jnp.float32)

        def local(params: Any, rest: Any, factor: jax.Array, *part: Any) -> tuple[jax.Array, Any, Any]:
            m = nnx.merge(graphdef, params, rest)

            def lf(m: Any) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
                out = fn(m, *part)
                if not (isinstance(out, (tuple, list)) and len(out) == 2
                        and all(jnp.shape(v) == () for v in out)):
                    raise ValueError("fn: must return (loss_sum, weight), two scalars (the sum of the device's "
                                     f"per-sample losses and their number); got {jax.tree_util.tree_map(jnp.shape, out)}")
                total, weight = out
                return total * factor, (total, weight)

            (_, (total, weight)), grads = nnx.value_and_grad(lf, has_aux=True)(m)
            weight = jax.lax.psum(weight, axis)
            loss = jax.lax.psum(total, axis) / jnp.maximum(weight, 1.0)
            grads = jax.tree_util.tree_map(lambda g: jax.lax.psum(g, axis) / jnp.maximum(weight, 1.0), grads)
            # running statistics moved by each device's own batch: their mean keeps the copies equal
            new_rest = jax.tree_util.tree_map(
                lambda v: jax.lax.pmean(v, axis) if jnp.issubdtype(v.dtype, jnp.floating) else v,
                nnx.state(m, nnx.Not(nnx.Param)))
            return loss, grads, new_rest

        rep = PartitionSpec()
        mapped = _shard_map()(local, mesh=mesh, in_specs=(rep, rep, rep) + (shard,) * len(batch),
                              out_specs=(rep, rep, rep), **_unchecked())
        loss, grads, new_rest = mapped(params, rest, factor, *batch)
        nnx.update(model, new_rest)
        return loss, grads

    return call


def on_every_device(fn: Callable[..., Any], mesh: Mesh) -> Callable[..., Any]:
    """`fn` run by every device of `mesh` on its whole copy of its (replicated) arguments, inside a
    jitted function: a `jax.shard_map` whose specs are all replicated. For custom calls that XLA's
    automatic partitioning cannot split (jax-triton kernels: their maintainers' route is shard_map);
    the results must be equal on every device (they are returned as replicated, unchecked).
    Keyword arguments are passed through as arrays."""
    def call(*args: Any, **kwargs: Any) -> Any:
        names = sorted(kwargs)

        def inner(*flat: Any) -> Any:
            return fn(*flat[:len(args)], **dict(zip(names, flat[len(args):])))

        mapped = _shard_map()(inner, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec(),
                              **_unchecked())
        return mapped(*args, *(kwargs[k] for k in names))

    return call


@functools.lru_cache(maxsize=None)
def _take_fn(sharding: NamedSharding) -> Any:
    # Sharded indices into a replicated array: each device gathers its own samples, no transfer.
    return jax.jit(lambda x, i: jnp.take(x, i, axis=0), out_shardings=sharding)


def shard_indices(indices: np.ndarray | Sequence[int], sharding: NamedSharding) -> jax.Array:
    """int32 `indices` placed on `sharding`'s devices, each its own part (for `take`). ValueError
    when their number does not divide by the shards."""
    idx = np.asarray(indices, dtype=np.int32).reshape(-1)
    check_divides(int(idx.size), sharding, "batch")
    return jax.device_put(idx, sharding)


def take(x: jax.Array, indices: np.ndarray | Sequence[int] | jax.Array, sharding: NamedSharding) -> jax.Array:
    """``x[indices]`` along axis 0, the result split by `sharding` (`batch_sharding(mesh)`): x should
    be replicated on the same mesh (`replicate`). `indices` on the host, or already placed by
    `shard_indices` (one upload for several arrays). ValueError when the number of indices does not
    divide by the shards."""
    i = indices if isinstance(indices, jax.Array) else shard_indices(indices, sharding)
    return _take_fn(sharding)(x, i)


class MeshMemoryProbe:
    """`MemoryProbe` over the devices of a mesh: each reading is the tightest device's (the highest
    used / min(limit, budget), `triaccel.distributed.tightest_memory`), so the memory lever is
    bounded by the fullest device. With several processes the readings of every process are
    gathered (one small collective per control boundary) so that all take the same decision.

    mesh: the mesh; budget: the config's memory_budget in bytes (None: none). Readings, `stats()`
    and None on platforms without allocator statistics as `MemoryProbe`."""

    def __init__(self, mesh: Mesh, budget: int | None = None) -> None:
        me = jax.process_index()
        self.devices = [d for d in mesh.devices.flat if d.process_index == me]
        self.probes = [MemoryProbe(d) for d in self.devices]
        self.device = self.devices[0]
        self.budget = budget
        self.device_index: int | None = None   # which device (of this process) the last reading came from

    def stats(self) -> dict[str, int] | None:
        """The allocator statistics of the local device with the most bytes in use (None: none)."""
        found = [s for p in self.probes if (s := p.stats()) and "bytes_in_use" in s]
        return max(found, key=lambda s: int(s["bytes_in_use"])) if found else None

    def read(self, batch: int | None = None, footprint: int | None = None) -> MemorySample | None:
        samples = [p.read(batch=batch, footprint=footprint) for p in self.probes]
        r, _ = tightest_memory([None if s is None else (s.used, s.limit) for s in samples], self.budget)
        self.device_index = r
        mine = None if r is None else samples[r]
        if jax.process_count() == 1:
            return mine
        from jax.experimental import multihost_utils

        row = np.array([-1, -1, -1] if mine is None else [mine.used, mine.in_use, mine.limit], dtype=np.int64)
        rows = np.asarray(multihost_utils.process_allgather(row)).reshape(-1, 3)
        p, _ = tightest_memory([None if u < 0 else (int(u), int(lim)) for u, _, lim in rows], self.budget)
        if p is None:
            return None
        used, in_use, limit = (int(v) for v in rows[p])
        return MemorySample(used=used, in_use=in_use, limit=limit, source=mine.source if mine else "memory_stats")
