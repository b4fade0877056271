"""ResNet-18 (CIFAR) and EfficientNet-B0 as ``torch.nn.Module`` (NCHW input), built from the
framework-free plans in :mod:`triaccel.layout`, plus converters to/from the canonical layout.

Canonical layout = this module's ``state_dict``: names like ``layer1.0.conv1.weight``, arrays in
torch layouts (conv OIHW, linear ``(out, in)``), BatchNorm buffers included.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from triaccel.layout import (
    BN_EPS,
    BN_MOMENTUM_TORCH,
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
    "ResNet",
    "EfficientNet",
    "create_model",
    "MEMORY_FORMATS",
    "uses_channels_last",
    "to_canonical",
    "load_canonical",
    "layer_infos",
]


def _bn(c: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(c, eps=BN_EPS, momentum=BN_MOMENTUM_TORCH)


def _conv(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, bias: bool = False) -> nn.Conv2d:
    # padding (k-1)//2 on every side: the Flax twin uses the same explicit padding.
    return nn.Conv2d(cin, cout, k, stride=stride, padding=(k - 1) // 2, groups=groups, bias=bias)


class BasicBlock(nn.Module):
    """ResNet BasicBlock: conv3x3-BN-ReLU-conv3x3-BN + shortcut, ReLU."""

    def __init__(self, plan: BasicBlockPlan) -> None:
        super().__init__()
        self.conv1 = _conv(plan.in_channels, plan.out_channels, 3, plan.stride)
        self.bn1 = _bn(plan.out_channels)
        self.conv2 = _conv(plan.out_channels, plan.out_channels, 3)
        self.bn2 = _bn(plan.out_channels)
        self.downsample: nn.Sequential | None = None
        if plan.downsample:
            self.downsample = nn.Sequential(
                _conv(plan.in_channels, plan.out_channels, 1, plan.stride), _bn(plan.out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.relu(out + shortcut)


class ResNet(nn.Module):
    """CIFAR ResNet-18: 3x3 stride-1 stem, no max-pool, 4 stages of 2 BasicBlocks, global average
    pool, ``fc``. Input (N, 3, H, W) float; output logits (N, num_classes)."""

    def __init__(self, plan: ResNetPlan, seed: int = 0) -> None:
        super().__init__()
        self.plan = plan
        self.conv1 = _conv(3, plan.stem_channels, 3)
        self.bn1 = _bn(plan.stem_channels)
        for i, stage in enumerate(plan.stages, start=1):
            self.add_module(f"layer{i}", nn.Sequential(*[BasicBlock(b) for b in stage]))
        self.fc = nn.Linear(plan.feature_channels, plan.num_classes)
        load_canonical(self, init_canonical(plan, seed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        for i in range(1, len(self.plan.stages) + 1):
            x = getattr(self, f"layer{i}")(x)
        return self.fc(torch.flatten(x.mean(dim=(2, 3)), 1))


class ConvBNAct(nn.Module):
    """conv (no bias) + BN (+ SiLU when ``act``)."""

    def __init__(self, cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, act: bool = True) -> None:
        super().__init__()
        self.conv = _conv(cin, cout, k, stride, groups)
        self.bn = _bn(cout)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn(self.conv(x))
        return F.silu(x) if self.act else x


class SqueezeExcite(nn.Module):
    """Squeeze-excitation: global pool -> 1x1 conv ``reduce`` -> SiLU -> 1x1 conv ``expand`` ->
    sigmoid -> channel scale."""

    def __init__(self, channels: int, squeeze: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, squeeze, 1, bias=True)
        self.expand = nn.Conv2d(squeeze, channels, 1, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.mean(dim=(2, 3), keepdim=True)
        s = self.expand(F.silu(self.reduce(s)))
        return x * torch.sigmoid(s)


def _drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    # Stochastic depth, per sample: keep the branch with prob 1-p, scaled by 1/(1-p).
    if not training or p == 0.0:
        return x
    keep = 1.0 - p
    mask = torch.empty((x.shape[0], 1, 1, 1), dtype=x.dtype, device=x.device).bernoulli_(keep)
    return x * mask / keep


class MBConv(nn.Module):
    """MBConv: [expand 1x1] -> depthwise kxk -> SE -> project 1x1 (+ residual with stochastic depth)."""

    def __init__(self, plan: MBConvPlan) -> None:
        super().__init__()
        self.plan = plan
        self.expand: ConvBNAct | None = None
        if plan.expand:
            self.expand = ConvBNAct(plan.in_channels, plan.expanded_channels, 1)
        c = plan.expanded_channels
        self.dw = ConvBNAct(c, c, plan.kernel, plan.stride, groups=c)
        self.se = SqueezeExcite(c, plan.se_channels)
        self.project = ConvBNAct(c, plan.out_channels, 1, act=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x if self.expand is None else self.expand(x)
        out = self.project(self.se(self.dw(out)))
        if self.plan.residual:
            out = _drop_path(out, self.plan.drop_prob, self.training) + x
        return out


class EfficientNet(nn.Module):
    """EfficientNet-B0: stem 3x3 conv-BN-SiLU, 16 MBConv blocks (``blocks.<i>``), 1x1 head conv-BN-SiLU,
    global average pool, [dropout], ``fc``. Input (N, 3, H, W) float (32x32 or 224x224, any H, W
    >= total stride works); output logits (N, num_classes)."""

    def __init__(self, plan: EfficientNetPlan, seed: int = 0) -> None:
        super().__init__()
        self.plan = plan
        self.stem = ConvBNAct(3, plan.stem_channels, 3, plan.stem_stride)
        self.blocks = nn.Sequential(*[MBConv(b) for b in plan.blocks])
        self.head = ConvBNAct(plan.blocks[-1].out_channels, plan.head_channels, 1)
        self.fc = nn.Linear(plan.head_channels, plan.num_classes)
        load_canonical(self, init_canonical(plan, seed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(self.blocks(self.stem(x)))
        x = torch.flatten(x.mean(dim=(2, 3)), 1)
        x = F.dropout(x, self.plan.dropout, self.training)
        return self.fc(x)


MEMORY_FORMATS = ("auto", "channels_last", "contiguous")


def uses_channels_last(name: str, memory_format: str, device_type: str) -> bool:
    """Whether `create_model(name)` runs in the channels_last memory format on `device_type`.

    memory_format: "channels_last", "contiguous", or "auto": channels_last on CUDA except for
    EfficientNet. Measured on an H100 (torch 2.11, cuDNN 9.19, bf16): EfficientNet's depthwise
    convolutions in channels_last cost ~10 s on the first step of each new batch size (0.3 s
    contiguous) and were not faster after it, and an elastic batch visits several sizes
    (docs/results.md, session of 2026-11-23 04:40Z)."""
    if memory_format not in MEMORY_FORMATS:
        raise ValueError(f"memory_format={memory_format!r}: allowed {MEMORY_FORMATS}")
    if memory_format == "auto":
        return device_type == "cuda" and not name.startswith("efficientnet")
    return memory_format == "channels_last"


def create_model(name: str, num_classes: int = 10, width: float = 1.0, *, seed: int = 0, **kwargs: Any) -> ResNet | EfficientNet:
    """Build ``"resnet18"`` or ``"efficientnet_b0"``.

    ``width`` scales channels (``width=0.125`` gives a tiny test model). EfficientNet also takes
    ``depth``, ``stem_stride`` (2 standard, 1 for CIFAR-native resolution), ``drop_path_rate``
    and ``dropout`` (both 0 = off by default); see :func:`triaccel.layout.efficientnet_b0_plan`.
    Weights come from :func:`triaccel.layout.init_canonical` with ``seed`` (not from torch's global
    RNG): the same seed gives the same weights as the Flax twin. Float32, on the CPU; move/cast
    with the usual ``.to()``.
    """
    plan = model_plan(name, num_classes, width, **kwargs)
    return ResNet(plan, seed) if isinstance(plan, ResNetPlan) else EfficientNet(plan, seed)


def layer_infos(model: ResNet | EfficientNet) -> tuple[LayerInfo, ...]:
    """Parameter-owning layers (canonical names, kinds) in forward order; same as the Flax twin's."""
    return model_layers(model.plan)


def to_canonical(model: nn.Module) -> dict[str, np.ndarray]:
    """The model's ``state_dict`` as NumPy arrays (copies on the host; float32 weights,
    int64 ``num_batches_tracked``)."""
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def load_canonical(model: nn.Module, d: Mapping[str, Any]) -> None:
    """Load a canonical dict (NumPy arrays or tensors) in place; values take the model's device
    and dtype.

    Raises ValueError naming any missing, unexpected or mis-shaped key; nothing is loaded then.
    """
    sd = model.state_dict()
    check_canonical({k: tuple(v.shape) for k, v in sd.items()}, d, what="load_canonical")
    with torch.no_grad():
        for k, v in sd.items():
            v.copy_(torch.as_tensor(d[k]).to(device=v.device, dtype=v.dtype))
