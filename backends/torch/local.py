"""Adaptive local learning in PyTorch (NeuroFlux-style): block-wise training with auxiliary heads,
per-block batch sizes and cached block outputs, under a memory budget planned by
:mod:`triaccel.local_plan`.

Schedule (NeuroFlux's, sequential block-wise): block b trains for ``epochs[b]`` epochs against its own
head, on inputs that no gradient crosses; it is then frozen (eval mode, no grad) and its outputs over
the training set are computed once and cached (device or host, as the plan says), so a trained block
never runs forward again while later blocks train. Block 0 reads freshly augmented images every epoch;
block b > 0 reads the cache, whose ``cache_views`` copies come from fixed, seeded augmentations of
the training set (epoch e reads view e mod cache_views). Each block steps through
:func:`triaccel.backends.torch.data.elastic_step` with its own controller (fixed logical batch; an
out-of-memory error shrinks the micro-batch and replays the same samples, gradients accumulated).
Steps with non-finite gradients are skipped on the device and checked on the host now and then
(:class:`triaccel.local_plan.NonFinitePolicy`); a block that keeps producing them stops training with
``NonFiniteTraining``, one that runs out of memory at a micro-batch of 1 with ``BlockOutOfMemory``
(naming what the device held).

Pieces: :func:`sequential_units` (a model as a list of units + its classifier), :func:`measure_layers`
(the per-unit memory table, from autograd's saved tensors), :class:`AuxHead`, :class:`LocalTrainer`
(train, evaluate every exit, export a prefix + head as an ``nn.Module``).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import time
import warnings
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from triaccel import Controller, OOMAtMinimumBatch
from triaccel.elastic import ElasticIndexLoader
from triaccel.local_plan import (BlockCurvature, BlockOutOfMemory, BlockRecord, BlockRun, LayerMemory, LocalPlan,
                                 NonFinitePolicy, block_runs, check_views, halving_on_oom, head_init)
from triaccel.precision import Precision

from .cuda_graph import GraphedStep
from .curvature import CurvatureEstimator
from .data import elastic_step, free_memory, gather_to, indices_to, is_oom
from .layers import discover_layers

__all__ = ["AuxHead", "Classifier", "ExitModel", "LocalTrainer", "BlockRecord", "live_tensors", "measure_layers",
           "sequential_units"]


class Classifier(nn.Module):
    """A model's own classifier: global average pool -> flatten -> [dropout] -> ``fc`` (shared)."""

    def __init__(self, fc: nn.Linear, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc, self.dropout = fc, float(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(x.mean(dim=(2, 3)), 1)
        return self.fc(F.dropout(x, self.dropout, self.training))


class AuxHead(nn.Module):
    """Auxiliary classifier on a (N, C, H, W) map; the layout `triaccel.local_plan.head_cost` models.

    width 0: global pool -> linear(C, num_classes). width w: adaptive average pool to at most
    pool x pool -> conv3x3(C, w) -> BatchNorm -> ReLU -> global pool -> linear(w, num_classes).
    """

    def __init__(self, in_channels: int, width: int, num_classes: int, pool: int = 4) -> None:
        super().__init__()
        self.pool = int(pool)
        self.body: nn.Sequential | None = None
        if width > 0:
            self.body = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
                                      nn.BatchNorm2d(width), nn.ReLU(inplace=False))
        self.fc = nn.Linear(width if width > 0 else in_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.body is not None:
            h, w = x.shape[-2:]
            if h > self.pool or w > self.pool:
                x = F.adaptive_avg_pool2d(x, (min(h, self.pool), min(w, self.pool)))
            x = self.body(x)
        return self.fc(torch.flatten(x.mean(dim=(2, 3)), 1))


def sequential_units(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], Classifier]:
    """The model as named units run one after another, and its classifier; the units share the
    model's modules (training them trains the model).

    ResNet (``triaccel.backends.torch.models``): stem (conv1-bn1-ReLU), then every BasicBlock.
    EfficientNet: stem, every MBConv, the 1x1 head conv. Anything else: an ``nn.Sequential`` whose
    last module is an ``nn.Linear`` (units = the modules before it, pooled before the linear).
    """
    from .models import EfficientNet, ResNet

    if isinstance(model, ResNet):
        units: list[tuple[str, nn.Module]] = [("stem", nn.Sequential(model.conv1, model.bn1, nn.ReLU()))]
        for i in range(1, len(model.plan.stages) + 1):
            units += [(f"layer{i}.{j}", blk) for j, blk in enumerate(getattr(model, f"layer{i}"))]
        return units, Classifier(model.fc)
    if isinstance(model, EfficientNet):
        units = [("stem", model.stem)] + [(f"blocks.{j}", blk) for j, blk in enumerate(model.blocks)]
        return units + [("head", model.head)], Classifier(model.fc, model.plan.dropout)
    if isinstance(model, nn.Sequential) and len(model) > 1 and isinstance(model[-1], nn.Linear):
        return [(str(i), m) for i, m in enumerate(list(model)[:-1])], Classifier(model[-1])
    raise ValueError(f"model: {type(model).__name__} cannot be split into units; expected ResNet, EfficientNet "
                     "or an nn.Sequential ending in nn.Linear")


def _autocast(device: torch.device, dtype: torch.dtype | None, cache: bool = True) -> Any:
    # cache=False in a CUDA graph: it must not keep autocast's cached weight casts from its capture
    return (torch.autocast(device.type, dtype=dtype, cache_enabled=cache) if dtype is not None
            else contextlib.nullcontext())


def measure_layers(units: Sequence[tuple[str, nn.Module]], example: torch.Tensor,
                   autocast_dtype: torch.dtype | None = torch.bfloat16) -> list[LayerMemory]:
    """Per-unit memory table for `triaccel.local_plan`, measured in training mode.

    example: a (n, C, H, W) input batch on the units' device, n >= 2. Each unit runs forward at n and
    at 2n samples with grad on (under autocast when `autocast_dtype`); the bytes autograd saves for
    its backward (distinct storages, counted through ``saved_tensors_hooks``) at both sizes give the
    per-sample figure as their difference / n, so weights and their 16-bit copies drop out.
    BatchNorm running statistics are restored afterwards.
    """
    if example.dim() != 4 or example.shape[0] < 2:
        raise ValueError(f"example: expected a (n >= 2, C, H, W) batch, got {tuple(example.shape)}")
    dev = example.device
    states = [copy.deepcopy(m.state_dict()) for _, m in units]
    modes = [m.training for _, m in units]

    def saved_bytes(module: nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
        seen: dict[tuple[int, int], int] = {}
        keep: list[torch.Tensor] = []   # saved storages stay allocated (and distinct) until the unit returns

        def pack(t: torch.Tensor) -> None:
            s = t.untyped_storage()
            seen[(s.data_ptr(), s.nbytes())] = s.nbytes()
            # A detached alias, not `t`: no backward runs here, and a saved output packed as itself
            # (ReLU saves its result) closes a cycle through autograd's C++ nodes that the garbage
            # collector cannot see. Packing `t` leaked every unit's activations and 16-bit weight
            # copies: 65 MiB on the H100 under issue 18's 520 MiB budget, which broke CUDA-graph captures.
            keep.append(t.detach())
            return None

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None), _autocast(dev, autocast_dtype):
            y = module(x.detach().requires_grad_(True))
        return sum(seen.values()), y.detach()

    out: list[LayerMemory] = []
    n = int(example.shape[0])
    xs, xl = example, torch.cat([example, example])
    try:
        for (name, m), _ in zip(units, states):
            m.train()
            small, ys = saved_bytes(m, xs)
            large, yl = saved_bytes(m, xl)
            per = max(large - small, 0) // n
            params = sum(p.numel() for p in m.parameters())
            out.append(LayerMemory(name, int(per), tuple(int(v) for v in ys.shape[1:]), int(params)))
            xs, xl = ys.float(), yl.float()
    finally:
        for (_, m), sd, mode in zip(units, states, modes):
            m.load_state_dict(sd)
            m.train(mode)
    return out


class ExitModel(nn.Module):
    """An exported exit: the units of the chosen prefix, then its head. Input as the model's; output
    logits (N, num_classes). ``param_count``: its parameters."""

    def __init__(self, units: Sequence[nn.Module], head: nn.Module) -> None:
        super().__init__()
        self.units = nn.Sequential(*units)
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.units(x))

    @property
    def param_count(self) -> int:
        return sum(p.numel() for p in self.parameters())


