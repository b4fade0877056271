"""ResNet-18 (CIFAR) and EfficientNet-B0 as Flax NNX modules (NHWC input), built from the
framework-free plans in :mod:`triaccel.layout`, plus converters to/from the canonical layout.

Module paths equal the torch twin's (NNX path ``('layer1', 0, 'conv1')`` <-> ``'layer1.0.conv1'``),
so per-layer names are identical in both frameworks. Every layer is an ``nnx.Conv``,
``nnx.Linear`` or :class:`BatchNorm2d` (an ``nnx.BatchNorm``) with ``param_dtype`` float32 and a
per-module ``dtype`` attribute (``None`` = compute in the inputs'/params' promoted type): set
``module.dtype = jnp.bfloat16`` on one layer to change that layer's compute dtype.

Canonical layout (shared with torch): conv OIHW <-> Flax HWIO kernel, linear ``(out, in)`` <->
``(in, out)``, BatchNorm ``weight/bias/running_mean/running_var/num_batches_tracked`` <->
``scale/bias/mean/var/num_batches_tracked``.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from triaccel.layout import (
    BN_EPS,
    BN_MOMENTUM_FLAX,
    BasicBlockPlan,
    EfficientNetPlan,
    LayerInfo,
    MBConvPlan,
    ResNetPlan,
    check_canonical,
    init_canonical,
    model_layers,
    model_plan,
)

__all__ = [
    "BatchNorm2d",
    "batch_mask",
    "ResNet",
    "EfficientNet",
    "create_model",
    "to_canonical",
    "load_canonical",
    "layer_infos",
    "named_layers",
]

# Used only when a class is built directly: the distributions of triaccel.layout.init_canonical
# (convs He-normal with fan_out, linear U(+-1/sqrt(fan_in))); create_model loads that instead.
_CONV_INIT = jax.nn.initializers.variance_scaling(2.0, "fan_out", "normal")
_LINEAR_INIT = jax.nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


_MASK = threading.local()   # `batch_mask`'s mask while a model is traced inside it


@contextlib.contextmanager
def batch_mask(mask: Any) -> Iterator[None]:
    """Inside, every `BatchNorm2d` in training mode takes its batch statistics over the rows where
    `mask` (float (B,), 1 = a real sample) is nonzero: padding rows (a loader's pad floor or short
    last step, `data.ElasticLoader`) then change neither the normalisation nor the running statistics,
    and, masked out of the loss too, have no path to the gradients: a padded step computes what the
    unpadded one does, however its copies were augmented or repeated. None: every row counts (the
    default). Set it around the model call inside the traced step (it is read at trace time)."""
    prev = getattr(_MASK, "value", None)
    _MASK.value = mask
    try:
        yield
    finally:
        _MASK.value = prev


class BatchNorm2d(nnx.BatchNorm):
    """``nnx.BatchNorm`` over the last (channel) axis with torch semantics.

    Differences from the parent, all to match ``torch.nn.BatchNorm2d``: the running variance is
    updated with the *unbiased* batch variance (normalisation uses the biased one), statistics are
    computed in at least float32 with the two-pass formula, and a ``num_batches_tracked`` counter
    (int32 ``BatchStat``) is kept. Momentum 0.9 here == 0.1 in torch; eps 1e-5.
    """

    def __init__(self, num_features: int, *, dtype: Any = None, rngs: nnx.Rngs) -> None:
        super().__init__(
            num_features,
            momentum=BN_MOMENTUM_FLAX,
            epsilon=BN_EPS,
            dtype=dtype,
            param_dtype=jnp.float32,
            use_fast_variance=False,
            use_running_average=False,
            rngs=rngs,
        )
        self.num_batches_tracked = nnx.BatchStat(jnp.zeros((), jnp.int32))

    def __call__(self, x: jax.Array, use_running_average: bool | None = None, *, mask: Any = None) -> jax.Array:
        """x: (B, ..., C). Train mode (``use_running_average=False``) normalises with batch statistics
        and updates the running ones; eval mode uses the running statistics. mask: float (B,), the
        rows the batch statistics are taken over (default: `batch_mask`'s, else every row)."""
        if mask is None:
            mask = getattr(_MASK, "value", None)
        if mask is not None and (jnp.ndim(mask) != 1 or jnp.shape(mask)[0] != x.shape[0]):
            raise ValueError(f"BatchNorm2d: mask must have shape ({x.shape[0]},) (one value per row), "
                             f"got {jnp.shape(mask)}")
        ura = self.use_running_average if use_running_average is None else use_running_average
        axes = tuple(range(x.ndim - 1))
        stat_dtype = jnp.promote_types(x.dtype, jnp.float32)
        out_dtype = self.dtype if self.dtype is not None else jnp.promote_types(x.dtype, self.param_dtype)
        xf = x.astype(stat_dtype)
        if ura:
            mean = self.mean[...].astype(stat_dtype)
            var = self.var[...].astype(stat_dtype)
        else:
            n = math.prod(x.shape[a] for a in axes)
            if n < 2:
                # torch raises too: the unbiased variance of one value is undefined.
                raise ValueError(f"BatchNorm2d: training needs more than 1 value per channel, got input shape {x.shape}")
            if mask is None:
                mean = jnp.mean(xf, axis=axes)
                var = jnp.mean(jnp.square(xf - mean), axis=axes)
            else:   # the real rows only: n values per channel of them (a traced count)
                w = jnp.reshape(mask, (-1,) + (1,) * (x.ndim - 1)).astype(stat_dtype)
                n = jnp.sum(w) * (n // x.shape[0])
                mean = jnp.sum(xf * w, axis=axes) / n
                var = jnp.sum(jnp.square(xf - mean) * w, axis=axes) / n
            m = self.momentum
            sg = jax.lax.stop_gradient
            self.mean[...] = sg(m * self.mean[...] + (1.0 - m) * mean).astype(self.mean.dtype)
            # (a masked count can be 1: a short step's one real sample at 1x1 spatial size)
            self.var[...] = sg(m * self.var[...] + (1.0 - m) * var * (n / jnp.maximum(n - 1, 1))).astype(self.var.dtype)
            self.num_batches_tracked[...] = self.num_batches_tracked[...] + 1
        mul = jax.lax.rsqrt(var + self.epsilon) * self.scale[...].astype(stat_dtype)
        y = (xf - mean) * mul + self.bias[...].astype(stat_dtype)
        return y.astype(out_dtype)


def _conv(cin: int, cout: int, k: int, rngs: nnx.Rngs, stride: int = 1, groups: int = 1, bias: bool = False) -> nnx.Conv:
    p = (k - 1) // 2  # explicit symmetric padding == torch's padding=(k-1)//2 (not 'SAME')
    return nnx.Conv(
        cin,
        cout,
        kernel_size=(k, k),
        strides=(stride, stride),
        padding=((p, p), (p, p)),
        feature_group_count=groups,
        use_bias=bias,
        kernel_init=_CONV_INIT,
        bias_init=jax.nn.initializers.zeros,
        param_dtype=jnp.float32,
        rngs=rngs,
    )


def _linear(cin: int, cout: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        cin, cout, kernel_init=_LINEAR_INIT, bias_init=jax.nn.initializers.zeros, param_dtype=jnp.float32, rngs=rngs
    )


class BasicBlock(nnx.Module):
    """ResNet BasicBlock: conv3x3-BN-ReLU-conv3x3-BN + shortcut, ReLU. NHWC."""

    def __init__(self, plan: BasicBlockPlan, rngs: nnx.Rngs) -> None:
        self.conv1 = _conv(plan.in_channels, plan.out_channels, 3, rngs, plan.stride)
        self.bn1 = BatchNorm2d(plan.out_channels, rngs=rngs)
        self.conv2 = _conv(plan.out_channels, plan.out_channels, 3, rngs)
        self.bn2 = BatchNorm2d(plan.out_channels, rngs=rngs)
        self.downsample: nnx.List | None = nnx.data(None)
        if plan.downsample:
            self.downsample = nnx.List(
                [_conv(plan.in_channels, plan.out_channels, 1, rngs, plan.stride), BatchNorm2d(plan.out_channels, rngs=rngs)]
            )

    def __call__(self, x: jax.Array) -> jax.Array:
        out = jax.nn.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.downsample is None else self.downsample[1](self.downsample[0](x))
        return jax.nn.relu(out + shortcut)


class ResNet(nnx.Module):
    """CIFAR ResNet-18 (see the torch twin). Input (N, H, W, 3); output logits (N, num_classes)."""

    def __init__(self, plan: ResNetPlan, rngs: nnx.Rngs) -> None:
        self.plan = plan
        self.conv1 = _conv(3, plan.stem_channels, 3, rngs)
        self.bn1 = BatchNorm2d(plan.stem_channels, rngs=rngs)
        self.num_stages = len(plan.stages)
        for i, stage in enumerate(plan.stages, start=1):
            setattr(self, f"layer{i}", nnx.List([BasicBlock(b, rngs) for b in stage]))
        self.fc = _linear(plan.feature_channels, plan.num_classes, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jax.nn.relu(self.bn1(self.conv1(x)))
        for i in range(1, self.num_stages + 1):
            for block in getattr(self, f"layer{i}"):
                x = block(x)
        return self.fc(jnp.mean(x, axis=(1, 2)))


class ConvBNAct(nnx.Module):
    """conv (no bias) + BN (+ SiLU when ``act``). NHWC."""

    def __init__(self, cin: int, cout: int, k: int, rngs: nnx.Rngs, stride: int = 1, groups: int = 1, act: bool = True) -> None:
        self.conv = _conv(cin, cout, k, rngs, stride, groups)
        self.bn = BatchNorm2d(cout, rngs=rngs)
        self.act = act

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.bn(self.conv(x))
        return jax.nn.silu(x) if self.act else x


class SqueezeExcite(nnx.Module):
    """Squeeze-excitation with 1x1 convs ``reduce`` / ``expand`` (with bias). NHWC."""

    def __init__(self, channels: int, squeeze: int, rngs: nnx.Rngs) -> None:
        self.reduce = _conv(channels, squeeze, 1, rngs, bias=True)
        self.expand = _conv(squeeze, channels, 1, rngs, bias=True)

    def __call__(self, x: jax.Array) -> jax.Array:
        s = jnp.mean(x, axis=(1, 2), keepdims=True)
        s = self.expand(jax.nn.silu(self.reduce(s)))
        return x * jax.nn.sigmoid(s)


class MBConv(nnx.Module):
    """MBConv: [expand 1x1] -> depthwise kxk -> SE -> project 1x1 (+ residual, stochastic depth)."""

    def __init__(self, plan: MBConvPlan, rngs: nnx.Rngs) -> None:
        self.residual = plan.residual
        self.expand: ConvBNAct | None = nnx.data(None)
        if plan.expand:
            self.expand = ConvBNAct(plan.in_channels, plan.expanded_channels, 1, rngs)
        c = plan.expanded_channels
        self.dw = ConvBNAct(c, c, plan.kernel, rngs, plan.stride, groups=c)
        self.se = SqueezeExcite(c, plan.se_channels, rngs)
        self.project = ConvBNAct(c, plan.out_channels, 1, rngs, act=False)
        # Stochastic depth = dropout of whole samples (broadcast over H, W, C); only when enabled,
        # so that default models hold no RNG state.
        self.drop_path: nnx.Dropout | None = nnx.data(None)
        if plan.residual and plan.drop_prob > 0.0:
            self.drop_path = nnx.Dropout(plan.drop_prob, broadcast_dims=(1, 2, 3), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        out = x if self.expand is None else self.expand(x)
        out = self.project(self.se(self.dw(out)))
        if self.residual:
            if self.drop_path is not None:
                out = self.drop_path(out)
            out = out + x
        return out


class EfficientNet(nnx.Module):
    """EfficientNet-B0 (see the torch twin). Input (N, H, W, 3); output logits (N, num_classes)."""

    def __init__(self, plan: EfficientNetPlan, rngs: nnx.Rngs) -> None:
        self.plan = plan
        self.stem = ConvBNAct(3, plan.stem_channels, 3, rngs, plan.stem_stride)
        self.blocks = nnx.List([MBConv(b, rngs) for b in plan.blocks])
        self.head = ConvBNAct(plan.blocks[-1].out_channels, plan.head_channels, 1, rngs)
        self.dropout: nnx.Dropout | None = nnx.data(None)
        if plan.dropout > 0.0:
            self.dropout = nnx.Dropout(plan.dropout, rngs=rngs)
        self.fc = _linear(plan.head_channels, plan.num_classes, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        x = jnp.mean(self.head(x), axis=(1, 2))
        if self.dropout is not None:
            x = self.dropout(x)
        return self.fc(x)


def create_model(
    name: str, num_classes: int = 10, width: float = 1.0, *, seed: int = 0, **kwargs: Any
) -> ResNet | EfficientNet:
    """Build ``"resnet18"`` or ``"efficientnet_b0"`` in train mode (call ``.eval()`` for eval).

    ``width`` and the EfficientNet ``kwargs`` are as in the torch twin
    (:func:`triaccel.layout.efficientnet_b0_plan`). Weights come from
    :func:`triaccel.layout.init_canonical` with ``seed``: the same seed gives the same weights as
    the torch twin's ``create_model``. Dropout / stochastic-depth streams (only when enabled) are
    seeded from ``seed`` too.
    """
    plan = model_plan(name, num_classes, width, **kwargs)
    init = init_canonical(plan, seed)  # validates seed
    cls = ResNet if isinstance(plan, ResNetPlan) else EfficientNet
    # Build the structure abstractly and fill it from NumPy: initialising with JAX random ops
    # costs one XLA compilation per distinct shape eagerly, or ~45 s for one jitted init of a
    # tiny ResNet on 2 CPU cores (threefry), against well under a second here.
    model = nnx.eval_shape(lambda: cls(plan, nnx.Rngs(0)))
    load_canonical(model, init)
    base = jax.random.key(int(seed))
    n_keys = 0
    for path, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Variable) or not isinstance(var.get_value(), jax.ShapeDtypeStruct):
            continue
        if isinstance(var, nnx.RngKey):
            var.set_value(jax.random.fold_in(base, n_keys))  # one independent stream per dropout
            n_keys += 1
        elif isinstance(var, nnx.RngCount):
            var.set_value(jnp.zeros(var.shape, var.dtype))
        else:  # a variable the canonical layout does not cover: a bug in this file
            raise RuntimeError(f"create_model: variable {path} was left uninitialised")
    return model


def layer_infos(model: ResNet | EfficientNet) -> tuple[LayerInfo, ...]:
    """Parameter-owning layers (canonical names, kinds) in forward order; same as the torch twin's."""
    return model_layers(model.plan)


def named_layers(model: ResNet | EfficientNet) -> Iterator[tuple[str, nnx.Conv | nnx.Linear | nnx.BatchNorm]]:
    """(canonical name, module) of every parameter-owning layer, in :func:`layer_infos` order."""
    found: dict[str, Any] = {}
    for path, m in nnx.iter_modules(model):
        if isinstance(m, (nnx.Conv, nnx.Linear, nnx.BatchNorm)):
            found[".".join(str(p) for p in path)] = m
    infos = layer_infos(model)
    names = [i.name for i in infos]
    if set(names) != set(found):
        # The plan and the module tree disagree: a bug in this file, not a user error.
        raise RuntimeError(f"model tree {sorted(found)} does not match plan {names}")
    for n in names:
        yield n, found[n]


def _canonical_entries(m: Any) -> list[tuple[str, Any, Any, Any]]:
    """(suffix, variable, to_canonical fn, from_canonical fn) for one layer module."""
    ident = lambda a: a  # noqa: E731
    if isinstance(m, nnx.BatchNorm):
        return [
            ("weight", m.scale, ident, ident),
            ("bias", m.bias, ident, ident),
            ("running_mean", m.mean, ident, ident),
            ("running_var", m.var, ident, ident),
            ("num_batches_tracked", m.num_batches_tracked, ident, ident),
        ]
    if isinstance(m, nnx.Conv):
        hwio_to_oihw = lambda a: np.transpose(a, (3, 2, 0, 1))  # noqa: E731
        oihw_to_hwio = lambda a: np.transpose(a, (2, 3, 1, 0))  # noqa: E731
        out = [("weight", m.kernel, hwio_to_oihw, oihw_to_hwio)]
    elif isinstance(m, nnx.Linear):
        out = [("weight", m.kernel, np.transpose, np.transpose)]
    else:
        raise TypeError(f"not a layer module: {type(m).__name__}")
    if m.bias is not None:
        out.append(("bias", m.bias, ident, ident))
    return out


def to_canonical(model: ResNet | EfficientNet) -> dict[str, np.ndarray]:
    """Canonical dict (torch ``state_dict`` names, order and layouts) as NumPy copies on the host.
    ``num_batches_tracked`` comes out as int64, like torch's."""
    out: dict[str, np.ndarray] = {}
    for name, m in named_layers(model):
        for suffix, var, fwd, _ in _canonical_entries(m):
            a = np.asarray(jax.device_get(var.get_value()))
            if suffix == "num_batches_tracked":
                a = a.astype(np.int64)
            out[f"{name}.{suffix}"] = np.array(fwd(a), order="C")  # copy; keeps 0-d shape
    return out


def load_canonical(model: ResNet | EfficientNet, d: Mapping[str, Any]) -> None:
    """Load a canonical dict in place (values take each variable's dtype).

    Raises ValueError naming any missing, unexpected or mis-shaped key, or a
    ``num_batches_tracked`` outside int32; nothing is loaded then.
    """
    plan: list[tuple[str, Any, Any]] = []
    expected: dict[str, tuple[int, ...]] = {}
    for name, m in named_layers(model):
        for suffix, var, fwd, back in _canonical_entries(m):
            key = f"{name}.{suffix}"
            expected[key] = tuple(fwd(np.empty(var.shape, dtype=np.bool_)).shape)
            plan.append((key, var, back))
    check_canonical(expected, d, what="load_canonical")
    i32 = np.iinfo(np.int32)
    for key, var, _ in plan:
        if key.endswith("num_batches_tracked"):
            v = int(np.asarray(d[key]))
            if not i32.min <= v <= i32.max:
                raise ValueError(f"load_canonical: {key!r} = {v} is outside the int32 range kept by Flax")
    for key, var, back in plan:
        var.set_value(jnp.asarray(back(np.asarray(d[key])), dtype=var.dtype))
