"""JAX/Flax backend: a wrapped optax transformation with the full Tri-Accel loop.

```python
from triaccel.backends.jax import TriAccel, wrap, precision_policy, loss_scale
ta = TriAccel(config, model, loss_fn=loss_fn)      # or: tx = wrap(optax.sgd(0.1), config, model)
tx = ta.wrap(optax.sgd(0.1, momentum=0.9))         # optax GradientTransformationExtraArgs
opt_state = tx.init(params)
for step in ...:
    opt_state = ta.control(step, opt_state, model, curvature_batch)  # no-op off boundaries
    ...  # loss * loss_scale(opt_state); grads; updates, opt_state = tx.update(grads, opt_state, params)
```
"""

from .compile_ahead import AheadCompiler, enable_compilation_cache
from .curvature import FisherTopK, HessianTopK, NNXLoss, fisher_topk, nnx_loss, per_sample_grads
from .flops import layer_flops
from .layers import LayerMap, layer_map, layer_map_from_model, layer_map_from_params
from .memory import MemoryProbe, MemorySample, limit_device_memory
from .policy import (CountingJit, commit, counting_jit, current_policy, linen_precision, policy_names,
                     precision_policy)
from .split_step import SplitStep
from .transform import (LossScaleConfig, TriAccel, TriAccelState, TriAccelTransformation, find_state,
                        loss_scale, wrap)

__all__ = [
    "AheadCompiler", "enable_compilation_cache", "limit_device_memory",
    "CountingJit", "FisherTopK", "HessianTopK", "LayerMap", "LossScaleConfig", "MemoryProbe", "MemorySample",
    "NNXLoss", "SplitStep", "TriAccel", "TriAccelState", "TriAccelTransformation", "commit", "counting_jit",
    "current_policy", "find_state", "fisher_topk", "layer_flops", "layer_map", "layer_map_from_model",
    "layer_map_from_params", "linen_precision", "loss_scale", "nnx_loss", "per_sample_grads", "policy_names",
    "precision_policy", "wrap",
]
