"""Precisions given as framework dtypes, and float64 models/gradients (CPU, TRITON_INTERPRET=1)."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy

import ml_dtypes  # noqa: E402

from triaccel import Precision, TriAccelConfig  # noqa: E402
from triaccel.kernels import cast_to, grad_moments, grad_moments_flat  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:MemoryProbe:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:triaccel. device:RuntimeWarning")]

P16, B16, F32 = Precision.FP16, Precision.BF16, Precision.FP32


@pytest.mark.parametrize("value,want", [
    (torch.float16, P16), (torch.half, P16), (torch.bfloat16, B16), (torch.float32, F32),
    (np.float16, P16), (np.float32, F32), (np.dtype("float16"), P16), (ml_dtypes.bfloat16, B16),
    (jnp.float16, P16), (jnp.bfloat16, B16), (jnp.float32, F32), (jnp.dtype("bfloat16"), B16),
    ("float16", P16), ("bfloat16", B16), ("FP32", F32), ("bf16", B16), (2, F32), (B16, B16),
])
def test_parse_accepts_framework_dtypes(value, want):
    assert Precision.parse(value) is want


@pytest.mark.parametrize("value", [torch.float64, torch.int8, np.float64, jnp.float64, "float64", None, 3,
                                   True, float])
def test_parse_rejects_other_dtypes_naming_the_parameter(value):
    with pytest.raises(ValueError, match=r"^dtypes\[2\]=.*: allowed 'fp16', 'bf16', 'fp32'"):
        Precision.parse(value, "dtypes[2]")


def test_parse_error_names_precision_by_default():
    with pytest.raises(ValueError, match=r"^precision=torch.float64: allowed"):
        Precision.parse(torch.float64)


def test_cast_to_takes_torch_dtypes_and_strings():
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (5, 1030, 7, 64)]
    out = cast_to(xs, [torch.float16, "bfloat16", torch.float32, np.float16], block=1024, iters=1)
    assert [o.dtype for o in out] == [torch.float16, torch.bfloat16, torch.float32, torch.float16]
    assert out[2] is xs[2]
    torch.testing.assert_close(out[0], xs[0].half(), rtol=0, atol=0)
    torch.testing.assert_close(out[1].float(), xs[1], rtol=2 ** -7, atol=0)  # interpreter truncates BF16
    with pytest.raises(ValueError, match=r"dtypes\[1\]=torch.float64: allowed"):
        cast_to(xs[:2], [torch.float16, torch.float64])


def test_cast_to_takes_jax_dtypes():
    xs = [jnp.linspace(-3, 3, 9, dtype=jnp.float32), jnp.ones((2, 3), jnp.float32)]
    out = cast_to(xs, [jnp.bfloat16, np.dtype("float16")])
    assert out[0].dtype == jnp.bfloat16 and out[1].dtype == jnp.float16 and out[1].shape == (2, 3)
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(xs[0].astype(jnp.bfloat16)))


def test_torch_dtype_and_plan_take_dtype_objects():
    from triaccel.backends.torch.layers import discover_layers
    from triaccel.backends.torch.precision import PrecisionPlan, torch_dtype

    assert torch_dtype(torch.bfloat16) is torch.bfloat16 and torch_dtype("float16") is torch.float16
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    plan = PrecisionPlan(discover_layers(model), "cpu")
    plan.apply([torch.bfloat16, torch.float32])
    assert plan.precisions == (B16, F32) and plan.majority == B16 and plan.hooked == ("1",)
    with pytest.raises(ValueError, match=r"precisions\[0\]=torch.float64"):
        plan.apply([torch.float64, "fp32"])


# ------------------------------------------------------------------------------------------------
# float64 gradients: statistics with stock framework ops, in float64


def _moments64(arrays, inv_scale=1.0):
    rows = []
    for a in arrays:
        x = np.asarray(a, np.float64).ravel() * inv_scale
        fin = np.isfinite(x)
        xf = np.where(fin, x, 0.0)
        rows.append((xf.sum(), (xf * xf).sum(), int((~fin).sum())))
    return np.array(rows)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_torch_moments_of_float64_in_a_mixed_list(impl):
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(4099, generator=g, dtype=torch.float64) * 1e-3 + 1.0,
          torch.randn(3, 5, generator=g),
          torch.randn(7, generator=g, dtype=torch.float64),
          torch.randn(2000, generator=g).to(torch.bfloat16)]
    ts[2][3] = float("nan")
    want = _moments64([t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy() for t in ts], 0.5)
    before = ts[0].clone()
    m = grad_moments(ts, inv_scale=0.5, impl=impl, block=1024, iters=1)
    assert m.sum.dtype == torch.float32 and m.nonfinite.tolist() == [0, 0, 1, 0]
    np.testing.assert_allclose(m.sum.numpy(), want[:, 0], rtol=1e-5)
    np.testing.assert_allclose(m.sumsq.numpy(), want[:, 1], rtol=1e-5)
    # unscaled in place, in float64 (exact: a power of two)
    assert ts[0].dtype == torch.float64 and torch.equal(ts[0], before * 0.5)


def test_torch_moments_float64_accumulates_in_float64():
    # 1 + 1e-9 is not representable in float32: a float32 sum would lose the 1e-9 parts entirely.
    t = torch.full((4096,), 1.0 + 1e-9, dtype=torch.float64)
    t[::2] = -1.0
    m = grad_moments_flat(t, [0, 4096], block=1024, iters=1)
    assert math.isclose(float(m.sum[0]), 2048 * 1e-9, rel_tol=1e-5)


def test_jax_moments_of_float64_under_x64():
    with jax.enable_x64(True):
        a = jnp.full((4096,), 1.0 + 1e-9, jnp.float64).at[::2].set(-1.0)
        b = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
        m = grad_moments([a, b])
        assert m.sum.dtype == jnp.float32
        assert math.isclose(float(m.sum[0]), 2048 * 1e-9, rel_tol=1e-5) and float(m.sum[1]) == 15.0
        (m2, unscaled) = grad_moments([a], inv_scale=0.25)
        assert unscaled[0].dtype == jnp.float64
        np.testing.assert_array_equal(np.asarray(unscaled[0]), np.asarray(a) * 0.25)


# ------------------------------------------------------------------------------------------------
# float64 models keep float64 under the precision plan / policy

CFG = TriAccelConfig(t_ctrl=2, warmup_steps=2, min_dwell=0, curvature="off", elastic_batch=False)


def test_float64_torch_model_keeps_float64_and_gets_statistics():
    from triaccel.backends.torch import wrap

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4)).double()
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, CFG.replace(base_precision="fp16"))
    # the plan holds float64 layers at their dtype, whatever is decided (here all FP16 or mixed)
    assert opt.plan.precisions == (F32,) * 3 and not opt.fp16_active and opt.plan.hooked == ()
    assert opt.plan.apply(["bf16", "fp32", torch.float16]) is False
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=g, dtype=torch.float64), torch.randint(0, 4, (32,), generator=g)
    losses = []
    for _ in range(5):
        with opt.autocast():
            out = model(x)
        assert out.dtype == torch.float64
        loss = torch.nn.functional.cross_entropy(out, y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert losses[-1] < losses[0]
    rep = opt.report()
    assert rep["step"] == 4 and rep["nonfinite_steps"] == 0 and rep["skipped_steps"] == 0
    ema = [v["var_ema"] for v in rep["layers"].values()]
    assert len(ema) == 3 and all(e is not None and math.isfinite(e) and e > 0 for e in ema)
    assert {v["dtype"] for v in rep["layers"].values()} == {"float64"}   # what the layers compute in


def test_float64_nnx_model_keeps_float64_and_gets_statistics():
    import optax
    from flax import nnx

    from triaccel.backends.jax import TriAccel, current_policy, loss_scale, precision_policy

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.l1 = nnx.Linear(6, 16, param_dtype=jnp.float64, rngs=rngs)
            self.l2 = nnx.Linear(16, 3, param_dtype=jnp.float64, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.l2(jnp.tanh(self.l1(x)))

    def loss_of(m, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

    with jax.enable_x64(True):
        model = MLP(nnx.Rngs(0))
        ta = TriAccel(CFG, model, loss_fn=lambda m, b: loss_of(m, *b))
        opt = nnx.Optimizer(model, ta.wrap(optax.sgd(0.1)), wrt=nnx.Param)

        @ta.jit
        def step(model, opt, x, y):
            loss, grads = nnx.value_and_grad(lambda m: loss_of(m, x, y) * loss_scale(opt.opt_state))(model)
            opt.update(model, grads)
            return loss

        rng = np.random.default_rng(0)
        x, y = jnp.asarray(rng.normal(size=(16, 6))), jnp.asarray(rng.integers(0, 3, 16))
        losses = []
        for s in range(5):
            ta.control(s, opt, model)
            losses.append(float(step(model, opt, x, y)))
        assert current_policy(model) == ("float64", "float64")
        assert precision_policy(model, [jnp.bfloat16, "fp16"]) == ("fp32", "fp32")
        assert model.l1.kernel.dtype == jnp.float64 and model(x).dtype == jnp.float64
        assert losses[-1] < losses[0]
        ema = [v["var_ema"] for v in ta.report()["layers"].values()]
        assert len(ema) == 2 and all(e is not None and math.isfinite(e) and e > 0 for e in ema)


def test_float64_linen_layer_computes_in_float64():
    import flax.linen as nn

    from triaccel.backends.jax import layer_map_from_params, linen_precision

    class Two(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
            h = nn.Dense(4, param_dtype=jnp.float64, name="a")(x)
            return h, nn.Dense(2, name="b")(h)

    with jax.enable_x64(True):
        x = jnp.ones((3, 5), jnp.float32)
        variables = Two().init(jax.random.PRNGKey(0), x)
        lm = layer_map_from_params(variables["params"])
        with linen_precision([jnp.bfloat16, jnp.bfloat16], lm):
            hidden, out = Two().apply(variables, x)
        assert hidden.dtype == jnp.float64  # float64 parameters: kept at float64
        assert out.dtype == jnp.bfloat16  # the float32 layer follows the policy


def test_config_base_precision_takes_framework_dtypes():
    import torch

    from triaccel import TriAccelConfig

    assert TriAccelConfig(base_precision=torch.float16).base_precision == "fp16"
    assert TriAccelConfig(base_precision="bfloat16").to_dict()["base_precision"] == "bf16"
    with pytest.raises(ValueError, match="base_precision"):
        TriAccelConfig(base_precision=torch.float64)
