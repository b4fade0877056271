"""Curvature of the JAX backend against dense references on a small MLP (CPU, seconds)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.flatten_util import ravel_pytree

from test_jax_backend import SmallCNN, cnn_loss, image_data, mlp_data, mlp_loss, mlp_params
from triaccel.backends.jax import FisherTopK, HessianTopK, layer_map, nnx_loss


def _pure(params, batch, aux):
    return mlp_loss(params, batch)


def _layer_fn(params, name, f):
    """f restricted to one layer's flat parameter vector (others fixed)."""
    flat, unravel = ravel_pytree(params[name])
    return flat, lambda v: f({**params, name: unravel(v)})


def test_hessian_top1_matches_dense_block():
    params, batch = mlp_params(), mlp_data()
    lm = layer_map(params)
    est = HessianTopK(_pure, lm, k=3, iters=40)
    eig = est(params, batch)
    assert eig.shape == (2, 3)
    for i, name in enumerate(lm.names):
        flat, g = _layer_fn(params, name, lambda p: mlp_loss(p, batch))
        dense = np.linalg.eigvalsh(np.asarray(jax.jit(jax.hessian(g))(flat), np.float64))
        top = dense[np.argmax(np.abs(dense))]
        assert eig[i, 0] == pytest.approx(top, rel=0.05), (name, eig[i], dense[-3:])
    # Warm start: a further call of one iteration stays converged.
    est.iters = 1
    np.testing.assert_allclose(est(params, batch)[:, 0], eig[:, 0], rtol=0.02)


def test_fisher_topk_matches_explicit_fisher_block():
    params, (x, y) = mlp_params(), mlp_data(16)
    lm = layer_map(params)
    eig = FisherTopK(_pure, lm, k=4)(params, (x, y))
    for i, name in enumerate(lm.names):
        rows = []
        for j in range(x.shape[0]):
            g = jax.grad(lambda p: mlp_loss(p, (x[j:j + 1], y[j:j + 1])))(params)
            rows.append(np.asarray(ravel_pytree(g[name])[0], np.float64))
        G = np.stack(rows)
        dense = np.linalg.eigvalsh(G.T @ G / len(rows))[::-1]
        np.testing.assert_allclose(eig[i], dense[:4], rtol=0.05, atol=1e-6 * dense[0])
        assert eig[i, 0] == pytest.approx(dense[0], rel=0.05)


def test_curvature_on_nnx_model_leaves_batch_stats_and_mode_alone():
    model = SmallCNN(nnx.Rngs(0))
    model.train()
    before = jax.tree_util.tree_map(np.asarray, nnx.state(model, nnx.BatchStat))
    x, y = image_data(8)
    pure = nnx_loss(model, cnn_loss)
    lm = layer_map(model)
    # (The Fisher path through nnx_loss runs in test_jax_backend's training test.)
    eig = HessianTopK(pure.fn, lm, k=2, iters=2)(pure.params, (x, y), pure.aux)
    assert eig.shape == (4, 2) and np.isfinite(eig).all()
    after = nnx.state(model, nnx.BatchStat)
    for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after)):
        np.testing.assert_array_equal(a, b)
    assert model.bn1.use_running_average is False  # the user's model stays in train mode
    assert (eig[:, 0] >= eig[:, 1]).all()  # descending Ritz values


def test_hessian_round_robin_refreshes_a_subset():
    params, batch = mlp_params(), mlp_data()
    est = HessianTopK(_pure, layer_map(params), k=2, iters=1, cold_iters=3, layers_per_event=1)
    first = est(params, batch)
    assert est.refreshed == (0, 1) and np.isfinite(first).all()
    second = est(params, batch)
    assert est.refreshed == (0,)
    np.testing.assert_array_equal(second[1], first[1])  # not refreshed: previous estimate kept
    est(params, batch)
    assert est.refreshed == (1,)


def test_bad_k_raises():
    with pytest.raises(ValueError, match="k=0"):
        FisherTopK(_pure, layer_map(mlp_params()), k=0)
    with pytest.raises(ValueError, match="iters=0"):
        HessianTopK(_pure, layer_map(mlp_params()), k=1, iters=0)
