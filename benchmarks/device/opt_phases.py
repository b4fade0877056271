"""Host time per phase of the wrapper's step()+zero_grad() beside a plain AMP-bf16 loop (both over fused
SGD), ResNet-18 at batch 96 on CUDA, without a profiler: each phase is wrapped in a perf_counter_ns
timer (about 0.3 us per timer), and the median over steps is printed.

    python3 benchmarks/device/opt_phases.py [--steps 700 --skip 200] [--model efficientnet_b0 --batch 384]

Phases: forward (its autocast region included) and backward (host time: the call returns when
autograd has launched the last kernel), then (triaccel) step() in all, of which the gradient list, the statistics launch, the inner
optimizer's step (torch's own wrapper included), the boundary (flush + decide); zero_grad().
``tri-nowrap`` calls the wrapper's step without torch's ``Optimizer.step`` profiling wrapper (what
that wrapper costs). Counters: statistics launches through the full path (new addresses) and
address-set uploads, per step.
``benchmarks/torch_overhead.py`` measures the two calls together (its ``opt us`` column).
"""

from __future__ import annotations

import argparse
import importlib
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from opt_loops import batch, loop
from triaccel.backends.torch.models import create_model


class Timer:
    """Accumulates the ns of each named phase within the current step."""

    def __init__(self) -> None:
        self.now: dict[str, int] = {}
        self.steps: list[dict[str, int]] = []

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                self.now[name] = self.now.get(name, 0) + time.perf_counter_ns() - t
        return timed

    def end_step(self, keep: bool) -> None:
        if keep:
            self.steps.append(self.now)
        self.now = {}

    def table(self) -> dict[str, float]:
        names = sorted({k for s in self.steps for k in s})
        med = {k: float(np.median([s.get(k, 0) for s in self.steps])) / 1e3 for k in names}
        return {**med, **{f"{k} mean": float(np.mean([s.get(k, 0) for s in self.steps])) / 1e3 for k in names}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--skip", type=int, default=200)
    ap.add_argument("--model", default="resnet18", help="a create_model name (contiguous memory format)")
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--ops", type=int, default=0, metavar="N",
                    help="last (after every timing): torch.profiler over N steps of amp and tri, the ops whose "
                         "count or self CPU time differ most")
    args = ap.parse_args()
    dev = torch.device("cuda")
    x, y = batch(dev, args.batch)
    out: dict[str, dict[str, float]] = {}
    GM = importlib.import_module("triaccel.kernels.grad_moments")
    for variant in ("amp", "tri", "tri-nowrap"):
        model, sgd, opt, region, backward = loop(variant, dev, x, y, args.model)
        tm = Timer()
        if variant != "amp":
            opt._grad_list = tm.wrap("  grad list", opt._grad_list)
            opt._moments = tm.wrap("  statistics launch", opt._moments)
            opt._inner_step = tm.wrap("  inner step", opt._inner_step)
            opt._boundary = tm.wrap("  boundary", opt._boundary)
            launch = GM._launch
            GM._launch = tm.wrap("    (kernel launch call)", launch)
        sgd.step = tm.wrap("  (torch SGD.step)", sgd.step)
        raw = opt.step if variant != "tri-nowrap" else type(opt).step.__wrapped__.__get__(opt)
        step, zero = tm.wrap("step()", raw), tm.wrap("zero_grad()", opt.zero_grad)
        counts = {"full path": 0, "upload": 0}
        saved = GM._torch_list, GM._set_base

        def counted(name, fn):
            def f(*a, **k):
                counts[name] += int(i >= args.skip)
                return fn(*a, **k)
            return f

        GM._torch_list, GM._set_base = counted("full path", saved[0]), counted("upload", saved[1])

        def forward() -> torch.Tensor:
            with region():
                return F.cross_entropy(model(x), y)

        forward, backward_t = tm.wrap("forward", forward), tm.wrap("backward", backward)
        for i in range(args.steps):
            backward_t(forward())
            step()
            zero(set_to_none=True)
            tm.end_step(i >= args.skip)
        torch.cuda.synchronize()
        if variant != "amp":
            GM._launch = launch
        t0 = time.perf_counter()
        for _ in range(50):
            with region():
                loss = F.cross_entropy(model(x), y)
            backward(loss)
            step()
            zero(set_to_none=True)
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) / 50 * 1e6
        GM._torch_list, GM._set_base = saved
        out[variant] = tm.table()
        out[variant].update({f"[{k} per step]": v / (args.steps - args.skip) for k, v in counts.items()})
        out[variant]["[wall us per step]"] = wall_us
    # one FixedMoments call on ResNet-18's gradients (no optimizer), its parts timed, in two contexts
    torch.manual_seed(0)
    model = create_model(args.model).to(dev)
    params = list(model.parameters())
    fm, buf = GM.FixedMoments(), torch.empty(len(params), 3, device=dev)
    D = importlib.import_module("triaccel.kernels._dispatch")
    parts = Timer()
    saved = GM._torch_list, GM._set_base, GM._launch, GM._list_plan, D.upload
    GM._torch_list, GM._set_base, GM._launch, GM._list_plan, D.upload = (
        parts.wrap("  full path", saved[0]), parts.wrap("    new address set", saved[1]),
        parts.wrap("    launch", saved[2]), parts.wrap("    new plan", saved[3]), parts.wrap("      upload", saved[4]))
    call = parts.wrap("FixedMoments()", fm)
    for i in range(300):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        call([p.grad for p in params], out=buf)
        parts.end_step(i >= 50)
        model.zero_grad(set_to_none=True)
    grads = [torch.randn_like(p) for p in params]
    for i in range(300):
        call(grads, out=buf)
        parts.end_step(False)
    calls = parts.steps
    print(f"# FixedMoments after backward, {len(calls)} calls: mean / median us per call")
    for k in sorted({k for c in calls for k in c}):
        v = [c.get(k, 0) / 1e3 for c in calls]
        print(f"#   {k:<24} {np.mean(v):8.1f} {np.median(v):8.1f}  (in {sum(k in c for c in calls)} calls)")
    GM._torch_list, GM._set_base, GM._launch, GM._list_plan, D.upload = saved
    # the same call after backward: first and second call, and after a device sync
    ctx = Timer()
    first, second, synced = ctx.wrap("first call", fm), ctx.wrap("second call", fm), ctx.wrap("after sync", fm)
    for i in range(300):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        gl = [p.grad for p in params]
        if i % 2:
            torch.cuda.synchronize()
            synced(gl, out=buf)
        else:
            first(gl, out=buf)
            second(gl, out=buf)
        ctx.end_step(i >= 50)
        model.zero_grad(set_to_none=True)
    for k in ("first call", "second call", "after sync"):
        v = [c[k] / 1e3 for c in ctx.steps if k in c]
        print(f"# FixedMoments after backward, {k}: median {np.median(v):.1f} us ({len(v)} calls)")
    bb = Timer()
    call = bb.wrap("b", fm)
    for i in range(300):
        call(grads, out=buf)
        bb.end_step(i >= 50)
    torch.cuda.synchronize()
    print(f"# FixedMoments back to back: median {bb.table()['b']:.1f} us")
    names = sorted({k for t in out.values() for k in t}, key=lambda k: (k.strip() != k, k))
    print(f"# {args.model} bs {args.batch}: host us per step (median; 'mean' rows: mean) over {args.steps - args.skip} "
          f"steps, {torch.cuda.get_device_name(0)}")
    print(f"{'phase':<26}" + "".join(f"{v:>12}" for v in out))
    for k in names:
        print(f"{k:<26}" + "".join(f"{t.get(k, float('nan')):>12.2f}" for t in out.values()))
    if args.ops:
        op_diff(args, dev, x, y)


