"""Host time per step of the demo's elastic step against a plain loop step (issue 15, "the demo harness
costs <= 5% over a plain loop"): what `elastic_step`'s bookkeeping adds where a step is host-bound.

Both loops run the same tiny model (one Linear layer) on a device-resident dataset, so the model costs
almost nothing and the difference is the harness: index bookkeeping (`ElasticSampler`), the index
upload, the micro-batch weighting, the controller's decision and the step record. Variants, timed
interleaved over `--rounds` rounds of `--steps` steps (median per-step microseconds):

  plain    randperm slice on the device, index, forward, backward, SGD step, zero_grad (a user's loop);
  elastic  `elastic_step(loader, Controller(cfg, ["model"]), ...)` with every lever off, as the demo's
           `--method amp` runs it.

    python benchmarks/elastic_host_cost.py                      # CPU (or --device cuda)
    python benchmarks/elastic_host_cost.py --profile 2000       # also cProfile the elastic variant

Prints a table; writes benchmarks/results/elastic_host_cost-<device>.json (or --out).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as _dt
import io
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from triaccel import Controller, TriAccelConfig  # noqa: E402
from triaccel.backends.torch.data import ElasticLoader, elastic_step  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_json  # noqa: E402


def build(args: argparse.Namespace, dev: torch.device):
    torch.manual_seed(0)
    x = torch.randn(args.samples, 8, device=dev)
    y = torch.randint(0, 2, (args.samples,), device=dev)
    model = torch.nn.Linear(8, 2).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    return x, y, model, opt


def plain_variant(args: argparse.Namespace, dev: torch.device):
    x, y, model, opt = build(args, dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    state = {"perm": torch.randperm(len(x), device=dev, generator=gen), "i": 0}

    def step() -> None:
        i = state["i"]
        if i + args.batch > len(x):
            state["perm"], i = torch.randperm(len(x), device=dev, generator=gen), 0
        idx = state["perm"][i:i + args.batch]
        state["i"] = i + args.batch
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def elastic_variant(args: argparse.Namespace, dev: torch.device):
    x, y, model, opt = build(args, dev)
    cfg = TriAccelConfig(batch_init=args.batch, batch_min=8, batch_max=args.batch, adaptive_precision=False,
                         elastic_batch=False, curvature="off")
    controller = Controller(cfg, ["model"])
    loader = ElasticLoader(x, y, batch_size=args.batch, seed=0)
    state = {"step": 0}

    def loss_fn(batch):
        return F.cross_entropy(model(batch[0]), batch[1])

    def step() -> None:
        elastic_step(loader, controller, loss_fn, opt, state["step"])
        state["step"] += 1
    return step


def timed(step, steps: int, sync) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - t0) / steps * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--samples", type=int, default=50_000)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile N elastic steps (top functions)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    for name in ("batch", "samples", "steps", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}={getattr(args, name)}: allowed >= 1")
    if args.batch % 8 or args.batch > args.samples:
        ap.error(f"--batch={args.batch}: allowed a multiple of 8 up to --samples")
    dev = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    variants = {"plain": plain_variant(args, dev), "elastic": elastic_variant(args, dev)}
    for step in variants.values():   # warm-up
        for _ in range(20):
            step()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.rounds):
        for k in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            times[k].append(timed(variants[k], args.steps, sync))
    med = {k: statistics.median(v) for k, v in times.items()}
    meta = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({platform.machine()})",
            "torch": torch.__version__, "command": " ".join([Path(sys.executable).name, *sys.argv])}
    prof = None
    if args.profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.profile):
            variants["elastic"]()
        sync()
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
        prof = buf.getvalue()
        print(prof)
    print(f"# {meta['device']}  torch {meta['torch']}  {meta['date']}")
    print(f"# {meta['command']}")
    print(f"{'variant':<10}{'us/step':>10}{'- plain':>10}")
    for k in variants:
        print(f"{k:<10}{med[k]:>10.1f}{med[k] - med['plain']:>10.1f}")
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"elastic_host_cost-{dev.type}.json"
    write_json({"meta": meta, "args": vars(args), "us_per_step": med, "rounds": times, "profile": prof}, out)


if __name__ == "__main__":
    main()
