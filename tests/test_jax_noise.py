"""JAX side of the gradient-noise measurement, the evidence precision law's inputs, report() and FLOPs.

(a) a noise step's squared norms equal those of jax.grad on each half; (b) other steps do no extra
work; (c) non-finite values and a loss-scale collapse reach the controller from the wrapper; (d)
report() is current whenever read; (e) layer_flops equals torch's FlopCounterMode on the twin model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from test_jax_backend import mlp_data, mlp_loss, mlp_params
from triaccel import Controller, Precision, TriAccelConfig
from triaccel.backends.jax import LossScaleConfig, SplitStep, TriAccel, layer_map_from_params, loss_scale
from triaccel.backends.jax import data as jdata
from triaccel.backends.jax.data import ElasticLoader, elastic_step

pytestmark = pytest.mark.filterwarnings("ignore:triaccel. device:RuntimeWarning")

BUCKETS = (8, 16, 32, 64)
SCALE = 1024.0


def _params():
    rng = np.random.default_rng(0)
    return {"fc1": {"kernel": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
                    "bias": jnp.asarray(rng.normal(size=(4,)), jnp.float32)},
            "fc2": {"kernel": jnp.asarray(rng.normal(size=(4, 1)), jnp.float32),
                    "bias": jnp.zeros((1,), jnp.float32)}}


def _loss(params, batch, mask):
    h = jnp.tanh(batch["x"] @ params["fc1"]["kernel"] + params["fc1"]["bias"])
    err = (h @ params["fc2"]["kernel"] + params["fc2"]["bias"])[:, 0] - batch["t"]
    return jnp.sum(err ** 2 * mask) / jnp.sum(mask)


def _arrays(n=64):
    rng = np.random.default_rng(1)
    return {"x": rng.normal(size=(n, 3)).astype(np.float32), "t": rng.normal(size=(n,)).astype(np.float32)}


def _setup(**kw):
    params = _params()
    lm = layer_map_from_params(params)
    cfg = TriAccelConfig(**{**dict(t_ctrl=1, warmup_steps=0, batch_init=16, batch_min=8, batch_max=64,
                                   batch_buckets=BUCKETS, adaptive_precision=False), **kw})
    ctl = Controller(cfg, lm.specs)
    calls = []
    observe = ctl.observe_gradient_noise

    def spy(step, sizes, micro, total):
        calls.append((step, list(sizes), np.array(micro, np.float64), np.array(total, np.float64)))
        observe(step, sizes, micro, total)

    ctl.observe_gradient_noise = spy
    loader = ElasticLoader(_arrays(), batch_size=cfg.batch_init, seed=3)
    vg = jax.jit(jax.value_and_grad(lambda p, b, m: _loss(p, b, m) * SCALE))
    return params, lm, ctl, calls, loader, (lambda b, m: vg(params, b, m))


def _layer_sqnorms(grads, lm):
    sq = np.array([float(jnp.sum(jnp.square(g))) for g in jax.tree_util.tree_leaves(grads)])
    out = np.zeros(lm.num_layers)
    np.add.at(out, lm.tensor_layer_of(grads), sq)
    return out


def _direct_grad(params, idx):
    arr = _arrays()
    batch = {k: jnp.asarray(v[idx]) for k, v in arr.items()}
    return jax.grad(_loss)(params, batch, jnp.ones(len(idx), jnp.float32))


@pytest.mark.parametrize("scale_kind", ["float", "callable"])
def test_noise_step_squared_norms_equal_direct_gradients(scale_kind):
    params, lm, ctl, calls, loader, grad_fn = _setup()
    assert ctl.is_noise_step(0)
    idx = loader.sampler.permutation(0)[:16]
    scale = SCALE if scale_kind == "float" else (lambda: jnp.asarray(SCALE))
    res = elastic_step(loader, ctl, grad_fn, 0, tensor_layer=lm, grad_scale=scale)
    assert res.micro_sizes == [8, 8] and len(calls) == 1
    step, sizes, micro, total = calls[0]
    assert step == 0 and sizes == [8, 8]
    for half, got in zip((idx[:8], idx[8:]), micro):   # each half's mean gradient, unscaled
        np.testing.assert_allclose(got, _layer_sqnorms(_direct_grad(params, half), lm), rtol=1e-5)
    np.testing.assert_allclose(total, _layer_sqnorms(_direct_grad(params, idx), lm), rtol=1e-5)
    # The accumulated gradient is the step's (scaled) mean gradient, as on any other step.
    for a, b in zip(jax.tree_util.tree_leaves(res.grads), jax.tree_util.tree_leaves(_direct_grad(params, idx))):
        np.testing.assert_allclose(np.asarray(a) / SCALE, b, rtol=1e-5, atol=1e-7)
    assert ctl._noise.count == 1


def test_doubled_noise_step_takes_two_batches_and_their_mean_gradient():
    params, lm, ctl, calls, loader, grad_fn = _setup(noise_split="double", short_step_lr="linear")
    idx = loader.sampler.permutation(0)[:32]
    res = elastic_step(loader, ctl, grad_fn, 0, tensor_layer=lm, grad_scale=SCALE)
    assert res.micro_sizes == [16, 16] and res.samples == 32 and calls[0][1] == [16, 16]
    for half, got in zip((idx[:16], idx[16:]), calls[0][2]):
        np.testing.assert_allclose(got, _layer_sqnorms(_direct_grad(params, half), lm), rtol=1e-5)
    # weight 1: the 32 samples' mean gradient, as the step's gradient (at the LR of 16)
    for a, b in zip(jax.tree_util.tree_leaves(res.grads), jax.tree_util.tree_leaves(_direct_grad(params, idx))):
        np.testing.assert_allclose(np.asarray(a) / SCALE, b, rtol=1e-5, atol=1e-7)


def test_noise_step_needs_a_layer_map_for_several_layers():
    _, lm, ctl, calls, loader, grad_fn = _setup()
    with pytest.raises(ValueError, match="tensor_layer"):
        elastic_step(loader, ctl, grad_fn, 0)
    assert loader.sampler.in_flight == 0 and not calls      # nothing taken
    # A callable and a plain index array map the leaves too.
    elastic_step(loader, ctl, grad_fn, 0, tensor_layer=lambda g: lm.tensor_layer_of(g), grad_scale=SCALE)
    elastic_step(loader, ctl, grad_fn, 1, tensor_layer=lm.tensor_layer, grad_scale=SCALE)
    assert [c[0] for c in calls] == [0, 1]


def test_other_steps_run_as_before(monkeypatch):
    _, lm, ctl, calls, loader, grad_fn = _setup(t_noise=2)

    def no_dispatch(*a, **k):
        raise AssertionError("a step that is not a noise step computed squared norms")

    monkeypatch.setattr(jdata, "_micro_sqnorms", no_dispatch)
    monkeypatch.setattr(jdata, "_noise_rows", no_dispatch)
    assert not ctl.is_noise_step(1)
    idx = loader.sampler.permutation(0)[:16]
    res = elastic_step(loader, ctl, grad_fn, 1)   # no tensor_layer needed off noise steps
    assert res.micro_sizes == [16] and not calls
    _, ref = grad_fn(*ElasticLoader(_arrays(), batch_size=16, buckets=BUCKETS).fetch(idx))
    for a, b in zip(jax.tree_util.tree_leaves(res.grads), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))   # the grads as given, untouched


# -- (c) evidence from the wrapper ------------------------------------------------------------------

def _poisoned(grads, layer):
    """grads with a NaN in one element of `layer`'s kernel."""
    return jax.tree_util.tree_map_with_path(
        lambda p, g: g.at[(0,) * g.ndim].set(jnp.nan) if jax.tree_util.keystr(p) == f"['{layer}']['kernel']" else g,
        grads)


