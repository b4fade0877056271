"""The CIFAR demo's `--method local` (torch or JAX): NeuroFlux-style block-wise training under `--budget`.

Steps: measure the model's per-unit activation memory (torch: saved tensors under bf16 autocast; JAX:
XLA's compiled memory analysis of each unit's forward + backward, convs/linears in bf16) -> plan
blocks, head widths, per-block batches and cache placement under the budget (`triaccel.local_plan`,
the same plan from the same table in both) -> on a GPU, the largest batch at which plain end-to-end
AMP training of the same model fits under the budget (torch: run under the capped allocator; JAX:
XLA's compiled memory analysis of the whole training step) -> train block by block
(`triaccel.backends.{torch,jax}.local`), evaluating each block's exit after each of its epochs
(`--exit-eval epoch`, the default; `end`: none until the end) -> evaluate every exit, choose the
smallest within `--exit-tolerance` of the best, export it and count its parameters.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from triaccel.backends.torch import augment
from triaccel.backends.torch.data import enforce_memory_budget, free_memory, is_oom
from triaccel.backends.torch.local import LocalTrainer, measure_layers, sequential_units
from triaccel.backends.torch.models import create_model
from triaccel.config import parse_bytes
from triaccel.local_plan import BlockCurvature, LocalPlanConfig, plan_local, select_exit
from triaccel.swap_plan import largest_fitting as bisect_largest

from .common import RunLog, RunOptions, bucket_ladder, lr_factor, median_last
from .datasets import CifarArrays
from .torch_loop import _prep, device_arrays, pick_device

# Local-learning options of the demo (train.py's --exit-tolerance, --max-blocks, --cache-views,
# --block-batch, --block-inputs, --cuda-graph, --graph-reserve, --block-epochs, --fuse-steps, --plan-headroom,
# --exit-eval, --block-curvature, --head-pool), kept here so RunOptions stays shared with the other methods unchanged.
LOCAL_DEFAULTS: dict[str, Any] = {"exit_tolerance": 0.01, "max_blocks": 4, "cache_views": "auto", "block_batch": None,
                                  "block_inputs": "cache", "cuda_graph": True, "graph_reserve": "auto",
                                  "block_epochs": None, "fuse_steps": 16, "headroom": 0.85,
                                  "exit_eval": "epoch", "block_curvature": 0, "head_pool": 4}
# --graph-reserve auto on a CUDA device with graphs on: with it the H100's block captures fitted issue 18's
# 520 MiB budget, without it the last block's warm-up ran out of memory (2026-11-23, docs/results.md)
AUTO_GRAPH_RESERVE = 32 * 2 ** 20


def block_curvature(lo: dict[str, Any]) -> BlockCurvature | None:
    """lo["block_curvature"]: epochs between a block's curvature measurements (0: the lever off)."""
    every = lo["block_curvature"]
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(f"block_curvature={every!r}: allowed integers >= 0 (0: off)")
    return BlockCurvature(every=every) if every else None


def exit_eval_every_epoch(lo: dict[str, Any]) -> bool:
    """lo["exit_eval"]: "epoch" (True: each block's exit after each of its epochs) or "end" (False)."""
    if lo["exit_eval"] not in ("epoch", "end"):
        raise ValueError(f"exit_eval={lo['exit_eval']!r}: allowed 'epoch', 'end'")
    return lo["exit_eval"] == "epoch"


def graph_reserve(lo: dict[str, Any], device_type: str) -> int:
    """The plan's graph reserve in bytes: --graph-reserve, or for "auto" AUTO_GRAPH_RESERVE where the
    torch trainer captures graphs (CUDA, --cuda-graph on) and 0 elsewhere (CPU, JAX)."""
    r = lo["graph_reserve"]
    if r == "auto":
        return AUTO_GRAPH_RESERVE if device_type == "cuda" and lo["cuda_graph"] else 0
    return int(r)


