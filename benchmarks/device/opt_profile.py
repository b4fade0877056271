"""Profile (cProfile, by self time) only opt.step() + opt.zero_grad() of a plain AMP-bf16 loop and of the
triaccel wrapper (both over fused SGD), ResNet-18 at batch 96 on CUDA: where the wrapper's host time goes.

    python3 benchmarks/device/opt_profile.py   # on a GPU machine, after benchmarks/device/prep.sh

Prints, per loop, the host microseconds per step inside the two calls (profiler on, so inflated) and
the 45 functions with the most self time. ``benchmarks/torch_overhead.py`` measures the same calls
without the profiler (its ``opt us`` column).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch
import torch.nn.functional as F

from opt_loops import batch, loop


def main(steps: int = 700, skip: int = 200) -> None:
    dev = torch.device("cuda")
    x, y = batch(dev)
    for variant in ("amp", "tri"):
        model, _, opt, region, backward = loop(variant, dev, x, y)
        prof, spent = cProfile.Profile(), 0.0
        for i in range(steps):
            with region():
                loss = F.cross_entropy(model(x), y)
            backward(loss)
            t = time.perf_counter()
            if i >= skip:
                prof.enable()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= skip:
                prof.disable()
                spent += time.perf_counter() - t
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(45)
        print(f"== {variant}: {spent / (steps - skip) * 1e6:.0f} us per step in step()+zero_grad() (profiled)")
        print(buf.getvalue())


if __name__ == "__main__":
    main()
