"""Shared by the local-learning tests of both backends: the demo's `--method local` on a tiny synthetic CIFAR."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def run_local_demo(tmp_path: Path, backend: str, block_inputs: str, options: dict[str, Any] | None = None,
                   **local: Any) -> dict[str, Any]:
    """examples.cifar.local_loop.train (CPU, 6 MiB budget, 1 epoch, width 1/16) -> its summary; the
    run's log is tmp_path/log.jsonl. options: more RunOptions fields; local: more of the demo's local
    options (LOCAL_DEFAULTS' keys)."""
    from examples.cifar.common import RunLog, RunOptions
    from examples.cifar.datasets import CifarArrays
    from examples.cifar.local_loop import train

    rng = np.random.default_rng(0)
    data = CifarArrays(rng.integers(0, 256, (32, 32, 32, 3), dtype=np.uint8), rng.integers(0, 4, 32),
                       rng.integers(0, 256, (16, 32, 32, 3), dtype=np.uint8), rng.integers(0, 4, 16), 4,
                       (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    opts = RunOptions(method="local", backend=backend, epochs=1, batch=16, lr=0.05, width=0.0625, budget="6MiB",
                      batch_max=16, device="cpu", out=str(tmp_path), progress=False, **(options or {}))
    opts.local = {"exit_tolerance": 0.5, "max_blocks": 3, "cache_views": 1, "block_batch": None,
                  "block_inputs": block_inputs, **local}
    log = RunLog(tmp_path / "log.jsonl")
    try:
        return train(opts, data, log, None)
    finally:
        log.close()


def check_block_inputs(summary: dict[str, Any], block_inputs: str) -> None:
    """The plan in the summary reads its blocks' inputs as asked: no views and "fresh" blocks, or caches."""
    fresh = block_inputs == "fresh"
    # seconds outside training are accounted: exit evaluations ran (each epoch and at the end)
    assert summary["exit_eval_seconds"] > 0 and summary["probe_seconds"] >= 0
    assert summary["plan"]["cache_views"] == (0 if fresh else 1)
    assert all((b["input_cache"] == "fresh") == fresh for b in summary["plan"]["blocks"][1:])
