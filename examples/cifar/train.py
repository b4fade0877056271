"""Train ResNet-18 / EfficientNet-B0 on CIFAR-10/100 with fp32, amp or triaccel, in torch or JAX.

    python -m examples.cifar.train --backend torch --method triaccel --epochs 10

Writes under --out (default runs/<backend>-<model>-<dataset>-<method>-s<seed>): log.jsonl (run header,
steps, epochs, the controller's decisions), summary.json, and PNG plots (per-layer precision heatmap,
batch size and memory, lambda_max per layer, loss and accuracy). With no GPU the defaults shrink to a
short CPU run (1 epoch on 2,048 training images, width 0.25) unless the options say otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from triaccel.local_plan import parse_reserve

from .common import DEFAULT_LEVERS, LEVERS, MEMORY_FORMATS, RunLog, RunOptions, options_record
from .plots import plot_run


def _has_gpu(backend: str) -> bool:
    if backend == "torch":
        import torch

        return torch.cuda.is_available()
    import jax

    return jax.default_backend() == "gpu"


def _parse_set(items: Sequence[str], flag: str = "--set", what: str = "a TriAccelConfig field") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"{flag} {item!r}: expected KEY=VALUE ({what})")
        if value in ("true", "false", "null") or value[:1] in "0123456789-[{":
            try:
                out[key] = json.loads(value)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{flag} {item!r}: {value!r} is not a JSON number, list or object ({e})") from None
        else:   # a string, e.g. kernels=triton (a word starting t/f/n is not JSON's true/false/null)
            out[key] = value
    return out


def _views_arg(v: str) -> int | str:
    """--cache-views: "auto" or an integer >= 1."""
    if v == "auto":
        return v
    if not v.isdigit() or int(v) < 1:
        raise argparse.ArgumentTypeError(f"{v!r}: allowed auto or an integer >= 1")
    return int(v)


def _epochs_list(v: str) -> tuple[int, ...]:
    """--block-epochs: comma-separated integers >= 1."""
    parts = v.split(",")
    if not all(x.strip().isdigit() and int(x) >= 1 for x in parts):
        raise argparse.ArgumentTypeError(f"{v!r}: allowed comma-separated integers >= 1, one per block, e.g. 10,15,15")
    return tuple(int(x) for x in parts)


def parse_args(argv: Sequence[str] | None = None) -> RunOptions:
    p = argparse.ArgumentParser(prog="python -m examples.cifar.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["torch", "jax"], default="torch")
    p.add_argument("--model", choices=["resnet18", "efficientnet_b0"], default="resnet18")
    p.add_argument("--dataset", choices=["cifar10", "cifar100"], default="cifar10")
    p.add_argument("--method", choices=["fp32", "amp", "triaccel", "local"], default="triaccel",
                   help="local: NeuroFlux-style block-wise training under --budget (torch or jax; examples/cifar/local_loop.py)")
    p.add_argument("--exit-tolerance", type=float, default=0.01,
                   help="local: export the smallest exit within this accuracy fraction of the best (0.01 = 1 point)")
    p.add_argument("--max-blocks", type=int, default=4, help="local: at most this many blocks")
    p.add_argument("--cache-views", type=_views_arg, default="auto",
                   help="local: fixed augmentations of the training set cached per block; auto (default): as "
                        "many as epochs while the host caches fit half of the available host memory")
    p.add_argument("--block-inputs", choices=["cache", "fresh"], default="cache",
                   help="local: blocks after the first read cached outputs of fixed views (cache) or run the "
                        "frozen prefix on freshly augmented images every step (fresh: no cache, no views)")
    p.add_argument("--cuda-graph", choices=["on", "off"], default="on",
                   help="local, torch on CUDA: capture each block's full-batch step once and replay it (on, default) "
                        "or run every step eagerly (off); JAX's steps are compiled by XLA either way")
    p.add_argument("--fuse-steps", type=int, default=None, metavar="K",
                   help="local, JAX: full-batch block steps run K per compiled call (a lax.scan; one host sync per "
                        "call, the counterpart of torch's CUDA graphs); 1: every step through the elastic path. "
                        "Default 16")
    p.add_argument("--graph-reserve", default="auto",
                   help="local, torch with --cuda-graph on: device bytes each block step keeps free beside its "
                        "modelled peak for the graph (e.g. 64MiB; smaller batches or more blocks within the same "
                        "budget; 0: none). Default auto: 32MiB on a CUDA device (on the H100 under issue 18's "
                        "520 MiB budget all three block captures fitted with it, the last one not without), 0 "
                        "elsewhere. A capture that does not fit falls back to eager steps")
    p.add_argument("--block-epochs", type=_epochs_list, default=None,
                   help="local: epochs of each block, comma-separated, one per planned block (default: --epochs "
                        "for every block; ResNet-18 under e2e:32 on the H100: 24,24,8 instead of 20 each moved the "
                        "best exit from -0.88 to -0.73 points of end-to-end's, mean of three seeds, at the same time)")
    p.add_argument("--exit-eval", choices=["epoch", "end"], default=None,
                   help="local: evaluate a block's exit on the test set after each of its epochs (epoch, default) "
                        "or only every exit once at the end (end: less time outside training)")
    p.add_argument("--block-curvature", type=int, default=None, metavar="N",
                   help="local: the curvature lever per block: every N epochs of a block, its LR is scaled by "
                        "1/(1 + alpha * its top Fisher eigenvalue) (triaccel.local_plan.BlockCurvature); "
                        "0 (default): off")
    p.add_argument("--plan-headroom", type=float, default=None, metavar="F",
                   help="local: the fraction of the budget a block's modelled peak may reach, (0, 1] (default "
                        "0.85: on the H100 under e2e:32 budgets every ResNet-18 block's CUDA graph fitted, and "
                        "EfficientNet-B0's first three of four)")
    p.add_argument("--head-pool", type=int, default=None, metavar="P",
                   help="local: an auxiliary head average-pools its block's map to at most P x P before its conv "
                        "(default 4; a larger P keeps more of the map's layout for the head, at a larger modelled "
                        "head peak; ResNet-18 local on the H100: 8 cost 0.9 points, 1 cost 3, 2 stayed within the "
                        "seeds' spread)")
    p.add_argument("--block-batch", type=int, default=None,
                   help="local: the partition aims at the largest batch bucket <= this (default: --batch-max)")
    p.add_argument("--epochs", type=int, default=None, help="default: 10 on a GPU, 1 on CPU")
    p.add_argument("--data", default=None,
                   help="CIFAR root: the official python folder (cifar-10-batches-py / cifar-100-python) "
                        "or an image-folder tree {train,test}/<class>/*.jpg (default: $TRIACCEL_DATA, else "
                        "~/.cache/triaccel/<dataset> or $TRIACCEL_CACHE/<dataset>, where the official archive "
                        "is downloaded on first use)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=None, help="initial/static batch (default 96; 32 on CPU)")
    p.add_argument("--lr", type=float, default=None, help="SGD lr at the initial batch (default 0.1 x batch/96)")
    p.add_argument("--width", type=float, default=None, help="channel width multiplier (default 1; 0.25 on CPU)")
    p.add_argument("--image-size", type=int, default=32, help="input resolution (224 = the paper's EfficientNet)")
    p.add_argument("--train-subset", type=int, default=None, help="train on N random images (default: all; "
                   "2048 on CPU)")
    p.add_argument("--test-subset", type=int, default=None, help="evaluate on N images (default: all; 512 on CPU)")
    p.add_argument("--budget", default=None, help="memory budget, e.g. 4GiB (triaccel)")
    p.add_argument("--offload", choices=["off", "auto"], default="off",
                   help="triaccel, torch: auto = batch and activation swap/recompute plan chosen together under the "
                        "budget from measured costs (TriAccelConfig.offload; the summary lists the plans taken)")
    p.add_argument("--batch-max", type=int, default=512,
                   help="upper bound of the elastic batch (samples), the ladder's top rung (default 512: ladder "
                        "96/192/384/512; torch triaccel without a rung between it and half of it, 96/192/512, "
                        "and its noise steps at two micro-batches of the decided size, RunOptions.triaccel_config). With 768 allowed ResNet-18 seeds 1-2 ended 0.3-0.6 points lower at about the "
                        "same wall (docs/results.md, 2026-11-23)")
    p.add_argument("--lr-rule", choices=["linear", "sqrt", "none", "accumulate"], default="linear",
                   help="LR multiplier when the batch changes (default linear, SGD's rule: one-seed ResNet-18 "
                        "runs reached 84.5%% with it vs 81.6%% with sqrt, docs/results.md)")
    p.add_argument("--curvature", choices=["fisher", "hessian", "off"], default="fisher")
    p.add_argument("--levers", default=",".join(DEFAULT_LEVERS),
                   help="triaccel levers on, comma-separated subset of precision,curvature,batch (default "
                        "precision,batch: the curvature LR scaling lowered accuracy in 3-seed ablations, "
                        "docs/results.md)")
    p.add_argument("--warmup-epochs", type=float, default=1.0,
                   help="linear LR warm-up over this many epochs (of samples), then cosine; every method")
    p.add_argument("--t-ctrl", type=int, default=50)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other TriAccelConfig field, e.g. --set min_dwell=400")
    p.add_argument("--xla-option", action="append", default=[], metavar="KEY=VALUE",
                   help="JAX: an XLA compiler option for the step's, the update's and the evaluation's "
                        "programs, every method alike (SplitStep's compiler_options), e.g. --xla-option "
                        "xla_gpu_autotune_level=2 (repeatable)")
    p.add_argument("--device", default="auto", help="torch device (cuda, cpu) or auto")
    p.add_argument("--out", default=None)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--cudnn-benchmark", choices=["on", "off"], default="off",
                   help="torch: cuDNN autotuning, once per new input shape (default off: on an H100 it made "
                        "AMP bs 96, bs 192 and triaccel slower over 10 epochs, 70.6/38.8/45.9 s vs "
                        "63.5/35.9/41.4 s, the first epoch paying the tuning; docs/results.md)")
    p.add_argument("--memory-format", choices=list(MEMORY_FORMATS), default="auto",
                   help="torch on CUDA: the model's and inputs' memory format, every method (auto: "
                        "channels_last, but contiguous for EfficientNet, whose depthwise convolutions cost "
                        "~10 s per new batch size in channels_last on an H100; docs/results.md)")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="JAX: keep XLA compilations in DIR (created) and reuse them on later runs (default: "
                        "$TRIACCEL_CACHE/jax or ~/.cache/triaccel/jax; 'off': no persistent cache)")
    p.add_argument("--devices", type=int, default=None,
                   help="JAX: data parallel over the first N devices, each batch split across them (default: "
                        "all; batch sizes must divide by N; triaccel.backends.jax.sharding)")
    p.add_argument("--bn-mask", choices=["auto", "off", "on"], default="auto",
                   help="JAX: on = BatchNorm's batch statistics over the real samples of a padded micro-batch only "
                        "(models.batch_mask): a step padded to the pad floor then computes the unpadded step's "
                        "gradients, whatever its copies' augmentation; off: every row counts. Default auto: on "
                        "where the pad floor pads (triaccel's climbing batch on a GPU). One H200, 2026-11-27: "
                        "EfficientNet-B0 76.14/73.68/76.67/76.59%% on seeds 0-3 against AMP bs 512's "
                        "68.59/70.30/75.34/74.08%% (unmasked triaccel 69.5-71.9%% in earlier runs); ResNet-18 "
                        "87.33%% mean of 3 seeds against 87.37%% unmasked (docs/results.md)")
    p.add_argument("--batch-stats", choices=["global", "per-device"], default="per-device",
                   help="on several devices: BatchNorm statistics of each device's part (default; torch's DDP has no "
                        "other; JAX: one gradient all-reduce per step, sharding.per_device_value_and_grad) or, JAX "
                        "only, of the global batch (the same results as one device; one all-reduce per BatchNorm "
                        "layer and pass). Two H200s, ResNet-18, global batch 512, 3 seeds (two calls, 2026-11-27): per-device "
                        "85.21%% against one device's 85.00%%; 0.95 / 0.90 of linear scaling at 2 / 4 devices against 0.88 / 0.83 "
                        "global (docs/results.md)")
    p.add_argument("--bn-parts", type=int, default=1, metavar="K",
                   help="torch, --compile off: each micro-batch's forward runs on K near-equal slices, so "
                        "BatchNorm normalises each by its own statistics, as K data-parallel ranks would: one GPU "
                        "standing in for K ranks' BatchNorm; its running statistics then update K times a step "
                        "(diagnostic; default 1)")
    p.add_argument("--augment-rng", choices=["stream", "sample"], default="stream",
                   help="torch: where the crops and flips come from: stream (default), each rank's generator "
                        "(seeded by rank); sample, a hash of (seed, epoch, sample index), so every sample is "
                        "augmented alike on any number of ranks (with --bn-parts: one GPU computes what the ranks "
                        "do; backends.torch.augment.keyed_crop_flip)")
    p.add_argument("--compile-ahead", choices=["on", "after", "off"], default="on",
                   help="JAX: compile the step variants the controller is likely to switch to (batch bucket "
                        "down/up, noise half batch, next precision policy) and the evaluation on a background "
                        "thread (default on; after: none while the loop's thread compiles, slower in five cold "
                        "runs of 2026-11-27/28, docs/results.md); "
                        "not used by --method local (its blocks compile in place: measured faster)")
    p.add_argument("--in-flight", choices=["on", "off"], default="on",
                   help="JAX: leave each optimizer step running on the device while the host prepares the next "
                        "(an out-of-memory error, which JAX reports only when a result is waited for, then "
                        "restores the state and replays that step's samples: data.InFlight). Default on "
                        "(H100, 2026-11-25: median epoch after the first 0.78-0.88x of waiting's in 3 pairs, peak +0.0-0.4 GiB; "
                        "docs/results.md); off waits for every micro-batch")
    p.add_argument("--fused-step", choices=["auto", "on", "off"], default="auto",
                   help="JAX with --in-flight on: run each micro-batch as one program, gradient and update together "
                        "(elastic_step(step_fn=...)); a gradient-noise step as two of them, its "
                        "halves (noise_split=halves, the default) or two batches of the decided size (double), accumulated "
                        "and measured in the wrapper's update (TriAccel(noise_in_update=True); --set noise_split=steps "
                        "runs it as a half-batch step of its own); off: two programs, "
                        "as OOM replays. auto (default): on (with --in-flight off: off; 'on' refuses it). "
                        "The demo's AMP at bs 96 on one H200 (2026-11-27): 1.48 s per epoch as one program (state "
                        "packed), 3.1-3.5 s as two (unpacked; benchmarks/device/jax_harness.sh); 4 H200s, 1024 per "
                        "GPU: 0.88 / 0.83 of linear scaling at 2 / 4 GPUs on, 0.71 / 0.53 off (docs/results.md)")
    p.add_argument("--gc-freeze", choices=["on", "off"], default="on",
                   help="JAX: after set-up and after each epoch, move the objects alive then out of the garbage "
                        "collector's scans (gc.freeze; examples/cifar/common.HeapFreeze), every method alike; off "
                        "leaves Python's collector as it is")
    p.add_argument("--pad-floor", default="auto", metavar="auto|off|largest|N",
                   help="JAX: pad every micro-batch at least to N samples' bucket ('largest': the largest batch "
                        "bucket <= --batch-max), so a climbing batch runs at one compiled shape (copies of its "
                        "own samples, masked out of the loss; dropped after an out-of-memory error). Default "
                        "auto: largest for triaccel with the batch lever on a GPU (H100, 2026-11-25: cold run "
                        "53.4 s against 74.5 s unpadded, warm 28.5 against 25.8 s), else off")
    p.add_argument("--compile", choices=["off", "default", "reduce-overhead", "cudagraphs", "graphs"], default="off",
                   help="torch: torch.compile the model (every method; reduce-overhead = inductor's kernels in CUDA "
                        "graphs; cudagraphs = the model's own kernels in CUDA graphs, torch's 'cudagraphs' backend: "
                        "no kernel generation, for host-bound steps at a small compile cost). One compilation per "
                        "precision policy and, as --compile-shapes says, per batch shape or for all of them "
                        "(triaccel.backends.torch.compile). graphs: no compiler, the forward and backward captured "
                        "as CUDA graphs per batch bucket and policy (torch.cuda.make_graphed_callables, "
                        "triaccel.backends.torch.cuda_graph.ShapeGraphs; buckets only)")
    p.add_argument("--graph-halves", choices=["on", "off"], default="on",
                   help="torch, --compile graphs, triaccel: capture the gradient-noise measurements' half batches "
                        "too (on) or run them eagerly (off): a capture costs 0.2-0.6 s once (H200, 2026-11-28), an "
                        "eager half step its host time at every measurement (ResNet-18 ~5 ms, EfficientNet-B0 "
                        "~30 ms), every t_noise steps. Only with --set noise_split=halves: the torch default, double, measures "
                        "on two micro-batches of the decided size, no half batches")
    p.add_argument("--graph-warmup", choices=["3", "1", "eager"], default="eager",
                   help="torch, --compile graphs: eager (default): a shape's first step runs eagerly as a real step "
                        "and the next one captures with no discarded pass (ShapeGraphs' default); or 3 / 1 "
                        "discarded warm-up passes before each capture (torch.cuda.make_graphed_callables on a side "
                        "stream; 3 is torch's recipe). Summed over six sizes the captures cost 2.17 / 2.38 / 3.18 s "
                        "(eager / 1 / 3) on EfficientNet-B0, 0.82 / 0.94 / 1.11 s on ResNet-18 (H200, 2026-11-28, "
                        "benchmarks/device/capture_cost.py)")
    p.add_argument("--triton-warmup", choices=["auto", "on", "first-step", "off"], default="auto",
                   help="torch, triaccel, CUDA: run Triton's once-per-process start-up (its cache key and driver; "
                        "~1.1 s of the first statistics launch under cProfile, H200, 2026-11-28) and the statistics "
                        "kernel's compilation (TriAccelOptimizer.prepare_kernels) on a thread beside the set-up, "
                        "joined before the first forward, instead of in the first step (graphed, seed 0, H200, 2026-11-28: "
                        "EfficientNet-B0 28.6 s from model to last evaluation against 31.9 s off, ResNet-18 18.6 "
                        "against 18.5 s; a child process compiling the kernel instead was slower: "
                        "benchmarks/results/s38/callE; only the start-up on the thread and the kernel compiled on the "
                        "main thread was slower in 4 of 4 runs: benchmarks/results/s39/callA). first-step: joined "
                        "before the first step's update instead, so that the thread also overlaps that step's eager "
                        "forward and backward (--compile off or graphs only: their first step captures nothing). "
                        "auto (default): first-step where the first step is eager (--compile off or graphs), on "
                        "otherwise (measured graphed only). first-step against on, graphed, bytecode cached, one H200 per call: ResNet-18 "
                        "wall -0.7 / -0.9 / -1.5 / -0.6 s on seeds 0-3, EfficientNet-B0 +0.5 / +0.2 / 0.0 s on "
                        "seeds 0-2 (2026-12-02, benchmarks/results/s46/call1-2), -2.5 / -1.7 / +1.4 s on three pairs "
                        "before (s45/call4): lower on 6 of 10 pairs, -0.58 s on the mean")
    p.add_argument("--compile-shapes", choices=["auto", "dynamic", "buckets"], default="auto",
                   help="torch with --compile: one graph for every batch size (dynamic), or one graph per batch "
                        "bucket visited, specialised to it, other sizes (an epoch's short last batch) eager "
                        "(buckets: faster steps, one compilation per bucket; H100, ResNet-18 bs 384, CUDA graphs: "
                        "0.502x vs 0.632x the eager step, benchmarks/compiled.py). Default auto: buckets with "
                        "--compile cudagraphs (that backend cannot replay one graph at another batch size, "
                        "pytorch#131009) and graphs (a capture is one batch size), else dynamic")
    p.add_argument("--inject-oom-every", type=int, default=0, metavar="N",
                   help="test-only fault injection (benchmarks/soak.py): the first micro-batch of every N-th "
                        "optimizer step raises the framework's out-of-memory error, which the elastic step must "
                        "survive (default 0: off)")
    p.add_argument("--trace-steps", default=None, metavar="START:STOP",
                   help="profile optimizer steps [START, STOP) with the backend's profiler (jax.profiler / "
                        "torch.profiler; a Perfetto/Chrome trace under OUT/trace; summary: "
                        "benchmarks/trace_summary.py); not with --method local")
    a = p.parse_args(argv)
    trace_steps = None
    if a.trace_steps is not None:
        try:
            trace_steps = tuple(int(v) for v in a.trace_steps.split(":"))
        except ValueError:
            trace_steps = ()
        if len(trace_steps) != 2 or not 0 <= trace_steps[0] < trace_steps[1] or a.method == "local":
            p.error(f"--trace-steps={a.trace_steps}: allowed START:STOP, integers with 0 <= START < STOP "
                    "(optimizer steps), not with --method local")
    if a.inject_oom_every < 0 or (a.inject_oom_every and a.method == "local"):
        p.error(f"--inject-oom-every={a.inject_oom_every}: allowed an integer >= 0, not with --method local")
    if a.compile != "off" and a.backend != "torch":
        p.error(f"--compile={a.compile}: only for --backend torch")
    if a.compile_shapes != "auto" and a.compile == "off":
        p.error(f"--compile-shapes={a.compile_shapes}: only with --compile default|reduce-overhead|cudagraphs|graphs")
    if a.graph_halves != "on" and a.compile != "graphs":
        p.error(f"--graph-halves={a.graph_halves}: only with --compile graphs")
    if a.triton_warmup == "auto":
        a.triton_warmup = "first-step" if a.compile in ("off", "graphs") else "on"
    elif a.triton_warmup == "first-step" and a.compile not in ("off", "graphs"):
        p.error(f"--triton-warmup=first-step: only with --compile off or graphs (their first step is eager; "
                f"--compile {a.compile} may compile or capture in it)")
    if a.graph_warmup != "eager" and a.compile != "graphs":
        p.error(f"--graph-warmup={a.graph_warmup}: only with --compile graphs")
    if a.compile in ("cudagraphs", "graphs") and a.compile_shapes == "dynamic":
        p.error(f"--compile-shapes=dynamic: not with --compile {a.compile} (a CUDA graph replays one batch size; "
                "torch's cudagraphs backend replayed one at another, pytorch#131009); allowed auto or buckets")
    a.compile_shapes = a.compile_shapes if a.compile_shapes != "auto" else (
        "buckets" if a.compile in ("cudagraphs", "graphs") else "dynamic")
    if a.offload == "auto" and (a.backend != "torch" or a.method != "triaccel" or a.compile != "off"):
        p.error("--offload auto: only for --backend torch --method triaccel --compile off (the JAX wrapper refuses "
                "it; saved-tensor hooks run eagerly)")
    if a.xla_option and (a.backend != "jax" or a.method == "local"):
        p.error(f"--xla-option: only for --backend jax, not with --method local (got {a.xla_option})")
    if a.compile_cache is not None and a.backend != "jax":
        p.error(f"--compile-cache={a.compile_cache!r}: only for --backend jax")
    if a.fused_step != "auto" and (a.backend != "jax" or a.method == "local" or
                                   (a.fused_step == "on" and a.in_flight == "off")):
        p.error(f"--fused-step={a.fused_step}: only for --backend jax, not with --method local, and 'on' needs "
                "--in-flight on (a failed fused step is restored from the step in flight)")
    if a.bn_mask == "on" and (a.backend != "jax" or a.method == "local"):
        p.error("--bn-mask=on: only for --backend jax, not with --method local")
    if a.bn_parts < 1 or (a.bn_parts > 1 and (a.backend != "torch" or a.compile != "off" or a.method == "local")):
        p.error(f"--bn-parts={a.bn_parts}: an integer >= 1; above 1 only for --backend torch with --compile off, "
                "not with --method local")
    if a.augment_rng == "sample" and (a.backend != "torch" or a.method == "local"):
        p.error("--augment-rng=sample: only for --backend torch, not with --method local")
    if a.batch_stats == "global" and (a.method == "local" or a.backend == "torch"):
        p.error("--batch-stats=global: only with --backend jax, not with --method local (torch's DDP normalises by "
                "each rank's batch: per-device)")
    if a.pad_floor not in ("off", "auto") and (a.backend != "jax" or a.method == "local" or not (
            a.pad_floor == "largest" or (a.pad_floor.isdigit() and int(a.pad_floor) >= 1))):
        p.error(f"--pad-floor={a.pad_floor}: allowed auto, off, largest or an integer >= 1, the last two only for --backend jax "
                "(not --method local)")
    if a.devices is not None and (a.backend != "jax" or a.devices < 1):
        p.error(f"--devices={a.devices}: an integer >= 1, only for --backend jax (torch: torchrun --nproc-per-node)")
    levers = tuple(x for x in a.levers.split(",") if x)
    bad = sorted(set(levers) - set(LEVERS))
    if bad:
        p.error(f"--levers: unknown {bad}; allowed {list(LEVERS)}")
    if not a.warmup_epochs >= 0:
        p.error(f"--warmup-epochs={a.warmup_epochs}: allowed [0, inf)")
    if a.backend == "jax" and a.budget is not None and not str(a.budget).startswith("e2e:"):
        # Before JAX starts its GPU backend (_has_gpu below): the XLA pool is capped at the budget,
        # so that compilation scratch cannot take the peak above it.
        from triaccel.backends.jax.memory import limit_device_memory

        limit_device_memory(a.budget)
    gpu = _has_gpu(a.backend) if a.device in ("auto", "cuda") else False
    batch = a.batch if a.batch is not None else (96 if gpu else 32)
    data = a.data or ""  # "": resolved when loading (triaccel.data.resolve_data)
    opts = RunOptions(
        backend=a.backend, model=a.model, dataset=a.dataset, method=a.method,
        epochs=a.epochs if a.epochs is not None else (10 if gpu else 1), data=data, seed=a.seed,
        batch=batch, lr=a.lr if a.lr is not None else 0.1 * batch / 96,
        width=a.width if a.width is not None else (1.0 if gpu else 0.25), image_size=a.image_size,
        train_subset=a.train_subset if a.train_subset is not None else (None if gpu else 2048),
        test_subset=a.test_subset if a.test_subset is not None else (None if gpu else 512),
        budget=a.budget, offload=a.offload, batch_max=a.batch_max, lr_rule=a.lr_rule, curvature=a.curvature, levers=levers,
        t_ctrl=a.t_ctrl, warmup_steps=a.warmup_steps, warmup_epochs=a.warmup_epochs, device=a.device, progress=not a.no_progress,
        compile_cache=a.compile_cache, compile_ahead={"on": True, "after": "after", "off": False}[a.compile_ahead], cudnn_benchmark=a.cudnn_benchmark == "on", compile=a.compile,
        compile_shapes=a.compile_shapes, pad_floor=a.pad_floor, batch_stats=a.batch_stats, bn_parts=a.bn_parts, augment_rng=a.augment_rng, bn_mask=a.bn_mask, in_flight=a.in_flight, fused_step=a.fused_step, gc_freeze=a.gc_freeze, graph_halves=a.graph_halves, graph_warmup=a.graph_warmup, triton_warmup=a.triton_warmup,
        memory_format=a.memory_format,
        inject_oom_every=a.inject_oom_every, trace_steps=trace_steps, extra=_parse_set(a.set),
        xla_options=_parse_set(a.xla_option, "--xla-option", "an XLA compiler option"))
    try:
        opts.check_extra()
    except ValueError as e:
        p.error(str(e))
    opts.out = a.out or f"runs/{a.backend}-{a.model}-{a.dataset}-{a.method}-s{a.seed}"
    opts.devices = a.devices  # type: ignore[attr-defined]  # JAX data parallel (jax_loop); None: all
    for flag, value in (("--fuse-steps", a.fuse_steps), ("--plan-headroom", a.plan_headroom),
                        ("--exit-eval", a.exit_eval), ("--block-curvature", a.block_curvature),
                        ("--head-pool", a.head_pool)):
        if value is not None and a.method != "local":
            p.error(f"{flag}={value}: only with --method local")
    if a.method == "local":
        from .local_loop import parse_local_budget
        try:
            parse_local_budget(a.budget)
        except ValueError as exc:
            p.error(str(exc))
        if not 0 <= a.exit_tolerance <= 1:
            p.error(f"--exit-tolerance={a.exit_tolerance}: allowed [0, 1] (accuracy fraction)")
        if a.plan_headroom is not None and not 0 < a.plan_headroom <= 1:
            p.error(f"--plan-headroom={a.plan_headroom}: allowed (0, 1]")
        if a.block_curvature is not None and a.block_curvature < 0:
            p.error(f"--block-curvature={a.block_curvature}: allowed integers >= 0 (0: off)")
        if a.head_pool is not None and a.head_pool < 1:
            p.error(f"--head-pool={a.head_pool}: allowed integers >= 1")
        if a.fuse_steps is not None and (a.backend != "jax" or a.fuse_steps < 1):
            p.error(f"--fuse-steps={a.fuse_steps}: allowed integers >= 1, with --backend jax")
        reserve: int | str = "auto"
        if a.graph_reserve != "auto":
            try:
                reserve = parse_reserve(a.graph_reserve, "--graph-reserve")
            except ValueError as exc:
                p.error(str(exc))
            if reserve and (a.backend != "torch" or a.cuda_graph == "off"):
                p.error(f"--graph-reserve={a.graph_reserve}: only with --backend torch and --cuda-graph on "
                        "(the reserve is for the torch trainer's CUDA graphs)")
        opts.local = {"exit_tolerance": a.exit_tolerance, "max_blocks": a.max_blocks,  # type: ignore[attr-defined]
                      "cache_views": a.cache_views, "block_batch": a.block_batch,
                      "block_inputs": a.block_inputs, "cuda_graph": a.cuda_graph == "on", "graph_reserve": reserve,
                      "block_epochs": a.block_epochs,
                      **({} if a.exit_eval is None else {"exit_eval": a.exit_eval}),
                      **({} if a.block_curvature is None else {"block_curvature": a.block_curvature}),
                      **({} if a.fuse_steps is None else {"fuse_steps": a.fuse_steps}),
                      **({} if a.plan_headroom is None else {"headroom": a.plan_headroom}),
                      **({} if a.head_pool is None else {"head_pool": a.head_pool})}
    if a.method != "local":   # local's budget may read e2e:B; its knobs are checked by its plan
        opts.triaccel_config()  # validate every knob before any data is loaded
    return opts


def _progress_factory(enabled: bool):
    if enabled:
        from tqdm import tqdm

        return lambda **kw: tqdm(unit="img", leave=False, dynamic_ncols=True, file=sys.stderr, **kw)

    class _Null:
        def update(self, n: int) -> None: ...
        def close(self) -> None: ...

    return lambda **kw: _Null()


def run(opts: RunOptions) -> dict[str, Any]:
    """Train once as `opts` says; returns the summary (also written to <out>/summary.json)."""
    from .datasets import load

    # torchrun: every rank trains (DDP); rank 0 writes log.jsonl, the summary and the plots, rank r > 0
    # its own log.rank<r>.jsonl (triaccel.backends.torch.distributed)
    dp = None
    if opts.backend == "torch" and "WORLD_SIZE" in os.environ:
        from triaccel.backends.torch.distributed import init_distributed

        dp = init_distributed()
    rank = 0 if dp is None else dp.rank
    t_load = time.perf_counter()
    if rank:
        dp.all_sum(0)   # rank 0 decodes and caches the images first
    data = load(opts.dataset, opts.data, opts.train_subset, opts.test_subset, opts.seed)
    if dp is not None and not rank:
        dp.all_sum(0)
    load_s = time.perf_counter() - t_load
    out = Path(opts.out)
    log = RunLog(out / ("log.jsonl" if not rank else f"log.rank{rank}.jsonl"))
    if opts.method == "local":
        from .local_loop import train
    elif opts.backend == "torch":
        from .torch_loop import train
    else:
        from .jax_loop import train
    # the batch law's bound as the run used it (plots label B_noise with it; default 1.0 before 2026-11-28)
    log.write("run", options=options_record(opts), noise_scale_c=opts.triaccel_config().noise_scale_c,
              train_images=len(data.train_x),
              test_images=len(data.test_x), host=platform.node(), started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              command=" ".join([os.path.basename(sys.executable), "-m", "examples.cifar.train", *sys.argv[1:]]))
    print(f"triaccel demo: {opts.backend} {opts.model} {opts.dataset} {opts.method}, {opts.epochs} epoch(s), "
          f"{len(data.train_x)} train / {len(data.test_x)} test images (loaded in {load_s:.1f}s) -> {out}",
          flush=True)
    try:
        summary = train(opts, data, log, _progress_factory(opts.progress and not rank),
                        **({} if dp is None else {"distributed": dp}))
    finally:
        log.close()
        # leave the process group before exit: a rank that exits with gloo's threads still alive can
        # abort ("terminate called without an active exception", seen in CI on 2026-11-28)
        if dp is not None:
            dp.close()
    summary.update(options=options_record(opts), data_load_seconds=load_s)
    if rank:
        return summary
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    t_plot = time.perf_counter()
    pngs = plot_run(out / "log.jsonl", out)
    print(f"final test accuracy {100 * summary['final_acc']:.2f}%; median s/epoch "
          f"{summary['s_per_epoch_median_last5']:.2f}; plots ({time.perf_counter() - t_plot:.1f}s): "
          f"{', '.join(p.name for p in pngs)}", flush=True)
    return summary


def main(argv: Sequence[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
