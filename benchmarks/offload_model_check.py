"""How well the swap planner's cost model (`triaccel.swap_plan.CostModel`, from the two tables a run of
`benchmarks/offload.py` measured) predicts that run's measured steps (#17): the no-plan step at B0, the
no-budget step at Bp and the planned step at Bp, modelled against measured, and the ratio the joint
choice of `offload="auto"` turns on: the plan at Bp's samples/s over no plan at B0's, modelled against
measured (above 1: the planned larger batch is worth it). Reads JSON, runs nothing on a GPU; prints a
table and writes JSON (default benchmarks/results/offload_model_check.json).

    python3 benchmarks/offload_model_check.py benchmarks/results/s53/call2/off/offload-bf16.json ...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from _results import print_table, run_meta, write_json
from offload_bound import cost_model

from triaccel.swap_plan import simulate

ROOT = Path(__file__).resolve().parents[1]


def check(run: dict[str, Any]) -> dict[str, Any]:
    """One run's row: modelled and measured step ms of its plain B0, no-budget Bp and planned Bp runs,
    and the plan-at-Bp over no-plan-at-B0 throughput ratio, modelled and measured."""
    model, runs = cost_model(run), run["runs"]
    b0, nobudget, plan = runs["plain_b0"], runs["nobudget_bp"], runs["plan_bp"]
    actions = run["plan_bp"]["actions"]   # {unit index: action} as offload.py writes it

    def modelled(batch: int, acts: list[str] | None) -> float:
        t = model.at(int(batch))
        return simulate(t, acts or ["keep"] * len(t.layers)).step_ms

    acts = [actions[str(i)] if isinstance(actions, dict) else actions[i] for i in range(len(actions))]
    row: dict[str, Any] = {"run": run.get("_path"), "amp": run.get("amp"), "device": run.get("device"),
                           "tables": "/".join(str(t["batch"]) for t in run["cost_tables"]), "b0": b0["batch"], "bp": plan["batch"]}
    for key, r, a in (("b0", b0, None), ("nobudget", nobudget, None), ("plan", plan, acts)):
        row[f"{key}_model_ms"] = modelled(r["batch"], a)
        row[f"{key}_measured_ms"] = r["step_s"] * 1e3
        row[f"{key}_ratio"] = row[f"{key}_model_ms"] / row[f"{key}_measured_ms"]
    row["choice_model"] = (plan["batch"] / row["plan_model_ms"]) / (b0["batch"] / row["b0_model_ms"])
    row["choice_measured"] = plan["samples_per_s"] / b0["samples_per_s"]
    row["choice_ratio"] = row["choice_model"] / row["choice_measured"]
    return row


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", type=Path, nargs="+", help="JSONs that benchmarks/offload.py (torch) wrote")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "offload_model_check.json")
    a = p.parse_args(argv)
    rows = []
    for path in a.runs:
        run = json.loads(path.read_text())
        missing = [k for k in ("cost_tables", "bandwidth_bytes_per_s", "runs", "plan_bp") if not run.get(k)]
        missing += [k for k in ("plain_b0", "nobudget_bp", "plan_bp") if k not in (run.get("runs") or {})]
        if missing:
            p.error(f"{path}: no {', '.join(map(repr, missing))} (not a torch benchmarks/offload.py result with a plan?)")
        rows.append(check({**run, "_path": str(path)}))
    print_table("the cost model against the measured steps (model / measured)", rows,
                [("tables", "tables", ">9"), ("B0", "b0", ">4d"), ("Bp", "bp", ">4d"),
                 ("no plan B0", "b0_ratio", ">10.2f"), ("no budget Bp", "nobudget_ratio", ">12.2f"),
                 ("plan Bp", "plan_ratio", ">7.2f"), ("choice model", "choice_model", ">12.2f"),
                 ("measured", "choice_measured", ">8.2f"), ("model/meas", "choice_ratio", ">10.2f"),
                 ("run", "run", "<0")])
    write_json({**run_meta("none (reads JSON)"), "rows": rows}, a.out)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
