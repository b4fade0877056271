"""CUDA-graph replay of a fixed-shape training step.

At small batches an eager step is bound by the host's kernel launches, not by the GPU: on an H100,
ResNet-18's local blocks at batch 64 took 5.00 / 6.46 ms of host time per bare eager step against
1.21 / 1.26 ms of GPU time, end-to-end training at batch 32 8.91 against 1.89 ms (2026-11-23,
`benchmarks/step_bound.py --steps 100`, issue 18). Captured once and replayed, such a step costs one graph launch
plus the copies of its inputs into static buffers.

`GraphedStep` follows torch's whole-network capture recipe: a few eager warm-up steps (cuDNN/cuBLAS set
themselves up there; on the caller's stream, see `__call__`), gradients set to None before the capture
so backward allocates them in the graph's private pool, then one capture; every later call copies its
inputs into the static buffers and replays. The warm-up steps are real steps (the step function runs on
the caller's batches), and the capture itself runs nothing, so the call that captures replays once at
the end: every call trains exactly once.

What the step function may do: only device work on tensors that live as long as the graph (parameters,
optimizer state, accumulators updated in place, the static inputs); no host reads (`.item()`,
`.tolist()`), no allocation that must outlive the step, no Python-side decision on tensor values; it
should zero gradients in place (``zero_grad(set_to_none=False)``, see `run_eager`). An
optimizer's lr must be a device tensor for a scheduler's changes to reach the replays. Its kernels are
fixed at capture: module modes (train/eval), autocast and the batch shape are those of the capture.
"""

from __future__ import annotations

import gc
from collections import OrderedDict
from typing import Any, Callable, Collection, Hashable, Sequence

import torch
from torch import nn

__all__ = ["GraphedStep", "ShapeGraphs"]