class _FnLoader(ElasticIndexLoader):
    """An elastic loader whose batches come from `fetch_fn(indices)` (the block's input source)."""

    def __init__(self, n: int, *, batch_size: int, seed: int, fetch_fn: Callable[[np.ndarray], Any]) -> None:
        super().__init__(n, batch_size=batch_size, seed=seed)
        self.fetch_fn = fetch_fn

    def fetch(self, indices: np.ndarray) -> Any:
        return self.fetch_fn(indices)


def live_tensors(device: torch.device | str, top: int = 6) -> str:
    """The distinct tensor storages alive on `device` (found through the garbage collector): their
    count and bytes, and the `top` largest as shape/dtype/bytes. For out-of-memory reports."""
    dev = torch.device(device)
    storages: dict[int, tuple[int, str]] = {}
    with warnings.catch_warnings():   # isinstance on deprecated module proxies warns
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for o in tensors:
        try:
            if o.device.type != dev.type or (dev.index is not None and o.device.index != dev.index):
                continue
            st = o.untyped_storage()
            ptr, nbytes = st.data_ptr(), st.nbytes()
        except Exception:  # noqa: BLE001 - no real storage: meta, sparse, subclasses, fake tensors left by compile
            continue
        if nbytes > storages.get(ptr, (-1, ""))[0]:
            storages[ptr] = (nbytes, f"{tuple(o.shape)} {str(o.dtype).replace('torch.', '')}")
    big = sorted(storages.values(), reverse=True)[:top]
    return (f"{len(storages)} storages, {sum(v for v, _ in storages.values())} bytes; largest: "
            + ", ".join(f"{d} {v}" for v, d in big))


