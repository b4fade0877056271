"""Issue 18's comparison: local learning (`--method local`) against end-to-end AMP training under the same budget.

    python3 benchmarks/local_vs_e2e.py --data ../shared/data/cifar10-jpeg --seeds 0 1 2 \
        [--budget e2e:32] [--variants e2e local local-fresh] [--model resnet18] [--epochs 10] [--local-epochs 20]

Per seed, every variant runs in its own process, one after the other (so the ratios are within one call):
``e2e`` = the demo's AMP-bf16 run at batch B, the largest end-to-end batch under the budget (``--budget
e2e:B``: B; a byte budget needs ``--e2e-batch``); ``local`` = ``--method local --budget ...`` with its
defaults (cached views: auto); ``local-fresh`` = the same with ``--block-inputs fresh`` (no cache);
``e2e-graph`` = e2e with ``--compile reduce-overhead`` (torch.compile's CUDA graphs: the end-to-end
step is host-bound too, so this is the stronger plain alternative; its ratio column "/ graph");
``local-eager`` / ``local-fresh-eager``: the same with ``--cuda-graph off`` (every block step eager).
``--epochs``: end-to-end's epochs, and each block's unless ``--local-epochs`` gives the local runs their
own (column "ep": a run's epochs, per block for local runs). Columns: best exit's accuracy and its
difference to e2e in points (target >= -1), the chosen exit's accuracy and its parameter reduction,
training seconds (epochs + cache building; e2e: its epochs) and their ratio to e2e's in the same seed (target <= 0.43), the run's process wall ("wall s": start-up, data,
planning and its memory probes, evaluations included) and its ratio to e2e's ("wall/e2e"), peak allocation
against the budget and the allocator's peak reservation (a CUDA graph's pool is reserved for the block's
training).
Writes benchmarks/results/local/local-vs-e2e-<model>-<device>.json (every summary and the table).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

from _results import device_tag, run_demo, write_json

VARIANTS: dict[str, list[str]] = {"e2e": [], "e2e-graph": ["--compile", "reduce-overhead"],
                                  "local": ["--method", "local"],
                                  "local-fresh": ["--method", "local", "--block-inputs", "fresh"],
                                  "local-eager": ["--method", "local", "--cuda-graph", "off"],
                                  "local-fresh-eager": ["--method", "local", "--block-inputs", "fresh",
                                                        "--cuda-graph", "off"]}
TARGET_POINTS, TARGET_RATIO = -1.0, 0.43


def e2e_batch(budget: str, given: int | None) -> int:
    """End-to-end's batch: B of "e2e:B", else `given` (required for a byte budget)."""
    if budget.startswith("e2e:"):
        b = budget[4:]
        if not b.isdigit() or int(b) < 1:
            raise ValueError(f"--budget={budget!r}: e2e:B needs a batch B >= 1")
        if given is not None and given != int(b):
            raise ValueError(f"--e2e-batch={given}: --budget {budget} already fixes it at {b}")
        return int(b)
    if given is None or given < 1:
        raise ValueError(f"--e2e-batch={given!r}: a byte budget ({budget}) needs end-to-end's batch, >= 1")
    return given


def train_seconds(run: dict[str, Any]) -> float:
    """Training seconds of a summary: local's train_seconds (epochs + caches), else the sum of epochs."""
    return float(run["train_seconds"]) if "train_seconds" in run else float(sum(run["epoch_seconds"]))


def epochs_of(run: dict[str, Any]) -> str | None:
    """A run's epochs as given to the demo: --block-epochs (comma-separated) or --epochs; None if unknown."""
    blocks = (run.get("local_options") or {}).get("block_epochs")
    if blocks:
        return ",".join(map(str, blocks))
    epochs = (run.get("options") or {}).get("epochs") if isinstance(run.get("options"), dict) else None
    return None if epochs is None else str(epochs)


def progress_of(log: Path) -> dict[str, Any] | None:
    """What a failed or killed run finished before it stopped, from its log.jsonl: its epoch records'
    count ("epochs_done"), the last test accuracy (fraction, None when it was not evaluated) and the
    epochs' seconds; None without epoch records. A run killed at --run-timeout has no summary, so
    this is all that says how far it got; it never stands in for a finished run's figures."""
    if not log.is_file():
        return None
    epochs = []
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:   # a line cut off by the kill
            continue
        if rec.get("type") == "epoch":
            epochs.append(rec)
    if not epochs:
        return None
    return {"epochs_done": len(epochs), "last_test_acc": epochs[-1].get("test_acc"),
            "epoch_seconds": float(sum(e.get("seconds") or 0.0 for e in epochs))}


