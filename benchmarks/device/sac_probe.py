"""Diagnostic (GPU), issue 17: what does recomputing only the cheap operations of a block cost and save?

    python3 benchmarks/device/sac_probe.py --batches 184 232

ResNet-152 at 224x224 (benchmarks/offload.py's net, fp32 with TF32 convolutions, SGD-momentum), every
bottleneck block under one mode: `none` (everything saved), `full` (torch.utils.checkpoint: only the
block input kept, the whole block rerun in backward), `save3x3` (selective checkpoint: the outputs of
the 3x3 convolutions kept, the 1x1 convolutions, BatchNorms and ReLUs rerun), `saveconv` (every
convolution's output kept, only BatchNorm/ReLU rerun). Prints samples/s (median of --steps steps after
two untimed) and the peak allocated bytes of each, and the ratio to `none` at the same batch.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from offload import Bottleneck, resnet152  # noqa: E402

CONV = torch.ops.aten.convolution.default


def policy(kind: str):
    def fn(ctx, op, *args, **kwargs):
        if op is CONV and (kind == "saveconv" or args[1].shape[-1] > 1):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return fn


def wrap(block: Bottleneck, mode: str) -> None:
    orig = block.forward
    if mode == "full":
        block.forward = lambda x: checkpoint(orig, x, use_reentrant=False)
    elif mode in ("save3x3", "saveconv"):
        ctx = functools.partial(create_selective_checkpoint_contexts, policy(mode))
        block.forward = lambda x: checkpoint(orig, x, use_reentrant=False, context_fn=ctx)


def run(mode: str, b: int, steps: int) -> tuple[float, int] | None:
    torch.manual_seed(0)
    model = resnet152().cuda()
    for m in model:
        if isinstance(m, Bottleneck):
            wrap(m, mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(b, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (b,), device="cuda")
    times = []
    try:
        torch.cuda.reset_peak_memory_stats()
        for i in range(steps + 2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        return b / statistics.median(times), torch.cuda.max_memory_allocated()
    except torch.OutOfMemoryError:
        return None
    finally:
        del model, opt, x, y
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[184, 232])
    ap.add_argument("--modes", nargs="+", default=["none", "full", "save3x3", "saveconv"])
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    rows = []
    for b in a.batches:
        base = None
        for mode in a.modes:
            r = run(mode, b, a.steps)
            if r is None:
                rows.append((b, mode, "OOM", "", ""))
            else:
                base = base or r[0]
                rows.append((b, mode, f"{r[0]:.1f}", f"{r[1] / 2**30:.2f}", f"{r[0] / base:.3f}"))
            print(*rows[-1], flush=True)
    print(f"\n{'batch':>6} {'mode':<9} {'samples/s':>10} {'peak GiB':>9} {'/ none':>7}")
    for r in rows:
        print(f"{r[0]:>6} {r[1]:<9} {r[2]:>10} {r[3]:>9} {r[4]:>7}")


if __name__ == "__main__":
    main()
