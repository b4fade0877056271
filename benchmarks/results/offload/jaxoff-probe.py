"""JAX ResNet-152 step at batch B under a plan (actions from an offload.py JSON), one XLA setting per process:
prints samples/s, compiled footprint, peak bytes in use. argv: json_path label"""
import json, statistics, sys, time
import jax, jax.numpy as jnp
sys.path.insert(0, "benchmarks")
import offload as ob
from triaccel.backends.jax.offload import PlannedSequential
d = json.load(open(sys.argv[1])); label = sys.argv[2]
plan = d["plan_bp"]; acts = list(plan["actions"].values()); B = plan["batch"]
units, params = ob.jax_bottleneck_net(ob.resnet152())
seq = PlannedSequential(units)
for name, a in (("plan", acts), ("recompute-all", ["recompute"] * len(acts))):
    f = seq.apply(a)
    x = jax.random.normal(jax.random.PRNGKey(0), (B, 224, 224, 3)); y = jax.random.randint(jax.random.PRNGKey(1), (B,), 0, 1000)
    def loss(ps, xb, yb, f=f):
        logp = jax.nn.log_softmax(f(ps, xb)); return -jnp.mean(jnp.take_along_axis(logp, yb[:, None], axis=1))
    def sgd(ps, mom, xb, yb):
        l, g = jax.value_and_grad(loss)(ps, xb, yb)
        mom = jax.tree_util.tree_map(lambda m, gi: 0.9 * m + gi, mom, g)
        return jax.tree_util.tree_map(lambda pi, m: pi - 0.01 * m, ps, mom), mom, l
    ps = jax.tree_util.tree_map(jnp.array, params); mom = jax.tree_util.tree_map(jnp.zeros_like, params)
    try:
        c = jax.jit(sgd, donate_argnums=(0, 1)).lower(ps, mom, x, y).compile()
        ma = c.memory_analysis()
        fp = ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes - ma.alias_size_in_bytes
        ts = []
        for k in range(6):
            t0 = time.perf_counter(); ps, mom, l = c(ps, mom, x, y); jax.block_until_ready(l)
            if k >= 2: ts.append(time.perf_counter() - t0)
        st = jax.devices()[0].memory_stats() or {}
        print(f"[{label}] {name:<14} bs {B}: {B / statistics.median(ts):7.1f} samples/s  compiled {fp / 2**30:.2f} GiB  "
              f"temp {ma.temp_size_in_bytes / 2**30:.2f} GiB  host temp {getattr(ma, 'host_temp_size_in_bytes', 0) / 2**30:.2f} GiB  "
              f"peak in use {st.get('peak_bytes_in_use', 0) / 2**30:.2f} GiB", flush=True)
    except Exception as e:
        print(f"[{label}] {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    del ps, mom
