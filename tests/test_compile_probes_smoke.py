"""The JAX compile probes of benchmarks/device (run on the GPU machine) on the CPU with --smoke: a row
per process, the table printed, the JSON written under $OUT."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# XLA's CPU backend without LLVM's optimisation passes (as tests/two_devices.py): these smoke runs check
# that every row is written, not how fast the CPU code is, and their compilations take less time
XLA_FAST = {"XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()}


@pytest.mark.parametrize("probe, rows, extra", [("jax_compile_pair_probe", 2, []),
                                               ("xla_options_probe", 2, ["--sets", "default", "threads1"])])
def test_probe_smoke(tmp_path, probe, rows, extra):
    env = {**os.environ, "OUT": str(tmp_path), "JAX_PLATFORMS": "cpu", **XLA_FAST}
    # width 1/8: the same programs' mechanics; a full-width bf16 step takes ~1 s on 2 CPU cores
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "device" / f"{probe}.py"), "--smoke", "--width", "0.125",
                        *extra],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads((tmp_path / f"{probe}.json").read_text())
    assert len(got) == rows and all("error" not in r for r in got)
    assert "# ResNet-18" in p.stdout


def test_child_row_reports_a_failure_and_a_timeout(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _results import child_row, print_table

    ok = child_row([sys.executable, "-c", "print('noise'); print('{\"a\": 1}')"], 60, "ok")
    assert ok["a"] == 1 and ok["stderr"] == ""
    assert "error" in child_row([sys.executable, "-c", "import sys; sys.exit(3)"], 60, "fails")
    assert child_row([sys.executable, "-c", "import time; time.sleep(5)"], 0.5, "slow")["error"].startswith("timeout")
    print_table("t", [{"x": 1.25, "n": "a"}], [("x s", "x", ">5.1f"), ("name", "n", ">4")])
    out = capsys.readouterr().out.splitlines()
    assert out[-3:] == ["# t", "  x s name", "  1.2    a"]


def test_drift_probe_profiles_two_windows_of_a_demo_run(tmp_path):
    """benchmarks/device/jax_drift_probe.py on a tiny CPU demo run: one cProfile per window, the
    collector's time per generation, and the functions compared between the first and last window."""
    data = ROOT.parent / "shared" / "data" / "cifar10-jpeg"   # beside the repository, as CI has it
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), **XLA_FAST}
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "device" / "jax_drift_probe.py"), "--windows", "2:4,6:8",
                        "--top", "5", "--json", str(tmp_path / "drift.json"), "--", "--backend", "jax", "--method",
                        "triaccel", "--levers", "precision", "--device", "cpu", "--epochs", "1", "--train-subset", "320",
                        "--test-subset", "64", "--width", "0.125", "--batch", "32", "--batch-max", "32", "--data",
                        str(data), "--no-progress", "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    windows = json.loads((tmp_path / "drift.json").read_text())
    assert list(windows) == ["2:4", "6:8"] and all(windows.values())
    assert "window (6, 8):" in p.stdout and "ms/step first" in p.stdout


def test_step_gaps_finds_each_backends_boundary_step():
    """The torch wrapper reads its statistics at the end of the step that fills the ring (k = t_ctrl - 1
    mod t_ctrl), the JAX loop before step k = 0 mod t_ctrl: the boundary's gap is looked for there."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "device"))
    from step_gaps import boundary_cost, boundary_step

    assert boundary_step("torch", 50) == 49 and boundary_step("jax", 50) == 0
    # 10 ms boundaries at steps 4 and 9 (t_ctrl 5), 2 ms elsewhere
    t, steps = 0.0, []
    for k in range(12):
        t += 0.010 if k % 5 == 4 else 0.002
        steps.append({"step": k, "host_s": t})
    n, med, excess = boundary_cost(steps, 5, boundary_step("torch", 5))
    assert n == 2 and med == pytest.approx(0.010) and excess == pytest.approx(0.016)
    assert boundary_cost(steps, 5, boundary_step("jax", 5))[1] == pytest.approx(0.002)


def test_fused_steps_probe_smoke_and_its_scan_matches_single_steps(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "JAX_PLATFORMS": "cpu", **XLA_FAST}
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "device" / "jax_fused_steps_probe.py"), "--smoke",
                        "--width", "0.125"], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads((tmp_path / "jax_fused_steps_probe.json").read_text())
    assert [r["variant"] for r in rows] == ["small", "floor", "scan"] and all(r["ms_per_step"] > 0 for r in rows)
    assert rows[1]["vs_floor"] == 1.0 and rows[2]["steps"] == 4
    assert rows[2]["max_abs_diff"] < 1e-4   # FP32: the scan is the single steps' arithmetic
    assert "# ResNet-18" in p.stdout
