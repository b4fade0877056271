"""Data parallelism on torch.distributed with one set of decisions for all ranks.

```python
from triaccel.backends.torch.distributed import init_distributed
ddp = init_distributed()                       # torchrun's env; None in a single process
model = ddp.prepare(model)                     # DistributedDataParallel (or strategy="fsdp": fully_shard)
opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, config, distributed=ddp)
loader = ElasticLoader(x, y, batch_size=config.batch_init, seed=0)   # the GLOBAL order, same on every rank
res = elastic_step(loader, opt.controller, loss_fn, opt, opt.step_count, scaler=opt,
                   apply_lr_batch_scale=False, optimizer_step=lambda d: opt.step_accumulated())
ddp.close()                                    # at the end: a gloo rank that exits inside the group can abort
```

Every rank runs the same controller on the same numbers (the rules: `triaccel.distributed`):

- **Statistics**: at each control boundary, one all-gather of a small float64 vector per rank
  (statistics ring, loss scale, memory reading, OOM count); every rank combines them the same way.
  Nothing per step beyond the gradient reduction itself (and, under FSDP, one 4-byte all-reduce of
  the non-finite flag, since each rank sees only its slice of the gradients).
- **Batch**: the loader's order and the decided batch are global; rank r trains on its part of each
  step (`RankShard`), so batch sizes must divide by the world size (`check_world_divides`).
- **OOM (DDP)**: a step's micro-batches run under `no_sync()` (no collective inside forward or
  backward), then one explicit all-reduce of the gradients, weighted by each rank's share of the
  step's samples. So an OOM on one rank is replayed on that rank alone (smaller micro-batches,
  same samples) while the others wait at the reduction; at the next boundary every controller
  applies the largest OOM count, and the global batch shrinks on all ranks at the same step.
  Every sample of an epoch is used exactly once across ranks. The price: the reduction does not
  overlap the backward pass (one flat all-reduce per step; DDP's own bucketed overlap is unused).
  Under FSDP (parameters are gathered inside forward and backward) an OOM cannot be replayed on
  one rank: it raises `OOMNotReplayable` on that rank.
- **Failures**: a rank that dies or stalls makes the others' next collective fail within the
  process group's `timeout` (`init_distributed(timeout=...)`, default 10 minutes): our collectives
  raise `RankFailure` naming the collective and the step. Under NCCL, set
  `TORCH_NCCL_ASYNC_ERROR_HANDLING=1` (torch's default) so that the watchdog aborts a timed-out
  collective; under torchrun, a rank that exits makes the agent stop the others and name it.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import os
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from triaccel.distributed import (BoundaryView, OOMNotReplayable, RankShard, check_world_divides, combine_boundary,
                                  combine_eigvals, combine_noise, pack_boundary)
from triaccel.kernels._dispatch import is_dense

__all__ = ["DEFAULT_TIMEOUT", "Distributed", "OOMNotReplayable", "RankFailure", "init_distributed", "local_tensor",
           "unwrap_parallel"]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


class RankFailure(RuntimeError):
    """A collective failed or timed out: another rank died, stalled or took a different path."""


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP parameters and gradients); any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _views_like(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive views of `flat`, one per parameter, with its shape and (for a dense parameter:
    channels_last, transposed, ...) its strides: gradients follow their parameter's layout, and
    equal strides on both sides let `torch._foreach_copy_` take its fused path (with contiguous
    views a channels_last model's copies went one tensor at a time: 124 copies per step for
    ResNet-18, counted under torch.profiler on an H200 rank)."""
    views, off = [], 0
    for p in params:
        n = p.numel()
        views.append(flat.as_strided(p.shape, p.stride(), off) if is_dense(p)
                     else flat[off:off + n].view(p.shape))
        off += n
    return views


def unwrap_parallel(model: nn.Module) -> nn.Module:
    """The module inside a `DistributedDataParallel` (layer names and hooks live there); else `model`."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def init_distributed(backend: str | None = None, *,
                     timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> "Distributed | None":
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

    Returns None when WORLD_SIZE is unset (a plain single process). backend: "nccl" when CUDA is
    available (and the current device becomes cuda:LOCAL_RANK), else "gloo". timeout: how long a
    collective waits for the other ranks before failing (a dead rank: a clear error, not a hang)."""
    if "WORLD_SIZE" not in os.environ and not dist.is_initialized():
        return None
    if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"timeout={timeout!r}: must be a positive datetime.timedelta")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend={backend!r}: allowed 'nccl', 'gloo'")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return Distributed(device=device)


