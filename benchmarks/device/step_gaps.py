"""Host time per step in a demo run, from its log.jsonl (the step records' `host_s`: seconds into the
epoch when the step returned). Per epoch and batch size: step count, median and p90 gap in ms, their
sum in s and the five largest gaps in s, to find where an epoch's time goes (compilations, control
boundaries, a slow step size).

usage: python3 benchmarks/device/step_gaps.py RUN/log.jsonl [...] [--epochs N]
"""
from __future__ import annotations

import argparse
import json
import statistics


def gaps_by_batch(steps: list[dict]) -> dict[int, list[float]]:
    """Seconds between consecutive step records of one epoch, keyed by the later step's batch size."""
    out: dict[int, list[float]] = {}
    for a, b in zip(steps, steps[1:]):
        out.setdefault(b["batch_size"], []).append(b["host_s"] - a["host_s"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--epochs", type=int, default=4, help="first N epochs of each run (default 4)")
    args = ap.parse_args()
    for path in args.logs:
        steps = [r for r in map(json.loads, open(path)) if r.get("type") == "step"]
        if steps and "host_s" not in steps[0]:
            raise SystemExit(f"{path}: step records have no host_s (a log from before it was recorded)")
        print(path)
        for epoch in sorted({r["epoch"] for r in steps})[:args.epochs]:
            for bs, g in sorted(gaps_by_batch([r for r in steps if r["epoch"] == epoch]).items()):
                g.sort()
                print(f"  epoch {epoch + 1} bs {bs:>4}: steps {len(g):>4}  median {1e3 * statistics.median(g):6.2f} ms  "
                      f"p90 {1e3 * g[int(0.9 * (len(g) - 1))]:6.2f} ms  sum {sum(g):6.2f} s  "
                      f"largest {[round(x, 3) for x in g[-5:]]}")


if __name__ == "__main__":
    main()
