"""Shared by the benchmark scripts: file-name tags for devices, writing a result as JSON, one run of the
CIFAR demo in its own process.

The scripts run as `python benchmarks/<name>.py`, so this folder is first on sys.path and they
import it as `_results` (tests add the folder to sys.path, tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence


def device_tag(name: str, empty: str = "cpu") -> str:
    """`name` (a device name) lower-cased with every run of other characters than letters and digits
    as one "-", for file names; `empty` when nothing is left."""
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() or empty


def without_instruction_numbers(name: str) -> str:
    """`name` (an XLA instruction or timer label) without the ``.N`` numbers XLA appends to instruction
    names: ``input_transpose_fusion.17`` -> ``input_transpose_fusion``, ``... cudnn-conv.20`` -> ``... cudnn-conv``."""
    return re.sub(r"\.\d+\b", "", name)


def write_json(obj: Any, path: str | Path, indent: int = 2) -> Path:
    """Write `obj` as JSON to `path` (folders made; values JSON cannot hold written as str), say so
    on stdout, and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=indent, default=str) + "\n")
    print(f"wrote {path}")
    return path


def write_to_out(name: str, obj: Any) -> Path | None:
    """`write_json(obj, $OUT/name)` when OUT is set (the device tool's folder that comes back), else
    nothing; the device probes' common ending."""
    out = os.environ.get("OUT")
    return write_json(obj, Path(out) / name, indent=1) if out else None


def child_row(cmd: Sequence[str], timeout: float | None, label: str, env: dict[str, str] | None = None,
              cwd: str | Path | None = None) -> dict[str, Any]:
    """Run a probe's child process; its row: the last JSON line of its stdout (with "stderr", the
    child's standard error), or {"error": ...} when it timed out or failed (also printed, under
    `label`). The device probes run each measurement in a fresh process this way."""
    try:
        p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    except subprocess.TimeoutExpired:
        print(f"{label}: no result within {timeout:.0f} s", flush=True)
        return {"error": f"timeout {timeout} s"}
    line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("{")), None)
    if p.returncode != 0 or line is None:
        print(f"{label}: failed (exit {p.returncode}): {p.stderr[-800:]}", flush=True)
        return {"error": p.stderr[-2000:]}
    return {**json.loads(line), "stderr": p.stderr}


def fresh_process_row(cmd: Sequence[str], label: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """`child_row` from the repository root, without a time limit and strict: the child's row (without
    its standard error), or RuntimeError naming `label`, with that error, when it fails."""
    row = child_row(cmd, None, label, env, cwd=Path(__file__).resolve().parents[1])
    if "error" in row:
        raise RuntimeError(f"{label} failed:\n{row['error']}")
    row.pop("stderr", None)
    return row


def run_meta(device: str) -> dict[str, str]:
    """A benchmark's header: the UTC date, the device and the command line as run."""
    import datetime

    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "device": device,
            "command": " ".join(["python3", *sys.argv])}


def print_table(title: str, rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> None:
    """A fixed-width table: `title` as a comment line, then one line per row; columns: (header, key,
    format spec), e.g. ("step s", "step_s", ">7.1f"); the header takes the spec's width."""
    print(f"# {title}")
    width = [int("".join(c for c in spec.split(".")[0] if c.isdigit()) or 0) for _, _, spec in columns]
    print(" ".join(f"{h:>{w}}" for (h, _, _), w in zip(columns, width)))
    for r in rows:
        print(" ".join(f"{r[k]:{spec}}" for _, k, spec in columns))


def run_demo(args: Sequence[str], out: Path, workdir: str | Path | None = None,
             gpu: str | None = None, timeout: float | None = None) -> dict[str, Any] | None:
    """`python -m examples.cifar.train ARGS --out OUT` in its own process (peak-memory counters and caches
    start clean), on GPU `gpu` (CUDA_VISIBLE_DEVICES) when given. Returns its summary.json plus
    wall_s (the process' seconds), without the bulky "report"; None when it failed (its output's
    tail printed; all of it is in OUT/output.log) or ran past `timeout` seconds."""
    cmd = [sys.executable, "-m", "examples.cifar.train", *args, "--out", str(out)]
    print("$", " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {}))
    Path(out).mkdir(parents=True, exist_ok=True)
    log = Path(out) / "output.log"   # the run's stdout and stderr as they come (a killed run keeps them)
    with open(log, "w") as f:
        try:
            proc = subprocess.run(cmd, cwd=workdir, text=True, stdout=f, stderr=subprocess.STDOUT, env=env,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            print(log.read_text()[-6000:], f"killed after {timeout} s", sep="\n", flush=True)
            return None
    if proc.returncode != 0:
        print(log.read_text()[-6000:], flush=True)
        return None
    summary = json.loads((Path(out) / "summary.json").read_text())
    summary["wall_s"] = time.perf_counter() - t0
    summary.pop("report", None)
    return summary