class GraphedStep:
    """fn(*inputs) -> None: one training step on `inputs` (tensors of fixed shapes and dtypes).

    warmup: eager steps before the capture (>= 1; torch's recipe uses a few). params: the tensors whose
    `.grad` the step produces; they are set to None before the capture so that backward allocates
    them in the graph's pool (and memory outside the graph can never alias them). stream: the stream
    to capture on, which should be the one every call runs on (not the legacy default stream, which
    cannot capture; None: torch's own capture stream). cuBLAS keeps a workspace per stream: on the
    callers' stream the capture finds the one its warm-ups set up (`LocalTrainer`'s blocks train so).
    """

    def __init__(self, fn: Callable[..., None], params: Sequence[torch.Tensor], *, warmup: int = 3,
                 stream: torch.cuda.Stream | None = None) -> None:
        if warmup < 1:
            raise ValueError(f"warmup={warmup!r}: allowed >= 1 (cuDNN/cuBLAS set up in eager steps before a capture)")
        self.fn, self.params, self.warmup, self.stream = fn, list(params), int(warmup), stream
        self.calls = 0
        self.warmup_ooms = 0   # the caller's count of warm-up steps that ran out of memory
        self.graph: torch.cuda.CUDAGraph | None = None
        self.pool_bytes: int | None = None   # what the allocator reserved during the capture (bytes)
        self.static: list[torch.Tensor] = []

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def matches(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Whether `inputs` can replay the captured graph (same shapes, dtypes, devices); True before the capture."""
        if self.graph is None:
            return True
        return len(inputs) == len(self.static) and all(
            x.shape == s.shape and x.dtype == s.dtype and x.device == s.device for x, s in zip(inputs, self.static))

    def __call__(self, *inputs: torch.Tensor) -> None:
        if self.graph is not None:
            if not self.matches(inputs):
                raise ValueError("inputs: shapes/dtypes " + str([(tuple(x.shape), x.dtype) for x in inputs])
                                 + " differ from the captured " + str([(tuple(s.shape), s.dtype) for s in self.static]))
            for s, x in zip(self.static, inputs):
                s.copy_(x)
            self.graph.replay()
        elif self.calls < self.warmup:
            # On the caller's stream, not torch's recipe's side stream: the caching allocator keeps a
            # stream's freed blocks for that stream, so a side stream's warm-up needs a second working set
            # beside the caller's (on the H100 it ran out of memory at step 0 under issue 18's 520 MiB cap).
            # Gradients dropped first, as an eager step's zero_grad does: a step that zeroes them in place
            # would otherwise hold last step's through its forward, one gradient set above the eager
            # peak (32 MiB for ResNet-18's layer4 on the H100, where every warm-up then ran out of memory).
            self._drop_grads()
            self.fn(*inputs)
        else:
            self._capture(inputs)
            self.graph.replay()
        self.calls += 1

    def run_eager(self, *inputs: torch.Tensor) -> None:
        """One step eagerly on `inputs` of any shape (e.g. an epoch's short last batch), not counted.
        A step function that zeroes gradients in place (``zero_grad(set_to_none=False)``) then
        accumulates into the gradient buffers the capture allocated, so no second set is needed."""
        self.fn(*inputs)

    def release(self) -> None:
        """Drop the graph and its static buffers (its private pool goes back to the allocator's cache);
        the next call warms up and captures again."""
        self.graph, self.static, self.calls = None, [], 0

    def _capture(self, inputs: Sequence[torch.Tensor]) -> None:
        # the static buffers keep the inputs' layouts (a channels_last batch stays channels_last)
        self.static = [torch.empty_like(x, memory_format=torch.preserve_format).copy_(x) for x in inputs]
        self._drop_grads()
        dev = self.static[0].device if self.static else None
        # The private pool can only take memory the caching allocator has given back: the warm-up's
        # cached blocks, the gradients just dropped among them, would otherwise stay reserved beside it
        # (GPU-tested on the H100 under issue 18's 520 MiB cap, 2026-11-23: the block captures fit).
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(dev)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=self.stream):
            self.fn(*self.static)
        self.graph = g
        self.pool_bytes = torch.cuda.memory_reserved(dev) - before

    def _drop_grads(self) -> None:
        for p in self.params:
            p.grad = None


class _Bare(nn.Module):
    """`module` behind a module with no hooks of its own (`make_graphed_callables` refuses a module
    with hooks; those of `module` and its children, e.g. a precision plan's, run in the capture)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> Any:
        return self.module(x)


class ShapeGraphs(nn.Module):
    """`module`'s forward and backward replayed as CUDA graphs, one capture per batch size, with no
    compiler: `torch.cuda.make_graphed_callables` (after the shape's first step ran eagerly, one capture of the
    forward and one of the backward): 0.2-0.6 s per shape in the demo's step records with torch's 3 warm-up
    passes (H200, 2026-11-28),
    where `torch.compile`'s cudagraphs backend traces for 7.1-9.3 s (EfficientNet-B0, H100, 2026-11-28).
    For an elastic batch that visits a few buckets, and a step bound by the host's kernel launches.

    sizes: the batch sizes (dim 0 of the input) that are graphed; a call at any other size (an epoch's
    short last batch, a noise measurement's half batch), in eval mode, under no_grad or off CUDA runs
    `module` eagerly. key: a callable whose value joins the capture key, for state the graph bakes in
    that the input does not show (a `TriAccelOptimizer`'s ``plan.key``, its precision policy); the
    autocast state (enabled, dtype) is always part of the key. max_graphs: captures kept (>= 1), least
    recently used dropped first: each holds its own memory pool (the activations of one step at its
    batch). eager_first: calls of each new key that run the module eagerly, as real steps on the
    caller's stream, before the capture (cuDNN's autotuning and lazy set-up happen there instead of in
    discarded passes; 0: capture at the key's first call). warmup: passes `make_graphed_callables`
    runs and discards before each capture, on a side stream (>= 1 with eager_first 0, torch's recipe
    is 3; >= 0 otherwise). Default: one eager step, no discarded pass, the cheapest capture measured
    (`benchmarks/device/capture_cost.py`, H200, 2026-11-28, benchmarks/results/s41/callA_probe: summed
    over six sizes EfficientNet-B0 2.17 s against 3.18 s with torch's 3 passes, ResNet-18 0.82 s against
    1.11 s). Each capture lets `torch.cuda.graph` empty the allocator's caches first, as torch does:
    keeping them saved nothing in the same probe and, under autocast, failed a GPU test's capture with
    no discarded pass.

    What the capture bakes in: the module's kernels at that shape, autocast state and policy; the
    parameters' and buffers' storage (an optimizer must update them in place, as torch's do). The
    warm-up passes run on the call's own batch and would update BatchNorm's running statistics; they
    are restored, so every call trains the statistics exactly once, graphed or not. A backward
    hands the parameters gradient tensors that live in the graph's pool and are overwritten by the
    next replay of that graph: set gradients to None between steps (torch's default) or accumulate
    into buffers of your own (`TriAccelOptimizer.zero_grad` does before a split step).
    """

    def __init__(self, module: nn.Module, sizes: Collection[int], *, key: Callable[[], Hashable] | None = None,
                 max_graphs: int = 2, warmup: int = 0, eager_first: int = 1) -> None:
        super().__init__()
        if isinstance(sizes, (str, bytes)) or not sizes or not all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in sizes):
            raise ValueError(f"sizes={sizes!r}: allowed a non-empty collection of ints >= 1")
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"max_graphs={max_graphs!r}: allowed integers >= 1")
        if isinstance(eager_first, bool) or not isinstance(eager_first, int) or eager_first < 0:
            raise ValueError(f"eager_first={eager_first!r}: allowed integers >= 0")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < (0 if eager_first else 1):
            raise ValueError(f"warmup={warmup!r}: allowed integers >= 1 (>= 0 with eager_first >= 1: cuDNN/cuBLAS "
                             f"set up in eager passes before a capture)")
        self.module = module
        self.sizes = frozenset(sizes)
        self.key, self.max_graphs, self.warmup, self.eager_first = key, max_graphs, warmup, eager_first
        self._graphs: OrderedDict[Hashable, Callable[..., Any]] = OrderedDict()
        self._eager_calls: dict[Hashable, int] = {}   # per key: eager calls before its first capture
        self.captures = 0   # captures made (a dropped graph captured again counts again)

    def forward(self, x: torch.Tensor) -> Any:
        if (not isinstance(x, torch.Tensor) or x.device.type != "cuda" or x.dim() == 0 or x.shape[0] not in self.sizes
                or not self.module.training or not torch.is_grad_enabled()):
            return self.module(x)
        enabled = torch.is_autocast_enabled("cuda")
        dtype = torch.get_autocast_dtype("cuda")
        k = (tuple(x.shape), x.stride(), x.dtype, x.device, enabled, dtype, None if self.key is None else self.key())
        fn = self._graphs.get(k)
        if fn is None:
            done = self._eager_calls.get(k, 0)
            if done < self.eager_first:   # a real step; a key dropped and needed again captures at once
                self._eager_calls[k] = done + 1
                return self.module(x)
            fn = self._capture(x, enabled, dtype)
            self._graphs[k] = fn
        self._graphs.move_to_end(k)
        return fn(x)

    def _capture(self, x: torch.Tensor, enabled: bool, dtype: torch.dtype) -> Callable[..., Any]:
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
        buffers = [b for b in self.module.buffers()]
        saved = [b.clone() for b in buffers]
        static = torch.empty_like(x, memory_format=torch.preserve_format).copy_(x)
        try:
            # autocast's cast cache would hand the capture casts made outside it (torch refuses it)
            with torch.autocast("cuda", dtype=dtype, enabled=enabled, cache_enabled=False):
                fn = torch.cuda.make_graphed_callables(_Bare(self.module), (static,), num_warmup_iters=self.warmup,
                                                       allow_unused_input=True)
        finally:   # also when the capture fails (e.g. out of memory): the caller may retry the step
            with torch.no_grad():
                for b, s in zip(buffers, saved):
                    b.copy_(s)
        self.captures += 1
        return fn

    def release(self) -> None:
        """Drop every capture (their pools go back to the allocator's cache)."""
        self._graphs.clear()

    @property
    def graphs(self) -> int:
        """Captures held now."""
        return len(self._graphs)
