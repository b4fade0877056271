"""The CIFAR demo's `--method local` (torch): NeuroFlux-style block-wise training under `--budget`.

Steps: measure the model's per-unit activation memory (saved tensors, bf16 autocast) -> plan blocks,
head widths, per-block batches and cache placement under the budget (`triaccel.local_plan`) -> on a
GPU, cap the allocator at the budget and probe the largest batch at which plain end-to-end AMP
training of the same model fits under it -> train block by block (`triaccel.backends.torch.local`),
evaluating each block's exit after each of its epochs -> evaluate every exit, choose the smallest
within `--exit-tolerance` of the best, export it and count its parameters.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from triaccel.backends.torch import augment
from triaccel.backends.torch.data import enforce_memory_budget, free_memory, is_oom
from triaccel.backends.torch.local import LocalTrainer, measure_layers, sequential_units
from triaccel.backends.torch.models import create_model
from triaccel.config import parse_bytes
from triaccel.local_plan import LocalPlanConfig, plan_local, select_exit

from .common import RunLog, RunOptions, bucket_ladder, lr_factor, median_last
from .datasets import CifarArrays
from .torch_loop import _prep, pick_device

# Local-learning options of the demo (train.py's --exit-tolerance, --max-blocks, --cache-views,
# --block-batch), kept here so RunOptions stays shared with the other methods unchanged.
LOCAL_DEFAULTS: dict[str, Any] = {"exit_tolerance": 0.01, "max_blocks": 4, "cache_views": 1, "block_batch": None}


def parse_local_budget(budget: str | None) -> tuple[int | None, int | None]:
    """--budget for --method local: bytes (e.g. "512MiB") -> (bytes, None), or "e2e:B" -> (None, B):
    the budget is then set halfway between the measured end-to-end peaks at batch B and 2B, so that
    end-to-end training's largest batch under it is B (CUDA only)."""
    if budget is None:
        raise ValueError("--budget: required with --method local (the plan partitions the model under it), "
                         "e.g. --budget 512MiB or --budget e2e:32")
    if str(budget).startswith("e2e:"):
        b = str(budget)[4:]
        if not b.isdigit() or int(b) < 1:
            raise ValueError(f"--budget={budget!r}: e2e:B needs a batch B >= 1, e.g. e2e:32")
        return None, int(b)
    return parse_bytes(budget, "memory_budget"), None


def _e2e_probe(model: torch.nn.Module, transform: Any, xtr: torch.Tensor, ytr: torch.Tensor,
               buckets: tuple[int, ...], opts: RunOptions) -> dict[int, int | None]:
    """Peak allocated bytes of two end-to-end AMP-bf16 SGD steps at each bucket, ascending, until the
    allocator raises out-of-memory (None at that bucket; under a cap, the budget). A copy of the model
    is used."""
    dev = xtr.device
    out: dict[int, int | None] = {}
    for bs in buckets:
        failed = False
        try:
            m = copy.deepcopy(model).train()
            opt = torch.optim.SGD(m.parameters(), lr=0.0, momentum=opts.momentum, nesterov=True)
            torch.cuda.reset_peak_memory_stats(dev)
            for _ in range(2):
                idx = torch.arange(bs, device=dev) % len(xtr)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = F.cross_entropy(m(transform(xtr[idx])), ytr[idx])
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize(dev)
            out[bs] = int(torch.cuda.max_memory_allocated(dev))
        except Exception as exc:  # noqa: BLE001 - only OOM is expected
            if not is_oom(exc):
                raise
            failed = True
        m = opt = loss = None  # noqa: F841 - drop the copy before freeing
        free_memory()
        if failed:
            out[bs] = None
            break
    return out


