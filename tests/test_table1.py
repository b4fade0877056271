"""benchmarks/table1.py's table: time to AMP's accuracy, the long row, cells per method."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

_path = Path(__file__).resolve().parents[1] / "benchmarks" / "table1.py"
_spec = importlib.util.spec_from_file_location("table1", _path)
t1 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(t1)


def _run(method: str, seed: int, accs: list[float], secs: list[float]) -> dict:
    return {"model": "resnet18", "method": method, "seed": seed, "final_acc": accs[-1], "accs": accs,
            "epoch_seconds": secs, "s_per_epoch_median_last5": secs[-1], "peak_alloc_bytes": 10**9,
            "final_batch": 96}


def test_seconds_to_accuracy_is_cumulative_until_first_hit():
    run = _run("x", 0, [0.5, 0.86, 0.85, 0.9], [4.0, 2.0, 2.0, 2.0])
    assert t1.seconds_to_accuracy(run, 0.86) == 6.0
    assert t1.seconds_to_accuracy(run, 0.95) is None


def test_table_reports_time_to_amp_accuracy_against_amp_wall():
    rows = [_run("FP32", 0, [0.5, 0.8], [5.0, 5.0]),
            _run(t1.AMP, 0, [0.6, 0.80], [5.0, 5.0]), _run(t1.AMP, 1, [0.6, 0.84], [5.0, 5.0]),
            _run(t1.FULL, 0, [0.7, 0.79], [2.0, 2.0]), _run(t1.FULL, 1, [0.7, 0.83], [2.0, 2.0]),
            _run(t1.long_row(3), 0, [0.6, 0.83, 0.9], [2.0, 2.0, 2.0]),
            _run(t1.long_row(3), 1, [0.6, 0.75, 0.85], [2.0, 2.0, 2.0]),
            {"model": "resnet18", "method": t1.FULL, "seed": 2, "failed": 1}]
    cells = {c["method"]: c for c in t1.table(rows)}
    assert list(cells) == ["FP32", t1.AMP, t1.FULL, t1.long_row(3)]
    amp = cells[t1.AMP]                      # target: mean final 0.82; seed 0 never reaches it
    assert amp["seconds_to_amp_acc"] is None and amp["wall_s"] == 10.0
    assert cells[t1.FULL]["seconds_to_amp_acc"] is None and cells[t1.FULL]["seeds"] == 2
    long = cells[t1.long_row(3)]             # seeds reach 0.82 after 4 s and 6 s: median 5
    assert long["seconds_to_amp_acc"] == 5.0 and long["to_amp_acc_vs_amp_wall"] == pytest.approx(0.5)
    assert long["epochs"] == [3, 3] and long["acc_mean"] == pytest.approx(87.5)


def test_long_row_runs_the_full_method_for_its_epochs():
    args = argparse.Namespace(long_epochs=14, epochs=10)
    assert t1.row_options(t1.long_row(14), args) == (t1.METHODS[t1.FULL], 14)
    assert t1.row_options(t1.AMP, args) == (t1.METHODS[t1.AMP], 10)


def test_static_sweep_names_best_and_fastest_static():
    rows = [_run(t1.AMP, 0, [0.5, 0.873], [4.8, 4.8]), _run("AMP bs 192", 0, [0.5, 0.872], [2.5, 2.5]),
            _run("AMP bs 384", 0, [0.5, 0.869], [1.4, 1.4]), _run("AMP bs 512", 0, [0.5, 0.852], [1.2, 1.2]),
            _run(t1.TRIACCEL, 0, [0.5, 0.871], [2.0, 2.0])]
    rows[-1]["flop_share"] = {"fp16": 0.0, "bf16": 0.95, "fp32": 0.05}
    cells = {c["method"]: c for c in t1.table(rows)}
    tri = cells[t1.TRIACCEL]
    assert tri["best_static"] == t1.AMP and tri["fastest_static"] == "AMP bs 192"   # 384 is 0.4 below
    assert tri["acc_vs_best_static"] == pytest.approx(-0.2)
    assert tri["wall_vs_fastest_static"] == pytest.approx(4.0 / 5.0)
    assert tri["sixteen_bit_min"] == pytest.approx(0.95)
    assert t1.METHODS["AMP bs 384"] == ["--method", "amp", "--batch", "384"]