class Distributed:
    """One rank of a data-parallel run: the model's parallel wrapper, the rank's share of each step
    and the collectives that keep the ranks' controllers equal.

    group: the process group (default: the world). device: where this rank trains (collectives of
    NCCL run on it; gloo's on the CPU). Build the model with `prepare`, or pass one already wrapped
    (`adopt`), before `wrap(..., distributed=self)`.
    """

    def __init__(self, group: Any = None, *, device: torch.device | str | None = None) -> None:
        if not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialised; call init_distributed() (or "
                             "torch.distributed.init_process_group) first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu"))
        self._comm_device = self.device if self.backend == "nccl" else torch.device("cpu")
        self.model: nn.Module | None = None
        self.sharded = False
        self.shard = RankShard(self.rank, self.world_size)
        self.budget: int | None = None
        # for the last parameter list (its ids): per dtype, the parameters' positions, a flat buffer
        # and views of it laid out as those parameters
        self._flat: tuple[tuple[int, ...], list[tuple[list[int], torch.Tensor, list[torch.Tensor]]]] | None = None

    # -- model ---------------------------------------------------------------------------------
    def prepare(self, model: nn.Module, strategy: str = "ddp", **kwargs: Any) -> nn.Module:
        """Wrap `model` (already on `device`) for data parallelism and adopt it.

        strategy "ddp": `DistributedDataParallel(model, forward_sync_buffers=False, **kwargs)`
        (parameters and buffers broadcast from rank 0 once, here). "fsdp": FSDP2 `fully_shard` on
        every direct child that owns parameters, then on the root (kwargs go to each call)."""
        if strategy == "ddp":
            ids = [self.device.index] if self.device.type == "cuda" else None
            # buffers synced once at construction, never inside forward (torch >= 2.13 names it
            # forward_sync_buffers; broadcast_buffers before)
            sig = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
            no_fwd_sync = {"forward_sync_buffers" if "forward_sync_buffers" in sig else "broadcast_buffers": False}
            wrapped: nn.Module = nn.parallel.DistributedDataParallel(
                model, device_ids=ids, process_group=self.group, **no_fwd_sync, **kwargs)
        elif strategy == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for child in model.children():
                if any(p.requires_grad for p in child.parameters()):
                    fully_shard(child, **kwargs)
            wrapped = fully_shard(model, **kwargs)
        else:
            raise ValueError(f"strategy={strategy!r}: allowed 'ddp', 'fsdp'")
        self.adopt(wrapped)
        return wrapped

    def adopt(self, model: nn.Module) -> None:
        """Use a model the caller wrapped: a `DistributedDataParallel` built with
        broadcast_buffers=False (a buffer broadcast inside forward would be a collective an OOM
        replay on one rank could not match), or an FSDP2 (`fully_shard`) module."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, nn.parallel.DistributedDataParallel):
            if getattr(model, "forward_sync_buffers", model.broadcast_buffers):
                raise ValueError("model: DistributedDataParallel broadcasts buffers in every forward; build it "
                                 "with forward_sync_buffers=False (broadcast_buffers=False before torch 2.13; "
                                 "Distributed.prepare does; "
                                 "sync_buffers() aligns BatchNorm statistics before evaluation)")
            self.sharded = False
        elif isinstance(model, FSDPModule):
            self.sharded = True
        else:
            raise ValueError(f"model: expected a DistributedDataParallel or an FSDP2 (fully_shard) module, got "
                             f"{type(model).__name__}; use Distributed.prepare(model)")
        self.model = model
        self.shard.replayable = not self.sharded

    def training_module(self) -> nn.Module:
        """The module to run the training forward with: under DDP its inner module, under FSDP the
        adopted module. The elastic step reduces DDP gradients itself after backward
        (`sync_gradients`), under `no_sync`, where DDP's own forward does nothing for the step but
        costs its per-call work (1.47 ms of self CPU time per step on an H200 rank, ResNet-18 at
        384 per GPU, under torch.profiler). Evaluation may use either."""
        if self.model is None:
            raise ValueError("model: none adopted; call prepare(model) or adopt(model) first")
        return unwrap_parallel(self.model) if not self.sharded else self.model

    def bind(self, config: Any) -> None:
        """Check that every batch size of `config` divides by the world size; take its OOM shrink and
        memory budget (the tightest rank is judged against it)."""
        check_world_divides(config, self.world_size)
        self.shard.oom_shrink = float(config.oom_shrink)
        self.budget = config.memory_budget

    # -- the step --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP: micro-batches accumulate locally (`sync_gradients` reduces them); FSDP: unchanged."""
        if self.model is None:
            raise ValueError("model: none adopted; call prepare(model) or adopt(model) first")
        if self.sharded:
            yield
            return
        with self.model.no_sync():  # type: ignore[operator]
            yield

    def loss_factor(self, n_local: int, n_total: int) -> float:
        """Extra loss weight of this rank's micro-batches: FSDP averages gradients over ranks, so an
        uneven step weighs rank r by W n_r / N; under DDP `sync_gradients` weighs instead (1)."""
        if not self.sharded or n_total == 0:
            return 1.0
        return self.world_size * n_local / n_total

    def sync_gradients(self, params: Sequence[torch.Tensor], n_local: int, n_total: int, step: int) -> None:
        """DDP: the step's gradient = sum over ranks of (n_local / n_total) x the rank's mean gradient,
        by one flat all-reduce per dtype (buffers kept between steps). FSDP: already reduced; no-op."""
        if self.sharded:
            return
        grads = [p.grad for p in params]
        # (not `None in grads`: that compares every tensor with None, ~1.6 ms for 62 on a CPU)
        if any(g is None for g in grads):  # a parameter this rank's step did not reach: zeros
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in params]
        key = tuple(map(id, params))
        if self._flat is None or self._flat[0] != key:
            # built once per parameter list: the per-step Python is then the list reads above
            # (ResNet-18's 62 parameters, copies and collective stubbed: 27.7 -> 14.4 us per call
            # on this project's CPU machine)
            by_dtype: dict[torch.dtype, list[int]] = {}
            for i, p in enumerate(params):
                by_dtype.setdefault(p.dtype, []).append(i)
            groups = []
            for dtype, idx in by_dtype.items():
                ps = [params[i] for i in idx]
                flat = torch.empty(sum(p.numel() for p in ps), dtype=dtype, device=ps[0].device)
                groups.append((idx, flat, _views_like(flat, ps)))
            self._flat = (key, groups)
        w = n_local / n_total if n_total else 0.0
        for idx, flat, views in self._flat[1]:
            gs = grads if len(idx) == len(grads) else [grads[i] for i in idx]
            torch._foreach_copy_(views, gs)
            flat.mul_(w)
            self._collective(f"gradient all-reduce at step {step}",
                             lambda: dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group))
            torch._foreach_copy_(gs, views)

    def reduce_found_inf(self, found: torch.Tensor) -> None:
        """FSDP: the step is non-finite when any rank's slice is (in place, MAX; no host sync)."""
        if self.sharded:
            self._collective("non-finite flag all-reduce",
                             lambda: dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group))

    # -- boundary exchange -----------------------------------------------------------------------
    def exchange_boundary(self, ring: np.ndarray | None, loss_scale: float | None,
                          memory: tuple[int, int] | None, n_tensors: int, step: int) -> BoundaryView:
        """The one all-gather of a control boundary; the view is identical on every rank."""
        vec = pack_boundary(ring, loss_scale, memory, self.shard.take_ooms())
        rows = self._all_gather(vec, f"statistics exchange at step {step}")
        return combine_boundary(rows, n_tensors, sharded=self.sharded, budget=self.budget)

    def observe_boundary(self, controller: Any, step: int, view: BoundaryView) -> None:
        """Feed the tightest rank's memory and every rank's shrink (the largest OOM count).

        step: the boundary's step; the OOMs are recorded at the step before it (they happened there
        or earlier), so that the boundary's own decision still runs the control law."""
        if view.memory is not None:
            controller.observe_memory(step, *view.memory)
        for _ in range(view.ooms):
            controller.observe_oom(max(step - 1, 0))

    def reduce_noise(self, sizes: Sequence[int], rows: np.ndarray | None, n_tensors: int, step: int
                     ) -> tuple[list[int], np.ndarray] | None:
        """A split step's noise measurement, the same on every rank (`combine_noise`); every rank
        calls it at such a step. rows: (3, n_tensors) squared norms (two micro-batches and their
        sum), None when this rank's step did not split into exactly two (then all ranks skip)."""
        T = int(n_tensors)
        ok = rows is not None and len(sizes) == 2 and np.shape(rows) == (3, T)
        vec = np.zeros(3 + 3 * T)
        if ok:
            vec[0], vec[1:3], vec[3:] = 1.0, sizes, np.asarray(rows, dtype=np.float64).reshape(-1)
        g = self._all_gather(vec, f"noise exchange at step {step}")
        if not (g[:, 0] == 1.0).all():
            return None
        return combine_noise(g[:, 1:3].astype(np.int64), g[:, 3:].reshape(-1, 3, T), sharded=self.sharded)

    def reduce_eigvals(self, eig: np.ndarray | None, shape: tuple[int, int], step: int) -> np.ndarray:
        """(L, k) curvature eigenvalues every rank observes (mean over ranks; NaN where a rank had none)."""
        vec = np.full(shape, np.nan) if eig is None else np.asarray(eig, dtype=np.float64).reshape(shape)
        g = self._all_gather(vec.reshape(-1), f"curvature exchange at step {step}")
        return combine_eigvals(g.reshape(-1, *shape))

    # -- helpers -----------------------------------------------------------------------------------
    def sync_buffers(self, model: nn.Module | None = None, reduce: str = "mean") -> None:
        """Make the buffers (BatchNorm running statistics) equal on every rank; each rank's drifted
        apart on its own samples. Call before evaluating or saving.

        reduce: "mean" (default): floating-point buffers averaged over the ranks (a running mean
        becomes the moving average of every rank's batch means, as one GPU's at the same global
        batch; a running variance the average of the ranks' within-batch variances), other buffers
        (counters) from rank 0. "rank0": every buffer from rank 0, whose statistics saw only its
        own samples (1 / world of each step's)."""
        if reduce not in ("mean", "rank0"):
            raise ValueError(f"reduce={reduce!r}: allowed 'mean' or 'rank0'")
        m = unwrap_parallel(model if model is not None else self.model)  # type: ignore[arg-type]
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for b in m.buffers():
            t = local_tensor(b)
            if reduce == "mean" and t.is_floating_point():
                self._collective("buffer all-reduce", lambda t=t: dist.all_reduce(t, group=self.group))
                t.div_(self.world_size)   # gloo has no AVG
            else:
                self._collective("buffer broadcast", lambda t=t: dist.broadcast(t, src=src, group=self.group))

    def all_sum(self, value: float) -> float:
        """Sum of a host number over ranks (e.g. correct predictions of each rank's test part)."""
        return float(self._all_gather(np.array([float(value)]), "sum").sum())

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, in rank order (e.g. decision digests to compare)."""
        out: list[Any] = [None] * self.world_size
        self._collective("object gather", lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def _all_gather(self, vec: np.ndarray, what: str) -> np.ndarray:
        t = torch.as_tensor(np.ascontiguousarray(vec, dtype=np.float64), device=self._comm_device)
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self._collective(what, lambda: dist.all_gather(out, t, group=self.group))
        return torch.stack(out).cpu().numpy()

    def _collective(self, what: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except (RuntimeError, dist.DistError) as exc:
            raise RankFailure(f"rank {self.rank}/{self.world_size}: {what} failed: another rank died, stalled "
                              f"past the process group's timeout or skipped this collective ({exc})") from exc

    def close(self) -> None:
        """Leave the process group (every rank, once training is done). Call it before the process exits:
        gloo's worker threads still alive at interpreter shutdown can abort the process (SIGABRT,
        pytorch/pytorch#190489)."""
        if dist.is_initialized():
            dist.destroy_process_group()
