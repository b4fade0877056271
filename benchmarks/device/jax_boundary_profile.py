"""Where the JAX demo's control boundary spends its host time (issue 15): the demo run as usual, with
`SplitStep.control` and the in-flight settle before it timed at every control step from --from-step on,
and cProfile switched on around those calls only. At bs 96 on an H200 a boundary step took 12.5-15 ms
against a 3.1-3.6 ms median step (2026-11-28, benchmarks/results/s37/callA).

    python3 benchmarks/device/jax_boundary_profile.py --from-step 200 --top 40 -- <demo options>

Prints the per-boundary settle / control times (median, max) and the profile of the control calls
(cumulative, our modules and jax's first), then the demo's own output.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

from triaccel.backends.jax import data as jdata
from triaccel.backends.jax.split_step import SplitStep

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # examples/


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from-step", type=int, default=200, help="profile control steps from this step on")
    p.add_argument("--top", type=int, default=40, help="profile rows printed")
    p.add_argument("demo", nargs=argparse.REMAINDER, help="-- then the demo's options")
    a = p.parse_args()
    argv = a.demo[1:] if a.demo[:1] == ["--"] else a.demo

    prof = cProfile.Profile()
    times: dict[str, list[float]] = {"settle": [], "control": []}
    armed = [False]   # the next settle precedes a profiled control call
    control, settle = SplitStep.control, jdata.InFlight.settle

    def timed_control(self, step, batch=None):
        ctl = self.ta.controller if self.ta is not None else None
        if ctl is None or step < a.from_step or not ctl.is_control_step(step):
            return control(self, step, batch)
        t = time.perf_counter()
        prof.enable()
        try:
            return control(self, step, batch)
        finally:
            prof.disable()
            times["control"].append(time.perf_counter() - t)

    def timed_settle(self):
        t = time.perf_counter()
        try:
            return settle(self)
        finally:
            if armed[0]:
                times["settle"].append(time.perf_counter() - t)

    # the demo settles right before a boundary's control call: time the settles at those steps
    from examples.cifar import jax_loop

    is_control = jax_loop.Controller.is_control_step

    def watching(self, step):
        out = is_control(self, step)
        armed[0] = bool(out) and step >= a.from_step
        return out

    SplitStep.control = timed_control
    jdata.InFlight.settle = timed_settle
    jax_loop.Controller.is_control_step = watching
    from examples.cifar.train import main as demo

    demo(argv)
    for k, v in times.items():
        if v:
            print(f"boundary {k}: n {len(v)} median {1e3 * statistics.median(v):.2f} ms max {1e3 * max(v):.2f} ms "
                  f"sum {sum(v):.3f} s")
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(a.top)
    print(s.getvalue())
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top // 2)
    print(s.getvalue())


if __name__ == "__main__":
    sys.exit(main())
