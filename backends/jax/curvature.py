"""Per-layer curvature for JAX: top-k eigenvalues of each layer's Fisher or Hessian block.

Both estimators work on a pure loss ``loss_fn(params, batch, aux) -> scalar`` (mean over the
batch; `aux`: non-differentiated state such as BatchNorm statistics, or None) and
return a float64 (L, k) array in the LayerMap's layer order, ready for `Controller.observe_curvature`.

* Fisher (empirical): one ``vmap(grad)`` gives the b per-sample gradients; per layer the (b, b) Gram
  matrix is summed over the layer's tensors on the device, and the core's `fisher_topk_from_gram`
  takes the exact top-k on the host (an eigh of b x b instead of n x n).
* Hessian: subspace iteration on each layer's diagonal block H_ll with k vectors at once
  (``vmap`` over ``jvp``-of-``grad``), warm-started from the previous call's vectors so that a few
  iterations per call suffice; the final Rayleigh-Ritz step uses the core's `ritz`. One compiled
  function serves every layer (the layer index is a traced argument and selects the tangent's
  support), so the cost is L x iters batched HVPs and one compilation.

For Flax NNX models `nnx_loss` turns ``loss_fn(model, batch)`` into the pure form on an eval-mode
FP32 copy of the model: BatchNorm uses its running statistics and the curvature pass never writes
batch statistics back (the copy is thrown away).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from triaccel.curvature import fisher_topk_from_gram, ritz

from .layers import LayerMap
from .policy import compiled_footprint

__all__ = ["NNXLoss", "nnx_loss", "FisherTopK", "per_sample_grads", "layer_grams", "fisher_topk", "HessianTopK"]

LossFn = Callable[[Any, Any, Any], jax.Array]  # (params, batch, aux) -> scalar


class NNXLoss(NamedTuple):
    """Pure form of an NNX loss: ``fn(params, batch, aux) -> scalar``; `params` the nnx.Param arrays,
    `aux` the other state (batch statistics...), `graphdef` the static graph (a cache key)."""

    fn: Callable[[Any, Any, Any], jax.Array]
    params: Any
    aux: Any
    graphdef: Any


def nnx_loss(model: Any, loss_fn: Callable[[Any, Any], jax.Array], wrt: Any = None) -> NNXLoss:
    """Pure form of ``loss_fn(model, batch) -> scalar`` for an NNX `model`, on an eval-mode FP32 clone.

    Eval mode: BatchNorm uses its running statistics and Dropout is off, and since the clone is
    thrown away, calling fn never changes `model` (no batch-statistics update). FP32: curvature is
    measured at full precision whatever the training policy is (every module ``dtype`` set to
    float32 on the clone), so the compiled curvature code does not change with the policy.
    """
    from flax import nnx

    clone = nnx.clone(model)
    clone.eval()
    for _, m in nnx.iter_modules(clone):
        if hasattr(m, "dtype"):  # also None ("infer"): one graph whatever the policy
            m.dtype = jnp.float32
    graphdef, params, rest = nnx.split(clone, nnx.Param if wrt is None else wrt, ...)

    def fn(p: Any, batch: Any, aux: Any) -> jax.Array:
        # copy=True: merging inside a transform must not alias Variables of another trace.
        return loss_fn(nnx.merge(graphdef, p, aux, copy=True), batch)

    return NNXLoss(fn, nnx.as_pure(params), rest, graphdef)


def per_sample_grads(loss_fn: LossFn, params: Any, batch: Any, aux: Any = None) -> Any:
    """Per-example gradients: a params-shaped tree whose leaves have a leading batch axis b.

    Each example is fed as a batch of one (leading axis kept), so `loss_fn` needs no change.
    """
    def one(p: Any, example: Any, a: Any) -> Any:
        return jax.grad(loss_fn)(p, jax.tree_util.tree_map(lambda x: x[None], example), a)

    return jax.vmap(one, in_axes=(None, 0, None))(params, batch, aux)


def layer_grams(grads: Any, tensor_layer: np.ndarray, num_layers: int) -> jax.Array:
    """(L, b, b) per-layer Gram matrices <g_i, g_j> of per-sample gradients (leaves (b, ...)),
    summed over each layer's tensors, accumulated in float32."""
    leaves = jax.tree_util.tree_leaves(grads)
    if len(leaves) != len(tensor_layer):
        raise ValueError(f"tensor_layer: {len(tensor_layer)} entries for {len(leaves)} gradient tensors")
    b = leaves[0].shape[0]
    out = jnp.zeros((num_layers, b, b), jnp.float32)
    for leaf, layer in zip(leaves, tensor_layer):
        g = leaf.reshape(b, -1).astype(jnp.float32)
        out = out.at[int(layer)].add(g @ g.T)
    return out


