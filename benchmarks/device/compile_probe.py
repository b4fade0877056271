"""Diagnostic (GPU): how long does `compile_model` take to give a model's first training steps?

    python3 benchmarks/device/compile_probe.py --model efficientnet_b0 --batch 192 --mode reduce-overhead [--static]

Prints the wall seconds of each of the first --steps training steps (bf16 autocast forward,
cross-entropy, backward, SGD step) of the compiled model on random CIFAR-shaped data, flushed as they
finish, so a call cut short still shows where the time went. Written for issue 14: the demo's
EfficientNet-B0 under `--compile reduce-overhead` finished no epoch in 570 s on an H100.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from triaccel.backends.torch.compile import compile_model
from triaccel.backends.torch.models import create_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="efficientnet_b0")
    ap.add_argument("--batch", type=int, default=192)
    ap.add_argument("--mode", default="reduce-overhead")
    ap.add_argument("--static", action="store_true", help="dynamic_batch=False (one graph per shape)")
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = create_model(a.model, num_classes=10).cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    cm = compile_model(model, mode=a.mode, dynamic_batch=not a.static)
    x = torch.randn(a.batch, 3, 32, 32, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (a.batch,), device="cuda")
    t_all = time.perf_counter()
    for i in range(a.steps):
        t = time.perf_counter()
        with torch.autocast("cuda", torch.bfloat16):
            loss = F.cross_entropy(cm(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        print(f"{a.model} bs {a.batch} {a.mode} {'static' if a.static else 'dynamic'} step {i}: "
              f"{time.perf_counter() - t:.2f} s (total {time.perf_counter() - t_all:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
