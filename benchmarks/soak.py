"""GPU soak of memory-elastic training (issue #19 item 5): the CIFAR demo for many epochs under a
memory budget, once clean and once with an out-of-memory error injected every N optimizer steps.

For each backend (`--backends torch jax`) the demo (`examples.cifar.train`, method triaccel, its
defaults otherwise) runs `--epochs` under `--budget` twice, each run in its own process (so that
peak-memory counters and JAX's allocator start fresh):

  clean    no injection;
  inject   `--inject-oom-every N`: the first micro-batch of every N-th step raises the backend's
           OOM error (torch.OutOfMemoryError; JAX: the XLA runtime error with RESOURCE_EXHAUSTED
           that `triaccel.backends.jax.data.is_oom` classifies as OOM) before its forward pass.

Checks per run (PASS / FAIL; n/a where not measured, e.g. peak memory on CPU):

  finish   the run completed every epoch (no OOMAtMinimumBatch or other error);
  samples  every sample index trained exactly once per epoch, and the samples per epoch equal the
           clean run's (or the training-set size when the clean run was not part of the call).
           Counted outside the loader's bookkeeping: the indices of each micro-batch are recorded
           when the loader fetches them and kept only if no OOM was reported for that micro-batch
           (the backend's `is_oom` predicate is wrapped) and its step completed; the step's kept
           indices must equal the indices the step retired;
  peak     peak allocated bytes <= budget (torch: max_memory_allocated, with the wrapper's probe
           peaks; JAX: peak_bytes_in_use);
  ooms     OOMs seen by the elastic step's predicate == OOMs injected (0 for the clean run).

Why `--oom-cooldown` (TriAccelConfig.oom_cooldown, default here 100 steps; 0 = the library's default,
1000 steps, longer than the injection interval, so it acts as a permanent cap here): every OOM lowers
the batch one rung of the demo's ladder and caps growth below the size that failed. With a
permanent cap, a fault every 200 steps walks the batch down to the smallest rung within a few
injections and the next one raises OOMAtMinimumBatch. With a cooldown
the law may grow the batch again (when memory and the gradient noise scale allow). On a CPU no
memory is measured, so the batch never grows back: there at most log2(batch / 8) injections fit.

Prints a table and writes JSON (default benchmarks/results/soak/soak-<device>.json; run folders
with the demo's logs under --runs-dir).

GPU (one backend per call keeps each call within ~10 minutes):
  python benchmarks/soak.py --backends torch --data <cifar10-jpeg> --out results/soak-torch.json
  python benchmarks/soak.py --backends jax --data <cifar10-jpeg> --out results/soak-jax.json
CPU smoke test (~10-20 minutes on 2 busy cores; 2 injections per inject run):
  python benchmarks/soak.py --device cpu --epochs 2 --every 5 --train-subset 256 --test-subset 256 \\
      --width 0.125 --batch 64 --data ../shared/data/cifar10-jpeg
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from _results import device_tag, write_json

ROOT = Path(__file__).resolve().parents[1]
RUNS = ("clean", "inject")


# -- worker: one demo run in this process, instrumented --------------------------------------------

class IndexRecorder:
    """Per-epoch count of each sample index over the micro-batches that completed.

    fetch(indices) -> the previous micro-batch (if not voided) is kept, these indices become
    pending; is_oom(exc) True -> the pending micro-batch failed (voided) and the OOM is counted;
    complete(indices) -> the pending one is kept, the step's kept indices are compared with the
    retired ones and added to the epoch's counts. An OOM raised inside fetch voids nothing: the
    previous micro-batch was already kept when that fetch began.
    """

    def __init__(self) -> None:
        self.counts: dict[int, np.ndarray] = {}
        self.ooms_seen = 0
        self.step_mismatches = 0
        self.steps = 0
        self._pending: np.ndarray | None = None
        self._step: list[np.ndarray] = []

    def _keep(self) -> None:
        if self._pending is not None:
            self._step.append(self._pending)
            self._pending = None

    def on_fetch(self, indices: Any) -> None:
        self._pending = np.array(indices, dtype=np.int64, copy=True).reshape(-1)

    def on_oom(self) -> None:
        self._pending = None
        self.ooms_seen += 1

    def on_complete(self, epoch: int, num_samples: int, indices: Any) -> None:
        self._keep()
        got = np.concatenate(self._step) if self._step else np.zeros(0, dtype=np.int64)
        self._step = []
        want = np.asarray(indices, dtype=np.int64).reshape(-1)
        if not np.array_equal(np.sort(got), np.sort(want)):
            self.step_mismatches += 1
        c = self.counts.setdefault(int(epoch), np.zeros(num_samples, dtype=np.int64))
        np.add.at(c, got, 1)
        self.steps += 1

    @contextlib.contextmanager
    def installed(self, backend: str) -> Iterator["IndexRecorder"]:
        """Wrap the backend loader's fetch/complete and its data module's is_oom while inside."""
        from unittest import mock

        if backend == "torch":
            import triaccel.backends.torch.data as mod
        else:
            import triaccel.backends.jax.data as mod
        loader_cls = mod.ElasticLoader
        fetch, complete, is_oom = loader_cls.fetch, loader_cls.complete, mod.is_oom
        rec = self

        def fetch_w(loader: Any, indices: Any, *args: Any, **kwargs: Any) -> Any:
            rec._keep()                      # the previous micro-batch returned without an OOM
            out = fetch(loader, indices, *args, **kwargs)   # e.g. JAX's pad_to
            rec.on_fetch(indices)
            return out

        def complete_w(loader: Any, indices: Any, *args: Any, **kwargs: Any) -> Any:
            rec.on_complete(loader.epoch, loader.num_samples, indices)
            return complete(loader, indices, *args, **kwargs)

        def is_oom_w(exc: BaseException) -> bool:
            r = is_oom(exc)
            if r:
                rec.on_oom()
            return r

        with mock.patch.object(loader_cls, "fetch", fetch_w), \
                mock.patch.object(loader_cls, "complete", complete_w), \
                mock.patch.object(mod, "is_oom", is_oom_w):
            yield self


def _records(log: Path, kind: str) -> list[dict[str, Any]]:
    """The demo log's records of one type ("step", "epoch"; written at each epoch's end)."""
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            if r.get("type") == kind:
                out.append(r)
    return out


def worker(out_json: Path, backend: str, demo_argv: list[str]) -> None:
    """Run the demo once under the recorder; write what soak's checks need to out_json."""
    sys.path.insert(0, str(ROOT))
    rec = IndexRecorder()
    summary: dict[str, Any] | None = None
    error = None
    from examples.cifar.train import parse_args, run

    opts = parse_args(demo_argv)   # JAX: caps the XLA pool at the budget before the backend starts
    t0 = time.perf_counter()
    with rec.installed(backend):
        try:
            summary = run(opts)
        except Exception as exc:  # noqa: BLE001 - the soak reports any failure as "did not finish"
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    wall = time.perf_counter() - t0
    steps = _records(Path(opts.out) / "log.jsonl", "step")
    by_epoch: dict[int, int] = {}
    ooms_logged = 0
    for r in steps:
        by_epoch[int(r["epoch"])] = by_epoch.get(int(r["epoch"]), 0) + int(r["samples"])
        ooms_logged += int(r.get("ooms") or 0)
    counts = [rec.counts.get(e) for e in range(opts.epochs)]
    res = {
        "backend": backend, "demo_argv": demo_argv, "error": error, "wall_s": wall,
        "epochs_requested": opts.epochs,
        "epochs_done": len(_records(Path(opts.out) / "log.jsonl", "epoch")),
        "samples_per_epoch_log": [by_epoch.get(e) for e in range(opts.epochs)],
        "samples_per_epoch_counted": [None if c is None else int(c.sum()) for c in counts],
        "exactly_once_per_epoch": [None if c is None else bool((c == 1).all()) for c in counts],
        "indices_never_seen": [None if c is None else int((c == 0).sum()) for c in counts],
        "indices_repeated": [None if c is None else int((c > 1).sum()) for c in counts],
        "step_mismatches": rec.step_mismatches, "steps_counted": rec.steps,
        "ooms_seen": rec.ooms_seen, "ooms_in_step_records": ooms_logged,
        "ooms_injected": None if summary is None else summary.get("injected_ooms"),
        "peak_alloc_bytes": None if summary is None else summary.get("peak_alloc_bytes"),
        "final_acc": None if summary is None else summary.get("final_acc"),
        "final_batch": None if summary is None else summary.get("final_batch"),
        "steps": None if summary is None else summary.get("steps"),
        "train_images": None if not counts or counts[0] is None else int(len(counts[0])),
        "device_name": None if summary is None else summary.get("device_name"),
        "epoch_seconds": None if summary is None else summary.get("epoch_seconds"),
    }
    out_json.write_text(json.dumps(res, indent=2, default=str))