def _check_k(k: int) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k={k!r}: must be an int >= 1")


class FisherTopK:
    """Jitted empirical-Fisher top-k per layer (compiled once per batch shape)."""

    def __init__(self, loss_fn: LossFn, layers: LayerMap, k: int) -> None:
        _check_k(k)
        self.layers, self.k = layers, k
        self._grams = jax.jit(lambda p, batch, aux: layer_grams(
            per_sample_grads(loss_fn, p, batch, aux), layers.tensor_layer, layers.num_layers))

    def __call__(self, params: Any, batch: Any, aux: Any = None) -> np.ndarray:
        """float64 (L, k): top-k eigenvalues of each layer's empirical Fisher on `batch`."""
        grams = np.asarray(jax.device_get(self._grams(params, batch, aux)), dtype=np.float64)
        return np.stack([fisher_topk_from_gram(g, self.k) for g in grams])

    def footprint(self, params: Any, batch: Any, aux: Any = None) -> int | None:
        """Bytes the jitted Gram pass needs on `batch` beyond its arguments (per-sample gradients
        and Grams), from XLA's compiled memory analysis; None where there is none."""
        return compiled_footprint(self._grams, params, batch, aux)


def fisher_topk(loss_fn: LossFn, params: Any, batch: Any, layers: LayerMap, k: int, aux: Any = None) -> np.ndarray:
    """One-shot form of FisherTopK (compiles every call; keep a FisherTopK in training loops)."""
    return FisherTopK(loss_fn, layers, k)(params, batch, aux)


