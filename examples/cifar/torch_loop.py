"""The CIFAR training loop in PyTorch: fp32, amp (static bf16 autocast) or triaccel (the wrapper)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from triaccel import Controller
from triaccel.backends.torch import augment, wrap
from triaccel.backends.torch.compile import compile_model
from triaccel.backends.torch.cuda_graph import ShapeGraphs
from triaccel.backends.torch.data import ElasticLoader, elastic_step
from triaccel.backends.torch.distributed import unwrap_parallel
from triaccel.backends.torch.flops import layer_flops
from triaccel.backends.torch.layers import discover_layers
from triaccel.distributed import decision_digest
from triaccel.backends.torch.models import create_model
from triaccel.flops import FlopShare
from triaccel.kernels._dispatch import prepare_triton_runtime

from .common import OOMInjector, RunLog, RunOptions, StepTrace, lr_factor, median_last, precision_record
from .datasets import CifarArrays


# Steps between peak-memory reads in the step records (a read builds torch's whole allocator-stats
# dict: ~0.3 ms of host time, measured under cProfile on an H100); a read is the peak since the last.
MEM_EVERY = 10


def pick_device(opts: RunOptions) -> torch.device:
    if opts.device != "auto":
        return torch.device(opts.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_arrays(data: CifarArrays, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(mean, std, train_x, train_y, test_x, test_y) on `device`: the images stay uint8 NHWC."""
    return (torch.tensor(data.mean, device=device), torch.tensor(data.std, device=device),
            *(torch.from_numpy(a).to(device) for a in (data.train_x, data.train_y, data.test_x, data.test_y)))


def _prep(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, size: int,
          channels_last: bool) -> torch.Tensor:
    """uint8 NHWC -> normalised float NCHW (in channels_last memory if asked), resized to `size`."""
    xb = augment.normalize(x, mean, std, channels_last=channels_last)
    if size != xb.shape[-1]:
        xb = F.interpolate(xb, size=size, mode="bilinear", align_corners=False)
    return xb


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, prep: Callable[[torch.Tensor], torch.Tensor],
             cast: Any, batch: int = 1000) -> float:
    """Top-1 accuracy on device-resident uint8 NHWC images (`prep`: a uint8 batch -> the model's input)."""
    model.eval()
    correct = 0
    for i in range(0, len(x), batch):
        xb = prep(x[i:i + batch])
        with cast():
            correct += int((model(xb).argmax(1) == y[i:i + batch]).sum())
    model.train()
    return correct / len(x)


