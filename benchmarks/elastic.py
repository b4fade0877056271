"""GPU check of memory-elastic batching (issue 6): climb to the budget, survive injected OOMs.

ResNet-18 on CIFAR-10, AMP-bf16, data and augmentation on the device. Three phases in one run:

  static   plain loop at bs 96 (the AMP-bf16 baseline): samples/s, peak allocated bytes.
  climb    `elastic_step` under the controller from bs 96 inside `--budget` (the allocator is also
           capped at the budget with `enforce_memory_budget` unless --no-enforce): the batch follows
           measured memory up to the largest size that fits; peak allocated (max over the probe's
           per-window peaks) vs the budget; samples/s over the second half of the phase.
  inject   one epoch with `--inject` torch.OutOfMemoryError raised at chosen micro-steps (every
           other micro-batch until the count is reached); a per-sample counter, independent of the
           loader's bookkeeping, shows samples lost (count 0) and repeated (count > 1).
           The law lowers its batch ceiling below every size that failed, so this phase starts at
           the climbed batch and uses `--inject-oom-shrink` (default 0.99: one grid step per OOM)
           so that 100 OOMs fit above batch_min; it is printed with the results.

Prints a table and machine/date/command; writes benchmarks/results/elastic-<device>.json.
On the device: untar the data (`tar -xzf cifar10-jpeg.tgz -C ..`, see DESIGN.md) or pass --data.
Each injected OOM lowers the batch by one grid step (8) at oom_shrink 0.99, so 100 injections need a
climbed batch above ~808 (two injections per step); otherwise the phase stops at batch_min and says so.
CPU smoke test (no memory measurement there, so the batch does not climb):
  python benchmarks/elastic.py --device cpu --model tiny --data synthetic --subset 512 --steps 5 --inject 4
"""

from __future__ import annotations

import argparse
import datetime as _dt
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from triaccel import Controller, OOMAtMinimumBatch, TriAccelConfig, parse_bytes
from triaccel.backends.torch.data import ElasticLoader, elastic_step, enforce_memory_budget
from triaccel.backends.torch.memory import MemoryProbe
from triaccel.backends.torch.models import create_model
from _results import device_tag, write_json

ROOT = Path(__file__).resolve().parents[1]
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


def load_data(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray, str]:
    if args.data == "synthetic":
        rng = np.random.default_rng(0)
        n = args.subset or 50_000
        return (rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8),
                rng.integers(0, 10, n).astype(np.int64), "synthetic")
    from triaccel.data.cifar import load_cifar  # written concurrently (issue: models/data)
    x, y = load_cifar("cifar10", args.data, "train")
    if args.subset:
        x, y = x[:args.subset], y[:args.subset]
    return np.asarray(x), np.asarray(y, dtype=np.int64), f"cifar10:{args.data}"


def make_transform(device: torch.device, seed: int) -> tuple[Any, str]:
    """uint8 NHWC -> float32 normalised NCHW with random crop (pad 4) + flip, on the device."""
    gen = torch.Generator(device=device).manual_seed(seed)
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1)

    def local(x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 3, 1, 2).float().div_(255)
        n = x.shape[0]
        padded = F.pad(x, (4, 4, 4, 4))
        ox = torch.randint(0, 9, (n,), device=device, generator=gen)
        oy = torch.randint(0, 9, (n,), device=device, generator=gen)
        ar = torch.arange(32, device=device)
        rows = (oy[:, None] + ar)[:, None, :, None]          # (n, 1, 32, 1)
        cols = (ox[:, None] + ar)[:, None, None, :]          # (n, 1, 1, 32)
        x = padded[torch.arange(n, device=device)[:, None, None, None],
                   torch.arange(3, device=device)[None, :, None, None], rows, cols]
        flip = torch.rand(n, device=device, generator=gen) < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(3), x)
        return ((x - mean) / std).contiguous(memory_format=torch.channels_last)
    return local, "inline crop(pad 4)+flip+normalize"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SampleCounter:
    """Counts each sample id once per micro-batch that fully succeeded (forward and backward).

    Ids are recorded when the forward returns and committed when the next micro-batch starts or the
    step ends, unless an OOM was reported in between (the controller proxy below tells it).
    """

    def __init__(self, n: int) -> None:
        self.counts = np.zeros(n, dtype=np.int64)
        self.pending: np.ndarray | None = None

    def begin(self, ids: np.ndarray) -> None:
        self.commit()
        self.pending = ids

    def fail(self) -> None:
        self.pending = None

    def commit(self) -> None:
        if self.pending is not None:
            np.add.at(self.counts, self.pending, 1)
            self.pending = None


