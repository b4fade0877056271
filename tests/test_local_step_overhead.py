"""benchmarks/local_step_overhead.py on the CPU: the graphed loop runs through its stand-in replay."""

from __future__ import annotations

import json

import pytest
import local_step_overhead as lso


def test_runs_and_counts_every_replayed_step(tmp_path):
    out = lso.main(["--samples", "300", "--batch", "64", "--epochs", "2", "--fixed-batch",
                    "--out", str(tmp_path / "r.json")])
    assert [r["fetch"] for r in out["rows"]] == ["augmented", "fixed batch"]
    for r in out["rows"]:
        # 5 steps per epoch (4 full, 1 short); 3 warm-ups, the short batches run eagerly
        assert r["steps_per_epoch"] == 5 and r["graph_steps"] == 2 * 4 - 3 and r["us_per_step"] > 0
    assert json.loads((tmp_path / "r.json").read_text())["meta"]["samples"] == 300
    with pytest.raises(SystemExit):
        lso.main(["--epochs", "1"])