def rows_of(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (variant, seed) with its same-seed e2e ratios, then one mean row per variant.

    runs: summaries with "variant" and "seed" added (a failed run: {"variant", "seed", "failed"}, and
    "progress" (`progress_of`) when it logged epochs before it stopped)."""
    e2e = {r["seed"]: r for r in runs if r["variant"] == "e2e" and "failed" not in r}
    graph = {r["seed"]: r for r in runs if r["variant"] == "e2e-graph" and "failed" not in r}
    rows = []
    for r in runs:
        if "failed" in r:
            rows.append({"variant": r["variant"], "seed": r["seed"], "failed": True, "progress": r.get("progress")})
            continue
        local = "exit_accs" in r
        best = max(r["exit_accs"]) if local else r["final_acc"]
        base = e2e.get(r["seed"])
        secs = train_seconds(r)
        rows.append({
            "variant": r["variant"], "seed": r["seed"], "best_acc": best,
            "chosen_acc": r["chosen_acc"] if local else r["final_acc"],
            "param_reduction": r["param_reduction"] if local else 1.0,
            "best_exit_param_reduction": (r["model_params"] / r["exit_params"][r["exit_accs"].index(best)]
                                          if local else 1.0),
            "train_s": secs, "points_vs_e2e": None if base is None else 100 * (best - base["final_acc"]),
            "ratio_vs_e2e": None if base is None else secs / train_seconds(base),
            "ratio_vs_e2e_graph": (secs / train_seconds(graph[r["seed"]])) if r["seed"] in graph else None,
            # the whole process (start-up, data, planning and its memory probes, every evaluation): the
            # user's wait, which training seconds leave out
            "wall_s": r.get("wall_s"),
            "wall_ratio_vs_e2e": (r["wall_s"] / base["wall_s"]
                                  if base is not None and r.get("wall_s") and base.get("wall_s") else None),
            "peak_bytes": r.get("peak_alloc_bytes"), "reserved_bytes": r.get("peak_reserved_bytes"),
            "budget_bytes": r.get("memory_budget_bytes"), "epochs": epochs_of(r),
        })
    for v in dict.fromkeys(r["variant"] for r in rows):
        ok = [r for r in rows if r["variant"] == v and not r.get("failed")]
        if not ok:
            continue

        def mean(key: str) -> float | None:
            vals = [r[key] for r in ok if r[key] is not None]
            return statistics.fmean(vals) if vals else None

        rows.append({"variant": v, "seed": "mean", "best_acc": mean("best_acc"), "chosen_acc": mean("chosen_acc"),
                     "param_reduction": mean("param_reduction"),
                     "best_exit_param_reduction": mean("best_exit_param_reduction"), "train_s": mean("train_s"),
                     "points_vs_e2e": mean("points_vs_e2e"), "ratio_vs_e2e": mean("ratio_vs_e2e"),
                     "ratio_vs_e2e_graph": mean("ratio_vs_e2e_graph"), "wall_s": mean("wall_s"),
                     "wall_ratio_vs_e2e": mean("wall_ratio_vs_e2e"),
                     "epochs": ok[0]["epochs"] if len({r["epochs"] for r in ok}) == 1 else None,
                     "peak_bytes": max((r["peak_bytes"] or 0) for r in ok) or None,
                     "reserved_bytes": max((r["reserved_bytes"] or 0) for r in ok) or None,
                     "budget_bytes": ok[0]["budget_bytes"],
                     "seeds": len(ok)})
    return rows


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'variant':<13}{'seed':>5}{'ep':>4}{'best %':>8}{'pts':>7}{'chosen %':>10}{'x fewer':>9}{'train s':>9}"
          f"{'/ e2e':>7}{'/ graph':>8}{'wall s':>8}{'wall/e2e':>9}{'peak MiB':>10}{'res. MiB':>10}")
    for r in rows:
        if r.get("failed"):
            g = r.get("progress")
            acc = None if g is None or g["last_test_acc"] is None else 100 * g["last_test_acc"]
            print(f"{r['variant']:<13}{r['seed']:>5}  failed" + ("" if g is None else
                  f" after {g['epochs_done']} epoch(s) ({g['epoch_seconds']:.1f} s; last test acc "
                  f"{_fmt(acc, '.2f')}%): no ratio"))
            continue
        pct = (lambda v: None if v is None else 100 * v)
        print(f"{r['variant']:<13}{str(r['seed']):>5}{r.get('epochs') or '-':>4}{_fmt(pct(r['best_acc']), '.2f'):>8}"
              f"{_fmt(r['points_vs_e2e'], '+.2f'):>7}{_fmt(pct(r['chosen_acc']), '.2f'):>10}"
              f"{_fmt(r['param_reduction'], '.1f'):>9}{_fmt(r['train_s'], '.1f'):>9}{_fmt(r['ratio_vs_e2e'], '.2f'):>7}"
              f"{_fmt(r['ratio_vs_e2e_graph'], '.2f'):>8}{_fmt(r['wall_s'], '.1f'):>8}"
              f"{_fmt(r['wall_ratio_vs_e2e'], '.2f'):>9}"
              f"{_fmt(None if r['peak_bytes'] is None else r['peak_bytes'] / 2**20, '.0f'):>10}"
              f"{_fmt(None if r['reserved_bytes'] is None else r['reserved_bytes'] / 2**20, '.0f'):>10}")
    print(f"targets: best exit >= e2e {TARGET_POINTS:+.0f} point, training <= {TARGET_RATIO}x e2e's (same seed, "
          "same call); wall: each run's whole process")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["e2e", "local", "local-fresh"])
    p.add_argument("--model", choices=["resnet18", "efficientnet_b0"], default="resnet18")
    p.add_argument("--backend", choices=["torch", "jax"], default="torch")
    p.add_argument("--epochs", type=int, default=10, help="end-to-end's epochs (and each block's by default)")
    p.add_argument("--local-epochs", type=int, default=None,
                   help="each block's epochs in the local runs (default: --epochs); e.g. 20 against e2e's 10")
    p.add_argument("--budget", default="e2e:32", help="the local runs' --budget (e2e:B or bytes)")
    p.add_argument("--e2e-batch", type=int, default=None, help="end-to-end's batch under a byte budget")
    p.add_argument("--workdir", default=str(Path(__file__).resolve().parents[1]))
    p.add_argument("--runs", default="/tmp/local-vs-e2e", help="where each run's --out goes")
    p.add_argument("--out", default=None)
    p.add_argument("--local-args", default="", help="extra demo options for the local variants only, e.g. "
                   "\"--graph-reserve 64MiB\" (one string)")
    p.add_argument("--e2e-args", default="", help="extra demo options for the end-to-end variants only, e.g. "
                   "\"--lr 0.0083\" (its best rate for EfficientNet-B0 at batch 32; one string)")
    p.add_argument("--run-timeout", type=float, default=None, help="seconds: a run still going then counts as failed")
    p.add_argument("demo_args", nargs=argparse.REMAINDER, help="after --: extra options for every run")
    a = p.parse_args(argv)
    for name in ("epochs", "local_epochs"):
        v = getattr(a, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')}={v}: allowed [1, inf)")
    try:
        batch = e2e_batch(a.budget, a.e2e_batch)
    except ValueError as exc:
        p.error(str(exc))
    extra = [x for x in a.demo_args if x != "--"]
    runs: list[dict[str, Any]] = []
    out: dict[str, Any] = {}
    for seed in a.seeds:
        for v in a.variants:
            epochs = a.epochs if v.startswith("e2e") or a.local_epochs is None else a.local_epochs
            opts = ["--backend", a.backend, "--model", a.model, "--epochs", str(epochs), "--data", a.data,
                    "--seed", str(seed), "--no-progress", *extra]
            opts += (["--method", "amp", "--batch", str(batch), *VARIANTS[v], *shlex.split(a.e2e_args)] if v.startswith("e2e")
                     else [*VARIANTS[v], "--budget", a.budget, *shlex.split(a.local_args)])
            run_dir = Path(a.runs) / f"{v}-s{seed}"
            s = run_demo(opts, run_dir, a.workdir, timeout=a.run_timeout)
            tag = {"variant": v, "seed": seed}
            runs.append({**tag, "failed": True, "progress": progress_of(run_dir / "log.jsonl")} if s is None
                        else {**s, **tag})
            out = write_report(runs, batch, a)   # after every run: a call cut short keeps what finished
    print("#", out["meta"])
    print_table(out["rows"])
    return out


def write_report(runs: list[dict[str, Any]], batch: int, a: argparse.Namespace) -> dict[str, Any]:
    """The rows of `runs` with this call's metadata, written to --out (or the default path)."""
    rows = rows_of(runs)
    device = next((r.get("device_name") for r in runs if r.get("device_name")), "unknown (no run finished)")
    meta = {"device": device, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "e2e_batch": batch}
    out = {"meta": meta, "rows": rows, "runs": runs}
    write_json(out, a.out or Path(__file__).resolve().parent / "results" / "local" /
               f"local-vs-e2e-{a.model}-{device_tag(device)}.json")
    return out


if __name__ == "__main__":
    main()
