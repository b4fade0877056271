"""Per-layer forward FLOPs of a torch model, for `triaccel.flops.FlopShare`.

Counted once with torch's own `torch.utils.flop_counter.FlopCounterMode` (matmuls and
convolutions, by module) on a batch of one sample.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from .layers import ROOT_NAME, TorchLayer

__all__ = ["layer_flops"]


@torch.no_grad()
def layer_flops(model: nn.Module, layers: Sequence[TorchLayer], sample: torch.Tensor) -> np.ndarray:
    """(L,) forward FLOPs per sample of each layer (`layers`' order) on input `sample` (1, ...).

    A layer's figure excludes the layers nested in it (a module owning parameters and children).
    The model runs once in eval mode (BatchNorm statistics untouched) and is put back in its mode.
    """
    if sample.shape[0] != 1:
        raise ValueError(f"sample: expected a batch of one sample (1, ...), got shape {tuple(sample.shape)}")
    was_training = model.training
    model.eval()
    try:
        with FlopCounterMode(display=False) as counter:
            model(sample)
    finally:
        model.train(was_training)
    counts = counter.get_flop_counts()
    root = type(model).__name__
    total = {layer.name: float(sum(counts.get(root if layer.name == ROOT_NAME else f"{root}.{layer.name}",
                                              {}).values())) for layer in layers}
    own = dict(total)
    for name in total:       # subtract nested layers (names are qualified module paths)
        if name == ROOT_NAME:
            own[name] -= sum(v for n, v in total.items() if n != ROOT_NAME)
        else:
            own[name] -= sum(v for n, v in total.items() if n.startswith(name + "."))
    return np.array([own[layer.name] for layer in layers])