def host_cache_bytes(meminfo: str = "/proc/meminfo") -> int:
    """Host bytes the local plan's caches may take: half of the memory available now. Linux's
    MemAvailable counts the page cache the kernel can reclaim (after reading a data set, free
    pages alone can be a small part of it); else free pages (sysconf); else 8 GiB."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2   # the kernel reports kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


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


def augmenters(prep: Callable[[torch.Tensor], torch.Tensor], device: torch.device,
               seed: int) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    """(train, probe): random crop + flip, then `prep`, each with a generator of its own (seeds
    `seed` and `seed + 1`). The memory probes draw from theirs: drawing from training's would shift
    its augmentations with every change in the probes (2026-11-24: four seed-0 runs of one plan, best
    exits 86.48-86.86%, differed that way)."""
    def augmenter(gen: torch.Generator) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda xb: prep(augment.random_crop_flip(xb, gen))

    train, probe = (augmenter(torch.Generator(device=device).manual_seed(seed + i)) for i in (0, 1))
    return train, probe


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


def unmodelled_fixed_bytes(probe: dict[int, int | None], resident: int, params: int,
                           state_bytes_per_param: int = LocalPlanConfig.state_bytes_per_param,
                           weight_bytes_per_param: int = LocalPlanConfig.frozen_bytes_per_param) -> int | None:
    """Bytes end-to-end training (`_e2e_probe`) held beyond what the plan models, at batch 0: the
    intercept of the line through the probe's peaks at its two largest batches that ran, less the
    data (resident), the trained copy's state (state_bytes_per_param * params) and the model's own
    weights beside it (weight_bytes_per_param * params). That is the framework's workspaces (cuBLAS,
    cuDNN) and whatever else the per-unit table does not show, which every block pays as well (the
    H100 run of issue 18: ~49 MB). The largest batches, because the plan's blocks train at batches
    of that size or more, and small batches' peaks are not on their line: EfficientNet-B0's H100
    peaks rise 0.54 MB per sample from 8 to 16 and 1.15 MB from 32 to 64, so 8 and 16 gave 5.8 MB
    more fixed bytes (61.7 against 56.2 MiB). None with fewer than two batches measured; never
    negative."""
    ran = sorted((b, peak) for b, peak in probe.items() if peak is not None)
    if len(ran) < 2:
        return None
    (b1, p1), (b2, p2) = ran[-2:]
    intercept = p1 - b1 * (p2 - p1) / (b2 - b1)
    return max(int(intercept) - resident - (state_bytes_per_param + weight_bytes_per_param) * params, 0)


def block_epochs(lo: dict[str, Any], opts: RunOptions, plan: Any) -> tuple[int, ...]:
    """Epochs per block: --block-epochs, else --epochs for each of `plan`'s blocks (plan None: the
    values alone, for sizing the view count). ValueError naming --block-epochs when its count is not
    the plan's number of blocks."""
    given = lo["block_epochs"]
    if given is None:
        return (opts.epochs,) * (1 if plan is None else len(plan.blocks))
    if plan is not None and len(given) != len(plan.blocks):
        raise ValueError(f"--block-epochs={','.join(map(str, given))}: {len(given)} values, but the plan has "
                         f"{len(plan.blocks)} blocks; give one per block")
    return tuple(given)


def _plan(table: list[Any], budget: int, lo: dict[str, Any], opts: RunOptions, resident: int, n: int,
          num_classes: int, log: RunLog) -> Any:
    """The plan under `budget` (logged and printed), the same for both backends."""
    cfg = LocalPlanConfig(memory_budget=budget, batch_buckets=bucket_ladder(8, 8, max(opts.batch_max, 8)),
                          max_blocks=lo["max_blocks"], target_batch=lo["block_batch"], cache_views=lo["cache_views"],
                          max_cache_views=max(*block_epochs(lo, opts, None), 1), host_cache_bytes=host_cache_bytes(),
                          block_inputs=lo["block_inputs"], graph_reserve_bytes=lo["graph_reserve"],
                          input_bytes=3 * opts.image_size ** 2 * 4, resident_bytes=resident, headroom=lo["headroom"],
                          head_pool=lo["head_pool"])
    plan = plan_local(table, cfg, num_samples=n, num_classes=num_classes)
    block_epochs(lo, opts, plan)   # the count of --block-epochs checked before any training
    log.write("local_plan", **plan.to_dict())
    print(f"block inputs: {lo['block_inputs']}; cached views: {plan.cache_views} ({lo['cache_views']}); "
          f"host bytes at most {plan.host_peak_bytes} "
          f"({plan.host_peak_bytes / 2**30:.1f} GiB, of {cfg.host_cache_bytes / 2**30:.1f} GiB allowed)", flush=True)
    for blk in plan.blocks:
        print(f"block {blk.index}: {blk.names[0]}..{blk.names[-1]}  batch {blk.batch}  head width {blk.head_width}  "
              f"modelled peak {blk.peak_bytes / 2**20:.0f} MiB  input {blk.input_cache}", flush=True)
    return plan


