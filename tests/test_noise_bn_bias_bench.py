"""benchmarks/noise_bn_bias.py: its two-size estimate, and one tiny run end to end on the CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import noise_bn_bias  # noqa: E402


def test_estimate_recovers_g2_and_trace_from_exact_expectations():
    g2, trace = 2.5, 640.0
    for b, B in ((8, 16), (64, 128), (3, 50)):
        e = noise_bn_bias.estimate(b, g2 + trace / b, B, g2 + trace / B)
        assert e["g2"] == pytest.approx(g2) and e["trace"] == pytest.approx(trace)
        assert e["b_noise"] == pytest.approx(trace / g2)
    assert noise_bn_bias.estimate(8, 10.0, 16, 10.0)["b_noise"] == 0.0            # no noise between the sizes
    assert noise_bn_bias.estimate(8, 30.0, 16, 10.0)["b_noise"] == float("inf")   # |G|^2 <= 0: no estimate


def test_bad_batch_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        noise_bn_bias.main(["--batch", "7"])
    assert "--batch=7" in capsys.readouterr().err


def test_tiny_run_writes_both_pairings(tmp_path, monkeypatch):
    data = ROOT.parent / "shared" / "data" / "cifar10-jpeg"
    if not data.is_dir():
        pytest.skip("CIFAR-10 not beside the checkout")
    monkeypatch.setattr(noise_bn_bias, "ROOT", tmp_path)
    out = noise_bn_bias.main(["--width", "0.125", "--batch", "8", "--batches", "2", "--data", str(data)])
    assert [r["pairing"].split()[0] for r in out["rows"]] == ["steps", "halves"]
    assert len(out["sq_big"]) == len(out["sq_mean_halves"]) == 2 and out["ratio_big"] > 0
    written = json.loads(next((tmp_path / "benchmarks" / "results").glob("noise_bn_bias-*.json")).read_text())
    assert written["batch"] == 8
    # without the classifier: smaller norms, the same batches, its own file
    fc = noise_bn_bias.main(["--width", "0.125", "--batch", "8", "--batches", "2", "--skip", "fc", "--data", str(data)])
    assert fc["skip"] == ["fc"] and all(x < y for x, y in zip(fc["sq_big"], out["sq_big"]))
    assert len(list((tmp_path / "benchmarks" / "results").glob("noise_bn_bias-*-no-fc-*.json"))) == 1
