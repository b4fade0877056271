"""benchmarks/climb_steps.py: the demo's controller driven by a given gradient noise scale."""

from __future__ import annotations

import json

import pytest
from climb_steps import main, simulate


def test_the_climb_follows_the_noise_law_and_a_static_batch_counts_as_static(tmp_path):
    # the defaults: measurements from step 100 every 50 steps, the EMA (beta 0.8) filled after 5,
    # then one rung per control decision (the demo's torch ladder: 96/192/512, no 384 rung)
    r = simulate("", 1000.0, 96, 512, 10, 50000)
    assert r["reached"] == {96: 0, 192: 350, 512: 400}
    assert simulate("--backend jax", 1000.0, 96, 512, 10, 50000)["reached"] == {96: 0, 192: 350, 384: 400, 512: 450}
    assert r["passes"] > r["steps"] and sum(r["samples_at"].values()) == 10 * 50000
    # batch_growth="jump": the first warm decision goes straight to the top rung the bound allows
    assert simulate("--set batch_growth=jump", 1000.0, 96, 512, 10, 50000)["reached"] == {96: 0, 512: 350}
    assert simulate("--set batch_growth=jump", 100.0, 96, 512, 2, 50000)["reached"] == {96: 0, 192: 350}
    # c x B_noise (c = 2 by default) below the next rung: the batch stays; at it, the batch grows
    assert set(simulate("", 90.0, 96, 512, 2, 50000)["reached"]) == {96}
    assert set(simulate("", 96.0, 96, 512, 2, 50000)["reached"]) == {96, 192}
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



def test_step_costs_price_the_passes(tmp_path):
    """--step-ms B:MS: passes priced by batch (linear between the given batches, held outside); a
    static run at the static batch costs exactly the static's time; bad entries are refused."""
    from climb_steps import pass_cost, static_ms

    cost = pass_cost({96: 7.0, 512: 19.0})
    assert cost(96) == 7.0 and cost(304) == 13.0 and cost(48) == 7.0 and cost(1024) == 19.0
    assert static_ms(cost, 512, 2, 5000) == 2 * (9 * 19.0 + cost(392))
    flat = simulate("--levers precision", 1000.0, 512, 512, 2, 5000, cost)
    assert flat["time_ms"] == static_ms(cost, 512, 2, 5000)
    out = main(["--b-noise", "1000", "--epochs", "2", "--step-ms", "96:7", "--step-ms", "512:19",
                "--out", str(tmp_path / "t.json")])
    row = out["rows"][0]
    assert row["time_vs_static"] == row["time_ms"] / out["static_ms"] > 1.0   # the climb's small batches cost more
    for bad in ("96", "0:5", "96:-1", "x:1"):
        with pytest.raises(SystemExit):
            main(["--step-ms", bad, "--out", str(tmp_path / "bad.json")])
