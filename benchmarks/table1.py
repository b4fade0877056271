"""Table 1/2 reproduction: FP32, AMP (static bf16) and triaccel with its ablations, on CIFAR.

Each cell is one run of the CIFAR demo (`python -m examples.cifar.train`) in its own process, so
that peak-memory counters and caches start clean. Columns: final test accuracy (mean +- std over
seeds), s/epoch (median of the last 5 epochs), peak allocated device memory, and an efficiency
score, and the training wall time each run took to first reach AMP's mean final accuracy (its
ratio to AMP's mean wall: the issue's "AMP's accuracy in at most half its time"). The score used here is accuracy(%) / (s/epoch x peak GB), reported relative to FP32 of the
same model (FP32 = 1.00); the paper's exact formula was not available to us, so compare its shape,
not its value, with the paper's column.

    python3 benchmarks/table1.py --models resnet18 efficientnet_b0 --seeds 0 1 2 --epochs 10 \
        --data ../shared/data/cifar10-jpeg

`--long-epochs N` adds a row "triaccel (full), N ep": the full method trained for N epochs (its
cosine schedule spans N epochs), for the time to AMP's accuracy when 10 epochs do not reach it.

Writes benchmarks/results/table1-<device>.json (every run's summary) and prints the table with the
machine, the date and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from _results import run_demo, write_json

ROOT = Path(__file__).resolve().parents[1]

AMP = "AMP (bf16)"
FULL = "triaccel (full)"
TRIACCEL = "triaccel"
# The static sweep a user would run instead: AMP-bf16 at fixed batches, the linear LR rule (the
# demo's default lr is 0.1 x batch/96) and the same warm-up + cosine. AMP (bf16) is its bs-96 row.
STATIC = {96: AMP, 192: "AMP bs 192", 384: "AMP bs 384", 512: "AMP bs 512"}
# name -> demo options (ablations stack on AMP's static bf16 baseline: the levers not listed are off)
METHODS: dict[str, list[str]] = {
    "FP32": ["--method", "fp32"],
    **{name: ["--method", "amp", *([] if b == 96 else ["--batch", str(b)])] for b, name in STATIC.items()},
    TRIACCEL: ["--method", "triaccel"],                     # the defaults (levers precision,batch)
    "+batch elasticity": ["--method", "triaccel", "--levers", "batch"],
    FULL: ["--method", "triaccel", "--levers", "precision,curvature,batch"],
}
# Accuracy band of "fastest static": statics within this many points of the best static's mean.
STATIC_BAND = 0.3


def long_row(epochs: int) -> str:
    return f"{FULL}, {epochs} ep"


def row_options(method: str, args: argparse.Namespace) -> tuple[list[str], int]:
    """(demo options, epochs) of a table row."""
    if args.long_epochs is not None and method == long_row(args.long_epochs):
        return METHODS[FULL], args.long_epochs
    return METHODS[method], args.epochs


def run_one(model: str, method: str, seed: int, args: argparse.Namespace, out: Path,
            gpu: str | None = None) -> dict[str, Any]:
    options, epochs = row_options(method, args)
    cmd = ["--backend", args.backend, "--model", model, "--dataset", args.dataset, "--epochs", str(epochs),
           "--data", args.data, "--seed", str(seed), "--no-progress", *options, *args.demo_args]
    if args.budget and "triaccel" in options:
        cmd += ["--budget", args.budget]
    summary = run_demo(cmd, out, args.workdir, gpu)
    if summary is None:
        return {"model": model, "method": method, "seed": seed, "failed": 1}
    summary.update(model=model, method=method, seed=seed)
    return summary


def seconds_to_accuracy(run: dict[str, Any], target: float) -> float | None:
    """Training seconds (sum of epoch_seconds) until the first epoch with test accuracy >= target
    (a fraction); None if no epoch reached it."""
    total = 0.0
    for acc, sec in zip(run["accs"], run["epoch_seconds"]):
        total += sec
        if acc >= target:
            return total
    return None


def table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One cell per (model, row) with runs: accuracy, s/epoch, wall, peak, efficiency, and the time
    to AMP's mean final accuracy (median over seeds, None unless every seed reached it)."""
    cells = []
    for model in dict.fromkeys(r["model"] for r in rows):
        ok = [r for r in rows if r["model"] == model and "failed" not in r]
        amp = [r for r in ok if r["method"] == AMP]
        target = statistics.mean(r["final_acc"] for r in amp) if amp else None
        amp_wall = statistics.mean(sum(r["epoch_seconds"]) for r in amp) if amp else None
        base = None
        for method in dict.fromkeys([*METHODS, *(r["method"] for r in ok)]):
            runs = [r for r in ok if r["method"] == method]
            if not runs:
                continue
            accs = [100 * r["final_acc"] for r in runs]
            reach = [seconds_to_accuracy(r, target) for r in runs] if target is not None else [None]
            t_amp = statistics.median(reach) if None not in reach else None
            spe = statistics.median(r["s_per_epoch_median_last5"] for r in runs)
            peaks = [r["peak_alloc_bytes"] for r in runs if r.get("peak_alloc_bytes")]
            peak_gb = max(peaks) / 1e9 if peaks else float("nan")
            raw = statistics.mean(accs) / (spe * peak_gb)
            base = raw if method == "FP32" else base
            cells.append({"model": model, "method": method, "seeds": len(runs), "acc_mean": statistics.mean(accs),
                          "acc_std": statistics.stdev(accs) if len(accs) > 1 else 0.0, "s_per_epoch": spe,
                          "peak_gb": peak_gb, "efficiency_vs_fp32": raw / base if base else float("nan"),
                          "epochs": [len(r["accs"]) for r in runs],
                          "wall_s": statistics.mean(sum(r["epoch_seconds"]) for r in runs),
                          "seconds_to_amp_acc": t_amp,
                          "to_amp_acc_vs_amp_wall": t_amp / amp_wall if t_amp is not None and amp_wall else None,
                          "final_batch": [r.get("final_batch") for r in runs],
                          "sixteen_bit_min": min((r["flop_share"]["fp16"] + r["flop_share"]["bf16"] for r in runs
                                                  if r.get("flop_share")), default=None)})
    for model in dict.fromkeys(c["model"] for c in cells):
        mine = [c for c in cells if c["model"] == model]
        statics = [c for c in mine if c["method"] in STATIC.values()]
        if not statics:
            continue
        best = max(statics, key=lambda c: c["acc_mean"])
        fastest = min((c for c in statics if c["acc_mean"] >= best["acc_mean"] - STATIC_BAND),
                      key=lambda c: c["wall_s"])
        for c in mine:
            c.update(best_static=best["method"], fastest_static=fastest["method"],
                     acc_vs_best_static=c["acc_mean"] - best["acc_mean"],
                     wall_vs_fastest_static=c["wall_s"] / fastest["wall_s"],
                     wall_vs_best_static=c["wall_s"] / best["wall_s"])
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["resnet18"], choices=["resnet18", "efficientnet_b0"])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--backend", choices=["torch", "jax"], default="torch")
    ap.add_argument("--dataset", choices=["cifar10", "cifar100"], default="cifar10")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "cifar10-jpeg"))
    ap.add_argument("--budget", default=None, help="memory budget for the triaccel rows, e.g. 4GiB")
    ap.add_argument("--workdir", default=str(ROOT), help="folder holding examples/ (cwd of each run)")
    ap.add_argument("--runs", default=str(ROOT / "runs" / "table1"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--parallel", type=int, default=1,
                    help="runs at once, one GPU each (CUDA_VISIBLE_DEVICES=0..N-1); s/epoch is then measured "
                         "with N processes sharing the host's CPUs")
    ap.add_argument("--long-epochs", type=int, default=None,
                    help="also run the full method for this many epochs (row 'triaccel (full), N ep')")
    ap.add_argument("demo_args", nargs=argparse.REMAINDER, help="after --: extra demo options for every run")
    args = ap.parse_args()
    args.demo_args = [a for a in args.demo_args if a != "--"]
    if args.parallel < 1:
        raise ValueError(f"--parallel={args.parallel}: must be >= 1")
    if args.long_epochs is not None and args.long_epochs < 1:
        raise ValueError(f"--long-epochs={args.long_epochs}: must be >= 1")
    methods = [*args.methods, *([long_row(args.long_epochs)] if args.long_epochs is not None else [])]
    jobs = [(model, method, seed) for model in args.models for method in methods for seed in args.seeds]
    gpus: queue.Queue[str | None] = queue.Queue()
    for i in range(args.parallel):
        gpus.put(str(i) if args.parallel > 1 else None)

    partial = Path(args.runs) / "table1-partial.jsonl"  # each finished run, in case the whole is cut off
    partial.parent.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()

    def job(spec: tuple[str, str, int]) -> dict[str, Any]:
        model, method, seed = spec
        gpu = gpus.get()
        try:
            slug = "".join(ch if ch.isalnum() else "-" for ch in method.lower()).strip("-")
            tag = f"{model}-{'-'.join(filter(None, slug.split('-')))}-s{seed}"
            row = run_one(model, method, seed, args, Path(args.runs) / tag, gpu)
        finally:
            gpus.put(gpu)
        with lock:
            with partial.open("a") as f:
                f.write(json.dumps(row, default=str) + "\n")
        return row

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        rows = list(pool.map(job, jobs))
    cells = table(rows)
    device = next((r.get("device_name") for r in rows if r.get("device_name")), "unknown")
    meta = {"device": device, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "epochs": args.epochs}
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / \
        f"table1-{device.lower().replace(' ', '-')}.json"
    write_json({"meta": meta, "cells": cells, "runs": rows}, out)
    print(f"# table1  device={device}  date={meta['date']}  epochs={args.epochs}  seeds={args.seeds}")
    print(f"# command: {meta['command']}")
    print(f"{'model':<16}{'method':<26}{'acc %':>14}{'s/epoch':>9}{'wall s':>8}{'peak GB':>9}{'eff/FP32':>9}"
          f"{'to AMP acc s':>13}{'/AMP wall':>10}{'-best st.':>10}{'/fast st.':>10}{'16-bit %':>9}")
    for c in cells:
        acc = f"{c['acc_mean']:.2f}+-{c['acc_std']:.2f}"
        t, r = c["seconds_to_amp_acc"], c["to_amp_acc_vs_amp_wall"]
        d, w, f16 = c.get("acc_vs_best_static"), c.get("wall_vs_fastest_static"), c.get("sixteen_bit_min")
        print(f"{c['model']:<16}{c['method']:<26}{acc:>14}{c['s_per_epoch']:>9.2f}{c['wall_s']:>8.1f}"
              f"{c['peak_gb']:>9.2f}{c['efficiency_vs_fp32']:>9.2f}{'-' if t is None else f'{t:.1f}':>13}"
              f"{'-' if r is None else f'{r:.2f}':>10}{'-' if d is None else f'{d:+.2f}':>10}"
              f"{'-' if w is None else f'{w:.2f}':>10}{'-' if f16 is None else f'{100 * f16:.1f}':>9}")
    for model in dict.fromkeys(c["model"] for c in cells):
        c = next((c for c in cells if c["model"] == model and "best_static" in c), None)
        if c:
            print(f"# {model}: best static = {c['best_static']}, fastest static within {STATIC_BAND} points = "
                  f"{c['fastest_static']}")
    print(f"# JSON: {out}")


if __name__ == "__main__":
    main()