def op_diff(args: argparse.Namespace, dev: torch.device, x: torch.Tensor, y: torch.Tensor) -> None:
    """Per op (torch.profiler, CPU side): calls and self CPU us per step, amp against tri."""
    from torch.profiler import ProfilerActivity, profile

    per: dict[str, dict[str, tuple[float, float]]] = {}
    for variant in ("amp", "tri"):
        model, _, opt, region, backward = loop(variant, dev, x, y, args.model)
        for i in range(args.skip + args.ops):
            if i == args.skip:
                torch.cuda.synchronize()
                prof = profile(activities=[ProfilerActivity.CPU])
                prof.__enter__()
            with region():
                loss = F.cross_entropy(model(x), y)
            backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        per[variant] = {e.key: (e.count / args.ops, e.self_cpu_time_total / args.ops) for e in prof.key_averages()}
    names = set(per["amp"]) | set(per["tri"])
    rows = sorted(names, key=lambda k: -abs(per["tri"].get(k, (0, 0))[1] - per["amp"].get(k, (0, 0))[1]))
    print(f"# ops per step ({args.ops} profiled steps after {args.skip}): calls amp/tri, self CPU us amp/tri, tri - amp")
    for k in rows[:30]:
        (ca, ta), (ct, tt) = per["amp"].get(k, (0, 0)), per["tri"].get(k, (0, 0))
        print(f"{k[:44]:<44} {ca:7.1f} {ct:7.1f} {ta:9.1f} {tt:9.1f} {tt - ta:+9.1f}")


if __name__ == "__main__":
    main()
