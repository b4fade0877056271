"""Framework-free half of memory-elastic batching: the epoch sampler and the OOM-retry step driver.

The control law (when and how the batch size changes) lives in `triaccel.batching` and the
`Controller`; this module only makes a changing batch size *safe*:

- `ElasticSampler` hands out the sample indices of an epoch in a seeded, deterministic order, in
  pieces of any size. Indices that have been taken but not yet completed are "in flight"; a step
  either completes them or puts them back (front of the queue), so every index of an epoch is
  completed exactly once whatever the batch sizes and failures were. Its `state_dict` resumes
  mid-epoch exactly (in-flight indices are saved as not done).
- `run_elastic_step` runs one optimizer step's logical batch as micro-batches, survives
  out-of-memory errors by shrinking at once and replaying the failed samples at the smaller size,
  and never runs a sample twice within the step nor skips one.

Both backends (`triaccel.backends.torch.data`, `triaccel.backends.jax.data`) plug their framework's
OOM test, memory release and micro-step into these two pieces.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterator, Sequence, TypeVar

import numpy as np

from .batching import OOMAtMinimumBatch, short_step_weight

__all__ = [
    "ElasticIndexLoader",
    "ElasticSampler",
    "ElasticStepOutcome",
    "ElasticStepReport",
    "OOMAtMinimumBatch",
    "run_elastic_step",
    "split_indices",
    "validate_batch_bounds",
    "check_batch_size",
    "controlled_step",
    "memory_pair",
    "noise_samples",
    "noise_split",
    "noise_take",
    "splits_for_noise",
    "step_weight",
]

T = TypeVar("T")


def check_batch_size(name: str, value: Any) -> int:
    """Return `value` as an int if it is a positive integer (bools refused), else ValueError."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name}={value!r}: must be a positive integer (allowed range [1, inf))")
    return int(value)


def validate_batch_bounds(num_samples: int, batch_min: int, batch_max: int | None = None) -> None:
    """ValueError when the batch bounds cannot fit a dataset of `num_samples` samples.

    A batch_min larger than the dataset could never be filled, so every step would be short and
    the law's lower bound meaningless; that is almost always a configuration mistake.
    """
    n = check_batch_size("num_samples", num_samples)
    lo = check_batch_size("batch_min", batch_min)
    if lo > n:
        raise ValueError(f"batch_min={lo} exceeds the dataset's num_samples={n}: allowed [1, {n}]")
    if batch_max is not None:
        hi = check_batch_size("batch_max", batch_max)
        if hi < lo:
            raise ValueError(f"batch_max={hi} is below batch_min={lo}: allowed [{lo}, inf)")


def split_indices(indices: np.ndarray, size: int) -> list[np.ndarray]:
    """Consecutive pieces of `indices` of `size` elements (the last may be shorter), order kept."""
    size = check_batch_size("size", size)
    return [indices[i:i + size] for i in range(0, len(indices), size)]


