"""The CIFAR training loop in JAX/Flax NNX: fp32, amp (all layers bf16) or triaccel (the wrapper)."""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from triaccel import Controller, Precision
from triaccel.backends.jax import (SplitStep, TriAccel, augment, find_state, layer_flops, layer_map_from_model,
                                   loss_scale, precision_policy)
from triaccel.backends.jax.compile_log import CompileLog, describe
from triaccel.backends.jax.data import OOM_ERROR_TYPES, ElasticLoader, InFlight, elastic_step, noise_step_compilations
from triaccel.backends.jax.models import batch_mask, create_model
from triaccel.backends.jax.sharding import (batch_sharding, check_config, data_mesh, num_shards,
                                            per_device_value_and_grad, replicated)
from triaccel.flops import FlopShare

from .common import HeapFreeze, OOMInjector, RunLog, RunOptions, StepTrace, lr_factor, median_last, precision_record
from .datasets import CifarArrays


def _sgd(lr: float, opts: RunOptions) -> optax.GradientTransformation:
    # The lr is a hyperparameter in the state so that the cosine schedule can follow samples seen
    # (the number of steps per epoch changes with the elastic batch).
    def make(learning_rate: float) -> optax.GradientTransformation:
        return optax.chain(optax.add_decayed_weights(opts.weight_decay),
                           optax.sgd(learning_rate, momentum=opts.momentum, nesterov=True))

    return optax.inject_hyperparams(make)(learning_rate=lr)


