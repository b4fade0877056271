"""Rank-consistent rules for data-parallel training: one set of decisions on every rank.

Every rank runs its own `Controller`; they stay identical because they are fed identical numbers.
This module says how the ranks' readings combine (framework-free; the torch backend moves the
numbers, `triaccel.backends.torch.distributed`):

- Once per control boundary each rank packs what its controller reads (`pack_boundary`: the
  gradient-statistics ring, the loss scale, its memory reading, its count of local OOMs) into one
  float64 vector; one all-gather gives every rank every vector, and `combine_boundary` reduces
  them the same way on every rank: moments summed when the gradients are sharded (FSDP: each rank
  holds a slice) or averaged when they are replicated (DDP: all equal), the smallest loss scale,
  the tightest rank's memory (highest used fraction of its limit, ties to the least headroom), and
  the largest OOM count.
- The elastic batch is global: a step's indices are the same on every rank and rank r trains on
  `rank_part(indices, world, r)`; a batch size must divide by the world size
  (`check_world_divides`, `per_rank_batch`).
- An OOM is survived where it happens: `RankShard` lowers that rank's micro-batch at once and the
  rank replays its failed samples inside the same step (other ranks are not waiting on it: their
  micro-batches run without collectives). At the next boundary every rank applies the largest OOM
  count to its controller, so the global batch shrinks on all ranks at the same step.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .batching import OOMAtMinimumBatch, resolve_memory_limit

__all__ = [
    "BoundaryView", "OOMNotReplayable", "RankShard", "check_rank", "check_world_divides",
    "combine_boundary", "combine_eigvals", "combine_noise", "decision_digest", "pack_boundary",
    "per_rank_batch", "rank_part", "tightest_memory",
]


class OOMNotReplayable(RuntimeError):
    """Out of memory on one rank while the step's collectives cannot be replayed (FSDP: forward and
    backward gather and scatter parameters with the other ranks, which wait inside them)."""


def _int(name: str, value: Any, lo: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < lo:
        raise ValueError(f"{name}={value!r}: must be an integer >= {lo}")
    return int(value)


def check_rank(rank: int, world_size: int) -> tuple[int, int]:
    """(rank, world_size) as ints; ValueError unless world_size >= 1 and 0 <= rank < world_size."""
    w = _int("world_size", world_size, 1)
    r = _int("rank", rank, 0)
    if r >= w:
        raise ValueError(f"rank={r}: allowed [0, {w - 1}] for world_size={w}")
    return r, w


def per_rank_batch(global_batch: int, world_size: int) -> int:
    """Samples per rank of a global batch; ValueError when `world_size` does not divide it."""
    b = _int("global_batch", global_batch, 1)
    w = _int("world_size", world_size, 1)
    if b % w:
        raise ValueError(f"global_batch={b}: must be a multiple of world_size={w} (each rank trains on "
                         f"global_batch / world_size samples)")
    return b // w


def check_world_divides(config: Any, world_size: int) -> None:
    """ValueError naming the field when a batch size the controller can choose does not divide by
    `world_size`: batch_init, and batch_buckets when given, else batch_min and batch_multiple (the
    grid is batch_min + i * batch_multiple). An OOM shrink lands on the same grid."""
    w = _int("world_size", world_size, 1)
    fields: list[tuple[str, Any]] = [("batch_init", config.batch_init)]
    if config.batch_buckets is not None:
        fields += [("batch_buckets", b) for b in config.batch_buckets]
    else:
        fields += [("batch_min", config.batch_min), ("batch_multiple", config.batch_multiple)]
    for name, v in fields:
        if v % w:
            raise ValueError(f"{name}={getattr(config, name)!r}: every batch size must be a multiple of the "
                             f"world size {w} (the global batch is split evenly across ranks)")


def rank_part(indices: np.ndarray | Sequence[int], world_size: int, rank: int) -> np.ndarray:
    """Rank `rank`'s contiguous part of a global step's indices (int64). Parts differ in size by at
    most one (an epoch's last step need not divide); they cover `indices` once, order kept."""
    r, w = check_rank(rank, world_size)
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    n = idx.size
    lo, hi = (n * r) // w, (n * (r + 1)) // w
    return idx[lo:hi]


class RankShard:
    """One rank's view of the global elastic step: its part of the indices, its micro-batch size and
    the OOMs it survived since the last boundary.

    `micro(batch)`: the rank's micro-batch for a global `batch`: batch / world_size, capped by the
    size an OOM forced on this rank (the cap goes once the per-rank batch is within it).
    `oom(micro)`: the rank's immediate shrink (the config's `oom_shrink`), counted in `pending_ooms`
    for the next boundary; raises `OOMNotReplayable` when `replayable` is False.
    `take_ooms()`: the pending count, reset (the boundary exchange sends it).
    """

    def __init__(self, rank: int, world_size: int, oom_shrink: float = 0.5, *, replayable: bool = True) -> None:
        self.rank, self.world_size = check_rank(rank, world_size)
        if not (isinstance(oom_shrink, (int, float)) and 0 < oom_shrink < 1):
            raise ValueError(f"oom_shrink={oom_shrink!r}: allowed (0, 1)")
        self.oom_shrink = float(oom_shrink)
        self.replayable = bool(replayable)
        self.cap: int | None = None
        self.pending_ooms = 0
        self.total_ooms = 0

    def part(self, indices: np.ndarray | Sequence[int]) -> np.ndarray:
        return rank_part(indices, self.world_size, self.rank)

    def micro(self, batch: int) -> int:
        per = per_rank_batch(batch, self.world_size)
        if self.cap is not None and per <= self.cap:
            self.cap = None
        return per if self.cap is None else self.cap

    def oom(self, micro: int) -> int:
        """Out of memory at micro-batch `micro` on this rank: the smaller size to replay with."""
        if not self.replayable:
            raise OOMNotReplayable(
                f"rank {self.rank}: out of memory in a step whose collectives cannot be replayed on one rank "
                "(FSDP gathers parameters inside forward and backward); lower the batch or memory_budget, "
                "or use DistributedDataParallel, whose steps are replayable")
        m = _int("micro", micro, 1)
        new = math.floor(m * self.oom_shrink)
        if new < 1:
            raise OOMAtMinimumBatch(f"rank {self.rank}: out of memory on a micro-batch of {m} sample(s); "
                                    "nothing smaller exists")
        self.cap = new
        self.pending_ooms += 1
        self.total_ooms += 1
        return new

    def take_ooms(self) -> int:
        n, self.pending_ooms = self.pending_ooms, 0
        return n


# -- the boundary exchange --------------------------------------------------------------------
_HEAD = 5   # n_rows, loss scale (nan: none), used bytes, limit bytes (nan: no reading), local OOMs


def pack_boundary(ring: np.ndarray | None, loss_scale: float | None, memory: tuple[int, int] | None,
                  ooms: int) -> np.ndarray:
    """One rank's boundary vector (float64): header + the (n, T, 3) statistics ring, flattened.

    ring: per-tensor (sum, sum of squares, non-finite count) rows since the last exchange, or None
    (a loop without statistics). memory: (used, limit) bytes or None. ooms: OOMs since the last
    exchange. Ranks exchange vectors of equal length (same rows, same tensors)."""
    r = np.zeros((0,), dtype=np.float64) if ring is None else np.asarray(ring, dtype=np.float64)
    n = 0 if ring is None else r.shape[0]
    used, limit = (math.nan, math.nan) if memory is None else (float(memory[0]), float(memory[1]))
    head = [float(n), math.nan if loss_scale is None else float(loss_scale), used, limit,
            float(_int("ooms", ooms, 0))]
    return np.concatenate([np.asarray(head, dtype=np.float64), r.reshape(-1)])


@dataclass(frozen=True)
class BoundaryView:
    """What every rank feeds its controller after an exchange (identical on every rank).

    ring: (n, T, 3) combined statistics, or None. loss_scale: the smallest rank's, or None.
    memory: the tightest rank's (used, limit) bytes, or None. ooms: the largest rank's OOM count.
    memory_rank: which rank that reading came from (None without one)."""

    ring: np.ndarray | None
    loss_scale: float | None
    memory: tuple[int, int] | None
    memory_rank: int | None
    ooms: int


def tightest_memory(readings: Sequence[tuple[int, int] | None],
                    budget: int | None = None) -> tuple[int | None, tuple[int, int] | None]:
    """(rank, (used, limit)) of the rank nearest its MemMax: the highest used / min(limit, budget),
    ties to the smallest headroom, then the lowest rank. (None, None) when no rank has a reading."""
    best: tuple[float, float, int] | None = None
    for r, m in enumerate(readings):
        if m is None:
            continue
        used, limit = m
        cap = resolve_memory_limit(budget, int(limit))
        assert cap is not None
        key = (-used / cap, cap - used, r)
        if best is None or key < best:
            best = key
    if best is None:
        return None, None
    r = best[2]
    m = readings[r]
    assert m is not None
    return r, (int(m[0]), int(m[1]))


def combine_boundary(gathered: np.ndarray, n_tensors: int, *, sharded: bool,
                     budget: int | None = None) -> BoundaryView:
    """Reduce the (W, D) rows of `pack_boundary` vectors, the same way on every rank.

    sharded: the ring holds each rank's slice of every gradient (summed), else a replica (averaged;
    non-finite counts: the largest). budget: the config's memory_budget in bytes (None: none)."""
    g = np.asarray(gathered, dtype=np.float64)
    if g.ndim != 2 or g.shape[1] < _HEAD:
        raise ValueError(f"gathered: expected (world, >= {_HEAD}) boundary vectors, got shape {g.shape}")
    n_rows = g[:, 0]
    if not (n_rows == n_rows[0]).all():
        raise ValueError(f"gathered: ranks sent different numbers of statistics rows {n_rows.tolist()}; "
                         "every rank must reach the same boundaries (the same optimizer steps)")
    n = int(n_rows[0])
    want = _HEAD + n * n_tensors * 3
    if g.shape[1] != want:
        raise ValueError(f"gathered: vectors of {g.shape[1]} values, expected {want} for {n} rows of "
                         f"{n_tensors} tensors")
    ring = None
    if n:
        rings = g[:, _HEAD:].reshape(g.shape[0], n, n_tensors, 3)
        if sharded:
            ring = rings.sum(axis=0)
        else:
            ring = rings.mean(axis=0)
            ring[..., 2] = rings[..., 2].max(axis=0)
    scales = g[:, 1][np.isfinite(g[:, 1])]
    scale = float(scales.min()) if scales.size else None
    readings = [None if not (np.isfinite(u) and np.isfinite(lim)) else (int(u), int(lim))
                for u, lim in g[:, 2:4]]
    rank, mem = tightest_memory(readings, budget)
    return BoundaryView(ring=ring, loss_scale=scale, memory=mem, memory_rank=rank, ooms=int(g[:, 4].max()))


def combine_noise(sizes: np.ndarray, rows: np.ndarray, *, sharded: bool) -> tuple[list[int], np.ndarray] | None:
    """The gradient-noise measurement every rank observes, from each rank's split step.

    sizes: (W, k) micro-batch sizes per rank; rows: (W, k + 1, T) squared norms per tensor (see
    `triaccel.noise.observe_split_step`). Replicated (DDP, norms of each rank's local gradients):
    rows averaged, sizes the per-rank ones (the mean of unbiased estimates at the same sizes).
    Sharded (FSDP, norms of each rank's slice of the already-reduced gradients): rows summed,
    sizes x W (global micro-batches). None when the ranks' sizes differ (an epoch's uneven last
    step): every rank then skips the measurement."""
    s = np.asarray(sizes, dtype=np.int64)
    q = np.asarray(rows, dtype=np.float64)
    if s.ndim != 2 or q.ndim != 3 or q.shape[:2] != (s.shape[0], s.shape[1] + 1):
        raise ValueError(f"sizes, rows: expected (W, k) and (W, k + 1, T), got {s.shape} and {q.shape}")
    if not (s == s[0]).all():
        return None
    if sharded:
        return [int(x) * s.shape[0] for x in s[0]], q.sum(axis=0)
    return [int(x) for x in s[0]], q.mean(axis=0)


def combine_eigvals(eigvals: np.ndarray) -> np.ndarray:
    """(L, k) curvature eigenvalues every rank observes: the mean over ranks of (W, L, k) (each rank
    measured its own curvature batch); non-finite where any rank's value is (then skipped)."""
    e = np.asarray(eigvals, dtype=np.float64)
    if e.ndim != 3:
        raise ValueError(f"eigvals: expected (world, layers, top_k), got shape {e.shape}")
    return e.mean(axis=0)


def decision_digest(records: Sequence[dict[str, Any]]) -> str:
    """SHA-256 of a controller's decision records (telemetry), to check that ranks agree: equal
    digests mean equal trajectories (every decision, every observed statistic they record)."""
    h = hashlib.sha256()
    for r in records:
        h.update(json.dumps(r, sort_keys=True, default=str).encode())
    return h.hexdigest()
