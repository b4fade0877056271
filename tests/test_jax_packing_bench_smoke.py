"""benchmarks/jax_packing.py on the CPU, tiny: both forms of the state train the same step."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import jax_packing  # noqa: E402


def test_both_forms_time_the_same_state():
    apart = jax_packing.one("resnet18", 0.0625, 2, False, 1)
    packed = jax_packing.one("resnet18", 0.0625, 2, True, 1)
    assert apart["leaves"] == packed["leaves"] == apart["buffers"] > packed["buffers"] >= 1
    assert apart["first_call_s"] > 0 and packed["step_ms"] > 0
    # the wrapped update carries the TriAccel state: more leaves, still packed into fewer buffers
    wrapped = jax_packing.one("resnet18", 0.0625, 2, True, 1, update="triaccel")
    assert wrapped["update"] == "triaccel" and wrapped["leaves"] > packed["leaves"]
    assert wrapped["buffers"] < wrapped["leaves"]


def test_bad_arguments_are_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["jax_packing.py", "--batch", "0"])
    with pytest.raises(SystemExit):
        jax_packing.main()
    assert "--batch=0: allowed >= 1" in capsys.readouterr().err
