"""Framework-free architecture plans and the canonical parameter layout shared by both backends.

One parameter layout serves PyTorch and Flax: canonical names are torch ``state_dict`` names
(``layer1.0.conv1.weight``, ``bn1.running_mean``, ``fc.bias``) and canonical arrays use torch
layouts (conv OIHW, linear ``(out, in)``). The Flax module tree uses the same module paths
(NNX path ``('layer1', 0, 'conv1')`` <-> ``'layer1.0.conv1'``), so per-layer names are identical
in both frameworks.

The plans below (channel widths, strides, kernel sizes, block order) are the single description of
each architecture; ``backends/torch/models.py`` and ``backends/jax/models.py`` build from them, and
:func:`model_layers` derives the ordered list of parameter-owning layers from them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "MODEL_NAMES",
    "BN_EPS",
    "BN_MOMENTUM_TORCH",
    "BN_MOMENTUM_FLAX",
    "LayerInfo",
    "BasicBlockPlan",
    "ResNetPlan",
    "MBConvPlan",
    "EfficientNetPlan",
    "make_divisible",
    "validate_model_args",
    "resnet18_plan",
    "efficientnet_b0_plan",
    "model_plan",
    "model_layers",
    "canonical_shapes",
    "init_canonical",
    "check_canonical",
]

MODEL_NAMES: tuple[str, ...] = ("resnet18", "efficientnet_b0")

#: BatchNorm epsilon used by every model in both frameworks.
BN_EPS: float = 1e-5
#: torch momentum (weight of the new batch statistic) ...
BN_MOMENTUM_TORCH: float = 0.1
#: ... and the equivalent Flax momentum (weight of the old running value): 1 - 0.1.
BN_MOMENTUM_FLAX: float = 1.0 - BN_MOMENTUM_TORCH


@dataclass(frozen=True)
class LayerInfo:
    """One parameter-owning module: canonical dotted ``name`` and ``kind`` ("conv"|"linear"|"norm").

    ``kind == "norm"`` marks BatchNorm layers, which the controller keeps in FP32.
    """

    name: str
    kind: str


def make_divisible(value: float, divisor: int = 8) -> int:
    """Round a channel count to the nearest multiple of ``divisor`` (at least ``divisor``), never
    going more than 10% below ``value`` (the EfficientNet/MobileNet rule)."""
    new = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if new < 0.9 * value:
        new += divisor
    return new


def _check_positive_finite(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v <= 0.0:
        raise ValueError(f"{name} must be a positive finite number (range (0, inf)), got {value!r}")
    return v


def _check_prob(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1), got {value!r}")
    return float(value)


def validate_model_args(name: str, num_classes: int, width: float) -> None:
    """Check the arguments every model factory shares; ValueError naming the bad one."""
    if name not in MODEL_NAMES:
        raise ValueError(f"model name must be one of {MODEL_NAMES}, got {name!r}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
        raise ValueError(f"num_classes must be an integer >= 1, got {num_classes!r}")
    _check_positive_finite("width", width)


# ----------------------------------------------------------------------------------------------
# ResNet-18, CIFAR variant: 3x3 stride-1 stem conv, no max-pool, BasicBlocks [2, 2, 2, 2].


@dataclass(frozen=True)
class BasicBlockPlan:
    """A BasicBlock at ``prefix`` (e.g. ``"layer2.0"``): in/out channels, stride of conv1, and
    whether a 1x1-conv + BN ``downsample`` shortcut exists."""

    prefix: str
    in_channels: int
    out_channels: int
    stride: int
    downsample: bool


@dataclass(frozen=True)
class ResNetPlan:
    """CIFAR ResNet-18 plan: stem channels, blocks in forward order, classes."""

    stem_channels: int
    blocks: tuple[BasicBlockPlan, ...]
    num_classes: int

    @property
    def stages(self) -> tuple[tuple[BasicBlockPlan, ...], ...]:
        """Blocks grouped by stage (``layer1`` .. ``layer4``)."""
        out: dict[str, list[BasicBlockPlan]] = {}
        for b in self.blocks:
            out.setdefault(b.prefix.split(".")[0], []).append(b)
        return tuple(tuple(v) for v in out.values())

    @property
    def feature_channels(self) -> int:
        return self.blocks[-1].out_channels


def resnet18_plan(num_classes: int = 10, width: float = 1.0) -> ResNetPlan:
    """Plan of the CIFAR ResNet-18; ``width`` scales all channel counts (rounded to multiples of 8)."""
    validate_model_args("resnet18", num_classes, width)
    stem = make_divisible(64 * width)
    blocks: list[BasicBlockPlan] = []
    in_ch = stem
    for stage, (base, stride) in enumerate(((64, 1), (128, 2), (256, 2), (512, 2)), start=1):
        out_ch = make_divisible(base * width)
        for i in range(2):
            s = stride if i == 0 else 1
            blocks.append(
                BasicBlockPlan(f"layer{stage}.{i}", in_ch, out_ch, s, downsample=(s != 1 or in_ch != out_ch))
            )
            in_ch = out_ch
    return ResNetPlan(stem, tuple(blocks), int(num_classes))


# ----------------------------------------------------------------------------------------------
# EfficientNet-B0: MBConv (expand 1x1, depthwise kxk, squeeze-excitation, project 1x1), SiLU.

# (expand_ratio, kernel, stride, in_channels, out_channels, num_layers) of the 7 B0 stages.
_B0_STAGES: tuple[tuple[int, int, int, int, int, int], ...] = (
    (1, 3, 1, 32, 16, 1),
    (6, 3, 2, 16, 24, 2),
    (6, 5, 2, 24, 40, 2),
    (6, 3, 2, 40, 80, 3),
    (6, 5, 1, 80, 112, 3),
    (6, 5, 2, 112, 192, 4),
    (6, 3, 1, 192, 320, 1),
)


@dataclass(frozen=True)
class MBConvPlan:
    """One MBConv block at ``prefix`` (``"blocks.<i>"``). ``expand`` is False when the expansion
    ratio is 1 (no expand conv). ``se_channels`` = squeeze width. ``drop_prob`` = stochastic-depth
    probability of this block (used only when ``residual``)."""

    prefix: str
    in_channels: int
    out_channels: int
    expanded_channels: int
    kernel: int
    stride: int
    se_channels: int
    drop_prob: float

    @property
    def expand(self) -> bool:
        return self.expanded_channels != self.in_channels

    @property
    def residual(self) -> bool:
        return self.stride == 1 and self.in_channels == self.out_channels


@dataclass(frozen=True)
class EfficientNetPlan:
    """EfficientNet-B0 plan: stem (3x3, ``stem_stride``), MBConv blocks, 1x1 head, classifier."""

    stem_channels: int
    stem_stride: int
    blocks: tuple[MBConvPlan, ...]
    head_channels: int
    num_classes: int
    dropout: float


def efficientnet_b0_plan(
    num_classes: int = 10,
    width: float = 1.0,
    depth: float = 1.0,
    stem_stride: int = 2,
    drop_path_rate: float = 0.0,
    dropout: float = 0.0,
) -> EfficientNetPlan:
    """Plan of EfficientNet-B0.

    ``width`` scales channels (multiples of 8), ``depth`` scales blocks per stage (ceil).
    ``stem_stride`` 2 is the standard B0 (total stride 32: 224x224 -> 7x7, 32x32 -> 1x1); 1 keeps
    more resolution at CIFAR's native 32x32 (total stride 16). ``drop_path_rate`` is the
    stochastic-depth probability of the last block, rising linearly from 0 (0 = off, the default).
    ``dropout`` is applied before the classifier (0 = off).
    """
    validate_model_args("efficientnet_b0", num_classes, width)
    _check_positive_finite("depth", depth)
    if stem_stride not in (1, 2) or isinstance(stem_stride, bool):
        raise ValueError(f"stem_stride must be 1 or 2, got {stem_stride!r}")
    drop_path_rate = _check_prob("drop_path_rate", drop_path_rate)
    dropout = _check_prob("dropout", dropout)

    stages = [
        (e, k, s, make_divisible(i * width), make_divisible(o * width), int(math.ceil(n * depth)))
        for e, k, s, i, o, n in _B0_STAGES
    ]
    total = sum(n for *_, n in stages)
    blocks: list[MBConvPlan] = []
    for e, k, s, in_ch, out_ch, n in stages:
        for j in range(n):
            cin = in_ch if j == 0 else out_ch
            idx = len(blocks)
            blocks.append(
                MBConvPlan(
                    prefix=f"blocks.{idx}",
                    in_channels=cin,
                    out_channels=out_ch,
                    expanded_channels=make_divisible(cin * e),
                    kernel=k,
                    stride=s if j == 0 else 1,
                    se_channels=max(1, cin // 4),
                    drop_prob=drop_path_rate * idx / total,
                )
            )
    return EfficientNetPlan(
        stem_channels=stages[0][3],
        stem_stride=int(stem_stride),
        blocks=tuple(blocks),
        head_channels=4 * stages[-1][4],
        num_classes=int(num_classes),
        dropout=dropout,
    )


def model_plan(name: str, num_classes: int = 10, width: float = 1.0, **kwargs: Any) -> ResNetPlan | EfficientNetPlan:
    """The plan for ``name`` in :data:`MODEL_NAMES`; ``kwargs`` go to the model's plan function."""
    validate_model_args(name, num_classes, width)
    if name == "resnet18":
        if kwargs:
            raise ValueError(f"resnet18 takes no extra arguments, got {sorted(kwargs)}")
        return resnet18_plan(num_classes, width)
    allowed = {"depth", "stem_stride", "drop_path_rate", "dropout"}
    extra = set(kwargs) - allowed
    if extra:
        raise ValueError(f"efficientnet_b0 got unknown arguments {sorted(extra)}; allowed: {sorted(allowed)}")
    return efficientnet_b0_plan(num_classes, width, **kwargs)