WARMUP_OOMS = 3   # warm-up steps of a CUDA graph that may run out of memory before a block gives up on it
GRAPH_RETRIES = 2   # failed captures / OOMs beside a graph after which a block warms up and captures again
                    # (each at half the micro-batch, `LocalTrainer._graph_step`)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class _StepGuard:
    """The TriAccel wrapper's device-side guard on one block's fused SGD. Per step, the gradients'
    non-finite counts (`triaccel.kernels.grad_moments`, one launch) set ``found_inf``, which the fused
    kernel reads (the GradScaler protocol): a flagged step leaves weights and momentum untouched with
    no host sync; device counters (skipped, consecutive) follow the flag. `check` is the policy's
    host read: new skips restore the buffers (BatchNorm statistics) saved at the last clean check."""

    def __init__(self, params: list[torch.Tensor], opt: torch.optim.SGD, buffers: list[torch.Tensor],
                 policy: NonFinitePolicy, block: int) -> None:
        from triaccel.kernels.grad_moments import grad_moments

        dev = params[0].device
        self.params, self.opt, self.policy, self.block = params, opt, policy, block
        self.moments_fn = grad_moments
        self.impl = "auto" if dev.type == "cuda" else "reference"   # the kernel is for GPUs
        self.moments = torch.zeros((len(params), 3), dtype=torch.float32, device=dev)
        self.flag = torch.zeros((), dtype=torch.float32, device=dev)      # 1.0: this step was skipped
        self.counts = torch.zeros(2, dtype=torch.float32, device=dev)     # skipped, consecutive
        # Momentum buffers start at zero: torch's first update is the same (0.9 * 0 + g == g), and a
        # skipped first step leaves them defined (the fused kernel would leave them uninitialised).
        for group in opt.param_groups:
            if group["momentum"] != 0:
                for p in group["params"]:
                    opt.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        self.buffers = buffers
        self.saved = [t.clone() for t in buffers]
        self.skipped = 0

    def step(self, _decision: Any) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads and self.impl == "auto" and torch.cuda.is_current_stream_capturing():
            # In a CUDA graph the kernel's launch plan cannot be used: it re-bases by uploading the
            # gradients' addresses into a buffer it recycles, which a replay would read stale. One
            # multi-tensor norm instead (a norm overflowing float32 counts as non-finite too).
            self.flag.copy_(torch.logical_not(torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum())))
        elif grads:
            rows = self.moments[:len(grads)]
            self.moments_fn(grads, out=rows, impl=self.impl)
            torch.clamp(rows[:, 2].sum(), max=1.0, out=self.flag)
        else:
            self.flag.zero_()
        self.opt.found_inf = self.flag
        try:
            self.opt.step()
        finally:
            del self.opt.found_inf
        self.counts.add_(self.flag)
        self.counts[1:].mul_(self.flag)     # consecutive: (c + f) * f

    def check(self, steps: int) -> int:
        """One host read after `steps` steps; returns the steps skipped so far."""
        skipped, consecutive = (int(v) for v in self.counts.tolist())
        fresh = skipped > self.skipped
        if fresh and self.buffers:
            torch._foreach_copy_(self.buffers, self.saved)
        elif self.buffers:
            torch._foreach_copy_(self.saved, self.buffers)
        self.policy.check(self.block, steps, skipped, consecutive, self.skipped)
        self.skipped = skipped
        return skipped


