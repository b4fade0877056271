"""benchmarks/jax_update_compile.py on the CPU, tiny: every variant compiles and runs the update."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import jax_update_compile  # noqa: E402


@pytest.mark.parametrize("variant,noise", [("plain", False), ("auto", True)])
def test_a_variant_is_timed(variant, noise):
    r = jax_update_compile.one("resnet18", 0.0625, variant, noise, 1)
    assert r["variant"] == variant and r["noise"] == noise
    assert r["leaves"] == 62 and r["compile_s"] > 0 and r["call_ms"] > 0 and r["fusions"] >= 1


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        jax_update_compile.main(["--calls", "0"])
    assert "--calls=0: allowed >= 1" in capsys.readouterr().err
