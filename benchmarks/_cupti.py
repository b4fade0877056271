"""CUDA kernel records from CUPTI through torch.profiler, which also sees the kernels JAX launches in the
same process: one clock for both frameworks (benchmarks/kernels.py, benchmarks/device/jax_dp_probe.py)."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Callable


def cuda_trace_events(run: Callable[[], Any]) -> list[dict[str, Any]]:
    """The chrome-trace events (``cat`` "kernel", "gpu_memset", ...; ``ts``/``dur`` in us, ``args.device``)
    of everything `run()` puts on CUDA devices; `run` should synchronise before it returns."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            return json.load(fh)["traceEvents"]
