"""benchmarks/offload_model_check.py on committed benchmarks/offload.py results (H200 2026-11-27, H100 2026-12-07)."""

import json
from pathlib import Path

import pytest

import offload_model_check
from offload_bound import cost_model
from triaccel.swap_plan import simulate

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks/results"
RUNS = [RESULTS / "s30/offload-remeasure/offload-bf16-remeasure.json", RESULTS / "s53/call2/off/offload-bf16.json"]


def test_rows_hold_the_runs_measurements_beside_the_model(tmp_path):
    rows = offload_model_check.main([*map(str, RUNS), "--out", str(tmp_path / "c.json")])
    assert [r["bp"] for r in rows] == [432, 368] and [r["b0"] for r in rows] == [80, 80]
    for path, r in zip(RUNS, rows):
        run = json.loads(path.read_text())
        plain = run["runs"]["plain_b0"]
        assert r["b0_measured_ms"] == pytest.approx(plain["step_s"] * 1e3)
        t = cost_model(run).at(80)
        assert r["b0_model_ms"] == pytest.approx(simulate(t, ["keep"] * len(t.layers)).step_ms)
        assert r["choice_measured"] == pytest.approx(run["runs"]["plan_bp"]["samples_per_s"] / plain["samples_per_s"])
        assert r["choice_ratio"] == pytest.approx(r["choice_model"] / r["choice_measured"])
    # on 2026-12-07's H100 run no plan at B0 was measured faster than the plan at Bp; the model rates the plan higher
    assert rows[1]["choice_measured"] < 1.0 < rows[1]["choice_model"]
    assert json.loads((tmp_path / "c.json").read_text())["rows"][1]["bp"] == 368


def test_a_result_without_plan_runs_is_refused(tmp_path):
    run = json.loads(RUNS[0].read_text())
    del run["runs"]["plan_bp"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(run))
    with pytest.raises(SystemExit):
        offload_model_check.main([str(bad), "--out", str(tmp_path / "c.json")])
