"""What the first jax-triton kernel of a process costs: lowering time, torch import, cache effect.

jax-triton compiles a Triton kernel while JAX lowers the function that calls it, in every process
(it keeps the PTX in memory only); with Triton 3.6 its argument specializer also imports torch.
`triaccel.kernels.jax_triton_cache` keeps compilations on disk. This benchmark starts fresh
processes that each lower and run the gradient-moments kernel (with unscale, as the JAX update does)
over ResNet-18's parameter shapes and report: seconds to lower it, seconds to compile the XLA
executable, whether torch got imported, and the result's largest relative sumsq error against float64 sums on
the host (correct: the unscaled gradients exact and that error <= 1e-5 for the jax-triton kernel, or
<= 1e-2 for the `jnp` reference that runs without a GPU, whose FP32 `segment_sum` accumulates one
long sequence: 1.8e-3 measured on this set on a CPU).

Processes, one after the other, sharing one empty cache folder (``$TRIACCEL_CACHE``): with the disk
cache off (``TRIACCEL_JAX_TRITON_CACHE=0``), then `--runs` with it on (the first fills it).

    python benchmarks/jax_first_lowering.py            # GPU (jax-triton); on a CPU the jnp path runs

Writes benchmarks/results/jax-first-lowering/jax-first-lowering-<device>.json and prints a table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from _results import device_tag, write_json

ROOT = Path(__file__).resolve().parents[1]


def child() -> dict[str, Any]:
    """One fresh process's measurement (printed as one JSON line)."""
    t0 = time.perf_counter()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from triaccel.backends.jax.models import create_model
    from triaccel.kernels import grad_moments

    params = nnx.state(create_model("resnet18", num_classes=10), nnx.Param)
    rng = np.random.default_rng(0)
    grads = jax.tree_util.tree_map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)
    scale = jnp.full((1,), 0.5, jnp.float32)
    t_imports = time.perf_counter() - t0
    fn = jax.jit(lambda g, s: grad_moments(g, inv_scale=s))
    t1 = time.perf_counter()
    lowered = fn.lower(grads, scale)
    t2 = time.perf_counter()
    exe = lowered.compile()
    t3 = time.perf_counter()
    got, unscaled = exe(grads, scale)
    leaves = jax.tree_util.tree_leaves(grads)
    # float64 sums on the host: the yardstick for the kernel (XLA's fp32 segment sums are looser)
    exact = np.array([np.sum(np.square(np.asarray(a, np.float64) * 0.5)) for a in leaves])
    rel_err = float(np.max(np.abs(np.asarray(got.sumsq, np.float64) - exact) / exact))
    unscale_exact = bool(jnp.array_equal(jax.tree_util.tree_leaves(unscaled)[0], leaves[0] * 0.5))
    impl = "jax-triton" if jax.default_backend() == "gpu" else "jnp reference"
    same = unscale_exact and rel_err <= (1e-5 if impl == "jax-triton" else 1e-2)
    return {"backend": jax.default_backend(), "impl": impl, "device": str(jax.devices()[0].device_kind),
            "setup_s": t_imports, "lower_s": t2 - t1, "compile_s": t3 - t2,
            "torch_imported": "torch" in sys.modules, "sumsq_rel_err": rel_err,
            "unscale_exact": unscale_exact, "correct": same,
            "cache_files": len(list((Path(os.environ["TRIACCEL_CACHE"]) / "jax-triton").glob("*.json")))
            if os.environ.get("TRIACCEL_CACHE") else None}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="processes with the disk cache on (>= 1)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per process")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        print(json.dumps(child()), flush=True)
        return {}
    if args.runs < 1:
        ap.error(f"--runs={args.runs}: must be >= 1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="jax-first-lowering-") as cache:
        plan = [("cache off", "0")] + [(f"cache on, run {i + 1}", "1") for i in range(args.runs)]
        for label, switch in plan:
            env = dict(os.environ, TRIACCEL_CACHE=cache, TRIACCEL_JAX_TRITON_CACHE=switch)
            proc = subprocess.run([sys.executable, __file__, "--_child"], env=env, capture_output=True, text=True,
                                  timeout=args.timeout, cwd=ROOT)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode != 0 or not lines:
                raise SystemExit(f"{label}: the process failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            rows.append({"run": label, **json.loads(lines[-1])})
    device = rows[0]["device"]
    print(f"# jax_first_lowering  device={device}  backend={rows[0]['backend']}  "
          f"date={_dt.datetime.now().isoformat(timespec='seconds')}")
    print(f"{'run':<18}{'lower s':>9}{'compile s':>11}{'torch imported':>16}{'sumsq rel err':>15}{'correct':>9}{'cache files':>13}")
    for r in rows:
        print(f"{r['run']:<18}{r['lower_s']:>9.2f}{r['compile_s']:>11.2f}{str(r['torch_imported']):>16}"
              f"{r['sumsq_rel_err']:>15.2e}{str(r['correct']):>9}{str(r['cache_files']):>13}")
    result = {"benchmark": "jax_first_lowering", "device": device,
              "date": _dt.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "rows": rows}
    write_json(result, args.out or ROOT / "benchmarks" / "results" / "jax-first-lowering" /
               f"jax-first-lowering-{device_tag(device)}.json")
    return result


if __name__ == "__main__":
    main()
