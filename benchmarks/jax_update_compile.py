"""What the triaccel wrapper adds to a JAX optimizer update, per gradient-moments implementation: the
update alone (plain SGD with momentum, the demo's, against it wrapped by `TriAccel` with
`TriAccelConfig(kernels=...)`), jitted over a model's parameters, each variant in its own process (no
shared compilation caches): XLA's compilation seconds, the fusions in the optimized program (on a GPU
each is at least one kernel launch) and the median call time.

    python3 benchmarks/jax_update_compile.py --model resnet18 --width 0.5       # CPU here, or a GPU

Variants: plain (no wrapper), and the wrapper with kernels auto (under JAX: XLA's per-array reductions,
"xla"), triton (jax-triton, GPU only) and reference, without the
batch lever (no noise halves in the update) or, with --noise, with them (a noise step's first half).
Prints a table and writes benchmarks/results/jax_update_compile-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import device_tag, fresh_process_row, run_meta, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ("auto", "triton", "reference")   # "xla" is what "auto" runs under JAX


def one(model_name: str, width: float, variant: str, noise: bool, calls: int,
        options: dict[str, Any] | None = None) -> dict[str, Any]:
    """variant: "plain" or a `TriAccelConfig.kernels` value. options: XLA compiler options for the
    update's compilation (`Lowered.compile(compiler_options=...)`)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from examples.cifar.common import RunOptions
    from examples.cifar.jax_loop import _sgd
    from triaccel import TriAccelConfig
    from triaccel.backends.jax import TriAccel
    from triaccel.backends.jax.models import create_model

    model = create_model(model_name, num_classes=10, width=width, seed=0)
    params = nnx.state(model, nnx.Param)
    kw: dict[str, Any] = {}
    if variant == "plain":
        tx = _sgd(0.1, RunOptions())
    else:
        ta = TriAccel(TriAccelConfig(elastic_batch=noise, kernels=variant), model, noise_in_update=noise)
        tx = ta.wrap(_sgd(0.1, RunOptions()))
        if noise:
            kw = {"noise_part": jnp.int32(1), "noise_samples": jnp.float32(8.0)}
    state = tx.init(params)
    keys, extra = list(kw), list(kw.values())   # arguments of the program, not constants folded into it
    fn = jax.jit(lambda g, s, p, *e: tx.update(g, s, p, **dict(zip(keys, e))))
    t0 = time.perf_counter()
    lowered = fn.lower(params, state, params, *extra)
    t1 = time.perf_counter()
    compiled = lowered.compile(compiler_options=options or None)
    t2 = time.perf_counter()
    hlo = compiled.as_text()
    jax.block_until_ready(compiled(params, state, params, *extra))
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        jax.block_until_ready(compiled(params, state, params, *extra))
        times.append(time.perf_counter() - t)
    return {"variant": variant, "noise": noise, "leaves": len(jax.tree_util.tree_leaves(params)),
            "lower_s": t1 - t0, "compile_s": t2 - t1, "fusions": hlo.count(" fusion("),
            "triton_fusions": hlo.count('"kind":"__triton'), "options": options or {},
            "custom_calls": hlo.count(" custom-call("), "call_ms": statistics.median(times) * 1e3,
            "device": jax.devices()[0].device_kind}


def main(argv: list[str] | None = None) -> list[dict[str, Any]] | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("resnet18", "efficientnet_b0"), default="resnet18")
    ap.add_argument("--width", type=float, default=0.5)
    ap.add_argument("--noise", action="store_true", help="the wrapper with the batch lever: noise halves in the update")
    ap.add_argument("--calls", type=int, default=20, help="timed calls per variant (median)")
    ap.add_argument("--variants", nargs="+", choices=("plain", *KERNELS), default=["plain", "auto", "reference"],
                    help="default: plain auto reference (triton needs jax-triton on a GPU)")
    ap.add_argument("--xla-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an XLA compiler option for every variant's update, e.g. "
                         "xla_gpu_experimental_enable_fusion_autotuner=false (repeatable; as the demo's --xla-option)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--_one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.width <= 0:
        ap.error(f"--width={a.width}: allowed > 0")
    if a.calls < 1:
        ap.error(f"--calls={a.calls}: allowed >= 1")
    sys.path.insert(0, str(ROOT))   # examples/: the demo's KEY=VALUE parser, as its --xla-option reads them
    from examples.cifar.train import _parse_set

    options = _parse_set(a.xla_option, "--xla-option", "an XLA compiler option")
    if a._one is not None:
        print(json.dumps(one(a.model, a.width, a._one, a.noise, a.calls, options)))
        return None
    # the child imports examples.cifar; the caller's path stays (the device's wheels, e.g. jax_triton)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    rows = [fresh_process_row([sys.executable, __file__, "--model", a.model, "--width", str(a.width), "--calls",
                               str(a.calls), "--_one", v, *(["--noise"] if a.noise else []),
                               *(f"--xla-option={o}" for o in a.xla_option)], v, env)
            for v in a.variants]
    dev = rows[0]["device"]
    meta = run_meta(dev)
    write_json({"meta": meta, "rows": rows}, a.out / f"jax_update_compile-{device_tag(dev)}.json")
    base = next((r for r in rows if r["variant"] == "plain"), None)
    print(f"\n{a.model} width {a.width}, {rows[0]['leaves']} parameter arrays, noise halves {a.noise}; "
          f"{dev}  {meta['date']}; XLA options {options or 'default'}")
    print(f"{'variant':>12} {'compile s':>9} {'/plain':>7} {'fusions':>7} {'triton':>6} {'custom':>6} {'call ms':>8}")
    for r in rows:
        rel = f"{r['compile_s'] / base['compile_s']:.2f}" if base else ""
        print(f"{r['variant']:>12} {r['compile_s']:9.2f} {rel:>7} {r['fusions']:7d} {r['triton_fusions']:6d} {r['custom_calls']:6d} "
              f"{r['call_ms']:8.2f}")
    return rows


if __name__ == "__main__":
    main()
