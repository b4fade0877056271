"""Activation swap / recompute for a torch model under a VRAM budget: measures the cost table of
:mod:`triaccel.swap_plan` at run time and applies a plan.

```python
off = ActivationOffload(model)                      # units: top-level children, Sequentials expanded
tables = [off.measure(lambda: loss_of(x[:b], y[:b]), b) for b in (16, 32)]
plan = plan_for_budget(CostModel(tables).at(96), 8 * 2**30)
off.apply(plan)
with off:                                           # saved tensors of swap units go to host
    loss = loss_of(x, y)
    loss.backward()
```

Mechanics on CUDA: inside a "swap" unit every saved tensor (not a parameter, at least `min_bytes`)
is copied to a pinned host buffer on a device->host side stream as it is saved (the compute stream
does not wait; the device memory is released once the copy ends, `record_stream`). At the backward
start of the unit named by the plan's `prefetch_at` (a hook on that unit's output gradient) its
buffers are copied back on a host->device stream into blocks of the compute stream's pool; the
compute stream waits on an event only when the tensor is used. "recompute" units run under
`torch.utils.checkpoint` (non-reentrant); their BatchNorm running statistics are restored after
the recomputation so they move once per step, as without a plan. "recompute_swap" units are
recomputed too, and the inputs the checkpoint keeps go through the swap path above (the checkpoint
saves them under this object's saved-tensor hooks; the operations inside it save under the
checkpoint's own). On CPU there are no streams: a swap is a copy into a separate host tensor, so
the same code paths run (and tests can compare gradients bit for bit).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
import warnings
import weakref
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from triaccel.swap_plan import ACTIONS, RECOMPUTING, SWAPPING, CostTable, LayerCost, SwapPlan

__all__ = ["ActivationOffload", "CudaBytes", "LiveBytes", "OffloadDriver", "OffloadError", "check_pinnable",
           "default_units", "measure_bandwidth"]


class OffloadError(RuntimeError):
    """Host memory for swapped activations cannot be pinned (no CUDA, or the host is out of pinnable
    memory)."""


def default_units(model: nn.Module) -> list[str]:
    """Names of the swap units of `model`: its top-level children, with every `nn.Sequential`
    replaced by its children (recursively), so a ResNet's units are its stem layers, its blocks and
    its head."""
    out: list[str] = []

    def walk(prefix: str, m: nn.Module) -> None:
        for name, child in m.named_children():
            full = f"{prefix}{name}"
            if isinstance(child, nn.Sequential):
                walk(full + ".", child)
            elif any(True for _ in child.parameters()) or any(True for _ in child.children()):
                out.append(full)

    walk("", model)
    if not out:
        raise ValueError("model has no child modules with parameters: give `units` explicitly")
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device: torch.device | str, nbytes: int = 256 * 2**20, repeats: int = 3) -> tuple[float, float]:
    """(device->host, host->device) copy bandwidth in bytes/s between `device` and pinned host
    memory, the best of `repeats` copies of `nbytes`. On CPU: a host memcpy, both directions."""
    device = torch.device(device)
    if nbytes < 1 or repeats < 1:
        raise ValueError(f"nbytes={nbytes!r}, repeats={repeats!r} are invalid: allowed integers >= 1")
    n = nbytes // 4
    if device.type != "cuda":
        a, b = torch.empty(n), torch.empty(n)
        best = min(_timed(lambda: b.copy_(a), device) for _ in range(repeats))
        return n * 4 / best, n * 4 / best
    host = _pinned(torch.empty(0), (n,), None, "bandwidth probe")
    dev = torch.empty(n, device=device)

    def timed(dst: torch.Tensor, src: torch.Tensor) -> float:
        dst.copy_(src, non_blocking=True)  # warm
        return _timed(lambda: dst.copy_(src, non_blocking=True), device)

    d2h = min(timed(host, dev) for _ in range(repeats))
    h2d = min(timed(dev, host) for _ in range(repeats))
    return n * 4 / d2h, n * 4 / h2d


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds `fn()` takes: between two CUDA events on CUDA (its GPU work, after what is queued
    before it), on the host clock elsewhere; at least 1e-9."""
    if device.type == "cuda":
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        return max(s.elapsed_time(e) / 1e3, 1e-9)
    t0 = time.perf_counter()
    fn()
    return max(time.perf_counter() - t0, 1e-9)


