"""Memory-elastic data loading for PyTorch: batch size changes at the controller's word, OOMs survived.

Two sources, one loader (`ElasticLoader`):

- device-resident tensors (`ElasticLoader(images, labels, ...)`): e.g. CIFAR's uint8 images kept on
  the GPU; gathering and augmentation (`transform`, e.g. the functions of
  `triaccel.backends.torch.augment`) run on the device, with no host work per step;
- any map-style `torch.utils.data.Dataset` (`ElasticLoader.from_dataset`): items gathered by index
  and collated (threads when `num_workers > 0`), then moved to `device`.

`elastic_step(loader, controller, loss_fn, optimizer, step)` runs one optimizer step with
out-of-memory survival: `torch.OutOfMemoryError` is caught, memory is freed outside the except
block, the controller shrinks the batch at once, and the failed samples are replayed at the new
size; every sample of an epoch is used exactly once (see `triaccel.elastic`).

Budget: the controller keeps measured memory below `memory_budget`; `enforce_memory_budget` can in
addition make CUDA's caching allocator refuse to grow past it
(`torch.cuda.set_per_process_memory_fraction`), which turns an overshoot into an OOM that
`elastic_step` survives.
"""

from __future__ import annotations

import contextlib
import gc
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from triaccel.batching import resolve_memory_limit
from triaccel.config import parse_bytes
from triaccel.elastic import (ElasticIndexLoader, ElasticStepOutcome, ElasticStepReport, controlled_step,
                              memory_pair, noise_split, noise_take, step_weight)
from triaccel.noise import observe_split_step

__all__ = ["ElasticLoader", "ElasticStepResult", "elastic_step", "enforce_memory_budget",
           "free_memory", "is_oom"]


def is_oom(exc: BaseException) -> bool:
    """True for torch's out-of-memory error (`torch.OutOfMemoryError`, CUDA's included) only."""
    return isinstance(exc, torch.OutOfMemoryError)


def free_memory() -> None:
    """Collect garbage and return cached CUDA blocks; call it outside any except block."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def enforce_memory_budget(budget: int | str, device: torch.device | str | int | None = None) -> float:
    """Cap this process's CUDA allocator at `budget` bytes (int or e.g. "4GiB"); returns the fraction.

    Uses `torch.cuda.set_per_process_memory_fraction(budget / total)`: allocations beyond it raise
    `torch.OutOfMemoryError` (which `elastic_step` survives). ValueError when the budget exceeds the
    device; RuntimeError without CUDA.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("enforce_memory_budget: CUDA is not available; a memory budget can only be "
                           "enforced on a CUDA device")
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.index is None:  # "cuda": the current device (set_per_process_memory_fraction needs an index)
        dev = torch.device("cuda", torch.cuda.current_device())
    total = int(torch.cuda.get_device_properties(dev).total_memory)
    limit = resolve_memory_limit(parse_bytes(budget, "memory_budget"), total)
    assert limit is not None
    fraction = limit / total
    torch.cuda.set_per_process_memory_fraction(fraction, dev)
    return fraction


def _to_device(batch: Any, device: torch.device | None) -> Any:
    if device is None:
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


def indices_to(indices: np.ndarray, device: torch.device) -> torch.Tensor:
    """int64 `indices` (host array) on `device`. On CUDA the copy goes through a pinned buffer,
    non-blocking: a copy from pageable memory synchronises the stream, so the host could not queue
    the next step while the GPU runs this one (measured: +45% per epoch at bs 384 on an H100).
    torch's pinned-memory cache keeps the buffer alive until the copy has run."""
    idx = torch.from_numpy(np.array(indices, dtype=np.int64))   # a copy: indices may be read-only
    if device.type == "cuda":
        return idx.pin_memory().to(device, non_blocking=True)
    return idx if idx.device == device else idx.to(device)


def gather_to(src: torch.Tensor, indices: np.ndarray, device: torch.device) -> torch.Tensor:
    """src[indices] (rows of a tensor anywhere) on `device`, with no stream sync: rows of a host
    tensor are gathered on the host straight into a pinned buffer (torch's pinned-memory cache, kept
    alive until the copy has run) and copied non-blocking; a device tensor is gathered there."""
    if src.device.type != "cpu" or device.type != "cuda":
        return src.index_select(0, indices_to(indices, src.device)).to(device)
    idx = torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int64))
    out = torch.empty((len(idx), *src.shape[1:]), dtype=src.dtype, pin_memory=True)
    torch.index_select(src, 0, idx, out=out)
    return out.to(device, non_blocking=True)


