"""Adaptive local learning in JAX/Flax NNX (NeuroFlux-style), the twin of
:mod:`triaccel.backends.torch.local`: the same plan (:mod:`triaccel.local_plan`), the same schedule
(:func:`triaccel.local_plan.block_runs`), the same head initialisation, on the Flax models of
:mod:`triaccel.backends.jax.models` (NHWC).

Schedule: block b trains for its epochs against its own head, on inputs no gradient crosses; it is then
frozen and its outputs over the training set's fixed views are computed once and cached on the device
(a JAX array) or on the host (a NumPy array), as the plan says, so a trained block never runs forward
again while later blocks train. Block 0 reads freshly augmented images; epoch e of block b > 0 reads
view e mod cache_views. Each block steps through :func:`triaccel.backends.jax.data.elastic_step` with
its own controller (fixed logical batch; an out-of-memory error shrinks the micro-batch, replays the
same samples and accumulates gradients), with optax SGD (decoupled into weight decay + a momentum trace,
which is torch's SGD update) under ``optax.apply_if_finite``: a step with non-finite gradients is skipped
on the device, and the host checks the counters now and then (:class:`triaccel.local_plan.NonFinitePolicy`,
as the torch twin: skipped steps restore the BatchNorm statistics of the last clean check; a block that
keeps producing them raises ``NonFiniteTraining``; an OOM at a micro-batch of 1, ``BlockOutOfMemory``).

Every step is a ``jax.jit`` over the split state of an NNX graph (``nnx.split`` once per block; the
graph definition is a static argument, so equal structures share compilations), not ``nnx.jit``,
whose per-call graph walk costs the host more than a small step. Micro-batches come padded to the
block's micro-batch ladder with a mask (the loss is mask-weighted), so a block compiles one step per
size it uses. Full-batch steps run up to `steps_per_call` at a time as one compiled program (a ``lax.scan``
over the steps, `LocalTrainer._fused_call`): the elastic step waits for every step's results (so an
out-of-memory error surfaces inside its retry loop) before the host queues the next, so at these
small steps the host's work adds to every step (H100, issue 18: 7.3 ms per block step at batch 64); a
fused call waits once. An epoch's short last batch, and every step after a fused call runs out of memory, take
the elastic path. The torch twin's counterpart is its CUDA graph. A block's programs compile when it
first runs them: compiling block b+1's on a background thread while block b trained or compiled made
both compilations 3-11x slower on an H100 (jax 0.11, issue 18, 2026-11-24: block 0's first epoch 101 s
against 16 s), with no block epoch long enough to hide them.

Pieces: :func:`sequential_units`, :func:`measure_layers` (the per-unit table from XLA's compiled memory
analysis), :class:`AuxHead`, :class:`LocalTrainer` (train, evaluate every exit, export a prefix + head
as an :class:`ExitModel`).
"""

from __future__ import annotations

import time
import warnings
from functools import lru_cache, partial
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from triaccel import Controller, OOMAtMinimumBatch
from triaccel.layout import check_canonical
from triaccel.local_plan import (BlockCurvature, BlockOutOfMemory, BlockRecord, BlockRun, LayerMemory, LocalPlan,
                                 NonFinitePolicy, block_runs, check_views, halving_on_oom, head_init)
from triaccel.precision import Precision

from .curvature import FisherTopK, nnx_loss
from .data import ElasticLoader, elastic_step, free_memory, is_oom
from .layers import layer_map_from_model
from .models import BatchNorm2d, EfficientNet, ResNet, _canonical_entries, _conv, _linear

__all__ = ["AuxHead", "Classifier", "ExitModel", "LocalTrainer", "BlockRecord", "measure_layers",
           "sequential_units", "set_compute_dtype"]


# -- modules ---------------------------------------------------------------------------------------

def _pool_matrix(size: int, out: int) -> np.ndarray:
    """(out, size) averaging weights of torch's adaptive average pooling along one axis (window i:
    [floor(i*size/out), ceil((i+1)*size/out)))."""
    m = np.zeros((out, size), np.float32)
    for i in range(out):
        lo, hi = (i * size) // out, -((-(i + 1) * size) // out)
        m[i, lo:hi] = 1.0 / (hi - lo)
    return m


def adaptive_avg_pool(x: jax.Array, out_hw: tuple[int, int]) -> jax.Array:
    """torch's ``adaptive_avg_pool2d`` on (N, H, W, C) -> (N, out_h, out_w, C)."""
    ph = jnp.asarray(_pool_matrix(x.shape[1], out_hw[0]), x.dtype)
    pw = jnp.asarray(_pool_matrix(x.shape[2], out_hw[1]), x.dtype)
    return jnp.einsum("nhwc,ih,jw->nijc", x, ph, pw)


class Classifier(nnx.Module):
    """A model's own classifier: global average pool -> [dropout] -> ``fc`` (shared with the model)."""

    def __init__(self, fc: nnx.Linear, dropout: nnx.Dropout | None = None) -> None:
        self.fc = fc
        self.dropout = nnx.data(dropout)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jnp.mean(x, axis=(1, 2))
        if self.dropout is not None:
            x = self.dropout(x)
        return self.fc(x)


