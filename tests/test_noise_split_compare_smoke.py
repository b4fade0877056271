"""benchmarks/noise_split_compare.py on a few real images (CPU, torch): every split's run measures the
noise and gets its row; the trajectory and the summary are read from the demo's own records."""

from pathlib import Path

import pytest

import noise_split_compare as nsc

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10-jpeg"
pytestmark = pytest.mark.skipif(not DATA.exists(), reason=f"CIFAR-10 image folder not found at {DATA}")


def test_every_split_measures_and_is_summarised(tmp_path):
    rows = nsc.main(["--backend", "torch", "--device", "cpu", "--data", str(DATA), "--train-subset", "256",
                     "--epochs", "1", "--batch", "32", "--width", "0.125", "--t-ctrl", "2", "--warmup-steps", "2",
                     "--splits", "halves", "steps", "--out", str(tmp_path / "runs"), "--results", str(tmp_path)])
    assert [r["split"] for r in rows] == ["halves", "steps"]
    for r in rows:
        assert r["measurements"] >= 1 and r["steps"] >= 8 and r["trajectory"][0][0] == 0
    assert rows[1]["steps"] > rows[0]["steps"]   # the half steps are steps of their own
    assert (tmp_path / "noise_split_compare-torch-cpu.json").exists()


def test_summary_of_a_trajectory():
    traj = [(0, None), (2, 10.0), (4, 20.0), (6, 10.0), (8, -1.0)]
    row = nsc.summarise("steps", traj, {"report": {"noise_measurements": 3}, "steps": 9, "train_seconds": 1.0,
                                        "final_acc": 0.5})
    assert row["estimates"] == 3 and row["median_b_noise"] == 20.0 and row["measurements"] == 3
    assert row["median_log_jump"] == pytest.approx(0.6931, abs=1e-3)