class ElasticLoader(ElasticIndexLoader):
    """Elastic loader over device-resident tensors, or over a Dataset (`from_dataset`).

    tensors: `data` (N, ...) any dtype (e.g. uint8 NHWC/NCHW images, on the GPU when it fits);
      `targets` (N,) or None. A batch is `(transform(data[idx]), targets[idx])`, or
      `transform(data[idx])` without targets; `transform` (optional) maps a batch tensor to a
      batch tensor (augmentation, normalisation, dtype/layout conversion) and runs where the data
      lives. Index tensors are built on the data's device. `index_transform` (instead of
      `transform`) is called as `index_transform(data[idx], idx)`, `idx` the batch's sample indices
      (int64, on the data's device): for augmentation keyed by sample (`augment.keyed_crop_flip`).
    batch_size: initial micro-batch size (samples); `set_batch_size`/`apply(decision)` change it.
    seed/shuffle: the per-epoch order (see `ElasticSampler`).
    """

    def __init__(self, data: torch.Tensor, targets: torch.Tensor | None = None, *, batch_size: int,
                 seed: int = 0, shuffle: bool = True,
                 transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 index_transform: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> None:
        if transform is not None and index_transform is not None:
            raise ValueError("transform, index_transform: give at most one")
        if not isinstance(data, torch.Tensor) or data.dim() == 0:
            raise ValueError(f"data: expected a torch.Tensor with a leading sample axis, got "
                             f"{type(data).__name__}; use ElasticLoader.from_dataset for a Dataset")
        if targets is not None and (not isinstance(targets, torch.Tensor) or targets.shape[0] != data.shape[0]):
            raise ValueError(f"targets: expected a tensor with {data.shape[0]} rows (one per sample), got "
                             f"{getattr(targets, 'shape', type(targets).__name__)}")
        super().__init__(int(data.shape[0]), batch_size=batch_size, seed=seed, shuffle=shuffle)
        self.data, self.targets, self.transform = data, targets, transform
        self.index_transform = index_transform
        self.dataset: Any = None
        self.device = data.device
        self._order: tuple[np.ndarray, torch.Tensor] | None = None   # (host order, its device copy)

    def _device_order(self) -> torch.Tensor:
        """The epoch's sample order on the data's device, uploaded when the sampler starts a new one
        (measured on an H100 host: a step's own index upload cost ~130 us of host time)."""
        order = self.sampler.order
        if self._order is None or self._order[0] is not order:
            self._order = (order, indices_to(order, self.device))
        return self._order[1]

    @classmethod
    def from_dataset(cls, dataset: Any, *, batch_size: int, seed: int = 0, shuffle: bool = True,
                     transform: Callable[[Any], Any] | None = None,
                     collate_fn: Callable[[list[Any]], Any] | None = None,
                     device: torch.device | str | None = None, num_workers: int = 0) -> "ElasticLoader":
        """Loader over a map-style Dataset (`__len__`, `__getitem__(int)`).

        A batch is `collate_fn([dataset[i] for i in idx])` (default `default_collate`), moved to
        `device`, then `transform` applied to its inputs (element 0 of a tuple/list batch, else the
        batch). num_workers > 0 gathers items in that many threads (decoding libraries such as PIL
        release the GIL); workers live as long as the loader.
        """
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise ValueError(f"dataset: expected a map-style Dataset with __len__ and __getitem__, got "
                             f"{type(dataset).__name__}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers={num_workers!r}: must be an integer >= 0")
        self = cls.__new__(cls)
        ElasticIndexLoader.__init__(self, len(dataset), batch_size=batch_size, seed=seed, shuffle=shuffle)
        self.data = self.targets = self.index_transform = None
        self.dataset, self.transform = dataset, transform
        self.collate_fn = collate_fn or torch.utils.data.default_collate
        self.device = torch.device(device) if device is not None else None
        self._pool = ThreadPoolExecutor(num_workers) if num_workers > 0 else None
        return self

    def fetch(self, indices: np.ndarray) -> Any:
        """The batch of samples `indices` (int array), on the loader's device, transformed."""
        if self.dataset is None:
            span = self.sampler.order_span(indices)
            if span is None:
                idx = indices_to(indices, self.device)
            else:   # a slice of the epoch order, uploaded once per epoch: no per-step copy
                idx = self._device_order()[span[0]:span[1]]
            x = self.data.index_select(0, idx)
            if self.transform is not None:
                x = self.transform(x)
            elif self.index_transform is not None:
                x = self.index_transform(x, idx)
            return x if self.targets is None else (x, self.targets.index_select(0, idx))
        ids = [int(i) for i in indices]
        items = list(self._pool.map(self.dataset.__getitem__, ids)) if self._pool else [self.dataset[i] for i in ids]
        batch = _to_device(self.collate_fn(items), self.device)
        if self.transform is not None:
            if isinstance(batch, (tuple, list)):
                batch = type(batch)([self.transform(batch[0]), *batch[1:]])
            else:
                batch = self.transform(batch)
        return batch


@dataclass
class ElasticStepResult(ElasticStepOutcome):
    """One elastic optimizer step: the common fields (`triaccel.elastic.ElasticStepOutcome`; its
    decision's lr_batch_scale was applied) and `loss`, the sample-weighted mean of loss_fn over the
    step's samples (0-dim tensor, detached; no host sync)."""

    loss: torch.Tensor


def elastic_step(loader: ElasticLoader, controller: Any, loss_fn: Callable[[Any], torch.Tensor],
                 optimizer: torch.optim.Optimizer, step: int, *, scaler: Any = None,
                 probe: Any = None, apply_lr_batch_scale: bool = True,
                 optimizer_step: Callable[[Any], None] | None = None,
                 distributed: Any = None) -> ElasticStepResult:
    """One optimizer step over the controller's logical batch, surviving out-of-memory errors.

    loss_fn(batch) -> 0-dim mean loss over the micro-batch `batch` (as produced by `loader.fetch`);
      it runs the forward pass (autocast etc. are the caller's).
    optimizer: gradients are zeroed at the start; micro-batch gradients are accumulated weighted by
      their share of the step's samples, so the result equals the gradient of the mean loss over
      the whole logical batch. The first micro-batch backpropagates into `.grad` directly (an OOM
      there is undone by zeroing); later ones compute their gradients with `torch.autograd.grad`
      and add them only once complete, so an OOM mid-backward leaves no partial gradient. (A
      failed forward may still have moved BatchNorm running statistics.)
    scaler: an optional `torch.amp.GradScaler` (FP16): losses are scaled, `scaler.step/update` used.
    probe: an optional memory probe (`triaccel.backends.torch.memory.MemoryProbe` or anything with
      `read()` returning a reading / (used, limit) pair, or a callable returning one); its reading
      after the step goes to `controller.observe_memory`.
    apply_lr_batch_scale: multiply each param group's lr by the step's `decision.lr_batch_scale`
      for this `optimizer.step()` only (restored right after, so LR schedulers see their own
      values). Pass False when the triaccel optimizer wrapper applies the decision's multipliers.
    optimizer_step(decision): replaces `optimizer.step()` (e.g. a wrapper's step); grads are ready.

    A step with fewer samples than its logical batch (an epoch's last) has its summed gradients
    multiplied by the controller's short-step weight first (`triaccel.elastic.step_weight`: s/B under
    the default short_step_lr="linear", 1 under "batch").

    Gradient noise: when `controller.is_noise_step(step)`, the step runs as two micro-batches (its
    two halves, or under the config's noise_split="double" two batches of the decided size, 2B
    samples) and the squared norms of each one's gradient and of their sum go to
    `controller.observe_gradient_noise` (one host read of 3 x n_params floats on such steps; under
    the triaccel wrapper started without a wait and fed at its next statistics flush, before the
    next decision, `TriAccelOptimizer.defer_noise`; with a plain optimizer the step waits for it).
    Tensors map to layers through `optimizer.layer_index(params)` (the triaccel wrapper); with a
    plain optimizer the controller must have a single layer.

    distributed: a `triaccel.backends.torch.distributed.Distributed` (default: the wrapper's
    `optimizer.distributed`). The loader's order and the decided batch are global; this rank runs
    its part of the step, OOMs are replayed on this rank alone, gradients are reduced once after
    its micro-batches, and `samples` counts the whole step (see that module).
    """
    if distributed is None:
        distributed = getattr(optimizer, "distributed", None)
    sharded = distributed is not None and distributed.sharded
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    done = [0]
    split = noise_split(controller, step)
    take = noise_take(controller, split)   # 2: a doubled noise step (noise_split="double")
    measure = split > 1
    tensor_layer = _tensor_layer(controller, optimizer, params) if measure else None
    sq: list[torch.Tensor] = []   # per successful micro-batch: (n_params,) squared norms

    def sqnorms(grads: list[torch.Tensor | None]) -> torch.Tensor:
        gs = [g if distributed is None else _local(g) for g in grads if g is not None]
        norms = torch.stack(torch._foreach_norm(gs)).float() if gs else torch.zeros(0)
        if len(gs) != len(grads):   # unused parameters: zero norm, kept in place
            full = torch.zeros(len(grads), device=norms.device)
            full[[i for i, g in enumerate(grads) if g is not None]] = norms
            norms = full
        return norms.square()

    def run_micro(chunk: np.ndarray, weight: float) -> torch.Tensor:
        if done[0] == 0:
            optimizer.zero_grad(set_to_none=True)   # also wipes partial grads of a failed first try
        elif done[0] == 1 and not sharded:
            _own_gradients(optimizer, params)
        loss = loss_fn(loader.fetch(chunk))
        scaled = loss if weight == 1.0 else loss * weight   # a whole step in one micro-batch: no extra op
        if sharded:   # FSDP averages over ranks: weigh this rank by its share of the step
            scaled = scaled * distributed.loss_factor(n_local[0], n_step[0])
        if scaler is not None:
            scaled = scaler.scale(scaled)
        if done[0] == 0 or sharded:   # FSDP reduces in backward's hooks: always into .grad
            before = [_local(p.grad).clone() if p.grad is not None else None for p in params] \
                if measure and done[0] else None
            scaled.backward()
            if measure:
                sq.append(sqnorms([p.grad for p in params]) if before is None else sqnorms(
                    [None if p.grad is None else _local(p.grad) - (0 if b is None else b)
                     for p, b in zip(params, before)]))
        else:
            grads = torch.autograd.grad(scaled, params, allow_unused=True)
            if measure:
                sq.append(sqnorms(list(grads)))
            into, added = [], []
            for p, g in zip(params, grads):
                if g is None:
                    continue
                if p.grad is None:   # a copy: g may be in a CUDA graph's pool (see _own_gradients)
                    p.grad = g.detach().clone()
                else:
                    into.append(p.grad)
                    added.append(g)
            if into:   # one launch per dtype group, not one per parameter (a step is host-bound at small batches)
                torch._foreach_add_(into, added)
        done[0] += 1
        return loss.detach()

    def finish(decision: Any, report: ElasticStepReport[torch.Tensor]) -> ElasticStepResult:
        w = step_weight(controller, report.num_samples if report.step_samples is None else report.step_samples,
                        decision, take)
        if w != 1.0:   # a short step (config short_step_lr): its gradient as applied, measured so too
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], w)
            sq[:] = [s * (w * w) for s in sq]
        if measure and (len(report.sizes) >= 2 or distributed is not None):
            _observe_noise(controller, step, params, report, sq, sqnorms, scaler, tensor_layer, distributed,
                           getattr(optimizer, "defer_noise", None))
        if distributed is not None:
            distributed.sync_gradients(params, report.num_samples, report.step_samples or 0, step)
        saved = [g["lr"] for g in optimizer.param_groups]
        if apply_lr_batch_scale:
            for g in optimizer.param_groups:
                g["lr"] = g["lr"] * decision.lr_batch_scale
        try:
            if optimizer_step is not None:
                optimizer_step(decision)
            elif scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
        finally:
            for g, lr in zip(optimizer.param_groups, saved):
                g["lr"] = lr
        loss = report.weighted_sum() if report.outputs else torch.zeros((), device=_device(params))
        return ElasticStepResult(loss=loss, **ElasticStepOutcome.fields(report, decision, loader.epoch))

    def read_memory() -> tuple[int, int] | None:
        if probe is None:
            return None
        return memory_pair(probe.read() if hasattr(probe, "read") else probe())

    n_local, n_step = [0], [0]
    local = None
    if distributed is not None:
        local = _SizedShard(distributed.shard, n_local, n_step)
    try:
        with contextlib.nullcontext() if distributed is None else distributed.no_sync():
            result = controlled_step(loader, controller, step, run_micro=run_micro, finish=finish,
                                     is_oom=is_oom, free_memory=free_memory,
                                     read_memory=read_memory if distributed is None else None,
                                     split=split, take=take, local=local)
    except BaseException:
        optimizer.zero_grad(set_to_none=True)
        raise
    result.end_of_epoch = loader.end_of_epoch
    if distributed is not None and getattr(optimizer, "distributed", None) is not distributed \
            and controller.is_control_step(step + 1):
        # a plain optimizer has no boundary of its own: exchange memory and OOMs here
        reading = read_memory()
        view = distributed.exchange_boundary(None, None, reading, 0, step + 1)
        distributed.observe_boundary(controller, step + 1, view)
    return result