@dataclass(frozen=True)
class _Layer:
    name: str
    kind: str  # "conv" | "linear" | "norm"
    cin: int
    cout: int
    kernel: int = 1
    groups: int = 1
    bias: bool = False


def _conv(name: str, cin: int, cout: int, k: int, groups: int = 1, bias: bool = False) -> _Layer:
    return _Layer(name, "conv", cin, cout, k, groups, bias)


def _norm(name: str, c: int) -> _Layer:
    return _Layer(name, "norm", c, c)


def _layer_table(plan: ResNetPlan | EfficientNetPlan) -> list[_Layer]:
    out: list[_Layer] = []
    if isinstance(plan, ResNetPlan):
        out += [_conv("conv1", 3, plan.stem_channels, 3), _norm("bn1", plan.stem_channels)]
        for b in plan.blocks:
            p, ci, co = b.prefix, b.in_channels, b.out_channels
            out += [_conv(f"{p}.conv1", ci, co, 3), _norm(f"{p}.bn1", co)]
            out += [_conv(f"{p}.conv2", co, co, 3), _norm(f"{p}.bn2", co)]
            if b.downsample:
                out += [_conv(f"{p}.downsample.0", ci, co, 1), _norm(f"{p}.downsample.1", co)]
        out.append(_Layer("fc", "linear", plan.feature_channels, plan.num_classes, bias=True))
    elif isinstance(plan, EfficientNetPlan):
        out += [_conv("stem.conv", 3, plan.stem_channels, 3), _norm("stem.bn", plan.stem_channels)]
        for b in plan.blocks:
            p, e = b.prefix, b.expanded_channels
            if b.expand:
                out += [_conv(f"{p}.expand.conv", b.in_channels, e, 1), _norm(f"{p}.expand.bn", e)]
            out += [
                _conv(f"{p}.dw.conv", e, e, b.kernel, groups=e),
                _norm(f"{p}.dw.bn", e),
                _conv(f"{p}.se.reduce", e, b.se_channels, 1, bias=True),
                _conv(f"{p}.se.expand", b.se_channels, e, 1, bias=True),
                _conv(f"{p}.project.conv", e, b.out_channels, 1),
                _norm(f"{p}.project.bn", b.out_channels),
            ]
        c_last = plan.blocks[-1].out_channels
        out += [_conv("head.conv", c_last, plan.head_channels, 1), _norm("head.bn", plan.head_channels)]
        out.append(_Layer("fc", "linear", plan.head_channels, plan.num_classes, bias=True))
    else:
        raise ValueError(f"plan must be a ResNetPlan or EfficientNetPlan, got {type(plan).__name__}")
    return out


