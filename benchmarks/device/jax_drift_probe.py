"""Where a JAX demo run's host time per step goes in two windows of steps: cProfile over each window
(instead of the demo's jax.profiler trace), then the functions whose own time per step changed most
between the first and the last window, the garbage collector's time per step in each window (by
generation), and (--json) every window's functions, to compare runs.

usage (device tool, after prep.sh): python3 benchmarks/device/jax_drift_probe.py --windows 20:60,340:380 \
    -- --backend jax --model efficientnet_b0 --method triaccel --levers precision --batch 384 --batch-max 384 \
       --epochs 3 --data /tmp/data/cifar10-jpeg --out /tmp/runs/drift
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import sys
import time

import examples.cifar.jax_loop as jax_loop
from examples.cifar.train import main as demo_main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", required=True, help="START:STOP[,START:STOP...] optimizer steps")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None, help="write {window: {function: [ms/step, calls/step]}} here")
    ap.add_argument("demo", nargs=argparse.REMAINDER, help="-- then the demo's arguments")
    a = ap.parse_args()
    windows = [tuple(int(x) for x in w.split(":")) for w in a.windows.split(",")]
    stats: list[tuple[tuple[int, int], pstats.Stats, float, list[float]]] = []
    gc_ms = [0.0, 0.0, 0.0]   # collection time by generation while a window runs
    gc_t0 = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_t0[0] = time.perf_counter()
        else:
            gc_ms[info["generation"]] += (time.perf_counter() - gc_t0[0]) * 1e3

    gc.callbacks.append(on_gc)

    class WindowProfile:
        """Stands in for the demo's StepTrace: cProfile over each window."""

        def __init__(self, steps, begin, end, annotate=None) -> None:  # noqa: ANN001 - the demo's signature
            self.prof: cProfile.Profile | None = None
            self.win: tuple[int, int] | None = None
            self.t0 = 0.0

        def at(self, step: int) -> None:
            if self.prof is not None and self.win is not None and step == self.win[1]:
                self.close()
            for w in windows:
                if step == w[0]:
                    print(f"window {w}: gc counts {gc.get_count()} objects {len(gc.get_objects())}", flush=True)
                    self.win, self.prof, self.t0 = w, cProfile.Profile(), time.perf_counter()
                    gc_ms[:] = [0.0, 0.0, 0.0]
                    self.prof.enable()

        def close(self) -> None:
            if self.prof is not None:
                self.prof.disable()
                wall = time.perf_counter() - self.t0
                stats.append((self.win, pstats.Stats(self.prof), wall, list(gc_ms)))
                self.prof = None

    jax_loop.StepTrace = WindowProfile
    demo_main([x for x in a.demo if x != "--"])
    own: list[dict[str, tuple[float, int]]] = []
    for w, st, wall, gms in stats:
        n = w[1] - w[0]
        print(f"window {w}: {wall / n * 1e3:.2f} ms per step (profiled); gc ms per step by generation "
              f"{[round(x / n, 3) for x in gms]}")
        own.append({f"{k[0].rsplit('/', 2)[-1]}:{k[1]} {k[2]}": (v[2] / n * 1e3, v[1] / n)
                    for k, v in st.stats.items()})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({f"{w[0]}:{w[1]}": o for (w, *_), o in zip(stats, own)}, f)
    if len(own) >= 2:
        first, last = own[0], own[-1]
        keys = sorted(set(first) | set(last), key=lambda k: -abs(last.get(k, (0, 0))[0] - first.get(k, (0, 0))[0]))
        print(f"{'function':<70} {'ms/step first':>13} {'last':>8} {'calls/step first':>16} {'last':>8}")
        for k in keys[:a.top]:
            f, l = first.get(k, (0.0, 0)), last.get(k, (0.0, 0))
            print(f"{k[:70]:<70} {f[0]:13.3f} {l[0]:8.3f} {f[1]:16.1f} {l[1]:8.1f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
