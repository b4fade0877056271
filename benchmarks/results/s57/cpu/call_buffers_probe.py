"""CPU probe (dev box): host seconds per call of a jitted program by the number of array buffers it takes and
returns, EfficientNet-B0's 213 parameter arrays as tiny arrays (dispatch cost only). Not code: a record."""
import time, jax, jax.numpy as jnp, numpy as np
from triaccel.backends.jax.models import create_model
from flax import nnx
m = create_model("efficientnet_b0", num_classes=10, width=1.0, seed=0)
leaves = jax.tree_util.tree_leaves(nnx.state(m, nnx.Param))
print(len(leaves), "param arrays", sum(x.size for x in leaves))
small = [jnp.zeros((4,), x.dtype) for x in leaves]   # same count, tiny: dispatch cost only
out_many = jax.jit(lambda s: [a + 1 for a in s])
in_many = jax.jit(lambda s: sum(a.sum() for a in s))
one = jax.jit(lambda a: a + 1)
flat = jnp.zeros((4 * len(leaves),))
for f, arg, name in ((out_many, small, "213 in + 213 out"), (in_many, small, "213 in, 1 out"), (one, flat, "1 in + 1 out")):
    jax.block_until_ready(f(arg))
    for rep in range(2):
        t = time.perf_counter(); n = 300
        for _ in range(n):
            r = f(arg)
        t_disp = (time.perf_counter() - t) / n
        jax.block_until_ready(r)
    print(f"{name}: {t_disp*1e6:.0f} us per call (dispatch)")
