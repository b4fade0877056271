"""Memory-elastic data loading for JAX: bucketed batch sizes, sample masks, OOMs survived.

`ElasticLoader` serves micro-batches of any size the controller asks for, from NumPy arrays (host)
or JAX arrays (device-resident: gathering and `transform` run on the device). So that the number
of compiled shapes stays bounded, every micro-batch is padded up to the smallest of a small set of
`buckets` (by default the controller's `batch_buckets`) and comes with a 0/1 float32 `mask` of
the bucket's length: 1 for real samples, 0 for padding. **The loss must be mask-weighted**, e.g.
`jnp.sum(per_sample_loss * mask) / jnp.sum(mask)`; padded rows then contribute nothing to the loss,
so no sample is dropped or counted twice. Layers that pool over the batch (BatchNorm in training
mode) do see the padded rows, so these repeat the micro-batch's own samples cyclically
(`np.resize`): the batch statistics stay those of the real samples (exactly when the bucket is a
multiple of the count, else within one extra copy of some). Padding with copies of one sample
instead made an epoch's short last step (e.g. 80 real + 304 copies at bucket 384) normalise its
real samples with the statistics of a single image, a large spurious gradient step.

With ``pad_to_batch=True`` every micro-batch is padded at least to the bucket of the decided batch
(`elastic_step` passes the controller's batch size in force, after any OOM shrink): the
gradient-noise half batches and an epoch's short last step then run at the full step's shape, so
under `jax.jit` they need no compilation of their own (a half batch is padded with its own samples
once more). The padded rows cost compute: one short step per epoch and the noise steps' halves.

`elastic_step(loader, controller, grad_fn, step)` runs one optimizer step with out-of-memory
survival (`XlaRuntimeError`/`JaxRuntimeError` whose message contains RESOURCE_EXHAUSTED): the failed
samples are replayed at the controller's shrunken size and gradients are accumulated with weights
n_chunk / n_step, so they equal the gradient of the mean loss over the step's samples. At the
controller's gradient-noise steps (`Controller.is_noise_step`) the step runs as two halves and the
squared norms of their gradients go to the controller (`triaccel.noise.observe_split_step`).

`InFlight` lets `elastic_step` return while its step still runs on the device, so the host
prepares the next step meanwhile; an out-of-memory error, which JAX reports only when a result is
waited for, is then caught at the next call: the state is restored from before the step and its
samples replayed (see `InFlight`). With an `InFlight`, `elastic_step(..., step_fn=...)` runs such a
step (one micro-batch, no noise measurement) as one program, gradient and update together: on
several devices of one host a second program per step cost the steady step 0.88 -> 0.53-0.69 of
linear scaling (ResNet-18 at 1,024 per device, 4 H200s: `benchmarks/device/jax_dp_probe.py`).
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from triaccel.elastic import (
    ElasticIndexLoader,
    ElasticStepOutcome,
    ElasticStepReport,
    check_batch_size,
    controlled_step,
    memory_pair,
    noise_split,
    noise_take,
    run_elastic_step,
    step_weight,
)
from triaccel.batching import OOMAtMinimumBatch
from triaccel.noise import observe_split_step

from .sharding import check_divides, shard_indices, take

__all__ = ["ElasticLoader", "ElasticStepResult", "InFlight", "OOM_ERROR_TYPES", "elastic_step", "free_memory",
           "is_oom", "noise_step_compilations"]


def _oom_error_types() -> tuple[type[BaseException], ...]:
    """The runtime error classes this jax has (the name moved between releases; often aliases)."""
    found: list[type[BaseException]] = []
    cand = [getattr(jax.errors, "JaxRuntimeError", None)]
    try:
        from jax._src.lib import xla_client  # jax >= 0.4.x
        cand.append(getattr(xla_client, "XlaRuntimeError", None))
    except ImportError:
        pass
    try:
        from jaxlib import xla_extension  # type: ignore[attr-defined]  # older jaxlib
        cand.append(getattr(xla_extension, "XlaRuntimeError", None))
    except ImportError:
        pass
    for c in cand:
        if isinstance(c, type) and issubclass(c, BaseException) and c not in found:
            found.append(c)
    return tuple(found)


OOM_ERROR_TYPES: tuple[type[BaseException], ...] = _oom_error_types()


def is_oom(exc: BaseException) -> bool:
    """True for an XLA runtime error whose status is RESOURCE_EXHAUSTED (device out of memory)."""
    return isinstance(exc, OOM_ERROR_TYPES) and "RESOURCE_EXHAUSTED" in str(exc)


def free_memory() -> None:
    """Drop unreachable device buffers (those the failed step held); call outside an except block."""
    gc.collect()


def _check_buckets(buckets: Sequence[int] | None) -> tuple[int, ...] | None:
    if buckets is None:
        return None
    b = tuple(buckets)
    ok = len(b) > 0 and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x > 0 for x in b)
    if not ok or list(b) != sorted(set(b)):
        raise ValueError(f"buckets={b!r}: must be a non-empty strictly increasing tuple of positive ints")
    return tuple(int(x) for x in b)


@jax.jit
def _gather(x: jax.Array, idx: jax.Array) -> jax.Array:
    """The rows `idx` of `x` (as ``jnp.take(x, idx, axis=0)``, as one jit of this module's own, so
    that `ElasticLoader.gather_compilations` can compile it ahead)."""
    return jnp.take(x, idx, axis=0)


class ElasticLoader(ElasticIndexLoader):
    """Elastic loader over arrays sharing a leading sample axis, with bucket padding and a mask.

    arrays: one array, a tuple/list of arrays or a dict of arrays (NumPy: gathered on the host
      then `jax.device_put` to `device`; JAX arrays: gathered where they live). A micro-batch has
      the same structure, each leaf padded to the bucket size.
    batch_size: initial micro-batch size (samples); changed by `set_batch_size` / `apply(decision)`.
    buckets: allowed (padded) micro-batch sizes, strictly increasing; None = no padding (every
      distinct size is a new compiled shape). `elastic_step` takes the controller's
      `batch_buckets` when this is None.
    device: where a batch goes: a device, or a `NamedSharding` (`sharding.batch_sharding(mesh)`)
      that splits every micro-batch across devices (JAX arrays replicated on its mesh are gathered
      in place, each device its own samples); every bucket must then divide by the shards.
    transform(batch, key): optional, applied to the gathered, padded batch (e.g. augmentation and
      normalisation on the device). `key` is a PRNG key derived from (seed, epoch, first sample
      id of the micro-batch), so augmentation is deterministic and resumes exactly.
    pad_to_batch: `elastic_step` pads every micro-batch at least to the bucket of the decided
      batch size (module docstring); False: to the bucket of its own size.
    pad_floor: None, or pad every micro-batch at least to the bucket of this many samples, so that
      every smaller batch runs at one compiled shape (e.g. the largest bucket a batch ladder climbs
      to: no compilation per rung). The rows are the micro-batch's own samples again (module
      docstring: exact batch statistics when the bucket is a multiple of the count). It costs
      compute on smaller batches, and their memory is the floor's: `elastic_step` drops it (sets
      None, with a warning) when a micro-batch runs out of memory, before the replay.
    """

    def __init__(self, arrays: Any, *, batch_size: int, buckets: Sequence[int] | None = None,
                 seed: int = 0, shuffle: bool = True,
                 transform: Callable[[Any, jax.Array], Any] | None = None, device: Any = None,
                 pad_to_batch: bool = False, pad_floor: int | None = None) -> None:
        leaves = jax.tree_util.tree_leaves(arrays)
        if not leaves:
            raise ValueError("arrays: no arrays given")
        n = {int(np.shape(x)[0]) if np.ndim(x) > 0 else -1 for x in leaves}
        if len(n) != 1 or -1 in n:
            raise ValueError(f"arrays: all arrays need the same leading sample axis, got lengths {sorted(n)}")
        super().__init__(n.pop(), batch_size=batch_size, seed=seed, shuffle=shuffle)
        self.arrays = arrays
        self.buckets = _check_buckets(buckets)
        if self.buckets is not None and self.batch_size > self.buckets[-1]:
            raise ValueError(f"batch_size={self.batch_size}: exceeds the largest bucket {self.buckets[-1]}")
        if not isinstance(pad_to_batch, bool):
            raise ValueError(f"pad_to_batch={pad_to_batch!r}: allowed True or False")
        self.transform = transform
        self.device = device
        self.pad_to_batch = pad_to_batch
        self.pad_floor = None if pad_floor is None else check_batch_size("pad_floor", pad_floor)
        self._check_floor(self.buckets)
        self.seed = seed
        self.shapes_served: set[int] = set()   # padded micro-batch sizes handed out (compile count)
        self._masks: dict[tuple[int, int], jax.Array] = {}   # (samples, bucket) -> mask on `device`

    def set_buckets(self, buckets: Sequence[int] | None) -> None:
        buckets = _check_buckets(buckets)
        self._check_floor(buckets)
        self.buckets = buckets

    def _check_floor(self, buckets: tuple[int, ...] | None) -> None:
        if self.pad_floor is not None and buckets is not None and self.pad_floor > buckets[-1]:
            raise ValueError(f"pad_floor={self.pad_floor}: exceeds the largest bucket {buckets[-1]}; "
                             f"allowed None or [1, {buckets[-1]}]")

    def bucket_for(self, n: int) -> int:
        """The padded size of a micro-batch of n samples: the smallest bucket >= n (n without buckets)."""
        n = check_batch_size("n", n)
        if self.buckets is None:
            return n
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"micro-batch of n={n} samples exceeds the largest bucket {self.buckets[-1]} "
                         f"(buckets {self.buckets}); allowed [1, {self.buckets[-1]}]")

    def gather_compilations(self, sizes: Sequence[int]) -> list[tuple[str, Callable[[], Any]]]:
        """(name, thunk) pairs that compile the on-device gather of a micro-batch padded to each of
        `sizes`' buckets, for every device-resident array (none for host arrays or a sharded
        `device`, whose gathers are not this loader's jit). Run them on a background thread before
        the batch reaches those sizes (e.g. `SplitStep.compile_in_background`)."""
        from .compile_ahead import abstract

        if isinstance(self.device, jax.sharding.NamedSharding):
            return []
        leaves = [x for x in jax.tree_util.tree_leaves(self.arrays) if isinstance(x, jax.Array)]
        out: list[tuple[str, Callable[[], Any]]] = []
        for size in dict.fromkeys(self.bucket_for(max(int(n), self.pad_floor or 0)) for n in sizes):
            idx = jax.ShapeDtypeStruct((size,), jax.dtypes.canonicalize_dtype(np.int64))
            for i, x in enumerate(leaves):
                out.append((f"gather:{i}@{size}",
                            lambda x=abstract(x), idx=idx: _gather.lower(x, idx).compile()))
        return out

    def fetch(self, indices: np.ndarray, pad_to: int | None = None) -> tuple[Any, jax.Array]:
        """(batch, mask) for the samples `indices`: leaves padded to
        `bucket_for(max(len, pad_to, pad_floor))` (None counts as 0), mask (bucket,)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = int(idx.size)
        if pad_to is not None:
            pad_to = check_batch_size("pad_to", pad_to)
        size = self.bucket_for(max(n, pad_to or 0, self.pad_floor or 0))
        sharded = isinstance(self.device, jax.sharding.NamedSharding)   # batches split across devices
        if sharded:
            check_divides(size, self.device, f"micro-batch of {n} samples padded to bucket")
        padded = np.resize(idx, size)  # cyclic repeat: BatchNorm sees the real samples' statistics
        placed = None   # the indices on the device, uploaded once for every device-resident leaf

        def gather(x: Any) -> Any:
            nonlocal placed
            if not isinstance(x, jax.Array):
                return jax.device_put(np.take(np.asarray(x), padded, axis=0), self.device)
            if placed is None:
                placed = shard_indices(padded, self.device) if sharded else jnp.asarray(padded)
            return take(x, placed, self.device) if sharded else _gather(x, placed)
        batch = jax.tree_util.tree_map(gather, self.arrays)
        if self.transform is not None:
            key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(self.seed), self.epoch), int(idx[0]))
            batch = self.transform(batch, key)
        self.shapes_served.add(size)
        return batch, self._mask(n, size)

    def _mask(self, n: int, size: int) -> jax.Array:
        """(size,) float32 on `device`, 1 for the n real samples then 0 for the padding; kept per
        (n, size), as a step's upload costs host time (a run sees a few pairs: full buckets and each
        epoch's short last batch; the oldest goes past 64)."""
        key = (n, size)
        m = self._masks.get(key)
        if m is None or m.is_deleted():   # deleted: a step donated it
            host = np.zeros(size, dtype=np.float32)
            host[:n] = 1.0
            if m is None and len(self._masks) >= 64:
                self._masks.pop(next(iter(self._masks)))
            m = self._masks[key] = jax.device_put(host, self.device)
        return m


