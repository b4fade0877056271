"""CPU probe: compile seconds of EfficientNet-B0's update, plain / wrapped / wrapped with moments stubbed /
wrapped with the bucketing off (every array its own reduction). Not code."""
import sys, time, jax, jax.numpy as jnp
from flax import nnx
from examples.cifar.common import RunOptions
from examples.cifar.jax_loop import _sgd
from triaccel import TriAccelConfig
import triaccel.backends.jax.transform as TT
from triaccel.backends.jax import TriAccel
from triaccel.backends.jax.models import create_model
import sys as _s; import triaccel.kernels.grad_moments; GM = _s.modules["triaccel.kernels.grad_moments"]
mode = sys.argv[1]
real = TT._grad_moments_fn()
if mode == "nomoments":
    def fake(tensors, inv_scale=None, impl=None):
        leaves, tdef = jax.tree_util.tree_flatten(tensors)
        z = jnp.zeros((len(leaves),), jnp.float32)
        m = GM._jax_moments(jnp.zeros((len(leaves), 3), jnp.float32))
        if inv_scale is None:
            return m
        return m, jax.tree_util.tree_unflatten(tdef, [x * inv_scale.reshape(()).astype(x.dtype) for x in leaves])
    TT._grad_moments_fn = lambda: fake
elif mode == "nobucket":
    GM.SMALL_MAX = 0
    orig = GM.moments_reference_jnp_tree
    GM.moments_reference_jnp_tree = lambda leaves, inv, small_max=0, row=0: orig(leaves, inv, 0, row)
model = create_model("efficientnet_b0", num_classes=10, width=1.0, seed=0)
params = nnx.state(model, nnx.Param)
tx = _sgd(0.1, RunOptions()) if mode == "plain" else TriAccel(TriAccelConfig(elastic_batch=False), model).wrap(_sgd(0.1, RunOptions()))
state = tx.init(params)
fn = jax.jit(lambda g, s, p: tx.update(g, s, p))
t0 = time.perf_counter(); low = fn.lower(params, state, params); t1 = time.perf_counter()
c = low.compile(); t2 = time.perf_counter()
print(f"{mode}: lower {t1-t0:.2f}s compile {t2-t1:.2f}s fusions {c.as_text().count(' fusion(')}", flush=True)
