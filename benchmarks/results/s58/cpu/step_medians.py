"""Median host time per step, epochs 3-10, from the committed step records of the 2026-12-07 ~17:05Z session
(benchmarks/results/s54/call1 and call2: JAX ResNet-18 seeds 4-5 and EfficientNet-B0 seed 0, one H100, 10 epochs
cold). A step's time is the difference of consecutive records' `host_s` (seconds since the epoch's start) between
two steps of one epoch (`step_gaps.gaps_by_batch`); with a step in flight that is the step's GPU time once the host runs
ahead. Run from the repository root: python3 benchmarks/results/s58/cpu/step_medians.py"""

import io
import json
import statistics
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "benchmarks" / "device"))
from step_gaps import gaps_by_batch  # noqa: E402
CALLS = {"ResNet-18": ROOT / "benchmarks/results/s54/call1/step-records.tgz",
         "EfficientNet-B0": ROOT / "benchmarks/results/s54/call2/step-records.tgz"}
RUNS = {"amp192": "AMP bs 192", "amp512": "AMP bs 512", "tri": "triaccel, steps split (no halves in the update)",
        "halves": "triaccel, halves in the update (the JAX default)"}

print("| model | seed | run | batch (epochs 3-10) | median ms per step, epochs 3-10 | per-epoch medians ms |")
print("|---|---|---|---|---|---|")
for model, path in CALLS.items():
    with tarfile.open(path) as tf:
        for m in sorted(tf.getmembers(), key=lambda m: m.name):
            if not m.name.endswith(".jsonl"):
                continue
            seed, run = m.name.split("/")[-2], Path(m.name).stem
            rows = [json.loads(x) for x in io.TextIOWrapper(tf.extractfile(m))]
            steps = [r for r in rows if r.get("type") == "step"]
            per: dict[int, list[float]] = {}
            sizes = set()
            for epoch in range(2, 10):
                same = [r for r in steps if r["epoch"] == epoch]
                for size, gaps in gaps_by_batch(same).items():
                    per.setdefault(epoch, []).extend(1e3 * g for g, _ in gaps)
                    sizes.add(size)
            every = [t for v in per.values() for t in v]
            print(f"| {model} | {seed[1:]} | {RUNS.get(run, run)} | {'/'.join(map(str, sorted(sizes)))} | "
                  f"{statistics.median(every):.2f} | "
                  f"{' '.join(f'{statistics.median(v):.2f}' for _, v in sorted(per.items()))} |")
