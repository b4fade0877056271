"""First training steps of EfficientNet-B0 through `compile_model(..., backend="cudagraphs")`: what the
cudagraphs backend's tracing (dynamo and AOT autograd) costs before the first step, and whether a new
batch size traces again. On a CPU the graphs themselves are skipped (torch's warning); the tracing is
the same.

    python3 benchmarks/device/cudagraphs_first_step.py --shapes dynamic    # or static: one trace per size
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from triaccel.backends.torch.compile import compile_model
from triaccel.backends.torch.models import create_model


def step_seconds(model: torch.nn.Module, bs: int, dev: str) -> float:
    """Wall seconds of one bf16-autocast forward and backward at batch `bs` (synchronised on CUDA)."""
    x = torch.randn(bs, 3, 32, 32, device=dev)
    y = torch.randint(0, 10, (bs,), device=dev)
    t = time.perf_counter()
    with torch.autocast(dev, dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    if dev == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", choices=["dynamic", "static"], default="dynamic")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = create_model("efficientnet_b0", num_classes=10, width=1.0, seed=0).to(dev)
    compiled = compile_model(model, backend="cudagraphs", dynamic_batch=a.shapes == "dynamic")
    for bs in (8, 16, 8):
        print(f"compiled bs {bs}: {step_seconds(compiled, bs, dev):.2f} s", flush=True)
    print(f"eager bs 8: {step_seconds(model, 8, dev):.2f} s")
    print("dynamo:", dict(torch._dynamo.utils.counters["stats"]))


if __name__ == "__main__":
    main()
