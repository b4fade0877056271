"""Data-parallel scaling of the CIFAR demo (issue 16): triaccel throughput on 1 and N GPUs.

Runs `examples.cifar.train` once per GPU count, one after the other: 1 GPU as a plain single process
(the baseline), N > 1 under `torchrun --standalone --nproc-per-node N` (DDP through
`triaccel.backends.torch.distributed`); with `--backend jax` every count is one process, the demo's
`--devices N` (a `jax.sharding` mesh: the batch split across the GPUs, `triaccel.backends.jax.sharding`).
Weak scaling: the initial global batch and its ceiling are
N x the per-GPU values (`--batch`, `--batch-max`), the LR follows the demo's rule (0.1 x batch / 96).

Throughput = training images / epoch seconds (evaluation excluded); steady state = the median over
the epochs after the first (the first pays cuDNN/allocator warm-up). Beside it, the median step (ms
between consecutive steps of those epochs, from the step records' host_s) and the efficiency it
gives, free of each epoch's first and last step. Per-GPU batch = the mean samples
per step of those epochs / N, so a run whose elastic batch took a different path is visible. Efficiency
= (images/s on N) / (N x images/s on 1). Each multi-GPU run also reports whether every rank's decision
digest was equal (`ranks_agree`).

Prints a table and writes JSON (default benchmarks/results/scaling-<device>.json).
GPU (2 GPUs):
  python benchmarks/scaling.py --gpus 1,2 --epochs 6 --data /tmp/data/cifar10-jpeg --out $OUT/scaling.json
GPU, JAX (2 GPUs):
  python benchmarks/scaling.py --backend jax --gpus 1,2 --epochs 6 --data /tmp/data/cifar10-jpeg --out $OUT/scaling-jax.json
CPU smoke test (gloo, tiny; --backend jax: host devices forced by XLA_FLAGS):
  python benchmarks/scaling.py --device cpu --gpus 1,2 --epochs 2 --train-subset 256 --test-subset 64 --width 0.125 --batch 16 --batch-max 32
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from _results import write_json

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device_name(summary_name: str | None) -> str:
    """The runs' device for the file name (read from their summaries: this process keeps off the GPU,
    whose memory the runs measure)."""
    return (summary_name or "cpu").lower().replace(" ", "-")


def median_step_ms(records: list[dict[str, Any]], epochs: list[int]) -> float | None:
    """Median ms between consecutive steps of the same epoch (the step records' host_s, the host's
    seconds into the epoch when a step returned) over `epochs` (0-based): the steady step, free of
    an epoch's first and last steps (an empty pipeline, the wait for the last), which weigh on a
    short epoch (12 steps at 4 x 1024 images). None when no epoch has two steps."""
    gaps = []
    for e in epochs:
        h = [r["host_s"] for r in records if r["type"] == "step" and r["epoch"] == e and "host_s" in r]
        gaps += [1e3 * (b - a) for a, b in zip(h, h[1:])]
    return statistics.median(gaps) if gaps else None


def run_one(n: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Train once on n GPUs (n processes on CPU); returns the measured figures."""
    demo = ["-m", "examples.cifar.train", "--backend", args.backend, "--method", args.method, "--levers", args.levers,
            "--epochs", str(args.epochs), "--seed", str(args.seed), "--batch", str(n * args.batch),
            "--batch-max", str(n * args.batch_max), "--no-progress", "--out", str(out)]
    for flag in ("data", "train_subset", "test_subset", "width"):
        v = getattr(args, flag)
        if v is not None:
            demo += [f"--{flag.replace('_', '-')}", str(v)]
    if args.device == "cpu":
        demo += ["--device", "cpu"]
    demo += args.extra
    env = dict(os.environ)
    if args.backend == "jax":   # one process; the demo splits each batch across n devices
        demo += ["--devices", str(n)]
        if args.device == "cpu":
            env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={n}", JAX_PLATFORMS="cpu")
    if n == 1 or args.backend == "jax":
        cmd = [sys.executable, *demo]
        if n == 1 and args.device != "cpu":
            env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
               "--master-port", str(_free_port()), *demo]
    if args.device == "cpu":
        env.update(OMP_NUM_THREADS="1", TRITON_INTERPRET="0")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    tail = (proc.stdout + proc.stderr).splitlines()[-25:]
    if proc.returncode != 0:
        raise SystemExit(f"{n} GPU run failed (exit {proc.returncode}): {shlex.join(cmd)}\n" + "\n".join(tail))
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line.strip()]
    epochs = [r for r in records if r["type"] == "epoch"]
    images = int(records[0]["train_images"])
    secs = summary["epoch_seconds"]
    steady = list(range(1, len(secs))) or [0]
    steps = [e["steps"] for e in epochs]
    per_epoch_steps = [steps[0]] + [b - a for a, b in zip(steps, steps[1:])]
    ips = statistics.median(images / secs[i] for i in steady)
    batch = statistics.mean(images / per_epoch_steps[i] for i in steady) / n
    step_ms = median_step_ms(records, steady)
    return {"gpus": n, "images_per_s": ips, "epoch_seconds": secs, "steady_epochs": [i + 1 for i in steady],
            "step_ms": step_ms, "images_per_s_by_step": None if step_ms is None else n * batch / step_ms * 1e3,
            "per_gpu_batch": batch, "final_acc": summary["final_acc"], "final_batch": summary["final_batch"],
            "world_size": summary.get("world_size", summary.get("devices", 1)), "ranks_agree": summary.get("ranks_agree"),
            "device_name": summary.get("device_name"), "wall_s": wall, "command": shlex.join(cmd), "tail": tail}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["torch", "jax"], default="torch",
                   help="torch: torchrun + DDP; jax: one process, a device mesh (--devices N)")
    p.add_argument("--gpus", default="1,2", help="comma-separated GPU counts; 1 first is the baseline")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--method", default="triaccel", choices=["triaccel", "amp", "fp32"])
    p.add_argument("--levers", default="precision,batch", help="the demo's --levers (triaccel)")
    p.add_argument("--batch", type=int, default=96, help="initial batch PER GPU (the global one is N x)")
    p.add_argument("--batch-max", type=int, default=512, help="elastic batch ceiling PER GPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="the demo's --data")
    p.add_argument("--train-subset", type=int, default=None)
    p.add_argument("--test-subset", type=int, default=None)
    p.add_argument("--width", type=float, default=None)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: gloo processes (smoke test)")
    p.add_argument("--timeout", type=float, default=540.0, help="seconds per run")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/scaling-<device>.json)")
    p.add_argument("extra", nargs="*", help="after --: more options for the demo")
    args = p.parse_args(argv)
    counts = [int(x) for x in args.gpus.split(",") if x]
    if not counts or counts[0] != 1 or any(c < 1 for c in counts):
        p.error(f"--gpus={args.gpus!r}: a comma-separated list starting with 1 (the baseline), each >= 1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="scaling-") as tmp:
        for n in counts:
            rows.append(run_one(n, args, Path(tmp) / f"gpus{n}"))
            r = rows[-1]
            print(f"  {n} GPU(s): {r['images_per_s']:.0f} images/s, epochs {[round(s, 2) for s in r['epoch_seconds']]} s",
                  flush=True)
    device = _device_name(rows[0]["device_name"])
    base = rows[0]["images_per_s"]
    base_step = rows[0]["images_per_s_by_step"]
    for r in rows:
        r["speedup"] = r["images_per_s"] / base
        r["efficiency_per_gpu"] = r["speedup"] / r["gpus"]
        by_step = r["images_per_s_by_step"]
        r["efficiency_per_gpu_by_step"] = None if by_step is None or not base_step else by_step / base_step / r["gpus"]
    print(f"\nResNet-18 CIFAR-10 {args.backend} {args.method} ({args.levers}), {args.epochs} epochs, per-GPU batch {args.batch} "
          f"(max {args.batch_max}), steady state = median of epochs {rows[0]['steady_epochs']}, device {device}")
    print(f"{'GPUs':>4} {'images/s':>10} {'speed-up':>9} {'eff./GPU':>9} {'step ms':>8} {'eff. by step':>12} "
          f"{'batch/GPU':>10} {'final acc':>10} {'ranks agree':>12}")
    for r in rows:
        agree = "-" if r["ranks_agree"] is None else str(r["ranks_agree"])
        step = "-" if r["step_ms"] is None else f"{r['step_ms']:.2f}"
        eff_step = "-" if r["efficiency_per_gpu_by_step"] is None else f"{r['efficiency_per_gpu_by_step']:.2f}"
        print(f"{r['gpus']:>4} {r['images_per_s']:>10.0f} {r['speedup']:>8.2f}x {r['efficiency_per_gpu']:>9.2f} "
              f"{step:>8} {eff_step:>12} {r['per_gpu_batch']:>10.1f} {100 * r['final_acc']:>9.2f}% {agree:>12}")
    result = {"benchmark": "scaling", "device": device, "host": platform.node(),
              "date": _dt.datetime.now().isoformat(timespec="seconds"),
              "command": shlex.join([sys.executable, *sys.argv]), "args": {k: v for k, v in vars(args).items()},
              "rows": rows}
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / \
        (f"scaling-{device}.json" if args.backend == "torch" else f"scaling-jax-{device}.json")
    write_json(result, out)
    return result


if __name__ == "__main__":
    main()
