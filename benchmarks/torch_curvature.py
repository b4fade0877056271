"""Cost and accuracy of the torch per-layer Hessian top-k under its options (ResNet-18, b_curv=32, k=5).

For each configuration (warm iterations per event, layers packed per batched second backward,
layers refreshed per event) the script runs one cold event, then times `--events` warm events
(median), and compares every event's estimate with a reference: the same estimator run exact
(all layers, pack 1) with `--ref-iters` cold iterations followed by 3 warm events on the same batch.
Accuracy = median and max over layers of |lambda_1 - lambda_1_ref| / |lambda_1_ref| on the last
timed event (stale rows count: they are what the controller sees).

    python benchmarks/torch_curvature.py                      # GPU
    python benchmarks/torch_curvature.py --device cpu --width 0.125 --events 1 --configs 1,1,all

Writes benchmarks/results/torch_curvature-<device>.json and prints a table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from triaccel.backends.torch.curvature import CurvatureEstimator
from triaccel.backends.torch.layers import discover_layers
from triaccel.backends.torch.models import create_model
from _results import device_tag, write_json


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _parse(cfg: str) -> tuple[int, int, int | None]:
    it, pack, per = cfg.split(",")
    return int(it), int(pack), None if per == "all" else int(per)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--width", type=float, default=1.0)
    ap.add_argument("--b-curv", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=5)
    ap.add_argument("--events", type=int, default=3, help="timed warm events per configuration")
    ap.add_argument("--ref-iters", type=int, default=12)
    ap.add_argument("--cold-iters", type=int, default=8)
    ap.add_argument("--step-ms", type=float, default=8.42, help="train step (ms) for the amortised fraction")
    ap.add_argument("--t-curv", type=int, default=200)
    ap.add_argument("--configs", nargs="+", default=["2,1,all", "1,1,all", "1,4,all", "1,41,all", "1,1,8"],
                    help="'iters,pack,layers_per_event' (layers_per_event 'all' = every layer each event)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = create_model("resnet18", num_classes=10, width=args.width).to(dev)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(args.b_curv, 3, 32, 32, generator=g).to(dev)
    y = torch.randint(0, 10, (args.b_curv,), generator=g).to(dev)
    if dev.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    # a few SGD steps so that the Hessian is not the one at initialisation
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(20):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    layers = discover_layers(model)
    k = args.top_k

    ref_est = CurvatureEstimator(model, layers, F.cross_entropy, "hessian", k, hessian_iters=2,
                                 hessian_iters_cold=args.ref_iters)
    _sync(dev)
    t0 = time.perf_counter()
    ref = ref_est((x, y))
    _sync(dev)
    ref_cold_s = time.perf_counter() - t0
    for _ in range(3):
        ref = ref_est((x, y))
    ref1 = ref[:, 0]
    res: dict[str, Any] = {"layers": len(layers), "ref_cold_s": ref_cold_s, "ref_lambda1": ref1.tolist(),
                           "configs": {}}
    for cfg in args.configs:
        iters, pack, per = _parse(cfg)
        est = CurvatureEstimator(model, layers, F.cross_entropy, "hessian", k, hessian_iters=iters,
                                 hessian_iters_cold=args.cold_iters, hessian_pack=pack,
                                 hessian_layers_per_event=per)
        _sync(dev)
        t0 = time.perf_counter()
        try:
            first = est((x, y))
        except torch.OutOfMemoryError:
            del est
            torch.cuda.empty_cache()
            res["configs"][cfg] = {"oom": True}
            print(f"# {cfg}: out of memory", flush=True)
            continue
        _sync(dev)
        cold = time.perf_counter() - t0
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        times, errs = [], []
        for _ in range(args.events):
            _sync(dev)
            t0 = time.perf_counter()
            eig = est((x, y))
            _sync(dev)
            times.append(time.perf_counter() - t0)
            errs.append(np.abs(eig[:, 0] - ref1) / np.maximum(np.abs(ref1), 1e-12))
        cold_err = np.abs(first[:, 0] - ref1) / np.maximum(np.abs(ref1), 1e-12)
        warm = statistics.median(times)
        step = args.step_ms * 1e-3
        res["configs"][cfg] = {
            "iters": iters, "pack": pack, "layers_per_event": per, "cold_s": cold, "event_s": warm,
            "event_times_s": times, "amortised_fraction": warm / (args.t_curv * step + warm),
            "staleness_steps": args.t_curv * (1 if per is None else -(-len(layers) // per)),
            "cold_rel_err_median": float(np.median(cold_err)), "cold_rel_err_max": float(cold_err.max()),
            "rel_err_median": float(np.median(errs[-1])), "rel_err_max": float(errs[-1].max()),
            "lambda1": eig[:, 0].tolist(),
            "peak_mem_gb": (torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None),
        }
        del est
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    res["meta"] = {"device": name, "torch": torch.__version__, "python": platform.python_version(),
                   "date": _dt.datetime.now().isoformat(timespec="seconds"), "args":
                   {kk: (str(v) if isinstance(v, Path) else v) for kk, v in vars(args).items()}}
    path = write_json(res, args.out / f"torch_curvature-{device_tag(name)}.json")
    print(f"# torch_curvature device={name} torch={torch.__version__} date={res['meta']['date']} "
          f"layers={len(layers)} b={args.b_curv} k={k} ref: exact, {args.ref_iters} cold iters + 3 warm "
          f"({ref_cold_s:.2f} s cold)")
    print(f"{'iters,pack,per':>15} {'cold s':>7} {'event ms':>9} {'amort %':>8} {'stale steps':>11} "
          f"{'err med':>8} {'err max':>8} {'cold err max':>12} {'peak GB':>8}")
    for cfg, e in res["configs"].items():
        if e.get("oom"):
            print(f"{cfg:>15} out of memory")
            continue
        pk = "-" if e["peak_mem_gb"] is None else f"{e['peak_mem_gb']:.2f}"
        print(f"{cfg:>15} {e['cold_s']:7.2f} {e['event_s'] * 1e3:9.1f} {e['amortised_fraction'] * 100:7.2f}% "
              f"{e['staleness_steps']:>11} {e['rel_err_median'] * 100:7.2f}% {e['rel_err_max'] * 100:7.2f}% "
              f"{e['cold_rel_err_max'] * 100:11.2f}% {pk:>8}")
    print(f"# amortised = event / (t_curv={args.t_curv} x {args.step_ms} ms + event); JSON: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
