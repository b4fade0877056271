"""The two training loops the optimizer probes compare (`opt_profile.py`, `opt_phases.py`): ResNet-18
(or another model of `create_model`, contiguous) at batch 96 (or another) on CUDA over fused SGD, as a
plain AMP-bf16 loop ("amp") or wrapped by triaccel (any other variant name), with the same model seed,
data and optimizer settings."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from triaccel import TriAccelConfig
from triaccel.backends.torch import wrap
from triaccel.backends.torch.models import create_model

CONFIG = TriAccelConfig(curvature="fisher", t_curv=10**9, t_ctrl=50, warmup_steps=50, min_dwell=50,
                        batch_init=96, batch_min=8, batch_max=1024, lr_rule="linear")


def batch(dev: torch.device, n: int = 96) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed CIFAR-shaped batch of `n` on `dev`."""
    return torch.randn(n, 3, 32, 32, device=dev), torch.randint(0, 10, (n,), device=dev)


def loop(variant: str, dev: torch.device, x: torch.Tensor, y: torch.Tensor, model_name: str = "resnet18"
         ) -> tuple[torch.nn.Module, torch.optim.SGD, Any, Callable[[], Any], Callable[[torch.Tensor], None]]:
    """(model, inner SGD, the optimizer to step, the forward's autocast region, backward) for `variant`."""
    torch.manual_seed(0)
    model = create_model(model_name).to(dev)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4,
                          fused=True)
    if variant == "amp":
        return model, sgd, sgd, (lambda: torch.autocast("cuda", dtype=torch.bfloat16)), (lambda loss: loss.backward())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = wrap(sgd, model, CONFIG.replace(batch_init=len(x), batch_max=max(len(x), 1024)),
                   curvature_data=(x[:32], y[:32]))
    return model, sgd, opt, opt.autocast, opt.backward
