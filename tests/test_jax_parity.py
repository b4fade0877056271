"""Cross-framework parity: the JAX backend's statistics and the controller's decisions equal the
torch side's for the same weights and batches.

The torch side here is the torch backend's layer discovery + `triaccel.kernels.grad_moments` on the
torch gradients + the core's grouping/variance maths (the torch optimizer wrapper is another
helper's work; this is the path it feeds the Controller with).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from test_jax_backend import mlp_data, mlp_loss, mlp_params  # noqa: E402
from triaccel import Controller, TriAccelConfig  # noqa: E402
from triaccel.backends.jax import TriAccel, find_state, loss_scale  # noqa: E402
from triaccel.backends.torch.layers import discover_layers, tensor_layer_index  # noqa: E402
from triaccel.kernels.grad_moments import grad_moments  # noqa: E402
from triaccel.stats import group_by_layer, variance_from_moments  # noqa: E402


class TorchMLP(torch.nn.Module):
    def __init__(self, params: dict) -> None:
        super().__init__()
        for name in ("l1", "l2"):
            k = np.asarray(params[name]["kernel"])
            lin = torch.nn.Linear(k.shape[0], k.shape[1])
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(k.T.copy()))
                lin.bias.copy_(torch.from_numpy(np.array(params[name]["bias"])))
            setattr(self, name, lin)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


def _torch_layer_var(model, layers, x, y):
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(torch.from_numpy(np.asarray(x))),
                                      torch.from_numpy(np.asarray(y)).long()).backward()
    params, index = tensor_layer_index(layers)
    m = grad_moments([p.grad for p in params])
    L = len(layers)
    sums = group_by_layer(m.sum.numpy(), np.array(index), L)
    sqs = group_by_layer(m.sumsq.numpy(), np.array(index), L)
    counts = group_by_layer(np.array([p.numel() for p in params]), np.array(index), L)
    return sums, sqs, counts


def test_statistics_and_decisions_match_torch():
    cfg = TriAccelConfig(curvature="off", precision_law="variance", t_ctrl=4, warmup_steps=4, min_dwell=0,
                         batch_init=16, batch_min=8, batch_max=64)   # the paper's variance law (calibration, FP16)
    params = mlp_params()
    ta = TriAccel(cfg)
    tx = ta.wrap(optax.sgd(0.1))
    state = tx.init(params)
    tmodel = TorchMLP(params)
    tlayers = discover_layers(tmodel)
    assert [l.spec for l in tlayers] == list(ta.layers.specs)
    tctl = Controller(cfg, [l.spec for l in tlayers])
    x, y = mlp_data(16 * 9)
    upd = jax.jit(tx.update)
    for s in range(9):
        state = ta.control(s, state)
        td = tctl.decide(s)
        jd = ta.decision
        assert jd.precisions == td.precisions and jd.batch_size == td.batch_size
        np.testing.assert_allclose(jd.lr_multipliers, td.lr_multipliers, rtol=1e-12)
        if s == 8:  # both controllers have now seen steps 0..7 and decided at boundaries 0, 4, 8
            break
        xb, yb = x[16 * s:16 * (s + 1)], y[16 * s:16 * (s + 1)]
        scale = loss_scale(state)  # > 1 once a layer is FP16: the wrapped tx unscales
        _, state = upd(jax.grad(lambda p: mlp_loss(p, (xb, yb)) * scale)(params), state, params)  # params fixed
        sums, sqs, counts = _torch_layer_var(tmodel, tlayers, xb, yb)
        tctl.observe_grad_moments(s, sums, sqs, counts)
        # The JAX ring row of this step holds the same per-layer moments.
        row = np.asarray(find_state(state).moments[s % cfg.t_ctrl], np.float64)
        jsum = group_by_layer(row[:, 0], ta._tensor_layer, ta.layers.num_layers)
        jsq = group_by_layer(row[:, 1], ta._tensor_layer, ta.layers.num_layers)
        np.testing.assert_allclose(jsum, sums, rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(jsq, sqs, rtol=1e-5)
        np.testing.assert_allclose(variance_from_moments(jsum, jsq, counts),
                                   variance_from_moments(sums, sqs, counts), rtol=1e-4)
    assert any(p.short == "fp16" for p in ta.decision.precisions)  # loss scaling was exercised
    # Both controllers calibrated thresholds and took their decisions from the same numbers.
    a, b = ta.controller.report(), tctl.report()
    for name in a["layers"]:
        assert a["layers"][name]["precision"] == b["layers"][name]["precision"]
        assert a["layers"][name]["var_ema"] == pytest.approx(b["layers"][name]["var_ema"], rel=1e-4)
