"""Where XLA's compilation time goes: runs a command with XLA's scoped logging timers on (TF_CPP_VMODULE
over the compiler's modules) and sums the printed timers by label, e.g. the wrapped JAX update's
compilation on a GPU:

    python3 benchmarks/xla_compile_phases.py --name wrapped -- \\
        python3 benchmarks/jax_update_compile.py --model efficientnet_b0 --width 1 --noise --calls 1 --_one auto

XLA prints one line per timed scope, ``<label> time: 1.2 s (1200000 us) (cumulative: ..., #called: N)``;
HLO passes come as ``HLO pass: <name>`` (summed over every program the command compiles); other labels
name their program (``Compiling [jit_fn] ...``). Prints the top labels (seconds, calls) and writes
benchmarks/results/xla_compile_phases-<name>.json with every label and the command's own wall.
Nested scopes overlap (a pipeline's time includes its passes): read the table as a tree, not a sum.

Two runs side by side (labels with their instruction numbers dropped, ``cudnn-conv.20`` as ``cudnn-conv``,
sorted by the second run's excess):

    python3 benchmarks/xla_compile_phases.py --diff results/xla_compile_phases-a.json results/xla_compile_phases-b.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import run_meta, without_instruction_numbers, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# XLA source files whose scoped timers cover a compilation, CPU and GPU (an unknown name is ignored)
MODULES = ("hlo_pass_pipeline", "gpu_compiler", "nvptx_compiler", "compile_module_to_llvm_ir", "autotuner_util",
           "gemm_fusion_autotuner", "conv_algorithm_picker", "fusion_autotuner", "triton_fusion_emitter",
           "ptx_compiler_impl", "cpu_compiler", "pjrt_stream_executor_client", "se_gpu_pjrt_client")
_UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0}
_TIMER = re.compile(r"\] (?P<label>.+?) time: (?P<value>[\d.]+) (?P<unit>us|ms|s|min) \(")


def _totals(rows: Any) -> dict[str, dict[str, float]]:
    """{label: {"s": summed seconds, "calls": summed count}} of (label, seconds, calls) rows."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"s": 0.0, "calls": 0})
    for label, seconds, calls in rows:
        out[label]["s"] += seconds
        out[label]["calls"] += calls
    return dict(out)


def parse(lines: Any) -> dict[str, dict[str, float]]:
    """{label: {"s": summed seconds, "calls": count}} from XLA's timer lines; other lines are skipped."""
    found = (_TIMER.search(line) for line in lines)
    return _totals((m.group("label").strip(), float(m.group("value")) * _UNIT[m.group("unit")], 1)
                   for m in found if m is not None)


def grouped(labels: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """`labels` summed over the instruction numbers XLA appends to a name (``fusion.17`` -> ``fusion``)."""
    return _totals((without_instruction_numbers(k), v["s"], v["calls"]) for k, v in labels.items())


def diff(a: Path, b: Path, top: int) -> list[tuple[str, dict[str, float], dict[str, float]]]:
    """Rows (label, a's, b's) of two saved runs' grouped labels, by b's excess over a in seconds."""
    ga, gb = (grouped(json.loads(Path(p).read_text())["labels"]) for p in (a, b))
    zero = {"s": 0.0, "calls": 0}
    keys = sorted(set(ga) | set(gb), key=lambda k: -(gb.get(k, zero)["s"] - ga.get(k, zero)["s"]))
    rows = [(k, ga.get(k, zero), gb.get(k, zero)) for k in keys[:top]]
    print(f"\n{'a s':>9} {'calls':>6} {'b s':>9} {'calls':>6} {'b - a':>8}  label (a: {a.name}, b: {b.name})")
    for k, x, y in rows:
        print(f"{x['s']:9.3f} {int(x['calls']):6d} {y['s']:9.3f} {int(y['calls']):6d} {y['s'] - x['s']:8.3f}  {k[:100]}")
    return rows


def main(argv: list[str] | None = None) -> Any:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--diff"]:
        ap = argparse.ArgumentParser(prog="xla_compile_phases.py --diff")
        ap.add_argument("a", type=Path)
        ap.add_argument("b", type=Path)
        ap.add_argument("--top", type=int, default=25)
        d = ap.parse_args(argv[1:])
        if d.top < 1:
            ap.error(f"--top={d.top}: allowed >= 1")
        return diff(d.a, d.b, d.top)
    if "--" not in argv:
        raise SystemExit("usage: xla_compile_phases.py [--name N] [--top K] -- COMMAND ... | --diff A.json B.json [--top K]")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="run", help="names the JSON file")
    ap.add_argument("--top", type=int, default=25, help="labels printed, by seconds")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    a = ap.parse_args(argv[:cut])
    cmd = argv[cut + 1:]
    if not cmd:
        ap.error("no command after --")
    if a.top < 1:
        ap.error(f"--top={a.top}: allowed >= 1")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": ",".join(f"{m}=1" for m in MODULES)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"command exited {proc.returncode}: {' '.join(cmd)}")
    labels = parse(proc.stderr.splitlines())
    meta = run_meta("")   # the command prints its own device
    write_json({"meta": meta, "command": cmd, "wall_s": wall, "stdout_tail": proc.stdout[-2000:], "labels": labels},
               a.out / f"xla_compile_phases-{a.name}.json")
    print(f"\n{a.name}: {' '.join(cmd)}\n{meta['date']}  command wall {wall:.1f} s; {len(labels)} timer labels")
    print(f"{'seconds':>9} {'calls':>6}  label")
    for label, v in sorted(labels.items(), key=lambda kv: -kv[1]["s"])[:a.top]:
        print(f"{v['s']:9.3f} {int(v['calls']):6d}  {label[:110]}")
    return labels


if __name__ == "__main__":
    main()
