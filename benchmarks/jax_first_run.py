"""JAX first-run wall (issue 15 item 4): the CIFAR demo under AMP and triaccel, each from an empty
compilation cache, and where their compilation time goes.

Runs `examples.cifar.train --backend jax --method M` once per method, one after the other, each in its
own process with ``TRIACCEL_CACHE`` set to a fresh folder (empty persistent compilation cache, as a
first run on a new machine), and reads the run's summary.json: wall (the training function, from model
creation to the last evaluation), training (sum of epoch seconds), setup (before the first epoch),
evaluation (after each epoch: the test pass and the epoch's records), the demo's compile log
(`triaccel.backends.jax.compile_log`: seconds of traces, lowerings, XLA compilations and waits on the
background compiler, on the critical path vs on the background thread) and accuracy / peak memory.
The last row is the ratio of the second method to the first (target: wall <= 1.1).

Prints a table and writes JSON (default benchmarks/results/jax-first-run-<device>.json).
GPU:
  python benchmarks/jax_first_run.py --data /tmp/data/cifar10-jpeg --budget 4GiB --out $OUT/jax-first-run.json
CPU smoke test:
  python benchmarks/jax_first_run.py --epochs 1 --train-subset 256 --test-subset 64 --width 0.125 --batch 16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from _results import device_tag, write_json

ROOT = Path(__file__).resolve().parents[1]


def run_one(method: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Train once with `method` from an empty compilation cache; returns the measured figures."""
    cmd = [sys.executable, "-m", "examples.cifar.train", "--backend", "jax", "--method", method,
           "--epochs", str(args.epochs), "--seed", str(args.seed), "--no-progress", "--out", str(out)]
    for flag, value in (("--data", args.data), ("--budget", args.budget), ("--batch", args.batch),
                        ("--width", args.width), ("--train-subset", args.train_subset),
                        ("--test-subset", args.test_subset)):
        if value is not None:
            cmd += [flag, str(value)]
    with tempfile.TemporaryDirectory(prefix="triaccel-cache-") as cache:
        env = {**os.environ, "TRIACCEL_CACHE": cache}
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        process_s = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"{method}: the demo exited with {proc.returncode}")
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith(("epoch", "  train", "  eval"))),
          flush=True)
    s = json.loads((out / "summary.json").read_text())
    clog = s["compile_log"]

    def part(window: dict[str, Any], side: str) -> float:
        return float(window[side]["seconds"])

    epochs = [{"seconds": t, "critical_s": part(w, "critical"), "background_s": part(w, "background"),
               "critical_compiles": w["critical"]["compiles"], "top_critical": w["critical"]["top"]}
              for t, w in zip(s["epoch_seconds"], clog["epochs"])]
    evals = [{"seconds": t, "critical_s": part(w, "critical"), "top_critical": w["critical"]["top"]}
             for t, w in zip(s["eval_seconds"], clog["evals"])]
    total = clog["total"]
    return {"method": method, "wall_s": s["wall_seconds"], "train_s": s["train_seconds"],
            "setup_s": s["setup_seconds"], "eval_s": sum(s["eval_seconds"]), "process_s": process_s,
            "epoch_s": s["epoch_seconds"], "critical_s": part(total, "critical"),
            "background_s": part(total, "background"), "critical_by_kind": total["critical"]["by_kind"],
            "top_critical": total["critical"]["top"], "setup_critical_s": part(clog["setup"], "critical"),
            "epochs": epochs, "evals": evals, "final_acc": s["final_acc"], "peak_bytes": s["peak_alloc_bytes"],
            "step_traces": s["step_traces"], "compiled_ahead": s["compiled_ahead"],
            "batches": s.get("final_batch"), "device": s.get("device_name")}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=["amp", "triaccel"], choices=["fp32", "amp", "triaccel"],
                   help="the first is the baseline of the ratio row")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None)
    p.add_argument("--budget", default=None, help="e.g. 4GiB (the same for every method)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--width", type=float, default=None)
    p.add_argument("--train-subset", type=int, default=None)
    p.add_argument("--test-subset", type=int, default=None)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/jax-first-run-<device>.json)")
    args = p.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="jax-first-run-") as tmp:
        for m in args.methods:
            runs.append(run_one(m, args, Path(tmp) / m))
    head = (f"{'method':>9} {'wall s':>7} {'train s':>7} {'setup s':>7} {'eval s':>6} {'epoch 1':>7} "
            f"{'crit s':>6} {'bg s':>6} {'acc %':>6} {'peak GB':>7} {'traces':>6} {'ahead':>5}")
    print(head)
    for r in runs:
        peak = f"{r['peak_bytes'] / 1e9:7.2f}" if r["peak_bytes"] else f"{'-':>7}"
        print(f"{r['method']:>9} {r['wall_s']:7.1f} {r['train_s']:7.1f} {r['setup_s']:7.1f} {r['eval_s']:6.1f} "
              f"{r['epoch_s'][0]:7.1f} {r['critical_s']:6.1f} {r['background_s']:6.1f} {100 * r['final_acc']:6.2f} "
              f"{peak} {r['step_traces']:6d} {r['compiled_ahead']:5d}")
    base = runs[0]
    ratios = {}
    for r in runs[1:]:
        ratios[r["method"]] = {k: r[k] / base[k] for k in ("wall_s", "train_s") if base[k]}
        print(f"{r['method'] + '/' + base['method']:>9} wall {ratios[r['method']].get('wall_s', float('nan')):.3f}  "
              f"train {ratios[r['method']].get('train_s', float('nan')):.3f}  (target wall <= 1.1)")
    for r in runs:
        print(f"{r['method']}: per epoch s / critical-path compile s: "
              + ", ".join(f"{e['seconds']:.1f}/{e['critical_s']:.1f}" for e in r["epochs"]))
        print(f"{r['method']}: critical path by kind {r['critical_by_kind']}; top {r['top_critical'][:4]}")
    device = device_tag(runs[0]["device"] or "cpu")
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"jax-first-run-{device}.json"
    write_json({"runs": runs, "ratios": ratios, "args": vars(args)}, out)


if __name__ == "__main__":
    main()