def _own_gradients(optimizer: Any, params: list[torch.Tensor]) -> None:
    """Before a step's second micro-batch: every gradient in a buffer of its own. The first
    micro-batch's backward may have handed over tensors in the CUDA graphs' pool of a
    torch.compile(mode="reduce-overhead") model, which the next replay overwrites. A
    `TriAccelOptimizer` copies only what it did not allocate (nothing on a step it planned to
    split); any other optimizer gets a copy of every gradient, on steps of several micro-batches
    only."""
    own = getattr(optimizer, "own_gradients", None)
    if own is not None:
        own()
        return
    for p in params:
        if p.grad is not None:
            p.grad = p.grad.detach().clone()


class _SizedShard:
    """A `RankShard` that also records the sizes of this rank's part and of the whole step."""

    def __init__(self, shard: Any, n_local: list[int], n_step: list[int]) -> None:
        self._shard, self._n_local, self._n_step = shard, n_local, n_step

    def part(self, indices: np.ndarray) -> np.ndarray:
        mine = self._shard.part(indices)
        self._n_local[0], self._n_step[0] = len(mine), len(indices)
        return mine

    def micro(self, batch: int) -> int:
        return self._shard.micro(batch)

    def oom(self, micro: int) -> int:
        return self._shard.oom(micro)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)   # an FSDP gradient: this rank's slice
    return to_local() if to_local is not None else t


