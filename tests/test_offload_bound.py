"""benchmarks/offload_bound.py on a committed benchmarks/offload.py result (H200, bf16, 2026-11-27)."""

import json
from pathlib import Path

import pytest

import offload_bound
from triaccel.swap_plan import plan_for_budget, simulate, throughput_bound

RUN = Path(__file__).resolve().parents[1] / "benchmarks/results/s30/offload-remeasure/offload-bf16-remeasure.json"


def test_bounds_the_target_batch_and_the_measured_plan(tmp_path):
    out = offload_bound.main([str(RUN), "--out", str(tmp_path / "b.json")])
    rows = {r["batch"]: r for r in out["rows"]}
    assert sorted(rows) == [336, 432]                       # ceil(4.2 x 80) and the run's Bp
    for r in rows.values():
        assert 0.0 < r["measured_times"]["ratio"] < 1.0 and 0.0 < r["model"]["ratio"] < 1.0
        assert r["model"]["recompute_bytes"] == max(0, r["model"]["over_bytes"] - r["model"]["copy_bytes"])
    # a larger batch has more to free, in the same forward time per sample
    assert rows[432]["model"]["ratio"] < rows[336]["model"]["ratio"]
    assert rows[432]["measured_plan_ratio"] <= rows[432]["measured_times"]["ratio"]   # the plan run stays under it
    assert json.loads((tmp_path / "b.json").read_text())["rows"][0]["batch"] == 336


def test_scaled_times_and_the_measured_table():
    run = json.loads(RUN.read_text())
    model = offload_bound.cost_model(run)
    t = model.at(80)
    step = throughput_bound(t, run["budget_bytes"]).step_ms
    # the model's line through the two tables (slope and intercept kept >= 0) near the table measured at 80
    assert step == pytest.approx(sum(u["forward_ms"] + u["backward_ms"] for u in run["cost_tables"][1]["layers"])
                                 + run["cost_tables"][1]["other_ms"], rel=0.05)
    assert throughput_bound(offload_bound.scaled(t, 2.0), run["budget_bytes"]).step_ms == pytest.approx(2 * step)
    with pytest.raises(ValueError, match="factor"):
        offload_bound.scaled(t, 0.0)
    with pytest.raises(SystemExit):
        offload_bound.main([str(RUN), "--batch", "0", "--out", "/dev/null"])
    with pytest.raises(SystemExit):
        offload_bound.main([str(RUN), "--search-iters", "-1", "--out", "/dev/null"])


def test_search_keeps_a_fitting_plan_and_never_loses_to_its_start(tmp_path):
    run = json.loads(RUN.read_text())
    t, budget = offload_bound.cost_model(run).at(336), run["budget_bytes"]
    greedy = plan_for_budget(t, budget)
    best = simulate(t, offload_bound.searched(t, budget, greedy.actions, 300), budget=budget)
    assert greedy.fits and best.fits and best.step_ms <= greedy.step_ms
    argv = [str(RUN), "--batch", "336", "--search-iters", "50", "--out", str(tmp_path / "s.json")]
    row = offload_bound.main(argv)["rows"][0]
    assert row["greedy_model_ratio"] <= row["searched_model_ratio"] <= row["model"]["ratio"]