@contextlib.contextmanager
def _clock(spent: dict[str, float], key: str) -> Iterator[None]:
    """Adds the seconds of the `with` body to spent[key]."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        spent[key] += time.perf_counter() - t0


def _spent() -> dict[str, float]:
    """Seconds outside training, by `_clock`: "probe" (end-to-end memory probes), "eval" (exit evaluations)."""
    return {"probe": 0.0, "eval": 0.0}


def _exits_and_summary(trainer: Any, plan: Any, records: list[Any], xte: Any, yte: Any, prep: Any,
                       lo: dict[str, Any], model_params: int, log: RunLog, spent: dict[str, float]) -> dict[str, Any]:
    """Evaluate every exit on (xte, yte) (timed into spent["eval"], `_spent`), choose and export the
    exit, log the blocks and exits; the summary fields both backends share."""
    with _clock(spent, "eval"):
        accs = trainer.evaluate_exits(xte, yte, prep)
    chosen = select_exit(accs, lo["exit_tolerance"])
    exported = trainer.export(chosen)
    params = trainer.exit_params()
    for blk, rec in zip(plan.blocks, records):
        log.write("block", **blk.to_dict(), measured_peak_bytes=rec.peak_bytes, cache_peak_bytes=rec.cache_peak_bytes,
                  cache_seconds=rec.cache_seconds, steps=rec.steps, skipped_steps=rec.skipped_steps, ooms=rec.ooms,
                  graph_steps=rec.graph_steps, graph_pool_bytes=rec.graph_pool_bytes, graph_note=rec.graph_note,
                  graph_recaptures=rec.graph_recaptures, graph_retries=rec.graph_retries, graph_micro_batch=rec.graph_micro_batch,
                  precision=rec.precision, promoted_at=rec.promoted_at, lr_scales=rec.lr_scales,
                  peak_reserved_bytes=rec.peak_reserved_bytes)
    log.write("exits", accs=accs, params=params, chosen=chosen, tolerance=lo["exit_tolerance"])
    epoch_seconds = [s for r in records for s in r.epoch_seconds]
    train_seconds = sum(epoch_seconds) + sum(r.cache_seconds for r in records)
    peaks = [p for r in records for p in (r.peak_bytes, r.cache_peak_bytes) if p is not None]
    reserved = [r.peak_reserved_bytes for r in records if r.peak_reserved_bytes is not None]
    print(f"exits: {', '.join(f'{100 * a:.2f}%' for a in accs)}; chosen exit {chosen} "
          f"({exported.param_count} params, {model_params / exported.param_count:.1f}x fewer than the model); "
          f"training {train_seconds:.1f}s; outside it: memory probes {spent['probe']:.1f}s, "
          f"exit evaluations {spent['eval']:.1f}s", flush=True)
    return {
        "final_acc": accs[-1], "accs": list(accs), "exit_accs": accs, "exit_params": params,
        "chosen_exit": chosen, "exit_tolerance": lo["exit_tolerance"], "exported_params": exported.param_count,
        "model_params": model_params, "param_reduction": model_params / exported.param_count,
        "chosen_acc": accs[chosen], "local_options": lo, "plan": plan.to_dict(),
        "blocks": [r.to_dict() for r in records], "epoch_seconds": epoch_seconds, "train_seconds": train_seconds,
        "s_per_epoch_median_last5": median_last(epoch_seconds), "peak_alloc_bytes": max(peaks) if peaks else None,
        "peak_reserved_bytes": max(reserved) if reserved else None,
        "graph_steps": sum(r.graph_steps for r in records),
        "e2e_largest_batch_modelled": plan.e2e_batch, "steps": sum(r.steps for r in records),
        "probe_seconds": spent["probe"], "exit_eval_seconds": spent["eval"],
    }


def _epoch_reporter(trainer: Any, plan: Any, log: RunLog, xte: Any, yte: Any, prep: Any,
                    spent: dict[str, float], every_epoch: bool) -> Any:
    """The trainers' on_epoch callback (either backend): log and print the epoch, with its block's exit
    evaluated when `every_epoch` (its seconds added to spent["eval"]; else test_acc None: the run's end
    evaluates every exit)."""
    epoch_no = [0]

    def on_epoch(b: int, e: int, loss: float, seconds: float) -> None:
        acc = None
        if every_epoch:
            with _clock(spent, "eval"):
                acc = trainer.evaluate_exits(xte, yte, prep, upto=b + 1)[-1]
        epoch_no[0] += 1
        log.write("epoch", epoch=epoch_no[0], block=b, block_epoch=e + 1, train_loss=loss, test_acc=acc,
                  seconds=seconds, batch_size=plan.blocks[b].batch)
        shown = "" if acc is None else f"  exit {b} test acc {100 * acc:.2f}%"
        print(f"block {b} epoch {e + 1}: loss {loss:.4f}{shown}  {seconds:.1f}s  batch {plan.blocks[b].batch}",
              flush=True)

    return on_epoch


def train(opts: RunOptions, data: CifarArrays, log: RunLog, progress: Any) -> dict[str, Any]:
    if opts.backend == "jax":
        return _train_jax(opts, data, log)
    lo = {**LOCAL_DEFAULTS, **getattr(opts, "local", {})}
    budget, e2e_batch = parse_local_budget(opts.budget)
    device = pick_device(opts)
    lo["graph_reserve"] = graph_reserve(lo, device.type)
    every_epoch = exit_eval_every_epoch(lo)
    torch.manual_seed(opts.seed)
    model = create_model(opts.model, num_classes=data.num_classes, width=opts.width, seed=opts.seed).to(device)
    nhwc = opts.channels_last(device.type)
    fmt = torch.channels_last if nhwc else torch.contiguous_format
    model = model.to(memory_format=fmt)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = opts.cudnn_benchmark
    elif budget is None:
        raise ValueError(f"--budget={opts.budget!r}: e2e:B measures end-to-end peaks, which needs CUDA; "
                         "pass bytes on a CPU")
    mean, std, xtr, ytr, xte, yte = device_arrays(data, device)

    def prep(xb: torch.Tensor) -> torch.Tensor:
        return _prep(xb, mean, std, opts.image_size, nhwc)

    train_transform, probe_transform = augmenters(prep, device, opts.seed)
    buckets = bucket_ladder(8, 8, max(opts.batch_max, 8))
    e2e_probe: dict[int, int | None] = {}
    spent = _spent()
    if budget is None:   # e2e:B: probe uncapped up to 2B, then the budget between the two peaks
        # From batch 2 (BatchNorm cannot train on one sample where the map is 1x1, EfficientNet's last
        # stages), not from B: a peak depends on what ran before it (H100, ResNet-18 at batch 32: 507.2
        # MB probed first, 509.1 MB after the smaller batches), and every earlier run's budget came
        # from this ladder.
        with _clock(spent, "probe"):
            e2e_probe = _e2e_probe(model, probe_transform, xtr, ytr, bucket_ladder(e2e_batch, 2, 2 * e2e_batch), opts)
        if e2e_probe.get(2 * e2e_batch) is None or e2e_probe.get(e2e_batch) is None:
            raise RuntimeError(f"--budget {opts.budget}: end-to-end did not run at batch {2 * e2e_batch} on this "
                               f"device ({e2e_probe}); pass bytes")
        budget = (e2e_probe[e2e_batch] + e2e_probe[2 * e2e_batch]) // 2
        print(f"budget {budget} bytes ({budget / 2**20:.1f} MiB): halfway between end-to-end's peaks at batch "
              f"{e2e_batch} and {2 * e2e_batch}", flush=True)
        # Measured, so not probed again under the cap: end-to-end's largest batch is B (2B's peak is
        # above the budget), and the line through the two peaks gives the unmodelled fixed bytes.
        e2e_fit = [e2e_batch]
    if device.type == "cuda":
        enforce_memory_budget(budget, device)
        if e2e_batch is None:
            with _clock(spent, "probe"):
                e2e_probe = _e2e_probe(model, probe_transform, xtr, ytr, buckets, opts)   # under the cap
            e2e_fit = [b for b, peak in e2e_probe.items() if peak is not None]
    else:
        e2e_fit = []

    units, clf = sequential_units(model)
    t0 = time.perf_counter()
    table = measure_layers(units, prep(xtr[:2]), autocast_dtype=torch.bfloat16)
    data_bytes = sum(t.numel() * t.element_size() for t in (xtr, ytr, xte, yte))
    overhead = unmodelled_fixed_bytes(e2e_probe, data_bytes, sum(p.numel() for p in model.parameters()))
    if overhead is not None:
        print(f"fixed bytes the layer table does not show (end-to-end peaks' intercept less data and training "
              f"state): {overhead} ({overhead / 2**20:.1f} MiB), planned as resident", flush=True)
    resident = data_bytes + (overhead or 0)
    plan = _plan(table, budget, lo, opts, resident, len(xtr), data.num_classes, log)
    plan_s = time.perf_counter() - t0
    print(f"end-to-end under the budget: modelled largest batch {plan.e2e_batch}"
          + (f", measured {max(e2e_fit) if e2e_fit else None} ({e2e_probe})" if e2e_probe else ""), flush=True)

    # Fixed augmentations of the training set, cached per block (host memory: uint8, small).
    views = []
    for v in range(plan.cache_views):
        g = torch.Generator(device=device).manual_seed(1_000_003 * (opts.seed + 1) + v)
        # chunks of 512: the gather indices of a 4096-image chunk (~130 MB) broke a 520 MiB budget (H100)
        chunks = [augment.random_crop_flip(xtr[i:i + 512], g).cpu() for i in range(0, len(xtr), 512)]
        views.append(torch.cat(chunks).pin_memory() if device.type == "cuda" else torch.cat(chunks))

    warmup = int(opts.warmup_epochs * len(xtr))
    trainer = LocalTrainer(
        units, clf, plan, num_classes=data.num_classes, device=device, lr=opts.lr, lr_batch=opts.batch,
        momentum=opts.momentum, weight_decay=opts.weight_decay,
        lr_factor=lambda seen, total: lr_factor(seen, total, min(warmup, total)),
        autocast_dtype=torch.bfloat16, cache_dtype=torch.bfloat16, memory_format=fmt, seed=opts.seed,
        cuda_graph=lo["cuda_graph"], curvature=block_curvature(lo), head_pool=lo["head_pool"])
    on_epoch = _epoch_reporter(trainer, plan, log, xte, yte, prep, spent, every_epoch)
    records = trainer.train(xtr, ytr, train_transform, views, prep, block_epochs(lo, opts, plan), on_epoch=on_epoch)
    summary = _exits_and_summary(trainer, plan, records, xte, yte, prep, lo, sum(p.numel() for p in model.parameters()),
                                 log, spent)
    return {
        **summary, "memory_budget_bytes": budget, "plan_seconds": plan_s, "unmodelled_fixed_bytes": overhead,
        "e2e_probe_peak_bytes": {str(k): v for k, v in e2e_probe.items()},
        "e2e_largest_batch_measured": max(e2e_fit) if e2e_fit else None, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }


def largest_fitting(batches: Sequence[int], peak_of: Callable[[int], int], budget: int,
                    known: dict[int, int] | None = None) -> dict[int, int]:
    """The peaks a bisection (`triaccel.swap_plan.largest_fitting`) computes (`peak_of(batch)`, bytes;
    they grow with the batch) to find the largest of the ascending `batches` whose peak fits
    `budget`, merged with the `known` ones (reused, and they narrow the search): at most
    ~log2(len(batches)) + 1 calls, none when the known peaks already bracket the answer. The answer:
    the largest key whose peak is <= budget (none: no batch fits)."""
    peaks = dict(known or {})
    lo, hi = 0, len(batches)
    for i, b in enumerate(batches):   # known peaks bound the range
        if b in peaks:
            if peaks[b] <= budget:
                lo = max(lo, i + 1)
            else:
                hi = min(hi, i)

    def fits(b: int) -> bool:
        if b not in peaks:
            peaks[b] = peak_of(b)
        return peaks[b] <= budget

    bisect_largest(batches[lo:hi], fits)
    return peaks


def _jax_e2e_peaks(model: Any, batches: Sequence[int], image_size: int, fixed_bytes: int) -> dict[int, int]:
    """Modelled device peak of one end-to-end training step (fwd + bwd + SGD-momentum update, the
    model's compute dtypes) at each batch: fixed_bytes + arguments + XLA's compiled temporaries +
    outputs not aliased to donated arguments. Compiled, never run (each compilation costs seconds)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    gd, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.sgd(0.1, momentum=0.9, nesterov=True)

    def step(p: Any, r: Any, o: Any, x: Any, y: Any) -> Any:
        def lf(p_: Any) -> Any:
            m = nnx.merge(gd, p_, r, copy=True)
            ce = optax.softmax_cross_entropy_with_integer_labels(m(x).astype(jnp.float32), y).mean()
            return ce, nnx.split(m, nnx.Param, ...)[2]

        (loss, r), g = jax.value_and_grad(lf, has_aux=True)(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), r, o, loss

    opt = jax.eval_shape(tx.init, params)
    out = {}
    for bs in sorted(batches):
        x = jax.ShapeDtypeStruct((bs, image_size, image_size, 3), jnp.float32)
        y = jax.ShapeDtypeStruct((bs,), jnp.int32)
        ma = jax.jit(step, donate_argnums=(0, 1, 2)).lower(params, rest, opt, x, y).compile().memory_analysis()
        out[bs] = int(fixed_bytes + ma.argument_size_in_bytes + ma.temp_size_in_bytes
                      + max(ma.output_size_in_bytes - ma.alias_size_in_bytes, 0))
    return out


def _train_jax(opts: RunOptions, data: CifarArrays, log: RunLog) -> dict[str, Any]:
    """--method local --backend jax: the same steps as the torch path (module docstring)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from triaccel.backends.jax import augment as jaug
    from triaccel.backends.jax import local as jlocal
    from triaccel.backends.jax.compile_ahead import enable_compilation_cache
    from triaccel.backends.jax.models import create_model as jax_model

    lo = {**LOCAL_DEFAULTS, **getattr(opts, "local", {})}
    lo["graph_reserve"] = graph_reserve(lo, "jax")   # XLA compiles the steps: no CUDA graphs to reserve for
    every_epoch = exit_eval_every_epoch(lo)
    # as the end-to-end JAX loop (SplitStep): a run compared with one sees the same persistent cache
    cache_dir = enable_compilation_cache(False if opts.compile_cache == "off" else (opts.compile_cache or True))
    budget, e2e_batch = parse_local_budget(opts.budget)
    dev = jax.devices()[0]
    model = jax_model(opts.model, num_classes=data.num_classes, width=opts.width, seed=opts.seed)
    units, clf = jlocal.sequential_units(model)
    jlocal.set_compute_dtype([model], jnp.bfloat16)   # AMP's split: convs/linears bf16, norms fp32
    mean, std = jnp.asarray(data.mean, jnp.float32), jnp.asarray(data.std, jnp.float32)
    xtr, ytr = jax.device_put(data.train_x, dev), jax.device_put(data.train_y.astype(np.int32), dev)
    xte, yte = jax.device_put(data.test_x, dev), jax.device_put(data.test_y.astype(np.int32), dev)
    resident = sum(int(a.nbytes) for a in (xtr, ytr, xte, yte))

    def prep(xb: Any) -> Any:
        xb = jaug.normalize(xb, mean, std)
        if opts.image_size != xb.shape[1]:
            xb = jax.image.resize(xb, (xb.shape[0], opts.image_size, opts.image_size, 3), "bilinear")
        return xb

    def train_transform(xb: Any, key: Any) -> Any:
        return prep(jaug.random_crop_flip(xb, key))

    buckets = bucket_ladder(8, 8, max(opts.batch_max, 8))
    e2e_peaks: dict[int, int] = {}
    spent = _spent()
    if budget is None:   # e2e:B: halfway between the end-to-end step's modelled peaks at B and 2B
        with _clock(spent, "probe"):
            e2e_peaks = _jax_e2e_peaks(model, (e2e_batch, 2 * e2e_batch), opts.image_size, resident)
        budget = (e2e_peaks[e2e_batch] + e2e_peaks[2 * e2e_batch]) // 2
        print(f"budget {budget} bytes ({budget / 2**20:.1f} MiB): halfway between end-to-end's modelled peaks at "
              f"batch {e2e_batch} and {2 * e2e_batch} (XLA memory analysis; the XLA pool is not capped)", flush=True)
    if dev.platform == "gpu":   # end-to-end's largest batch under the budget, for the report
        with _clock(spent, "probe"):
            e2e_peaks = largest_fitting(buckets, lambda b: _jax_e2e_peaks(model, [b], opts.image_size, resident)[b],
                                        budget, e2e_peaks)
    e2e_fit = [b for b, peak in sorted(e2e_peaks.items()) if peak <= budget]

    t0 = time.perf_counter()
    # compiled at 32 and 64 samples (nothing runs): activations, not fixed workspaces, set the slope
    table = jlocal.measure_layers(units, jax.ShapeDtypeStruct((32, opts.image_size, opts.image_size, 3), jnp.float32))
    plan = _plan(table, budget, lo, opts, resident, len(data.train_x), data.num_classes, log)
    plan_s = time.perf_counter() - t0
    print(f"end-to-end under the budget: modelled largest batch {plan.e2e_batch}"
          + (f", by XLA's analysis of the whole step {max(e2e_fit) if e2e_fit else None}" if e2e_peaks else ""),
          flush=True)

    # Fixed augmentations of the training set, cached per block (host memory: uint8, small).
    views = []
    for v in range(plan.cache_views):
        key = jax.random.key(1_000_003 * (opts.seed + 1) + v)
        views.append(np.concatenate([np.asarray(jaug.random_crop_flip(xtr[i:i + 512], jax.random.fold_in(key, i)))
                                     for i in range(0, len(data.train_x), 512)]))   # chunks of 512, as torch's

    warmup = int(opts.warmup_epochs * len(data.train_x))
    trainer = jlocal.LocalTrainer(
        units, clf, plan, num_classes=data.num_classes, lr=opts.lr, lr_batch=opts.batch, momentum=opts.momentum,
        weight_decay=opts.weight_decay, lr_factor=lambda seen, total: lr_factor(seen, total, min(warmup, total)),
        compute_dtype=jnp.bfloat16, cache_dtype=jnp.bfloat16, seed=opts.seed, device=dev,
        steps_per_call=lo["fuse_steps"], curvature=block_curvature(lo), head_pool=lo["head_pool"])
    on_epoch = _epoch_reporter(trainer, plan, log, xte, yte, prep, spent, every_epoch)
    records = trainer.train(xtr, ytr, train_transform, views, prep, block_epochs(lo, opts, plan), on_epoch=on_epoch)
    model_params = sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    summary = _exits_and_summary(trainer, plan, records, xte, yte, prep, lo, model_params, log, spent)
    stats = dev.memory_stats() or {}
    return {
        **summary, "memory_budget_bytes": budget, "plan_seconds": plan_s,
        "e2e_compiled_peak_bytes": {str(k): v for k, v in e2e_peaks.items()},
        "e2e_largest_batch_compiled": max(e2e_fit) if e2e_fit else None, "device": str(dev),
        "device_name": getattr(dev, "device_kind", str(dev)), "bytes_limit": stats.get("bytes_limit"),
        "fuse_steps": lo["fuse_steps"], "compile_cache": cache_dir,
    }