def test_nonfinite_layer_goes_fp32_at_next_decision_others_stay_16bit():
    params = mlp_params(sizes=(6, 5, 4, 3))
    cfg = TriAccelConfig(precision_law="evidence", t_ctrl=2, warmup_steps=0, min_dwell=10, batch_law="memory")
    ta = TriAccel(cfg, loss_fn=mlp_loss)
    tx = ta.wrap(optax.sgd(0.1))
    state = tx.init(params)
    upd = jax.jit(tx.update)
    x, y = mlp_data(32, din=6)
    grads = jax.grad(mlp_loss)(params, (x, y))
    state = ta.control(0, state)
    assert ta.decision.precisions == (Precision.BF16,) * 3
    _, state = upd(_poisoned(grads, "l2"), state, params)     # step 0: skipped on the device
    state = ta.control(1, state)
    _, state = upd(grads, state, params)
    state = ta.control(2, state)                              # reads both rows, decides
    assert ta.decision.precisions == (Precision.BF16, Precision.FP32, Precision.BF16)
    assert ta.rows_skipped == 1 and ta.skipped_steps == 1


def test_loss_scale_collapse_promotes_fp16_layers():
    params = mlp_params()
    cfg = TriAccelConfig(precision_law="evidence", base_precision="fp16", t_ctrl=4, warmup_steps=0,
                         min_dwell=10, batch_law="memory")
    ta = TriAccel(cfg, loss_fn=mlp_loss, loss_scaling=LossScaleConfig(init=2.0))
    tx = ta.wrap(optax.sgd(0.1))
    state = tx.init(params)
    upd = jax.jit(tx.update)
    grads = jax.grad(mlp_loss)(params, mlp_data())
    state = ta.control(0, state)
    assert ta.decision.precisions == (Precision.FP16,) * 2 and float(loss_scale(state)) == 2.0
    for s in range(4):   # an FP16 layer's overflow under scaling is the scaler's: backs off 2 -> 1/8
        _, state = upd(_poisoned(grads, "l1"), state, params)
        state = ta.control(s + 1, state)
    assert ta.report()["loss_scale"] == 0.125 and ta.skipped_steps == 4
    assert ta.decision.precisions == (Precision.FP32,) * 2     # the scale fell below 1: collapse


