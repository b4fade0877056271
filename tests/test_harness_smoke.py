"""benchmarks/harness.py's JAX plain loop on the CPU: it trains (one jitted program per step, the last
batch of an epoch shorter), and the torch.compile variants are refused for --backend jax."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import harness
import pytest

DATA = Path(__file__).resolve().parents[2] / "shared/data/cifar10-jpeg"


def test_jax_plain_loop_trains():
    a = argparse.Namespace(data=str(DATA), train_subset=80, model="resnet18", width=0.125, seed=0, batch=32,
                           epochs=2)
    res = harness.plain_loop_jax(a)
    assert len(res["epoch_seconds"]) == 2 and all(t > 0 for t in res["epoch_seconds"])
    assert math.isfinite(res["last_loss"]) and 0 < res["last_loss"] < 10


def test_compiled_variants_refused_for_jax(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["harness.py", "--backend", "jax", "--variants", "plain", "amp-compiled"])
    with pytest.raises(SystemExit):
        harness.main()
    assert "--variants amp-compiled" in capsys.readouterr().err
