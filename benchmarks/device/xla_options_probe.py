"""What XLA's compiler options cost and buy for a background step compilation (issue 14, cold JAX runs).

    python3 benchmarks/device/xla_options_probe.py                # GPU machine, after prep.sh
    python3 benchmarks/device/xla_options_probe.py --smoke        # CPU: the mechanics only
    python3 benchmarks/device/xla_options_probe.py --sets default threads1 threads1-autotune2   # one GPU call

The demo's ResNet-18 step (AMP-bf16 policy, SGD-nesterov) on random CIFAR-shaped data. Each option set
runs in its own process (XLA keeps autotuning results in-process): compile the foreground step at
--fg (default options), time --steps of it alone; then compile the step at --bg with the option set
on a background thread while the foreground keeps stepping, and report: the background compilation's
seconds, the foreground's ms per step during it (against alone), and the --bg step's ms per step
once compiled. An option set that compiles faster, slows the foreground less and runs its step as
fast as the default is one to use for triaccel's compilations ahead.
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

OPTION_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "autotune1": {"xla_gpu_autotune_level": 1},
    "autotune2": {"xla_gpu_autotune_level": 2},
    "no-triton-gemm": {"xla_gpu_enable_triton_gemm": False},
    "autotune0": {"xla_gpu_autotune_level": 0},
    # one compilation thread: whether the foreground's slowdown beside a compilation is XLA's thread
    # pool taking the host's cores (the foreground is host-bound) rather than the GPU's autotuning
    "threads1": {"xla_gpu_force_compilation_parallelism": 1},
    "threads1-autotune2": {"xla_gpu_force_compilation_parallelism": 1, "xla_gpu_autotune_level": 2},
    # between one thread (foreground unslowed, compilation 4.4x longer: H200, 2026-11-27) and all cores
    "threads4": {"xla_gpu_force_compilation_parallelism": 4},
    "threads8": {"xla_gpu_force_compilation_parallelism": 8},
    "threads12": {"xla_gpu_force_compilation_parallelism": 12},
}


def child(name: str, fg: int, bg: int, steps: int, width: float = 1.0) -> dict[str, Any]:
    import jax
    import numpy as np
    from _r18_step import amp_resnet18

    state, pure, _ = amp_resnet18(width)
    step = jax.jit(pure, donate_argnums=0)
    rng = np.random.default_rng(0)

    def batch(n: int) -> tuple[Any, Any]:
        return (jax.device_put(rng.normal(size=(n, 32, 32, 3)).astype(np.float32)),
                jax.device_put(rng.integers(0, 10, n).astype(np.int32)))

    xf, yf = batch(fg)
    t0 = time.perf_counter()
    exe_fg = step.lower(state, xf, yf).compile()
    fg_compile = time.perf_counter() - t0

    holder = {"state": state}

    def run(exe: Any, x: Any, y: Any, n: int) -> float:
        t = time.perf_counter()
        loss = None
        for _ in range(n):
            loss, holder["state"] = exe(holder["state"], x, y)
        jax.block_until_ready(loss)
        return (time.perf_counter() - t) / n * 1e3

    run(exe_fg, xf, yf, 5)
    alone = run(exe_fg, xf, yf, steps)
    xb, yb = batch(bg)
    res: dict[str, Any] = {}

    def compile_bg() -> None:
        t = time.perf_counter()
        lowered = step.lower(holder["state"], xb, yb)
        res["lower_s"] = time.perf_counter() - t
        t = time.perf_counter()
        res["exe"] = lowered.compile(compiler_options=OPTION_SETS[name] or None)
        res["compile_s"] = time.perf_counter() - t

    th = threading.Thread(target=compile_bg)
    t0 = time.perf_counter()
    th.start()
    done = 0
    while th.is_alive():
        run(exe_fg, xf, yf, 10)
        done += 10
    beside_wall = time.perf_counter() - t0
    th.join()
    exe_bg = res["exe"]
    run(exe_bg, xb, yb, 5)
    bg_step = run(exe_bg, xb, yb, steps)
    return {"options": name, "device": jax.devices()[0].device_kind, "fg": fg, "bg": bg,
            "fg_compile_s": fg_compile, "fg_ms_alone": alone, "fg_ms_beside": beside_wall / max(done, 1) * 1e3,
            "fg_steps_beside": done, "bg_lower_s": res["lower_s"], "bg_compile_s": res["compile_s"],
            "bg_ms": bg_step}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sets", nargs="+", default=None, choices=list(OPTION_SETS),
                    help="option sets to run (default: all; with --smoke: default)")
    ap.add_argument("--fg", type=int, default=96)
    ap.add_argument("--bg", type=int, default=384)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--width", type=float, default=1.0,
                    help="ResNet-18's channel width multiplier (default 1; smaller: the mechanics in less time)")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per option set's process")
    ap.add_argument("--smoke", action="store_true", help="CPU, small batches (the default set unless --sets)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.fg, a.bg, a.steps, a.width)), flush=True)
        return
    if a.smoke:
        a.fg, a.bg, a.steps = 8, 16, 3
    if a.sets is None:
        a.sets = ["default"] if a.smoke else list(OPTION_SETS)
    rows = []
    for name in a.sets:
        cmd = [sys.executable, __file__, "--child", name, "--fg", str(a.fg), "--bg", str(a.bg), "--steps", str(a.steps),
               "--width", str(a.width)]
        row = child_row(cmd, a.timeout, name)
        row.pop("stderr", None)
        rows.append({"options": name, **row})
        if "error" not in row:
            print(json.dumps(rows[-1]), flush=True)
    ok = [r for r in rows if "error" not in r]
    if ok:
        print_table(f"ResNet-18{'' if a.width == 1 else f' (width {a.width})'} bf16 step, {ok[0]['device']}: foreground bs {a.fg}, background compilation at bs {a.bg}",
                    ok, [("options", "options", ">15"), ("fg compile s", "fg_compile_s", ">12.1f"),
                         ("fg ms alone", "fg_ms_alone", ">11.2f"), ("fg ms beside", "fg_ms_beside", ">12.2f"),
                         ("bg lower s", "bg_lower_s", ">10.1f"), ("bg compile s", "bg_compile_s", ">12.1f"),
                         ("bg ms", "bg_ms", ">7.2f")])
    write_to_out("xla_options_probe.json", rows)


if __name__ == "__main__":
    main()