# -- (d) report() current at read time --------------------------------------------------------------

class _MLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(6, 5, rngs=rngs)
        self.fc2 = nnx.Linear(5, 3, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jnp.tanh(self.fc1(x)))


def _nnx_step(model, opt, x, y, poison):
    def lf(m):
        return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean() * loss_scale(opt.opt_state)
    g = nnx.grad(lf)(model)
    bad = jnp.where(poison, jnp.nan, 1.0)
    g = jax.tree_util.tree_map_with_path(lambda p, v: v * bad if "fc2" in jax.tree_util.keystr(p) else v, g)
    opt.update(model, g)


def test_report_counts_current_whenever_read():
    x, y = mlp_data(16, din=6)
    for use_split in (False, True):
        model = _MLP(nnx.Rngs(0))
        ta = TriAccel(TriAccelConfig(t_ctrl=100, batch_law="memory"), model)
        opt = nnx.Optimizer(model, ta.wrap(optax.sgd(0.1)), wrt=nnx.Param)
        if use_split:
            run = SplitStep(_nnx_step, model, opt, ta=ta)
            control = run.control
        else:
            jitted = nnx.jit(_nnx_step)
            run = lambda *a: jitted(model, opt, *a)  # noqa: E731
            control = lambda s: ta.control(s, opt, model)  # noqa: E731
        control(0)
        for s, poison in enumerate([False, True, False, True]):
            control(s)                                        # off boundaries after 0: nothing read
            run(x, y, jnp.asarray(poison))
        rep = ta.report(run) if use_split else ta.report()  # mid-window: read at once
        assert (rep["skipped_steps"], rep["rows_skipped"], rep["optimizer_step"]) == (2, 2, 4), use_split
        assert ta.last_fed == 3
        assert ta.controller._precision.evidence_until[ta.layers.index("fc2")] > 0   # fed as evidence
        assert ta.report(run if use_split else None)["rows_skipped"] == 2   # read again: not counted twice


# -- (e) FLOPs ----------------------------------------------------------------------------------------

def test_layer_flops_equal_torch_on_twin_resnet18():
    torch = pytest.importorskip("torch")
    from triaccel.backends.jax import models as jm
    from triaccel.backends.jax.flops import layer_flops
    from triaccel.backends.jax.layers import layer_map_from_model
    from triaccel.backends.torch import models as tm
    from triaccel.backends.torch.flops import layer_flops as torch_layer_flops
    from triaccel.backends.torch.layers import discover_layers

    t = tm.create_model("resnet18", num_classes=10, width=0.25, seed=0)
    j = jm.create_model("resnet18", num_classes=10, width=0.25, seed=0)
    tl, lm = discover_layers(t), layer_map_from_model(j)
    assert [l.name for l in tl] == list(lm.names)
    ft = torch_layer_flops(t, tl, torch.zeros(1, 3, 32, 32))
    fj = layer_flops(j, jnp.zeros((1, 32, 32, 3)), lm)
    np.testing.assert_array_equal(fj, ft)
    assert fj.sum() > 0 and all(fj[i] == 0 for i, s in enumerate(lm.specs) if s.kind == "norm")
    with pytest.raises(ValueError, match="one sample"):
        layer_flops(j, jnp.zeros((2, 32, 32, 3)), lm)
