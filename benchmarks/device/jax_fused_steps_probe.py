"""What a small-batch JAX step costs three ways (#14, JAX epoch 1): the demo's ResNet-18 step (AMP-bf16
policy, SGD-nesterov, random data, no triaccel wrapper) at bs `--small` one call per step; at bs `--floor`
(the program a bs-96 step is padded to under the demo's pad floor, bs 512); and `--k` steps of bs `--small` per call as
one `lax.scan` (the local path's `steps_per_call`; for the end-to-end loop measured and not built: docs/results.md,
"Session of 2026-12-04", call 1). Each variant in
its own process: compile seconds, then `--steps` steps back to back (one wait at the end): ms per step.

    python3 benchmarks/device/jax_fused_steps_probe.py                 # GPU machine, after prep.sh
    python3 benchmarks/device/jax_fused_steps_probe.py --smoke         # CPU: the mechanics only

`--check` (the smoke test's) also runs `k` single steps and their scan from the same state and data with every
layer in FP32 and prints how far the scan's weights (and optimizer state) end from the single steps' (max
|difference|): the same arithmetic within float rounding. In bf16 the two programs round differently and the
difference grows with the steps (CPU, width 1/8, bs 4, two steps: 2.3e-6 in FP32, 0.23 in bf16).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/: the shared helpers
from _results import child_row, print_table, write_to_out  # noqa: E402

VARIANTS = ("small", "floor", "scan")


def child(variant: str, small: int, floor: int, k: int, steps: int, width: float, check: bool) -> dict[str, Any]:
    import jax
    import numpy as np
    from _r18_step import amp_resnet18

    state, train, _ = amp_resnet18(width)
    rng = np.random.default_rng(0)

    def scan_of(step: Any) -> Any:
        def scanned(s: Any, xs: Any, ys: Any) -> Any:
            def body(carry: Any, xy: Any) -> Any:
                loss, new = step(carry, *xy)
                return new, loss
            new, losses = jax.lax.scan(body, s, (xs, ys))
            return losses, new
        return scanned

    def data(*shape: int) -> tuple[Any, Any]:
        return (jax.device_put(rng.normal(size=(*shape, 32, 32, 3)).astype(np.float32)),
                jax.device_put(rng.integers(0, 10, shape).astype(np.int32)))

    fn, x, y, per_call = {"small": (train, *data(small), 1), "floor": (train, *data(floor), 1),
                          "scan": (scan_of(train), *data(k, small), k)}[variant]
    t0 = time.perf_counter()
    exe = jax.jit(fn).lower(state, x, y).compile()
    compile_s = time.perf_counter() - t0
    row: dict[str, Any] = {"variant": variant, "device": jax.devices()[0].device_kind, "small": small, "floor": floor,
                           "k": k, "compile_s": compile_s}
    if check and variant == "scan":
        state32, train32, _ = amp_resnet18(width, fp32=True)
        one = jax.jit(train32)
        s1 = state32
        for i in range(k):
            _, s1 = one(s1, x[i], y[i])
        _, sk = jax.jit(scan_of(train32))(state32, x, y)
        row["max_abs_diff"] = max(float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
                                  for a, b in zip(jax.tree_util.tree_leaves(s1), jax.tree_util.tree_leaves(sk)))
    calls = max(1, steps // per_call)
    s = state
    for _ in range(2):   # warm
        loss, s = exe(s, x, y)
    jax.block_until_ready(loss)
    t = time.perf_counter()
    for _ in range(calls):
        loss, s = exe(s, x, y)
    jax.block_until_ready(loss)
    row["ms_per_step"] = (time.perf_counter() - t) / (calls * per_call) * 1e3
    row["steps"] = calls * per_call
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", type=int, default=96, help="the small batch (samples per step)")
    ap.add_argument("--floor", type=int, default=512, help="the pad floor's batch (today's program for small steps)")
    ap.add_argument("--k", type=int, default=10, help="small steps per scan call")
    ap.add_argument("--steps", type=int, default=200, help="timed small steps per variant")
    ap.add_argument("--width", type=float, default=1.0, help="ResNet-18's channel width multiplier")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--timeout", type=float, default=200.0, help="seconds per variant's process")
    ap.add_argument("--check", action="store_true", help="the scan's weights against k single steps'")
    ap.add_argument("--smoke", action="store_true", help="CPU: bs 4 / 8, k 2, 4 steps, --check")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    for name in ("small", "floor", "k", "steps"):
        if getattr(a, name) < 1:
            ap.error(f"--{name}={getattr(a, name)}: allowed >= 1")
    if a.width <= 0:
        ap.error(f"--width={a.width}: allowed > 0")
    if a.child:
        print(json.dumps(child(a.child, a.small, a.floor, a.k, a.steps, a.width, a.check)), flush=True)
        return
    if a.smoke:
        a.small, a.floor, a.k, a.steps, a.check = 4, 8, 2, 4, True
    rows = []
    for v in a.variants:
        cmd = [sys.executable, __file__, "--child", v, "--small", str(a.small), "--floor", str(a.floor), "--k", str(a.k),
               "--steps", str(a.steps), "--width", str(a.width), *(["--check"] if a.check else [])]
        row = child_row(cmd, a.timeout, v)
        row.pop("stderr", None)
        rows.append({"variant": v, **row})
    ok = [r for r in rows if "error" not in r]
    base = next((r for r in ok if r["variant"] == "floor"), None)
    for r in ok:
        r["vs_floor"] = r["ms_per_step"] / base["ms_per_step"] if base else float("nan")
    if ok:
        print_table(f"ResNet-18{'' if a.width == 1 else f' (width {a.width})'} bf16 step, {ok[0]['device']}: bs {a.small} "
                    f"one per call, at the bs-{a.floor} program, {a.k} per lax.scan call",
                    ok, [("variant", "variant", ">8"), ("compile s", "compile_s", ">9.1f"),
                         ("ms per small step", "ms_per_step", ">17.2f"), ("/ floor", "vs_floor", ">7.2f"),
                         ("steps", "steps", ">6d")])
        for r in ok:
            if "max_abs_diff" in r:
                print(f"FP32: scan of {a.k} steps against {a.k} single steps: state within {r['max_abs_diff']:.3g}")
    write_to_out("jax_fused_steps_probe.json", rows)
    if len(ok) < len(rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
