"""Small Flax models and data shared by the tests/test_jax_*.py files (CPU, seconds)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


class SmallCNN(nnx.Module):
    """conv1 -> bn1 -> conv2 (stride 2) -> global mean -> fc; torch-style module names."""

    def __init__(self, rngs: nnx.Rngs, classes: int = 4) -> None:
        self.conv1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(8, rngs=rngs)
        self.conv2 = nnx.Conv(8, 8, (3, 3), strides=2, rngs=rngs)
        self.fc = nnx.Linear(8, classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.bn1(self.conv1(x)))
        x = nnx.relu(self.conv2(x))
        return self.fc(x.mean((1, 2)))


def cnn_loss(model: nnx.Module, batch: tuple) -> jax.Array:
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def image_data(n: int = 64, seed: int = 0, classes: int = 4) -> tuple[jax.Array, jax.Array]:
    """Learnable toy images: the label shifts the mean of one channel."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    x = rng.normal(size=(n, 8, 8, 3)).astype(np.float32)
    x[..., 0] += (y[:, None, None] - classes / 2) * 0.8
    return jnp.asarray(x), jnp.asarray(y)


def mlp_params(seed: int = 0, sizes: tuple = (6, 5, 3)) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        out[f"l{i + 1}"] = {"kernel": jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a), jnp.float32),
                            "bias": jnp.asarray(rng.normal(size=(b,)) * 0.1, jnp.float32)}
    return out


def mlp_apply(params: dict, x: jax.Array) -> jax.Array:
    n = len(params)
    for i in range(n):
        p = params[f"l{i + 1}"]
        x = x @ p["kernel"] + p["bias"]
        if i < n - 1:
            x = jnp.tanh(x)
    return x


def mlp_loss(params: dict, batch: tuple) -> jax.Array:
    x, y = batch
    logits = mlp_apply(params, x)
    # one-hot form: cheaper to compile under jvp-of-grad than a gather of the label column
    return -(jax.nn.one_hot(y, logits.shape[-1]) * jax.nn.log_softmax(logits)).sum(-1).mean()


def mlp_data(n: int = 32, seed: int = 1, din: int = 6, classes: int = 3) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(n, din)), jnp.float32), jnp.asarray(rng.integers(0, classes, n)))


# ------------------------------------------------------------------------------------------------
# Tests (helpers above are also imported by test_jax_curvature.py / test_jax_parity.py)
# ------------------------------------------------------------------------------------------------

import json  # noqa: E402
import warnings  # noqa: E402

import flax.serialization  # noqa: E402
import pytest  # noqa: E402

from triaccel import Precision, TriAccelConfig  # noqa: E402
from triaccel.backends.jax import transform as transform_mod  # noqa: E402
from triaccel.backends.jax import (MemoryProbe, SplitStep, TriAccel, current_policy, find_state, layer_map,  # noqa: E402
                                   loss_scale, precision_policy, wrap)

pytestmark = pytest.mark.filterwarnings("ignore:triaccel. device:RuntimeWarning")

FAST = dict(t_ctrl=4, t_curv=8, warmup_steps=4, min_dwell=0, batch_init=16, batch_min=8, batch_max=64,
            top_k=2, b_curv=8)


def _train_cnn(inner: optax.GradientTransformation, steps: int, curvature: str = "fisher", **cfg: Any):
    x, y = image_data()
    model = SmallCNN(nnx.Rngs(0))
    ta = TriAccel(TriAccelConfig(curvature=curvature, **FAST, **cfg), model, loss_fn=cnn_loss)
    opt = nnx.Optimizer(model, ta.wrap(inner), wrt=nnx.Param)

    @ta.jit
    def step(model, opt, x, y):
        def lf(m):
            return cnn_loss(m, (x, y)) * loss_scale(opt.opt_state)
        l, g = nnx.value_and_grad(lf)(model)
        opt.update(model, g)
        return l / loss_scale(opt.opt_state)

    losses = []
    for s in range(steps):
        ta.control(s, opt, model, batch=(x[:8], y[:8]))
        i = (s * 16) % 64
        losses.append(float(step(model, opt, x[i:i + 16], y[i:i + 16])))
    return ta, model, opt, losses