def _cross_entropy_sum(logits: jax.Array, y: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of the real samples' cross-entropies, their number)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
    return (ce * mask).sum(), mask.sum()


def _cross_entropy(logits: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:
    total, count = _cross_entropy_sum(logits, y, mask)
    return total / jnp.maximum(count, 1.0)


def pad_floor_size(option: str, platform: str, climbing: bool, buckets: tuple[int, ...], batch_max: int) -> int | None:
    """The loader's pad floor in samples (None: none) for --pad-floor `option` (auto | off | largest
    | N). auto = largest where a step compilation costs more than the padded compute and the batch
    can climb (platform "gpu", `climbing`: triaccel's batch lever), else off; largest = the largest
    bucket <= batch_max."""
    if option == "auto":
        option = "largest" if platform == "gpu" and climbing else "off"
    if option == "off":
        return None
    if option == "largest":
        return max((b for b in buckets if b <= batch_max), default=batch_max)
    return int(option)


def _noise_law(cfg: Any) -> bool:
    """The batch lever measures the gradient noise (its noise law)."""
    return cfg.elastic_batch and cfg.batch_law == "noise"


def _noise_programs(cfg: Any) -> bool:
    """The noise measurement has programs of its own (halves in the update, or the eager halves'),
    unless noise_split="steps" takes it from two steps' statistics rows."""
    return _noise_law(cfg) and cfg.noise_split != "steps"


def _fused(opts: RunOptions) -> bool:
    """--fused-step: one program per micro-batch (auto and on), with a step left in flight only."""
    return opts.in_flight == "on" and opts.fused_step in ("auto", "on")


def train(opts: RunOptions, data: CifarArrays, log: RunLog, progress: Any) -> dict[str, Any]:
    with HeapFreeze(opts.gc_freeze == "on") as heap:
        return _train(opts, data, log, progress, heap)


def _train(opts: RunOptions, data: CifarArrays, log: RunLog, progress: Any, heap: HeapFreeze) -> dict[str, Any]:
    t_start = time.perf_counter()
    # Every trace/lowering/XLA compilation of the run, timed on the critical path or in the background
    clog = CompileLog().start()
    compiles: dict[str, Any] = {"epochs": [], "evals": []}
    model = create_model(opts.model, num_classes=data.num_classes, width=opts.width, seed=opts.seed)
    # Data parallel over a mesh when more than one device is used (--devices; default all): each
    # batch is split across the devices, the state replicated (triaccel.backends.jax.sharding).
    mesh = data_mesh(getattr(opts, "devices", None))
    mesh = mesh if num_shards(mesh) > 1 else None
    cfg = opts.triaccel_config(1 if mesh is None else num_shards(mesh))   # the ladder's rungs that split evenly
    if mesh is not None:
        check_config(cfg, mesh)
    mean = jnp.asarray(data.mean, jnp.float32)
    std = jnp.asarray(data.std, jnp.float32)
    dev = jax.devices()[0]
    place = dev if mesh is None else replicated(mesh)   # the dataset, the LR: a copy on every device
    xtr, ytr = jax.device_put(data.train_x, place), jax.device_put(data.train_y.astype(np.int32), place)
    xte, yte = jax.device_put(data.test_x, place), jax.device_put(data.test_y.astype(np.int32), place)

    def prep(xb: jax.Array, key: jax.Array | None) -> jax.Array:
        if key is not None:
            xb = augment.random_crop_flip(xb, key)
        xb = augment.normalize(xb, mean, std)
        if opts.image_size != xb.shape[1]:
            xb = jax.image.resize(xb, (xb.shape[0], opts.image_size, opts.image_size, 3), "bilinear")
        return xb

    if opts.method == "triaccel":
        def curv_loss(m: Any, batch: Any) -> jax.Array:
            x, y = batch
            return _cross_entropy(m(x), y, jnp.ones(y.shape, jnp.float32))

        # a fused step measures the gradient noise in its own program, halves through the update
        ta = TriAccel(cfg, model, loss_fn=curv_loss, mesh=mesh, noise_in_update=_fused(opts) and _noise_programs(cfg))
        tx: Any = ta.wrap(_sgd(opts.lr, opts))
        controller: Controller = ta.controller
        lm = ta.layers
    else:
        ta = None
        tx = _sgd(opts.lr, opts)
        controller = Controller(cfg, ["model"])  # all levers off: a static batch, same data order
        lm = layer_map_from_model(model)
        if opts.method == "amp":  # static bf16 everywhere but the norm layers, as AMP
            precision_policy(model, [Precision.FP32 if s.kind == "norm" else Precision.BF16 for s in lm.specs], lm)
    # conv/linear FLOPs per precision: the wrapper's layers, or all of AMP's/FP32's at one precision
    flops = FlopShare(layer_flops(model, prep(xtr[:1], None), lm))
    static_prec = None if opts.method == "triaccel" else precision_record(opts.method, lm.specs)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    log.write("layers", names=list(controller.layer_names))
    key = jax.random.key(opts.seed)

    def hyper(opt: Any) -> Any:
        inner = find_state(opt.opt_state).inner if ta is not None else opt.opt_state
        return inner.hyperparams["learning_rate"]

    # auto: one compiled shape where a compilation costs more than the padded compute (a GPU: ~17 s
    # per ResNet-18 step variant) and the batch can climb; on a CPU compute dominates
    pad_floor = pad_floor_size(opts.pad_floor, dev.platform, ta is not None and cfg.elastic_batch,
                               cfg.batch_buckets or (), cfg.batch_max)
    # --bn-mask (auto: on where the pad floor pads): BatchNorm's batch statistics over the real samples
    # only (models.batch_mask), so the floor's copies, augmented apart and repeated unequally, do not
    # weigh in them
    bn_masked = opts.bn_mask == "on" or (opts.bn_mask == "auto" and pad_floor is not None)

    def stats_mask(mask: jax.Array) -> Any:
        return batch_mask(mask if bn_masked else None)

    def loss_sum(m: Any, xb: jax.Array, y: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        with stats_mask(mask):
            return _cross_entropy_sum(m(xb), y, mask)

    # --batch-stats per-device: each device's forward/backward on its own samples (BatchNorm statistics
    # per device, as torch's DDP), one gradient all-reduce (triaccel.backends.jax.sharding)
    per_device = (per_device_value_and_grad(loss_sum, mesh)
                  if mesh is not None and opts.batch_stats == "per-device" else None)

    # Every step program gathers its micro-batch from the device-resident training set by the
    # uploaded indices and draws its augmentation key from (base key, micro-batch counter): per
    # micro-batch the host uploads the indices and two scalars and calls one program. Gathers and a
    # key split as programs of their own cost more host time per step than the step's launch
    # (benchmarks/device/jax_dp_probe.py, bs 96 on an H200: 2.93 ms per step as one program that
    # gathers, 8.6-9.1 ms with the gathers, key split and update apart; docs/results.md).
    def grad_body(model: Any, opt: Any, idx: jax.Array, mask: jax.Array, xs: jax.Array, ys: jax.Array,
                  base: jax.Array, lr: jax.Array, count: jax.Array, weight: jax.Array):
        """weight: the step's gradient weight (elastic_step's, 1 but for a short step under
        short_step_lr), multiplied into the gradients with the loss scale; the loss returned is the mean."""
        xb = prep(xs[idx], jax.random.fold_in(base, count))
        y = ys[idx]
        scale = loss_scale(opt.opt_state) if ta is not None else jnp.ones((), jnp.float32)
        if per_device is not None:
            loss, grads = per_device(model, xb, y, mask, scale=scale * weight)
            return loss, grads, scale

        def lf(m: Any) -> tuple[jax.Array, jax.Array]:
            with stats_mask(mask):
                loss = _cross_entropy(m(xb), y, mask)
            return loss * (scale * weight), loss

        (_, loss), grads = nnx.value_and_grad(lf, has_aux=True)(model)
        return loss, grads, scale   # the scale the grads carry (the noise measurement unscales them)

    def update_body(params: Any, opt: Any, grads: Any, lr: jax.Array, **noise: jax.Array) -> None:
        hyper(opt).set_value(lr)
        opt.update(params, grads, **noise)

    def eval_body(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        model.eval()   # the trace's own copy of the model: the training graph is not touched
        return (model(prep(x, None)).argmax(-1) == y).sum()

    # jax.jit over the split state (SplitStep): nnx.jit's per-call graph walk costs the host more than
    # a whole bs-96 step on the GPU (docs/benchmarks.md). No donation: a micro-batch that runs out of
    # memory must leave the state intact for its retry. The update sees only the parameters' state
    # and the optimizer, not the model's graph: a new precision policy does not recompile it.
    # Every micro-batch is padded to the decided batch's bucket (the noise halves, the epoch's short
    # last step), or to --pad-floor's when larger: only those sizes are step variants, all compiled ahead. The update and the
    # evaluation (once per policy) are compiled in the background too, from the shapes they will see.
    cache = False if opts.compile_cache == "off" else (opts.compile_cache or True)
    # The loader serves sample indices (host arrays: one upload per micro-batch, split across the
    # devices on a mesh); the step programs gather the images and labels themselves (grad_body).
    loader = ElasticLoader((np.arange(len(data.train_x), dtype=np.int32),), batch_size=cfg.batch_init,
                           seed=opts.seed, pad_to_batch=True, pad_floor=pad_floor, buckets=cfg.batch_buckets,
                           device=None if mesh is None else batch_sharding(mesh))
    # With a step in flight (and --fused-step), every step runs as one program per micro-batch,
    # gradient and update (`train_body`, the step's main program: compiled ahead for the sizes and
    # policies the controller may ask for); a gradient-noise step as two calls of it, its halves,
    # which the wrapper's update accumulates and measures (TriAccel(noise_in_update=True)). The two
    # programs `grad_body` then `update_body` run OOM replays only (compiled when one happens). On 4
    # GPUs a second program per step held the step at 0.53-0.69 of linear scaling, one program at
    # 0.85-0.88 (benchmarks/device/jax_dp_probe.py); ResNet-18 bs 96 on one H200 (2026-11-27): the
    # demo's AMP epoch 1.48 s as one program (0.86x a plain loop's) against 3.1-3.5 s as two before
    # the state was packed. docs/results.md
    noise_steps = ta is not None and _noise_programs(cfg)   # the first: step 100
    fused = _fused(opts)
    in_update = ta is not None and ta.noise_in_update

    def train_body(model: Any, opt: Any, idx: jax.Array, mask: jax.Array, xs: jax.Array, ys: jax.Array,
                   base: jax.Array, lr: jax.Array, count: jax.Array, weight: jax.Array, *part: jax.Array) -> jax.Array:
        """part (with in-update noise): 0 a plain step, 1 / 2 a noise step's first / second half."""
        loss, grads, _ = grad_body(model, opt, idx, mask, xs, ys, base, lr, count, weight)
        update_body(model, opt, grads, lr, **({"noise_part": part[0], "noise_samples": mask.sum()} if part else {}))
        return loss

    split = SplitStep(train_body if fused else grad_body, model, opt, ta=ta, donate_argnums=(),
                      compile_ahead=opts.compile_ahead, compile_cache=cache, mesh=mesh, pad_to_batch=True, loader=loader,
                      compiler_options=opts.xla_options or None)
    # One step left running while the host prepares the next (no donation above keeps the state it
    # may have to be restored to); settled before anything reads the state or the losses.
    in_flight = InFlight(split.snapshot, split.restore) if opts.in_flight == "on" else None
    params = nnx.state(model, nnx.Param)
    sharding = jax.sharding.SingleDeviceSharding(dev) if mesh is None else place
    grads_like = jax.tree_util.tree_map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=sharding), params)
    eager_noise = noise_steps and not in_update   # noise halves as gradients the host combines
    if eager_noise:
        for name, job in noise_step_compilations(grads_like):
            split.compile_in_background(name, job)
    lr_like = jax.device_put(np.float32(opts.lr), place)
    # without the fused step every step needs it at once; with it the eager noise steps (compiled
    # ahead after the background jobs) and replays (compiled when needed)
    update = split.bind(update_body, params, opt, soon=not fused,
                        example_args=(grads_like, lr_like) if eager_noise or not fused else None)
    base_key = jax.device_put(key, place)
    micro_count = [0]   # micro-batches run so far: each one's augmentation key is fold_in(base_key, count)
    if fused:
        size = loader.bucket_for(max(cfg.batch_init, pad_floor or 0))   # the first steps' micro-batch
        on = loader.device or jax.sharding.SingleDeviceSharding(dev)
        idx_like = jax.ShapeDtypeStruct((size,), jnp.int32, sharding=on)
        mask_like = jax.ShapeDtypeStruct((size,), jnp.float32, sharding=on)
        count_like = jax.device_put(np.int32(0), place)
        weight_like = jax.device_put(np.float32(1.0), place)
        grads_of = split.bind(grad_body, model, opt, soon=False,
                              example_args=(idx_like, mask_like, xtr, ytr, base_key, lr_like, count_like, weight_like)
                              if eager_noise else None)
    eval_chunk = min(1000, len(data.test_x))
    # needed at the epoch's end: queued after the noise programs the first noise step needs
    evaluate = split.bind(eval_body, model, example_args=(xte[:eval_chunk], yte[:eval_chunk]), soon=False)

    grad_scale: list[Any] = [1.0]   # the loss scale of the last micro-batch's grads (a device scalar)

    # test-only (off by default): an XLA runtime error with RESOURCE_EXHAUSTED, as a real OOM
    inject = OOMInjector(opts.inject_oom_every, OOM_ERROR_TYPES[0])

    def scalars(lr: float, weight: float, *part: int) -> tuple[jax.Array, ...]:
        """Each micro-batch: (LR, its key's counter, the step's gradient weight[, its noise part]) in
        one upload (and a test OOM, if armed)."""
        inject.fire()
        micro_count[0] += 1
        return jax.device_put((np.float32(lr), np.int32(micro_count[0]), np.float32(weight), *map(np.int32, part)),
                              place)

    def micro(idx: jax.Array, mask: jax.Array, lr: float) -> Any:
        # weight 1: elastic_step weighs the summed gradients of steps through here itself
        loss, grads, grad_scale[0] = (grads_of if fused else split)(idx, mask, xtr, ytr, base_key, *scalars(lr, 1.0))
        return loss, grads

    def whole(idx: jax.Array, mask: jax.Array, lr: float, weight: float, part: int = 0) -> Any:
        return split(idx, mask, xtr, ytr, base_key, *scalars(lr, weight, *((part,) if in_update else ())))

    total_samples = opts.epochs * len(data.train_x)
    warmup_samples = int(opts.warmup_epochs * len(data.train_x))
    seen = 0
    rng = np.random.default_rng(opts.seed + 1)
    curv_key = jax.random.key(opts.seed + 1)
    epoch_times: list[float] = []
    eval_times: list[float] = []   # evaluation and the epoch's records, outside epoch_times
    accs: list[float] = []
    step = 0
    heap.freeze()
    compiles["setup"] = clog.window()
    setup_seconds = time.perf_counter() - t_start
    losses: list[Any] = []   # the epoch's step results

    def end_trace() -> None:
        if in_flight is not None:
            in_flight.settle()
        if losses:
            jax.block_until_ready(losses[-1].loss)
        jax.profiler.stop_trace()

    tracer = StepTrace(opts.trace_steps, lambda: jax.profiler.start_trace(
        os.path.join(opts.out, "trace"), create_perfetto_trace=True), end_trace,
        annotate=lambda s: jax.profiler.TraceAnnotation(f"step {s}"))
    for epoch in range(opts.epochs):
        t0 = time.perf_counter()
        losses = []
        records: list[dict[str, Any]] = []
        bar = progress(total=len(data.train_x), desc=f"epoch {epoch + 1}/{opts.epochs}")
        while True:
            tracer.at(step)
            lr_now = opts.lr * lr_factor(seen, total_samples, warmup_samples)
            if ta is not None:
                curv = None
                if in_flight is not None and (controller.is_control_step(step) or controller.is_curvature_step(step)):
                    in_flight.settle()   # the boundary reads the state
                if controller.is_curvature_step(step):  # augmented, as the training batches (and torch's)
                    idx = rng.choice(len(data.train_x), cfg.b_curv, replace=False)
                    curv_key, k = jax.random.split(curv_key)
                    curv = (prep(xtr[idx], k), ytr[idx])
                split.control(step, batch=curv)
            inject.arm(step)
            res = elastic_step(loader, controller, lambda b, m, lr=lr_now: micro(b[0], m, lr), step,
                               update_fn=lambda g, d, lr=lr_now: update(g, jax.device_put(np.float32(lr), place)),
                               tensor_layer=lm if ta is not None else None,
                               grad_scale=lambda: grad_scale[0], in_flight=in_flight, quiet=split.quiet,
                               step_fn=(lambda b, m, d, w, lr=lr_now: whole(b[0], m, lr, w)) if fused else None,
                               noise_step_fn=(lambda b, m, d, part, w, lr=lr_now: whole(b[0], m, lr, w, part))
                               if in_update else None)
            seen += res.samples
            flops.add(res.decision.precisions if static_prec is None else static_prec, res.samples)
            # kept for its loss (a late OOM's replay replaces it), read at the epoch's end; not its
            # gradients: a result per step holding them kept every step's gradients alive all epoch
            res.grads = res.aux = res.updated = None
            losses.append(res)
            bar.update(res.samples)
            # Step records are written at the epoch's end: reading the loss now would sync the host.
            records.append(dict(step=step, epoch=epoch, batch_size=res.decision.batch_size, samples=res.samples,
                                ooms=res.ooms, lr=lr_now, host_s=round(time.perf_counter() - t0, 5),
                                mem_used=(dev.memory_stats() or {}).get("bytes_in_use")))
            step += 1
            if res.end_of_epoch:
                break
        if in_flight is not None:
            in_flight.settle()
        jax.block_until_ready(losses[-1].loss)
        epoch_times.append(time.perf_counter() - t0)
        compiles["epochs"].append(clog.window())
        bar.close()
        t_eval = time.perf_counter()
        correct = sum(int(evaluate(xte[i:i + eval_chunk], yte[i:i + eval_chunk]))
                      for i in range(0, len(data.test_x), eval_chunk))
        acc = correct / len(data.test_x)
        accs.append(acc)
        # one transfer per loss, no compilation (a stack of them compiled once per step count)
        step_losses = np.asarray(jax.device_get([r.loss for r in losses]), dtype=np.float64).tolist()
        log.end_epoch(controller, epoch, records, step_losses, acc, epoch_times[-1], step, flop_share=flops.shares())
        heap.freeze()   # what the epoch left alive (its compiled variants), outside its seconds
        eval_times.append(time.perf_counter() - t_eval)
        compiles["evals"].append(clog.window())   # evaluation and the epoch's records
        print(f"  train {describe(compiles['epochs'][-1])}\n  eval {eval_times[-1]:.1f}s, "
              f"{describe(compiles['evals'][-1])}", flush=True)
    unused = split.never_taken   # before close: compiled in the background beside the training, never used
    if unused:
        print(f"compiled ahead and never used: {', '.join(unused)}", flush=True)
    split.close()   # the compilations still queued (variants the run did not reach) are not waited for at exit
    tracer.close()
    stats = dev.memory_stats() or {}
    report = ta.report(split) if ta is not None else None
    compiles["end"] = clog.window()
    compiles["total"] = clog.summary()
    compiles["records"] = [[r.kind, r.name, round(r.seconds, 4), r.background, round(r.end, 3)] for r in clog.records]
    clog.stop()
    wall = time.perf_counter() - t_start
    return {"final_acc": accs[-1], "accs": accs, "epoch_seconds": epoch_times,
            "s_per_epoch_median_last5": median_last(epoch_times),
            "peak_alloc_bytes": stats.get("peak_bytes_in_use"), "steps": step,
            "final_batch": controller.decision.batch_size, "device": str(dev), "injected_ooms": inject.injected,
            "late_ooms": in_flight.lagged_ooms if in_flight is not None else 0,
            "flop_share": flops.shares(), "b_noise": controller.b_noise,
            "device_name": getattr(dev, "device_kind", str(dev)),
            "devices": 1 if mesh is None else num_shards(mesh), "fused_step": fused, "noise_in_update": in_update,
            "report": report, "wall_seconds": wall, "setup_seconds": setup_seconds, "eval_seconds": eval_times,
            "compile_log": compiles, "train_seconds": sum(epoch_times),
            "step_traces": split.traces, "compiled_ahead": split.compiled_ahead, "compiled_ahead_unused": unused,
            "compile_cache": split.compile_cache, "memory_budget": cfg.memory_budget, "pad_floor": pad_floor,
            "bn_masked": bn_masked, "bytes_limit": stats.get("bytes_limit")}
