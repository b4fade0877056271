"""Overhead of the torch backend vs plain AMP-bf16, and the amortised cost of curvature.

ResNet-18 (CIFAR variant) on synthetic CIFAR-size inputs (3x32x32, 10 classes) resident on the
device, SGD-nesterov. For each batch size, in the same process and interleaved (A, B, A, B, ...):

- AMP-bf16: `torch.autocast(bf16)`, backward, step, zero_grad;
- triaccel: `wrap(...)` with precision and batch levers on (adaptive precision decides after a short
  warm-up, the memory probe runs at every control step) and curvature EXCLUDED from the timed
  steps (t_curv larger than the run; curvature is timed separately below).

Reports median step times and their ratio (target <= 1.03). Curvature: one event (k=5, b_curv=32)
timed after a cold event, for "fisher" and "hessian" (warm-started, `hessian_iters` iterations);
amortised fraction = t_event / (t_curv * t_step + t_event) at t_curv=200 (targets: fisher <= 2%,
hessian <= 10%).

    python benchmarks/torch_overhead.py                         # GPU, full run
    python benchmarks/torch_overhead.py --device cpu --steps 3  # smoke check of the script

Writes benchmarks/results/torch_overhead-<device>.json and prints a table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import re
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from triaccel import TriAccelConfig
from triaccel.backends.torch import wrap
from triaccel.backends.torch.models import create_model


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn: Callable[[], None], steps: int, dev: torch.device) -> list[float]:
    out = []
    for _ in range(steps):
        _sync(dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        out.append(time.perf_counter() - t)
    return out


def _model(dev: torch.device, width: float) -> torch.nn.Module:
    torch.manual_seed(0)
    m = create_model("resnet18", num_classes=10, width=width).to(dev)
    if dev.type == "cuda":
        m = m.to(memory_format=torch.channels_last)
    return m


def run(args: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device(args.device)
    amp_dtype = torch.bfloat16
    results: dict[str, Any] = {"batch_sizes": {}}
    for bs in args.batch_sizes:
        g = torch.Generator(device="cpu").manual_seed(bs)
        x = torch.randn(bs, 3, 32, 32, generator=g).to(dev)
        if dev.type == "cuda":
            x = x.contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 10, (bs,), generator=g).to(dev)
        xc, yc = x[: args.b_curv], y[: args.b_curv]

        base_model = _model(dev, args.width)
        base_opt = torch.optim.SGD(base_model.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                                   weight_decay=5e-4)

        def base_step() -> None:
            with torch.autocast(dev.type, dtype=amp_dtype):
                loss = F.cross_entropy(base_model(x), y)
            loss.backward()
            base_opt.step()
            base_opt.zero_grad(set_to_none=True)

        tri_model = _model(dev, args.width)
        cfg = TriAccelConfig(curvature="fisher", t_curv=10**9, top_k=args.top_k, b_curv=args.b_curv,
                             t_ctrl=args.t_ctrl, warmup_steps=args.warmup, min_dwell=args.t_ctrl,
                             batch_init=bs, batch_min=8, batch_max=max(bs, 1024), lr_rule="linear")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # CPU smoke runs: the memory probe warns once
            tri_opt = wrap(torch.optim.SGD(tri_model.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                                           weight_decay=5e-4), tri_model, cfg, curvature_data=(xc, yc))

        def tri_step() -> None:
            with tri_opt.autocast():
                loss = F.cross_entropy(tri_model(x), y)
            tri_opt.backward(loss)
            tri_opt.step()
            tri_opt.zero_grad()

        # warm-up: cudnn autotune, allocator, the step-0 curvature event, the precision warm-up
        for fn in (base_step, tri_step):
            _timed(fn, args.warmup + 2, dev)
        base_t, tri_t = [], []
        for _ in range(args.rounds):
            base_t += _timed(base_step, args.steps, dev)
            tri_t += _timed(tri_step, args.steps, dev)
        tb, tt = statistics.median(base_t), statistics.median(tri_t)
        entry: dict[str, Any] = {
            "amp_bf16_step_s": tb, "triaccel_step_s": tt, "ratio": tt / tb,
            "steps_timed_each": len(base_t),
            "triaccel_precisions": [p.short for p in tri_opt.decision.precisions],
            "triaccel_hooked_layers": list(tri_opt.plan.hooked),
            "triaccel_autocast_dtype": tri_opt.plan.majority.short,
            "triaccel_skipped_steps": tri_opt.skipped_steps,
        }
        # curvature: one cold event, then `curv_events` warm events timed
        for mode in ("fisher", "hessian"):
            from triaccel.backends.torch.curvature import CurvatureEstimator

            est = CurvatureEstimator(tri_model, tri_opt.layers, F.cross_entropy, mode, args.top_k,
                                     hessian_iters=args.hessian_iters, hessian_iters_cold=args.hessian_iters_cold)
            _sync(dev)
            t0 = time.perf_counter()
            est((xc, yc))
            _sync(dev)
            cold = time.perf_counter() - t0
            warm = statistics.median(_timed(lambda: est((xc, yc)), args.curv_events, dev))
            entry[f"{mode}_event_cold_s"] = cold
            entry[f"{mode}_event_s"] = warm
            entry[f"{mode}_amortised_fraction"] = warm / (args.t_curv * tt + warm)
        results["batch_sizes"][str(bs)] = entry
        del base_model, base_opt, tri_model, tri_opt
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[96, 512])
    ap.add_argument("--steps", type=int, default=50, help="timed steps per round and method")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (A then B) per batch size")
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps; also the precision warm-up")
    ap.add_argument("--t-ctrl", type=int, default=50)
    ap.add_argument("--t-curv", type=int, default=200, help="for the amortised curvature fraction")
    ap.add_argument("--top-k", type=int, default=5)
    ap.add_argument("--b-curv", type=int, default=32)
    ap.add_argument("--hessian-iters", type=int, default=2)
    ap.add_argument("--hessian-iters-cold", type=int, default=8)
    ap.add_argument("--curv-events", type=int, default=3)
    ap.add_argument("--width", type=float, default=1.0, help="channel width multiplier (1.0 = ResNet-18)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    if args.device.startswith("cpu"):
        torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here; use --device cpu for a smoke run")
    if args.steps < 1 or args.rounds < 1 or args.curv_events < 1:
        ap.error("--steps, --rounds and --curv-events must be >= 1")
    res = run(args)
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})"
    res["meta"] = {
        "device": name, "torch": torch.__version__, "python": platform.python_version(),
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    tag = re.sub(r"[^A-Za-z0-9]+", "-", name.split(" (")[0] if dev.type == "cpu" else name).strip("-").lower()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"torch_overhead-{tag}.json"
    path.write_text(json.dumps(res, indent=2) + "\n")
    m = res["meta"]
    print(f"# torch_overhead  device={m['device']}  torch={m['torch']}  date={m['date']}")
    print(f"# command: {m['command']}")
    print(f"{'bs':>5} {'amp-bf16 ms':>12} {'triaccel ms':>12} {'ratio':>7} {'fisher ms':>10} {'fisher %':>9} "
          f"{'hessian ms':>11} {'hessian %':>10}")
    for bs, e in res["batch_sizes"].items():
        print(f"{bs:>5} {e['amp_bf16_step_s'] * 1e3:12.2f} {e['triaccel_step_s'] * 1e3:12.2f} {e['ratio']:7.3f} "
              f"{e['fisher_event_s'] * 1e3:10.1f} {e['fisher_amortised_fraction'] * 100:8.2f}% "
              f"{e['hessian_event_s'] * 1e3:11.1f} {e['hessian_amortised_fraction'] * 100:9.2f}%")
    print(f"# targets: ratio <= 1.03, fisher <= 2%, hessian <= 10% (t_curv={args.t_curv}, k={args.top_k}, "
          f"b_curv={args.b_curv}); JSON: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
