"""benchmarks/offload.py end to end on the CPU (bottleneck net, live-bytes peaks): the plan's cost model is
measured again at B0/2 and B0 once B0 is known (--remeasure on), or kept from --measure-batches (off); its
tables scaled to a step timed with no hook (--calibrate on) or not."""

from __future__ import annotations

import json

import offload
import pytest

ARGS = ["--device", "cpu", "--depths", "1,1,1,1", "--base-width", "8", "--image", "32", "--classes", "10",
        "--budget", "4MiB", "--steps", "1", "--max-batch", "32", "--multiple", "4", "--measure-batches", "2,4",
        "--lr-batch", "8", "--min-bytes", "0"]


@pytest.mark.parametrize("remeasure, calibrate", [("on", "off"), ("off", "on")])
def test_plan_model_measured_at_b0(tmp_path, remeasure, calibrate):
    out = tmp_path / "off.json"
    offload.main([*ARGS, "--remeasure", remeasure, "--calibrate", calibrate, "--out", str(out)])
    r = json.loads(out.read_text())
    b0 = r["b0"]
    assert b0 is not None and b0 >= 12 and r["bp"] is not None and r["bp"] > b0
    assert [t["batch"] for t in r["first_cost_tables"]] == [2, 4]
    want = [b0 // 2 // 4 * 4, b0] if remeasure == "on" else [2, 4]
    assert [t["batch"] for t in r["cost_tables"]] == want
    assert r["measured_peak_bp"] <= r["budget_bytes"]
