"""benchmarks/jax_first_lowering.py end to end on the CPU (the jnp path: jax-triton needs a GPU)."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")
_path = Path(__file__).resolve().parents[1] / "benchmarks" / "jax_first_lowering.py"
_spec = importlib.util.spec_from_file_location("jax_first_lowering", _path)
jax_first_lowering = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(jax_first_lowering)


def test_fresh_processes_report_lowering_and_match_the_reference(tmp_path, capsys):
    out = tmp_path / "r.json"
    res = jax_first_lowering.main(["--runs", "1", "--out", str(out)])
    assert [r["run"] for r in res["rows"]] == ["cache off", "cache on, run 1"]
    assert all(r["correct"] and r["lower_s"] > 0 for r in res["rows"])
    assert json.loads(out.read_text())["rows"] == res["rows"] and "lower s" in capsys.readouterr().out


def test_bad_runs_is_refused():
    with pytest.raises(SystemExit):
        jax_first_lowering.main(["--runs", "0"])