@pytest.mark.parametrize("name,inner", [("sgd", optax.sgd(0.1, momentum=0.9)), ("adamw", optax.adamw(1e-2))])
def test_wrapped_optimizer_trains_cnn(name, inner):
    ta, model, opt, losses = _train_cnn(inner, 24)
    assert np.mean(losses[-4:]) < 0.8 * np.mean(losses[:4]), losses
    rep = ta.report()
    # The policy left the base precision (variance thresholds calibrated after warm-up) and the
    # model's dtypes follow the decision; norm layers stay FP32.
    assert current_policy(model, ta.layers) == tuple(p.short for p in ta.decision.precisions)
    assert rep["layers"]["bn1"]["precision"] == "fp32"
    assert all(rep["layers"][n]["lambda_max"] is not None for n in ("conv1", "conv2", "fc"))
    # One trace per distinct policy seen at the boundaries, no more.
    policies = {tuple(r["precisions"]) for r in ta.controller.telemetry.records if r["step"] >= 0}
    assert 1 <= rep["compilations"] <= len(policies) + 1
    assert int(find_state(opt.opt_state).count.get_value()) == 24


def test_xla_moments_train_as_the_kernel_path():
    """kernels="xla" (XLA's reductions in the update): the same losses, decisions and statistics as
    the kernel's jnp reference over a run with precision changes."""
    runs = [_train_cnn(optax.sgd(0.1, momentum=0.9), 24, curvature="off", precision_law="variance", kernels=k)
            for k in ("reference", "xla")]
    (ta_a, _, _, loss_a), (ta_x, _, _, loss_x) = runs
    np.testing.assert_allclose(loss_x, loss_a, rtol=1e-5)
    rec = [[(r["step"], r["precisions"]) for r in ta.controller.telemetry.records] for ta in (ta_a, ta_x)]
    assert rec[0] == rec[1] and len({tuple(p) for _, p in rec[0]}) >= 2   # the policy changed, alike
    for a, b in zip(ta_a.controller.telemetry.records, ta_x.controller.telemetry.records):
        assert [v or 0.0 for v in b["var_ema"]] == pytest.approx([v or 0.0 for v in a["var_ema"]], rel=1e-4)


@pytest.mark.parametrize("kernels,impl", [("auto", "xla"), ("triton", "triton")])
def test_jax_auto_kernels_take_xla_statistics(monkeypatch, kernels, impl):
    """Under JAX, kernels="auto" asks the statistics of XLA's per-array reductions (no jax-triton
    lowering: faster in cold GPU runs, docs/results.md 2026-11-28); "triton" still asks the kernel."""
    import triaccel.kernels as K

    real, asked = K.grad_moments, []

    def recorded(*args, impl="auto", **kw):
        asked.append(impl)
        return real(*args, impl="reference" if impl == "triton" else impl, **kw)   # no jax-triton on a CPU

    monkeypatch.setattr(K, "grad_moments", recorded)
    _train_cnn(optax.sgd(0.1), 2, curvature="off", kernels=kernels)
    assert asked and set(asked) == {impl}


