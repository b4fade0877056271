"""Linen models: layer discovery from the params, per-layer compute dtypes through
`linen_precision`, and the wrapped optimizer with the policy as a static jit argument (CPU)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from triaccel import TriAccelConfig
from triaccel.backends.jax import (CountingJit, TriAccel, layer_map_from_params, linen_precision, loss_scale,
                                   policy_names)

from test_jax_backend import FAST, image_data

pytestmark = pytest.mark.filterwarnings("ignore:triaccel. device:RuntimeWarning")


class LinenCNN(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(8, (3, 3))(x)))
        x = nn.relu(nn.Conv(8, (3, 3), strides=2, name="conv2")(x))
        return nn.Dense(4)(x.mean((1, 2)))


class NoDtype(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.param("kernel", nn.initializers.ones, (x.shape[-1], 2))


class HoldsNoDtype(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return NoDtype(name="inner")(x)


def _ops(fn, x):
    jaxpr = jax.make_jaxpr(fn)(x)
    return [(e.primitive.name, str(e.invars[0].aval.dtype)) for e in jaxpr.jaxpr.eqns
            if e.primitive.name in ("conv_general_dilated", "dot_general")]


def test_linen_layers_and_per_layer_compute_dtypes():
    model, x = LinenCNN(), jnp.ones((2, 8, 8, 3))
    variables = model.init(jax.random.PRNGKey(0), x, train=False)
    lm = layer_map_from_params(variables["params"])
    by_name = {s.name: s.kind for s in lm.specs}
    assert set(by_name) == {"Conv_0", "BatchNorm_0", "conv2", "Dense_0"} and by_name["BatchNorm_0"] == "norm"
    want = {"Conv_0": "bf16", "BatchNorm_0": "fp32", "conv2": "fp16", "Dense_0": "fp32"}
    policy = [want[s.name] for s in lm.specs]

    def fwd(x):
        with linen_precision(policy, lm) as names:
            assert names == tuple(policy)
            return model.apply(variables, x, train=False)

    assert _ops(fwd, x) == [("conv_general_dilated", "bfloat16"), ("conv_general_dilated", "float16"),
                            ("dot_general", "float32")]
    # Outside the block the model computes as defined (FP32), and the parameters stay FP32.
    assert [d for _, d in _ops(lambda x: model.apply(variables, x, train=False), x)] == ["float32"] * 3
    assert all(a.dtype == jnp.float32 for a in jax.tree_util.tree_leaves(variables["params"]))
    with pytest.raises(ValueError, match="3 precisions for 4 layers"):
        with linen_precision(policy[:3], lm):
            pass
    nd = HoldsNoDtype()
    nd_vars = nd.init(jax.random.PRNGKey(0), jnp.ones((1, 3)))
    with pytest.raises(ValueError, match="no `dtype` attribute"):
        with linen_precision(["bf16"], layer_map_from_params(nd_vars["params"])):
            nd.apply(nd_vars, jnp.ones((1, 3)))


def test_wrapped_optimizer_trains_linen_model_one_trace_per_policy():
    x, y = image_data()
    model = LinenCNN()
    variables = model.init(jax.random.PRNGKey(0), x[:2], train=False)
    params, stats = variables["params"], variables["batch_stats"]
    # The paper's variance law, which leaves the base policy on this model (one trace per policy).
    ta = TriAccel(TriAccelConfig(curvature="off", precision_law="variance", **FAST))
    tx = ta.wrap(optax.sgd(0.1, momentum=0.9))
    state = tx.init(params)

    def step(params, stats, state, x, y, policy):
        def lf(p):
            with linen_precision(policy, ta.layers):
                logits, upd = model.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()
            return loss * loss_scale(state), (loss, upd["batch_stats"])
        (_, (loss, stats)), g = jax.value_and_grad(lf, has_aux=True)(params)
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), stats, state, loss

    jitted = CountingJit(step, use_nnx=False, static_argnames="policy")
    losses, policies = [], set()
    for s in range(24):
        state = ta.control(s, state)
        policy = policy_names(ta.decision)
        policies.add(policy)
        i = (s * 16) % 64
        params, stats, state, loss = jitted(params, stats, state, x[i:i + 16], y[i:i + 16], policy=policy)
        losses.append(float(loss))
    assert np.mean(losses[-4:]) < 0.8 * np.mean(losses[:4]), losses
    assert len(policies) > 1                               # the controller left the base policy
    assert jitted.traces == len(policies)
    assert all(a.dtype == jnp.float32 for a in jax.tree_util.tree_leaves(params))
