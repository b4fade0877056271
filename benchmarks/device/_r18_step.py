"""The demo's JAX ResNet-18 training step as a pure function, for the compile probes
(xla_options_probe.py, jax_compile_pair_probe.py): AMP-bf16 policy (norm layers FP32), SGD-nesterov."""

from __future__ import annotations

from typing import Any, Callable


def amp_resnet18(width: float = 1.0, fp32: bool = False) -> tuple[Any, Callable[..., Any], Callable[..., Any]]:
    """(state, train, evaluate): the split (model, optimizer) state; train(state, x, y) -> (loss, new
    state), the mean cross-entropy's step; evaluate(state, x, y) -> the count of correct argmaxes.
    x: (N, 32, 32, 3) float32, y: (N,) int32. width: the channel width multiplier (the demo's --width).
    fp32: every layer in FP32 instead (for comparisons that bf16's rounding would blur)."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from triaccel import Precision
    from triaccel.backends.jax import layer_map_from_model, precision_policy
    from triaccel.backends.jax.models import create_model

    model = create_model("resnet18", num_classes=10, width=width, seed=0)
    lm = layer_map_from_model(model)
    precision_policy(model, [Precision.FP32 if s.kind == "norm" or fp32 else Precision.BF16 for s in lm.specs], lm)
    opt = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9, nesterov=True), wrt=nnx.Param)
    graphdef, state = nnx.split((model, opt))

    def train(state: Any, x: Any, y: Any) -> Any:
        m, o = nnx.merge(graphdef, state)

        def lf(mm: Any) -> Any:
            return optax.softmax_cross_entropy_with_integer_labels(mm(x).astype(jnp.float32), y).mean()

        loss, grads = nnx.value_and_grad(lf)(m)
        o.update(m, grads)
        return loss, nnx.state((m, o))

    def evaluate(state: Any, x: Any, y: Any) -> Any:
        m, _ = nnx.merge(graphdef, state)
        m.eval()
        return (m(x).argmax(-1) == y).sum()

    return state, train, evaluate