@dataclass
class ElasticStepResult(ElasticStepOutcome):
    """One elastic optimizer step: the common fields (`triaccel.elastic.ElasticStepOutcome`; apply
    its decision's lr_batch_scale to the LR) and grads: sample-weighted mean of the micro-batch
    gradients (the gradient of the mean loss over the step's samples); loss: the same weighted mean
    of the micro-batch losses (jax scalar); aux: the last micro-batch's aux (has_aux=True), else
    None; updated: update_fn's return value, else None."""

    grads: Any
    loss: jax.Array
    aux: Any
    updated: Any


def _sqnorms(leaves: list[jax.Array]) -> jax.Array:
    """float32 (T,) squared norm of each array."""
    return jnp.stack([jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves])


@jax.jit
def _noise_rows(micro: list[jax.Array], total: list[jax.Array], scale: jax.Array) -> jax.Array:
    """float32 ((k + 1) * T + 1,): the micro-batches' squared norms (k, T), the accumulated
    gradient's (T,) and the loss scale, flat, so that one transfer reads them all."""
    rows = jnp.stack([*micro, _sqnorms(total)])
    return jnp.concatenate([rows.reshape(-1), jnp.reshape(scale, (1,)).astype(jnp.float32)])


_micro_sqnorms = jax.jit(_sqnorms)
# A split step's gradient weighting and accumulation, one compilation per gradient tree (as eager
# per-leaf ops they compiled one executable per leaf shape, on the critical path); the same
# elementwise operations, so the same values.
@jax.jit
def _scale_tree(tree: Any, w: Any) -> Any:
    return jax.tree_util.tree_map(lambda g: g * w, tree)


