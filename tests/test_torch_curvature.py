"""Per-layer curvature of the torch backend against dense eigendecompositions (small MLP, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from triaccel.backends.torch.curvature import CurvatureEstimator
from triaccel.backends.torch.layers import discover_layers


def _mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    with torch.no_grad():
        m.train()
        m(torch.randn(64, 6))  # non-trivial running statistics
    return m, x, y


def _dense_blocks(m: nn.Module, layers, x, y):
    """Per layer: (Hessian block, explicit empirical Fisher) in eval mode, float64."""
    m.eval()
    out = []
    for layer in layers:
        ps = [p for _, p in layer.params]
        sizes = [p.numel() for p in ps]
        flat0 = torch.cat([p.detach().reshape(-1) for p in ps])

        def f(v, layer=layer, sizes=sizes):
            d = {n: c.reshape(p.shape) for (n, p), c in zip(layer.params, v.split(sizes))}
            return F.cross_entropy(functional_call(m, d, (x,), strict=False), y)

        h = torch.autograd.functional.hessian(f, flat0).double()
        gs = []
        for i in range(x.shape[0]):
            g = torch.autograd.grad(F.cross_entropy(m(x[i:i + 1]), y[i:i + 1]), ps)
            gs.append(torch.cat([t.reshape(-1) for t in g]))
        gmat = torch.stack(gs).double()
        out.append((h, gmat.T @ gmat / x.shape[0]))
    m.train()
    return out


@pytest.mark.parametrize("mode", ["fisher", "hessian"])
def test_top1_matches_dense_block(mode: str) -> None:
    m, x, y = _mlp()
    layers = discover_layers(m)
    assert [l.spec.kind for l in layers] == ["other", "other", "norm", "other"]
    rm, rv = m[3].running_mean.clone(), m[3].running_var.clone()
    nbt = m[3].num_batches_tracked.clone()
    est = CurvatureEstimator(m, layers, F.cross_entropy, mode, 3, hessian_iters_cold=8)
    eig = est((x, y))
    assert eig.shape == (len(layers), 3)
    # BatchNorm statistics and train flags untouched by the curvature pass
    assert torch.equal(rm, m[3].running_mean) and torch.equal(rv, m[3].running_var)
    assert torch.equal(nbt, m[3].num_batches_tracked)
    assert m.training and all(mod.training for mod in m.modules())
    assert all(p.grad is None for p in m.parameters())
    for i, (h, fis) in enumerate(_dense_blocks(m, layers, x, y)):
        dense = torch.linalg.eigvalsh(h if mode == "hessian" else fis)
        top1 = float(dense[-1])
        assert top1 > 0
        assert abs(eig[i, 0] - top1) <= 0.05 * abs(top1), (mode, layers[i].name, eig[i, 0], top1)
        assert np.all(np.diff(eig[i]) <= 1e-9)  # descending
    if mode == "fisher":  # the Gram route is exact, not only within 5%
        for i, (_, fis) in enumerate(_dense_blocks(m, layers, x, y)):
            np.testing.assert_allclose(eig[i], torch.linalg.eigvalsh(fis).flip(0)[:3].numpy(), rtol=1e-4,
                                       atol=1e-7)


def test_hessian_warm_start_keeps_estimate() -> None:
    m, x, y = _mlp()
    layers = discover_layers(m)
    est = CurvatureEstimator(m, layers, F.cross_entropy, "hessian", 2, hessian_iters=1, hessian_iters_cold=8)
    first = est((x, y))
    # One warm iteration per event from the stored subspace stays at the converged top eigenvalue.
    second = est((x, y))
    np.testing.assert_allclose(second[:, 0], first[:, 0], rtol=1e-3)


def test_small_block_is_exact_and_padded() -> None:
    torch.manual_seed(1)
    m = nn.Sequential(nn.Linear(2, 1), nn.Tanh(), nn.Linear(1, 2))  # first block: 3 params, last: 4
    x, y = torch.randn(8, 2), torch.randint(0, 2, (8,))
    layers = discover_layers(m)
    est = CurvatureEstimator(m, layers, F.cross_entropy, "hessian", 5, hessian_iters_cold=4)
    eig = est((x, y))
    (h0, _), (h1, _) = _dense_blocks(m, layers, x, y)
    np.testing.assert_allclose(eig[0, :3], torch.linalg.eigvalsh(h0).flip(0).numpy(), rtol=1e-4, atol=1e-6)
    assert np.all(eig[0, 3:] == eig[0, 2])  # a 3x3 block has 3 eigenvalues: padded with its smallest
    np.testing.assert_allclose(eig[1, :4], torch.linalg.eigvalsh(h1).flip(0).numpy(), rtol=1e-4, atol=1e-6)


def test_bad_arguments() -> None:
    m, x, y = _mlp()
    layers = discover_layers(m)
    with pytest.raises(ValueError, match="mode"):
        CurvatureEstimator(m, layers, F.cross_entropy, "gauss", 2)
    with pytest.raises(ValueError, match="top_k"):
        CurvatureEstimator(m, layers, F.cross_entropy, "fisher", 0)
    est = CurvatureEstimator(m, layers, F.cross_entropy, "fisher", 2)
    with pytest.raises(ValueError, match="batch"):
        est((x, y[:3]))
    with pytest.raises(ValueError, match="inputs, targets"):
        est(x)


def test_packed_blocks_equal_per_layer_calls() -> None:
    # Disjoint probe rows: packing all layers into one batched second backward is still exact.
    m, x, y = _mlp()
    layers = discover_layers(m)
    one = CurvatureEstimator(m, layers, F.cross_entropy, "hessian", 3, hessian_iters_cold=6, hessian_pack=1)
    allp = CurvatureEstimator(m, layers, F.cross_entropy, "hessian", 3, hessian_iters_cold=6,
                              hessian_pack=len(layers))
    for _ in range(2):  # cold event, then a warm one
        np.testing.assert_allclose(allp((x, y)), one((x, y)), rtol=1e-4, atol=1e-6)


def test_warm_power_step_converges_across_events() -> None:
    # One iteration per event (cold included): the carried (H - sigma I) y start refines the
    # subspace event after event, so the estimate reaches the dense top eigenvalue.
    m, x, y = _mlp()
    layers = discover_layers(m)
    est = CurvatureEstimator(m, layers, F.cross_entropy, "hessian", 2, hessian_iters=1, hessian_iters_cold=1)
    dense = [float(torch.linalg.eigvalsh(h)[-1]) for h, _ in _dense_blocks(m, layers, x, y)]
    first = est((x, y))
    for _ in range(15):
        eig = est((x, y))
    for i, top1 in enumerate(dense):
        assert abs(eig[i, 0] - top1) <= 0.05 * abs(top1), (layers[i].name, eig[i, 0], top1)
    assert max(abs(first[i, 0] - t) / abs(t) for i, t in enumerate(dense)) > 0.01  # it did have to converge


def test_round_robin_refreshes_subset_and_keeps_the_rest() -> None:
    m, x, y = _mlp()
    layers = discover_layers(m)
    est = CurvatureEstimator(m, layers, F.cross_entropy, "hessian", 2, hessian_iters_cold=6,
                             hessian_layers_per_event=3)
    first = est((x, y))
    assert est.refreshed == (0, 1, 2, 3)  # no estimate yet: every layer
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1.5)  # a different Hessian: refreshed rows must change, the others must not
    second = est((x, y))
    assert est.refreshed == (0, 1, 2)
    assert np.array_equal(second[3], first[3])
    assert not np.allclose(second[:3, 0], first[:3, 0])
    third = est((x, y))
    assert est.refreshed == (0, 1, 3)  # cycle wraps: 3, 0, 1
    assert np.array_equal(third[2], second[2])
    est.reset()
    est((x, y))
    assert est.refreshed == (0, 1, 2, 3)


def test_bad_hessian_options() -> None:
    m, _, _ = _mlp()
    layers = discover_layers(m)
    with pytest.raises(ValueError, match="hessian_layers_per_event"):
        CurvatureEstimator(m, layers, F.cross_entropy, "hessian", 2, hessian_layers_per_event=0)
    with pytest.raises(ValueError, match="hessian_pack"):
        CurvatureEstimator(m, layers, F.cross_entropy, "hessian", 2, hessian_pack=0)
    with pytest.raises(ValueError, match="hessian_iters"):
        CurvatureEstimator(m, layers, F.cross_entropy, "hessian", 2, hessian_iters=0)
