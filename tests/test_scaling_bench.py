"""benchmarks/scaling.py's step-gap figure."""

from __future__ import annotations

import pytest


def test_scaling_median_step_skips_epoch_boundaries():
    """benchmarks/scaling.py: the median step from the step records' host_s within each epoch."""
    from scaling import median_step_ms

    recs = [{"type": "run"}, *({"type": "step", "epoch": 0, "host_s": t} for t in (0.5, 0.51, 0.52)),
            *({"type": "step", "epoch": 1, "host_s": t} for t in (0.2, 0.21, 0.23, 0.5)),
            {"type": "epoch", "epoch": 1}]
    assert median_step_ms(recs, [1]) == pytest.approx(20.0)     # gaps 10, 20, 270 ms: not epoch 0's
    assert median_step_ms(recs, [0, 1]) == pytest.approx(10.0)  # 10, 10, 10, 20, 270
    assert median_step_ms(recs, [2]) is None