def _device(params: list[torch.Tensor]) -> torch.device:
    return params[0].device if params else torch.device("cpu")


def _tensor_layer(controller: Any, optimizer: Any, params: list[torch.Tensor]) -> np.ndarray:
    """(n_params,) the controller's layer of each parameter, for the noise measurement."""
    if hasattr(optimizer, "layer_index"):
        return optimizer.layer_index(params)
    if len(controller.layers) == 1:
        return np.zeros(len(params), dtype=np.int64)
    raise ValueError(f"optimizer: a {type(optimizer).__name__} cannot map parameters to the "
                     f"controller's {len(controller.layers)} layers; wrap it with triaccel.backends.torch.wrap")


def _host_copy(t: torch.Tensor) -> Callable[[], np.ndarray]:
    """`t`'s device->host copy, started now without waiting for the GPU; the returned call waits for
    the copy (a CUDA event) and gives the array. Off CUDA the copy is made at once."""
    if t.device.type != "cuda":
        host = t.detach().cpu().numpy().copy()
        return lambda: host
    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    buf.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def wait() -> np.ndarray:
        done.synchronize()
        return buf.numpy()

    return wait


def _observe_noise(controller: Any, step: int, params: list[torch.Tensor], report: ElasticStepReport[torch.Tensor],
                   sq: list[torch.Tensor], sqnorms: Any, scaler: Any, tensor_layer: np.ndarray,
                   distributed: Any = None, defer: Callable[[Callable[[], None]], None] | None = None) -> None:
    """The noise measurement of a split step: one device->host read, then the shared core.
    defer: the triaccel optimizer's `defer_noise`: the read starts now and is fed at its next flush
    (no wait for the GPU at this step); without it the step waits for the read. Data parallel:
    every rank calls it at the step (never deferred); the ranks' measurements are combined."""
    if distributed is not None and len(report.sizes) < 2:
        distributed.reduce_noise(report.sizes, None, len(params), step)   # the others wait for this rank's part
        return
    rows = torch.stack([*sq, sqnorms([p.grad for p in params])])
    if scaler is not None:
        one = torch.ones((), device=rows.device)
        rows = torch.cat([rows.reshape(-1), scaler.scale(one).float().reshape(1)])
    read = _host_copy(rows.double())
    sizes, weights, shape = list(report.sizes), list(report.weights), (len(sq) + 1, len(params))

    def feed() -> None:
        host, scale, measured = read(), 1.0, sizes   # waits for the copy (held to the next flush: long done)
        if scaler is not None:
            host, scale = host[:-1].reshape(shape), float(host[-1])
        if distributed is not None:
            got = distributed.reduce_noise(sizes, host, len(params), step)
            if got is None:
                return
            measured, host = got
        observe_split_step(controller, step, measured, weights, host, tensor_layer, scale)

    if distributed is None and defer is not None:
        defer(feed)
    else:
        feed()