class AuxHead(nnx.Module):
    """Auxiliary classifier on a (N, H, W, C) map; the layout `triaccel.local_plan.head_cost` models and
    the torch twin's module paths (``body.0`` conv, ``body.1`` BatchNorm, ``fc``).

    width 0: global pool -> linear(C, num_classes). width w: adaptive average pool to at most
    pool x pool -> conv3x3(C, w) -> BatchNorm -> ReLU -> global pool -> linear(w, num_classes).
    Weights: `load_canonical` (the trainer loads `triaccel.local_plan.head_init`); built directly, the
    conv and linear take the models' initialisers. dtype: compute dtype of the conv and the linear.
    """

    def __init__(self, in_channels: int, width: int, num_classes: int, pool: int = 4, *, dtype: Any = None,
                 rngs: nnx.Rngs | None = None) -> None:
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.pool = int(pool)
        self.body: nnx.List | None = nnx.data(None)
        if width > 0:
            conv = _conv(in_channels, width, 3, rngs)
            conv.dtype = dtype
            self.body = nnx.List([conv, BatchNorm2d(width, rngs=rngs)])
        self.fc = _linear(width if width > 0 else in_channels, num_classes, rngs)
        self.fc.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.body is not None:
            h, w = x.shape[1:3]
            if h > self.pool or w > self.pool:
                x = adaptive_avg_pool(x, (min(h, self.pool), min(w, self.pool)))
            x = jax.nn.relu(self.body[1](self.body[0](x)))
        return self.fc(jnp.mean(x, axis=(1, 2)))

    def _entries(self) -> list[tuple[str, Any, Any, Any]]:
        layers = [("body.0", self.body[0]), ("body.1", self.body[1])] if self.body is not None else []
        return [(f"{name}.{suffix}", var, fwd, back) for name, m in [*layers, ("fc", self.fc)]
                for suffix, var, fwd, back in _canonical_entries(m)]

    def to_canonical(self) -> dict[str, np.ndarray]:
        """The torch twin's ``state_dict`` names and layouts, as NumPy copies."""
        out = {}
        for key, var, fwd, _ in self._entries():
            a = np.asarray(jax.device_get(var.get_value()))
            out[key] = np.array(fwd(a.astype(np.int64) if key.endswith("num_batches_tracked") else a), order="C")
        return out

    def load_canonical(self, d: Any) -> None:
        """Load a canonical dict (e.g. `triaccel.local_plan.head_init`) in place; ValueError naming a
        missing, unexpected or mis-shaped key."""
        entries = self._entries()
        check_canonical({k: tuple(fwd(np.empty(var.shape, np.bool_)).shape) for k, var, fwd, _ in entries}, d,
                        what="AuxHead.load_canonical")
        for key, var, _, back in entries:
            var.set_value(jnp.asarray(back(np.asarray(d[key])), dtype=var.dtype))


def _new_head(in_channels: int, width: int, num_classes: int, pool: int, dtype: Any, init: dict[str, Any]) -> AuxHead:
    # Built abstractly and filled from NumPy, as models.create_model: no random-init compilations.
    head = nnx.eval_shape(lambda: AuxHead(in_channels, width, num_classes, pool, dtype=dtype, rngs=nnx.Rngs(0)))
    head.load_canonical(init)
    return head


class _Stem(nnx.Module):
    """ResNet's stem unit conv1-bn1-ReLU (the model's own modules)."""

    def __init__(self, conv: nnx.Conv, bn: BatchNorm2d) -> None:
        self.conv1, self.bn1 = conv, bn

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.relu(self.bn1(self.conv1(x)))


class _Chain(nnx.Module):
    """units in sequence, then `head` when given."""

    def __init__(self, units: Sequence[nnx.Module], head: nnx.Module | None = None) -> None:
        self.units = nnx.List(list(units))
        self.head = nnx.data(head)

    def __call__(self, x: jax.Array) -> jax.Array:
        for u in self.units:
            x = u(x)
        return x if self.head is None else self.head(x)


class _Exits(nnx.Module):
    """units, with head i applied after unit stops[i] - 1: logits of every exit in one pass."""

    def __init__(self, units: Sequence[nnx.Module], heads: Sequence[nnx.Module], stops: Sequence[int]) -> None:
        self.units, self.heads, self.stops = nnx.List(list(units)), nnx.List(list(heads)), tuple(stops)

    def __call__(self, x: jax.Array) -> list[jax.Array]:
        out, start = [], 0
        for head, stop in zip(self.heads, self.stops):
            for u in self.units[start:stop]:
                x = u(x)
            out.append(head(x))
            start = stop
        return out


class ExitModel(nnx.Module):
    """An exported exit: the units of the chosen prefix, then its head, in eval mode (copies).
    Input (N, H, W, C) as the model's; output logits (N, num_classes). ``param_count``: its parameters."""

    def __init__(self, units: Sequence[nnx.Module], head: nnx.Module) -> None:
        self.units = nnx.List(list(units))
        self.head = head

    def __call__(self, x: jax.Array) -> jax.Array:
        for u in self.units:
            x = u(x)
        return self.head(x)

    @property
    def param_count(self) -> int:
        return _param_count(self)


def _param_count(*modules: nnx.Module) -> int:
    return sum(int(np.prod(a.shape)) for m in modules for a in jax.tree_util.tree_leaves(nnx.state(m, nnx.Param)))


def sequential_units(model: nnx.Module) -> tuple[list[tuple[str, nnx.Module]], Classifier]:
    """The model as named units run one after another, and its classifier, with the torch twin's
    names; the units share the model's modules (training them trains the model).

    ResNet: stem (conv1-bn1-ReLU), then every BasicBlock. EfficientNet: stem, every MBConv, the 1x1
    head conv; its classifier keeps the model's dropout.
    """
    if isinstance(model, ResNet):
        units: list[tuple[str, nnx.Module]] = [("stem", _Stem(model.conv1, model.bn1))]
        for i in range(1, model.num_stages + 1):
            units += [(f"layer{i}.{j}", blk) for j, blk in enumerate(getattr(model, f"layer{i}"))]
        return units, Classifier(model.fc)
    if isinstance(model, EfficientNet):
        units = [("stem", model.stem)] + [(f"blocks.{j}", blk) for j, blk in enumerate(model.blocks)]
        return units + [("head", model.head)], Classifier(model.fc, model.dropout)
    raise ValueError(f"model: {type(model).__name__} cannot be split into units; expected the ResNet or "
                     "EfficientNet of triaccel.backends.jax.models")


