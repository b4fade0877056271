"""Overhead of the torch backend vs plain AMP-bf16, and the amortised cost of curvature.

ResNet-18 (CIFAR variant; or `--model efficientnet_b0`) on synthetic CIFAR-size inputs (3x32x32,
10 classes) resident on the device, SGD-nesterov. For each batch size, in the same process and
interleaved (A, B, A, B, ...):

- AMP-bf16: `torch.autocast(bf16)`, backward, step, zero_grad;
- triaccel: `wrap(...)` with precision and batch levers on (adaptive precision decides after a short
  warm-up, the memory probe runs at every control step) and curvature EXCLUDED from the timed
  steps (t_curv larger than the run; curvature is timed separately below).

Variants (`--variants`): amp, tri, tri-uniform (adaptive precision off: bf16 everywhere, no hooks),
tri-keep (tri with zero_grad(set_to_none=False)); inner SGD foreach and/or fused (`--optimizers`, the
same for baseline and wrapper). Step time = wall time of `--steps` consecutive steps synchronised only
at both ends (how training runs: the host may run ahead of the device, and control boundaries are
included), median over interleaved rounds (the order reversed every other round); also the median
of single synchronised steps, and the "paired" ratio: each round's window over the baseline's window
of the same round, median and quartiles over rounds (drift of the host's speed between rounds cancels).
Reports step times and ratios to amp (target <= 1.03). Curvature: one event (k=5, b_curv=32)
timed after a cold event, for "fisher" and "hessian" (warm-started, `hessian_iters` iterations);
amortised fraction = t_event / (t_curv * t_step + t_event) at t_curv=200 (targets: fisher <= 2%,
hessian <= 10%).

    python benchmarks/torch_overhead.py                         # GPU, full run
    python benchmarks/torch_overhead.py --device cpu --steps 3  # smoke check of the script
    python benchmarks/torch_overhead.py --no-curvature --profile 20   # overhead only, with profiles

Writes benchmarks/results/torch_overhead-<device>.json and prints a table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from triaccel import TriAccelConfig
from triaccel.backends.torch import wrap
from triaccel.backends.torch.models import MEMORY_FORMATS, create_model, uses_channels_last
from _results import device_tag, write_json


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn: Callable[[], None], steps: int, dev: torch.device) -> list[float]:
    """Per-step times (s), the device synchronised around every step."""
    out = []
    for _ in range(steps):
        _sync(dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        out.append(time.perf_counter() - t)
    return out


def _pipelined(fn: Callable[[], None], steps: int, dev: torch.device) -> float:
    """Mean step time (s) over `steps` steps synchronised only at both ends (as training runs)."""
    _sync(dev)
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync(dev)
    return (time.perf_counter() - t) / steps


def _model(dev: torch.device, args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    m = create_model(args.model, num_classes=10, width=args.width).to(dev)
    if uses_channels_last(args.model, args.memory_format, dev.type):
        m = m.to(memory_format=torch.channels_last)
    return m


def _sgd(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4,
                           fused=True if kind == "fused" else None)


VARIANTS = ("amp", "tri", "tri-uniform", "tri-keep")
VARIANT_HELP = ("amp: torch.autocast(bf16) + GradScaler-free step (the baseline); tri: wrap() with precision "
                "and batch levers on; tri-uniform: wrap() with adaptive_precision=False (bf16 everywhere, no "
                "hooks, no loss scaling); tri-keep: tri with zero_grad(set_to_none=False)")


def _profile(fn: Callable[[], None], steps: int, dev: torch.device, path: Path) -> None:
    """cProfile (Python, by self time) and torch.profiler (ops, by self CPU time) over `steps` steps."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    _sync(dev)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        fn()
    _sync(dev)
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        _sync(dev)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    path.write_text(f"# {steps} steps\n## cProfile (tottime)\n{buf.getvalue()}\n## torch.profiler\n{table}\n")