def _pinned(like: torch.Tensor, size: Sequence[int], stride: Sequence[int] | None, what: str) -> torch.Tensor:
    """An empty pinned host tensor; OffloadError with the cause when pinning fails."""
    try:
        if stride is None:
            return torch.empty(tuple(size), dtype=like.dtype, pin_memory=True)
        return torch.empty_strided(tuple(size), tuple(stride), dtype=like.dtype, pin_memory=True)
    except RuntimeError as e:
        nbytes = like.element_size() * int(torch.Size(size).numel())
        raise OffloadError(
            f"cannot pin {nbytes} bytes of host memory for {what}: {e}. Swapping activations needs a CUDA "
            "device and pinnable host memory; use TriAccelConfig(offload='off'), a smaller batch, or free "
            "host memory") from e


def check_pinnable(nbytes: int = 4) -> None:
    """Raise OffloadError (naming the cause and the way out) when `nbytes` of host memory cannot be
    pinned here."""
    _pinned(torch.empty(0), (max(nbytes // 4, 1),), None, "a pinning probe")


def _dense_stride(t: torch.Tensor) -> tuple[int, ...] | None:
    """t's strides when they describe a dense layout that the host copy can keep (contiguous or
    channels_last), else None (the host copy is then contiguous)."""
    if t.is_contiguous():
        return None
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return tuple(t.stride())
    return None


class CudaBytes:
    """The CUDA caching allocator's bytes in use on `device`: allocated(), peak() since reset_peak().
    (A block freed while a side-stream copy still reads it, `record_stream`, leaves these counters at
    once but is reused only after the copy: `memory_reserved` holds it meanwhile.)"""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


class LiveBytes(TorchDispatchMode):
    """CPU stand-in for `CudaBytes`: bytes of the tensor storages created while the mode is active
    that are still alive (allocated()), and their peak since reset_peak(). Storages that existed
    before entering are not counted, so compare differences (peak - allocated at a start).

    ignore: called at each op; True makes its outputs uncounted (e.g. `ActivationOffload.host_copying`:
    a swap's host copy is host memory on a device, so CPU runs count what a device would hold).
    For tests and CPU smoke runs of the planner against measured bytes; it slows every op.
    """

    def __init__(self, ignore: Callable[[], bool] | None = None) -> None:
        super().__init__()
        self.ignore = ignore
        self._cur = self._peak = 0
        self._seen: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.ignore is None or not self.ignore():
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    s = t.untyped_storage()
                    n = s.nbytes()
                    if n and s not in self._seen:
                        self._seen[s] = n
                        self._cur += n
                        self._peak = max(self._peak, self._cur)
                        weakref.finalize(s, self._freed, n)
        return out

    def _freed(self, n: int) -> None:
        self._cur -= n

    def allocated(self) -> int:
        return self._cur

    def peak(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        self._peak = self._cur


class _Packed:
    """A saved tensor living in host memory, and its copy back to the device once issued."""

    __slots__ = ("host", "device", "stored", "fetched", "ready", "shape", "stride")

    def __init__(self, host: torch.Tensor, device: torch.device, stored: Any, shape: torch.Size,
                 stride: tuple[int, ...]) -> None:
        self.host, self.device, self.stored = host, device, stored  # stored: d2h event (CUDA) or None
        self.fetched: torch.Tensor | None = None
        self.ready: Any = None
        self.shape, self.stride = shape, stride


class ActivationOffload:
    """Swap / recompute the saved activations of a model's units per a SwapPlan.

    model: the module; units: names of its submodules that form the units, in forward order
    (default `default_units(model)`); min_bytes: saved tensors smaller than this stay on the device
    (a copy of a few KiB costs more in launches than it frees). Use as a context manager around
    forward (and backward) once a plan is applied; `measure` gives the cost table. `remove()` undoes
    all hooks and recompute wrappers.

    Raises OffloadError at `apply` when a plan swaps on a CUDA model but host memory cannot be pinned.
    """

    def __init__(self, model: nn.Module, units: Sequence[str] | None = None, *, min_bytes: int = 64 * 2**10) -> None:
        if not (isinstance(min_bytes, int) and min_bytes >= 0):
            raise ValueError(f"min_bytes={min_bytes!r} is invalid: allowed an integer >= 0 (bytes)")
        self.model = model
        self.units = tuple(default_units(model) if units is None else units)
        mods = dict(model.named_modules())
        missing = [u for u in self.units if u not in mods]
        if missing or not self.units:
            raise ValueError(f"units={list(self.units)!r} is invalid: allowed names of submodules of the model; "
                             f"not found: {missing}")
        self.modules = [mods[u] for u in self.units]
        self.min_bytes = min_bytes
        self.actions: tuple[str, ...] = ("keep",) * len(self.units)
        self.prefetch_at: tuple[int | None, ...] = (None,) * len(self.units)
        self._triggers: dict[int, list[int]] = {}
        self._applied: SwapPlan | Sequence[str] = self.actions
        self._params: set[int] = set()
        self._stack: list[int] = []
        self._packed: list[list[_Packed]] = [[] for _ in self.units]
        self._orig_forward: dict[int, Any] = {}
        self._recorder: Callable[[str, int], None] | None = None
        self._hooks_ctx: Any = None
        self._streams: tuple[Any, Any] | None = None
        self.swapped_bytes = 0  # bytes copied to host in the last step
        self.host_copying = False  # True while a swapped tensor's host copy is made (LiveBytes' ignore)
        self._observer: Callable[[str, int], None] | None = None
        # the units' forward hooks exist only while something needs them (a plan, a measurement, an
        # observer): with no plan in force a forward runs as without this object
        self._handles: list[Any] = []

    @property
    def observer(self) -> Callable[[str, int], None] | None:
        """Called as observer(event, unit) at "fwd_start", "fwd_end", "bwd_start" of each unit
        (e.g. to trace memory over a step); None: off."""
        return self._observer

    @observer.setter
    def observer(self, fn: Callable[[str, int], None] | None) -> None:
        self._observer = fn
        self._sync_hooks()

    @property
    def hooked(self) -> bool:
        """Whether the units' forward hooks are installed (a plan, a measurement or an observer)."""
        return bool(self._handles)

    def _sync_hooks(self) -> None:
        want = self.plan_active or self._observer is not None or self._recorder is not None
        if want and not self._handles:
            for i, m in enumerate(self.modules):
                self._handles.append(m.register_forward_pre_hook(self._make_pre(i)))
                self._handles.append(m.register_forward_hook(self._make_post(i)))
        elif not want and self._handles:
            for h in self._handles:
                h.remove()
            self._handles = []
            self._stack = []

    # -- plan --------------------------------------------------------------------------------
    @property
    def plan_active(self) -> bool:
        return any(a != "keep" for a in self.actions)

    def apply(self, plan: SwapPlan | Sequence[str]) -> None:
        """Apply a SwapPlan (or a list of per-unit actions, prefetched one unit ahead)."""
        if isinstance(plan, SwapPlan):
            if plan.names != self.units:
                raise ValueError(f"plan names units {plan.names}, this offload has {self.units}")
            acts, pf = tuple(plan.actions), tuple(plan.prefetch_at)
        else:
            acts = tuple(plan)
            if len(acts) != len(self.units) or any(a not in ACTIONS for a in acts):
                raise ValueError(f"plan={acts!r} is invalid: allowed {len(self.units)} actions from {ACTIONS}")
            last = len(acts) - 1
            pf = tuple(min(i + 1, last) if a in SWAPPING else None for i, a in enumerate(acts))
        if SWAPPING.intersection(acts) and self._device().type == "cuda":
            check_pinnable()
        for i, m in enumerate(self.modules):  # recompute wrappers follow the plan
            if acts[i] in RECOMPUTING and i not in self._orig_forward:
                # the instance's own forward, if it had one (None: the class's, restored by deletion)
                self._orig_forward[i] = vars(m).get("forward")
                m.forward = self._recompute_forward(m, m.forward)
            elif acts[i] not in RECOMPUTING and i in self._orig_forward:
                orig = self._orig_forward.pop(i)
                if orig is None:
                    del m.forward
                else:
                    m.forward = orig
        self.actions, self.prefetch_at = acts, pf
        self._applied = plan
        self._triggers = {}
        for j, k in enumerate(pf):
            if k is not None:
                self._triggers.setdefault(k, []).append(j)
        self._sync_hooks()

    def remove(self) -> None:
        """Remove hooks, recompute wrappers and the observer."""
        self._observer = None
        self.apply(("keep",) * len(self.units))

    def _device(self) -> torch.device:
        p = next(self.model.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    @staticmethod
    def _recompute_forward(module: nn.Module, orig: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            calls = [0]

            def run(*a: Any, **k: Any) -> Any:
                calls[0] += 1
                if calls[0] == 1:
                    return orig(*a, **k)
                # the recomputation in backward: BatchNorm's running statistics must not move twice
                bufs = [b for b in module.buffers()]
                saved = [b.clone() for b in bufs]
                try:
                    return orig(*a, **k)
                finally:
                    with torch.no_grad():
                        for b, s in zip(bufs, saved):
                            b.copy_(s)
            return checkpoint(run, *args, use_reentrant=False, **kwargs)
        return forward

    # -- hooks -------------------------------------------------------------------------------
    def __enter__(self) -> "ActivationOffload":
        self._packed = [[] for _ in self.units]
        self.swapped_bytes = 0
        # parameters and buffers are resident anyway: swapping them would copy without freeing
        self._params = {p.untyped_storage().data_ptr()
                        for p in (*self.model.parameters(), *self.model.buffers())}
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks_ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        ctx, self._hooks_ctx = self._hooks_ctx, None
        ctx.__exit__(*exc)

    def _make_pre(self, i: int) -> Callable[..., None]:
        def pre(module: nn.Module, args: Any) -> None:
            self._stack.append(i)
            if self._observer is not None:
                self._observer("fwd_start", i)
            if self._recorder is not None:
                self._recorder("fwd_start", i)
                self._recorder_inputs(i, args)
        return pre

    def _make_post(self, i: int) -> Callable[..., None]:
        def post(module: nn.Module, args: Any, out: Any) -> None:
            if self._stack and self._stack[-1] == i:
                self._stack.pop()
            if self._observer is not None:
                self._observer("fwd_end", i)
            if self._recorder is not None:
                self._recorder("fwd_end", i)
            want = (self._recorder is not None or self._observer is not None
                    or (self._hooks_ctx is not None and i in self._triggers))
            if want and torch.is_grad_enabled():
                t = out if isinstance(out, torch.Tensor) else next(
                    (o for o in (out if isinstance(out, (tuple, list)) else ()) if isinstance(o, torch.Tensor)), None)
                if t is not None and t.requires_grad:
                    t.register_hook(lambda g, i=i: self._backward_start(i))
        return post

    def _backward_start(self, i: int) -> None:
        if self._observer is not None:
            self._observer("bwd_start", i)
        if self._recorder is not None:
            self._recorder("bwd_start", i)
        for j in self._triggers.get(i, ()):
            for p in self._packed[j]:
                self._fetch(p)
            self._packed[j] = []

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._stack:
            return t
        i = self._stack[-1]
        if self._recorder is not None:
            self._record_saved(i, t)
            return t
        if self.actions[i] not in SWAPPING or t.numel() * t.element_size() < self.min_bytes:
            return t
        if t.untyped_storage().data_ptr() in self._params:
            return t
        stride = _dense_stride(t)
        nbytes = t.numel() * t.element_size()
        self.swapped_bytes += nbytes
        with torch.no_grad():
            if t.device.type == "cuda":
                if self._streams is None:
                    self._streams = (torch.cuda.Stream(t.device), torch.cuda.Stream(t.device))
                d2h, _ = self._streams
                host = _pinned(t, t.shape, stride, f"unit {self.units[i]!r}")
                d2h.wait_stream(torch.cuda.current_stream(t.device))
                with torch.cuda.stream(d2h):
                    host.copy_(t, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(d2h)
                t.record_stream(d2h)  # the device block is reused only after the copy
            else:
                self.host_copying = True
                try:
                    host = torch.empty(t.shape, dtype=t.dtype) if stride is None else torch.empty_strided(
                        t.shape, stride, dtype=t.dtype)
                    host.copy_(t)
                finally:
                    self.host_copying = False
                ev = None
        p = _Packed(host, t.device, ev, t.shape, t.stride())
        self._packed[i].append(p)
        return p

    def _fetch(self, p: _Packed) -> None:
        if p.fetched is not None or p.device.type != "cuda":
            return
        _, h2d = self._streams
        # allocated on the compute stream, whose pool the swapped-out tensors returned to (a block of
        # the copy stream's own pool would not be reused by the compute stream); the copy waits for
        # the compute work queued so far, which may still read the block's previous tensor
        cur = torch.cuda.current_stream(p.device)
        dev = torch.empty_strided(p.host.shape, p.host.stride(), dtype=p.host.dtype, device=p.device)
        h2d.wait_stream(cur)
        h2d.wait_event(p.stored)
        with torch.cuda.stream(h2d):
            dev.copy_(p.host, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(h2d)
        p.fetched, p.ready = dev, ev

    def _unpack(self, p: Any) -> torch.Tensor:
        if not isinstance(p, _Packed):
            return p
        if p.device.type != "cuda":
            return p.host
        self._fetch(p)  # on demand when no prefetch was issued (exposed time)
        cur = torch.cuda.current_stream(p.device)
        cur.wait_event(p.ready)
        t, p.fetched = p.fetched, None
        return t

    # -- measurement ---------------------------------------------------------------------------
    def _recorder_inputs(self, i: int, args: Any) -> None:
        ts = [a for a in args if isinstance(a, torch.Tensor)]
        self._rec_inputs[i] = sum(a.numel() * a.element_size() for a in ts)
        self._rec_input_ptrs[i] = {a.untyped_storage().data_ptr(): a.numel() * a.element_size() for a in ts}

    def _record_saved(self, i: int, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes or t.untyped_storage().data_ptr() in self._params:
            return
        ptr = t.untyped_storage().data_ptr()
        seen = self._rec_saved[i]
        seen[ptr] = max(seen.get(ptr, 0), nbytes)  # the same storage saved twice frees its bytes once
        self._rec_transfer[i] += nbytes

    def measure(self, loss_fn: Callable[[], torch.Tensor], batch: int, repeats: int = 3,
                bandwidth: tuple[float, float] | None = None, memory: Any = None,
                calibrate: bool = False) -> CostTable:
        """The cost table at `batch` samples: runs `loss_fn()` (a forward on `batch` samples giving a
        scalar loss) and its backward once to warm up, then `repeats` times with per-unit CUDA
        events (timestamps on CPU) and saved-tensor hooks, with no plan applied; medians of the
        times. Gradients accumulate into `.grad` as in training: zero them afterwards if needed.
        bandwidth: (d2h, h2d) bytes/s, measured with `measure_bandwidth` when None. memory: what
        reads the step's static and peak bytes (`allocated()`, `peak()`, `reset_peak()`): None is
        the CUDA allocator on CUDA; on CPU None leaves static_bytes and transient_bytes at 0, and a
        `LiveBytes` (entered by the caller) counts them.
        calibrate: also time `repeats` forward and backward passes with no hook at all and scale every
        time of the table (forward, backward, other) by the median plain step over the table's own
        total (its units' medians and other): the per-unit events and saved-tensor hooks make a small
        batch's step host-bound (ResNet-152 bf16 on an H100: the model from its tables ran 1.30-1.84x
        the measured plain step at B0, 2026-12-07, `benchmarks/offload_model_check.py`), so the units
        keep their shares and the table its plain step's total. Off by default: on an H100 (2026-12-07,
        `benchmarks/offload.py --calibrate on`, docs/results.md) it brought the model's step at B0 from 1.56x
        to 1.01x the measured one, but at Bp the model stayed 26-40% under, as without it.
        """
        if not (isinstance(batch, int) and batch >= 1) or not (isinstance(repeats, int) and repeats >= 1):
            raise ValueError(f"batch={batch!r}, repeats={repeats!r} are invalid: allowed integers >= 1")
        if not isinstance(calibrate, bool):
            raise ValueError(f"calibrate={calibrate!r}: allowed True or False")
        applied = self._applied
        self.apply(("keep",) * len(self.units))
        dev = self._device()
        cuda = dev.type == "cuda"
        mem = memory if memory is not None else (CudaBytes(dev) if cuda else None)
        counted = mem is not None
        L = len(self.units)
        runs: list[dict[str, Any]] = []
        try:
            loss_fn().backward()  # warm-up: allocator, cuDNN algorithms, .grad buffers
            for _ in range(repeats):
                marks: list[tuple[str, int, Any]] = []

                def mark(kind: str, i: int) -> None:
                    if cuda:
                        e = torch.cuda.Event(enable_timing=True)
                        e.record()
                        marks.append((kind, i, e))
                    else:
                        marks.append((kind, i, time.perf_counter()))

                self._rec_inputs = [0] * L
                self._rec_input_ptrs: list[dict[int, int]] = [dict() for _ in range(L)]
                self._rec_saved = [dict() for _ in range(L)]
                self._rec_transfer = [0] * L
                _sync(dev)
                if mem is not None:
                    mem.reset_peak()
                static = mem.allocated() if mem is not None else 0
                self._recorder = mark
                self._sync_hooks()
                self.__enter__()
                try:
                    mark("start", -1)
                    loss = loss_fn()
                    mark("fwd_done", -1)
                    loss.backward()
                    mark("end", -1)
                finally:
                    self.__exit__(None, None, None)
                    self._recorder = None
                    self._sync_hooks()
                _sync(dev)
                peak = mem.peak() if mem is not None else 0
                runs.append(self._times(marks, cuda) | {"static": static, "peak": peak})
                del loss
            plain = [self._plain_step_ms(loss_fn, dev) for _ in range(repeats)] if calibrate else []
        finally:
            self.apply(applied)
        med = lambda key, i: statistics.median(r[key][i] for r in runs)  # noqa: E731
        saved = [sum(d.values()) for d in self._rec_saved]
        # a unit's input that its predecessor saves too (a block's output, saved by its last op and by
        # the next block's first): one tensor, resident while either unit holds it. Storages live
        # through the measured step (the graph holds them), so equal pointers are equal tensors.
        shared, claimed = [0] * L, set()
        for i in range(1, L):
            prev, mine, inp = self._rec_saved[i - 1], self._rec_saved[i], self._rec_input_ptrs[i]
            common = (prev.keys() & mine.keys() & inp.keys()) - claimed
            shared[i] = sum(min(prev[p], mine[p], inp[p]) for p in common)
            claimed = common  # the next pair may not count these again from this unit's bytes
        other = statistics.median(r["other"] for r in runs)
        # the table's total (its units' medians and "other") scaled to the median plain step
        hooked = sum(med("fwd", i) + med("bwd", i) for i in range(L)) + other
        scale = statistics.median(plain) / hooked if plain and hooked > 0 else 1.0
        layers = tuple(LayerCost(self.units[i], saved[i], med("fwd", i) * scale, med("bwd", i) * scale,
                                 input_bytes=self._rec_inputs[i], transfer_bytes=self._rec_transfer[i],
                                 shared_bytes=shared[i])
                       for i in range(L))
        d2h, h2d = bandwidth if bandwidth is not None else measure_bandwidth(dev)
        static = min(r["static"] for r in runs) if counted else 0
        peak = max(r["peak"] for r in runs) if counted else 0
        other *= scale
        transient = CostTable.transient_from_peak(peak, static, layers) if counted else 0
        return CostTable(batch, layers, d2h, h2d, static_bytes=static, transient_bytes=transient, other_ms=other)

    def _times(self, marks: list[tuple[str, int, Any]], cuda: bool) -> dict[str, Any]:
        t0 = marks[0][2]
        ms = [(k, i, (t0.elapsed_time(v) if cuda else (v - t0) * 1e3)) for k, i, v in marks]
        L = len(self.units)
        fwd, bwd = [0.0] * L, [0.0] * L
        starts: dict[int, float] = {}
        bwd_marks = []
        fwd_done = end = 0.0
        for k, i, t in ms:
            if k == "fwd_start":
                starts[i] = t
            elif k == "fwd_end" and i in starts:
                fwd[i] += t - starts.pop(i)
            elif k == "bwd_start":
                bwd_marks.append((t, i))
            elif k == "fwd_done":
                fwd_done = t
            elif k == "end":
                end = t
        # a unit's backward runs from its output gradient's hook to the next unit's hook
        bwd_marks.sort()
        for n, (t, i) in enumerate(bwd_marks):
            nxt = bwd_marks[n + 1][0] if n + 1 < len(bwd_marks) else end
            bwd[i] += nxt - t
        bwd_begin = bwd_marks[0][0] if bwd_marks else end
        other = max(fwd_done - sum(fwd), 0.0) + max(bwd_begin - fwd_done, 0.0)
        return {"fwd": fwd, "bwd": bwd, "other": other}

    def _plain_step_ms(self, loss_fn: Callable[[], torch.Tensor], dev: torch.device) -> float:
        """One forward and backward of `loss_fn` with no hook of this offload (no plan, no recorder,
        no observer): its time in ms, CUDA events on CUDA, the host clock elsewhere."""
        observer, self._observer = self._observer, None
        self._sync_hooks()
        try:
            _sync(dev)
            return _timed(lambda: loss_fn().backward(), dev) * 1e3
        finally:
            self._observer = observer
            self._sync_hooks()



def _slice_batch(v: Any, n: int, k: int) -> Any:
    """`v` with every tensor of leading size n cut to its first k rows (nested tuples/lists/dicts)."""
    if isinstance(v, torch.Tensor):
        return v[:k] if v.dim() > 0 and v.shape[0] == n else v
    if isinstance(v, (tuple, list)):
        return type(v)(_slice_batch(x, n, k) for x in v)
    if isinstance(v, dict):
        return {key: _slice_batch(x, n, k) for key, x in v.items()}
    return v


def _first_tensor(v: Any) -> torch.Tensor | None:
    if isinstance(v, torch.Tensor):
        return v
    items = v.values() if isinstance(v, dict) else v if isinstance(v, (tuple, list)) else ()
    return next((t for t in map(_first_tensor, items) if t is not None), None)


def _scalar(out: Any) -> torch.Tensor:
    """A scalar from a forward's output(s) for the measuring backward (its saved tensors and times
    are those of training up to the loss itself, which the table counts as other/transient)."""
    if isinstance(out, torch.Tensor):
        return out.float().mean()
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    parts = [_scalar(o) for o in items if isinstance(o, (torch.Tensor, tuple, list, dict))]
    if not parts:
        raise ValueError(f"model output of type {type(out).__name__} holds no tensor to measure a backward from")
    return torch.stack(parts).sum()


class OffloadDriver:
    """The torch wrapper's half of offload="auto" (`triaccel.backends.torch.wrap`): an
    `ActivationOffload` over the model, measurement of its cost tables when the controller asks
    (`Controller.wants_offload_costs`), the decided plan (`Decision.offload_plan`) applied when it
    changes, and wall time per step of windows run under one active plan (`observe_step_time`).
    With no plan in force the steady state costs one forward pre-hook per step (the input capture):
    no unit hooks, no timing, no re-measurement.

    The measuring steps re-run the last training forward's input (a reference kept by a forward
    pre-hook) at two batch sizes, n and n/2 (n/2 and n/4 while a plan is active, since without a plan
    n may not fit), under the precision `region`, with no plan; BatchNorm buffers, gradients and RNG
    states are restored afterwards, so training does not see them. units / min_bytes: as
    `ActivationOffload`; bandwidth: (d2h, h2d) bytes/s (None: `measure_bandwidth` once); repeats:
    timed runs per table.
    """

    def __init__(self, model: nn.Module, controller: Any, region: Callable[[], Any], *,
                 units: Sequence[str] | None = None, min_bytes: int = 64 * 2**10,
                 bandwidth: tuple[float, float] | None = None, repeats: int = 3) -> None:
        if not (isinstance(repeats, int) and repeats >= 1):
            raise ValueError(f"repeats={repeats!r} is invalid: allowed an integer >= 1")
        self.model, self.controller, self.region = model, controller, region
        self.offload = ActivationOffload(model, units, min_bytes=min_bytes)
        self.bandwidth, self.repeats = bandwidth, repeats
        self.applied: tuple[str, ...] | None = None
        self.plans: list[dict[str, Any]] = []   # each plan applied: step, batch, actions
        self.measurements: list[dict[str, Any]] = []  # each measurement: step, batches
        self._input: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self._capturing = True
        self._hook = model.register_forward_pre_hook(self._capture, with_kwargs=True)
        self._last: tuple[int, float, Any] | None = None  # (step, time, decision key) at the last boundary
        self._run = 0  # consecutive boundaries under the same key

    def _capture(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._capturing and torch.is_grad_enabled():  # a training forward (evaluation runs under no_grad)
            self._input = (args, kwargs)

    def remove(self) -> None:
        """Undo the offload's hooks and wrappers and the input capture."""
        self._hook.remove()
        self.offload.remove()

    # -- plan ----------------------------------------------------------------------------------
    def sync(self, decision: Any, step: int) -> None:
        """Apply `decision.offload_plan` if it is not the plan applied (None: no plan)."""
        acts = decision.offload_plan
        if acts == self.applied:
            return
        n = len(self.offload.units)
        plan = self.controller.offload_swap_plan
        if acts is None:
            self.offload.apply(("keep",) * n)
        elif plan is not None and tuple(plan.actions) == tuple(acts) and plan.names == self.offload.units:
            self.offload.apply(plan)  # with the model's prefetch points
        else:
            self.offload.apply(acts)
        self.applied = None if acts is None else tuple(acts)
        self.plans.append({"step": step, "batch": decision.batch_size,
                           "actions": None if acts is None else list(acts)})

    def context(self, precision_region: Any, decision: Any, step: int) -> Any:
        """The forward's context: the precision region, plus the swap hooks while a plan is active.
        Syncs the plan first (an OOM may have shrunk the batch and changed the plan mid-step)."""
        self.sync(decision, step)
        if not self.offload.plan_active:
            return precision_region
        stack = contextlib.ExitStack()
        stack.enter_context(precision_region)
        stack.enter_context(self.offload)
        return stack

    @contextlib.contextmanager
    def suspended(self) -> Any:
        """No plan inside (e.g. the curvature pass: torch.func transforms refuse the recompute
        checkpoints); the plan in force is restored on exit."""
        applied = self.offload._applied
        self.offload.apply(("keep",) * len(self.offload.units))
        self._capturing = False  # a transform's inputs must not escape it
        try:
            yield
        finally:
            self._capturing = True
            self.offload.apply(applied)

    # -- boundary ------------------------------------------------------------------------------
    def boundary(self, step: int) -> None:
        """At a control boundary, before `decide`: the step time of the window just ended, and new
        cost tables when the controller asks for them."""
        ctl = self.controller
        d = ctl.decision
        key = (d.batch_size, d.accumulation, d.offload_plan)
        now = time.perf_counter()
        if self._last is not None:
            s0, t0, k0 = self._last
            self._run = self._run + 1 if k0 == key else 0
            # the first window under a new decision holds its warm-up (allocator, cuDNN, pinned blocks);
            # with no plan in force nothing is timed (step times then only ask for re-measurements)
            if self._run >= 1 and step > s0 and self.offload.plan_active:
                ctl.observe_step_time(step, (now - t0) * 1e3 / (step - s0))
        if ctl.wants_offload_costs(step) and self._input is not None:
            tables = self.measure()
            if tables is not None:
                ctl.observe_offload_costs(step, tables)
                self.measurements.append({"step": step, "batches": [t.batch for t in tables]})
            self._run = -1  # the next window starts after a measurement: not timed
            now = time.perf_counter()
        self._last = (step, now, key)

    def measure(self) -> tuple[CostTable, ...] | None:
        """Cost tables of the last training input at two batch sizes (see the class); None when
        even one sample runs out of memory."""
        assert self._input is not None
        args, kwargs = self._input
        x = _first_tensor((args, kwargs))
        if x is None or x.dim() == 0:
            raise ValueError("offload: the model's forward takes no batched tensor to measure with")
        n = int(x.shape[0])
        top = max(n // 2, 1) if self.offload.plan_active else n
        model, dev = self.model, self.offload._device()
        if self.bandwidth is None:
            self.bandwidth = measure_bandwidth(dev, nbytes=(64 if dev.type == "cuda" else 1) * 2**20)
        grads = [(p, p.grad) for p in model.parameters()]
        buffers = [(b, b.clone()) for b in model.buffers()]
        devices = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
        try:
            # the wrapper's boundary runs inside its no_grad step
            with torch.random.fork_rng(devices=devices), torch.enable_grad():
                while True:
                    sizes = sorted({max(top // 2, 1), top})
                    try:
                        tables = []
                        for k in sizes:
                            for p, _ in grads:
                                p.grad = None
                            tables.append(self._measure_at(args, kwargs, n, k))
                        return tuple(tables)
                    except torch.OutOfMemoryError:
                        if top == 1:
                            warnings.warn("offload: measuring the cost table ran out of memory even at one "
                                          "sample; no plan is taken", RuntimeWarning, stacklevel=3)
                            return None
                    _free(dev)  # outside the except block: the failed step's tensors are gone
                    top = max(top // 2, 1)
        finally:
            self._input = (args, kwargs)  # the measuring forwards' inputs were captured too
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            for p, g in grads:
                p.grad = g
            if dev.type == "cuda":  # the measuring steps' peak is not the next window's
                torch.cuda.reset_peak_memory_stats(dev)

    def _measure_at(self, args: Any, kwargs: Any, n: int, k: int) -> CostTable:
        a, kw = _slice_batch(args, n, k), _slice_batch(kwargs, n, k)

        def loss() -> torch.Tensor:
            with self.region():
                out = self.model(*a, **kw)
            return _scalar(out)

        return self.offload.measure(loss, k, repeats=self.repeats, bandwidth=self.bandwidth)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
