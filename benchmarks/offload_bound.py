"""How much of the no-budget throughput any swap/recompute plan can keep (#17), from a run of
`benchmarks/offload.py`: its two measured cost tables (`CostModel`), its copy bandwidth and budget.

For each batch (default: the smallest at >= 4.2x B0, the issue's target, and the run's Bp) it prints
`triaccel.swap_plan.throughput_bound` twice: on the model's own times, and on the times scaled so that
the no-plan step equals the run's measured no-budget step at Bp (the tables are measured at small
batches, where per-unit times run long; the bound's copy capacity is the forward's time x the
bandwidth, so longer times make a looser bound). Beside it, the run's measured plan at Bp against its
no-budget run; with --search-iters N, the model's plan (`plan_for_budget`) and the best a simulated
annealing from it finds (is the gap to the bound the planner's, or the bound's?). Reads JSON, runs nothing
on a GPU; prints a table and writes JSON (default benchmarks/results/offload_bound.json).

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

from triaccel.swap_plan import ACTIONS, CostModel, CostTable, LayerCost, plan_for_budget, simulate, throughput_bound

ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO = 4.2   # #17: the planned batch at least 4.2x the largest without a plan


def cost_model(run: dict[str, Any]) -> CostModel:
    """The run's measured tables (offload.py's "cost_tables", the bandwidth beside them) as a model."""
    bw = {"d2h_bytes_per_s": run["bandwidth_bytes_per_s"]["d2h"], "h2d_bytes_per_s": run["bandwidth_bytes_per_s"]["h2d"]}
    return CostModel(tuple(CostTable.from_dict({**t, **bw}) for t in run["cost_tables"]))


def scaled(table: CostTable, factor: float) -> CostTable:
    """`table` with every time (forward, backward, recompute, other) multiplied by `factor` (> 0)."""
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"factor={factor!r}: allowed a finite number > 0")
    def unit(u: LayerCost) -> LayerCost:
        return dataclasses.replace(u, forward_ms=u.forward_ms * factor, backward_ms=u.backward_ms * factor,
                                   recompute_ms=None if u.recompute_ms is None else u.recompute_ms * factor)
    return dataclasses.replace(table, layers=tuple(unit(u) for u in table.layers), other_ms=table.other_ms * factor)


def searched(table: CostTable, budget: int, start: tuple[str, ...], iters: int, seed: int = 0) -> tuple[str, ...]:
    """The fastest fitting plan a simulated annealing over per-unit actions finds in `iters` steps from
    `start` (1-3 units changed per step; an unfitting plan pays 10 s plus its excess MB): whether the
    greedy planner leaves modelled time on the table."""
    import random
    rng = random.Random(seed)

    def cost(q: Any) -> float:
        return q.step_ms + (0.0 if q.fits else 1e4 + (q.peak_bytes - budget) / 1e6)

    cur = best = list(start)
    cq = bq = simulate(table, cur, budget=budget)
    temp = 5.0
    for _ in range(iters):
        trial = cur.copy()
        for _ in range(rng.randint(1, 3)):
            trial[rng.randrange(len(trial))] = rng.choice(ACTIONS)
        q = simulate(table, trial, budget=budget)
        d = cost(q) - cost(cq)
        if d < 0 or rng.random() < math.exp(-d / temp):
            cur, cq = trial, q
            if q.fits and (not bq.fits or q.step_ms < bq.step_ms):
                best, bq = trial, q
        temp = max(0.05, temp * 0.9995)
    return tuple(best)


def bounds(run: dict[str, Any], batches: list[int], search_iters: int = 0) -> list[dict[str, Any]]:
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
        bound = throughput_bound(t, budget)
        row: dict[str, Any] = {"batch": b, "over_b0": b / run["b0"], "model": bound.to_dict()}
        if fix is not None:
            row["time_scale"] = fix
            row["measured_times"] = throughput_bound(scaled(t, fix), budget).to_dict()
        if search_iters:   # the model's plans: the planner's greedy one, and the best a search finds from it
            plain = bound.step_ms   # the no-plan step
            greedy = plan_for_budget(t, budget)
            best = simulate(t, searched(t, budget, greedy.actions, search_iters), budget=budget)
            row["greedy_model_ratio"] = plain / greedy.step_ms if greedy.fits else 0.0
            row["searched_model_ratio"] = plain / best.step_ms if best.fits else 0.0
            row["search_iters"] = search_iters
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
    p.add_argument("--search-iters", type=int, default=0,
                   help="also plan each batch in the model: the greedy planner's plan and the best of a simulated "
                        "annealing from it over N steps (0: off; ~0.8 ms a step on ResNet-152's 52 units, "
                        "2-core CPU)")
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
    if a.search_iters < 0:
        p.error(f"--search-iters={a.search_iters}: allowed an integer >= 0")
    rows = bounds(run, batches, a.search_iters)
    d2h = run["bandwidth_bytes_per_s"]["d2h"] / 1e9
    print(f"{run.get('model')} {run.get('image')}px {run.get('amp')}, budget {run['budget_bytes'] / 2**30:.2f} GiB, "
          f"{run.get('device')}, {run.get('date')}; d2h {d2h:.1f} GB/s; B0 {run['b0']}")
    search_head = f" {'greedy model':>12} {'searched':>8}" if a.search_iters else ""
    print(f"{'batch':>6} {'xB0':>5} {'over GiB':>9} {'copy GiB':>9} {'recompute GiB':>13} {'bound':>6} "
          f"{'bound (measured times)':>23} {'plan measured':>14}{search_head}")
    for r in rows:
        m, s = r["model"], r.get("measured_times")
        print(f"{r['batch']:>6} {r['over_b0']:>5.2f} {m['over_bytes'] / 2**30:>9.2f} {m['copy_bytes'] / 2**30:>9.2f} "
              f"{m['recompute_bytes'] / 2**30:>13.2f} {m['ratio']:>6.3f} "
              f"{(format(s['ratio'], '.3f') + ' (x' + format(r['time_scale'], '.3f') + ')') if s else '':>23} "
              f"{format(r['measured_plan_ratio'], '.3f') if 'measured_plan_ratio' in r else '':>14}"
              + (f" {r['greedy_model_ratio']:>12.3f} {r['searched_model_ratio']:>8.3f}" if a.search_iters else ""))
    result = {"issue": 17, "benchmark": "offload_bound", "source": str(a.run),
              "date": _dt.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv]), "rows": rows}
    write_json(result, a.out)
    return result


if __name__ == "__main__":
    main()
