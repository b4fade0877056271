"""The gradient-noise estimate B_noise under each `noise_split` (halves, double, steps), side by side on the
CIFAR demo at a fixed batch: each split in its own process, the same seed and data; the batch cannot climb
(`--batch-max` = `--batch`), so every split measures along the same kind of run and only the measurement
differs (the evidence precision law keeps the noise steps going). Per split: the B_noise the controller held
at each control boundary (log.jsonl's decision records), its median over the run's second half, and the
spread of log B_noise between consecutive boundaries (how much the estimate jumps), beside the
training time. Prints a table, writes JSON to benchmarks/results/noise_split_compare-<backend>-<device>.json.

    python3 benchmarks/noise_split_compare.py --backend torch --data ../shared/data/cifar10-jpeg          # CPU: ~5 min
    python3 benchmarks/noise_split_compare.py --backend jax --train-subset 50000 --epochs 3 --width 1      # GPU
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import device_tag, print_table, run_demo, run_meta, write_json  # noqa: E402

SPLITS = ("halves", "double", "steps")
ROOT = Path(__file__).resolve().parents[1]


def trajectory(run_dir: Path) -> list[tuple[int, float | None]]:
    """(step, B_noise or None) at each decision record of a demo run's log.jsonl."""
    rows = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    return [(int(r["step"]), r.get("b_noise")) for r in rows if r.get("type") == "decision"]


def summarise(split: str, traj: list[tuple[int, float | None]], summary: dict[str, Any]) -> dict[str, Any]:
    """The row of one split: median B_noise over the second half of its boundaries with an estimate,
    the median |log ratio| between consecutive estimates, the run's measurements and training seconds."""
    known = [b for _, b in traj if b is not None and b > 0]
    half = known[len(known) // 2:]
    jumps = sorted(abs(math.log(b / a)) for a, b in zip(known, known[1:]))
    return {"split": split, "estimates": len(known),
            "median_b_noise": sorted(half)[len(half) // 2] if half else float("nan"),
            "median_log_jump": jumps[len(jumps) // 2] if jumps else float("nan"),
            "measurements": (summary.get("report") or {}).get("noise_measurements", -1),
            "steps": summary["steps"], "train_s": summary["train_seconds"], "final_acc": summary["final_acc"],
            "trajectory": traj}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("torch", "jax"), default="torch")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "cifar10-jpeg"))
    ap.add_argument("--splits", nargs="+", choices=SPLITS, default=list(SPLITS))
    ap.add_argument("--train-subset", type=int, default=4096)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--width", type=float, default=0.25)
    ap.add_argument("--t-ctrl", type=int, default=10, help="steps between boundaries (and noise steps)")
    ap.add_argument("--warmup-steps", type=int, default=None, help="the demo's --warmup-steps (default: its own)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="the demo's --device (default: its own choice)")
    ap.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"), help="folder for the JSON")
    a = ap.parse_args(argv)
    for name in ("train_subset", "epochs", "batch", "t_ctrl"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(a, name)}: allowed >= 1")
    if a.width <= 0:
        ap.error(f"--width={a.width}: allowed > 0")
    base = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="noise_split_"))
    rows, device = [], "?"
    for split in a.splits:
        args = ["--backend", a.backend, "--method", "triaccel", "--budget", "4GiB", "--data", a.data,
                "--train-subset", str(a.train_subset), "--test-subset", "500", "--epochs", str(a.epochs),
                "--batch", str(a.batch), "--batch-max", str(a.batch), "--width", str(a.width),
                "--t-ctrl", str(a.t_ctrl), "--seed", str(a.seed), "--no-progress", "--set", f"noise_split={split}",
                *(["--device", a.device] if a.device else []),
                *(["--warmup-steps", str(a.warmup_steps)] if a.warmup_steps is not None else [])]
        summary = run_demo(args, base / split, workdir=ROOT, timeout=a.timeout)
        if summary is None:
            rows.append({"split": split, "error": f"the run failed; its output is in {base / split}"})
            continue
        full = json.loads((base / split / "summary.json").read_text())   # with its report
        device = summary.get("device_name") or summary.get("device") or device
        rows.append(summarise(split, trajectory(base / split), full))
    ok = [r for r in rows if "error" not in r]
    if ok:
        print_table(f"B_noise by noise split, {a.backend}, ResNet-18 width {a.width}, bs {a.batch} fixed, "
                    f"{a.train_subset} images x {a.epochs} epochs, t_ctrl {a.t_ctrl}, seed {a.seed}, {device}", ok,
                    [("split", "split", ">7"), ("measurements", "measurements", ">12d"),
                     ("estimates", "estimates", ">9d"), ("median B_noise", "median_b_noise", ">14.1f"),
                     ("median |log jump|", "median_log_jump", ">17.3f"), ("steps", "steps", ">6d"),
                     ("train s", "train_s", ">8.1f"), ("acc", "final_acc", ">6.3f")])
    write_json({**run_meta(device), "rows": rows},
               Path(a.results) / f"noise_split_compare-{a.backend}-{device_tag(device)}.json")
    if len(ok) < len(rows):
        sys.exit(1)
    return rows


if __name__ == "__main__":
    main()