@jax.jit
def _add_trees(a: Any, b: Any) -> Any:
    return jax.tree_util.tree_map(jnp.add, a, b)


@jax.jit
def _weighted_losses(outputs: tuple[Any, ...], weights: tuple[float, ...]) -> Any:
    """sum of weight x output over a split step's micro-batches, in order (the sum
    `ElasticStepReport.weighted_sum` forms; XLA may fuse a multiply and its add), as one program:
    eager, its multiplies and adds were compiled on the caller's thread at the first noise step
    (seconds on a GPU beside a background compilation)."""
    total = weights[0] * outputs[0]
    for w, o in zip(weights[1:], outputs[1:]):
        total = total + w * o
    return total


def _step_loss(report: ElasticStepReport[jax.Array]) -> jax.Array:
    """The step's sample-weighted loss: a single whole micro-batch's own output, else `_weighted_losses`."""
    if len(report.outputs) == 1 and report.weights[0] == 1.0:
        return jnp.asarray(report.outputs[0])
    return _weighted_losses(tuple(report.outputs), tuple(float(w) for w in report.weights))


def noise_step_compilations(grads_like: Any, loss_like: Any = None) -> list[tuple[str, Callable[[], Any]]]:
    """(name, thunk) pairs that compile what `elastic_step` runs at a gradient-noise step besides the
    user's functions (weighting, accumulation, squared norms, the rows read back, the two halves'
    loss weighting), for gradients shaped as `grads_like` (a pytree of arrays or
    `jax.ShapeDtypeStruct`s, placed as the step's gradients are) and a loss shaped as `loss_like`
    (None: a float32 scalar placed as the gradients). Run them on a background thread before the first noise step (e.g.
    `SplitStep.compile_in_background`): a later call with those shapes then finds them compiled
    (jax.jit's caches hold ahead-of-time compilations)."""
    from .compile_ahead import abstract

    grads = jax.tree_util.tree_map(abstract, grads_like)
    leaves = jax.tree_util.tree_leaves(grads)
    if not leaves:
        raise ValueError("grads_like: no arrays")
    sharding = getattr(leaves[0], "sharding", None)
    rows = jax.ShapeDtypeStruct((len(leaves),), jnp.float32, sharding=sharding)
    scale = jax.ShapeDtypeStruct((), jnp.float32, sharding=sharding)
    loss = scale if loss_like is None else abstract(loss_like)
    return [("noise:scale", lambda: _scale_tree.lower(grads, 0.5).compile()),
            ("noise:add", lambda: _add_trees.lower(grads, grads).compile()),
            ("noise:sqnorms", lambda: _micro_sqnorms.lower(leaves).compile()),
            ("noise:rows", lambda: _noise_rows.lower([rows, rows], leaves, scale).compile()),
            ("noise:loss", lambda: _weighted_losses.lower((loss, loss), (0.5, 0.5)).compile())]


