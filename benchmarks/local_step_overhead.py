"""Host time per step of the local trainer's graphed loop, the replay itself left out.

With its block steps replayed from CUDA graphs (issue 18) the local trainer is fast only while the host
work around each replay stays under the replay's GPU time (1.2-1.3 ms for ResNet-18's blocks at batch 64
on an H100, `benchmarks/step_bound.py`). This measures that host work: `LocalTrainer(cuda_graph=True)`
trains one block on synthetic uint8 images with the demo's augmentation (`triaccel.backends.torch.augment`)
while `GraphedStep` is replaced by a stand-in whose warm-up steps run the real step and whose "replay"
only copies the batch into static buffers. Per step that leaves the lr update, the sampler, the fetch
(indices to the device, gather, augmentation) and the copies.

    python benchmarks/local_step_overhead.py                  # CPU (fetch on CPU tensors)
    python benchmarks/local_step_overhead.py --device cuda    # the fetch's real kernel launches

Columns: us per step over the epochs after the first (the first holds the warm-up steps), median over
`--epochs - 1` epochs; `--fixed-batch` also times a fetch that returns one fixed batch (loop only).
Writes benchmarks/results/local/local-step-overhead-<device>.json.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
from typing import Any

import torch

from _results import device_tag, write_json
import triaccel.backends.torch.local as tl
from triaccel.backends.torch import augment
from triaccel.backends.torch.local import LocalTrainer, measure_layers, sequential_units
from triaccel.backends.torch.models import create_model
from triaccel.local_plan import LocalPlanConfig, plan_local


class _Replay:
    """GraphedStep's interface: real eager warm-up steps, then "replays" that copy the inputs only."""

    def __init__(self, fn: Any, params: Any, warmup: int = 3, stream: Any = None) -> None:
        self.fn, self.warmup, self.calls, self.warmup_ooms, self.pool_bytes = fn, warmup, 0, 0, 0
        self.static: list[torch.Tensor] = []

    @property
    def captured(self) -> bool:
        return self.calls > self.warmup

    def __call__(self, *inputs: torch.Tensor) -> None:
        if self.calls < self.warmup:
            self.fn(*inputs)
        elif not self.static:
            self.static = [x.clone() for x in inputs]
        else:
            for s, x in zip(self.static, inputs):
                s.copy_(x)
        self.calls += 1

    def run_eager(self, *inputs: torch.Tensor) -> None:
        self.fn(*inputs)

    def release(self) -> None:
        self.calls, self.static = 0, []


def measure(device: torch.device, n: int, batch: int, epochs: int, fixed: bool) -> dict[str, Any]:
    """One block over n images of 3x8x8 at `batch`; returns us per step (median of the later epochs)."""
    model = create_model("resnet18", num_classes=10, width=0.0625, seed=0).to(device)
    units, clf = sequential_units(model)
    table = measure_layers(units, torch.randn(2, 3, 8, 8, device=device), autocast_dtype=None)
    cfg = LocalPlanConfig(memory_budget="1GiB", batch_buckets=(batch,), max_blocks=1, input_bytes=3 * 8 * 8 * 4)
    plan = plan_local(table, cfg, num_samples=n, num_classes=10)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(0, 256, (n, 8, 8, 3), dtype=torch.uint8, generator=g, device=device)
    y = torch.randint(0, 10, (n,), generator=g, device=device)
    trainer = LocalTrainer(units, clf, plan, num_classes=10, device=device, lr=0.05, lr_batch=batch,
                           autocast_dtype=None, seed=0, cuda_graph=True)
    trainer.cuda_graph = True   # the graphed loop on any device, through the stand-in
    if fixed:
        one = augment.augment(x[:batch], g)

        def transform(xb: torch.Tensor) -> torch.Tensor:
            return one[:xb.shape[0]]
    else:
        def transform(xb: torch.Tensor) -> torch.Tensor:
            return augment.augment(xb, g)
    saved = tl.GraphedStep
    tl.GraphedStep = _Replay   # type: ignore[misc, assignment]
    try:
        rec = trainer.train(x, y, transform, [], lambda v: augment.augment(v, train=False), epochs)[0]
    finally:
        tl.GraphedStep = saved   # type: ignore[misc]
    steps = -(-n // batch)
    later = [s / steps * 1e6 for s in rec.epoch_seconds[1:]]
    return {"fetch": "fixed batch" if fixed else "augmented", "steps_per_epoch": steps,
            "graph_steps": rec.graph_steps, "us_per_step": statistics.median(later), "us_per_step_epochs": later}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--samples", type=int, default=50_000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--epochs", type=int, default=3, help=">= 2 (the first holds the warm-up steps)")
    p.add_argument("--fixed-batch", action="store_true", help="also time a fetch returning one fixed batch")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.epochs < 2:
        p.error(f"--epochs={a.epochs}: allowed >= 2 (the first epoch holds the warm-up steps)")
    dev = torch.device(a.device)
    rows = [measure(dev, a.samples, a.batch, a.epochs, fixed) for fixed in ([False, True] if a.fixed_batch else [False])]
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    meta = {"device": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "torch": torch.__version__,
            "samples": a.samples, "batch": a.batch, "epochs": a.epochs, "cpu_threads": torch.get_num_threads()}
    print("#", meta)
    print(f"{'fetch':<14}{'steps/epoch':>12}{'us/step':>10}")
    for r in rows:
        print(f"{r['fetch']:<14}{r['steps_per_epoch']:>12}{r['us_per_step']:>10.1f}")
    out = {"meta": meta, "rows": rows}
    write_json(out, a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "local",
                                          f"local-step-overhead-{device_tag(name)}.json"))
    return out


if __name__ == "__main__":
    main()