class LocalTrainer:
    """Trains `units` block by block as `plan` says (see the module docstring).

    units / classifier: from :func:`sequential_units`, on `device`. plan: `triaccel.local_plan.plan_local`
    over the same units. num_classes: the heads' outputs. lr: SGD lr at `lr_batch` samples, scaled
    linearly to each block's batch; momentum, nesterov, weight_decay: SGD's. lr_factor(seen, total):
    the schedule's multiplier after `seen` of a block's `total` training samples (default 1).
    autocast_dtype: the compute dtype (None: fp32). inputs: what blocks after the first read
    (`triaccel.local_plan.block_runs`): "cache" (cached block outputs over the fixed views),
    "recompute" (the frozen prefix on the fixed views every step, the reference the cache must
    match) or "fresh" (the frozen prefix on freshly augmented images every step, no cache).
    cache_dtype: the cache's (and a recomputed prefix output's) dtype.
    memory_format: applied to every input batch (channels_last on CUDA). head_pool: AuxHead's pool.
    nonfinite: how steps with non-finite gradients are skipped and when training stops
    (`triaccel.local_plan.NonFinitePolicy`; default: its defaults). cuda_graph: on a CUDA device,
    capture each block's full-batch step (a frozen prefix included) once and replay it
    (`cuda_graph.GraphedStep`; an epoch's short last batch runs the same step eagerly, OOMs fall back
    to the eager elastic step, see `_graph_step`): the eager step at these batches is bound by the
    host's launches. Ignored on other devices. curvature: the curvature lever per block
    (`triaccel.local_plan.BlockCurvature`; None: off): each block's LR follows its measured curvature.
    """

    def __init__(self, units: Sequence[tuple[str, nn.Module]], classifier: nn.Module, plan: LocalPlan, *,
                 num_classes: int, device: torch.device | str, lr: float, lr_batch: int = 96,
                 momentum: float = 0.9, nesterov: bool = True, weight_decay: float = 5e-4,
                 lr_factor: Callable[[int, int], float] | None = None,
                 autocast_dtype: torch.dtype | None = torch.bfloat16, inputs: str = "cache",
                 cache_dtype: torch.dtype = torch.bfloat16, memory_format: torch.memory_format = torch.contiguous_format,
                 head_pool: int = 4, seed: int = 0, nonfinite: NonFinitePolicy | None = None,
                 cuda_graph: bool = True, curvature: BlockCurvature | None = None) -> None:
        if len(units) != len(plan.layers) or [n for n, _ in units] != [l.name for l in plan.layers]:
            raise ValueError(f"units: names {[n for n, _ in units]} do not match the plan's layers "
                             f"{[l.name for l in plan.layers]}")
        if not lr > 0:
            raise ValueError(f"lr={lr!r}: allowed (0, inf)")
        self.device = torch.device(device)
        self.units = [m for _, m in units]
        self.plan = plan
        self.num_classes = int(num_classes)
        self.lr, self.lr_batch, self.momentum, self.nesterov, self.wd = lr, lr_batch, momentum, nesterov, weight_decay
        self.lr_factor = lr_factor or (lambda seen, total: 1.0)
        self.autocast_dtype, self.inputs, self.cache_dtype = autocast_dtype, inputs, cache_dtype
        # per block: the compute dtype its steps, its frozen forward and its exit run at (promotions)
        self.block_dtypes: list[torch.dtype | None] = [autocast_dtype] * len(plan.blocks)
        self.memory_format, self.seed = memory_format, seed
        self.nonfinite = nonfinite if nonfinite is not None else NonFinitePolicy()
        self.curvature = BlockCurvature.checked(curvature)
        self.cuda_graph = bool(cuda_graph) and self.device.type == "cuda"
        self.heads: list[nn.Module] = []
        for blk in plan.blocks:
            last = blk.stop == len(units)
            if last and blk.head_width == 0 and plan.layers and classifier is not None:
                head = classifier     # the last block keeps the model's own classifier
            else:
                c = plan.layers[blk.stop - 1].out_shape[0]
                head = AuxHead(c, blk.head_width, num_classes, head_pool)
                # the core's initialisation: the JAX twin starts from the same heads
                head.load_state_dict({k: torch.from_numpy(v) for k, v in
                                      head_init(c, blk.head_width, num_classes, seed=seed, index=blk.index).items()})
            self.heads.append(head.to(self.device))
        self.records: list[BlockRecord] = []
        self.stream: torch.cuda.Stream | None = None   # `_training_stream`'s, while training with graphs

    # -- pieces -----------------------------------------------------------------------------------
    def block(self, b: int) -> nn.Sequential:
        """The units of block b as one module (shared with the model)."""
        blk = self.plan.blocks[b]
        return nn.Sequential(*self.units[blk.start:blk.stop])

    def _fmt(self, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous(memory_format=self.memory_format) if x.dim() == 4 else x

    def _cast(self, block: int, cache: bool = True) -> Any:
        """Autocast at block `block`'s compute dtype (the trainer's unless it was promoted)."""
        return _autocast(self.device, self.block_dtypes[block], cache)

    def _precision(self, b: int) -> Precision:
        dtype = self.block_dtypes[b]
        return Precision.FP32 if dtype is None else Precision.parse(dtype)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def _prefix(self, stop: int, x: torch.Tensor) -> torch.Tensor:
        """Frozen units [0, stop) on x (eval mode), each block's at its compute dtype."""
        for blk in self.plan.blocks:
            if blk.start >= stop:
                break
            with self._cast(blk.index):
                for m in self.units[blk.start:min(blk.stop, stop)]:
                    x = m(x)
        return x

    # -- training ---------------------------------------------------------------------------------
    def train(self, train_x: torch.Tensor, train_y: torch.Tensor, train_transform: Callable[[torch.Tensor], torch.Tensor],
              views: Sequence[torch.Tensor], view_transform: Callable[[torch.Tensor], torch.Tensor],
              epochs: int | Sequence[int],
              on_epoch: Callable[[int, int, float, float], None] | None = None) -> list[BlockRecord]:
        """Train every block in order; returns one record per block.

        train_x (N, ...) raw samples on the device, train_y (N,) labels on the device;
        train_transform(raw batch) -> block 0's augmented input. views: `plan`'s cache_views tensors
        (N, ...) of raw samples from fixed augmentations (any device), view_transform(raw) -> input.
        epochs: per block (an int for all). on_epoch(block, epoch, train_loss, seconds) after each
        epoch (e.g. to evaluate the block's exit).
        """
        runs = block_runs(self.plan, epochs, lr=self.lr, lr_batch=self.lr_batch, seed=self.seed, inputs=self.inputs)
        n = int(train_x.shape[0])
        check_views(n, [int(v.shape[0]) for v in views], int(train_y.shape[0]), runs)
        for m in self.units:
            m.eval()
            m.requires_grad_(False)
        self.records = []
        with self._training_stream():
            self._train_blocks(runs, train_x, train_y, train_transform, views, view_transform, n, on_epoch)
        for m in self.units:
            m.requires_grad_(True)
        return self.records

    @contextlib.contextmanager
    def _training_stream(self) -> Iterator[None]:
        """With CUDA graphs, every block trains on one side stream (`self.stream`), the one its graphs
        capture on (cuBLAS keeps a workspace per stream, which a capture on torch's own stream sets
        up anew), after the default stream's cuBLAS workspaces are freed. Before (H100, issue 18's
        budgets, 2026-11-24): every EfficientNet-B0 block capture failed, block 0's on a 32 MiB
        request, and ResNet-18's blocks peaked 56 MiB higher. Elsewhere: nothing."""
        if not (self.cuda_graph and self.device.type == "cuda"):   # tests fake graphs on the CPU
            yield
            return
        dev = self.device
        torch.cuda.synchronize(dev)
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        free_memory()
        self.stream = torch.cuda.Stream(dev)
        self.stream.wait_stream(torch.cuda.current_stream(dev))
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            torch.cuda.current_stream(dev).wait_stream(self.stream)
            torch.cuda.synchronize(dev)
            self.stream = None
            free_memory()   # the blocks cached for the training stream: no other stream could reuse them

    def _train_blocks(self, runs: Sequence[BlockRun], train_x: torch.Tensor, train_y: torch.Tensor,
                      train_transform: Callable[[torch.Tensor], torch.Tensor], views: Sequence[torch.Tensor],
                      view_transform: Callable[[torch.Tensor], torch.Tensor], n: int,
                      on_epoch: Callable[[int, int, float, float], None] | None) -> None:
        """`train`'s loop over the blocks (records appended to self.records)."""
        cache: list[torch.Tensor] | None = None

        # Every fetch is free of stream syncs (`gather_to`): a pageable host-to-device copy per step
        # would drain the GPU's queue before each step (the H100 runs of issue 18 had one or two).
        def augmented(idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
            """Freshly augmented images and their labels (block 0's input, and a fresh prefix's)."""
            i = indices_to(idx, train_x.device)
            y = (train_y.index_select(0, i) if train_y.device == train_x.device
                 else gather_to(train_y, idx, self.device))
            return self._fmt(train_transform(train_x.index_select(0, i))), y

        for b, (blk, run) in enumerate(zip(self.plan.blocks, runs)):
            # fetch(indices, [epoch]) -> (x, y) on the device; pre(x) -> the block's input (inside
            # the step, so a CUDA graph holds a frozen prefix's forward too)
            pre: Callable[[torch.Tensor], torch.Tensor] = _identity
            if run.source == "data":
                def fetch(idx: np.ndarray, _e: list[int]) -> Any:
                    return augmented(idx)
            elif run.source == "cache":
                assert cache is not None
                src = cache

                def fetch(idx: np.ndarray, _e: list[int], src=src) -> Any:
                    v = src[BlockRun.view(_e[0], len(src))]
                    return self._fmt(gather_to(v, idx, self.device)), gather_to(train_y, idx, self.device)
            else:   # the frozen prefix every step: on a fixed view ("recompute") or fresh images
                def fetch(idx: np.ndarray, _e: list[int], fresh=run.source == "fresh") -> Any:
                    if fresh:
                        return augmented(idx)
                    raw = gather_to(views[BlockRun.view(_e[0], len(views))], idx, self.device)
                    return self._fmt(view_transform(raw)), gather_to(train_y, idx, self.device)

                def pre(x: torch.Tensor, start: int = blk.start) -> torch.Tensor:
                    x = self._prefix(start, x)
                    return self._fmt(x.to(self.cache_dtype) if self.cache_dtype != x.dtype else x)
            probe = fetch   # the curvature lever's rows: a cache or fixed view as it is, images un-augmented
            if run.source in ("data", "fresh"):
                def probe(idx: np.ndarray, _e: list[int]) -> Any:
                    raw = gather_to(train_x, idx, self.device)
                    return self._fmt(view_transform(raw)), gather_to(train_y, idx, self.device)
            self.records.append(self._train_block(run, fetch, pre, n, on_epoch, probe))
            if run.cache_after is not None:
                cache = self._build_cache(b, run.cache_after, cache, views, view_transform)

    def _train_block(self, run: BlockRun, fetch: Callable[[np.ndarray, list[int]], Any],
                     pre: Callable[[torch.Tensor], torch.Tensor], n: int, on_epoch: Any,
                     probe: Callable[[np.ndarray, list[int]], Any]) -> BlockRecord:
        b, blk, epochs = run.index, self.plan.blocks[run.index], run.epochs
        body, head = self.block(b), self.heads[b]
        body.requires_grad_(True)
        head.requires_grad_(True)
        params = [*body.parameters(), *head.parameters()]
        # fused: the kernel takes the GradScaler protocol's found_inf (a device-side skip); same update
        # and state (momentum buffers) as the default SGD. A device tensor lr reaches a graph's replays.
        lr0 = torch.tensor(run.lr, dtype=torch.float32, device=self.device) if self.cuda_graph else run.lr
        opt = torch.optim.SGD(params, lr=lr0, momentum=self.momentum, nesterov=self.nesterov,
                              weight_decay=self.wd, fused=True)
        guard = _StepGuard(params, opt, [*body.buffers(), *head.buffers()], self.nonfinite, b)
        ctl = Controller(run.controller_config(self.plan.memory_budget), [f"block{b}"])
        epoch_of = [0]
        loader = _FnLoader(n, batch_size=blk.batch, seed=run.seed,
                           fetch_fn=lambda idx: fetch(idx, epoch_of))
        total, seen = epochs * n, 0
        loss_sum = torch.zeros((), device=self.device)   # per epoch, over steps not skipped
        kept = torch.zeros((), device=self.device)

        scale = [1.0]   # the curvature lever's LR multiplier (BlockCurvature)

        def set_lr() -> None:
            lr = run.lr * self.lr_factor(seen, total) * scale[0]
            for g in opt.param_groups:
                if isinstance(g["lr"], torch.Tensor):
                    g["lr"].fill_(lr)
                else:
                    g["lr"] = lr

        def tally(loss: torch.Tensor, samples: int) -> None:
            # the epoch's loss over steps not skipped, on the device (no host sync per step)
            loss_sum.add_(torch.where(guard.flag > 0, 0.0, loss.float()) * samples)
            kept.add_((1.0 - guard.flag) * samples)

        def loss_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            x, y = batch
            xb = pre(x)   # the frozen prefix at its blocks' dtypes
            with self._cast(b):
                return F.cross_entropy(head(body(xb)), y)

        def graph_step(x: torch.Tensor, y: torch.Tensor) -> None:
            # the eager step's work, device-side only: a capture records it (see GraphedStep); in
            # micro-batches of rec.graph_micro_batch (a failed capture halves it, `_graph_step`), their
            # gradients accumulated, as the elastic step's OOM fallback does
            opt.zero_grad(set_to_none=False)   # in place: eager calls after the capture reuse its buffers
            rows, k = y.shape[0], blk.batch // rec.graph_micro_batch
            losses = []
            for xc, yc in zip(x.chunk(k), y.chunk(k)):
                xb = pre(xc)
                with self._cast(b, cache=False):
                    loss = F.cross_entropy(head(body(xb)), yc)
                if k > 1:
                    loss = loss * (yc.shape[0] / rows)   # each micro-batch's share of the batch mean
                loss.backward()
                losses.append(loss.detach())
            guard.step(None)
            tally(losses[0] if k == 1 else torch.stack(losses).sum(), rows)

        graphed = GraphedStep(graph_step, params, stream=self.stream) if self.cuda_graph else None
        rec = BlockRecord(index=b, batch=blk.batch, precision=self._precision(b).short,
                          graph_micro_batch=blk.batch if graphed is not None else None)

        def read() -> None:
            # the non-finite policy's host read; new skips may promote the block (its precision lever)
            before = rec.skipped_steps
            rec.skipped_steps = guard.check(rec.steps)
            new = self.nonfinite.precision_after(rec.skipped_steps > before, rec.precision)
            if new != Precision.parse(rec.precision):
                # block b computes at `new` from now on: its steps, its frozen forward, its exit
                self.block_dtypes[b] = None if new == Precision.FP32 else getattr(torch, new.dtype_name)
                warnings.warn(rec.promote(new), RuntimeWarning, stacklevel=2)
                if graphed is not None:
                    graphed.release()   # captured at the old dtype: warm up and capture at the new one
                    free_memory()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        for e in range(epochs):
            epoch_of[0] = e
            # every epoch: on_epoch (evaluate_exits) leaves the modules in eval mode, and BatchNorm in
            # eval mode trains on stale running statistics (block 0 diverged at peak LR that way)
            body.train()
            head.train()
            self._sync()
            t0 = time.perf_counter()
            loss_sum.zero_()
            kept.zero_()
            while True:
                set_lr()
                samples = self._graph_step(graphed, loader, blk.batch, rec) if graphed is not None else 0
                if samples == 0:
                    oom: str | None = None
                    try:
                        res = elastic_step(loader, ctl, loss_fn, opt, rec.steps, optimizer_step=guard.step)
                    except OOMAtMinimumBatch as exc:
                        oom = str(exc)   # the text only: the exception's frames hold the failed step's tensors
                    if oom is not None:
                        raise BlockOutOfMemory(self._oom_report(b, rec.steps, oom))
                    samples = res.samples
                    tally(res.loss, res.samples)
                    rec.ooms += res.ooms
                seen += samples
                rec.steps += 1
                if loader.end_of_epoch:
                    break
                if self.nonfinite.due(rec.steps):
                    read()
            read()   # before on_epoch evaluates the statistics
            if self.curvature is not None and self.curvature.due(e):   # the lever's cost counts as training
                scale[0] = self._block_curvature(b, body, head, probe, pre, n, run.seed, epoch_of)
                rec.lr_scales.append(scale[0])
            self._sync()
            rec.epoch_seconds.append(time.perf_counter() - t0)
            rec.epoch_losses.append(float(loss_sum / kept))
            if on_epoch is not None:
                on_epoch(b, e, rec.epoch_losses[-1], rec.epoch_seconds[-1])
        if self.device.type == "cuda":
            rec.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            rec.peak_reserved_bytes = int(torch.cuda.max_memory_reserved(self.device))
        body.eval().requires_grad_(False)
        head.eval().requires_grad_(False)
        # Free the block's graph, gradients and momentum now: later blocks plan without them.
        del graphed
        opt.zero_grad(set_to_none=True)
        opt.state.clear()
        return rec

    def _block_curvature(self, b: int, body: nn.Module, head: nn.Module, probe: Callable[..., Any],
                         pre: Callable[[torch.Tensor], torch.Tensor], n: int, seed: int, epoch_of: list[int]) -> float:
        """The curvature lever's measurement: per-layer top empirical-Fisher eigenvalue of block b
        (units + head, eval mode, FP32) on `BlockCurvature.rows` of `probe` (deterministic inputs: no
        draw on the training augmentation); returns the block's new LR scale."""
        assert self.curvature is not None
        rows = self.curvature.rows(n, seed)
        model = nn.Sequential(body, head)
        est = CurvatureEstimator(model, discover_layers(model), F.cross_entropy, "fisher", top_k=1)

        def eigvals_of(k: int) -> np.ndarray:
            with torch.no_grad():
                x, y = probe(rows[:k], epoch_of)
                xb = pre(x).float()
            return est((xb, y))

        return self.curvature.measure(b, eigvals_of, len(rows), is_oom=is_oom, free_memory=free_memory)

    def _graph_step(self, graphed: GraphedStep, loader: _FnLoader, batch: int, rec: BlockRecord) -> int:
        """One step through `graphed`: a full batch replays (or warms up, or captures) the graph, an
        epoch's short last batch once it is captured runs the same step eagerly into the graph's
        gradient buffers (`GraphedStep.run_eager`: no second set of gradients beside the pool). Returns
        its samples, or 0 to leave the step to the eager elastic path (a short batch before the
        capture; a warm-up step that ran out of memory; a short batch that ran out of memory beside the
        graph, which is then released and captured again next epoch; from a failed capture, an OOM
        beside a replay or the WARMUP_OOMS-th warm-up OOM on, the whole block once GRAPH_RETRIES
        fresh warm-ups and captures, each at half the micro-batch of the one before, have failed too)."""
        left = loader.left_for_next
        if rec.graph_note or loader.logical_batch != batch or (left < batch and not graphed.captured):
            return 0
        full = left >= batch
        idx = loader.next_indices()
        capturing = not graphed.captured and graphed.calls >= graphed.warmup
        stage, failed, oom = "fetch", "", False
        try:
            x, y = loader.fetch(idx)
            stage = "capture" if capturing else "step"
            if full:
                graphed(x, y)
            else:
                graphed.run_eager(x, y)
        except Exception as exc:   # noqa: BLE001 - an OOM, or any error of a capture, falls back to eager
            loader.put_back(idx)
            oom = is_oom(exc)
            if not (oom or stage == "capture"):
                raise
            failed = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        if failed and stage != "capture" and not graphed.captured and graphed.warmup_ooms < WARMUP_OOMS:
            # a warm-up step (eager) that ran out of memory: the elastic path replays it in
            # micro-batches; the first steps' OOMs can be transient (cuDNN's first-call workspaces)
            graphed.warmup_ooms += 1
            free_memory()
            return 0
        if failed and stage == "step" and not full:
            # The epoch's short last batch, run eagerly beside the graph's pool, ran out of memory: free
            # the pool for it (the elastic path replays it) and capture again from the next epoch's
            # full batches (warm-up steps included). Under issue 18's 520 MiB cap on the H100 this hit
            # two blocks of three (pools of 192 and 98 MiB), which before fell back to eager for good.
            graphed.release()
            rec.graph_recaptures += 1
            free_memory()
            return 0
        if failed:
            # The graph's private pool stays reserved beside every eager allocation, so under a tight
            # cap a capture that does not fit, or an OOM beside a captured graph, means the next
            # steps would likely OOM too: release the graph. The block then warms up and captures
            # again, up to GRAPH_RETRIES times, each time at half the micro-batch while the batch
            # divides (a smaller working set in the pool; the same samples per optimizer step),
            # before it trains eagerly for good. (H100, issue 18's budget, 2026-11-24: EfficientNet-B0's
            # last block, batch 256, ran out of memory on a 12 MiB request in its capture and trained
            # eagerly, 20 of the run's 80 s; a same-size retry had not rescued ResNet-18's layer4 block.)
            cuda, dev = torch.cuda, self.device
            mem = (f"allocated {cuda.memory_allocated(dev)}, reserved {cuda.memory_reserved(dev)} bytes"
                   if dev.type == "cuda" else "")
            graphed.release()
            note = f"{stage} at step {rec.steps}: {failed} ({mem}); graph released"
            if oom and rec.graph_retries < GRAPH_RETRIES:   # another error would only repeat
                rec.graph_retries += 1
                graphed.warmup_ooms = 0
                micro = rec.graph_micro_batch
                if micro is not None and micro % 2 == 0:
                    rec.graph_micro_batch = micro // 2
                note += f", warm-up and capture again in micro-batches of {rec.graph_micro_batch}"
            else:
                rec.graph_note = note = note + ", eager steps"
            warnings.warn(f"block {rec.index}: CUDA graph {note}", RuntimeWarning, stacklevel=2)
            free_memory()
            return 0
        loader.complete(idx)
        if graphed.captured and full:
            rec.graph_steps += 1
            rec.graph_pool_bytes = graphed.pool_bytes
        return int(len(idx))

    def _oom_report(self, b: int, step: int, msg: str) -> str:
        """BlockOutOfMemory's message: the block, its plan, what the device holds (largest live tensors)."""
        gc.collect()
        state = ""
        if self.device.type == "cuda":
            # reserved well above allocated: the cap (which counts reserved segments) was lost to fragmentation
            cuda, dev = torch.cuda, self.device
            state = (f"allocated {cuda.memory_allocated(dev)} bytes now, peak {cuda.max_memory_allocated(dev)}, "
                     f"reserved {cuda.memory_reserved(dev)}, peak reserved {cuda.max_memory_reserved(dev)}; ")
        return BlockOutOfMemory.message(self.plan, b, step, msg, state + "live tensors: " + live_tensors(self.device))

    @torch.no_grad()
    def _build_cache(self, b: int, cache_after: str, cache: list[torch.Tensor] | None, views: Sequence[torch.Tensor],
                     view_transform: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        """Block b's outputs over every view of the training set, where the plan puts block b+1's input
        (cache_after: "device" or "host")."""
        nxt = self.plan.blocks[b + 1]
        # A host cache is pageable: steps gather their rows into pinned buffers (`gather_to`), so
        # pinning the whole cache (~3.3 GB per view after ResNet-18's layer2.0) buys nothing (H100:
        # ten views built in 33.6 s pinned, 33.2 s pageable).
        where = self.device if cache_after == "device" else torch.device("cpu")
        body = self.block(b)
        self._sync()
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        out: list[torch.Tensor] = []
        shape = self.plan.layers[nxt.start - 1].out_shape
        for v, raw in enumerate(views):
            n = int(raw.shape[0])
            # A host buffer is zero-filled first: torch fills it on all its threads, so the pages are
            # faulted in in parallel rather than one by one inside each device-to-host copy (this
            # project's CPU machine: 0.20 GB/s copying into fresh pages, 1.9 GB/s zeroing on two
            # threads, then 9.1 GB/s copying). The H100 host built ten 3.3 GB views at ~1 GB/s before
            # this; its effect there is not yet measured.
            alloc = torch.zeros if where.type == "cpu" else torch.empty
            buf = alloc((n, *shape), dtype=self.cache_dtype, device=where)

            def fill(bs: int, v: int = v, raw: torch.Tensor = raw, buf: torch.Tensor = buf) -> None:
                for i in range(0, n, bs):
                    if cache is None:
                        x = self._fmt(view_transform(raw[i:i + bs].to(self.device)))
                    else:
                        x = self._fmt(cache[v][i:i + bs].to(self.device, non_blocking=True))
                    with self._cast(b):
                        y = body(x)
                    buf[i:i + bs].copy_(y)

            halving_on_oom(fill, self.plan.infer_batch, is_oom=is_oom, free_memory=free_memory)
            out.append(buf)
        self._sync()
        rec = self.records[b]
        rec.cache_seconds = time.perf_counter() - t0
        if self.device.type == "cuda":
            rec.cache_peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
        return out

    # -- exits ------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate_exits(self, x: torch.Tensor, y: torch.Tensor, transform: Callable[[torch.Tensor], torch.Tensor],
                       upto: int | None = None, batch: int | None = None) -> list[float]:
        """Top-1 accuracy of every exit (block heads, in order; only the first `upto` when given) on
        raw samples x (N, ...) with labels y (N,), one forward pass through the prefix."""
        nb = len(self.plan.blocks) if upto is None else int(upto)
        for m in [*self.units, *self.heads]:
            m.eval()
        correct = [0] * nb

        def run(bs: int) -> None:
            correct[:] = [0] * nb
            for i in range(0, int(x.shape[0]), bs):
                h = self._fmt(transform(x[i:i + bs].to(self.device)))
                yb = y[i:i + bs].to(self.device)
                for b in range(nb):
                    blk = self.plan.blocks[b]
                    with self._cast(b):
                        for m in self.units[blk.start:blk.stop]:
                            h = m(h)
                        correct[b] += int((self.heads[b](h).argmax(1) == yb).sum())

        halving_on_oom(run, batch or self.plan.infer_batch, is_oom=is_oom, free_memory=free_memory)
        return [c / int(x.shape[0]) for c in correct]

    def export(self, b: int) -> ExitModel:
        """Exit b as a standalone module: deep copies of units [0, stop of block b) and block b's head,
        in eval mode."""
        if not 0 <= b < len(self.plan.blocks):
            raise ValueError(f"b={b}: allowed [0, {len(self.plan.blocks) - 1}]")
        stop = self.plan.blocks[b].stop
        return ExitModel(copy.deepcopy(self.units[:stop]), copy.deepcopy(self.heads[b])).eval()

    def exit_params(self) -> list[int]:
        """Parameter count of every exit's exported model."""
        out = []
        for b, blk in enumerate(self.plan.blocks):
            units = sum(p.numel() for m in self.units[:blk.stop] for p in m.parameters())
            out.append(units + sum(p.numel() for p in self.heads[b].parameters()))
        return out

