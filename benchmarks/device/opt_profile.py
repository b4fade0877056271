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
import warnings

import torch
import torch.nn.functional as F

from triaccel import TriAccelConfig
from triaccel.backends.torch import wrap
from triaccel.backends.torch.models import create_model


def main(steps: int = 700, skip: int = 200) -> None:
    dev = torch.device("cuda")
    x = torch.randn(96, 3, 32, 32, device=dev)
    y = torch.randint(0, 10, (96,), device=dev)
    cfg = TriAccelConfig(curvature="fisher", t_curv=10**9, t_ctrl=50, warmup_steps=50, min_dwell=50,
                         batch_init=96, batch_min=8, batch_max=1024, lr_rule="linear")
    for variant in ("amp", "tri"):
        torch.manual_seed(0)
        model = create_model("resnet18").to(dev)
        sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4,
                              fused=True)
        if variant == "amp":
            opt, backward = sgd, (lambda loss: loss.backward())

            def region():
                return torch.autocast("cuda", dtype=torch.bfloat16)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt = wrap(sgd, model, cfg, curvature_data=(x[:32], y[:32]))
            region, backward = opt.autocast, opt.backward
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