def test_layer_discovery_nnx_and_pytree():
    lm = layer_map(SmallCNN(nnx.Rngs(0)))
    assert [(s.name, s.kind) for s in lm.specs] == [("bn1", "norm"), ("conv1", "other"), ("conv2", "other"),
                                                    ("fc", "other")]
    assert lm.layer_counts.tolist() == [16, 3 * 3 * 3 * 8 + 8, 3 * 3 * 8 * 8 + 8, 8 * 4 + 4]
    # linen-style dicts: 'params' collection dropped, norm guessed from scale/bias, nested numbering.
    tree = {"params": {"layer1": {"0": {"conv1": {"kernel": jnp.zeros((3, 3, 2, 2))},
                                        "bn1": {"scale": jnp.ones(2), "bias": jnp.zeros(2)}}},
                       "layer10": {"fc": {"kernel": jnp.zeros((2, 2))}}, "layer2": {"fc": {"kernel": jnp.zeros((2, 2))}}}}
    lm = layer_map(tree)
    assert [(s.name, s.kind) for s in lm.specs] == [("layer1.0.bn1", "norm"), ("layer1.0.conv1", "other"),
                                                    ("layer2.fc", "other"), ("layer10.fc", "other")]
    with pytest.raises(ValueError, match="no owning module"):
        layer_map({"w": jnp.zeros(3)})


def _conv_and_dot_dtypes(model, x):
    jaxpr = jax.make_jaxpr(lambda x: model(x))(x)
    return [(e.primitive.name, str(e.invars[0].aval.dtype), str(e.invars[1].aval.dtype))
            for e in jaxpr.jaxpr.eqns if e.primitive.name in ("conv_general_dilated", "dot_general")]


def test_precision_policy_changes_compute_dtypes_and_caches_traces():
    model = SmallCNN(nnx.Rngs(0))
    model.eval()
    lm = layer_map(model)
    x = jnp.ones((2, 8, 8, 3))
    # order: bn1, conv1, conv2, fc
    precision_policy(model, ["fp32", "fp16", "bf16", "fp32"], lm)
    assert _conv_and_dot_dtypes(model, x) == [("conv_general_dilated", "float16", "float16"),
                                              ("conv_general_dilated", "bfloat16", "bfloat16"),
                                              ("dot_general", "float32", "float32")]
    assert model.bn1.dtype == jnp.float32 and model.conv1.kernel.dtype == jnp.float32  # master weights
    precision_policy(model, [Precision.FP32, Precision.BF16, Precision.FP32, Precision.FP16], lm)
    assert [d[1] for d in _conv_and_dot_dtypes(model, x)] == ["bfloat16", "float32", "float16"]

    ta = TriAccel(TriAccelConfig(**FAST), model)
    fwd = ta.jit(lambda m, x: m(x))
    pol_a, pol_b = ["fp32", "bf16", "fp32", "fp16"], ["fp32", "fp32", "fp32", "fp32"]
    for pol, expect in [(pol_a, 1), (pol_a, 1), (pol_b, 2), (pol_b, 2), (pol_a, 2)]:
        precision_policy(model, pol, lm)
        fwd(model, x)
        assert ta.report()["compilations"] == expect
    with pytest.raises(ValueError, match="3 precisions for 4 layers"):
        precision_policy(model, ["fp32"] * 3, lm)


def _pure_setup(cfg=None, inner=None):
    params = mlp_params()
    ta = TriAccel(cfg or TriAccelConfig(curvature="off", **FAST), loss_fn=mlp_loss)
    tx = ta.wrap(inner or optax.sgd(0.1, momentum=0.9))
    return ta, tx, params, tx.init(params)


