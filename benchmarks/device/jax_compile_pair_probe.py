"""Do two XLA compilations at once slow each other, and how often badly? (issue 14, cold JAX runs)

    python3 benchmarks/device/jax_compile_pair_probe.py --reps 3        # GPU machine, after prep.sh
    python3 benchmarks/device/jax_compile_pair_probe.py --smoke         # CPU: the mechanics only

The demo's first epoch compiles its ResNet-18 training step (AMP-bf16 policy, SGD-nesterov) on the
loop's thread while the evaluation program compiles on the background thread; in one cold run of
2026-11-25 the step took 54.2 s and the evaluation 47.5 s that way, against 16.5 / 5.0 s in another
(docs/results.md). Each rep runs in a fresh process (XLA keeps autotuning results in-process; no
persistent cache), in two modes: `alone` compiles the step, then the evaluation; `pair` compiles
them at once (the step on the main thread, the evaluation on a second thread started with it). The
table gives each program's compile seconds per rep and the count of XLA's "Delay kernel timed out"
warnings (its autotuning timer's sign of a busy GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/: the shared helpers
from _results import child_row, print_table, write_to_out  # noqa: E402

MODES = ("alone", "pair")


def child(mode: str, batch: int, eval_batch: int, width: float = 1.0) -> dict[str, Any]:
    import jax
    import numpy as np
    from _r18_step import amp_resnet18

    state, train, evaluate = amp_resnet18(width)

    def shapes(n: int) -> tuple[Any, Any]:
        return (jax.ShapeDtypeStruct((n, 32, 32, 3), np.float32), jax.ShapeDtypeStruct((n,), np.int32))

    lowered = {"step": jax.jit(train).lower(state, *shapes(batch)),
               "eval": jax.jit(evaluate).lower(state, *shapes(eval_batch))}
    secs: dict[str, float] = {}

    def compile_one(name: str) -> None:
        t = time.perf_counter()
        lowered[name].compile()
        secs[name] = time.perf_counter() - t

    t0 = time.perf_counter()
    if mode == "alone":
        compile_one("step")
        compile_one("eval")
    else:
        th = threading.Thread(target=compile_one, args=("eval",))
        th.start()
        compile_one("step")
        th.join()
    return {"mode": mode, "device": jax.devices()[0].device_kind, "batch": batch, "eval_batch": eval_batch,
            "step_s": secs["step"], "eval_s": secs["eval"], "wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3, help="fresh processes per mode (interleaved)")
    ap.add_argument("--batch", type=int, default=96, help="the training step's batch (the demo's first)")
    ap.add_argument("--eval-batch", type=int, default=1000, help="the evaluation chunk (the demo's)")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per process")
    ap.add_argument("--width", type=float, default=1.0,
                    help="ResNet-18's channel width multiplier (default 1; smaller: the mechanics in less time)")
    ap.add_argument("--smoke", action="store_true", help="CPU, small batches, one rep")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.batch, a.eval_batch, a.width)), flush=True)
        return
    if a.smoke:
        a.reps, a.batch, a.eval_batch = 1, 8, 16
    rows = []
    for rep in range(a.reps):
        for mode in MODES:
            cmd = [sys.executable, __file__, "--child", mode, "--batch", str(a.batch), "--eval-batch", str(a.eval_batch),
                   "--width", str(a.width)]
            row = child_row(cmd, a.timeout, f"rep {rep} {mode}")
            if "error" not in row:
                row["delay_warnings"] = row.pop("stderr").count("Delay kernel timed out")
            rows.append({"rep": rep, "mode": mode, **row})
            if "error" not in row:
                print(json.dumps(rows[-1]), flush=True)
    ok = [r for r in rows if "error" not in r]
    if ok:
        print_table(f"ResNet-18{'' if a.width == 1 else f' (width {a.width})'} bf16 training step at bs {a.batch} and evaluation at {a.eval_batch}, {ok[0]['device']}: "
                    "compile seconds, fresh process per row",
                    ok, [("rep", "rep", ">3"), ("mode", "mode", ">6"), ("step s", "step_s", ">7.1f"),
                         ("eval s", "eval_s", ">7.1f"), ("wall s", "wall_s", ">7.1f"),
                         ("delay warnings", "delay_warnings", ">14")])
    write_to_out("jax_compile_pair_probe.json", rows)


if __name__ == "__main__":
    main()
