"""Where a traced window of training steps spends its time: a summary of the demo's `--trace-steps`
trace (Chrome/Perfetto JSON from jax.profiler or torch.profiler).

Per track (process/thread): events, busy time (the union of its events' intervals, ms) and share of
the window; the GPU's busy time over all its streams; the most expensive event names of the busiest
tracks with their counts, and on GPU tracks the most frequent (kernels launched per step = count /
traced steps). A GPU busy share well below 1 over steady-state steps means the device waits for the host.

With --gaps N: the device's idle intervals between its first and last event (the device waiting for
the host), the N longest with the step they fall in (the demo marks each traced step's host span "step
N") and the innermost host event running when each began (e.g. a device->host copy that waited), and
the steps with the most idle time.

usage: python3 benchmarks/trace_summary.py RUN_OUT [--top 8] [--gaps N] [--json PATH]
  RUN_OUT: the demo's --out folder (its trace/ is searched; its summary.json gives the traced step
  count, for per-step figures) or a trace file (.json or .json.gz)
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
from collections import defaultdict
from typing import Any


def find_trace(path: str) -> str:
    """The trace file under a run folder (the newest), or `path` itself."""
    if os.path.isfile(path):
        return path
    found = [p for pat in ("**/*perfetto_trace.json.gz", "**/*.trace.json.gz", "**/torch_trace.json")
             for p in glob.glob(os.path.join(path, "trace", pat), recursive=True)]
    if not found:
        raise SystemExit(f"{path}: no trace under {os.path.join(path, 'trace')} (run the demo with --trace-steps)")
    return max(found, key=os.path.getmtime)


def traced_steps(path: str) -> int | None:
    """Steps in the window of a demo run folder (its summary's --trace-steps), else None."""
    summary = os.path.join(path, "summary.json")
    if not os.path.isfile(summary):
        return None
    with open(summary) as f:
        window = json.load(f).get("options", {}).get("trace_steps")
    return None if not window else int(window[1]) - int(window[0])


def load_events(path: str) -> list[dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (same unit as given)."""
    return sum(e - s for s, e in merged(intervals))


def is_gpu(process: str, event: dict[str, Any]) -> bool:
    """A device-side event: JAX's /device:GPU tracks, torch's kernel/memcpy/memset categories."""
    return "/device:gpu" in process.lower() or str(event.get("cat", "")).lower() in (
        "kernel", "gpu_memcpy", "gpu_memset")


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals as disjoint sorted intervals."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


STEP_MARK = re.compile(r"^step (\d+)$")


def idle_gaps(gpu: list[tuple[float, float]], host: list[tuple[tuple[float, float], str]],
              marks: list[tuple[tuple[float, float], int]], top: int) -> dict[str, Any]:
    """The device's idle intervals between its first and last event (us in, ms out): the `top` longest,
    each with its start (ms from the first device event), the traced step whose host mark ("step N")
    holds that start, and the innermost host event running then; and idle ms per step, most first.
    gpu: device intervals; host: (interval, name) of host events; marks: (interval, step) of step marks."""
    busy = merged(gpu)
    gaps = [(a[1], b[0]) for a, b in zip(busy, busy[1:])]
    origin = busy[0][0] if busy else 0.0

    def step_at(t: float) -> int | None:
        return next((n for (s, e), n in marks if s <= t < e), None)

    def host_at(t: float) -> str | None:
        inside = [(e - s, name) for (s, e), name in host if s <= t < e]
        return min(inside)[1] if inside else None

    per_step: dict[Any, float] = defaultdict(float)
    for s, e in gaps:
        per_step[step_at(s)] += e - s
    longest = sorted(gaps, key=lambda g: g[0] - g[1])[:top]
    return {"idle_ms": sum(e - s for s, e in gaps) / 1e3, "count": len(gaps),
            "longest": [{"at_ms": round((s - origin) / 1e3, 3), "ms": round((e - s) / 1e3, 3), "step": step_at(s),
                         "host": host_at(s)} for s, e in longest],
            "per_step": [{"step": k, "idle_ms": round(v / 1e3, 3)}
                         for k, v in sorted(per_step.items(), key=lambda kv: -kv[1])[:top]]}


def summarize(events: list[dict[str, Any]], top: int, gaps: int = 0) -> dict[str, Any]:
    pname: dict[Any, str] = {}
    tname: dict[tuple[Any, Any], str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pname[e["pid"]] = str(e.get("args", {}).get("name", e["pid"]))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            tname[(e["pid"], e.get("tid"))] = str(e.get("args", {}).get("name", e.get("tid")))
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if not spans:
        raise SystemExit("the trace has no complete ('X') events")
    t0 = min(float(e["ts"]) for e in spans)
    t1 = max(float(e["ts"]) + float(e["dur"]) for e in spans)
    tracks: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    gpu: list[tuple[float, float]] = []
    host: list[tuple[tuple[float, float], str]] = []
    marks: list[tuple[tuple[float, float], int]] = []
    for e in spans:
        if str(e.get("cat", "")).lower() == "gpu_user_annotation":   # a step mark mirrored on a stream: no work
            continue
        proc, name = pname.get(e["pid"], str(e["pid"])), str(e.get("name", ""))
        iv = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        mark = None if is_gpu(proc, e) else STEP_MARK.match(name)
        if mark:   # the demo's mark of a step's host span: where, not work (left out of the tracks' busy time)
            marks.append((iv, int(mark.group(1))))
            continue
        tracks[(proc, tname.get((e["pid"], e.get("tid")), str(e.get("tid"))))].append(e)
        if is_gpu(proc, e):
            gpu.append(iv)
        elif not name.startswith("PyTorch Profiler"):
            host.append((iv, name))
    window = t1 - t0
    rows = []
    for (proc, thread), evs in tracks.items():
        busy = union_us([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in evs])
        by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])   # name -> [us, count]
        for e in evs:
            acc = by_name[str(e.get("name"))]
            acc[0] += float(e["dur"])
            acc[1] += 1
        names = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
        frequent = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
        rows.append({"process": proc, "thread": thread, "gpu": any(is_gpu(proc, e) for e in evs),
                     "events": len(evs), "busy_ms": busy / 1e3,
                     "share": busy / window, "top": [(n, round(d / 1e3, 3), c) for n, (d, c) in names],
                     "most_frequent": [(n, c, round(d / 1e3, 3)) for n, (d, c) in frequent]})
    rows.sort(key=lambda r: -r["busy_ms"])
    out = {"window_ms": window / 1e3, "gpu_busy_ms": union_us(gpu) / 1e3,
           "gpu_share": union_us(gpu) / window if gpu else None, "gpu_events": len(gpu), "tracks": rows}
    if gaps:
        out["gaps"] = idle_gaps(gpu, host, marks, gaps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=8, help="event names shown per busy track (default 8)")
    ap.add_argument("--tracks", type=int, default=6, help="tracks shown with their top events (default 6)")
    ap.add_argument("--counts", action="store_true",
                    help="also list every shown track's most frequent events (GPU tracks always)")
    ap.add_argument("--gaps", type=int, default=0, metavar="N",
                    help="also list the N longest device-idle intervals and the N steps with the most idle time")
    ap.add_argument("--json", default=None, help="also write the summary here")
    args = ap.parse_args()
    if args.gaps < 0:
        ap.error(f"--gaps={args.gaps}: allowed an integer >= 0")
    path = find_trace(args.path)
    s = summarize(load_events(path), args.top, args.gaps)
    gpu = "none" if s["gpu_share"] is None else f"{s['gpu_busy_ms']:.1f} ms ({100 * s['gpu_share']:.0f}%)"
    print(f"{path}\nwindow {s['window_ms']:.1f} ms; GPU busy {gpu} over {s['gpu_events']} events")
    steps = traced_steps(args.path)
    if steps:
        s["steps"] = steps
        print(f"per step ({steps} traced): window {s['window_ms'] / steps:.2f} ms, GPU busy "
              f"{s['gpu_busy_ms'] / steps:.2f} ms, {s['gpu_events'] / steps:.0f} GPU events")
    for r in s["tracks"][:args.tracks]:
        print(f"  {r['process'][:40]:<40} {r['thread'][:32]:<32} {r['events']:>7} ev  busy {r['busy_ms']:9.1f} ms "
              f"({100 * r['share']:3.0f}%)")
        for n, ms, count in r["top"]:
            print(f"      {ms:9.3f} ms {count:>6}x  {n[:100]}")
        if r["gpu"] or args.counts:
            print("    most frequent:")
            for n, count, ms in r["most_frequent"]:
                print(f"      {count:>6}x {ms:9.3f} ms  {n[:100]}")
    g = s.get("gaps")
    if g:
        print(f"device idle between its first and last event: {g['idle_ms']:.1f} ms in {g['count']} gaps; longest:")
        for r in g["longest"]:
            print(f"  {r['ms']:8.3f} ms at +{r['at_ms']:.1f} ms  step {r['step']}  host in: {str(r['host'])[:80]}")
        print("  idle per step (ms): " + ", ".join(f"{r['step']}: {r['idle_ms']:.2f}" for r in g["per_step"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)


if __name__ == "__main__":
    main()