class HessianTopK:
    """Top-k eigenvalues of each layer's Hessian block by warm-started subspace iteration.

    loss_fn(params, batch, aux) -> scalar. iters: subspace iterations per layer and call (each one
    batched HVP of k vectors); the vectors persist between calls (warm start). Memory: k copies of
    the parameters for the vectors, plus one vmapped HVP of k tangents.
    """

    def __init__(self, loss_fn: LossFn, layers: LayerMap, k: int, iters: int = 3, seed: int = 0, *,
                 cold_iters: int | None = None, layers_per_event: int | None = None) -> None:
        _check_k(k)
        if not isinstance(iters, int) or iters < 1:
            raise ValueError(f"iters={iters!r}: must be an int >= 1")
        if cold_iters is not None and (not isinstance(cold_iters, int) or cold_iters < 1):
            raise ValueError(f"cold_iters={cold_iters!r}: must be None or an int >= 1")
        if layers_per_event is not None and (not isinstance(layers_per_event, int) or layers_per_event < 1):
            raise ValueError(f"layers_per_event={layers_per_event!r}: must be None (all) or an int >= 1")
        self.layers, self.k, self.iters = layers, k, iters
        self.cold_iters = cold_iters if cold_iters is not None else max(iters, 8)
        self.layers_per_event = layers_per_event
        self._key = jax.random.PRNGKey(seed)
        self.vectors: Any = None  # params-shaped tree, leaves (k, *shape): the warm start
        self.eigvals = np.full((layers.num_layers, k), np.nan)  # last estimate per layer
        self.refreshed: tuple[int, ...] = ()  # layers recomputed by the last call
        self._cursor = 0
        tl = tuple(int(x) for x in layers.tensor_layer)

        def hvp(p: Any, batch: Any, aux: Any, v: Any) -> Any:
            return jax.jvp(lambda q: jax.grad(loss_fn)(q, batch, aux), (p,), (v,))[1]

        def dot(a: Any, b: Any, masks: list) -> jax.Array:
            # (k, k) inner products restricted to the current layer's tensors.
            terms = [m * (x.reshape(x.shape[0], -1).astype(jnp.float32)
                          @ y.reshape(y.shape[0], -1).astype(jnp.float32).T)
                     for m, x, y in zip(masks, jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))]
            return sum(terms)

        def run_layer(p: Any, batch: Any, aux: Any, vecs: Any, layer: jax.Array) -> tuple[Any, jax.Array]:
            treedef = jax.tree_util.tree_structure(vecs)
            masks = [(jnp.asarray(l) == layer).astype(jnp.float32) for l in tl]

            def restrict(tree: Any) -> Any:
                return jax.tree_util.tree_unflatten(treedef, [
                    m * x for m, x in zip(masks, jax.tree_util.tree_leaves(tree))])

            # One subspace-iteration step; the host loops `iters` times (one compile whatever iters is).
            v = restrict(vecs)
            # Orthonormalise the k vectors (symmetric orthogonalisation through the k x k Gram).
            g = dot(v, v, masks)
            s, u = jnp.linalg.eigh(g)
            # Directions with ~zero norm (a layer with fewer than k parameters) are dropped
            # instead of amplified: they then contribute zero Ritz values.
            keep = s > 1e-6 * jnp.max(s)
            inv = u @ jnp.diag(jnp.where(keep, jax.lax.rsqrt(jnp.where(keep, s, 1.0)), 0.0)) @ u.T
            q = jax.tree_util.tree_map(lambda x: jnp.tensordot(inv, x, axes=1), v)
            w = restrict(jax.vmap(hvp, in_axes=(None, None, None, 0))(p, batch, aux, q))
            t = dot(q, w, masks)  # Q^T H_ll Q
            # Next basis: H Q itself (plain subspace iteration; the Ritz rotation is done on the host
            # from t by the core's `ritz`, which is all the eigenvalues need).
            new = w
            # Keep the other layers' warm-start vectors; replace this layer's.
            merged = jax.tree_util.tree_unflatten(treedef, [
                jnp.where(m > 0, n, o) for m, n, o in zip(
                    masks, jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(vecs))])
            return merged, t

        self._run_layer = jax.jit(run_layer, donate_argnums=(3,))

    def _init_vectors(self, params: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(params)
        keys = jax.random.split(self._key, len(leaves))
        return jax.tree_util.tree_unflatten(treedef, [
            jax.random.normal(kk, (self.k,) + jnp.shape(x), jnp.float32) for kk, x in zip(keys, leaves)])

    def _select(self) -> list[int]:
        """Layers to recompute: all without an estimate, plus the next `layers_per_event` of a
        round-robin cycle (all layers when None). The others keep their last estimate."""
        L = self.layers.num_layers
        missing = [i for i in range(L) if np.isnan(self.eigvals[i]).any()]
        per = self.layers_per_event
        if per is None or per >= L:
            return list(range(L))
        if len(missing) == L:
            return missing
        chosen = {(self._cursor + j) % L for j in range(per)}
        self._cursor = (self._cursor + per) % L
        return sorted(chosen.union(missing))

    def footprint(self, params: Any, batch: Any, aux: Any = None) -> int | None:
        """Bytes one jitted subspace-iteration step (the vmapped HVP of k vectors) needs on `batch`
        beyond its arguments, from XLA's compiled memory analysis; None before the first call
        (no warm-start vectors yet) or where there is no analysis. The k warm-start vectors are
        resident between calls: they count as memory in use, not here."""
        if self.vectors is None:
            return None
        return compiled_footprint(self._run_layer, params, batch, aux, self.vectors, jnp.int32(0))

    def __call__(self, params: Any, batch: Any, aux: Any = None) -> np.ndarray:
        """float64 (L, k): top-k Ritz values (descending) of each layer's Hessian block on `batch`.

        Layers not refreshed this call (see `layers_per_event`) report their previous estimate;
        a layer's first estimate runs `cold_iters` iterations, later ones `iters` (warm start).
        """
        if self.vectors is None or jax.tree_util.tree_structure(self.vectors) != jax.tree_util.tree_structure(params):
            self.vectors = self._init_vectors(params)
            self.eigvals[:] = np.nan
        selected = self._select()
        for layer in selected:
            iters = self.cold_iters if np.isnan(self.eigvals[layer]).any() else self.iters
            for _ in range(iters):
                self.vectors, t = self._run_layer(params, batch, aux, self.vectors, jnp.int32(layer))
            self.eigvals[layer] = ritz(np.asarray(t, dtype=np.float64))[0]
        self.refreshed = tuple(selected)
        return self.eigvals.copy()
