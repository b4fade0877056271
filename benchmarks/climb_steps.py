"""What the batch climb costs in steps: the demo's controller (the real `triaccel.Controller` with the
demo's config) driven over a whole run by a gradient noise scale B_noise given in samples, no GPU.

Where a step costs the same at every batch size (a step bound by kernel launches or by the host, as
EfficientNet-B0's on an H100, ~34 ms from bs 96 to 512; docs/results.md), a run's time is its number
of forward/backward passes, and triaccel's climb from its first batch is what it pays over a static
batch. This counts them: optimizer steps, passes (a gradient-noise step runs as two micro-batches),
the step at which each batch size was reached, and passes / the static batch's passes.

Each noise measurement is synthesised exactly for the given B_noise (|G|^2 = 1, tr(Sigma) = B_noise:
a micro-batch or step of b samples has |g|^2 = 1 + B_noise / b; under noise_split="steps", JAX's, every
step's row is fed), so the law sees a noise-free estimate: the counts are the law's own floor (real
estimates scatter, docs/results.md). Memory is not the limit.

    python3 benchmarks/climb_steps.py --b-noise 1000 --static 512 \
        --variant "" --variant "--set t_noise=10" --variant "--warmup-steps 50 --set t_noise=10"

Each --variant is a string of extra demo options (`python -m examples.cifar.train`) on top of
`--method triaccel --batch B --batch-max M --epochs E`; "" is the demo's defaults (torch's; "--backend jax"
for JAX's ladder and noise split). Prints a table and writes JSON (default benchmarks/results/climb_steps.json).

Where the step's cost does depend on the batch (a CUDA-graphed step is bound by the GPU's kernels: ~7 /
10 / 19 ms at bs 96 / 192 / 512 for EfficientNet-B0, `benchmarks/step_bound.py`, H100, 2026-11-23),
`--step-ms B:MS` (repeatable) gives measured pass costs; other sizes are interpolated linearly between
them and held at the end values outside (a bs-48 noise half is charged as bs 96: an upper bound). The
table then adds the modelled pass time against the static batch's.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
from _results import write_json

from triaccel import Controller
from triaccel.batching import short_step_weight
from triaccel.elastic import ElasticIndexLoader, controlled_step, noise_split

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # examples/ (the demo's options and config)


class _Indices(ElasticIndexLoader):
    """The elastic loader's bookkeeping with nothing to load: a batch is its indices."""

    def fetch(self, indices: np.ndarray) -> np.ndarray:
        return indices


def pass_cost(table: dict[int, float]) -> Callable[[int], float]:
    """ms of one forward/backward pass at batch b from {batch: ms}: linear between the given batches,
    the end values outside them."""
    xs = sorted(table)
    ys = [table[x] for x in xs]
    return lambda b: float(np.interp(b, xs, ys))


def static_ms(cost: Callable[[int], float], static: int, epochs: int, images: int) -> float:
    """The static batch's passes priced by `cost`: full batches and each epoch's short last one."""
    full, rest = divmod(images, static)
    return epochs * (full * cost(static) + (cost(rest) if rest else 0.0))


