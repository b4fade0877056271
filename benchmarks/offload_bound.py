"""How much of the no-budget throughput any swap/recompute plan can keep (#17), from a run of
`benchmarks/offload.py`: its two measured cost tables (`CostModel`), its copy bandwidth and budget.

For each batch (default: the smallest at >= 4.2x B0, the issue's target, and the run's Bp) it prints
`triaccel.swap_plan.throughput_bound` twice: on the model's own times, and on the times scaled so that
the no-plan step equals the run's measured no-budget step at Bp (the tables are measured at small
batches, where per-unit times run long; the bound's copy capacity is the forward's time x the
bandwidth, so longer times make a looser bound). Beside it, the run's measured plan at Bp against its
no-budget run. Reads JSON, runs nothing on a GPU; prints a table and writes JSON (default
benchmarks/results/offload_bound.json).

    python3 benchmarks/offload_bound.py benchmarks/results/s30/offload-remeasure/offload-bf16-remeasure.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import math
import shlex
import sys
from pathlib import Path
from typing import Any

from _results import write_json

from triaccel.swap_plan import CostModel, CostTable, LayerCost, throughput_bound

ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO = 4.2   # #17: the planned batch at least 4.2x the largest without a plan


def cost_model(run: dict[str, Any]) -> CostModel:
    """The run's measured tables (offload.py's "cost_tables", the bandwidth beside them) as a model."""
    bw = run["bandwidth_bytes_per_s"]
    tables = tuple(CostTable(t["batch"], tuple(LayerCost(**u) for u in t["layers"]), bw["d2h"], bw["h2d"],
                             t["static_bytes"], t["transient_bytes"], t["other_ms"]) for t in run["cost_tables"])
    return CostModel(tables)


def scaled(table: CostTable, factor: float) -> CostTable:
    """`table` with every time (forward, backward, recompute, other) multiplied by `factor` (> 0)."""
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"factor={factor!r}: allowed a finite number > 0")
    def unit(u: LayerCost) -> LayerCost:
        return dataclasses.replace(u, forward_ms=u.forward_ms * factor, backward_ms=u.backward_ms * factor,
                                   recompute_ms=None if u.recompute_ms is None else u.recompute_ms * factor)
    return dataclasses.replace(table, layers=tuple(unit(u) for u in table.layers), other_ms=table.other_ms * factor)


def bounds(run: dict[str, Any], batches: list[int]) -> list[dict[str, Any]]:
    model, budget = cost_model(run), int(run["budget_bytes"])
    runs = run.get("runs") or {}
    nobudget = runs.get("nobudget_bp")
    fix = None
    if nobudget:
        at_bp = model.at(int(nobudget["batch"]))
        fix = nobudget["step_s"] * 1e3 / throughput_bound(at_bp, budget).step_ms
    rows = []
    for b in batches:
        t = model.at(b)
        row: dict[str, Any] = {"batch": b, "over_b0": b / run["b0"], "model": throughput_bound(t, budget).to_dict()}
        if fix is not None:
            row["time_scale"] = fix
            row["measured_times"] = throughput_bound(scaled(t, fix), budget).to_dict()
        plan = runs.get("plan_bp")
        if plan and nobudget and plan["batch"] == b == nobudget["batch"]:
            row["measured_plan_ratio"] = plan["samples_per_s"] / nobudget["samples_per_s"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a JSON that benchmarks/offload.py wrote")
    p.add_argument("--batch", type=int, action="append", default=None,
                   help="batches to bound (repeatable; default: ceil(4.2 x B0) and the run's Bp)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "offload_bound.json")
    a = p.parse_args(argv)
    import json
    run = json.loads(a.run.read_text())
    for key in ("cost_tables", "bandwidth_bytes_per_s", "budget_bytes", "b0"):
        if not run.get(key):
            p.error(f"{a.run}: no {key!r} (not a benchmarks/offload.py result?)")
    batches = a.batch or sorted({math.ceil(TARGET_RATIO * run["b0"]), *([run["bp"]] if run.get("bp") else [])})
    if any(b < 1 for b in batches):
        p.error(f"--batch={batches}: allowed integers >= 1 (samples)")
    rows = bounds(run, batches)
    print(f"{run.get('model')} {run.get('image')}px {run.get('amp')}, budget {run['budget_bytes'] / 2**30:.2f} GiB, "
          f"{run.get('device')}, {run.get('date')}; d2h {run['bandwidth_bytes_per_s']['d2h'] / 1e9:.1f} GB/s; B0 {run['b0']}")
    print(f"{'batch':>6} {'xB0':>5} {'over GiB':>9} {'copy GiB':>9} {'recompute GiB':>13} {'bound':>6} "
          f"{'bound (measured times)':>23} {'plan measured':>14}")
    for r in rows:
        m, s = r["model"], r.get("measured_times")
        print(f"{r['batch']:>6} {r['over_b0']:>5.2f} {m['over_bytes'] / 2**30:>9.2f} {m['copy_bytes'] / 2**30:>9.2f} "
              f"{m['recompute_bytes'] / 2**30:>13.2f} {m['ratio']:>6.3f} "
              f"{(format(s['ratio'], '.3f') + ' (x' + format(r['time_scale'], '.3f') + ')') if s else '':>23} "
              f"{format(r['measured_plan_ratio'], '.3f') if 'measured_plan_ratio' in r else '':>14}")
    result = {"issue": 17, "benchmark": "offload_bound", "source": str(a.run), "date": _dt.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv]), "rows": rows}
    write_json(result, a.out)
    return result


if __name__ == "__main__":
    main()