def run(args: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device(args.device)
    amp_dtype = torch.bfloat16
    results: dict[str, Any] = {"batch_sizes": {}}
    for bs in args.batch_sizes:
        g = torch.Generator(device="cpu").manual_seed(bs)
        x = torch.randn(bs, 3, 32, 32, generator=g).to(dev)
        if uses_channels_last(args.model, args.memory_format, dev.type):
            x = x.contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 10, (bs,), generator=g).to(dev)
        xc, yc = x[: args.b_curv], y[: args.b_curv]
        cfg = TriAccelConfig(curvature="fisher", t_curv=10**9, top_k=args.top_k, b_curv=args.b_curv,
                             t_ctrl=args.t_ctrl, warmup_steps=args.warmup, min_dwell=args.t_ctrl,
                             batch_init=bs, batch_min=8, batch_max=max(bs, 1024), lr_rule="linear")
        entry: dict[str, Any] = {"optimizers": {}}
        tri_model = tri_opt = None
        for kind in args.optimizers:
            steps_fns: dict[str, Callable[[], None]] = {}
            opts: dict[str, Any] = {}
            opt_host: dict[str, list[float]] = {}
            for v in args.variants:
                model = _model(dev, args)
                clock = opt_host[v] = [0.0]   # host seconds inside step() + zero_grad()
                if v == "amp":
                    opt = _sgd(model, kind)

                    def fn(model=model, opt=opt, clock=clock) -> None:
                        with torch.autocast(dev.type, dtype=amp_dtype):
                            loss = F.cross_entropy(model(x), y)
                        loss.backward()
                        t = time.perf_counter()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                        clock[0] += time.perf_counter() - t
                else:
                    vcfg = cfg.replace(adaptive_precision=False) if v == "tri-uniform" else cfg
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # CPU smoke runs: the memory probe warns once
                        opt = wrap(_sgd(model, kind), model, vcfg, curvature_data=(xc, yc))
                    none = v != "tri-keep"

                    def fn(model=model, opt=opt, none=none, clock=clock) -> None:
                        with opt.autocast():
                            loss = F.cross_entropy(model(x), y)
                        opt.backward(loss)
                        t = time.perf_counter()
                        opt.step()
                        opt.zero_grad(set_to_none=none)
                        clock[0] += time.perf_counter() - t
                    if v == "tri":
                        tri_model, tri_opt = model, opt
                steps_fns[v], opts[v] = fn, opt
            # warm-up: cudnn autotune, allocator, the step-0 curvature event, the precision warm-up and
            # the first control decision after it
            for fn in steps_fns.values():
                _timed(fn, max(args.warmup, args.t_ctrl) + 2, dev)
            synced: dict[str, list[float]] = {v: [] for v in steps_fns}
            piped: dict[str, list[float]] = {v: [] for v in steps_fns}
            order = list(steps_fns)
            host: dict[str, list[float]] = {v: [] for v in steps_fns}
            for r in range(args.rounds):  # interleaved: A, B, C, ... then C, B, A, ... (order effects cancel)
                for v in (order if r % 2 == 0 else order[::-1]):
                    opt_host[v][0] = 0.0
                    piped[v].append(_pipelined(steps_fns[v], args.steps, dev))
                    host[v].append(opt_host[v][0] / args.steps)
                    synced[v] += _timed(steps_fns[v], args.steps, dev)
            ke: dict[str, Any] = {}
            for v, opt in opts.items():
                ke[v] = {"pipelined_step_s": statistics.median(piped[v]),
                         "synced_step_s": statistics.median(synced[v]), "pipelined_rounds_s": piped[v],
                         "opt_host_s": statistics.median(host[v])}
                if "amp" in piped:
                    # each round's ratio to the baseline's window in the same round: drift between
                    # rounds cancels; median and quartiles over rounds
                    q = np.quantile([a / b for a, b in zip(piped[v], piped["amp"])], [0.25, 0.5, 0.75])
                    ke[v]["ratio_paired"] = [float(x) for x in q]
                if v != "amp":
                    ke[v].update({
                        "precisions": [p.short for p in opt.decision.precisions],
                        "hooked_layers": list(opt.plan.hooked), "autocast_dtype": opt.plan.majority.short,
                        "skipped_steps": opt.skipped_steps, "nonfinite_steps": opt.nonfinite_steps,
                        "batch_size": opt.decision.batch_size})
            if "amp" in ke:
                for v in ke:
                    ke[v]["ratio_pipelined"] = ke[v]["pipelined_step_s"] / ke["amp"]["pipelined_step_s"]
                    ke[v]["ratio_synced"] = ke[v]["synced_step_s"] / ke["amp"]["synced_step_s"]
                    # the optimizer calls' extra host time as a share of the baseline's step
                    ke[v]["opt_host_share"] = ((ke[v]["opt_host_s"] - ke["amp"]["opt_host_s"])
                                               / ke["amp"]["pipelined_step_s"])
            entry["optimizers"][kind] = ke
            if args.profile and kind == args.optimizers[0] and bs == args.batch_sizes[0]:
                args.out.mkdir(parents=True, exist_ok=True)
                for v, fn in steps_fns.items():
                    _profile(fn, args.profile, dev, args.out / f"torch_overhead-profile-{kind}-{v}-bs{bs}.txt")
            if kind != args.optimizers[-1]:
                del steps_fns, opts
        if not args.no_curvature and tri_model is not None and tri_opt is not None:
            # curvature: one cold event, then `curv_events` warm events timed
            from triaccel.backends.torch.curvature import CurvatureEstimator

            ref = entry["optimizers"][args.optimizers[0]]["tri"]["pipelined_step_s"]
            for mode in ("fisher", "hessian"):
                est = CurvatureEstimator(tri_model, tri_opt.layers, F.cross_entropy, mode, args.top_k,
                                         hessian_iters=args.hessian_iters,
                                         hessian_iters_cold=args.hessian_iters_cold)
                _sync(dev)
                t0 = time.perf_counter()
                est((xc, yc))
                _sync(dev)
                cold = time.perf_counter() - t0
                warm = statistics.median(_timed(lambda: est((xc, yc)), args.curv_events, dev))
                entry[f"{mode}_event_cold_s"] = cold
                entry[f"{mode}_event_s"] = warm
                entry[f"{mode}_amortised_fraction"] = warm / (args.t_curv * ref + warm)
        results["batch_sizes"][str(bs)] = entry
        tri_model = tri_opt = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[96, 512])
    ap.add_argument("--steps", type=int, default=50, help="timed steps per round and method")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (A, B, ...) per batch size")
    ap.add_argument("--optimizers", nargs="+", choices=("foreach", "fused"), default=["foreach", "fused"],
                    help="inner SGD implementation (the same for the baseline and the wrapper)")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help=VARIANT_HELP)
    ap.add_argument("--no-curvature", action="store_true", help="skip the curvature event timings")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="profile N steps of each variant (first batch size and optimizer) into --out")
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps; also the precision warm-up")
    ap.add_argument("--t-ctrl", type=int, default=50)
    ap.add_argument("--t-curv", type=int, default=200, help="for the amortised curvature fraction")
    ap.add_argument("--top-k", type=int, default=5)
    ap.add_argument("--b-curv", type=int, default=32)
    ap.add_argument("--hessian-iters", type=int, default=1)
    ap.add_argument("--hessian-iters-cold", type=int, default=8)
    ap.add_argument("--curv-events", type=int, default=3)
    ap.add_argument("--model", choices=("resnet18", "efficientnet_b0"), default="resnet18")
    ap.add_argument("--memory-format", choices=MEMORY_FORMATS, default="auto",
                    help="as the demo's --memory-format (auto: channels_last on CUDA but for EfficientNet)")
    ap.add_argument("--width", type=float, default=1.0, help="channel width multiplier (1.0 = the full model)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    if args.device.startswith("cpu"):
        torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here; use --device cpu for a smoke run")
    if "amp" not in args.variants:
        ap.error("--variants must include amp (the baseline of every ratio)")
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
    tag = device_tag(name.split(" (")[0] if dev.type == "cpu" else name)
    path = write_json(res, args.out / f"torch_overhead-{tag}.json")
    m = res["meta"]
    print(f"# torch_overhead  device={m['device']}  torch={m['torch']}  date={m['date']}")
    print(f"# command: {m['command']}")
    print("# step time = median over rounds of (wall time of --steps steps, synchronised at both ends) / steps;")
    print("# 'synced' = median of single steps synchronised around each step")
    print("# 'paired' = median [quartiles] over rounds of the round's ratio to amp's window in that round")
    print("# 'opt us' = host time inside step() + zero_grad() per step (pipelined windows, median);"
          " '+share' = its excess over amp's, as a share of amp's step")
    print(f"{'bs':>5} {'optimizer':>9} {'variant':>12} {'step ms':>9} {'ratio':>7} {'synced ms':>10} "
          f"{'ratio':>7} {'paired [q1, q3]':>22} {'opt us':>7} {'+share':>7}  decision")
    for bs, e in res["batch_sizes"].items():
        for kind, ke in e["optimizers"].items():
            for v, r in ke.items():
                dec = ""
                if v != "amp":
                    dec = (f"autocast {r['autocast_dtype']}, {len(r['hooked_layers'])} hooked, "
                           f"skipped {r['skipped_steps']}")
                pq = r.get("ratio_paired")
                paired = f"{pq[1]:.3f} [{pq[0]:.3f}, {pq[2]:.3f}]" if pq else "-"
                print(f"{bs:>5} {kind:>9} {v:>12} {r['pipelined_step_s'] * 1e3:9.2f} {r['ratio_pipelined']:7.3f} "
                      f"{r['synced_step_s'] * 1e3:10.2f} {r['ratio_synced']:7.3f} {paired:>22} "
                      f"{r['opt_host_s'] * 1e6:7.0f} {r.get('opt_host_share', float('nan')) * 100:6.2f}%  {dec}")
        if "fisher_event_s" in e:
            print(f"{bs:>5} curvature: fisher {e['fisher_event_s'] * 1e3:.1f} ms "
                  f"({e['fisher_amortised_fraction'] * 100:.2f}%), hessian {e['hessian_event_s'] * 1e3:.1f} ms "
                  f"({e['hessian_amortised_fraction'] * 100:.2f}%) amortised at t_curv={args.t_curv}")
    print(f"# targets: ratio <= 1.03, fisher <= 2%, hessian <= 10% (k={args.top_k}, b_curv={args.b_curv}); "
          f"JSON: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