def set_compute_dtype(modules: Sequence[nnx.Module], dtype: Any) -> None:
    """Set the compute dtype of every conv and linear inside `modules` (None: the inputs' and params'
    promoted type); norm layers keep float32 statistics (their dtype is left alone)."""
    for root in modules:
        for _, m in nnx.iter_modules(root):
            if isinstance(m, (nnx.Conv, nnx.Linear)):
                m.dtype = dtype


# -- jitted pure functions (graph definitions static: equal structures share compilations) ----------

def _mean_ce(model: nnx.Module, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x).astype(jnp.float32), y).mean()


def _masked_ce(logits: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
    return (ce * mask).sum() / jnp.maximum(mask.sum(), 1.0)


@partial(jax.jit, static_argnums=0)
def _grad(gd: Any, params: Any, rest: Any, x: jax.Array, y: jax.Array, mask: jax.Array) -> tuple[Any, Any, Any]:
    """(mask-weighted mean loss, grads of params, new non-param state: BatchNorm statistics, RNG)."""
    def lf(p: Any) -> tuple[jax.Array, Any]:
        m = nnx.merge(gd, p, rest, copy=True)
        loss = _masked_ce(m(x), y, mask)
        return loss, nnx.split(m, nnx.Param, ...)[2]

    (loss, new_rest), grads = jax.value_and_grad(lf, has_aux=True)(params)
    return loss, grads, new_rest


@partial(jax.jit, static_argnums=0)
def _forward(gd: Any, state: Any, x: jax.Array) -> Any:
    """An eval-mode module's output (its state unchanged)."""
    return nnx.merge(gd, state, copy=True)(x)


@partial(jax.jit, static_argnums=0)
def _correct(gd: Any, state: Any, x: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:
    """int32 (n_exits,): correct top-1 predictions per exit over the real (mask 1) samples."""
    logits = nnx.merge(gd, state, copy=True)(x)
    return jnp.stack([jnp.sum((jnp.argmax(lg, -1) == y) * (mask > 0)) for lg in logits]).astype(jnp.int32)


@lru_cache(maxsize=None)
def _sgd(momentum: float, nesterov: bool, weight_decay: float) -> optax.GradientTransformation:
    """torch's SGD update without its lr: g + wd * p, then the (nesterov) momentum trace; a step whose
    gradients are not all finite gives zero updates and leaves the trace alone (``apply_if_finite``,
    never giving up: NonFinitePolicy stops training first)."""
    return optax.apply_if_finite(
        optax.chain(optax.add_decayed_weights(weight_decay), optax.trace(decay=momentum, nesterov=nesterov)),
        max_consecutive_errors=2**31 - 1)


@jax.jit
def _add_loss(acc: jax.Array, loss: jax.Array, finite: jax.Array, samples: jax.Array) -> jax.Array:
    """acc (2,) += [loss * samples, samples] of a step that was not skipped."""
    return acc + jnp.where(finite, jnp.stack([loss.astype(jnp.float32) * samples, samples]), 0.0)


@partial(jax.jit, static_argnums=0)
def _update(tx: optax.GradientTransformation, params: Any, opt_state: Any, grads: Any,
            lr: jax.Array) -> tuple[Any, Any]:
    updates, opt_state = tx.update(grads, opt_state, params)
    return jax.tree_util.tree_map(lambda p, u: p - lr * u, params, updates), opt_state


def _on_host(x: Any) -> bool:
    """A NumPy array (a host cache or view), not a device array."""
    return isinstance(x, np.ndarray)


def _host_leaves(tree: Any) -> tuple[bool, ...]:
    return tuple(_on_host(x) for x in jax.tree_util.tree_leaves(tree))


# A fused call copies its host rows to the device up front: at most this many bytes (or one batch) at a
# time, beside the plan's single staged batch (ResNet-18's layer1 output at batch 64 is 8.4 MB a batch)
HOST_CALL_BYTES = 16 * 2 ** 20


def _fused_steps(steps_per_call: int, batch: int, sources: Sequence[Any], n: int) -> int:
    """Steps per fused call for a block reading `sources` (its loader's arrays, one per view) at
    `batch` over n samples: `steps_per_call`, at most an epoch's full batches, fewer where the call's
    host rows would pass HOST_CALL_BYTES; 1 (no fusing) when the views do not all keep each leaf in
    the same place (host or device: the compiled program gathers them differently)."""
    if len({_host_leaves(src) for src in sources}) > 1:
        return 1
    row = sum(int(np.prod(x.shape[1:])) * np.dtype(x.dtype).itemsize
              for x in jax.tree_util.tree_leaves(sources[0]) if _on_host(x))
    k = min(steps_per_call, max(n // batch, 1))
    return max(1, min(k, HOST_CALL_BYTES // (row * batch))) if row else k


def _scan_steps(gd: Any, tx: optax.GradientTransformation, transform: Callable[[Any, Any, jax.Array], Any] | None,
                seed: int, batch: int, host: tuple[bool, ...]) -> Callable[..., Any]:
    """K full-batch training steps as one jitted ``lax.scan`` (K from its inputs' leading axis).

    transform(tstate, raw batch, key) -> (x, y), or None (the raw batch is the input). Returns
    f(params, opt, rest, acc, tstate, arrays, idx, epoch, firsts, lrs, active) -> (params, opt, rest, acc):
    tstate: the transform's arrays (the frozen prefix's weights), an argument so that they are not
    baked into the program as constants; arrays: the source's leaves on the device, each the whole
    leaf where it lives on the device, or (host[i]: a NumPy leaf) the call's K * batch rows of it;
    idx: int32 (K, batch), each step's rows of the source (gathered inside the scan: no (K, batch,
    ...) stack of a device leaf); epoch:
    int32 () the loader's epoch; firsts: int32 (K,) each batch's first sample id (with the seed and
    epoch: the key the loader gives its transform, so the augmentation equals the elastic path's);
    lrs: float32 (K,); active: bool (K,), False steps leave the state alone (a call's spare slots at
    an epoch's end: one compiled K)."""
    ones = jnp.ones((batch,), jnp.float32)

    def run(params: Any, opt: Any, rest: Any, acc: jax.Array, tstate: Any, arrays: Any, idx: jax.Array,
            epoch: jax.Array, firsts: jax.Array, lrs: jax.Array, active: jax.Array) -> Any:
        # tstate and arrays are closed over, loop invariants: the scan's carry holds only what changes
        # (a large source in the carry could be copied into the loop's buffers)
        leaves, tree = jax.tree_util.tree_flatten(arrays)

        def one(carry: Any, inp: Any) -> tuple[Any, None]:
            idx_k, k, first, lr, on = inp

            def step(c: Any) -> Any:
                params, opt, rest, acc = c
                rows = [k * batch + jnp.arange(batch) if h else idx_k for h in host]
                raw_k = jax.tree_util.tree_unflatten(tree, [jnp.take(a, r, axis=0) for a, r in zip(leaves, rows)])
                key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), epoch), first)
                x, y = raw_k if transform is None else transform(tstate, raw_k, key)
                loss, grads, new_rest = _grad(gd, params, rest, x, y, ones)
                params, opt = _update(tx, params, opt, grads, lr)
                # a skipped step keeps the statistics it found (the elastic path restores them at the next check)
                new_rest = jax.tree_util.tree_map(lambda u, v: jnp.where(opt.last_finite, u, v), new_rest, rest)
                return params, opt, new_rest, _add_loss(acc, loss, opt.last_finite, jnp.float32(batch))

            return jax.lax.cond(on, step, lambda c: c, carry), None

        ks = jnp.arange(firsts.shape[0], dtype=jnp.int32)
        return jax.lax.scan(one, (params, opt, rest, acc), (idx, ks, firsts, lrs, active))[0]

    return jax.jit(run)


def _write_rows(buf: jax.Array, y: jax.Array, i: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(buf, y.astype(buf.dtype), i, 0)


_write_donated = jax.jit(_write_rows, donate_argnums=0)   # in place on accelerators
_write_copy = jax.jit(_write_rows)                          # CPU: donation unsupported (warns)


def _memory_stats(device: Any) -> str:
    """The device's bytes in use and peak, for out-of-memory reports ("no statistics" where it keeps none)."""
    try:
        s = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - platforms without statistics raise or return None
        s = {}
    if "bytes_in_use" not in s:
        return "no statistics"
    return f"{s['bytes_in_use']} bytes in use, peak {s.get('peak_bytes_in_use')}, limit {s.get('bytes_limit')}"


def _peak_bytes(device: Any) -> int | None:
    """The process' peak device bytes so far (XLA offers no reset); None where the device reports none."""
    try:
        s = device.memory_stats()
    except Exception:  # noqa: BLE001 - platforms without statistics raise or return None
        return None
    return int(s["peak_bytes_in_use"]) if s and "peak_bytes_in_use" in s else None


# -- the memory table --------------------------------------------------------------------------------

def measure_layers(units: Sequence[tuple[str, nnx.Module]], example: Any) -> list[LayerMemory]:
    """Per-unit memory table for `triaccel.local_plan`, from XLA's compiled memory analysis.

    example: an (n, H, W, C) input batch, or its ``jax.ShapeDtypeStruct`` (nothing runs: each unit's
    forward + backward, in training mode at the units' compute dtypes, is compiled at n and at 2n
    samples). saved_bytes per sample = (temp(2n) - temp(n)) / n, where temp is
    ``memory_analysis().temp_size_in_bytes``: what XLA keeps alive beyond the arguments (params,
    input, cotangent) and outputs (gradients): the residuals carried from the forward to the backward
    and the backward's transients at their peak. (torch's table counts the saved tensors, the unit's
    input among them, and no transients; the plan adds the input and gradient buffers itself, so both
    are conservative in their own way.) The units themselves are not touched (copies are measured).
    """
    shape = tuple(int(v) for v in example.shape)
    if len(shape) != 4 or shape[0] < 1:
        raise ValueError(f"example: expected an (n >= 1, H, W, C) batch or ShapeDtypeStruct, got shape {shape}")
    n = shape[0]
    x = jax.ShapeDtypeStruct(shape, example.dtype)
    out: list[LayerMemory] = []
    for name, unit in units:
        m = nnx.clone(unit)
        m.train()
        gd, params, rest = nnx.split(m, nnx.Param, ...)

        def fwd_bwd(p: Any, r: Any, xb: jax.Array, g: jax.Array, gd: Any = gd) -> Any:
            y, vjp = jax.vjp(lambda p_, x_: nnx.merge(gd, p_, r, copy=True)(x_), p, xb)
            return vjp(g)

        temps = []
        for k in (1, 2):
            xk = jax.ShapeDtypeStruct((k * n, *x.shape[1:]), x.dtype)
            yk = jax.eval_shape(lambda p_, x_, gd=gd, r=rest: nnx.merge(gd, p_, r, copy=True)(x_), params, xk)
            # Never run: on the CPU, skip LLVM's optimisation (half the compile time; buffer sizes
            # are decided before it, measured equal).
            opts = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None
            stats = jax.jit(fwd_bwd).lower(params, rest, xk, yk).compile(opts).memory_analysis()
            if stats is None:
                raise RuntimeError(f"measure_layers: this platform ({jax.default_backend()}) gives no compiled "
                                   "memory analysis")
            temps.append(int(stats.temp_size_in_bytes))
            if k == 1:
                y1 = yk
        per = max(temps[1] - temps[0], 0) // n
        h, w, c = y1.shape[1:]
        out.append(LayerMemory(name, int(per), (int(c), int(h), int(w)), _param_count(unit)))
        x = jax.ShapeDtypeStruct(y1.shape, y1.dtype)
    return out


# -- the trainer -----------------------------------------------------------------------------------

class LocalTrainer:
    """Trains `units` block by block as `plan` says (see the module docstring).

    units / classifier: from :func:`sequential_units`. plan: `triaccel.local_plan.plan_local` over the
    same units. num_classes: the heads' outputs. lr: SGD lr at `lr_batch` samples, scaled linearly to
    each block's batch; momentum, nesterov, weight_decay: SGD's (torch's update). lr_factor(seen,
    total): the schedule's multiplier after `seen` of a block's `total` training samples (default 1).
    compute_dtype: the convs' and linears' compute dtype, set on the units (shared with the model) and
    the heads; None leaves the units as they are and the heads in float32. inputs: what blocks after
    the first read, as the torch twin: "cache", "recompute" (the frozen prefix on the fixed views,
    the cache's reference) or "fresh" (the frozen prefix on freshly augmented images). cache_dtype:
    the cache's (and a recomputed prefix output's) dtype. head_pool: AuxHead's pool. seed: heads' initialisation
    (`triaccel.local_plan.head_init`, as the torch twin) and data order. device: where training runs
    (default: the first device). Records' peak bytes are the process' peak so far (XLA keeps one,
    with no reset), None on the CPU. nonfinite: how steps with non-finite gradients are skipped and
    when training stops (`triaccel.local_plan.NonFinitePolicy`; default: its defaults). steps_per_call:
    full-batch steps per compiled call (>= 1; 1: every step through the elastic path); a record's
    graph_steps counts the steps that ran fused, graph_note says why fusing stopped (an OOM).
    curvature: the curvature lever per block (`triaccel.local_plan.BlockCurvature`; None: off), as
    the torch twin.
    """

    def __init__(self, units: Sequence[tuple[str, nnx.Module]], classifier: nnx.Module | None, plan: LocalPlan, *,
                 num_classes: int, lr: float, lr_batch: int = 96, momentum: float = 0.9, nesterov: bool = True,
                 weight_decay: float = 5e-4, lr_factor: Callable[[int, int], float] | None = None,
                 compute_dtype: Any = None, inputs: str = "cache", cache_dtype: Any = jnp.bfloat16,
                 head_pool: int = 4, seed: int = 0, device: Any = None,
                 nonfinite: NonFinitePolicy | None = None, steps_per_call: int = 16,
                 curvature: BlockCurvature | None = None) -> None:
        if isinstance(steps_per_call, bool) or not isinstance(steps_per_call, int) or steps_per_call < 1:
            raise ValueError(f"steps_per_call={steps_per_call!r}: allowed integers >= 1")
        if len(units) != len(plan.layers) or [n for n, _ in units] != [l.name for l in plan.layers]:
            raise ValueError(f"units: names {[n for n, _ in units]} do not match the plan's layers "
                             f"{[l.name for l in plan.layers]}")
        if not lr > 0:
            raise ValueError(f"lr={lr!r}: allowed (0, inf)")
        self.units = [m for _, m in units]
        self.plan = plan
        self.num_classes = int(num_classes)
        self.lr, self.lr_batch = float(lr), int(lr_batch)
        self.tx = _sgd(float(momentum), bool(nesterov), float(weight_decay))
        self.lr_factor = lr_factor or (lambda seen, total: 1.0)
        self.inputs, self.cache_dtype, self.seed = inputs, jnp.dtype(cache_dtype), int(seed)
        self.nonfinite = nonfinite if nonfinite is not None else NonFinitePolicy()
        self.curvature = BlockCurvature.checked(curvature)
        self.device = device if device is not None else jax.devices()[0]
        self.steps_per_call = steps_per_call
        if compute_dtype is not None:
            set_compute_dtype(self.units, compute_dtype)
        self.heads: list[nnx.Module] = []
        for blk in plan.blocks:
            if blk.stop == len(units) and blk.head_width == 0 and classifier is not None:
                head = classifier     # the last block keeps the model's own classifier
                if compute_dtype is not None:
                    set_compute_dtype([head], compute_dtype)
            else:
                c = plan.layers[blk.stop - 1].out_shape[0]
                head = _new_head(c, blk.head_width, num_classes, head_pool, compute_dtype,
                                 head_init(c, blk.head_width, num_classes, seed=self.seed, index=blk.index))
            self.heads.append(head)
        self.records: list[BlockRecord] = []

    # -- pieces -----------------------------------------------------------------------------------
    def _eval_split(self, module: nnx.Module) -> tuple[Any, Any]:
        module.eval()
        gd, state = nnx.split(module)
        return gd, jax.device_put(state, self.device)

    @staticmethod
    def _precision(module: nnx.Module) -> Precision:
        """The lowest compute precision among `module`'s convs and linears (None, the promoted type: FP32)."""
        dtypes = {m.dtype for _, m in nnx.iter_modules(module) if isinstance(m, (nnx.Conv, nnx.Linear))}
        return min((Precision.FP32 if d is None else Precision.parse(d) for d in dtypes), default=Precision.FP32)

    def _put(self, x: Any) -> jax.Array:
        return jax.device_put(x, self.device)

    # -- training ---------------------------------------------------------------------------------
    def train(self, train_x: Any, train_y: Any, train_transform: Callable[[jax.Array, jax.Array], jax.Array],
              views: Sequence[Any], view_transform: Callable[[jax.Array], jax.Array], epochs: int | Sequence[int],
              on_epoch: Callable[[int, int, float, float], None] | None = None) -> list[BlockRecord]:
        """Train every block in order; returns one record per block.

        train_x (N, ...) raw samples, train_y (N,) int labels (device or host arrays);
        train_transform(raw batch, key) -> block 0's augmented input (jitted here; the key comes from
        the loader: seed, epoch, first sample). views: `plan`'s cache_views arrays (N, ...) of raw
        samples from fixed augmentations (host or device), view_transform(raw) -> input (jitted here).
        epochs: per block (an int for all). on_epoch(block, epoch, train_loss, seconds) after each
        epoch (the trained weights are in the modules then, e.g. to evaluate the block's exit).
        """
        runs = block_runs(self.plan, epochs, lr=self.lr, lr_batch=self.lr_batch, seed=self.seed, inputs=self.inputs)
        n = int(train_x.shape[0])
        check_views(n, [int(v.shape[0]) for v in views], int(train_y.shape[0]), runs)
        train_y = self._put(jnp.asarray(train_y, jnp.int32))
        aug, prep = jax.jit(train_transform), jax.jit(view_transform)
        cache: list[Any] | None = None
        self.records = []
        for blk, run in zip(self.plan.blocks, runs):
            sources, transform, still, tstate = self._inputs(blk, run, train_x, train_y, views, cache, aug, prep)
            # the curvature lever's measurements read un-augmented images (no draw on the training keys)
            probe = None if self.curvature is None else (sources, still, tstate)
            self.records.append(self._train_block(run, sources, transform, tstate, n, on_epoch, probe))
            if run.cache_after is not None:
                cache = self._build_cache(run.index, run.cache_after, cache, views, prep)
        return self.records

    def _inputs(self, blk: Any, run: BlockRun, train_x: Any, train_y: Any, views: Sequence[Any],
                cache: list[Any] | None, aug: Callable[..., Any],
                prep: Callable[..., Any]) -> tuple[Any, Any, Any, Any]:
        """A block's (sources, transform, still, tstate): the arrays its loader reads, transform(tstate,
        raw batch, key) -> (x, y) or None, the same without augmentation (`prep` for `aug`: the
        curvature lever's inputs), its arrays (the frozen prefix's eval-mode state, on the device)."""
        if run.source == "data":
            return ([(train_x, train_y)], (lambda _s, b, key: (aug(b[0], key), b[1])),
                    (lambda _s, b, key: (prep(b[0]), b[1])), None)
        if run.source == "cache":
            assert cache is not None
            return [(c, train_y) for c in cache], None, None, None
        # the frozen prefix every step: on the fixed views ("recompute") or fresh images
        pre_gd, tstate = self._eval_split(_Chain(self.units[:blk.start]))
        fresh = run.source == "fresh"
        sources = [(train_x, train_y)] if fresh else [(v, train_y) for v in views]

        def through_prefix(inp: Callable[[Any, Any], Any]) -> Callable[..., Any]:
            return lambda s, b, key: (_forward(pre_gd, s, inp(b, key)).astype(self.cache_dtype), b[1])

        still = through_prefix(lambda b, key: prep(b[0]))
        return sources, (through_prefix(lambda b, key: aug(b[0], key)) if fresh else still), still, tstate

    def _body_split(self, b: int) -> tuple[nnx.Module, Any, Any, Any]:
        """Block b's training module (units + head) and its train-mode split: (module, graph def, params,
        rest). The step runs this graph definition: on_epoch's exit evaluation, which puts the shared
        modules in eval mode, cannot reach training (the torch twin sets train mode each epoch)."""
        blk = self.plan.blocks[b]
        body = _Chain(self.units[blk.start:blk.stop], self.heads[b])
        body.train()
        return (body, *nnx.split(body, nnx.Param, ...))

    def _train_block(self, run: BlockRun, sources: list[tuple[Any, Any]], transform: Any, tstate: Any, n: int,
                     on_epoch: Any, probe: tuple[Any, Any, Any] | None) -> BlockRecord:
        b, blk = run.index, self.plan.blocks[run.index]
        body, gd, params, rest = self._body_split(b)
        # committed to the device from the start: the step's outputs are, and a change of placement
        # between calls would compile the step again
        params, rest = jax.device_put((params, rest), self.device)
        # scale: the curvature lever's LR multiplier (BlockCurvature)
        st = {"params": params, "rest": rest, "opt": jax.device_put(self.tx.init(params), self.device), "scale": 1.0}
        ctl = Controller(run.controller_config(self.plan.memory_budget), [f"block{b}"])
        loader = ElasticLoader(sources[0], batch_size=blk.batch, buckets=run.micro_batches, seed=run.seed,
                               transform=None if transform is None else partial(transform, tstate), device=self.device)
        total, seen = run.epochs * n, 0

        def grad_fn(batch: Any, mask: jax.Array) -> tuple[jax.Array, Any]:
            x, y = batch
            loss, grads, new_rest = _grad(gd, st["params"], st["rest"], x, y, mask)
            # wait before keeping the new statistics: an OOM of this micro-batch must leave them as they were
            jax.block_until_ready((loss, grads, new_rest))
            st["rest"] = new_rest
            return loss, grads

        rec = BlockRecord(index=b, batch=blk.batch, precision=self._precision(body).short)
        clean = {"rest": st["rest"], "skipped": 0}   # the statistics of the last check without new skips

        def check() -> None:
            nonlocal gd, fused
            state = st["opt"]
            skipped, consecutive = (int(v) for v in jax.device_get((state.total_notfinite, state.notfinite_count)))
            if skipped > clean["skipped"]:
                st["rest"] = clean["rest"]
            else:
                clean["rest"] = st["rest"]
            fresh = self.nonfinite.check(b, rec.steps, skipped, consecutive, clean["skipped"])
            clean["skipped"] = rec.skipped_steps = skipped
            new = self.nonfinite.precision_after(fresh, rec.precision)
            if new != Precision.parse(rec.precision):
                # the dtype is static in the graph definition: the steps compile again at the new one
                set_compute_dtype([body], jnp.dtype(new.dtype_name))
                body.train()
                gd = nnx.graphdef(body)
                if fused is not None:
                    fused = _scan_steps(gd, self.tx, transform, run.seed, blk.batch, _host_leaves(sources[0]))
                warnings.warn(rec.promote(new), RuntimeWarning, stacklevel=2)

        curv: dict[str, Any] = {}   # the block's curvature estimator (one compile per block)
        fused = None
        k = _fused_steps(self.steps_per_call, blk.batch, sources, n)
        if k > 1:
            fused = _scan_steps(gd, self.tx, transform, run.seed, blk.batch, _host_leaves(sources[0]))
        for e in range(run.epochs):
            loader.arrays = sources[BlockRun.view(e, len(sources))]
            t0 = time.perf_counter()
            st["acc"] = self._put(np.zeros(2, np.float32))
            while True:
                done = (self._fused_call(fused, k, st, tstate, loader, run, blk.batch, seen, total, rec)
                        if fused is not None and not rec.graph_note else 0)
                seen += done * blk.batch
                if not done:
                    lr = self._put(np.float32(run.lr * self.lr_factor(seen, total) * st["scale"]))

                    def update(grads: Any, _decision: Any, lr: jax.Array = lr) -> None:
                        st["params"], st["opt"] = _update(self.tx, st["params"], st["opt"], grads, lr)

                    oom: str | None = None
                    try:
                        res = elastic_step(loader, ctl, grad_fn, rec.steps, update_fn=update)
                    except OOMAtMinimumBatch as exc:
                        oom = str(exc)   # the text only: the exception's frames hold the failed step's arrays
                    if oom is not None:
                        stats = _memory_stats(self.device)
                        raise BlockOutOfMemory(BlockOutOfMemory.message(self.plan, b, rec.steps, oom, stats))
                    seen += res.samples
                    st["acc"] = _add_loss(st["acc"], res.loss, st["opt"].last_finite, np.float32(res.samples))
                    rec.steps += 1
                    rec.ooms += res.ooms
                if loader.end_of_epoch:
                    break
                if self.nonfinite.due(rec.steps):   # a fused call ends at a due step, never past one
                    check()
            check()   # before on_epoch evaluates the statistics
            total_loss, kept = (float(v) for v in np.asarray(st["acc"]))   # the sync that ends the epoch
            rec.epoch_losses.append(total_loss / kept if kept > 0 else float("nan"))
            nnx.update(body, st["params"], st["rest"])   # the shared modules hold the trained weights
            if probe is not None and self.curvature is not None and self.curvature.due(e):   # counts as training
                p_sources, p_transform, p_state = probe
                st["scale"] = self._block_curvature(b, body, p_sources[BlockRun.view(e, len(p_sources))],
                                                    p_transform, p_state, n, run.seed, curv)
                rec.lr_scales.append(st["scale"])
            rec.epoch_seconds.append(time.perf_counter() - t0)
            if on_epoch is not None:
                on_epoch(b, e, rec.epoch_losses[-1], rec.epoch_seconds[-1])
        rec.peak_bytes = _peak_bytes(self.device)
        body.eval()
        return rec

    def _block_curvature(self, b: int, body: nnx.Module, arrays: tuple[Any, Any], transform: Any, tstate: Any,
                         n: int, seed: int, curv: dict[str, Any]) -> float:
        """The curvature lever's measurement, as the torch twin: per-layer top empirical-Fisher
        eigenvalue of block b (units + head; `nnx_loss`'s eval-mode FP32 clone) on
        `BlockCurvature.rows` of `arrays` (through `transform`); returns the block's new LR scale."""
        assert self.curvature is not None
        rows = self.curvature.rows(n, seed)
        pure = nnx_loss(body, _mean_ce)
        if "est" not in curv:
            curv["est"] = FisherTopK(pure.fn, layer_map_from_model(body), 1)

        def eigvals_of(k: int) -> np.ndarray:
            batch = tuple(jnp.asarray(a[rows[:k]]) for a in arrays)
            if transform is not None:
                batch = transform(tstate, batch, jax.random.PRNGKey(seed))
            return curv["est"](pure.params, (batch[0].astype(jnp.float32), batch[1]), pure.aux)

        return self.curvature.measure(b, eigvals_of, len(rows), is_oom=is_oom, free_memory=free_memory)

    def _fused_call(self, fused: Callable[..., Any], steps: int, st: dict[str, Any], tstate: Any,
                    loader: ElasticLoader, run: BlockRun, batch: int, seen: int, total: int,
                    rec: BlockRecord) -> int:
        """Up to `steps` full batches of the epoch through `fused` (`_scan_steps`, compiled for `steps`), updating
        `st` (params, opt, rest, acc) and `rec`. Returns the steps taken: 0 leaves the step to the
        elastic path (no full batch left, or the call ran out of memory: its samples are put back and
        the block's later steps take the elastic path, the reason in rec.graph_note)."""
        left = loader.left_for_next
        # a call ends at the next non-finite check, as the elastic path's steps would reach it
        k = min(steps, left // batch, self.nonfinite.until_due(rec.steps))
        if k == 0 or loader.logical_batch != batch:
            return 0
        idx = [loader.next_indices() for _ in range(k)]
        flat = np.concatenate(idx)
        spare = steps - k   # slots of the one compiled K, inactive: the state passes through
        rows = np.concatenate([flat, np.resize(flat, spare * batch)]) if spare else flat

        firsts = np.array([int(i[0]) for i in idx] + [0] * spare, np.int32)
        lrs = np.array([run.lr * self.lr_factor(seen + j * batch, total) * st["scale"] for j in range(k)]
                       + [0.0] * spare,
                       np.float32)
        active = np.arange(steps) < k
        failed = ""
        try:
            # a host leaf's rows of this call go to the device (as the elastic step's would, K at once)
            arrays = jax.tree_util.tree_map(lambda x: jax.device_put(np.take(x, rows, axis=0), self.device)
                                            if _on_host(x) else x, loader.arrays)
            out = fused(st["params"], st["opt"], st["rest"], st["acc"], tstate, arrays,
                        rows.astype(np.int32).reshape(steps, batch), np.int32(loader.epoch),
                        firsts, lrs, active)
            jax.block_until_ready(out)   # an OOM surfaces here, before the state is replaced
        except Exception as exc:   # noqa: BLE001 - only an OOM falls back
            if not is_oom(exc):
                loader.put_back(flat)
                raise
            failed = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        if failed:
            loader.put_back(flat)
            rec.ooms += 1
            rec.graph_note = f"fused steps at step {rec.steps}: {failed}; elastic steps"
            warnings.warn(f"block {rec.index}: {rec.graph_note}", RuntimeWarning, stacklevel=2)
            out = arrays = None   # noqa: F841 - drop the failed call's buffers
            free_memory()
            return 0
        st["params"], st["opt"], st["rest"], st["acc"] = out
        for i in idx:
            loader.complete(i)
        rec.steps += k
        rec.graph_steps += k
        return k

    def _build_cache(self, b: int, where: str, cache: list[Any] | None, views: Sequence[Any],
                     prep: Callable[[Any], jax.Array]) -> list[Any]:
        """Block b's outputs over every view of the training set, on the device or the host (`where`)."""
        blk = self.plan.blocks[b]
        gd, state = self._eval_split(_Chain(self.units[blk.start:blk.stop]))
        c, h, w = self.plan.layers[blk.stop - 1].out_shape
        write = _write_copy if self.device.platform == "cpu" else _write_donated
        t0 = time.perf_counter()
        out: list[Any] = []
        for v, raw in enumerate(views):
            n = int(raw.shape[0])
            filled: list[Any] = []

            def fill(bs: int, v: int = v, raw: Any = raw, n: int = n) -> None:
                filled.clear()
                if where == "device":
                    buf: Any = self._put(jnp.zeros((n, h, w, c), self.cache_dtype))
                else:
                    buf = np.empty((n, h, w, c), self.cache_dtype)
                for i in range(0, n, bs):
                    x = prep(self._put(raw[i:i + bs])) if cache is None else self._put(cache[v][i:i + bs])
                    y = _forward(gd, state, x)
                    if where == "device":
                        buf = write(buf, y, i)
                    else:
                        buf[i:i + bs] = np.asarray(y.astype(self.cache_dtype))
                filled.append(jax.block_until_ready(buf) if where == "device" else buf)

            halving_on_oom(fill, self.plan.infer_batch, is_oom=is_oom, free_memory=free_memory)
            out.append(filled[0])
        rec = self.records[b]
        rec.cache_seconds = time.perf_counter() - t0
        rec.cache_peak_bytes = _peak_bytes(self.device)
        return out

    # -- exits ------------------------------------------------------------------------------------
    def evaluate_exits(self, x: Any, y: Any, transform: Callable[[jax.Array], jax.Array], upto: int | None = None,
                       batch: int | None = None) -> list[float]:
        """Top-1 accuracy of every exit (block heads, in order; only the first `upto` when given) on
        raw samples x (N, ...) with labels y (N,), one forward pass through the prefix per batch (the
        last batch padded with repeats, masked out)."""
        nb = len(self.plan.blocks) if upto is None else int(upto)
        if not 1 <= nb <= len(self.plan.blocks):
            raise ValueError(f"upto={upto}: allowed [1, {len(self.plan.blocks)}]")
        stops = [blk.stop for blk in self.plan.blocks[:nb]]
        gd, state = self._eval_split(_Exits(self.units[:stops[-1]], self.heads[:nb], stops))
        prep = jax.jit(transform)
        total = int(x.shape[0])
        labels = self._put(jnp.asarray(y, jnp.int32))
        correct: list[Any] = []

        def run(bs: int) -> None:
            acc = jnp.zeros(nb, jnp.int32)
            for i in range(0, total, bs):
                idx = np.resize(np.arange(i, min(i + bs, total)), bs)
                mask = (np.arange(bs) < min(bs, total - i)).astype(np.float32)
                xb = jnp.take(x, idx, axis=0) if isinstance(x, jax.Array) else self._put(np.take(x, idx, axis=0))
                acc = acc + _correct(gd, state, prep(self._put(xb)), jnp.take(labels, idx), self._put(mask))
            correct[:] = [int(c) for c in np.asarray(acc)]

        halving_on_oom(run, batch or self.plan.infer_batch, is_oom=is_oom, free_memory=free_memory)
        return [c / total for c in correct]

    def export(self, b: int) -> ExitModel:
        """Exit b as a standalone module: copies of units [0, stop of block b) and block b's head, in
        eval mode."""
        if not 0 <= b < len(self.plan.blocks):
            raise ValueError(f"b={b}: allowed [0, {len(self.plan.blocks) - 1}]")
        stop = self.plan.blocks[b].stop
        model = nnx.clone(ExitModel(self.units[:stop], self.heads[b]))
        model.eval()
        return model

    def exit_params(self) -> list[int]:
        """Parameter count of every exit's exported model."""
        return [_param_count(*self.units[:blk.stop], self.heads[b]) for b, blk in enumerate(self.plan.blocks)]
