"""Compiled vs eager training steps: plain AMP-bf16 loop and triaccel, eager and torch.compile'd.

ResNet-18 (CIFAR variant), synthetic CIFAR-10-shaped batches (3x32x32, 10 classes) resident on the
device, SGD-nesterov, one static batch (default 384), the same precision for both methods (bf16:
triaccel's evidence law keeps its base precision without evidence; the batch lever is off so that
both run the same batch). Six variants, each with its own model from the same initial weights:

  amp-eager, amp-default, amp-reduce-overhead (torch.autocast(bf16), backward, step, zero_grad)
  tri-eager, tri-default, tri-reduce-overhead (`wrap(...)`: opt.autocast(), opt.backward, step, zero_grad)

Compiled variants go through `triaccel.backends.torch.compile.compile_model` (`--dynamic-batch`:
the batch dim dynamic, as in the demo, or static). Each variant first runs `--warmup` steps (the
compilations and CUDA-graph recordings: reported as `warmup_s`, with the number of graphs dynamo
compiled and its graph breaks), then `--rounds` interleaved rounds of `--steps` consecutive steps
synchronised only at both ends (the variant order rotates each round). s/epoch-equivalent =
median step time x ceil(50,000 / batch); ratios are against amp-eager measured in the same run.

    python benchmarks/compiled.py                               # GPU (inductor), table + JSON
    python benchmarks/compiled.py --dynamic-batch off           # static batch shape instead
    python benchmarks/compiled.py --tiny                        # CPU smoke test (aot_eager backend)

Modes are inductor's: with another backend (the CPU smoke test's aot_eager) the reduce-overhead rows
run the default rows' graphs (dynamo shares them: 0 graphs compiled), so only GPU figures compare modes.

Writes benchmarks/results/compiled/compiled-<device>-<dynamic|static>.json (or --out).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from triaccel import TriAccelConfig
from triaccel.backends.torch import wrap
from triaccel.backends.torch.compile import compile_model
from triaccel.backends.torch.models import create_model
from _results import device_tag, write_json

CIFAR_TRAIN = 50_000
METHODS = ("amp", "tri")
COMPILES = ("eager", "default", "reduce-overhead")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _graph_stats() -> tuple[int, int]:
    """(graphs dynamo compiled, graph breaks) so far in this process."""
    return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))


class Variant:
    """One method x compile setting: its own model, optimizer and step function."""

    def __init__(self, method: str, compile_mode: str, args: argparse.Namespace, dev: torch.device) -> None:
        self.name = f"{method}-{compile_mode}"
        self.method, self.compile_mode = method, compile_mode
        model = create_model("resnet18", num_classes=10, width=args.width, seed=args.seed).to(dev)
        if dev.type == "cuda":
            model = model.to(memory_format=torch.channels_last)
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
        opt: Any = inner
        if method == "tri":
            b = args.batch
            cfg = TriAccelConfig(batch_init=b, batch_min=b, batch_max=b, elastic_batch=False,
                                 base_precision="bf16", t_ctrl=args.t_ctrl)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)   # CPU: the memory probe does not measure
                opt = wrap(inner, model, cfg)
        fwd: Any = model
        if compile_mode != "eager":
            mode = compile_mode if args.backend == "inductor" else None   # modes are inductor's
            fwd = compile_model(model, opt if method == "tri" else None, mode=mode, backend=args.backend,
                                dynamic_batch=args.dynamic_batch == "on")
        self.model, self.opt, self.fwd, self.dev = model, opt, fwd, dev
        self.losses: list[torch.Tensor] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.method == "amp":
            with torch.autocast(self.dev.type, dtype=torch.bfloat16):
                loss = F.cross_entropy(self.fwd(x), y)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        else:
            with self.opt.autocast():
                loss = F.cross_entropy(self.fwd(x), y)
            self.opt.backward(loss)
            self.opt.step()
            self.opt.zero_grad()
        self.last_loss = loss.detach()


def _run(v: Variant, batches: list[tuple[torch.Tensor, torch.Tensor]], steps: int, start: int) -> float:
    """Seconds per step over `steps` consecutive steps, synchronised at both ends."""
    _sync(v.dev)
    t0 = time.perf_counter()
    for i in range(steps):
        v.step(*batches[(start + i) % len(batches)])
    _sync(v.dev)
    return (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=384)
    p.add_argument("--width", type=float, default=1.0, help="ResNet-18 channel width multiplier")
    p.add_argument("--steps", type=int, default=40, help="timed steps per variant per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=8, help="untimed steps per variant first (compilation)")
    p.add_argument("--pool", type=int, default=8, help="distinct synthetic batches cycled through")
    p.add_argument("--t-ctrl", type=int, default=50, help="triaccel control interval (statistics flushes)")
    p.add_argument("--variants", default=",".join(f"{m}-{c}" for m in METHODS for c in COMPILES))
    p.add_argument("--dynamic-batch", choices=["on", "off"], default="on")
    p.add_argument("--backend", default=None, help="torch.compile backend (default inductor; aot_eager on CPU)")
    p.add_argument("--cudnn-benchmark", choices=["on", "off"], default="off")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="CPU smoke settings: bs 8, width 0.125, 2 steps x 2 rounds")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if args.tiny:
        args.batch, args.width, args.steps, args.rounds, args.warmup, args.pool = 8, 0.125, 2, 2, 2, 2
    if args.backend is None:
        args.backend = "inductor" if dev.type == "cuda" else "aot_eager"
    for name, lo in (("batch", 2), ("steps", 1), ("rounds", 1), ("warmup", 1), ("pool", 1), ("t_ctrl", 1)):
        if getattr(args, name) < lo:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: allowed >= {lo}")
    names = [n for n in args.variants.split(",") if n]
    allowed = [f"{m}-{c}" for m in METHODS for c in COMPILES]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        p.error(f"--variants: unknown {bad}; allowed {allowed}")
    if dev.type == "cuda":
        torch.backends.cudnn.benchmark = args.cudnn_benchmark == "on"

    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    batches = []
    for _ in range(args.pool):
        x = torch.randn(args.batch, 3, 32, 32, generator=gen).to(dev)
        if dev.type == "cuda":
            x = x.contiguous(memory_format=torch.channels_last)
        batches.append((x, torch.randint(0, 10, (args.batch,), generator=gen).to(dev)))

    variants: list[Variant] = []
    warm: dict[str, dict[str, Any]] = {}
    for n in names:
        method, mode = n.split("-", 1)
        v = Variant(method, mode, args, dev)
        g0, b0 = _graph_stats()
        t = _run(v, batches, args.warmup, 0) * args.warmup
        g1, b1 = _graph_stats()
        warm[n] = {"warmup_s": t, "graphs": g1 - g0, "graph_breaks": b1 - b0,
                   "policies": len(v.opt.plan.keys_seen) if method == "tri" else None}
        variants.append(v)
        print(f"warm-up {n}: {t:.2f} s, {g1 - g0} graph(s), {b1 - b0} break(s)", flush=True)

    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(args.rounds):
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            times[v.name].append(_run(v, batches, args.steps, args.warmup + r * args.steps))
    steps_per_epoch = math.ceil(CIFAR_TRAIN / args.batch)
    base = "amp-eager" if "amp-eager" in times else names[0]
    base_step = statistics.median(times[base])
    rows = []
    for v in variants:
        step = statistics.median(times[v.name])
        loss = float(v.last_loss)
        rows.append({"variant": v.name, "step_s_median": step, "step_s_all": times[v.name],
                     "s_per_epoch_equiv": step * steps_per_epoch, "ratio_vs_" + base: step / base_step,
                     "final_loss": loss, "loss_finite": math.isfinite(loss), **warm[v.name]})

    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    print(f"\nResNet-18 CIFAR-10 shapes, bs {args.batch}, width {args.width}, {dev_name}, backend "
          f"{args.backend}, batch dim {'dynamic' if args.dynamic_batch == 'on' else 'static'}; "
          f"median of {args.rounds} rounds x {args.steps} steps; epoch = {steps_per_epoch} steps")
    print(f"{'variant':<22}{'ms/step':>10}{'s/epoch':>10}{'vs ' + base:>16}{'warm-up s':>11}{'graphs':>8}"
          f"{'breaks':>8}")
    for row in rows:
        print(f"{row['variant']:<22}{1e3 * row['step_s_median']:>10.2f}{row['s_per_epoch_equiv']:>10.3f}"
              f"{row['ratio_vs_' + base]:>16.3f}{row['warmup_s']:>11.2f}{row['graphs']:>8}{row['graph_breaks']:>8}")
    tri = {r["variant"]: r for r in rows if r["variant"].startswith("tri-")}
    for c in COMPILES:
        a, t = f"amp-{c}", f"tri-{c}"
        if a in times and t in tri:
            print(f"triaccel / AMP step ({c}): {tri[t]['step_s_median'] / statistics.median(times[a]):.3f}")

    result = {
        "benchmark": "compiled", "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "device": str(dev), "device_name": dev_name, "torch": torch.__version__, "backend": args.backend,
        "options": vars(args), "steps_per_epoch": steps_per_epoch, "baseline": base, "rows": rows,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    tag = device_tag(dev_name, empty=dev.type)
    out = Path(args.out) if args.out else (Path(__file__).parent / "results" / "compiled" /
                                           f"compiled-{tag}-{'dynamic' if args.dynamic_batch == 'on' else 'static'}"
                                           f"{'-tiny' if args.tiny else ''}.json")
    write_json(result, out)
    return result


if __name__ == "__main__":
    main()
