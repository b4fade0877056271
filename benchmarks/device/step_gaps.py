"""Host time per step in a demo run, from its log.jsonl (the step records' `host_s`: seconds into the
epoch when the step returned). Per epoch and batch size: step count, median and p90 gap in ms, their
sum in s and the five largest gaps as (step, s), to find where an epoch's time goes (compilations,
graph captures, control boundaries, a slow step size); the first step's time into the epoch (a run's
one-time set-up lands there); and the control boundaries apart (`boundary_step`: the steps k = 0 mod
t_ctrl in a JAX run, k = t_ctrl - 1 in a torch run): their median gap and their cost over the other
steps' median, summed.

usage: python3 benchmarks/device/step_gaps.py RUN/log.jsonl [...] [--epochs N]
"""
from __future__ import annotations

import argparse
import json
import statistics


def gaps_by_batch(steps: list[dict]) -> dict[int, list[tuple[float, int]]]:
    """(seconds since the previous step record, step) for consecutive step records of one epoch, keyed
    by the later step's batch size."""
    out: dict[int, list[tuple[float, int]]] = {}
    for a, b in zip(steps, steps[1:]):
        out.setdefault(b["batch_size"], []).append((b["host_s"] - a["host_s"], b["step"]))
    return out


def boundary_step(backend: str, t_ctrl: int) -> int:
    """The remainder mod t_ctrl of the step whose record carries a control boundary's cost: the JAX loop
    runs the control before step k = 0 mod t_ctrl (`SplitStep.control`), the torch wrapper at the end of
    the step that fills its statistics ring (`TriAccelOptimizer.step`: step k = t_ctrl - 1 mod t_ctrl)."""
    return t_ctrl - 1 if backend == "torch" else 0


def boundary_cost(steps: list[dict], t_ctrl: int, at_step: int = 0) -> tuple[int, float, float] | None:
    """(boundaries, their median gap s, their summed excess over the other steps' median gap s) for
    one epoch's step records; None without a boundary or another step. A gap belongs to the later
    step; boundaries are the steps k with k % t_ctrl == at_step (`boundary_step`)."""
    at, rest = [], []
    for a, b in zip(steps, steps[1:]):
        (at if b["step"] % t_ctrl == at_step else rest).append(b["host_s"] - a["host_s"])
    if not at or not rest:
        return None
    base = statistics.median(rest)
    return len(at), statistics.median(at), sum(g - base for g in at)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--epochs", type=int, default=4, help="first N epochs of each run (default 4)")
    args = ap.parse_args()
    for path in args.logs:
        rows = [json.loads(line) for line in open(path)]
        steps = [r for r in rows if r.get("type") == "step"]
        options = next((r["options"] for r in rows if r.get("type") == "run"), {})
        t_ctrl = options.get("t_ctrl")
        if steps and "host_s" not in steps[0]:
            raise SystemExit(f"{path}: step records have no host_s (a log from before it was recorded)")
        print(path)
        for epoch in sorted({r["epoch"] for r in steps})[:args.epochs]:
            of_epoch = [r for r in steps if r["epoch"] == epoch]
            print(f"  epoch {epoch + 1}: first step (step {of_epoch[0]['step']}) at {of_epoch[0]['host_s']:.3f} s")
            for bs, gs in sorted(gaps_by_batch(of_epoch).items()):
                gs.sort()
                g = [x for x, _ in gs]
                print(f"  epoch {epoch + 1} bs {bs:>4}: steps {len(g):>4}  median {1e3 * statistics.median(g):6.2f} ms  "
                      f"p90 {1e3 * g[int(0.9 * (len(g) - 1))]:6.2f} ms  sum {sum(g):6.2f} s  "
                      f"largest {[(st, round(x, 3)) for x, st in gs[-5:]]}")
            cost = (boundary_cost([r for r in steps if r["epoch"] == epoch], t_ctrl,
                                  boundary_step(options.get("backend", "jax"), t_ctrl)) if t_ctrl else None)
            if cost is not None:
                print(f"    control boundaries (every {t_ctrl} steps): {cost[0]}, median {1e3 * cost[1]:.2f} ms, "
                      f"{cost[2]:.2f} s over the other steps' median")


if __name__ == "__main__":
    main()