def parts_forward(module: torch.nn.Module, parts: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A forward that runs `module` on `parts` near-equal slices of each batch and concatenates the
    outputs: in training mode BatchNorm normalises each slice by its own statistics, as `parts`
    data-parallel ranks would (one GPU standing in for several, --bn-parts)."""
    if parts == 1:
        return module
    return lambda xb: torch.cat([module(x) for x in xb.tensor_split(parts)])


def static_batches(buckets: Sequence[int], distributed: Any = None, smallest: int = 1) -> tuple[int, ...]:
    """The forward's batch sizes at the global batch buckets from `smallest` up: each rank runs global
    / world size (a bucket that does not divide gives uneven rank parts, which run uncompiled). Below
    the starting batch only a noise measurement's half batch (1 step in t_noise) or an OOM shrink
    would use a graph: those run eagerly rather than cost a compilation (EfficientNet-B0 under
    cudagraphs, H100, 2026-11-28: a 7.1 s gap at step 100, where the bs-48 noise halves begin)."""
    world = 1 if distributed is None else distributed.world_size
    return tuple(b // world for b in buckets if b % world == 0 and b >= smallest)


def build_model(opts: RunOptions, num_classes: int, device: torch.device) -> torch.nn.Module:
    """The run's model on `device`, seeded, in the run's memory format."""
    torch.manual_seed(opts.seed)
    model = create_model(opts.model, num_classes=num_classes, width=opts.width, seed=opts.seed).to(device)
    if opts.channels_last(device.type):
        model = model.to(memory_format=torch.channels_last)
    return model


def inner_optimizer(opts: RunOptions, model: torch.nn.Module) -> torch.optim.Optimizer:
    """Every method's optimizer: SGD with Nesterov momentum and weight decay."""
    return torch.optim.SGD(model.parameters(), lr=opts.lr, momentum=opts.momentum, nesterov=True,
                           weight_decay=opts.weight_decay)


class _Ahead(threading.Thread):
    """`fn()` started at once on a daemon thread; `finish()` waits for it and raises what it raised."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(name="triton-warmup", daemon=True)
        self.fn, self.error = fn, None
        self.start()

    def run(self) -> None:
        try:
            self.fn()
        except BaseException as e:   # re-raised on the caller's thread by finish()
            self.error = e

    def finish(self) -> None:
        self.join()
        if self.error is not None:
            raise self.error


def joined_before(ahead: _Ahead, step: Callable[[Any], None], phases: dict[str, float]) -> Callable[[Any], None]:
    """`step(decision)` that first waits for `ahead` (once; its wait in phases["triton_wait"], seconds): the
    thread's work then overlaps the first step's forward and backward as well as the set-up."""
    pending = [ahead]

    def first(decision: Any) -> None:
        if pending:
            t_wait = time.perf_counter()
            pending.pop().finish()
            phases["triton_wait"] = time.perf_counter() - t_wait
        step(decision)

    return first


def train(opts: RunOptions, data: CifarArrays, log: RunLog, progress: Any,
          distributed: Any = None) -> dict[str, Any]:
    """distributed: this rank of a torchrun launch (`triaccel.backends.torch.distributed.Distributed`):
    the model runs under DDP, each step's global batch is split across ranks (every method)."""
    t_start = time.perf_counter()
    device = pick_device(opts) if distributed is None else distributed.device
    # --triton-warmup on: Triton's per-process start-up on a thread beside the set-up below (no CUDA call),
    # then, once the wrapper exists, its statistics kernel compiled by one launch over the parameters;
    # joined before the first forward (a module loaded while the first step captures a CUDA graph would
    # break the capture)
    runtime = None
    if (opts.triton_warmup != "off" and opts.method == "triaccel" and device.type == "cuda"
            and opts.triaccel_config().kernels in ("auto", "triton")):   # "reference": no Triton to start
        runtime = _Ahead(prepare_triton_runtime)
    model = build_model(opts, data.num_classes, device)
    # where the set-up's seconds go (from t_start; the summary's setup_phases): 3.5-5.6 s passed between
    # the model and the next mark (then "wrapped" / "flops") in every graphed run, AMP's too (H200,
    # 2026-11-28, benchmarks/results/s41/callB-C); "arrays" and "loader" split that stretch
    phases = {"model": time.perf_counter() - t_start}
    nhwc = opts.channels_last(device.type)
    if device.type == "cuda":
        # cuDNN autotuning runs once per new input shape: the batch moves on a few buckets, and the
        # epoch's short last step adds one shape per bucket; the same setting for every method.
        torch.backends.cudnn.benchmark = opts.cudnn_benchmark
    if distributed is not None:
        model = distributed.prepare(model)   # DistributedDataParallel; rank 0's weights everywhere
    inner = inner_optimizer(opts, model)
    cfg = opts.triaccel_config(1 if distributed is None else distributed.world_size)
    mean, std, xtr, ytr, xte, yte = device_arrays(data, device)
    phases["arrays"] = time.perf_counter() - t_start
    # each rank its own augmentation stream (rank 0's is the single-process one)
    gen = torch.Generator(device=device).manual_seed(opts.seed + 7919 * (distributed.rank if distributed else 0))

    def prep(xb: torch.Tensor) -> torch.Tensor:
        return _prep(xb, mean, std, opts.image_size, nhwc)

    def transform(xb: torch.Tensor) -> torch.Tensor:
        return prep(augment.random_crop_flip(xb, gen))

    def keyed(xb: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        # --augment-rng sample: each sample's crop and flip from (seed, epoch, index), the same on any
        # number of ranks (whose generators are seeded apart), micro-batching or replay
        key = (opts.seed * 1_000_003 + loader.epoch) * len(xtr) + idx
        return prep(augment.keyed_crop_flip(xb, key))

    keyed_aug = opts.augment_rng == "sample"
    loader = ElasticLoader(xtr, ytr, batch_size=cfg.batch_init, seed=opts.seed,
                           transform=None if keyed_aug else transform, index_transform=keyed if keyed_aug else None)
    phases["loader"] = time.perf_counter() - t_start
    total_samples = opts.epochs * len(xtr)
    warmup_samples = int(opts.warmup_epochs * len(xtr))
    seen = [0]
    if opts.method == "triaccel":
        curv_idx = np.random.default_rng(opts.seed + 1)

        def curvature_batches():
            while True:
                idx = torch.from_numpy(curv_idx.choice(len(xtr), cfg.b_curv, replace=False)).to(device)
                yield transform(xtr[idx]), ytr[idx]

        opt: Any = wrap(inner, model, cfg, curvature_data=curvature_batches(), distributed=distributed)
        if runtime is not None:   # then the kernel, compiled and loaded
            started = runtime
            runtime = _Ahead(lambda: (started.finish(), opt.prepare_kernels()))
        controller: Controller = opt.controller
        cast = opt.autocast
        phases["wrapped"] = time.perf_counter() - t_start
        update: Callable[[Any], None] = lambda d: opt.step_accumulated()
        if runtime is not None and opts.triton_warmup == "first-step":
            # the first step's forward is eager (no capture a module load could break): joined before its update
            update = joined_before(runtime, update, phases)
            runtime = None
        step_kwargs = dict(scaler=opt, apply_lr_batch_scale=False, optimizer_step=update)
    else:
        opt = inner
        controller = Controller(cfg, ["model"])  # all levers off: a static batch, same data order
        if opts.method == "amp":
            def cast():
                return torch.autocast(device.type, dtype=torch.bfloat16)
        else:
            cast = contextlib.nullcontext
        step_kwargs = {"distributed": distributed}
    log.write("layers", names=list(controller.layer_names))
    # Training steps run the compiled forward; evaluation, FLOP counting and curvature the module.
    # Data parallel: the module DDP wraps (the elastic step reduces gradients itself).
    train_model = model if distributed is None else distributed.training_module()
    buckets = opts.compile_shapes == "buckets"
    graphed = static_batches(cfg.batch_buckets, distributed, cfg.batch_init) if buckets else None
    if opts.compile == "off":
        fwd = parts_forward(train_model, opts.bn_parts)
    elif opts.compile == "graphs":
        # a noise measurement's half batches graphed too (--graph-halves on): a capture costs 0.2-0.6 s (H200,
        # 2026-11-28) where an eager EfficientNet-B0 step costs ~33 ms of host time (H100, 2026-11-23)
        # (noise_split="double": a noise step's micro-batches are the buckets themselves; "steps": a noise
        # step is a step of the first half's size)
        halves = ({-(-b // 2) for b in graphed} if opts.method == "triaccel" and opts.graph_halves == "on"
                  and cfg.noise_split in ("halves", "steps") else set())
        eager_first = opts.graph_warmup == "eager"
        fwd = ShapeGraphs(train_model, set(graphed) | halves, max_graphs=3,
                          key=(lambda: opt.plan.key) if opts.method == "triaccel" else None,
                          warmup=0 if eager_first else int(opts.graph_warmup), eager_first=int(eager_first))
    else:
        fwd = compile_model(train_model, opt if opts.method == "triaccel" else None,
                            **({"backend": "cudagraphs"} if opts.compile == "cudagraphs" else {"mode": opts.compile}),
                            static_batches=graphed)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: lr_factor(seen[0], total_samples, warmup_samples))
    # conv/linear FLOPs per precision: the wrapper's layers, or all of AMP's/FP32's at one precision
    net = unwrap_parallel(model)   # layer names and FLOPs of the module itself (DDP: its .module)
    tlayers = opt.layers if opts.method == "triaccel" else discover_layers(net)
    flops = FlopShare(layer_flops(net, tlayers, transform(xtr[:1])))
    static_prec = None if opts.method == "triaccel" else precision_record(opts.method, [l.spec for l in tlayers])
    phases["flops"] = time.perf_counter() - t_start

    inject = OOMInjector(opts.inject_oom_every, torch.OutOfMemoryError)   # test-only (off by default)

    def loss_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        xb, yb = batch
        inject.fire()
        with cast():
            return F.cross_entropy(fwd(xb), yb)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    epoch_times: list[float] = []
    eval_peak = 0   # bytes, the evaluations' peak (CUDA)
    accs: list[float] = []
    step = 0
    profiler: list[Any] = []

    def begin_trace() -> None:
        acts = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
        profiler.append(torch.profiler.profile(activities=acts))
        profiler[0].start()

    def end_trace() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        profiler[0].stop()
        os.makedirs(os.path.join(opts.out, "trace"), exist_ok=True)
        profiler[0].export_chrome_trace(os.path.join(opts.out, "trace", "torch_trace.json"))

    tracer = StepTrace(opts.trace_steps, begin_trace, end_trace,
                       annotate=lambda s: torch.profiler.record_function(f"step {s}"))
    if runtime is not None:
        t_wait = time.perf_counter()
        runtime.finish()
        phases["triton_wait"] = time.perf_counter() - t_wait   # the thread's work not hidden by the set-up
    setup_seconds = time.perf_counter() - t_start
    eval_times: list[float] = []   # evaluation and the epoch's records, outside epoch_times
    for epoch in range(opts.epochs):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        losses: list[torch.Tensor] = []
        records: list[dict[str, Any]] = []
        bar = progress(total=len(xtr), desc=f"epoch {epoch + 1}/{opts.epochs}")
        while True:
            tracer.at(step)
            ctl_step = opt.step_count if opts.method == "triaccel" else step
            inject.arm(step)
            res = elastic_step(loader, controller, loss_fn, opt, ctl_step, **step_kwargs)
            seen[0] += res.samples
            flops.add(res.decision.precisions if static_prec is None else static_prec, res.samples)
            sched.step()
            losses.append(res.loss)
            bar.update(res.samples)
            # Step records are written at the epoch's end: reading the loss now would sync the host.
            records.append(dict(step=step, epoch=epoch, batch_size=res.decision.batch_size, samples=res.samples,
                                ooms=res.ooms, lr=opt.param_groups[0]["lr"],
                                host_s=round(time.perf_counter() - t0, 5),   # host time into the epoch
                                mem_used=(torch.cuda.max_memory_allocated(device)
                                          if device.type == "cuda" and (step % MEM_EVERY == 0 or res.end_of_epoch)
                                          else None)))
            step += 1
            if res.end_of_epoch:
                break
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        epoch_times.append(time.perf_counter() - t0)
        t_eval = time.perf_counter()
        bar.close()
        # the evaluation's batch of 1000 is not the training step's memory: left out of the probe
        with opt.memory.excluded() if opts.method == "triaccel" else contextlib.nullcontext():
            if distributed is not None:
                if epoch == opts.epochs - 1:   # what the average buys: rank 0 with its own statistics
                    own_acc = distributed.gather_objects(evaluate(model, xte, yte, prep, cast))[0]
                # every rank's BatchNorm statistics averaged: rank 0's alone saw 1 / world of each step's
                # samples (4 GPUs at a global 512, 3 seeds, 2026-11-27: 85.39% averaged, 85.36% with rank
                # 0's; the gap to one GPU's 86.05% was the ranks' augmentation draws, docs/results.md)
                distributed.sync_buffers()
            acc = evaluate(model, xte, yte, prep, cast)
            if device.type == "cuda":   # read before excluded() resets the counter: the run's peak keeps it
                eval_peak = max(eval_peak, torch.cuda.max_memory_allocated(device))
        accs.append(acc)
        log.end_epoch(controller, epoch, records, torch.stack(losses).float().cpu().tolist(), acc,
                      epoch_times[-1], step, flop_share=flops.shares())
        eval_times.append(time.perf_counter() - t_eval)
    tracer.close()
    peak = None
    if device.type == "cuda":  # the wrapper's probe resets torch's peak counter at each read
        peak = max(torch.cuda.max_memory_allocated(device), eval_peak,
                   opt.memory.peak_bytes if opts.method == "triaccel" else 0)
    ranks: dict[str, Any] = {"world_size": 1}
    if distributed is not None:   # equal digests: every rank took the same decisions
        digests = distributed.gather_objects(decision_digest(controller.telemetry.records))
        ranks = {"world_size": distributed.world_size, "rank_decision_digests": digests,
                 "ranks_agree": len(set(digests)) == 1, "final_acc_rank0_buffers": own_acc}
    return {**ranks, "final_acc": accs[-1], "accs": accs, "epoch_seconds": epoch_times,
            "s_per_epoch_median_last5": median_last(epoch_times), "peak_alloc_bytes": peak,
            "wall_seconds": time.perf_counter() - t_start, "setup_seconds": setup_seconds,
            "setup_phases": phases, "eval_seconds": eval_times, "train_seconds": sum(epoch_times),
            "steps": step, "final_batch": controller.decision.batch_size, "device": str(device),
            "injected_ooms": inject.injected,
            "flop_share": flops.shares(), "b_noise": controller.b_noise,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "graphed_sizes": sorted(fwd.sizes) if opts.compile == "graphs" else None,
            "compiled_graphs": (None if opts.compile == "off" else fwd.captures if opts.compile == "graphs"
                                else int(torch._dynamo.utils.counters["stats"]["unique_graphs"])),
            "report": opt.report() if opts.method == "triaccel" else None,
            "offload": (None if getattr(opt, "offload", None) is None else   # plans taken, when measured
                        {"plans": opt.offload.plans, "measurements": opt.offload.measurements,
                         "units": list(opt.offload.offload.units)})}
