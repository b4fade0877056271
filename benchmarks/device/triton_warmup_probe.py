"""Where Triton's first use goes in a fresh torch process, and what can overlap it (issue 14: torch triaccel's
graphed ResNet-18 run pays ~2 s of Triton start-up that AMP does not; on a thread during the demo's set-up
it did not overlap, 2026-11-28 benchmarks/results/s38/callA). Each mode runs in a fresh process on an empty
Triton cache (its own TRITON_CACHE_DIR):

- parts: one after another: CUDA start, the model and the wrapper, then Triton's cache key, its driver,
  the statistics kernel's first launch (`prepare_kernels`: compile, launcher, load) and a second one.
- thread: Triton's start-up and the first launch on a thread started before CUDA starts, beside the same
  set-up and then `--busy` seconds of pure-Python work on the main thread (the demo's set-up is mostly
  Python); the main thread's times against `parts`' show what the thread takes from it.
- subprocess: a child process does the first launch (filling the on-disk cache) while the parent does the
  same set-up and busy work; then the parent's own first launch, from the disk cache.

    python3 benchmarks/device/triton_warmup_probe.py [--model resnet18] [--busy 1.5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def busy_fixed(iters: int) -> float:
    """A fixed amount of pure-Python work; returns its seconds."""
    t = time.perf_counter()
    for _ in range(iters):
        sum(i * i for i in range(200))
    return time.perf_counter() - t


def setup(model_name: str) -> tuple[object, dict[str, float]]:
    import torch

    from triaccel import TriAccelConfig
    from triaccel.backends.torch import wrap
    from triaccel.backends.torch.models import create_model

    t = {}
    t0 = time.perf_counter()
    torch.zeros(1, device="cuda")
    t["cuda_start"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = create_model(model_name, num_classes=10).cuda()
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, TriAccelConfig())
    t["model_and_wrap"] = time.perf_counter() - t0
    return opt, t


def first_launch(opt: object) -> dict[str, float]:
    import torch
    import triton
    from triton.runtime.cache import triton_key

    t = {}
    t0 = time.perf_counter()
    triton_key()
    t["triton_key"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    triton.runtime.driver.active
    t["driver"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    opt.prepare_kernels()
    torch.cuda.synchronize()
    t["first_launch"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    opt.prepare_kernels()
    torch.cuda.synchronize()
    t["second_launch"] = time.perf_counter() - t0
    return t


def one(mode: str, model_name: str, busy_iters: int) -> dict[str, object]:
    t_start = time.perf_counter()
    out: dict[str, object] = {"mode": mode}
    if mode == "parts":
        import torch  # noqa: F401  (imported before the clock, as in the other modes)
        opt, t = setup(model_name)
        out.update(t)
        out["busy"] = busy_fixed(busy_iters)
        out.update(first_launch(opt))
    elif mode == "thread":
        import torch  # noqa: F401
        from triaccel.kernels._dispatch import prepare_triton_runtime
        done: dict[str, float] = {}
        holder: list[object] = []
        ready = threading.Event()

        def work() -> None:
            t0 = time.perf_counter()
            prepare_triton_runtime()
            done["runtime"] = time.perf_counter() - t0
            ready.wait()
            t1 = time.perf_counter()
            holder[0].prepare_kernels()
            done["kernel"] = time.perf_counter() - t1
            done["thread_end"] = time.perf_counter() - t_start

        th = threading.Thread(target=work, daemon=True)
        th.start()
        opt, t = setup(model_name)
        holder.append(opt)
        ready.set()
        out.update(t)
        out["busy"] = busy_fixed(busy_iters)
        t0 = time.perf_counter()
        th.join()
        out["join_wait"] = time.perf_counter() - t0
        out.update({f"thread_{k}": v for k, v in done.items()})
        t0 = time.perf_counter()
        opt.prepare_kernels()
        import torch
        torch.cuda.synchronize()
        out["launch_after"] = time.perf_counter() - t0
    elif mode == "subprocess":
        child = subprocess.Popen([sys.executable, __file__, "--_child", "--model", model_name],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        import torch  # noqa: F401
        opt, t = setup(model_name)
        out.update(t)
        out["busy"] = busy_fixed(busy_iters)
        t0 = time.perf_counter()
        child_out, _ = child.communicate()
        out["child_wait"] = time.perf_counter() - t0
        out["child_rc"] = child.returncode
        out["child_tail"] = child_out.strip().splitlines()[-1:] if child_out else []
        out.update({f"own_{k}": v for k, v in first_launch(opt).items()})
    out["total"] = time.perf_counter() - t_start
    return out


def child(model_name: str) -> None:
    opt, _ = setup(model_name)
    opt.prepare_kernels()
    import torch
    torch.cuda.synchronize()
    print("child done")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18", choices=["resnet18", "efficientnet_b0"])
    p.add_argument("--busy", type=float, default=1.5, help="seconds of pure-Python work on the main thread (alone)")
    p.add_argument("--modes", nargs="+", default=["parts", "thread", "subprocess"],
                   choices=["parts", "thread", "subprocess"])
    p.add_argument("--_one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_iters", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.busy < 0:
        p.error(f"--busy={a.busy}: allowed >= 0")
    if a._child:
        child(a.model)
        return
    if a._one:
        print(json.dumps(one(a._one, a.model, a._iters)))
        return
    # the busy work as a fixed iteration count, calibrated here, so that every mode does the same work
    t0, iters = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.2:
        sum(i * i for i in range(200))
        iters += 1
    iters = int(iters * a.busy / (time.perf_counter() - t0))
    rows = []
    for mode in a.modes:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TRITON_CACHE_DIR": cache}
            r = subprocess.run([sys.executable, __file__, "--_one", mode, "--_iters", str(iters), "--model", a.model],
                               env=env, capture_output=True, text=True)
            line = next((x for x in reversed(r.stdout.splitlines()) if x.startswith("{")), None)
            if line is None:
                print(f"{mode}: rc {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
                continue
            rows.append(json.loads(line))
    for r in rows:
        print(r["mode"], " ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
                                   if k != "mode"))


if __name__ == "__main__":
    main()