# -- parent: runs, checks, table --------------------------------------------------------------------

def demo_argv(a: argparse.Namespace, backend: str, run: str, out: Path) -> list[str]:
    argv = ["--backend", backend, "--method", "triaccel", "--epochs", str(a.epochs), "--budget", a.budget,
            "--seed", str(a.seed), "--device", a.device, "--no-progress", "--out", str(out)]
    if a.oom_cooldown:
        argv += ["--set", f"oom_cooldown={a.oom_cooldown}"]
    for flag, v in (("--data", a.data), ("--train-subset", a.train_subset), ("--test-subset", a.test_subset),
                    ("--width", a.width), ("--batch", a.batch)):
        if v is not None:
            argv += [flag, str(v)]
    if run == "inject":
        argv += ["--inject-oom-every", str(a.every)]
    return argv + shlex.split(a.demo_args)


def run_one(a: argparse.Namespace, backend: str, run: str, runs_dir: Path) -> dict[str, Any]:
    out = runs_dir / f"{backend}-{run}"
    out.mkdir(parents=True, exist_ok=True)
    res_path, log_path = out / "soak-worker.json", out / "soak-worker.log"
    res_path.unlink(missing_ok=True)
    argv = demo_argv(a, backend, run, out)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    if a.device == "cpu" and backend == "jax":
        env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(res_path), "--backends", backend, "--",
           *argv]
    t0 = time.perf_counter()
    with log_path.open("w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    if not res_path.exists():   # the worker itself died (e.g. killed): report it as not finished
        tail = log_path.read_text().splitlines()[-5:]
        return {"backend": backend, "error": f"worker exited {proc.returncode}: {' | '.join(tail)}",
                "wall_s": time.perf_counter() - t0, "demo_argv": argv, "epochs_requested": a.epochs,
                "epochs_done": 0}
    res = json.loads(res_path.read_text())
    res["log"] = str(log_path)
    return res


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def checks(res: dict[str, Any], run: str, budget: int, clean: dict[str, Any] | None) -> dict[str, bool | None]:
    finished = res.get("error") is None and res.get("epochs_done") == res.get("epochs_requested")
    per_epoch = res.get("samples_per_epoch_counted") or []
    if clean is not None and clean.get("samples_per_epoch_counted"):
        ref = clean["samples_per_epoch_counted"]
    else:
        ref = [res.get("train_images")] * int(res.get("epochs_requested") or 0)
    samples = (finished and bool(per_epoch) and per_epoch == ref and None not in ref
               and per_epoch == res.get("samples_per_epoch_log")
               and all(res.get("exactly_once_per_epoch") or [False]) and res.get("step_mismatches") == 0)
    peak = res.get("peak_alloc_bytes")
    want = res.get("ooms_injected") if run == "inject" else 0
    ooms = (finished and want is not None and res.get("ooms_seen") == want
            and res.get("ooms_in_step_records") == want and (run == "clean" or want > 0))
    return {"finish": finished, "samples": samples, "peak": None if peak is None else bool(peak <= budget),
            "ooms": ooms}


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict[str, Any]]) -> str:
    head = ("backend", "run", "epochs", "samples/ep min", "max", "OOM inj", "seen", "peak GB", "budget GB",
            "final acc", "wall s", "finish", "samples", "peak", "ooms")
    lines = [" | ".join(head)]
    for r in rows:
        spe = [x for x in r.get("samples_per_epoch_counted") or [] if x is not None]
        c = r["checks"]
        peak = r.get("peak_alloc_bytes")
        lines.append(" | ".join([
            r["backend"], r["run"], f"{r.get('epochs_done', 0)}/{r.get('epochs_requested')}",
            _fmt(min(spe) if spe else None, "d"), _fmt(max(spe) if spe else None, "d"),
            _fmt(r.get("ooms_injected"), "d"), _fmt(r.get("ooms_seen"), "d"),
            _fmt(None if peak is None else peak / 1e9, ".2f"), f"{r['budget_bytes'] / 1e9:.2f}",
            _fmt(None if r.get("final_acc") is None else 100 * r["final_acc"], ".2f"),
            f"{r['wall_s']:.0f}", *(_verdict(c[k]) for k in ("finish", "samples", "peak", "ooms"))]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", choices=["torch", "jax"], default=["torch", "jax"])
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--budget", default="4GiB")
    p.add_argument("--every", type=int, default=200, help="inject an OOM every N optimizer steps")
    p.add_argument("--oom-cooldown", type=int, default=100,
                   help="steps without an OOM after which the batch may grow past a failed size again "
                        "(TriAccelConfig.oom_cooldown; 0 = the library default, 1000)")
    p.add_argument("--data", default=None, help="the demo's --data (default: its own resolution)")
    p.add_argument("--device", default="auto", help="the demo's --device (cpu: JAX on the CPU too)")
    p.add_argument("--train-subset", type=int, default=None)
    p.add_argument("--test-subset", type=int, default=None)
    p.add_argument("--width", type=float, default=None)
    p.add_argument("--batch", type=int, default=None, help="the demo's initial batch (default: its own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--demo-args", default="", help="more demo options, one shell-quoted string")
    p.add_argument("--runs-dir", default=str(ROOT / "runs" / "soak"))
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/soak/soak-<device>.json)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("demo", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(Path(a.worker), a.backends[0], a.demo[1:] if a.demo[:1] == ["--"] else a.demo)
        return None
    for name in ("epochs", "every"):
        if getattr(a, name) < 1:
            p.error(f"--{name}={getattr(a, name)}: allowed an integer >= 1")
    if a.oom_cooldown < 0:
        p.error(f"--oom-cooldown={a.oom_cooldown}: allowed an integer >= 0 (0 = the library default)")
    from triaccel import parse_bytes

    budget = parse_bytes(a.budget, "budget")
    runs_dir = Path(a.runs_dir)
    rows: list[dict[str, Any]] = []
    t_all = time.perf_counter()
    for backend in a.backends:
        clean = None
        for run in a.runs:
            res = run_one(a, backend, run, runs_dir)
            res.update(run=run, budget_bytes=budget, checks=checks(res, run, budget, clean))
            if run == "clean":
                clean = res
            rows.append(res)
            c = res["checks"]
            print(f"{backend} {run}: {res.get('epochs_done')}/{a.epochs} epochs in {res['wall_s']:.0f}s; "
                  + ", ".join(f"{k} {_verdict(v)}" for k, v in c.items())
                  + (f"; error: {res['error']}" if res.get("error") else ""), flush=True)
    device = next((r.get("device_name") for r in rows if r.get("device_name")), None) or a.device
    meta = {"device": device, "date": _dt.datetime.now().isoformat(timespec="seconds"),
            "host": platform.node(), "command": " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv]),
            "args": vars(a), "seconds": time.perf_counter() - t_all}
    verdict = all(v is not False for r in rows for v in r["checks"].values())
    print()
    print(table(rows))
    print(f"\nsoak {'PASS' if verdict else 'FAIL'}: {', '.join(a.backends)}, {a.epochs} epochs, budget {a.budget}, "
          f"an OOM every {a.every} steps, oom_cooldown {a.oom_cooldown or 'library default (1000)'}")
    print(f"device: {device}; {meta['date']}; {meta['command']}")
    slug = device_tag(str(device))
    result = {"meta": meta, "pass": verdict, "runs": rows}
    write_json(result, Path(a.out) if a.out else ROOT / "benchmarks" / "results" / "soak" / f"soak-{slug}.json")
    return result


if __name__ == "__main__":
    main()