class CountingController:
    """Delegates to a Controller; an OOM report also voids the pending micro-batch's ids."""

    def __init__(self, ctl: Controller, counter: SampleCounter) -> None:
        self._ctl, self._counter = ctl, counter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctl, name)

    def observe_oom(self, step: int) -> Any:
        self._counter.fail()
        return self._ctl.observe_oom(step)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", choices=["resnet18", "tiny"], default="resnet18")
    p.add_argument("--data", default=str(ROOT.parent / "shared/data/cifar10-jpeg"),
                   help="CIFAR-10 root for triaccel.data.cifar.load_cifar, or 'synthetic'")
    p.add_argument("--subset", type=int, default=0, help="use the first N training samples (0 = all)")
    p.add_argument("--budget", default="4GiB")
    p.add_argument("--no-enforce", action="store_true", help="do not cap the allocator at the budget")
    p.add_argument("--batch-init", type=int, default=96)
    p.add_argument("--batch-max", type=int, default=4096)
    p.add_argument("--t-ctrl", type=int, default=2)
    p.add_argument("--delta", type=int, default=64, help="delta_up = delta_down (samples)")
    p.add_argument("--climb-epochs", type=int, default=2)
    p.add_argument("--steps", type=int, default=0, help="cap steps per phase (0 = whole epochs)")
    p.add_argument("--inject", type=int, default=100)
    p.add_argument("--inject-oom-shrink", type=float, default=0.99)
    p.add_argument("--inject-oom-cooldown", type=int, default=2,
                   help="steps without OOM after which the post-OOM growth cap lifts (oom_cooldown)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    budget = parse_bytes(args.budget, "budget")
    torch.manual_seed(args.seed)
    x_np, y_np, data_desc = load_data(args)
    n = len(y_np)
    images = torch.from_numpy(x_np).to(device)
    labels = torch.from_numpy(y_np).to(device)
    transform, aug_desc = make_transform(device, args.seed)
    width = 0.125 if args.model == "tiny" else 1.0
    enforced = None
    if device.type == "cuda" and not args.no_enforce:
        enforced = enforce_memory_budget(budget, device)
    amp = torch.autocast(device.type, dtype=torch.bfloat16)

    def new_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(args.seed)
        m = create_model("resnet18", num_classes=10, width=width).to(device)
        m = m.to(memory_format=torch.channels_last)
        return m, torch.optim.SGD(m.parameters(), lr=args.lr, momentum=0.9, nesterov=True,
                                  weight_decay=5e-4)

    results: dict[str, Any] = {}

    # -- static AMP-bf16 baseline --------------------------------------------------------------
    model, opt = new_model()
    loader = ElasticLoader(images, labels, batch_size=args.batch_init, seed=args.seed, transform=transform)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    steps, samples, t0 = 0, 0, None
    half = (args.steps or -(-n // args.batch_init)) // 2
    for xb, yb in loader:
        with amp:
            loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        steps += 1
        if steps == half:
            sync(device)
            t0, samples = time.perf_counter(), 0
        elif t0 is not None:
            samples += len(yb)
        if args.steps and steps >= args.steps:
            break
    sync(device)
    dt = time.perf_counter() - t0 if t0 is not None else float("nan")
    results["static"] = {"batch": args.batch_init, "steps": steps,
                         "samples_per_s": samples / dt if samples else None,
                         "peak_alloc_bytes": int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None,
                         "final_loss": float(loss.detach())}

    # -- elastic climb ---------------------------------------------------------------------------
    base_cfg = dict(batch_init=args.batch_init, batch_min=8, batch_max=args.batch_max, batch_multiple=8,
                    delta_up=args.delta, delta_down=args.delta, memory_budget=budget, t_ctrl=args.t_ctrl,
                    curvature="off", adaptive_precision=False, lr_rule="linear")
    cfg = TriAccelConfig(**base_cfg)
    model, opt = new_model()
    ctl = Controller(cfg, ["model"])
    probe = MemoryProbe(device)
    readings: list[int] = []

    def read() -> tuple[int, int] | None:
        r = probe.read()
        if r is None:
            return None
        readings.append(r.used_bytes)
        return r.used_bytes, r.limit_bytes

    loader = ElasticLoader(images, labels, batch_size=args.batch_init, seed=args.seed, transform=transform)

    def loss_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        xb, yb = batch
        with amp:
            return F.cross_entropy(model(xb), yb)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    trace, step, t_half, s_half = [], 0, None, 0
    while True:
        r = elastic_step(loader, ctl, loss_fn, opt, step, probe=read)
        trace.append({"step": step, "batch": r.decision.batch_size, "ooms": r.ooms})
        step += 1
        if t_half is None and (r.epoch >= args.climb_epochs / 2 or (args.steps and step >= args.steps // 2)):
            sync(device)
            t_half, s_half = time.perf_counter(), 0
        elif t_half is not None:
            s_half += r.samples
        if (r.end_of_epoch and r.epoch + 1 >= args.climb_epochs) or (args.steps and step >= args.steps):
            break
    sync(device)
    dt = time.perf_counter() - t_half if t_half is not None else float("nan")
    peak = max(readings) if readings else None
    climbed = ctl.decision.batch_size
    results["climb"] = {"batch_start": args.batch_init, "batch_end": climbed,
                        "batch_max_seen": max(t["batch"] for t in trace), "steps": step,
                        "real_ooms": loader.stats["ooms"], "samples_per_s": s_half / dt if s_half else None,
                        "peak_alloc_bytes": peak, "budget_bytes": budget,
                        "peak_within_budget": None if peak is None else bool(peak <= budget),
                        "batch_trace": [t["batch"] for t in trace]}

    # -- injected OOMs over one epoch ---------------------------------------------------------------
    inj_cfg = TriAccelConfig(**(base_cfg | dict(batch_init=climbed, batch_max=max(climbed, args.batch_init),
                                                oom_shrink=args.inject_oom_shrink,
                                                oom_cooldown=args.inject_oom_cooldown)))
    model, opt = new_model()
    counter = SampleCounter(n)
    ctl = CountingController(Controller(inj_cfg, ["model"]), counter)
    loader = ElasticLoader(images, labels, batch_size=climbed, seed=args.seed + 1, transform=transform)
    calls, injected = [0], [0]
    # the ids of each micro-batch, taken from the indices the loader is asked to fetch
    last_ids: list[np.ndarray] = [np.empty(0, dtype=np.int64)]
    fetch = loader.fetch

    def fetch_recording(indices: np.ndarray) -> Any:
        last_ids[0] = np.asarray(indices).copy()
        return fetch(indices)
    loader.fetch = fetch_recording  # type: ignore[method-assign]

    def loss_fn_inj(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        xb, yb = batch
        calls[0] += 1
        counter.commit()   # the previous micro-batch finished its backward
        if injected[0] < args.inject and calls[0] % 2 == 1:
            injected[0] += 1
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected #{injected[0]})")
        with amp:
            out = F.cross_entropy(model(xb), yb)
        counter.begin(last_ids[0])
        return out

    step, t0, failure = 0, time.perf_counter(), None
    while True:
        try:
            r = elastic_step(loader, ctl, loss_fn_inj, opt, step, probe=read)
        except OOMAtMinimumBatch as exc:   # the law's floor: reported, not hidden
            failure = str(exc)
            break
        counter.commit()
        step += 1
        if r.end_of_epoch or (args.steps and step >= args.steps * 4):
            break
    sync(device)
    full_epoch = bool(loader.sampler.epoch_done)
    used = counter.counts
    results["inject"] = {"injected": injected[0], "survived_ooms": loader.stats["ooms"],
                         "steps": step, "full_epoch": full_epoch,
                         "samples_counted": int(used.sum()), "num_samples": n,
                         "lost": int((used == 0).sum()) if full_epoch else None,
                         "repeated": int((used > 1).sum()), "batch_end": ctl.decision.batch_size,
                         "oom_shrink": args.inject_oom_shrink, "seconds": time.perf_counter() - t0,
                         "failure": failure}

    meta = {"device": device_name(device), "date": _dt.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
            "torch": torch.__version__, "model": args.model, "data": data_desc, "samples": n,
            "augment": aug_desc, "budget": args.budget, "allocator_fraction": enforced}
    out = {"meta": meta, **results}

    print(f"machine: {meta['device']}  date: {meta['date']}  torch {meta['torch']}")
    print(f"command: {meta['command']}")
    print(f"data: {data_desc} ({n} samples), model {args.model}, AMP-bf16, budget {args.budget}"
          f" (allocator fraction {enforced})")
    gib = lambda b: "n/a" if b is None else f"{b / 2**30:.3f} GiB"  # noqa: E731
    sps = lambda v: "n/a" if v is None else f"{v:,.0f}"  # noqa: E731
    st, cl, inj = results["static"], results["climb"], results["inject"]
    print(f"{'phase':<8} {'batch':>12} {'samples/s':>12} {'peak alloc':>12} {'notes'}")
    print(f"{'static':<8} {st['batch']:>12} {sps(st['samples_per_s']):>12} {gib(st['peak_alloc_bytes']):>12}")
    print(f"{'climb':<8} {str(cl['batch_start']) + '->' + str(cl['batch_end']):>12} "
          f"{sps(cl['samples_per_s']):>12} {gib(cl['peak_alloc_bytes']):>12} "
          f"budget {gib(budget)}, within: {cl['peak_within_budget']}, real OOMs {cl['real_ooms']}")
    print(f"{'inject':<8} {str(climbed) + '->' + str(inj['batch_end']):>12} {'':>12} {'':>12} "
          f"injected {inj['injected']}, survived {inj['survived_ooms']}, lost {inj['lost']}, "
          f"repeated {inj['repeated']}, full epoch {inj['full_epoch']}, oom_shrink {args.inject_oom_shrink}")
    if failure:
        print(f"inject phase stopped: {failure}")
    if st["samples_per_s"] and cl["samples_per_s"]:
        print(f"throughput elastic / static bs{args.batch_init}: {cl['samples_per_s'] / st['samples_per_s']:.2f}x")

    write_json(out, Path(args.out) if args.out else
               ROOT / "benchmarks" / "results" / f"elastic-{device_tag(meta['device'])}.json")
    return out


if __name__ == "__main__":
    main()
