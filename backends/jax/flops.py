"""Per-layer forward FLOPs of a Flax NNX model, for `triaccel.flops.FlopShare`.

Counted once from the model's jaxpr (`jax.make_jaxpr` of one forward pass on one sample): every
convolution (`conv_general_dilated`) and matrix product (`dot_general`) counts 2 x its
multiply-accumulates, as torch's `FlopCounterMode` counts them (`triaccel.backends.torch.flops`);
bias additions, norms, activations and pooling count 0. Each product goes to the layer that owns
its parameter operand (followed through dtype casts and reshapes), so a layer's figure is its own
whatever the module nesting; products of two activations belong to no layer and are left out.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .layers import LayerMap, layer_map_from_model

__all__ = ["layer_flops"]

# Primitives that pass their first operand through unchanged but for dtype or layout: a
# parameter's identity survives them (e.g. the cast of a kernel to a layer's compute dtype).
_PASS = frozenset({"convert_element_type", "reshape", "transpose", "squeeze", "expand_dims", "copy",
                   "copy_p", "reduce_precision", "broadcast_in_dim", "optimization_barrier"})


def _sub_jaxprs(eqn: Any) -> list[Any]:
    """(jaxpr, consts-free) sub-programs of a call-like equation (jit, custom_jvp/vjp, remat)."""
    out = []
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if sub is None:
            continue
        out.append(getattr(sub, "jaxpr", sub))
    return out


def _count(jaxpr: Any, origin: dict[Any, int], flops: np.ndarray, times: float) -> None:
    """Add the FLOPs of `jaxpr`'s products into `flops` (per tensor); origin: var -> parameter leaf."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = [None if type(v).__name__ == "Literal" else origin.get(v) for v in eqn.invars]
        if name == "conv_general_dilated":
            rhs, out = eqn.invars[1].aval, eqn.outvars[0].aval
            owner = ins[1] if ins[1] is not None else ins[0]
            if owner is not None:
                out_dim = eqn.params["dimension_numbers"].rhs_spec[0]
                macs = int(np.prod(out.shape)) * int(np.prod(rhs.shape)) // int(rhs.shape[out_dim])
                flops[owner] += 2.0 * macs * times
        elif name == "dot_general":
            lhs = eqn.invars[0].aval
            out = eqn.outvars[0].aval
            owner = ins[1] if ins[1] is not None else ins[0]
            if owner is not None:
                (contract, _), _ = eqn.params["dimension_numbers"]
                k = int(np.prod([lhs.shape[d] for d in contract])) if contract else 1
                flops[owner] += 2.0 * int(np.prod(out.shape)) * k * times
        elif name in _PASS:
            if ins and ins[0] is not None:
                origin[eqn.outvars[0]] = ins[0]
        elif name == "scan":
            body = eqn.params["jaxpr"].jaxpr
            n_consts = eqn.params["num_consts"]
            sub = {bv: o for bv, o in zip(body.invars[:n_consts], ins[:n_consts]) if o is not None}
            _count(body, sub, flops, times * int(eqn.params["length"]))
        else:
            for body in _sub_jaxprs(eqn):
                if len(body.invars) != len(ins):
                    continue
                sub = {bv: o for bv, o in zip(body.invars, ins) if o is not None}
                _count(body, sub, flops, times)


def layer_flops(model: Any, sample: Any, layer_map: LayerMap | None = None) -> np.ndarray:
    """(L,) forward FLOPs per sample of each layer of the NNX `model`, in `layer_map`'s order.

    sample: the model's input for ONE sample, with its batch axis (1, ...) (an array, or a tuple
    of the model's positional arguments). layer_map: the layers to report (default
    `layer_map_from_model(model)`; e.g. the TriAccel wrapper's `ta.layers`). The model is only
    traced (`jax.make_jaxpr` on a copy): nothing runs, its state is not changed.
    """
    from flax import nnx

    args = sample if isinstance(sample, tuple) else (sample,)
    first = jax.tree_util.tree_leaves(args)
    if not first or np.ndim(first[0]) == 0 or np.shape(first[0])[0] != 1:
        raise ValueError(f"sample: expected a batch of one sample (1, ...), got shape "
                         f"{np.shape(first[0]) if first else None}")
    lm = layer_map if layer_map is not None else layer_map_from_model(model)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tensor_layer = lm.tensor_layer_of(params)

    def forward(p: Any, r: Any, *xs: Any) -> Any:
        m = nnx.merge(graphdef, p, r, copy=True)
        m.eval()   # as torch's count: eval mode, running statistics untouched
        return m(*xs)

    closed = jax.make_jaxpr(forward)(params, rest, *args)
    jaxpr = closed.jaxpr
    n = len(tensor_layer)
    origin = {v: i for i, v in enumerate(jaxpr.invars[:n])}
    per_tensor = np.zeros(n)
    _count(jaxpr, origin, per_tensor, 1.0)
    out = np.zeros(lm.num_layers)
    np.add.at(out, tensor_layer, per_tensor)
    return out