def _tensor_layer_fn(tensor_layer: Any, controller: Any) -> Callable[[Any], np.ndarray]:
    """grads -> (T,) layer index per gradient leaf, from `elastic_step`'s tensor_layer argument."""
    if tensor_layer is None:
        n = len(getattr(controller, "layers", ()))
        if n != 1:
            raise ValueError(
                f"tensor_layer=None: the gradient noise measurement cannot map gradient leaves to the "
                f"controller's {n} layers; pass tensor_layer= (e.g. the TriAccel wrapper's `ta.layers`, a "
                "LayerMap, or a callable grads -> (T,) layer indices)")
        return lambda grads: np.zeros(len(jax.tree_util.tree_leaves(grads)), dtype=np.int64)
    if hasattr(tensor_layer, "tensor_layer_of"):
        return tensor_layer.tensor_layer_of
    if callable(tensor_layer):
        return lambda grads: np.asarray(tensor_layer(grads), dtype=np.int64)
    fixed = np.asarray(tensor_layer, dtype=np.int64)
    return lambda grads: fixed


class InFlight:
    """One optimizer step left running on the device while the host prepares the next.

    `elastic_step` waits for every micro-batch's results so that an out-of-memory error surfaces
    inside its retry loop: on jax 0.11 (GPU) such an error is raised when a result is waited for,
    not by the jitted call (benchmarks/device/jax_oom_probe.py). That wait serialises the host's
    per-step work with the device's step (the CIFAR demo's ResNet-18 at bs 384 on an H100,
    2026-11-24: 1.72-1.77 s per epoch with it, 1.12-1.27 s without; docs/results.md). With an `InFlight`, a step of one
    micro-batch is not waited for: the next `elastic_step` call waits for it once its own first
    micro-batch is queued behind it (so the device always has the next step), or `settle()` does.
    If it ran out of memory, the training state is restored from before it (`restore(snapshot)`),
    the controller shrinks the batch (`observe_oom`) and the step's samples run again at once as
    micro-batches of the new size, each waited for, through the same `grad_fn` and `update_fn`
    with the step's own decision; its `ElasticStepResult` then holds the replay's loss, grads,
    update result and micro-batch sizes, with the OOM counted. The step that found it runs its
    micro-batch again from the restored state, at the new size. Every sample is still trained
    once. Steps of several micro-batches (noise measurements, OOM retries) wait as before.

    With `elastic_step(..., quiet=...)` the replay runs inside `quiet()` (no background compilation
    beside it: an OOM beside XLA's autotuning may be transient) and first tries the step's own
    size, shrinking only if that fails again; without it the batch shrinks at once.
    snapshot(): the training state now (e.g. `SplitStep.snapshot`); restore(s): put it back. The
    step functions must not donate the state (its arrays from before a step must stay valid), and
    one more generation of it is alive while a step runs. Call `settle()` before anything reads the
    state or a step's results outside `elastic_step` (a control boundary, evaluation, reading the
    losses, a checkpoint): a failed step's outputs raise when read. `lagged_ooms`: OOMs found so.
    """

    def __init__(self, snapshot: Callable[[], Any], restore: Callable[[Any], None]) -> None:
        if not (callable(snapshot) and callable(restore)):
            raise ValueError("snapshot, restore: allowed two callables (e.g. SplitStep.snapshot, SplitStep.restore)")
        self.snapshot, self.restore = snapshot, restore
        self.lagged_ooms = 0
        self._pending: tuple[Any, Any, Callable[[], None]] | None = None   # (wait on, state before, replay)

    @property
    def pending(self) -> bool:
        """A step is running that no one has waited for yet."""
        return self._pending is not None

    def settle(self) -> bool:
        """Wait for the step in flight; after an out-of-memory error, restore the state from before
        it and replay its samples (waiting for each micro-batch): True then. Other errors propagate."""
        p, self._pending = self._pending, None
        if p is None:
            return False
        wait_on, before, replay = p
        try:
            jax.block_until_ready(wait_on)
        except Exception as e:  # XLA's runtime errors have no public OOM type: is_oom reads the status
            if not is_oom(e):
                raise
            del wait_on
            self.lagged_ooms += 1
            self.restore(before)
            replay()
            return True
        return False

    def _leave(self, wait_on: Any, before: Any, replay: Callable[[], None]) -> None:
        self._pending = (wait_on, before, replay)


