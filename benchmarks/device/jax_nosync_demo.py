"""Probe only (issue 15/16): the CIFAR demo with `elastic_step`'s wait for every micro-batch
(`jax.block_until_ready` in triaccel.backends.jax.data) made a no-op, to time what that wait costs
the JAX loop. NOT safe for training: on jax 0.11 an out-of-memory error surfaces only at the wait
(benchmarks/device/jax_oom_probe.py), so without it an OOM is not caught by the retry loop.

    python3 benchmarks/device/jax_nosync_demo.py --backend jax --method amp --batch 384 ...   # the demo's arguments
"""

import os
import runpy
import sys
import types

sys.path.insert(0, os.getcwd())

import jax  # noqa: E402

import triaccel.backends.jax.data as data  # noqa: E402

no_wait = types.SimpleNamespace(**{k: getattr(jax, k) for k in dir(jax) if not k.startswith("__")})
no_wait.block_until_ready = lambda x: x
data.jax = no_wait
sys.argv = ["train"] + sys.argv[1:]
runpy.run_module("examples.cifar.train", run_name="__main__")