class ElasticSampler:
    """Seeded per-epoch permutation of `range(num_samples)`, consumed in pieces of any size.

    Epoch e's order is `np.random.default_rng(SeedSequence([seed, e])).permutation(num_samples)`
    (identity order when `shuffle=False`), so it depends only on (seed, epoch).

    Queue discipline: `take(n)` returns the next up-to-n indices of the current epoch (put-back
    indices first, in the order they were put back, then the permutation), and marks them in
    flight. `complete(idx)` retires in-flight indices; `put_back(idx)` returns in-flight indices
    to the front of the queue, to be replayed next. An epoch is finished once every index has been
    completed; `next_epoch()` only starts the next one then, so no index is ever lost.
    """

    def __init__(self, num_samples: int, seed: int = 0, *, shuffle: bool = True) -> None:
        self.num_samples = check_batch_size("num_samples", num_samples)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed={seed!r}: must be a non-negative integer (allowed [0, inf))")
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self._start_epoch(0)

    # -- epoch ------------------------------------------------------------------------------
    def permutation(self, epoch: int) -> np.ndarray:
        """The full sample order of `epoch` (int64, shape (num_samples,))."""
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, int(epoch)]))
        return rng.permutation(self.num_samples).astype(np.int64)

    def _start_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self._perm = self.permutation(self.epoch)
        self._perm.flags.writeable = False   # take() hands out views of it (see order_span)
        self.cursor = 0                       # next position in the permutation
        self._pending: deque[int] = deque()   # put-back indices, replayed before the permutation
        # taken, neither completed nor put back: a mask, so a step's check is one numpy gather
        # rather than a Python pass over its indices (the demo's steps are host-bound)
        self._flight = np.zeros(self.num_samples, dtype=bool)
        self._n_flight = 0
        self.completed = 0                    # indices of this epoch completed so far

    @property
    def remaining(self) -> int:
        """Indices of this epoch not yet handed out (put-back ones included)."""
        return len(self._pending) + self.num_samples - self.cursor

    @property
    def in_flight(self) -> int:
        """Indices taken and neither completed nor put back."""
        return self._n_flight

    @property
    def epoch_done(self) -> bool:
        """True once every index of the epoch has been completed."""
        return self.completed == self.num_samples

    def next_epoch(self) -> None:
        """Start the next epoch; ValueError if the current one still has unfinished indices."""
        if not self.epoch_done:
            raise ValueError(
                f"epoch={self.epoch} is not finished: {self.remaining} indices not handed out and "
                f"{self.in_flight} in flight; finishing it first keeps every sample exactly once")
        self._start_epoch(self.epoch + 1)

    # -- queue ------------------------------------------------------------------------------
    def take(self, n: int) -> np.ndarray:
        """The next up-to-n indices of this epoch (int64); fewer at the end, empty when none left.
        Without put-back indices the result is a read-only view of `order` (copy it to modify it)."""
        n = check_batch_size("n", n)
        out: list[int] = []
        while self._pending and len(out) < n:
            out.append(self._pending.popleft())
        k = min(n - len(out), self.num_samples - self.cursor)
        fresh = self._perm[self.cursor:self.cursor + k]
        self.cursor += k
        # no put-back index: a read-only view of the epoch order, which `order_span` recognises
        idx = np.concatenate([np.asarray(out, dtype=np.int64), fresh]) if out else fresh
        self._flight[idx] = True   # pending and fresh indices are never in flight: no overlap
        self._n_flight += int(idx.size)
        return idx

    @property
    def order(self) -> np.ndarray:
        """This epoch's whole sample order, (num_samples,) int64, read-only (a new array each epoch)."""
        return self._perm

    def order_span(self, indices: np.ndarray) -> tuple[int, int] | None:
        """(start, stop) when `indices` is `order[start:stop]` itself, a view of it (what `take`
        returns without put-back indices, and any contiguous slice of that), else None. Lets a
        backend index a device copy of the order instead of uploading each step's indices."""
        if not isinstance(indices, np.ndarray) or indices.base is not self._perm or indices.ndim != 1 \
                or indices.strides != (8,) or indices.dtype != np.int64:
            return None
        start = (indices.__array_interface__["data"][0] - self._perm.__array_interface__["data"][0]) // 8
        return int(start), int(start) + int(indices.size)

    def _retire(self, name: str, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Take `indices` out of flight (int64 array, order kept); ValueError, with nothing changed,
        when one is not in flight or appears twice."""
        if self.order_span(indices) is not None:   # a slice of a permutation: in range, no repeats
            held = self._flight[indices]
            if held.all():
                self._flight[indices] = False
                self._n_flight -= int(indices.size)
                return indices
        ids = np.asarray(indices, dtype=np.int64).reshape(-1)
        try:
            held = self._flight[ids]   # IndexError past the end; negatives are caught below
        except IndexError:
            held = None
        if held is None or not held.all() or (ids.size and ids.min() < 0):
            ok = (ids >= 0) & (ids < self.num_samples)
            bad = ids[~ok | ~self._flight[np.where(ok, ids, 0)]][:8].tolist()
            raise ValueError(f"{name}: indices {bad} are not in flight; only indices returned by take() "
                             "and not yet completed or put back are allowed")
        self._flight[ids] = False
        left = int(np.count_nonzero(self._flight))
        if self._n_flight - left != ids.size:   # fewer cleared than given: an index repeated
            self._flight[ids] = True
            raise ValueError(f"{name}: indices repeated; each in-flight index may be retired once")
        self._n_flight = left
        return ids

    def complete(self, indices: Sequence[int] | np.ndarray) -> None:
        """Retire in-flight indices: their samples have been used for this epoch."""
        self.completed += int(self._retire("complete(indices)", indices).size)

    def put_back(self, indices: Sequence[int] | np.ndarray) -> None:
        """Return in-flight indices to the front of the queue, order kept; take() replays them next."""
        self._pending.extendleft(reversed(self._retire("put_back(indices)", indices).tolist()))

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state. In-flight indices are saved as put back (not done), in sorted order.

        Save between steps, when nothing is in flight, to resume with the exact same order.
        """
        return {
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "pending": np.flatnonzero(self._flight).tolist() + list(self._pending),
            "completed": self.completed,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Resume from `state_dict()`; ValueError if it belongs to another dataset/seed/order."""
        for key in ("num_samples", "seed", "shuffle"):
            if sd[key] != getattr(self, key):
                raise ValueError(f"state_dict[{key!r}]={sd[key]!r} does not match this sampler's "
                                 f"{key}={getattr(self, key)!r}")
        cursor, pending = int(sd["cursor"]), [int(i) for i in sd["pending"]]
        completed = int(sd["completed"])
        if not 0 <= cursor <= self.num_samples:
            raise ValueError(f"state_dict['cursor']={cursor}: allowed [0, {self.num_samples}]")
        if completed + len(pending) + self.num_samples - cursor != self.num_samples:
            raise ValueError(
                f"state_dict is inconsistent: completed={completed} + pending={len(pending)} + "
                f"unread={self.num_samples - cursor} != num_samples={self.num_samples}")
        self._start_epoch(int(sd["epoch"]))
        self.cursor = cursor
        self._pending = deque(pending)
        self.completed = completed


@dataclass
class ElasticStepReport(Generic[T]):
    """What one elastic step did.

    outputs/weights/sizes: per successful micro-batch, in order: run_micro's return value, the
    weight it got (its sample count / the step's sample count; they sum to 1) and its size.
    ooms: out-of-memory errors survived; replayed: samples re-run after an OOM (counted once per
    retry); micro_batch: the micro-batch size in force at the end (after any shrink).
    """

    num_samples: int
    micro_batch: int
    outputs: list[T] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    ooms: int = 0
    replayed: int = 0
    step_samples: int | None = None   # the global step's samples when this is one rank's part

    def weighted_sum(self) -> Any:
        """Sum of weight x output over the micro-batches (framework scalars stay on the device); a
        step of one micro-batch (weight 1) gives its output itself, with no device op."""
        if len(self.outputs) == 1 and self.weights[0] == 1.0:
            return self.outputs[0]
        return sum(w * o for w, o in zip(self.weights, self.outputs))

    def mean_loss(self) -> float:
        """Sample-weighted mean of the outputs over the step, on the host (one sync)."""
        return float(self.weighted_sum())


@dataclass
class ElasticStepOutcome:
    """What both backends' `elastic_step` results hold besides their framework values.

    samples: samples in the step. micro_sizes: micro-batch sizes run, in order. ooms: OOMs survived
    in the step; replayed: samples re-run after them. decision: the controller decision the step
    started with. epoch / end_of_epoch: the samples' epoch and whether this step completed it.
    """

    samples: int
    micro_sizes: list[int]
    ooms: int
    replayed: int
    decision: Any
    epoch: int
    end_of_epoch: bool

    @staticmethod
    def fields(report: "ElasticStepReport[Any]", decision: Any, epoch: int) -> dict[str, Any]:
        """The common fields of a step that just finished (end_of_epoch set by the caller after)."""
        samples = report.num_samples if report.step_samples is None else report.step_samples
        return {"samples": samples, "micro_sizes": list(report.sizes), "ooms": report.ooms,
                "replayed": report.replayed, "decision": decision, "epoch": epoch, "end_of_epoch": False}


def run_elastic_step(
    indices: np.ndarray | Sequence[int],
    *,
    micro_batch: int,
    run_micro: Callable[[np.ndarray, float], T],
    is_oom: Callable[[BaseException], bool],
    on_oom: Callable[[], int],
    free_memory: Callable[[], None] = lambda: None,
) -> ElasticStepReport[T]:
    """Run the logical batch `indices` as micro-batches of `micro_batch`, surviving OOMs.

    run_micro(chunk, weight): forward+backward over the samples `chunk` (int64 array), with the
      loss scaled by `weight` = len(chunk) / len(indices), so that summed gradients equal the
      gradient of the mean loss over the whole logical batch. It must leave no trace of a chunk
      that raises (the backends make sure of that).
    is_oom(exc): True only for the framework's out-of-memory error; anything else propagates.
    on_oom(): the controller's immediate shrink; returns the new micro-batch size. It raises
      `OOMAtMinimumBatch` when already at batch_min.
    free_memory(): releases cached memory; called after the except block has been left, since the
      exception's traceback frames keep the failed step's tensors alive.

    Exactly-once by construction: a chunk leaves the work queue only when run_micro returns; a
    failed chunk and every chunk not run yet are re-split at the new size and stay at the front of
    the queue, order kept. Chunks already done are kept.
    """
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size == 0:
        raise ValueError("indices: empty; a step needs at least one sample")
    micro = check_batch_size("micro_batch", micro_batch)
    total = int(idx.size)
    report: ElasticStepReport[T] = ElasticStepReport(num_samples=total, micro_batch=micro)
    queue: deque[np.ndarray] = deque(split_indices(idx, micro))
    while queue:
        chunk = queue[0]
        failed_msg: str | None = None
        try:
            out = run_micro(chunk, len(chunk) / total)
        except Exception as exc:  # noqa: BLE001 - re-raised unless it is an OOM
            if not is_oom(exc):
                raise
            failed_msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        # Out of the except block: the exception and its frames (holding the failed chunk's
        # activations) are gone, so free_memory can actually return that memory.
        if failed_msg is None:
            queue.popleft()
            report.outputs.append(out)
            report.weights.append(len(chunk) / total)
            report.sizes.append(len(chunk))
            continue
        report.ooms += 1
        free_memory()
        new = on_oom()
        new = check_batch_size("on_oom() result", new)
        if new >= micro:
            # No smaller size to retry with: the same chunk would fail the same way forever.
            raise OOMAtMinimumBatch(
                f"out of memory on a micro-batch of {len(chunk)} samples and the batch cannot "
                f"shrink below {new}: lower batch_min or the model/input size ({failed_msg})")
        micro = min(new, micro)
        rest = np.concatenate(list(queue))
        report.replayed += len(chunk)
        queue = deque(split_indices(rest, micro))
    report.micro_batch = micro
    return report



def memory_pair(reading: Any) -> tuple[int, int] | None:
    """(used_bytes, limit_bytes) from a probe reading, or None when there is no reading.

    Accepts the torch probe's `MemoryReading` (used_bytes, limit_bytes), the JAX probe's
    `MemorySample` (used, limit) or a plain (used, limit) pair, so that both backends feed
    `Controller.observe_memory` the same way.
    """
    if reading is None:
        return None
    if isinstance(reading, tuple):
        used, limit = reading
    elif hasattr(reading, "used_bytes"):
        used, limit = reading.used_bytes, reading.limit_bytes
    else:
        used, limit = reading.used, reading.limit
    return int(used), int(limit)


class ElasticIndexLoader:
    """Framework-free bookkeeping of an elastic loader; backends subclass it and add `fetch`.

    Holds the `ElasticSampler`, the micro-batch size (`batch_size`) and the logical batch
    (`logical_batch`, samples per optimizer step; equal to batch_size unless accumulating), both
    changeable between any two steps (`set_batch_size` or `apply(decision)`), and counts what the
    elastic steps did (`stats`). Subclasses implement `fetch(indices) -> batch`.
    """

    def __init__(self, num_samples: int, *, batch_size: int, seed: int = 0, shuffle: bool = True) -> None:
        self.sampler = ElasticSampler(num_samples, seed, shuffle=shuffle)
        self.batch_size = check_batch_size("batch_size", batch_size)
        self.logical_batch = self.batch_size
        self.stats: dict[str, int] = {"steps": 0, "samples": 0, "ooms": 0, "replayed": 0}
        self.end_of_epoch = False   # True right after the step that completed an epoch

    def __len__(self) -> int:
        return self.sampler.num_samples

    @property
    def num_samples(self) -> int:
        return self.sampler.num_samples

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def fetch(self, indices: np.ndarray) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- batch size -------------------------------------------------------------------------
    def set_batch_size(self, batch_size: int, logical_batch: int | None = None) -> None:
        """Micro-batch size (samples) from the next step on; logical_batch defaults to it."""
        self.batch_size = check_batch_size("batch_size", batch_size)
        self.logical_batch = (self.batch_size if logical_batch is None
                              else check_batch_size("logical_batch", logical_batch))

    def apply(self, decision: Any) -> None:
        """Take batch_size and logical_batch from a controller `Decision`."""
        self.set_batch_size(decision.batch_size, decision.logical_batch)

    def check_bounds(self, batch_min: int, batch_max: int | None = None) -> None:
        """ValueError when [batch_min, batch_max] cannot fit this dataset (see validate_batch_bounds)."""
        validate_batch_bounds(self.num_samples, batch_min, batch_max)

    # -- indices ----------------------------------------------------------------------------
    @property
    def left_for_next(self) -> int:
        """Indices the next steps can still take from their epoch: this epoch's remaining ones, or a
        whole epoch once this one is complete (`next_indices` starts the next one then)."""
        return self.sampler.num_samples if self.sampler.epoch_done else self.sampler.remaining

    def next_indices(self, n: int | None = None) -> np.ndarray:
        """Take the next step's indices (default: `logical_batch` of them; fewer at an epoch's end).

        Starts the next epoch first when the current one is complete, so a step never spans
        two epochs.
        """
        if self.sampler.epoch_done:
            self.sampler.next_epoch()
        idx = self.sampler.take(self.logical_batch if n is None else n)
        if idx.size == 0:
            raise ValueError(f"next_indices: epoch {self.epoch} has no indices left to hand out while "
                             f"{self.sampler.in_flight} are in flight; complete or put them back first")
        self.end_of_epoch = False
        return idx

    def complete(self, indices: np.ndarray, report: ElasticStepReport[Any] | None = None) -> None:
        """The step over `indices` succeeded: retire them and count it."""
        self.sampler.complete(indices)
        self.end_of_epoch = self.sampler.epoch_done
        self.stats["steps"] += 1
        self.stats["samples"] += int(len(indices))
        if report is not None:
            self.stats["ooms"] += report.ooms
            self.stats["replayed"] += report.replayed

    def put_back(self, indices: np.ndarray) -> None:
        """The step over `indices` failed: they are replayed first by the next step."""
        self.sampler.put_back(indices)

    def __iter__(self) -> Iterator[Any]:
        """Plain pass over the rest of the current epoch at the current batch_size (no OOM retry).

        A batch counts as used once the consumer asks for the next one; breaking out puts the
        last one back. Useful for evaluation; training goes through the backend's elastic_step.
        """
        if self.sampler.epoch_done:
            self.sampler.next_epoch()
        while self.sampler.remaining:
            idx = self.sampler.take(self.batch_size)
            try:
                yield self.fetch(idx)
            except GeneratorExit:
                self.put_back(idx)
                raise
            self.complete(idx)

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-safe: sampler position (mid-epoch exact), batch sizes and counters."""
        return {"sampler": self.sampler.state_dict(), "batch_size": self.batch_size,
                "logical_batch": self.logical_batch, "stats": dict(self.stats),
                "end_of_epoch": self.end_of_epoch}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sampler.load_state_dict(sd["sampler"])
        self.set_batch_size(sd["batch_size"], sd["logical_batch"])
        self.stats = {k: int(v) for k, v in sd["stats"].items()}
        self.end_of_epoch = bool(sd["end_of_epoch"])


R = TypeVar("R")


def _noise_kind(controller: Any) -> str:
    return getattr(getattr(controller, "config", None), "noise_split", "halves")


def splits_for_noise(controller: Any, step: int) -> bool:
    """`step` is a gradient-noise step run as two micro-batches (`Controller.is_noise_step` on the
    decision in force; not under noise_split="steps", whose noise step runs whole at half the batch)."""
    return controller.is_noise_step(step) and _noise_kind(controller) != "steps"


def noise_split(controller: Any, step: int) -> int:
    """Micro-batches `step` must run as: 2 at the controller's gradient-noise steps
    (`Controller.is_noise_step`, taken on the decision the step will run under), else 1 (also under
    noise_split="steps", whose noise step runs whole: `noise_samples`). Both backends'
    `elastic_step` call it before the step, so they know to record per-micro norms."""
    is_noise_step = getattr(controller, "is_noise_step", None)
    if is_noise_step is None:
        return 1
    controller.decide(step)   # idempotent for a step: the decision the step will run under
    return 2 if splits_for_noise(controller, step) else 1


def noise_samples(controller: Any, step: int) -> int | None:
    """Samples `step` takes under noise_split="steps" at a gradient-noise step: half the decided
    logical batch, rounded up (the halves' first half: the same micro-batch shape), run as an
    optimizer step of its own; None for every other step and split (the step takes its logical batch)."""
    is_noise_step = getattr(controller, "is_noise_step", None)
    if is_noise_step is None or _noise_kind(controller) != "steps":
        return None
    d = controller.decide(step)
    return -(-d.logical_batch // 2) if is_noise_step(step) else None


def noise_take(controller: Any, split: int) -> int:
    """Logical batches a step of `split` micro-batches (`noise_split`) takes from the loader: 2 for a
    noise step under the controller's noise_split="double" (two micro-batches of the decided size,
    no half-size shape), else 1."""
    cfg = getattr(controller, "config", None)
    return 2 if split > 1 and getattr(cfg, "noise_split", "halves") == "double" else 1


def step_weight(controller: Any, samples: int, decision: Any, take: int = 1) -> float:
    """The gradient weight of a step of `samples` real samples (the whole step's, all ranks) taken
    under `decision`: `triaccel.batching.short_step_weight` by the controller's `short_step_lr`
    against the step's logical batch, `take` x `decision.logical_batch` (`noise_take`: a doubled
    noise step's 2B samples weigh 1, its mean gradient at B's LR); 1.0 for a controller without a
    config. Both backends' `elastic_step` apply it before the update (torch: to the summed
    gradients; JAX: passed to `step_fn`, or to the summed gradients before `update_fn`)."""
    rule = getattr(getattr(controller, "config", None), "short_step_lr", "batch")
    if rule == "batch":
        return 1.0
    return short_step_weight(rule, int(samples), int(take) * int(decision.logical_batch))


def controlled_step(
    loader: ElasticIndexLoader,
    controller: Any,
    step: int,
    *,
    run_micro: Callable[[np.ndarray, float], T],
    finish: Callable[[Any, ElasticStepReport[T]], R],
    is_oom: Callable[[BaseException], bool],
    free_memory: Callable[[], None],
    read_memory: Callable[[], tuple[int, int] | None] | None = None,
    split: int = 1,
    take: int = 1,
    local: Any = None,
) -> R:
    """One optimizer step under the controller, shared by the torch and JAX `elastic_step`.

    decide(step) -> the loader applies the decision -> the step's indices -> `run_elastic_step`
    (OOM -> `controller.observe_oom(step)`, replay at the new size) -> `finish(decision, report)`
    (the backend's optimizer update; `decision` is the one in force when the step started, whose
    lr_batch_scale matches the samples actually used) -> indices completed -> memory observed.
    If anything raises, the step's indices are put back (replayed first next time) and the error
    propagates, so no sample is lost. split: run the step as at least that many micro-batches
    (the gradient noise measurement's two halves, `Controller.is_noise_step`). take: the step takes
    that many logical batches (`noise_take`: 2 for a noise step under noise_split="double"), run as
    micro-batches of take x the decided size / split (a backend that halves the step inside its own
    program passes split=1 and gets it as one micro-batch). Under noise_split="steps" a noise step
    takes half the decided batch (`noise_samples`) and every step reports what it runs
    (`Controller.observe_step_samples`, before it runs) for the pairing of its statistics row.
    local: a `triaccel.distributed.RankShard` under data parallelism: the step's (global) indices
    are the same on every rank, this rank runs its part at its micro-batch, and an OOM shrinks
    this rank only (the controllers of all ranks shrink together at the next boundary).
    """
    cfg = getattr(controller, "config", None)
    if cfg is not None and not getattr(loader, "_bounds_checked", False):
        loader.check_bounds(cfg.batch_min, cfg.batch_max)
        loader._bounds_checked = True  # type: ignore[attr-defined]
    decision = controller.decide(step)
    loader.apply(decision)
    if take < 1 or (take > 1 and getattr(decision, "accumulation", 1) != 1):
        raise ValueError(f"take={take}: allowed 1, or > 1 for a step of one micro-batch per logical batch "
                         f"(the decision accumulates {getattr(decision, 'accumulation', 1)})")
    half = noise_samples(controller, step)   # noise_split="steps": half the batch, as a step of its own
    idx = loader.next_indices(half if half is not None else None if take == 1 else take * loader.logical_batch)
    mine = idx if local is None else local.part(idx)
    micro = decision.batch_size if local is None else local.micro(decision.batch_size)
    parts = split if split > 1 and len(mine) >= split else 1
    if take > 1:   # take batches as `parts` micro-batches: of the decided size when split == take
        micro = micro * take // parts
    if parts > 1:
        micro = min(micro, -(-len(mine) // parts))
    cur = [micro]
    if _noise_kind(controller) == "steps":
        # what the step runs, for its statistics row's noise pair: before it runs, as a backend may
        # hand its row over inside the step (torch, when its ring fills)
        controller.observe_step_samples(step, len(idx), decision.logical_batch, half is not None)

    def on_oom() -> int:
        # A split step keeps its split at the shrunken size, so each retry is strictly smaller.
        if local is not None:
            cur[0] = -(-local.oom(cur[0] * parts) // parts)
            return cur[0]
        return -(-controller.observe_oom(step).batch_size // parts)

    try:
        if len(mine):
            report = run_elastic_step(
                mine, micro_batch=micro, run_micro=run_micro, is_oom=is_oom,
                on_oom=on_oom, free_memory=free_memory)
        else:   # an epoch's last step with fewer samples than ranks: this rank only takes part in the sync
            report = ElasticStepReport(num_samples=0, micro_batch=micro)
        if local is not None:
            report.step_samples = int(len(idx))
        result = finish(decision, report)
    except BaseException:
        loader.put_back(idx)
        loader.apply(controller.decision)
        raise
    loader.complete(idx, report)
    loader.apply(controller.decision)   # an OOM may have shrunk it mid-step
    mem = read_memory() if read_memory is not None else None
    if mem is not None:
        controller.observe_memory(step, *mem)
    return result