def test_nonfinite_gradients_never_reach_params_and_back_off_scale():
    ta, tx, params, state = _pure_setup()
    upd = jax.jit(tx.update)
    grads = jax.grad(mlp_loss)(params, mlp_data())
    bad = jax.tree_util.tree_map(lambda g: g, grads)
    bad["l2"]["kernel"] = bad["l2"]["kernel"].at[0, 0].set(jnp.nan)
    state = state._replace(scaling=jnp.asarray(True), loss_scale=jnp.asarray(1024.0))
    u, s2 = upd(bad, state, params)
    assert all(bool((x == 0).all()) for x in jax.tree_util.tree_leaves(u))
    assert float(s2.loss_scale) == 512.0 and int(s2.skipped) == 1 and int(s2.count) == 1
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: bool((a == b).all()), s2.inner, state.inner))
    assert float(s2.moments[0, :, 2].sum()) == 1.0  # the row records the non-finite count
    # The next finite step applies (grads scaled by the current loss scale are unscaled first).
    scaled = jax.tree_util.tree_map(lambda g: g * 512.0, grads)
    u2, s3 = upd(scaled, s2, params)
    ref, _ = optax.sgd(0.1, momentum=0.9).update(grads, optax.sgd(0.1, momentum=0.9).init(params), params)
    for a, b in zip(jax.tree_util.tree_leaves(u2), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert int(s3.good_steps) == 1 and float(s3.loss_scale) == 512.0
    # Host: the non-finite row is not observed, the finite one is.
    ta._feed(s3)
    assert ta.rows_skipped == 1 and ta.last_fed == 1


def test_per_layer_multipliers_scale_inner_updates_in_chain_and_inject_hyperparams():
    params = mlp_params()
    grads = jax.grad(mlp_loss)(params, mlp_data())
    inner = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    ta = TriAccel(TriAccelConfig(curvature="off", **FAST))
    tx = optax.chain(optax.clip_by_global_norm(1e3), ta.wrap(inner))
    state = tx.init(params)
    names = ta.layers.names
    assert names == ("l1", "l2")
    state = ta._swap(state, find_state(state)._replace(lr_mult=jnp.asarray([0.5, 0.25])))
    u, state = jax.jit(tx.update)(grads, state, params)
    np.testing.assert_allclose(u["l1"]["kernel"], -0.1 * 0.5 * grads["l1"]["kernel"], rtol=1e-6)
    np.testing.assert_allclose(u["l2"]["bias"], -0.1 * 0.25 * grads["l2"]["bias"], rtol=1e-6)
    # The user's schedule lives in the inner state and keeps working.
    assert float(find_state(state).inner.hyperparams["learning_rate"]) == pytest.approx(0.1)
    # control() writes the decision's multipliers back through the chain's tuple state.
    state = ta.control(0, state)
    np.testing.assert_allclose(find_state(state).lr_mult, ta.decision.lr_multipliers, rtol=1e-7)


def test_a_boundary_writes_only_the_fields_that_change(monkeypatch):
    """A boundary whose decision leaves the multipliers, the loss-scale mode and the accumulation as
    they are returns the state object untouched (no transfer, nothing for a split step to put back);
    one that changes a field writes that field (also after a state the wrapper has not read)."""
    ta, tx, params, state = _pure_setup(TriAccelConfig(curvature="off", **{**FAST, "base_precision": "bf16"}))
    placed = []
    monkeypatch.setattr(transform_mod, "_placed_like", lambda v, old: placed.append(v) or jnp.asarray(v, old.dtype))
    assert ta.control(0, state) is state and placed == []   # ones, scaling off, one micro-batch: as initialised
    upd = jax.jit(tx.update)
    x, y = mlp_data()
    for s in range(1, 4):
        state = upd(jax.grad(mlp_loss)(params, (x[:16], y[:16])), state, params)[1]
    assert ta.control(4, state) is state and placed == []
    # a state the wrapper never read (e.g. restored): read, compared, and only the changed field written
    other = state._replace(lr_mult=jnp.asarray([0.5, 0.25], jnp.float32))
    written = ta.control(8, other)
    assert [np.asarray(v).tolist() for v in placed] == [[1.0, 1.0]]
    np.testing.assert_array_equal(written.lr_mult, [1.0, 1.0])
    assert written.scaling is other.scaling and written.accum is other.accum


def test_gradient_accumulation_holds_logical_batch():
    cfg = TriAccelConfig(curvature="off", **{**FAST, "lr_rule": "accumulate"})
    ta, tx, params, state = _pure_setup(cfg, optax.sgd(0.1))
    state = state._replace(accum=jnp.asarray(2, jnp.int32))
    x, y = mlp_data()
    g1, g2 = jax.grad(mlp_loss)(params, (x[:16], y[:16])), jax.grad(mlp_loss)(params, (x[16:], y[16:]))
    u1, state = tx.update(g1, state, params)
    assert all(bool((a == 0).all()) for a in jax.tree_util.tree_leaves(u1)) and int(state.count) == 0
    u2, state = tx.update(g2, state, params)
    full = jax.grad(mlp_loss)(params, (x, y))
    np.testing.assert_allclose(u2["l1"]["kernel"], -0.1 * full["l1"]["kernel"], rtol=1e-5, atol=1e-7)
    assert int(state.count) == 1 and int(state.micro) == 0


def _run_pure(ta, tx, params, state, steps, start):
    upd = jax.jit(tx.update)
    x, y = mlp_data(64)
    for s in range(start, start + steps):
        state = ta.control(s, state)
        i = (s * 16) % 64
        g = jax.grad(lambda p: mlp_loss(p, (x[i:i + 16], y[i:i + 16])) * loss_scale(state))(params)
        u, state = upd(g, state, params)
        params = optax.apply_updates(params, u)
    return params, state


def test_state_roundtrip_through_flax_serialization_resumes_identically():
    cfg = TriAccelConfig(curvature="off", **{**FAST, "base_precision": "fp16"})
    ta, tx, params, state = _pure_setup(cfg)
    params, state = _run_pure(ta, tx, params, state, 10, 0)
    blob = flax.serialization.to_bytes((params, state))
    host = json.dumps(ta.state_dict())
    p_a, s_a = _run_pure(ta, tx, params, state, 10, 10)

    ta2, tx2, p0, s0 = _pure_setup(cfg)
    params2, state2 = flax.serialization.from_bytes((p0, s0), blob)
    ta2.load_state_dict(json.loads(host))
    p_b, s_b = _run_pure(ta2, tx2, params2, state2, 10, 10)
    for a, b in zip(jax.tree_util.tree_leaves((p_a, s_a)), jax.tree_util.tree_leaves((p_b, s_b))):
        np.testing.assert_array_equal(a, b)
    assert ta.controller.state_dict() == ta2.controller.state_dict()
    assert float(s_a.scaling) == 1.0  # fp16 base: loss scaling was active through the run


def test_trainstate_control_and_missed_boundary_warns():
    from flax.training import train_state

    params = mlp_params()
    ta = TriAccel(TriAccelConfig(curvature="off", **FAST))
    st = train_state.TrainState.create(apply_fn=mlp_apply, params=params, tx=ta.wrap(optax.sgd(0.1)))
    batch = mlp_data()

    @jax.jit
    def step(st):
        return st.apply_gradients(grads=jax.grad(mlp_loss)(st.params, batch))

    for s in range(9):  # control only at step 0 and 8: steps 0..3 of the ring were overwritten
        if s in (0, 8):
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                st = ta.control(s, st)
            if s == 8:
                assert any("overwritten" in str(x.message) for x in w)
        st = step(st)
    assert ta.rows_lost == 4 and ta.last_fed == 7


def test_memory_probe_on_cpu_warns_once():
    probe = MemoryProbe()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert probe.read() is None and probe.read() is None
    assert len([x for x in w if "no memory statistics" in str(x.message)]) == 1


def test_wrap_one_liner_and_bad_input():
    tx = wrap(optax.sgd(0.1), TriAccelConfig(**{**FAST, "curvature": "fisher"}))  # curvature is opt-in
    state = tx.init(mlp_params())
    assert tx.host.layers.names == ("l1", "l2")
    state = tx.control(1, state)  # off a boundary: unchanged object
    assert tx.control(1, state) is state
    tx.control(0, state)  # step 0 is in warm-up: no curvature yet, no batch needed
    with pytest.raises(ValueError, match="batch=None at curvature step 8"):
        tx.control(8, state)
    with pytest.raises(ValueError, match="config"):
        TriAccel({"beta": 0.9})


def test_observe_oom_shrinks_batch_and_writes_state():
    ta, tx, params, state = _pure_setup()
    state = ta.control(0, state)
    b0 = ta.decision.batch_size
    state = ta.observe_oom(1, state)
    assert ta.decision.batch_size < b0
    np.testing.assert_allclose(find_state(state).lr_mult, ta.decision.lr_multipliers, rtol=1e-7)


def _split_setup(curvature: str = "off"):
    x, y = image_data()
    model = SmallCNN(nnx.Rngs(0))
    # The paper's variance law: its policy changes are what the split step's re-splits are tested on.
    cfg = TriAccelConfig(curvature=curvature, precision_law="variance", **{**FAST, "t_ctrl": 4, "warmup_steps": 4})
    ta = TriAccel(cfg, model, loss_fn=cnn_loss)
    opt = nnx.Optimizer(model, ta.wrap(optax.sgd(0.1, momentum=0.9)), wrt=nnx.Param)

    def step(model, opt, x, y):
        scale = loss_scale(opt.opt_state)
        l, g = nnx.value_and_grad(lambda m: cnn_loss(m, (x, y)) * scale)(model)
        opt.update(model, g)
        return l / scale

    return x, y, model, opt, ta, step


@pytest.mark.parametrize("pack", [False, True])   # the CPU's default, and the state packed (an accelerator's)
def test_split_step_matches_nnx_jit_and_reuses_compiled_policies(pack):
    """SplitStep: the same losses and parameters as the nnx.jit step, through boundaries that change
    the policy (re-split) and boundaries that change only values (curvature's LR multipliers: moved
    without a re-split); one compilation per policy (a policy seen before reuses its variant);
    objects hold the current values after sync()."""
    x, y, model_a, opt_a, ta_a, step = _split_setup("fisher")
    jitted = ta_a.jit(step)
    x, y, model_b, opt_b, ta_b, step_b = _split_setup("fisher")
    split = SplitStep(step_b, model_b, opt_b, ta=ta_b, compile_ahead=False, pack=pack)   # foreground compilations only
    la, lb = [], []
    xc, yc = jax.device_put((x[:16], y[:16]), jax.devices()[0])   # committed data: committed outputs
    curv = (x[16:24], y[16:24])
    boundaries = 0
    for s in range(24):
        ta_a.control(s, opt_a, model_a, batch=curv)
        la.append(float(jitted(model_a, opt_a, x[:16], y[:16])))
        boundaries += ta_b.controller.is_control_step(s)
        split.control(s, batch=curv)
        lb.append(float(split(xc, yc)))
    assert 0 < ta_b.policy_version < boundaries   # both kinds of boundary were crossed
    assert not np.allclose(ta_b.decision.lr_multipliers, 1.0)
    # One executable per policy: the state keeps its placement from the first call on (the step runs
    # ahead-of-time executables, one per argument signature of each policy).
    assert all(len(exes) == 1 for exes in split._main.exes.values())
    np.testing.assert_allclose(lb, la, rtol=1e-6)
    split.sync()
    np.testing.assert_allclose(np.asarray(find_state(opt_b).lr_mult.get_value()), ta_b.decision.lr_multipliers,
                               rtol=1e-6)
    # Packed (pack=True: flat buffers sliced and concatenated inside the program), XLA fuses the update
    # differently: last-bit differences over 24 steps (3e-7 seen on this CPU).
    for a, b in zip(jax.tree_util.tree_leaves(nnx.state(model_a, nnx.Param)),
                    jax.tree_util.tree_leaves(nnx.state(model_b, nnx.Param))):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    assert current_policy(model_b, ta_b.layers) == current_policy(model_a, ta_a.layers)
    policies = {tuple(r["precisions"]) for r in ta_b.controller.telemetry.records}
    assert split.traces == len(split._main.steps) == len(policies) == ta_b.report()["compilations"]
    # Back to the first policy: its compiled step is found again, no new trace.
    first = ta_b.controller.telemetry.records[0]["precisions"]
    precision_policy(model_b, first, ta_b.layers)
    before = split.traces
    split.resplit()
    split(x[:16], y[:16])
    assert split.traces == before
    with pytest.raises(ValueError, match="without ta="):
        SplitStep(step_b, model_b, opt_b).control(0)


@pytest.mark.parametrize("pack", [False, True])
def test_bound_update_shares_the_state_and_is_not_recompiled_by_a_new_policy(pack):
    """A gradient step and an update bound over the parameters' state and the optimizer (the CIFAR
    demo's split, for the elastic batch) give the fused nnx.jit step's losses; the update compiles
    once although the policy changes."""
    x, y, model_a, opt_a, ta_a, step = _split_setup()
    jitted = ta_a.jit(step)
    x, y, model_b, opt_b, ta_b, _ = _split_setup()

    def grad(model, opt, x, y):
        scale = loss_scale(opt.opt_state)
        l, g = nnx.value_and_grad(lambda m: cnn_loss(m, (x, y)) * scale)(model)
        return l / scale, g

    def update(params, opt, g):
        opt.update(params, g)

    split = SplitStep(grad, model_b, opt_b, ta=ta_b, donate_argnums=(), compile_ahead=False, pack=pack)
    upd = split.bind(update, nnx.state(model_b, nnx.Param), opt_b)
    la, lb = [], []
    for s in range(16):
        ta_a.control(s, opt_a, model_a)
        la.append(float(jitted(model_a, opt_a, x[:16], y[:16])))
        split.control(s)
        loss, g = split(x[:16], y[:16])
        upd(g)
        lb.append(float(loss))
    np.testing.assert_allclose(lb, la, rtol=1e-6)
    assert ta_b.policy_version >= 2                       # the model's graph changed at least once...
    assert len(upd.steps) == 1 and upd.steps[next(iter(upd.steps))].traces == 1   # ...not the update's
    assert split.traces == len(split._main.steps) + 1 == ta_b.report()["compilations"]
    with pytest.raises(ValueError, match="not in the SplitStep"):
        split.bind(update, nnx.state(SmallCNN(nnx.Rngs(1)), nnx.Param), opt_b)


def test_split_step_rejects_a_step_that_changes_the_state_structure():
    x, y, model, opt, ta, step = _split_setup()

    def grows(model: Any, opt: Any, x: jax.Array) -> jax.Array:
        model.extra = nnx.BatchStat(jnp.zeros(()))   # a new Variable: the flat leaves no longer line up
        return x.sum()

    with pytest.raises(ValueError, match="changed the structure"):
        SplitStep(grows, model, opt)(x[:4])


def test_decisions_written_at_boundaries_keep_input_placement():
    """A committed state stays committed through control(): the jitted update does not compile
    again after each boundary for a new input placement."""
    cfg = TriAccelConfig(curvature="off", **{**FAST, "base_precision": "fp16"})  # boundaries write scaling too
    ta, tx, params, state = _pure_setup(cfg)
    dev = jax.devices()[0]
    params, state = jax.device_put(params, dev), jax.device_put(state, dev)
    upd = jax.jit(tx.update)
    x, y = mlp_data(64)
    for s in range(12):                           # boundaries at 0, 4, 8
        state = ta.control(s, state)
        assert all(a.committed for a in jax.tree_util.tree_leaves(state))
        g = jax.grad(lambda p: mlp_loss(p, (x[:16], y[:16])))(params)
        u, state = upd(g, state, params)
        params = optax.apply_updates(params, u)
    assert upd._cache_size() == 1
