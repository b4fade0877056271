"""Helpers for tests that need two JAX devices on the CPU: XLA fixes its host device count when jax
starts, and the pytest process may have started it already, so such runs happen in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Two host devices, and XLA's CPU backend without LLVM's optimisation passes: these runs compare runs with
# runs under the same flags, and their compilations take less time (2-core machine, 2026-12-02: the per-device
# demo test 118 -> 87 s, the dp probe loops 93 -> 72 s). Not for the in-process tests: unoptimised CPU
# reductions round differently (a JAX-against-torch statistics check failed at rtol 1e-4 under it).
ENV = {**os.environ, "JAX_PLATFORMS": "cpu",
       "XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"}


def run(args: list[str], timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python args...` from the repository root with two CPU devices (and `env` on top); asserts exit
    status 0."""
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env={**ENV, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def run_demo(args: list[str], timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The CIFAR demo (`python -m examples.cifar.train args...`) as `run` runs it, asserting exit status 0
    (the demo cancels its queued background compilations when the run ends: `SplitStep.close`)."""
    return run(["-m", "examples.cifar.train", *args], timeout, env)


def worker_result(script: str, timeout: float = 300) -> dict:
    """The JSON a test module prints on its last line when run as a script with two CPU devices."""
    return json.loads(run([script], timeout).stdout.strip().splitlines()[-1])


def value_error(fn) -> str:
    """The message of the ValueError `fn()` raises ("no error" when it raises none): for workers
    that report errors in their JSON."""
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return "no error"
