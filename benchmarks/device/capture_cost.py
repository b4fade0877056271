"""What one CUDA-graph capture of the demo's training step costs, per batch size (issue 14: triaccel's graphed
EfficientNet-B0 run makes five captures AMP does not, 0.37-0.49 s each in its step records, ~2.2 s of its 3.5 s
behind AMP bs 512 over epochs 1-2; benchmarks/results/s39/callB). `ShapeGraphs` captures with
`torch.cuda.make_graphed_callables`: `warmup` eager passes, then one capture of the forward and one of the
backward, each entered through `torch.cuda.graph`, which first empties the allocator's caches (device and
pinned host). This times, in a fresh process per variant: the first step at each size (the capture), the
second, and the median of the next ones; and the process's peak reserved memory, for `--warmups` passes
(or `eager`: each size's first step eager, the second captures with no discarded pass,
`ShapeGraphs(eager_first=1, warmup=0)`, its default since 2026-11-28: the cheapest here on both models,
benchmarks/results/s41/callA_probe, where keeping the caches instead of emptying them saved nothing).
A size's cost over its steady steps: first + second - 2 x steady.

    python3 benchmarks/device/capture_cost.py --model efficientnet_b0 [--sizes 96 48 192 384 512 256]
        [--warmups 3 1 eager] [--steps 20] [--out DIR]

Prints one table and writes DIR/capture_cost-<model>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _phase_timers(torch: Any) -> dict[str, float]:
    """Seconds spent, summed, in the calls a capture makes through `torch.cuda.graph`: the caches
    emptied and the device synchronised on entry, the capture's start, and its end (where the graph
    is instantiated). The totals grow in place; read and reset them per size."""
    spent = {"empty_cache_s": 0.0, "synchronize_s": 0.0, "capture_begin_s": 0.0, "capture_end_s": 0.0}

    def timed(owner: Any, name: str, key: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t
        setattr(owner, name, wrapper)

    timed(torch.cuda, "empty_cache", "empty_cache_s")   # torch.cuda.graph calls both through torch.cuda
    timed(torch.cuda, "synchronize", "synchronize_s")
    timed(torch.cuda.CUDAGraph, "capture_begin", "capture_begin_s")
    timed(torch.cuda.CUDAGraph, "capture_end", "capture_end_s")
    return spent


def _prewarm_on_thread(torch: Any, model: Any, sizes: list[int], nhwc: bool) -> float:
    """Seconds for one eager forward and backward of a copy of `model` at every size, bf16 autocast, run on a
    second thread (joined): whether a size's first-step cost is the process's (kernels loaded, cuDNN's own
    caches) or the calling thread's (torch keeps cuDNN's execution plans per thread)."""
    import copy
    import threading

    twin = copy.deepcopy(model)

    def run() -> None:
        for b in sizes:
            x = torch.randn(b, 3, 32, 32, device="cuda")
            if nhwc:
                x = x.contiguous(memory_format=torch.channels_last)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                twin(x).float().sum().backward()
        torch.cuda.synchronize()

    t = time.perf_counter()
    th = threading.Thread(target=run)
    th.start()
    th.join()
    return time.perf_counter() - t


def one(model_name: str, sizes: list[int], warmup: str, steps: int, phases: bool = False,
        prewarm: bool = False) -> dict[str, Any]:
    """Every size captured in turn by one `ShapeGraphs` (bf16 autocast, SGD step), in this process.
    phases: also time the capture's calls (`_phase_timers`) per size, beside the step's own synchronisations.
    prewarm: first run every size once on another thread (`_prewarm_on_thread`)."""
    import torch
    import torch.nn.functional as F

    from triaccel.backends.torch.cuda_graph import ShapeGraphs
    from triaccel.backends.torch.models import create_model, uses_channels_last

    torch.manual_seed(0)
    nhwc = uses_channels_last(model_name, "auto", "cuda")   # the demo's --memory-format auto
    model = create_model(model_name, num_classes=10).cuda()
    if nhwc:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    eager = warmup == "eager"
    fwd = ShapeGraphs(model, set(sizes), max_graphs=len(sizes), warmup=0 if eager else int(warmup),
                      eager_first=int(eager))
    prewarm_s = _prewarm_on_thread(torch, model, sizes, nhwc) if prewarm else None
    sync = torch.cuda.synchronize    # the step's own waits, taken before the timers wrap it
    spent = _phase_timers(torch) if phases else {}
    rows = []
    for b in sizes:
        x = torch.randn(b, 3, 32, 32, device="cuda")
        if nhwc:
            x = x.contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 10, (b,), device="cuda")

        def step() -> float:
            sync()
            t = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(fwd(x), y)
            loss.backward()
            opt.step()
            sync()
            return time.perf_counter() - t

        first = step()
        before = dict(spent)
        second = step()
        steady = statistics.median(step() for _ in range(steps))
        row = {"batch": b, "first_s": round(first, 4), "second_s": round(second, 4),
               "steady_ms": round(steady * 1e3, 2), "capture_s": round(first + second - 2 * steady, 4)}
        row.update({k: round(v - before[k], 4) for k, v in spent.items()})   # the second step's capture
        rows.append(row)
    return {"warmup": warmup, "rows": rows, "prewarm_thread_s": prewarm_s,
            "max_reserved_GiB": round(torch.cuda.max_memory_reserved() / 2**30, 3), "torch": torch.__version__}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="efficientnet_b0", choices=["resnet18", "efficientnet_b0"])
    p.add_argument("--sizes", type=int, nargs="+", default=[96, 48, 192, 384, 512, 256])
    p.add_argument("--warmups", nargs="+", default=["3", "1", "eager"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--phases", action="store_true",
                   help="also time the capture's calls: caches emptied, synchronisations, capture start and end "
                        "(where the graph is instantiated), per size")
    p.add_argument("--prewarm-thread", action="store_true",
                   help="first run every size once on a second thread (is a size's first-step cost per process "
                        "or per thread?)")
    p.add_argument("--one", help=argparse.SUPPRESS)   # WARMUP: one variant in this process
    a = p.parse_args(argv)
    if any(b < 1 for b in a.sizes) or a.steps < 1 or not all(w == "eager" or (w.isdigit() and int(w) >= 1)
                                                               for w in a.warmups):
        p.error("--sizes and --steps take integers >= 1, --warmups integers >= 1 or 'eager'")
    if a.one:
        print(json.dumps(one(a.model, a.sizes, a.one, a.steps, a.phases, a.prewarm_thread)))
        return {}
    runs = []
    for w in a.warmups:
        cmd = [sys.executable, __file__, "--model", a.model, "--steps", str(a.steps), "--one", w,
               "--sizes", *map(str, a.sizes), *(["--phases"] if a.phases else []),
               *(["--prewarm-thread"] if a.prewarm_thread else [])]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if out.returncode != 0:
            raise SystemExit(f"variant warmup={w} failed:\n{out.stderr[-3000:]}")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"# {a.model}: each size's capture cost (first + second step - 2 x steady, s) / its steady step, "
          "fresh process per variant")
    print(f"{'warmup':>6} " + " ".join(f"{b:>17}" for b in a.sizes) + "  sum capture s  reserved GiB")
    for r in runs:
        cells = " ".join(f"{x['capture_s']:7.3f}/{x['steady_ms']:6.1f}ms" for x in r["rows"])
        print(f"{r['warmup']:>6} {cells}  {sum(x['capture_s'] for x in r['rows']):13.3f}"
              f"  {r['max_reserved_GiB']:12.3f}"
              + ("" if r["prewarm_thread_s"] is None else f"  (sizes run first on a thread: {r['prewarm_thread_s']:.3f} s)"))
    if a.phases:
        keys = ("empty_cache_s", "synchronize_s", "capture_begin_s", "capture_end_s")
        print("# the capturing step's calls (s): " + ", ".join(keys))
        for r in runs:
            for x in r["rows"]:
                print(f"{r['warmup']:>6} {x['batch']:>5}  first {x['first_s']:.3f}  second {x['second_s']:.3f}  "
                      + "  ".join(f"{x[k]:.3f}" for k in keys))
    res = {"model": a.model, "sizes": a.sizes, "steps": a.steps, "runs": runs,
           "command": " ".join(["python3", "benchmarks/device/capture_cost.py", *(argv or sys.argv[1:])])}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    path = Path(a.out) / f"capture_cost-{a.model}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")
    return res


if __name__ == "__main__":
    main()
