"""Which Python lines made a compiled program's fusions (each at least one GPU kernel): reads XLA's
optimized HLO text dumps, counts the fusions by name (``input_transpose_fusion.17`` counted as
``input_transpose_fusion``) and, with ``--show NAME``, where those fusions come from (the JAX op path and
the source line XLA keeps in each instruction's metadata). Dump a program first, e.g. the demo's step:

    XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_body.*" \\
        python3 -m examples.cifar.train ...
    python3 benchmarks/hlo_fusions.py /tmp/dump/*train_body*after_optimizations.txt [B.txt] --show input_transpose_fusion

With two files the counts stand side by side (b - a). Prints only; reads text, runs nothing.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import without_instruction_numbers  # noqa: E402

_FUSION = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = .*? fusion\(.*?\), kind=(?P<kind>\w+)"
                     r"(?:.*?metadata=\{(?P<meta>[^}]*)\})?")
# inside metadata={...}: a CPU dump writes op_name then stack_frame_id, a GPU dump puts scheduling_name between
_OP = re.compile(r"\bop_name=\"(?P<op>[^\"]*)\"")
_FRAME = re.compile(r"\bstack_frame_id=(?P<frame>\d+)")
_TABLE_ROW = re.compile(r"^(\d+) (.*)$")
_FIELD = re.compile(r"(\w+)=(\"[^\"]*\"|\S+?)(?=[ }])")


@dataclass(frozen=True)
class Fusion:
    name: str      # the fusion's name without its instruction number
    kind: str      # kLoop, kInput, kCustom, ...
    op: str        # the JAX op path of the fusion's metadata ("" when none)
    source: str    # "file:line (function)" of its stack frame ("" when none)


def _tables(lines: list[str]) -> dict[str, dict[int, str]]:
    """The dump's header tables (FileNames, FunctionNames, FileLocations, StackFrames): id -> row text."""
    out: dict[str, dict[int, str]] = {}
    current = None
    for line in lines:
        if line.strip() in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = out.setdefault(line.strip(), {})
        elif current is not None and (m := _TABLE_ROW.match(line.strip())):
            current[int(m.group(1))] = m.group(2)
        elif line.startswith("%") or line.startswith("ENTRY"):
            break
        elif not line.strip():
            current = None
    return out


def _source(tables: dict[str, dict[int, str]], frame: int) -> str:
    def fields(text: str) -> dict[str, str]:
        return {k: v.strip('"') for k, v in _FIELD.findall(text + " ")}

    row = tables.get("StackFrames", {}).get(frame)
    if row is None:
        return ""
    loc = tables.get("FileLocations", {}).get(int(fields(row).get("file_location_id", -1)))
    if loc is None:
        return ""
    f = fields(loc)
    file = tables.get("FileNames", {}).get(int(f.get("file_name_id", -1)), "?").strip('"')
    func = tables.get("FunctionNames", {}).get(int(f.get("function_name_id", -1)), "?").strip('"')
    return f"{file}:{f.get('line', '?')} ({func})"


def fusions(path: Path) -> list[Fusion]:
    """Every fusion instruction of an optimized HLO text dump (nested ones included)."""
    lines = Path(path).read_text().splitlines()
    tables = _tables(lines)
    out = []
    for line in lines:
        m = _FUSION.match(line)
        if m is None:
            continue
        meta = m.group("meta") or ""
        op, frame = _OP.search(meta), _FRAME.search(meta)
        out.append(Fusion(without_instruction_numbers(m.group("name")), m.group("kind"), op.group("op") if op else "",
                          _source(tables, int(frame.group("frame"))) if frame else ""))
    return out


def main(argv: list[str] | None = None) -> list[Counter]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path, help="one or two *after_optimizations.txt dumps")
    ap.add_argument("--show", default=None, metavar="NAME", help="list where the fusions named NAME come from")
    ap.add_argument("--top", type=int, default=20, help="rows per table")
    a = ap.parse_args(argv)
    if len(a.files) > 2:
        ap.error(f"files: {len(a.files)} given, allowed one or two")
    if a.top < 1:
        ap.error(f"--top={a.top}: allowed >= 1")
    runs = [(p, fusions(p)) for p in a.files]
    counts = [Counter(f.name for f in fs) for _, fs in runs]
    names = sorted(set().union(*counts), key=lambda n: -sum(c[n] for c in counts))
    print("  ".join(f"{'file ' + str(i + 1):>7}" for i in range(len(runs))) + ("  b - a" if len(runs) == 2 else "")
          + "  fusion   " + "  ".join(f"{i + 1}: {p.name} ({sum(c.values())} fusions)" for i, ((p, _), c) in
                                      enumerate(zip(runs, counts))))
    for n in names[:a.top]:
        delta = f"  {counts[1][n] - counts[0][n]:5d}" if len(runs) == 2 else ""
        print("  ".join(f"{c[n]:7d}" for c in counts) + f"{delta}  {n}")
    if a.show:
        for p, fs in runs:
            where = Counter((f.op.split("/")[-1] if f.op else "?", f.source) for f in fs if f.name == a.show)
            print(f"\n{a.show} in {p.name}: {sum(where.values())}, by op and source line")
            for (op, src), k in where.most_common(a.top):
                print(f"{k:7d}  {op:<28} {src}")
    return counts


if __name__ == "__main__":
    main()