def simulate(variant: str, b_noise: float, batch: int, batch_max: int, epochs: int, images: int,
             cost: Callable[[int], float] | None = None) -> dict[str, Any]:
    """One run of the demo's controller over `epochs` x `images` samples at a constant B_noise, each
    step through the backends' shared `controlled_step` (its noise split, its epoch tails). cost: ms
    per pass at a micro-batch size (`pass_cost`); with it the result holds the modelled ``time_ms``."""
    from examples.cifar import train

    opts = train.parse_args(["--method", "triaccel", "--batch", str(batch), "--batch-max", str(batch_max),
                             "--epochs", str(epochs), *shlex.split(variant)])
    ctl = Controller(opts.triaccel_config(), ["model"])
    rows = ctl.config.noise_split == "steps"
    loader = _Indices(images, batch_size=batch)
    reached: dict[int, int] = {}   # batch size -> first step at it
    samples_at: dict[int, int] = {}

    time_ms = [0.0]

    def finish(decision: Any, report: Any) -> int:
        sizes = list(report.sizes)
        if cost is not None:
            time_ms[0] += sum(cost(n) for n in sizes)
        reached.setdefault(decision.batch_size, step)
        samples_at[decision.batch_size] = samples_at.get(decision.batch_size, 0) + report.num_samples
        if rows:   # noise_split="steps": every step's row as applied (its short-step weight w: w^2 |g|^2)
            w = short_step_weight(ctl.config.short_step_lr, report.num_samples, decision.logical_batch)
            ctl.observe_noise_rows([step], np.array([[w * w * (1.0 + b_noise / report.num_samples)]]), np.array([True]))
        elif len(sizes) >= 2:   # the noise step's halves, each measured exactly: |g|^2 = 1 + B_noise / b
            ctl.observe_gradient_noise(step, sizes, [[1.0 + b_noise / n] for n in sizes], [1.0 + b_noise / sum(sizes)])
        return len(sizes)

    step = passes = done = 0
    while done < epochs:
        passes += controlled_step(loader, ctl, step, run_micro=lambda chunk, w: None, finish=finish,
                                  is_oom=lambda e: False, free_memory=lambda: None, split=noise_split(ctl, step))
        done += loader.end_of_epoch
        step += 1
    out = {"variant": variant, "steps": step, "passes": passes, "reached": reached, "samples_at": samples_at}
    return out if cost is None else {**out, "time_ms": time_ms[0]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--b-noise", type=float, nargs="+", default=[1000.0], help="B_noise values (samples), one run each")
    p.add_argument("--variant", action="append", default=None, help='extra demo options ("" = defaults); repeatable')
    p.add_argument("--batch", type=int, default=96, help="the demo's --batch (initial)")
    p.add_argument("--batch-max", type=int, default=512)
    p.add_argument("--static", type=int, default=512, help="the static batch compared against")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--train-images", type=int, default=50000)
    p.add_argument("--step-ms", action="append", default=None, metavar="B:MS",
                   help="measured ms of one pass at batch B (repeatable; module docstring)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "climb_steps.json"))
    a = p.parse_args(argv)
    table: dict[int, float] = {}
    for item in a.step_ms or []:
        b, sep, ms = item.partition(":")
        try:
            if not sep or int(b) < 1 or not (float(ms) > 0 and math.isfinite(float(ms))):
                raise ValueError
        except ValueError:
            p.error(f"--step-ms {item!r}: expected B:MS with an integer batch B >= 1 and a time MS > 0 (ms)")
        table[int(b)] = float(ms)
    cost = pass_cost(table) if table else None
    for name in ("batch", "batch_max", "static", "epochs", "train_images"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(a, name)}: allowed an integer >= 1")
    if any(not (b > 0 and math.isfinite(b)) for b in a.b_noise):
        p.error(f"--b-noise={a.b_noise}: allowed finite values > 0 (samples)")
    variants = a.variant if a.variant is not None else [""]
    static = a.epochs * math.ceil(a.train_images / a.static)
    rows = [{"b_noise": b, **simulate(v, b, a.batch, a.batch_max, a.epochs, a.train_images, cost)}
            for b in a.b_noise for v in variants]
    static_t = None if cost is None else static_ms(cost, a.static, a.epochs, a.train_images)
    print(f"# batch climb from {a.batch} (max {a.batch_max}), {a.epochs} epochs x {a.train_images} images; static "
          f"bs {a.static}: {static} passes" + ("" if static_t is None else f", {static_t / 1e3:.2f} s of passes"))
    print(f"{'B_noise':>8} {'variant':<50} {'steps':>6} {'passes':>7} {'/static':>8}"
          + ("" if cost is None else f" {'time s':>7} {'/static':>8}") + "  first step at each batch")
    for r in rows:
        r["passes_vs_static"] = r["passes"] / static
        timed = ""
        if static_t is not None:
            r["time_vs_static"] = r["time_ms"] / static_t
            timed = f" {r['time_ms'] / 1e3:>7.2f} {r['time_vs_static']:>8.3f}"
        firsts = ", ".join(f"{b}@{s}" for b, s in sorted(r["reached"].items()))
        print(f"{r['b_noise']:>8.0f} {r['variant'] or '(defaults)':<50} {r['steps']:>6} {r['passes']:>7} "
              f"{r['passes_vs_static']:>8.3f}{timed}  {firsts}")
    result = {"benchmark": "climb_steps", "date": _dt.datetime.now().isoformat(timespec="seconds"),
              "command": shlex.join([sys.executable, *sys.argv]), "static_passes": static, "static_ms": static_t,
              "step_ms": {str(b): ms for b, ms in sorted(table.items())}, "args": vars(a), "rows": rows}
    write_json(result, a.out)
    return result


if __name__ == "__main__":
    main()
