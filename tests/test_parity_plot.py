"""benchmarks/parity_plot.py on two synthetic demo runs with known differences, written by RunLog."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from examples.cifar.common import RunLog, RunOptions, options_record
from triaccel import Controller, Decision, Precision, TriAccelConfig

LAYERS = ["conv1", "bn1", "layer1.conv", "fc"]


def _load_module() -> Any:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "parity_plot.py"
    spec = importlib.util.spec_from_file_location("parity_plot", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["parity_plot"] = mod  # dataclasses resolve the module of their class
    spec.loader.exec_module(mod)
    return mod


pp = _load_module()


def _decision(step: int, precisions: str, lr_scales: list[float], lr_batch_scale: float, batch: int,
              lam: list[float | None]) -> dict[str, Any]:
    d = Decision(step=step, precisions=tuple(Precision.parse(p) for p in precisions.split()),
                 lr_scales=np.array(lr_scales), lr_batch_scale=lr_batch_scale, batch_size=batch,
                 accumulation=1, logical_batch=batch)
    return {"event": "decide", **d.to_dict(), "lambda_max": lam}


def _write_run(out: Path, layers: list[str], batches: list[int], decisions: list[dict[str, Any]],
               accs: list[float], backend: str) -> None:
    """Two epochs: the first half of `batches` (one per step) in epoch 1, the rest in epoch 2."""
    opts = RunOptions(backend=backend, width=0.125, epochs=2, out=str(out))
    ctl = Controller(TriAccelConfig(batch_init=batches[0]), layers)
    log = RunLog(out / "log.jsonl")
    log.write("run", options=options_record(opts))
    log.write("layers", names=layers)
    half = len(batches) // 2
    for epoch, (lo, hi) in enumerate([(0, half), (half, len(batches))]):
        records = [dict(step=s, epoch=epoch, batch_size=batches[s], samples=batches[s], ooms=0, lr=0.1,
                        mem_used=None) for s in range(lo, hi)]
        # The epoch's decisions go through the controller's telemetry, as in the demo loops.
        for d in decisions:
            if (d["step"] >= half) == bool(epoch):
                ctl.telemetry.append(d)
        log.end_epoch(ctl, epoch, records, [2.0] * (hi - lo), accs[epoch], 1.0, hi)
    log.close()
    (out / "summary.json").write_text(json.dumps({"final_acc": accs[-1], "accs": accs, "final_batch": batches[-1]}))


# A: batch 32 for 4 steps, then 64 (8 steps, 384 samples); B: 32 for 2 steps, then 64 (7 steps, 384 samples).
BATCH_A = [32] * 4 + [64] * 4
BATCH_B = [32] * 2 + [64] * 5
DEC_A = [
    _decision(0, "fp32 fp32 bf16 bf16", [1, 1, 1, 1], 1.0, 32, [None] * 4),
    _decision(4, "fp32 fp32 bf16 bf16", [1, 1, 1, 1], 1.0, 64, [None] * 4),
    # A curvature re-decision of step 4: this last record is the one in force.
    _decision(4, "fp32 fp32 bf16 bf16", [1, 0.5, 1, 1], 1.0, 64, [1.0, 2.0, 3.0, 4.0]),
    _decision(8, "fp32 fp32 fp16 fp16", [1, 1, 1, 1], 2.0, 64, [1.0, 2.0, 3.0, 4.0]),
]
DEC_B = [
    _decision(0, "fp32 fp32 bf16 bf16", [1, 1, 1, 1], 1.0, 32, [None] * 4),
    _decision(4, "fp32 fp32 bf16 fp32", [1, 0.375, 1, 1], 1.0, 64, [1.5, 2.0, 3.0, 4.0]),
    _decision(6, "fp32 fp32 bf16 fp32", [1, 0.375, 1, 1], 1.0, 64, [1.5, 2.0, 3.0, 4.0]),
    _decision(8, "fp32 fp32 bf16 bf16", [1, 1, 1, 1], 1.0, 64, [1.5, 2.0, 3.0, 4.0]),
]


@pytest.fixture()
def runs(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "torch", tmp_path / "jax"
    _write_run(a, LAYERS, BATCH_A, DEC_A, [0.5, 0.875], "torch")
    _write_run(b, LAYERS, BATCH_B, DEC_B, [0.5, 0.8125], "jax")
    return a, b


def test_compare_numbers(runs: tuple[Path, Path]) -> None:
    a, b = (pp.load_run(r) for r in runs)
    assert [d["step"] for d in a.decisions] == [0, 4, 8]
    r = pp.compare(a, b)
    acc = r["accuracy"]
    assert (acc["final_a"], acc["final_b"], acc["diff_points"]) == (87.5, 81.25, 6.25)
    assert (acc["per_epoch_a"], acc["per_epoch_b"]) == ([50.0, 87.5], [50.0, 81.25])

    dec = r["decisions"]
    assert (dec["steps_a"], dec["steps_b"]) == ([0, 4, 8], [0, 4, 6, 8])
    common = dec["common"]
    assert [c["step"] for c in common] == [0, 4, 8]
    assert [c["precision_agreement"] for c in common] == [1.0, 0.75, 0.5]
    assert [c["disagreeing_layers"] for c in common] == [[], ["fc"], ["layer1.conv", "fc"]]
    assert [(c["batch_a"], c["batch_b"]) for c in common] == [(32, 32), (64, 64), (64, 64)]
    # step 4: layer bn1 0.5 vs 0.375 -> 0.125 / 0.5; step 8: batch scale 2 vs 1 -> 1 / 2.
    assert [c["lr_max_rel_diff"] for c in common] == [0.0, 0.25, 0.5]
    assert dec["precision_agreement"] == 9 / 12
    assert dec["lr_max_rel_diff"] == 0.5

    bt = r["batch"]
    assert bt["a"] == {"samples": [0, 32, 64, 96, 128, 192, 256, 320], "batch_size": BATCH_A, "samples_total": 384}
    assert bt["b"] == {"samples": [0, 32, 64, 128, 192, 256, 320], "batch_size": BATCH_B, "samples_total": 384}
    assert bt["aligned"] == {"samples": [0, 32, 64, 96, 128, 192, 256, 320],
                             "batch_a": [32, 32, 32, 32, 64, 64, 64, 64],
                             "batch_b": [32, 32, 64, 64, 64, 64, 64, 64]}
    # They differ on samples [64, 128) of 384.
    assert bt["agreement"] == 320 / 384
    assert (bt["final_a"], bt["final_b"]) == (64, 64)


def test_main_writes_png_json_and_table(runs: tuple[Path, Path], tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_png = tmp_path / "out" / "p.json", tmp_path / "out" / "p.png"
    result = pp.main([str(runs[0]), str(runs[1]), "--out-json", str(out_json), "--out-png", str(out_png)])
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 20_000
    saved = json.loads(out_json.read_text())
    assert saved["accuracy"] == result["accuracy"] and saved["decisions"] == result["decisions"]
    assert "benchmarks/parity_plot.py" in saved["command"] and saved["date"]
    row = capsys.readouterr().out.splitlines()
    assert "| resnet18 w0.125 cifar10 triaccel | torch / jax | 87.50 / 81.25 | +6.25 | 75.0% | 64 / 64 |" in row


@pytest.mark.parametrize("names_b, message", [
    (["conv1", "bn1", "layer1.conv", "head"], "at index 3 run 'a' has 'fc', run 'b' has 'head'"),
    (["conv1", "bn1", "layer1.conv"], "at index 3 run 'a' has 'fc', run 'b' has nothing"),
])
def test_layer_mismatch_raises(tmp_path: Path, names_b: list[str], message: str) -> None:
    _write_run(tmp_path / "a", LAYERS, BATCH_A, DEC_A[:1], [0.5, 0.5], "torch")
    dec_b = [_decision(0, " ".join(["fp32"] * len(names_b)), [1] * len(names_b), 1.0, 32, [None] * len(names_b))]
    _write_run(tmp_path / "b", names_b, BATCH_B, dec_b, [0.5, 0.5], "jax")
    with pytest.raises(ValueError, match=message):
        pp.compare(pp.load_run(tmp_path / "a"), pp.load_run(tmp_path / "b"))


def test_summary_over_seed_pairs(tmp_path, capsys):
    def comparison(seed: int, fa: float, fb: float, agree: float) -> dict[str, Any]:
        runs = {k: {"name": n, "options": {"seed": seed}} for k, n in (("a", "torch"), ("b", "jax"))}
        return {"runs": runs, "accuracy": {"final_a": fa, "final_b": fb, "diff_points": fa - fb},
                "decisions": {"precision_agreement": agree}}

    comps = [comparison(0, 84.0, 83.0, 0.9), comparison(1, 85.0, 84.8, 0.95), comparison(2, 86.0, 85.6, 1.0)]
    res = pp.summarize(comps)
    assert res["mean_a"] == pytest.approx(85.0) and res["std_a"] == pytest.approx(1.0)
    assert res["mean_b"] == pytest.approx(84.4667, abs=1e-4)
    assert res["diff_of_means"] == pytest.approx(85.0 - 84.4667, abs=1e-4)
    assert res["within_half_point"] == 2 and res["count"] == 3
    paths = []
    for i, c in enumerate(comps):
        paths.append(tmp_path / f"c{i}.json")
        paths[-1].write_text(json.dumps(c))
    out = tmp_path / "summary.json"
    pp.main(["--summary", *map(str, paths), "--out-json", str(out)])
    assert json.loads(out.read_text())["within_half_point"] == 2
    assert "| mean | 85.00 +- 1.00 | 84.47 +- 1.33 | +0.53 | 2 of 3 within 0.5 |" in capsys.readouterr().out
    with pytest.raises(ValueError, match="at least one"):
        pp.summarize([])
    with pytest.raises(SystemExit):
        pp.main([str(paths[0])])             # one run directory alone