def model_layers(plan: ResNetPlan | EfficientNetPlan) -> tuple[LayerInfo, ...]:
    """Parameter-owning layers of a planned model, in forward (and torch registration) order.

    Both backends name their layers exactly so; this is the order a controller should use.
    """
    return tuple(LayerInfo(layer.name, layer.kind) for layer in _layer_table(plan))


def canonical_shapes(plan: ResNetPlan | EfficientNetPlan) -> dict[str, tuple[int, ...]]:
    """``{canonical name: torch-layout shape}`` in torch ``state_dict`` order (conv OIHW,
    linear (out, in), BatchNorm weight/bias/running_mean/running_var (C,), num_batches_tracked ())."""
    out: dict[str, tuple[int, ...]] = {}
    for layer in _layer_table(plan):
        n = layer.name
        if layer.kind == "conv":
            out[f"{n}.weight"] = (layer.cout, layer.cin // layer.groups, layer.kernel, layer.kernel)
            if layer.bias:
                out[f"{n}.bias"] = (layer.cout,)
        elif layer.kind == "linear":
            out[f"{n}.weight"] = (layer.cout, layer.cin)
            out[f"{n}.bias"] = (layer.cout,)
        else:
            for suffix in ("weight", "bias", "running_mean", "running_var"):
                out[f"{n}.{suffix}"] = (layer.cout,)
            out[f"{n}.num_batches_tracked"] = ()
    return out


def init_canonical(plan: ResNetPlan | EfficientNetPlan, seed: int = 0) -> dict[str, np.ndarray]:
    """Initial weights in the canonical layout, from NumPy's PCG64 seeded with ``seed``, so that
    the same seed gives the same model in both frameworks.

    Convs: He-normal with fan_out = out*k*k (``N(0, 2/fan_out)``); linear weight
    ``U(-1/sqrt(in), 1/sqrt(in))``; all biases 0; BatchNorm weight 1, bias 0, running mean 0,
    running var 1, num_batches_tracked 0 (int64). Float arrays are float32.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    rng = np.random.default_rng(int(seed))
    kinds = {layer.name: layer.kind for layer in _layer_table(plan)}
    out: dict[str, np.ndarray] = {}
    for key, shape in canonical_shapes(plan).items():
        layer, suffix = key.rsplit(".", 1)
        kind = kinds[layer]
        if suffix == "num_batches_tracked":
            out[key] = np.zeros(shape, np.int64)
        elif suffix in ("bias", "running_mean"):
            out[key] = np.zeros(shape, np.float32)
        elif suffix == "running_var" or (kind == "norm" and suffix == "weight"):
            out[key] = np.ones(shape, np.float32)
        elif kind == "conv":
            fan_out = shape[0] * shape[2] * shape[3]
            out[key] = rng.normal(0.0, math.sqrt(2.0 / fan_out), size=shape).astype(np.float32)
        else:  # linear weight (out, in)
            bound = 1.0 / math.sqrt(shape[1])
            out[key] = rng.uniform(-bound, bound, size=shape).astype(np.float32)
    return out


def check_canonical(
    expected: Mapping[str, tuple[int, ...]], given: Mapping[str, Any], *, what: str = "state"
) -> None:
    """Validate a canonical dict against the expected ``{name: shape}``.

    Raises ValueError naming the first missing, unexpected or mis-shaped key (and how many of
    each kind there are), so that nothing is silently dropped or broadcast.
    """
    missing = [k for k in expected if k not in given]
    extra = [k for k in given if k not in expected]
    if missing:
        raise ValueError(f"{what}: missing key {missing[0]!r} ({len(missing)} missing in all)")
    if extra:
        raise ValueError(f"{what}: unexpected key {extra[0]!r} ({len(extra)} unexpected in all)")
    for k, shape in expected.items():
        got = tuple(np.shape(given[k]))
        if got != tuple(shape):
            raise ValueError(f"{what}: key {k!r} has shape {got}, expected {tuple(shape)}")