def elastic_step(loader: ElasticLoader, controller: Any, grad_fn: Callable[[Any, jax.Array], Any],
                 step: int, *, has_aux: bool = False, probe: Any = None,
                 update_fn: Callable[[Any, Any], Any] | None = None, tensor_layer: Any = None,
                 grad_scale: Any = None, in_flight: InFlight | None = None,
                 quiet: Callable[[], Any] | None = None,
                 step_fn: Callable[[Any, jax.Array, Any], Any] | None = None,
                 noise_step_fn: Callable[[Any, jax.Array, Any, int], Any] | None = None) -> ElasticStepResult:
    """One optimizer step over the controller's logical batch, surviving out-of-memory errors.

    grad_fn(batch, mask) -> (loss, grads), or ((loss, aux), grads) with has_aux=True, as from
      `jax.value_and_grad` (jit it: shapes are bounded by the buckets). `loss` must be the
      mask-weighted mean over the real samples of the micro-batch (see the module docstring).
      Each micro-batch's results are waited for (`block_until_ready`) so that an OOM raised by
      asynchronous execution surfaces inside the retry loop.
    update_fn(grads, decision): optional; runs the optimizer update before the step's samples are
      marked as used (if it raises, they are put back). Its result is `ElasticStepResult.updated`.
    probe: optional memory probe (`triaccel.backends.jax.memory.MemoryProbe`, anything with
      `read()`, or a callable returning (used, limit)); read after the step for the controller.

    Gradient noise: when `controller.is_noise_step(step)`, the step runs as two micro-batches (its
    halves, or under the config's noise_split="double" two batches of the decided size, 2B samples,
    weighed as one step of 2B at B's LR; with noise_step_fn the same split inside its programs); the
    squared norms of each one's gradient contribution (as accumulated: x its weight) and of the
    accumulated gradient are computed per gradient leaf on the device and read with one host
    transfer (2 x 3 x n_leaves + 1 floats, every t_noise steps), then go to
    `controller.observe_gradient_noise` through `triaccel.noise.observe_split_step`. Other steps do
    no extra work. tensor_layer: maps gradient leaves to the controller's layers: a `LayerMap`
    (anything with `tensor_layer_of(grads)`, e.g. the TriAccel wrapper's `ta.layers`), a callable
    grads -> (T,) int array, or a (T,) int array; None only for a one-layer controller (else
    ValueError at a noise step). grad_scale: the loss scale the grads from grad_fn carry (FP16 loss
    scaling, e.g. `loss_scale(opt_state)` multiplied into the loss): a float, a 0-d array or a
    callable returning one, read at the end of the step (before update_fn); None = 1.
    in_flight: an `InFlight`: the step in flight before this one is settled once this step's first
    micro-batch is queued, and this step, if it runs as one micro-batch, is left running.
    quiet: optional context-manager factory (`SplitStep.quiet`): after an OOM, the rest of the step
    (its retries at the shrunken size, whose new shapes compile in place) runs inside it, with no
    background XLA compilation beside it: XLA's autotuning scratch comes from the pool the step
    allocates from (`memory.limit_device_memory`), so an OOM beside it may be transient.
    step_fn(batch, mask, decision, weight) -> loss (with has_aux: (loss, aux)): optional, grad_fn
    and update_fn of one micro-batch as one program (the same loss, the same state after it), the
    gradient times `weight` (a float: `triaccel.elastic.step_weight`, 1.0 but for a short step
    under config short_step_lr; the loss returned stays the mean). Steps through grad_fn get the
    weight on their summed gradients before update_fn (and in `ElasticStepResult.grads`). With
    `in_flight`, a step that runs as one micro-batch and measures no gradient noise (the common
    step) runs through it, and its result has grads None; the other steps, and a step replayed
    after an OOM, run through grad_fn and update_fn.
    noise_step_fn(batch, mask, decision, part, weight) -> loss (with has_aux: (loss, aux)): optional, needs
    `in_flight`: a gradient-noise step runs as two calls of it, its halves, part 1 then 2, each one
    program that leaves the measurement and the update to the optimizer state (the TriAccel
    wrapper's ``noise_in_update``: the halves' squared norms are read at the next control boundary,
    not here); the step is then left running as a fused one. After an OOM, or when the step in
    flight before it failed, the step runs through grad_fn and update_fn, measured here as above.
    """
    if in_flight is not None and update_fn is None:
        raise ValueError("in_flight: needs update_fn (a step replayed after a late OOM runs its update again)")
    for name, fn in (("step_fn", step_fn), ("noise_step_fn", noise_step_fn)):
        if fn is not None and in_flight is None:
            raise ValueError(f"{name}: needs in_flight (a fused step that fails is restored from its snapshot and "
                             "replayed through grad_fn and update_fn)")
    before = [in_flight.snapshot()] if in_flight is not None else None   # the state before this step
    cfg = getattr(controller, "config", None)
    cfg_buckets = getattr(cfg, "batch_buckets", None)
    if loader.buckets is None and cfg_buckets is not None:
        loader.set_buckets(cfg_buckets)
    elif loader.buckets is not None and cfg_buckets is not None and not set(cfg_buckets) <= set(loader.buckets):
        raise ValueError(f"buckets={loader.buckets}: the controller's batch_buckets {tuple(cfg_buckets)} "
                         "must all be loader buckets, or micro-batches get padded to a larger size")
    split = noise_split(controller, step)
    take = noise_take(controller, split)   # 2: a doubled noise step (noise_split="double"), halves of B
    measure = split > 1
    # the halves run inside the step's programs (noise_step_fn): the step is taken whole, halved there
    in_update = measure and noise_step_fn is not None
    halves: list[int] = []   # the halves' sizes once the step ran through noise_step_fn
    layer_of = _tensor_layer_fn(tensor_layer, controller) if measure else None
    acc: dict[str, Any] = {}
    sq: list[jax.Array] = []   # per successful micro-batch of a noise step: (T,) squared norms
    chunks: list[np.ndarray] = []
    wait = [in_flight is None]
    unwaited = [False]   # the step ran as one micro-batch nobody waited for: it is left in flight
    unmeasured = [False]   # a late OOM of the previous step re-ran part of this one: no noise reading
    marker: list[Any] = []   # an output of the step's update, waited for with its loss
    rerun = [0, 0]   # OOMs and replayed samples inside a micro-batch re-run after a late OOM
    fused = [False]   # the step ran as step_fn: its update is done

    def fetch(chunk: np.ndarray) -> tuple[Any, jax.Array]:
        # padded to the decision in force now: an OOM earlier in this step has shrunk it
        pad_to = getattr(getattr(controller, "decision", None), "batch_size", loader.batch_size) \
            if loader.pad_to_batch else None
        chunks.append(chunk)
        return loader.fetch(chunk, pad_to=pad_to)

    def queue(chunk: np.ndarray) -> tuple[Any, Any]:
        return grad_fn(*fetch(chunk))

    def absorb(out: Any, grads: Any, weight: float) -> jax.Array:
        loss, aux = out if has_aux else (out, None)
        if wait[0] or measure or weight != 1.0 or len(chunks) > 1:
            jax.block_until_ready((loss, grads))
        else:
            unwaited[0] = True
        # Skipped for a whole batch (weight 1), the common step.
        scaled = grads if weight == 1.0 else _scale_tree(grads, weight)
        acc["grads"] = scaled if "grads" not in acc else _add_trees(acc["grads"], scaled)
        acc["aux"] = aux
        if measure:
            sq.append(_micro_sqnorms(jax.tree_util.tree_leaves(scaled)))
        return loss

    # No closure of this step refers to itself (run_micro's re-run goes through queue/absorb): a
    # self-referencing closure is a reference cycle, and everything the step holds (its gradients,
    # the state before it) would then live until Python's cyclic collector ran, not until the
    # caller dropped the result: hundreds of MB per step on a GPU.
    def run_micro(chunk: np.ndarray, weight: float) -> jax.Array:
        # weight 1 and no chunk before: the micro-batch is the whole step
        whole = not wait[0] and weight == 1.0 and not chunks
        one = step_fn is not None and whole and not measure
        halved = in_update and whole and len(chunk) >= 2
        decision = getattr(controller, "decision", None)
        # the whole step in this chunk: its gradient weight goes into the step's program
        w = step_weight(controller, len(chunk), decision, take) if halved or one else 1.0
        if halved:   # the first half now (the step in flight before is settled behind it), the second below
            cut = -(-len(chunk) // 2)
            out, grads = noise_step_fn(*fetch(chunk[:cut]), decision, 1, w), None
        elif one:
            out, grads = step_fn(*fetch(chunk), decision, w), None
        else:
            out, grads = queue(chunk)
        if in_flight is not None and in_flight.settle():
            # the previous step ran out of memory and was replayed from the state before it; this
            # micro-batch was computed from the failed state: run it again, at the shrunk size
            # (a fused micro-batch's update ran from the failed state too: restored with it)
            del out, grads
            before[0] = in_flight.snapshot()
            wait[0] = unmeasured[0] = True
            again = run_elastic_step(chunk, micro_batch=controller.decision.batch_size,
                                     run_micro=lambda sub, w: absorb(*queue(sub), weight * w), is_oom=is_oom,
                                     on_oom=lambda: controller.observe_oom(step).batch_size,
                                     free_memory=free_and_unpad)
            rerun[0] += again.ooms   # OOMs of this re-run, counted with the step's own
            rerun[1] += again.replayed
            return _step_loss(again)
        if halved:
            last = noise_step_fn(*fetch(chunk[cut:]), decision, 2, w)
            halves[:] = [cut, len(chunk) - cut]
            fused[0] = unwaited[0] = True
            acc["aux"] = last[1] if has_aux else None
            losses = (out[0], last[0]) if has_aux else (out, last)
            return _weighted_losses(losses, (cut / len(chunk), 1.0 - cut / len(chunk)))
        if one:
            fused[0] = unwaited[0] = True
            acc["aux"] = out[1] if has_aux else None
            return out[0] if has_aux else out
        return absorb(out, grads, weight)

    def finish(decision: Any, report: ElasticStepReport[jax.Array]) -> ElasticStepResult:
        w = 1.0 if fused[0] else step_weight(controller, report.num_samples, decision, take)
        if w != 1.0:   # a short step (config short_step_lr): its gradient as applied, measured so too
            acc["grads"] = _scale_tree(acc["grads"], w)
            sq[:] = [s * (w * w) for s in sq]
        if measure and len(report.sizes) >= 2 and not unmeasured[0]:
            _observe_noise(controller, step, report, sq, acc["grads"], layer_of, grad_scale)
        # the state before the step's update: for step_fn's step, before the step (its one program)
        pre = jax.tree_util.tree_leaves(before[0] if fused[0] else in_flight.snapshot()) \
            if in_flight is not None else None
        updated = update_fn(acc["grads"], decision) if update_fn is not None and not fused[0] else None
        if pre is not None:
            # one output of the update's program stands for all of them (a failed program fails every
            # output); waiting on each of a few hundred state arrays cost the host per step
            post = jax.tree_util.tree_leaves(in_flight.snapshot())
            marker[:] = [b for a, b in zip(pre, post) if a is not b][-1:]
        return ElasticStepResult(grads=acc.get("grads"), loss=_step_loss(report),
                                 aux=acc.get("aux"), updated=updated,
                                 **ElasticStepOutcome.fields(report, decision, loader.epoch))

    def read_memory() -> tuple[int, int] | None:
        if probe is None:
            return None
        return memory_pair(probe.read() if hasattr(probe, "read") else probe())

    held = contextlib.ExitStack()   # `quiet`, entered at the step's first OOM, left at its end
    quieted = [False]

    def unpad_and_free() -> None:
        # the replay runs at the shrunken size, not at the floor that ran out of memory
        if loader.pad_floor is not None:
            warnings.warn(f"step {step}: out of memory with micro-batches padded to pad_floor="
                          f"{loader.pad_floor}; padding to the decided batch from now on", RuntimeWarning,
                          stacklevel=4)
            loader.pad_floor = None
        free_memory()

    def free_and_unpad() -> None:   # inside the step: its retries run in `quiet`
        if quiet is not None and not quieted[0]:
            held.enter_context(quiet())
            quieted[0] = True
        unpad_and_free()

    try:
        with held:
            result = controlled_step(loader, controller, step, run_micro=run_micro, finish=finish,
                                     is_oom=is_oom, free_memory=free_and_unpad, read_memory=read_memory,
                                     split=1 if in_update else split, take=take)
    except OOMAtMinimumBatch as e:
        if in_flight is not None or update_fn is None:
            raise
        # Nobody waited for the last update's program: had it run out of memory, the state holds its
        # failed outputs and every micro-batch computed from them fails, at any size.
        raise OOMAtMinimumBatch(f"{e} If an earlier step's update_fn ran out of memory (JAX reports it only when "
                                "a result is waited for), the state holds its failed outputs and no batch size "
                                "helps: pass in_flight=InFlight(snapshot, restore) to restore and replay such a "
                                "step, or leave the update more memory.") from e
    result.end_of_epoch = loader.end_of_epoch
    if halves and fused[0]:
        result.micro_sizes = list(halves)

    def count(ooms: int, replayed: int) -> None:   # outside controlled_step's own counting
        result.ooms += ooms
        result.replayed += replayed
        loader.stats["ooms"] += ooms
        loader.stats["replayed"] += replayed

    count(*rerun)
    if in_flight is not None and unwaited[0]:
        indices = chunks[0]

        def replay() -> None:
            # as an OOM inside the step: run the step's samples again, same decision; in `quiet` at
            # the step's own size first, else shrunk at once
            wait[0] = True
            fused[0] = False
            acc.clear()
            chunks.clear()
            unpad_and_free()
            with quiet() if quiet is not None else contextlib.nullcontext():
                size = len(indices) if quiet is not None else controller.observe_oom(step).batch_size
                report = run_elastic_step(indices, micro_batch=size, run_micro=run_micro, is_oom=is_oom,
                                          on_oom=lambda: controller.observe_oom(step).batch_size,
                                          free_memory=unpad_and_free)
            again = finish(result.decision, report)
            loader.apply(controller.decision)
            result.loss, result.micro_sizes = again.loss, again.micro_sizes
            for name in ("grads", "aux", "updated"):   # unless the caller dropped them (see the demo)
                if getattr(result, name) is not None:
                    setattr(result, name, getattr(again, name))
            count(1 + report.ooms, len(indices) + report.replayed)

        in_flight._leave((result.loss, marker), before[0], replay)
    return result


def _observe_noise(controller: Any, step: int, report: ElasticStepReport[jax.Array], sq: list[jax.Array],
                   grads: Any, layer_of: Callable[[Any], np.ndarray], grad_scale: Any) -> None:
    """The noise measurement of a split step: one device->host read, then the shared core."""
    scale = grad_scale() if callable(grad_scale) else grad_scale
    leaves = jax.tree_util.tree_leaves(grads)
    flat = np.asarray(_noise_rows(sq, leaves, jnp.asarray(1.0 if scale is None else scale, jnp.float32)),
                      dtype=np.float64)   # the one sync of a measured step
    rows = flat[:-1].reshape(len(sq) + 1, len(leaves))
    observe_split_step(controller, step, report.sizes, report.weights, rows, layer_of(grads), float(flat[-1]))
