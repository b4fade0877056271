"""benchmarks/climb_steps.py: the demo's controller driven by a given gradient noise scale."""

from __future__ import annotations

import json

import pytest
from climb_steps import main, simulate


def test_the_climb_follows_the_noise_law_and_a_static_batch_counts_as_static(tmp_path):
    # the defaults: measurements from step 100 every 50 steps, the EMA (beta 0.8) filled after 5,
    # then one rung per control decision
    r = simulate("", 1000.0, 96, 512, 10, 50000)
    assert r["reached"] == {96: 0, 192: 350, 384: 400, 512: 450}
    assert r["passes"] > r["steps"] and sum(r["samples_at"].values()) == 10 * 50000
    # B_noise below the next rung: the batch stays
    assert set(simulate("", 150.0, 96, 512, 2, 50000)["reached"]) == {96}
    # no batch lever at the static batch: no noise steps, the static's passes exactly
    flat = simulate("--levers precision", 1000.0, 512, 512, 2, 5000)
    assert flat["passes"] == flat["steps"] == 2 * 10
    out = main(["--b-noise", "1000", "--variant", "", "--variant", "--set noise_beta=0.5", "--epochs", "2",
                "--out", str(tmp_path / "c.json")])
    assert [r["variant"] for r in out["rows"]] == ["", "--set noise_beta=0.5"]
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved["static_passes"] == 2 * 98 and saved["rows"][1]["passes"] < saved["rows"][0]["passes"]
    with pytest.raises(SystemExit):
        main(["--b-noise", "-1", "--out", str(tmp_path / "bad.json")])

