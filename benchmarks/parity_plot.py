"""Compare two CIFAR demo runs (issue 7: torch vs JAX with triaccel): accuracy and decision trajectories.

    python3 benchmarks/parity_plot.py RUN_A RUN_B [--out-json PATH] [--out-png PATH]
    python3 benchmarks/parity_plot.py --summary PARITY_JSON [PARITY_JSON ...] [--out-json PATH]

RUN_A and RUN_B are --out directories of `python -m examples.cifar.train` (log.jsonl + summary.json),
for instance a torch and a JAX run of the same options (the demo's batch settings differ by backend:
torch's triaccel climbs 96/192/512 with noise_split=double, JAX's 96/192/384/512 with the halves, so
name them for both):

    S="--set batch_buckets=[12,24,48,96,192,384,512] --set noise_split=halves"
    python -m examples.cifar.train --backend torch --method triaccel $S --out runs/torch
    python -m examples.cifar.train --backend jax --method triaccel $S --out runs/jax
    python3 benchmarks/parity_plot.py runs/torch runs/jax

Prints a markdown table (model, final accuracy A/B, A - B in points, precision agreement, batch at
the end A/B) with the date and command; writes the comparison as JSON (default
benchmarks/results/parity-<a>-vs-<b>.json, <a>/<b> = the directories' names) and a PNG (default
docs/img/parity-<a>-vs-<b>.png): accuracy per epoch, batch size vs samples seen, lambda_max per
layer over steps (when the runs estimated curvature), per-layer precision of A and of B, and the
precision level A - B at the steps where both decided.

`--summary` reads comparisons written before (one per seed, say) and prints one row each plus each
side's mean +- std of final accuracy and the difference of the means (`summarize`).

What `compare` measures:
- accuracy, in percent: final (summary.json) and per epoch (the log's "epoch" records).
- decisions: the controller's "decision" records, matched on the controller's step. A step with
  several records (a curvature re-decision, an OOM) counts once, with its last record: the decision
  in force after it. At each step where both runs decided: the fraction of layers whose precision
  agrees, each run's batch size, and max over layers of |m_a - m_b| / max(m_a, m_b) for the LR
  multipliers m = lr_scales * lr_batch_scale (positive by the Decision contract). Overall: the
  fraction of (step, layer) pairs that agree, and the largest LR difference.
- batch size: aligned on samples seen (training samples consumed before each step, summed over the
  "step" records), since the step counts differ once the batches differ; agreement = the fraction
  of the samples both runs saw during which their batch sizes were equal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from triaccel import Precision

ROOT = Path(__file__).resolve().parents[1]
BATCH_ALIGNMENT = "samples seen (training samples consumed before each step)"


@dataclass(frozen=True)
class Run:
    """One demo run, as its directory holds it."""

    name: str                              # the directory's name
    options: dict[str, Any]                # RunOptions of the "run" header
    layers: list[str]                      # the controller's layer order
    steps: list[dict[str, Any]]            # "step" records, in order
    epochs: list[dict[str, Any]]           # "epoch" records, in order
    decisions: list[dict[str, Any]]        # one per decision step (its last record), by step
    summary: dict[str, Any]                # summary.json


def load_run(run_dir: str | Path) -> Run:
    """Read <run_dir>/log.jsonl and <run_dir>/summary.json."""
    d = Path(run_dir)
    by_type: dict[str, list[dict[str, Any]]] = {}
    for line in (d / "log.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            by_type.setdefault(r["type"], []).append(r)
    for kind in ("run", "layers"):
        if kind not in by_type:
            raise ValueError(f"{d / 'log.jsonl'}: no {kind!r} record; expected a log of examples.cifar.train")
    last: dict[int, dict[str, Any]] = {}
    for r in by_type.get("decision", []):
        last[r["step"]] = r
    return Run(name=d.resolve().name, options=by_type["run"][0]["options"], layers=by_type["layers"][0]["names"],
               steps=by_type.get("step", []), epochs=by_type.get("epoch", []),
               decisions=[last[s] for s in sorted(last)], summary=json.loads((d / "summary.json").read_text()))


def _check_layers(a: Run, b: Run) -> None:
    if a.layers == b.layers:
        return
    i = next((i for i, (x, y) in enumerate(zip(a.layers, b.layers)) if x != y), min(len(a.layers), len(b.layers)))
    xa = repr(a.layers[i]) if i < len(a.layers) else "nothing (list ends)"
    xb = repr(b.layers[i]) if i < len(b.layers) else "nothing (list ends)"
    raise ValueError(f"layer names differ: at index {i} run {a.name!r} has {xa}, run {b.name!r} has {xb} "
                     f"({len(a.layers)} vs {len(b.layers)} layers); both runs must list the same layers in order")


def _batch_track(run: Run) -> tuple[np.ndarray, np.ndarray, int]:
    """(samples seen before each step, batch size of each step, samples seen at the end)."""
    samples = np.array([r["samples"] for r in run.steps], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(samples)[:-1]]) if len(samples) else samples
    return starts, np.array([r["batch_size"] for r in run.steps], dtype=np.int64), int(samples.sum())


def _multipliers(d: dict[str, Any]) -> np.ndarray:
    return np.asarray(d["lr_scales"], dtype=np.float64) * float(d["lr_batch_scale"])


def compare(a: Run, b: Run) -> dict[str, Any]:
    """JSON-safe comparison of two runs (accuracies in percent, fractions in [0, 1]); see the module doc.

    Raises ValueError if the runs' layer names differ.
    """
    _check_layers(a, b)
    n_layers = len(a.layers)
    da, db = {d["step"]: d for d in a.decisions}, {d["step"]: d for d in b.decisions}
    per_step = []
    for s in sorted(da.keys() & db.keys()):
        pa, pb = da[s]["precisions"], db[s]["precisions"]
        ma, mb = _multipliers(da[s]), _multipliers(db[s])
        per_step.append({
            "step": s,
            "precision_agreement": sum(x == y for x, y in zip(pa, pb)) / n_layers,
            "disagreeing_layers": [n for n, x, y in zip(a.layers, pa, pb) if x != y],
            "batch_a": da[s]["batch_size"], "batch_b": db[s]["batch_size"],
            "lr_max_rel_diff": float(np.max(np.abs(ma - mb) / np.maximum(ma, mb))),
        })
    sa, ba, total_a = _batch_track(a)
    sb, bb, total_b = _batch_track(b)
    # Both trajectories on the union of their step starts, up to the samples both runs saw.
    end = min(total_a, total_b)
    grid = np.union1d(sa, sb)
    grid = grid[grid < end]
    on_a = ba[np.searchsorted(sa, grid, side="right") - 1]
    on_b = bb[np.searchsorted(sb, grid, side="right") - 1]
    width = np.diff(np.append(grid, end))
    acc_a, acc_b = 100 * a.summary["final_acc"], 100 * b.summary["final_acc"]
    return {
        "runs": {"a": {"name": a.name, "options": a.options}, "b": {"name": b.name, "options": b.options}},
        "layers": a.layers,
        "accuracy": {
            "final_a": acc_a, "final_b": acc_b, "diff_points": acc_a - acc_b,
            "per_epoch_a": [100 * r["test_acc"] for r in a.epochs],
            "per_epoch_b": [100 * r["test_acc"] for r in b.epochs],
        },
        "decisions": {
            "steps_a": sorted(da), "steps_b": sorted(db), "common": per_step,
            "precision_agreement": (sum(p["precision_agreement"] for p in per_step) / len(per_step)
                                    if per_step else None),
            "lr_max_rel_diff": max((p["lr_max_rel_diff"] for p in per_step), default=None),
        },
        "batch": {
            "alignment": BATCH_ALIGNMENT,
            "final_a": a.summary["final_batch"], "final_b": b.summary["final_batch"],
            "a": {"samples": sa.tolist(), "batch_size": ba.tolist(), "samples_total": total_a},
            "b": {"samples": sb.tolist(), "batch_size": bb.tolist(), "samples_total": total_b},
            "aligned": {"samples": grid.tolist(), "batch_a": on_a.tolist(), "batch_b": on_b.tolist()},
            "agreement": float(width[on_a == on_b].sum() / end) if end else None,
        },
    }


def _levels(run: Run, steps: Sequence[int] | None = None) -> np.ndarray:
    """(L, decisions) precision levels (0 FP16, 1 BF16, 2 FP32) at `steps` (default: all decisions)."""
    ds = run.decisions if steps is None else [d for d in run.decisions if d["step"] in set(steps)]
    return np.array([[int(Precision.parse(p)) for p in d["precisions"]] for d in ds],
                    dtype=np.int64).reshape(len(ds), len(run.layers)).T


def _lambda_max(run: Run) -> np.ndarray:
    """(decisions, L) top curvature eigenvalue per layer; NaN where none was estimated yet."""
    return np.array([[np.nan if v is None else v for v in d["lambda_max"]] for d in run.decisions],
                    dtype=np.float64).reshape(len(run.decisions), len(run.layers))


def plot(a: Run, b: Run, result: dict[str, Any], path: str | Path) -> Path:
    """Write the comparison figure (PNG) to `path`; returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(2, 3, figsize=(17, 9))
    acc = result["accuracy"]
    for key, run, style in (("a", a, "-o"), ("b", b, "--s")):
        ep = acc[f"per_epoch_{key}"]
        ax[0, 0].plot(range(1, len(ep) + 1), ep, style, label=run.name)
        tr = result["batch"][key]
        if tr["samples"]:  # the last step's batch holds until the run's last sample
            ax[0, 1].step([*tr["samples"], tr["samples_total"]], [*tr["batch_size"], tr["batch_size"][-1]],
                          style[:-1], where="post", label=run.name)
    ax[0, 0].set(xlabel="epoch", ylabel="test accuracy (%)",
                 title=f"accuracy: final {acc['final_a']:.2f} / {acc['final_b']:.2f} (A - B {acc['diff_points']:+.2f})")
    ax[0, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    ax[0, 1].set(xlabel="samples seen", ylabel="batch size (samples)", title="batch size vs samples seen")
    for x in ax[0, :2]:
        x.legend()

    lam_ax = ax[0, 2]
    lam = {"a": _lambda_max(a), "b": _lambda_max(b)}
    if any(np.isfinite(x).any() for x in lam.values()):
        colours = plt.get_cmap("tab20")
        for k, run, ls in (("a", a, "-"), ("b", b, "--")):
            steps = [d["step"] for d in run.decisions]
            for i in range(len(run.layers)):
                lam_ax.plot(steps, lam[k][:, i], ls, color=colours(i % 20), lw=0.8, alpha=0.8)
        lam_ax.set_yscale("symlog", linthresh=1e-3)
        lam_ax.set(xlabel="step", ylabel="λ_max", title=f"λ_max per layer ({a.name} solid, {b.name} dashed)")
    else:
        lam_ax.axis("off")
        lam_ax.text(0.5, 0.5, "no curvature estimates in the logs", ha="center", va="center")

    cmap = ListedColormap(["#4c9be8", "#f2b134", "#d1495b"])
    common = [c["step"] for c in result["decisions"]["common"]]
    agree = _pct(result["decisions"]["precision_agreement"])
    panels = [(ax[1, 0], _levels(a), [d["step"] for d in a.decisions], cmap, (-0.5, 2.5),
               f"{a.name}: precision (blue FP16, amber BF16, red FP32)"),
              (ax[1, 1], _levels(b), [d["step"] for d in b.decisions], cmap, (-0.5, 2.5), f"{b.name}: precision"),
              (ax[1, 2], _levels(a, common) - _levels(b, common), common, "bwr", (-2.5, 2.5),
               f"precision level A - B at common steps (white: agree; {agree} agree)")]
    n_layers = len(a.layers)
    for x, grid, steps, cm, (lo, hi), title in panels:
        if steps:
            img = x.imshow(grid, aspect="auto", interpolation="nearest", cmap=cm, vmin=lo, vmax=hi,
                           extent=(-0.5, len(steps) - 0.5, n_layers - 0.5, -0.5))
            ticks = np.linspace(0, len(steps) - 1, min(len(steps), 8)).astype(int)
            x.set_xticks(ticks, [str(steps[i]) for i in ticks])
            if cm == "bwr":
                fig.colorbar(img, ax=x, ticks=[-2, -1, 0, 1, 2], label="levels (red: A higher, blue: B higher)")
        x.set(xlabel="step (decisions)", title=title)
        x.title.set_fontsize(9)
    if n_layers <= 80:
        ax[1, 0].set_yticks(range(n_layers), a.layers, fontsize=5)
    for x in ax[1, 1:]:
        x.set_yticks([])
    fig.suptitle(f"{_model(a, b)}: {a.name} (A) vs {b.name} (B)")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _model(a: Run, b: Run) -> str:
    def label(o: dict[str, Any]) -> str:
        return f"{o['model']} w{o['width']:g} {o['dataset']} {o['method']}"

    la, lb = label(a.options), label(b.options)
    return la if la == lb else f"{la} vs {lb}"


def table(a: Run, b: Run, result: dict[str, Any]) -> str:
    """The markdown table of the comparison (one row)."""
    acc, bt = result["accuracy"], result["batch"]
    return "\n".join([
        "| model | A / B | final acc A / B (%) | A - B (points) | precision agreement | batch at end A / B |",
        "|---|---|---|---|---|---|",
        f"| {_model(a, b)} | {a.name} / {b.name} | {acc['final_a']:.2f} / {acc['final_b']:.2f} | "
        f"{acc['diff_points']:+.2f} | {_pct(result['decisions']['precision_agreement'])} | "
        f"{bt['final_a']} / {bt['final_b']} |",
    ])


def summarize(comparisons: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Over several `compare` results (JSON as written by this script): per comparison its seeds,
    finals (%) and A - B; over all, mean and sample std of each side's final (%), the difference of
    the means (points), and how many comparisons are within 0.5 points on their own."""
    if not comparisons:
        raise ValueError("comparisons: need at least one parity JSON")
    rows = []
    for c in comparisons:
        acc, runs = c["accuracy"], c["runs"]
        rows.append({"seed_a": runs["a"]["options"]["seed"], "seed_b": runs["b"]["options"]["seed"],
                     "final_a": acc["final_a"], "final_b": acc["final_b"], "diff_points": acc["diff_points"],
                     "precision_agreement": c["decisions"]["precision_agreement"]})
    fa = np.array([r["final_a"] for r in rows], dtype=np.float64)
    fb = np.array([r["final_b"] for r in rows], dtype=np.float64)
    std = (lambda x: float(x.std(ddof=1)) if x.size > 1 else 0.0)
    return {"rows": rows, "mean_a": float(fa.mean()), "std_a": std(fa), "mean_b": float(fb.mean()),
            "std_b": std(fb), "diff_of_means": float(fa.mean() - fb.mean()),
            "within_half_point": int(sum(abs(r["diff_points"]) <= 0.5 for r in rows)), "count": len(rows)}


def _summary_main(paths: Sequence[str], out_json: str | None, command: list[str]) -> dict[str, Any]:
    comparisons = [json.loads(Path(p).read_text()) for p in paths]
    res = summarize(comparisons)
    names = comparisons[0]["runs"]["a"]["name"], comparisons[0]["runs"]["b"]["name"]
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(command), "inputs": list(paths)}
    print(f"# parity summary  date={meta['date']}")
    print(f"# command: {meta['command']}")
    print(f"| seed | {names[0]} % | {names[1]} % | A - B | precision agreement |")
    print("|---|---|---|---|---|")
    for r in res["rows"]:
        seed = r["seed_a"] if r["seed_a"] == r["seed_b"] else f"{r['seed_a']}/{r['seed_b']}"
        print(f"| {seed} | {r['final_a']:.2f} | {r['final_b']:.2f} | {r['diff_points']:+.2f} | "
              f"{_pct(r['precision_agreement'])} |")
    print(f"| mean | {res['mean_a']:.2f} +- {res['std_a']:.2f} | {res['mean_b']:.2f} +- {res['std_b']:.2f} | "
          f"{res['diff_of_means']:+.2f} | {res['within_half_point']} of {res['count']} within 0.5 |")
    if out_json:
        Path(out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(out_json).write_text(json.dumps({**meta, **res}, indent=1))
        print(f"# json: {out_json}")
    return res


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_a", nargs="?", help="run directory A (log.jsonl, summary.json)")
    p.add_argument("run_b", nargs="?", help="run directory B")
    p.add_argument("--summary", nargs="+", metavar="PARITY_JSON", default=None,
                   help="summarise comparisons written before instead of comparing two runs")
    p.add_argument("--out-json", default=None, help="default benchmarks/results/parity-<a>-vs-<b>.json")
    p.add_argument("--out-png", default=None, help="default docs/img/parity-<a>-vs-<b>.png")
    args = p.parse_args(argv)
    command = [os.path.basename(sys.executable), "benchmarks/parity_plot.py", *(sys.argv[1:] if argv is None else argv)]
    if args.summary is not None:
        if args.run_a or args.run_b:
            p.error("--summary takes parity JSON files, not run directories")
        return _summary_main(args.summary, args.out_json, command)
    if not (args.run_a and args.run_b):
        p.error("two run directories are needed (or --summary PARITY_JSON ...)")
    a, b = load_run(args.run_a), load_run(args.run_b)
    result = compare(a, b)
    stem = f"parity-{a.name}-vs-{b.name}"
    out_json = Path(args.out_json or ROOT / "benchmarks" / "results" / f"{stem}.json")
    out_png = Path(args.out_png or ROOT / "docs" / "img" / f"{stem}.png")
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(command)}
    plot(a, b, result, out_png)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps({**meta, **result}, indent=1))
    print(f"# parity  date={meta['date']}  batch aligned on {BATCH_ALIGNMENT}")
    print(f"# command: {meta['command']}")
    print(table(a, b, result))
    print(f"# json: {out_json}  png: {out_png}")
    return result


if __name__ == "__main__":
    main()
