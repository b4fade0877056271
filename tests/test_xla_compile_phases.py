"""benchmarks/xla_compile_phases.py: XLA's timer lines summed by label, and a real compilation's
timers read back through the tool on the CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import xla_compile_phases as xcp  # noqa: E402


def test_parse_sums_by_label_and_skips_other_lines():
    lines = ["I1203 18:58:35.279 2029 hlo_pass_pipeline.cc:176] HLO pass: fusion time: 250 us (250 us) (cumulative: 1 ms, max: 1 ms, #called: 3)",
             "I1203 18:58:35.280 2029 hlo_pass_pipeline.cc:176] HLO pass: fusion time: 1.5 ms (1500 us) (cumulative: 2 ms, max: 1 ms, #called: 4)",
             "I1203 18:58:36.000 2029 gpu_compiler.cc:99] GpuCompiler::RunBackend for jit_f time: 2.25 s (2250000 us) (cumulative: 2.25 s, max: 2.25 s, #called: 1)",
             "I1203 18:58:36.001 2029 gpu_compiler.cc:99] Compilation finished",
             "an unrelated line with time: 3 s ("]
    got = xcp.parse(lines)
    assert set(got) == {"HLO pass: fusion", "GpuCompiler::RunBackend for jit_f"}
    assert abs(got["HLO pass: fusion"]["s"] - 1.75e-3) < 1e-12 and got["HLO pass: fusion"]["calls"] == 2
    assert got["GpuCompiler::RunBackend for jit_f"] == {"s": 2.25, "calls": 1}


def test_a_cpu_compilation_is_timed(tmp_path, capsys):
    prog = "import jax, jax.numpy as jnp; jax.jit(lambda x: jnp.sin(x) * 2).lower(jnp.ones(8)).compile()"
    labels = xcp.main(["--name", "t", "--out", str(tmp_path), "--", sys.executable, "-c", prog])
    assert any(k.startswith("HLO pass: ") for k in labels) and all(v["s"] >= 0 for v in labels.values())
    saved = json.loads((tmp_path / "xla_compile_phases-t.json").read_text())
    assert saved["labels"] == labels and saved["wall_s"] > 0
    assert "timer labels" in capsys.readouterr().out


def test_a_failing_command_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="exited 3"):
        xcp.main(["--out", str(tmp_path), "--", sys.executable, "-c", "import sys; sys.exit(3)"])
    with pytest.raises(SystemExit, match="usage"):
        xcp.main(["--name", "x"])


def test_diff_groups_numbered_instructions_and_sorts_by_excess(tmp_path, capsys):
    def saved(name, labels):
        p = tmp_path / name
        p.write_text(json.dumps({"labels": labels}))
        return p

    a = saved("a.json", {"IR emission for cudnn-conv.20": {"s": 1.0, "calls": 2}, "HLO pass: fusion": {"s": 0.5, "calls": 1}})
    b = saved("b.json", {"IR emission for cudnn-conv.20": {"s": 1.0, "calls": 2}, "IR emission for cudnn-conv.21": {"s": 2.0, "calls": 3},
                         "HLO pass: fusion": {"s": 0.25, "calls": 1}, "Compile PTX": {"s": 0.5, "calls": 4}})
    rows = xcp.main(["--diff", str(a), str(b), "--top", "5"])
    assert [r[0] for r in rows] == ["IR emission for cudnn-conv", "Compile PTX", "HLO pass: fusion"]
    assert rows[0][1] == {"s": 1.0, "calls": 2} and rows[0][2] == {"s": 3.0, "calls": 5}
    assert rows[1][1] == {"s": 0.0, "calls": 0}
    assert "b - a" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        xcp.main(["--diff", str(a), str(b), "--top", "0"])