def train(opts: RunOptions, data: CifarArrays, log: RunLog, progress: Any) -> dict[str, Any]:
    lo = {**LOCAL_DEFAULTS, **getattr(opts, "local", {})}
    budget, e2e_batch = parse_local_budget(opts.budget)
    device = pick_device(opts)
    torch.manual_seed(opts.seed)
    model = create_model(opts.model, num_classes=data.num_classes, width=opts.width, seed=opts.seed).to(device)
    fmt = torch.channels_last if device.type == "cuda" else torch.contiguous_format
    if device.type == "cuda":
        model = model.to(memory_format=fmt)
        torch.backends.cudnn.benchmark = opts.cudnn_benchmark
    elif budget is None:
        raise ValueError(f"--budget={opts.budget!r}: e2e:B measures end-to-end peaks, which needs CUDA; "
                         "pass bytes on a CPU")
    mean = torch.tensor(data.mean, device=device)
    std = torch.tensor(data.std, device=device)
    xtr = torch.from_numpy(data.train_x).to(device)
    ytr = torch.from_numpy(data.train_y).to(device)
    xte = torch.from_numpy(data.test_x).to(device)
    yte = torch.from_numpy(data.test_y).to(device)
    gen = torch.Generator(device=device).manual_seed(opts.seed)

    def prep(xb: torch.Tensor) -> torch.Tensor:
        return _prep(xb, mean, std, opts.image_size)

    def train_transform(xb: torch.Tensor) -> torch.Tensor:
        return prep(augment.random_crop_flip(xb, gen))

    buckets = bucket_ladder(8, 8, max(opts.batch_max, 8))
    e2e_probe: dict[int, int | None] = {}
    if budget is None:   # e2e:B: probe uncapped up to 2B, then the budget between the two peaks
        e2e_probe = _e2e_probe(model, train_transform, xtr, ytr, bucket_ladder(e2e_batch, 1, 2 * e2e_batch), opts)
        if e2e_probe.get(2 * e2e_batch) is None or e2e_probe.get(e2e_batch) is None:
            raise RuntimeError(f"--budget {opts.budget}: end-to-end did not run at batch {2 * e2e_batch} on this "
                               f"device ({e2e_probe}); pass bytes")
        budget = (e2e_probe[e2e_batch] + e2e_probe[2 * e2e_batch]) // 2
        print(f"budget {budget} bytes ({budget / 2**20:.1f} MiB): halfway between end-to-end's peaks at batch "
              f"{e2e_batch} and {2 * e2e_batch}", flush=True)
    if device.type == "cuda":
        enforce_memory_budget(budget, device)
        e2e_probe = _e2e_probe(model, train_transform, xtr, ytr, buckets, opts)   # under the cap now
    e2e_fit = [b for b, peak in e2e_probe.items() if peak is not None]

    units, clf = sequential_units(model)
    t0 = time.perf_counter()
    table = measure_layers(units, prep(xtr[:2]), autocast_dtype=torch.bfloat16)
    resident = sum(t.numel() * t.element_size() for t in (xtr, ytr, xte, yte))
    cfg = LocalPlanConfig(memory_budget=budget, batch_buckets=buckets, max_blocks=lo["max_blocks"],
                          target_batch=lo["block_batch"], cache_views=lo["cache_views"],
                          input_bytes=3 * opts.image_size ** 2 * 4, resident_bytes=resident, headroom=0.85)
    plan = plan_local(table, cfg, num_samples=len(xtr), num_classes=data.num_classes)
    plan_s = time.perf_counter() - t0
    log.write("local_plan", **plan.to_dict())
    for blk in plan.blocks:
        print(f"block {blk.index}: {blk.names[0]}..{blk.names[-1]}  batch {blk.batch}  head width {blk.head_width}  "
              f"modelled peak {blk.peak_bytes / 2**20:.0f} MiB  input {blk.input_cache}", flush=True)
    print(f"end-to-end under the budget: modelled largest batch {plan.e2e_batch}"
          + (f", measured {max(e2e_fit) if e2e_fit else None} ({e2e_probe})" if e2e_probe else ""), flush=True)

    # Fixed augmentations of the training set, cached per block (host memory: uint8, small).
    views = []
    for v in range(lo["cache_views"]):
        g = torch.Generator(device=device).manual_seed(1_000_003 * (opts.seed + 1) + v)
        chunks = [augment.random_crop_flip(xtr[i:i + 4096], g).cpu() for i in range(0, len(xtr), 4096)]
        views.append(torch.cat(chunks).pin_memory() if device.type == "cuda" else torch.cat(chunks))

    warmup = int(opts.warmup_epochs * len(xtr))
    trainer = LocalTrainer(
        units, clf, plan, num_classes=data.num_classes, device=device, lr=opts.lr, lr_batch=opts.batch,
        momentum=opts.momentum, weight_decay=opts.weight_decay,
        lr_factor=lambda seen, total: lr_factor(seen, total, min(warmup, total)),
        autocast_dtype=torch.bfloat16, cache=True, cache_dtype=torch.bfloat16, memory_format=fmt, seed=opts.seed)
    epoch_no = [0]

    def on_epoch(b: int, e: int, loss: float, seconds: float) -> None:
        acc = trainer.evaluate_exits(xte, yte, prep, upto=b + 1)[-1]
        epoch_no[0] += 1
        log.write("epoch", epoch=epoch_no[0], block=b, block_epoch=e + 1, train_loss=loss, test_acc=acc,
                  seconds=seconds, batch_size=plan.blocks[b].batch)
        print(f"block {b} epoch {e + 1}: loss {loss:.4f}  exit {b} test acc {100 * acc:.2f}%  {seconds:.1f}s  "
              f"batch {plan.blocks[b].batch}", flush=True)

    records = trainer.train(xtr, ytr, train_transform, views, prep, opts.epochs, on_epoch=on_epoch)
    accs = trainer.evaluate_exits(xte, yte, prep)
    chosen = select_exit(accs, lo["exit_tolerance"])
    exported = trainer.export(chosen)
    params = trainer.exit_params()
    total_params = sum(p.numel() for p in model.parameters())
    for blk, rec in zip(plan.blocks, records):
        log.write("block", **blk.to_dict(), measured_peak_bytes=rec.peak_bytes, cache_peak_bytes=rec.cache_peak_bytes,
                  cache_seconds=rec.cache_seconds, steps=rec.steps, ooms=rec.ooms)
    log.write("exits", accs=accs, params=params, chosen=chosen, tolerance=lo["exit_tolerance"])
    epoch_seconds = [s for r in records for s in r.epoch_seconds]
    train_seconds = sum(epoch_seconds) + sum(r.cache_seconds for r in records)
    peaks = [p for r in records for p in (r.peak_bytes, r.cache_peak_bytes) if p is not None]
    print(f"exits: {', '.join(f'{100 * a:.2f}%' for a in accs)}; chosen exit {chosen} "
          f"({exported.param_count} params, {total_params / exported.param_count:.1f}x fewer than the model); "
          f"training {train_seconds:.1f}s", flush=True)
    return {
        "final_acc": accs[-1], "accs": [a for a in accs], "exit_accs": accs, "exit_params": params,
        "chosen_exit": chosen, "exit_tolerance": lo["exit_tolerance"], "exported_params": exported.param_count,
        "model_params": total_params, "param_reduction": total_params / exported.param_count,
        "chosen_acc": accs[chosen], "local_options": lo, "memory_budget_bytes": budget,
        "plan": plan.to_dict(), "plan_seconds": plan_s, "blocks": [r.to_dict() for r in records],
        "epoch_seconds": epoch_seconds, "train_seconds": train_seconds,
        "s_per_epoch_median_last5": median_last(epoch_seconds), "peak_alloc_bytes": max(peaks) if peaks else None,
        "e2e_probe_peak_bytes": {str(k): v for k, v in e2e_probe.items()},
        "e2e_largest_batch_measured": max(e2e_fit) if e2e_fit else None, "e2e_largest_batch_modelled": plan.e2e_batch,
        "steps": sum(r.steps for r in records), "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
