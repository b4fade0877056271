"""Activation swap planner (after AccUDNN): which units keep, swap to host or recompute their saved
activations so that a batch fits a VRAM budget, from a cost table measured at run time.

Framework-free: the backends measure the table (`backends/torch/offload.py`) and apply the plan
(torch: pinned host buffers on side streams and `torch.utils.checkpoint`; JAX: a `jax.checkpoint`
offload policy).

A *unit* is a contiguous block of the forward pass (a ResNet block, say), in forward order. The
step is modelled as a sequence: forward of units 0..L-1 on the compute stream, then backward of
L-1..0, then `other_ms` (loss, optimizer). A swapped unit's saved bytes go device->host on a copy
stream right after its forward (freeing device memory when the copy ends) and come back on a
second copy stream, issued "as late as possible" so that each transfer ends when its unit's
backward starts (`prefetch_at`); the compute stream waits only when a transfer is late (exposed
time). A recomputed unit keeps only its inputs and runs its forward again before its backward;
"recompute_swap" recomputes too, and its inputs go to host memory meanwhile (copied out when its
forward starts, prefetched back like a swapped unit's activations): for deep models whose kept
block inputs alone break the budget under recompute.

Units: bytes, milliseconds, bytes per second, samples.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .batching import BatchLaw
from .config import TriAccelConfig

__all__ = ["ACTIONS", "RECOMPUTING", "SWAPPING", "LayerCost", "CostTable", "CostModel", "SwapPlan", "simulate",
           "plan_for_budget", "ThroughputBound", "throughput_bound", "largest_fitting", "BatchChoice", "choose_batch",
           "scale_plan", "OffloadPlanner"]

ACTIONS = ("keep", "swap", "recompute", "recompute_swap")
SWAPPING = frozenset(("swap", "recompute_swap"))        # actions whose unit copies to host and back
RECOMPUTING = frozenset(("recompute", "recompute_swap"))  # actions whose unit reruns its forward
_EPS_MS = 1e-6  # exposed time below this counts as hidden (a ratio's denominator floor)


def _nonneg_int(name: str, v: object) -> None:
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
        raise ValueError(f"{name}={v!r} is invalid: allowed an integer >= 0 (bytes)")


def _nonneg_real(name: str, v: object) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    if not ok:
        raise ValueError(f"{name}={v!r} is invalid: allowed a finite real number >= 0")


@dataclass(frozen=True)
class LayerCost:
    """Costs of one unit at its table's batch.

    saved_bytes: device bytes its forward leaves saved for backward (what swapping or recomputing
      frees). forward_ms / backward_ms: compute time. input_bytes: bytes a recompute keeps (its
      inputs). transfer_bytes: bytes copied each way when swapped (None: saved_bytes; larger when the
      same storage is saved twice). recompute_ms: extra time of a recompute (None: forward_ms).
      shared_bytes: of saved_bytes, the bytes of inputs that the previous unit saves too (a block's
      input is its predecessor's output): on the device while either unit holds them; at most
      input_bytes and the previous unit's saved_bytes, 0 for the first unit.
    """

    name: str
    saved_bytes: int
    forward_ms: float
    backward_ms: float
    input_bytes: int = 0
    transfer_bytes: int | None = None
    recompute_ms: float | None = None
    shared_bytes: int = 0

    def __post_init__(self) -> None:
        _nonneg_int("saved_bytes", self.saved_bytes)
        _nonneg_int("input_bytes", self.input_bytes)
        _nonneg_int("shared_bytes", self.shared_bytes)
        if self.transfer_bytes is not None:
            _nonneg_int("transfer_bytes", self.transfer_bytes)
        _nonneg_real("forward_ms", self.forward_ms)
        _nonneg_real("backward_ms", self.backward_ms)
        if self.recompute_ms is not None:
            _nonneg_real("recompute_ms", self.recompute_ms)

    @property
    def copy_bytes(self) -> int:
        return self.saved_bytes if self.transfer_bytes is None else self.transfer_bytes

    @property
    def remat_ms(self) -> float:
        return self.forward_ms if self.recompute_ms is None else self.recompute_ms

    def moved_bytes(self, action: str) -> int:
        """Bytes copied each way under `action`: the saved activations ("swap"), the inputs a
        recompute keeps ("recompute_swap"), else 0."""
        if action == "swap":
            return self.copy_bytes
        return self.input_bytes if action == "recompute_swap" else 0


@dataclass(frozen=True)
class CostTable:
    """One measured step at `batch` samples.

    layers: the units in forward order. d2h_bytes_per_s / h2d_bytes_per_s: measured copy bandwidth
    between device and pinned host memory (> 0). static_bytes: device memory that does not scale
    with the batch (weights, gradients, optimizer state). transient_bytes: the rest of the measured
    peak, i.e. peak - static_bytes - resident_bytes (workspaces, activation gradients); it scales
    with the batch. other_ms: step time outside the units (loss, optimizer step). With these,
    `simulate(table, all "keep").peak_bytes` is the measured peak.
    """

    batch: int
    layers: tuple[LayerCost, ...]
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    static_bytes: int = 0
    transient_bytes: int = 0
    other_ms: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not (isinstance(self.batch, int) and not isinstance(self.batch, bool) and self.batch >= 1):
            raise ValueError(f"batch={self.batch!r} is invalid: allowed an integer >= 1 (samples)")
        if not self.layers or not all(isinstance(x, LayerCost) for x in self.layers):
            raise ValueError(f"layers={self.layers!r} is invalid: allowed a non-empty sequence of LayerCost")
        for name in ("d2h_bytes_per_s", "h2d_bytes_per_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name}={v!r} is invalid: allowed a finite real number > 0 (bytes/s)")
        _nonneg_int("static_bytes", self.static_bytes)
        if not isinstance(self.transient_bytes, int) or isinstance(self.transient_bytes, bool):
            raise ValueError(f"transient_bytes={self.transient_bytes!r} is invalid: allowed an integer (bytes)")
        _nonneg_real("other_ms", self.other_ms)
        ls = self.layers
        for i, x in enumerate(ls):
            nxt = ls[i + 1].shared_bytes if i + 1 < len(ls) else 0
            ok = x.shared_bytes <= x.input_bytes and x.shared_bytes + nxt <= x.saved_bytes
            ok = ok and (x.shared_bytes == 0 if i == 0 else x.shared_bytes <= ls[i - 1].saved_bytes)
            if not ok:
                raise ValueError(
                    f"layers[{i}].shared_bytes={x.shared_bytes} is invalid: allowed 0 for the first unit, else at "
                    "most its input_bytes and the previous unit's saved_bytes, with shared_bytes + the next "
                    "unit's shared_bytes at most its saved_bytes")

    @property
    def saved_bytes(self) -> int:
        return sum(x.saved_bytes for x in self.layers)

    @property
    def resident_bytes(self) -> int:
        """Device bytes of all units' saved tensors at once with no plan: each tensor once, i.e.
        sum(saved_bytes) less the shared_bytes that two neighbours both count."""
        return self.saved_bytes - sum(x.shared_bytes for x in self.layers)

    @staticmethod
    def transient_from_peak(peak_bytes: int, static_bytes: int, layers: Sequence[LayerCost]) -> int:
        """transient_bytes of a table whose no-plan step peaked at `peak_bytes` (bytes) over
        `static_bytes`: the peak less static and less the resident saved bytes of `layers` (shared
        bytes once: subtracting sum(saved_bytes) would count a block's input, saved by it and by
        its predecessor, twice, and every modelled peak would then fall short by those bytes)."""
        resident = sum(x.saved_bytes - x.shared_bytes for x in layers)
        return int(peak_bytes) - int(static_bytes) - resident

    def to_dict(self) -> dict:
        """JSON-safe; `CostTable.from_dict` rebuilds it."""
        return {**{k: getattr(self, k) for k in ("batch", "d2h_bytes_per_s", "h2d_bytes_per_s", "static_bytes",
                                                 "transient_bytes", "other_ms")},
                "layers": [dict(x.__dict__) for x in self.layers]}

    @classmethod
    def from_dict(cls, d: dict) -> "CostTable":
        return cls(**{**d, "layers": tuple(LayerCost(**x) for x in d["layers"])})

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(x.name for x in self.layers)


def _affine(y1: float, y2: float, b1: int, b2: int, b: int) -> float:
    """y(b) on the line through (b1, y1), (b2, y2), slope and intercept each kept >= 0: per-unit
    timings are noisy, and a negative intercept would predict negative times at small batches."""
    slope = max((y2 - y1) / (b2 - b1), 0.0)
    intercept = max(y1 - slope * b1, 0.0)
    return intercept + slope * b


@dataclass(frozen=True)
class CostModel:
    """Cost tables as functions of the batch. Bytes (saved, input, transfer, transient) are
    proportional to the batch. Times are proportional to it from one table, or affine through two
    tables measured at different batches (a GPU is less efficient at small batches, which is what
    makes a larger batch worth a swap plan)."""

    tables: tuple[CostTable, ...]

    def __post_init__(self) -> None:
        t = tuple(self.tables)
        object.__setattr__(self, "tables", t)
        if len(t) not in (1, 2) or not all(isinstance(x, CostTable) for x in t):
            raise ValueError(f"tables={t!r} is invalid: allowed one or two CostTable")
        if len(t) == 2:
            if t[0].batch == t[1].batch:
                raise ValueError(f"tables: both measured at batch {t[0].batch}; allowed two distinct batches")
            if t[0].names != t[1].names:
                raise ValueError("tables: the two tables name different units; allowed the same units in order")

    def at(self, batch: int) -> CostTable:
        """The modelled table at `batch` samples (>= 1)."""
        if not (isinstance(batch, int) and not isinstance(batch, bool) and batch >= 1):
            raise ValueError(f"batch={batch!r} is invalid: allowed an integer >= 1 (samples)")
        ref = self.tables[-1]
        r = batch / ref.batch

        def nbytes(v: int | None) -> int | None:
            return None if v is None else int(round(v * r))

        if len(self.tables) == 1:
            def time(i: int | None, attr: str) -> float | None:
                v = getattr(ref.layers[i], attr) if i is not None else ref.other_ms
                return None if v is None else v * r
        else:
            a, b = self.tables

            def time(i: int | None, attr: str) -> float | None:
                if i is None:
                    return _affine(a.other_ms, b.other_ms, a.batch, b.batch, batch)
                va, vb = getattr(a.layers[i], attr), getattr(b.layers[i], attr)
                if va is None or vb is None:
                    return None
                return _affine(va, vb, a.batch, b.batch, batch)

        layers = tuple(
            LayerCost(x.name, nbytes(x.saved_bytes), time(i, "forward_ms"), time(i, "backward_ms"),
                      nbytes(x.input_bytes), nbytes(x.transfer_bytes), time(i, "recompute_ms"),
                      int(x.shared_bytes * r))  # floored: stays within the rounded saved/input bytes
            for i, x in enumerate(ref.layers))
        return CostTable(batch, layers, ref.d2h_bytes_per_s, ref.h2d_bytes_per_s, ref.static_bytes,
                         int(round(ref.transient_bytes * r)), time(None, "other_ms"))


@dataclass(frozen=True)
class SwapPlan:
    """A per-unit plan and its modelled step.

    actions: "keep" | "swap" | "recompute" | "recompute_swap" per unit (forward order). prefetch_at:
    per unit, for a unit that copies to host ("swap", "recompute_swap") the index of the unit at
    whose backward start its host->device copy is issued (>= its own index; its own index means on
    demand), else None. step_ms: modelled step time;
    exposed_ms: of it, compute-stream waits on copies plus recompute time; peak_bytes: modelled
    peak device memory; fits: peak_bytes <= budget (None when no budget was given);
    backward_start_bytes: modelled device bytes when the forward pass ends, before any prefetch.
    """

    batch: int
    names: tuple[str, ...]
    actions: tuple[str, ...]
    prefetch_at: tuple[int | None, ...]
    step_ms: float
    exposed_ms: float
    peak_bytes: int
    budget: int | None = None
    fits: bool | None = None
    backward_start_bytes: int = 0

    @property
    def samples_per_s(self) -> float:
        return self.batch / self.step_ms * 1e3 if self.step_ms > 0 else math.inf

    @property
    def active(self) -> bool:
        """Whether any unit swaps or recomputes."""
        return any(a != "keep" for a in self.actions)

    def count(self, action: str) -> int:
        return sum(a == action for a in self.actions)

    def describe(self) -> str:
        """Units per action, e.g. "1 swap, 47 recompute, 4 keep" (actions in use only)."""
        return ", ".join(f"{self.count(a)} {a}" for a in ACTIONS[1:] + ACTIONS[:1] if self.count(a))

    def to_dict(self) -> dict:
        return {"batch": self.batch, "actions": dict(zip(self.names, self.actions)),
                "prefetch_at": list(self.prefetch_at), "step_ms": self.step_ms, "exposed_ms": self.exposed_ms,
                "peak_bytes": self.peak_bytes, "budget": self.budget, "fits": self.fits,
                "samples_per_s": self.samples_per_s}


def _check_actions(table: CostTable, actions: Sequence[str]) -> tuple[str, ...]:
    a = tuple(actions)
    if len(a) != len(table.layers) or any(x not in ACTIONS for x in a):
        raise ValueError(f"actions={a!r} is invalid: allowed {len(table.layers)} entries, each one of {ACTIONS}")
    return a


def _prefetch_schedule(table: CostTable, actions: tuple[str, ...]) -> tuple[int | None, ...]:
    """As-late-as-possible issue points on the serial host->device stream: each transfer should end
    when its unit's backward starts (or when the next-needed transfer must start), and is issued at
    the backward start of the latest unit that begins no later than that (nominal times, no stalls)."""
    L = len(table.layers)
    dur = [x.backward_ms + (x.remat_ms if actions[i] in RECOMPUTING else 0.0) for i, x in enumerate(table.layers)]
    start = [0.0] * L  # nominal backward start, relative to the end of the forward pass
    t = 0.0
    for i in range(L - 1, -1, -1):
        start[i] = t
        t += dur[i]
    out: list[int | None] = [None] * L
    limit = math.inf  # the start of the transfer needed right after this one
    for j in range(L - 1, -1, -1):  # in order of need
        if actions[j] not in SWAPPING:
            continue
        end = min(start[j], limit)
        begin = end - table.layers[j].moved_bytes(actions[j]) / table.h2d_bytes_per_s * 1e3
        limit = begin
        k = next((k for k in range(j, L) if start[k] <= begin + 1e-12), L - 1)
        out[j] = k
    return tuple(out)


def simulate(table: CostTable, actions: Sequence[str], prefetch_at: Sequence[int | None] | None = None,
             budget: int | None = None) -> SwapPlan:
    """Model one step of `table` under per-unit `actions`: step time, exposed time, peak memory.

    prefetch_at: as in SwapPlan (None: the as-late-as-possible schedule). budget: bytes, recorded
    in the plan with whether the peak fits it.
    """
    acts = _check_actions(table, actions)
    units = table.layers
    L = len(units)
    pf = _prefetch_schedule(table, acts) if prefetch_at is None else tuple(prefetch_at)
    if len(pf) != L or any((p is None) != (a not in SWAPPING) or (p is not None and not (i <= p < L))
                           for i, (p, a) in enumerate(zip(pf, acts))):
        raise ValueError(f"prefetch_at={pf!r} is invalid: allowed, per unit i that copies to host (swap, "
                         f"recompute_swap), an index in [i, {L - 1}], None for the others")
    d2h = [x.moved_bytes(a) / table.d2h_bytes_per_s * 1e3 for x, a in zip(units, acts)]
    h2d = [x.moved_bytes(a) / table.h2d_bytes_per_s * 1e3 for x, a in zip(units, acts)]

    # timeline: forward starts/ends, device->host copy ends, backward starts/ends, prefetch issues
    fs, fe, bs, be = [0.0] * L, [0.0] * L, [0.0] * L, [0.0] * L
    d2h_end, issue = [0.0] * L, [0.0] * L
    now, free_d2h = 0.0, 0.0
    for i, x in enumerate(units):
        fs[i] = now
        if acts[i] == "recompute_swap":  # its inputs are saved, and copied out, as its forward starts
            d2h_end[i] = free_d2h = max(now, free_d2h) + d2h[i]
        now += x.forward_ms
        fe[i] = now
        if acts[i] == "swap":
            d2h_end[i] = free_d2h = max(now, free_d2h) + d2h[i]
    fwd_end = now
    triggers: dict[int, list[int]] = {}
    for j in range(L - 1, -1, -1):
        if pf[j] is not None:
            triggers.setdefault(pf[j], []).append(j)
    exposed, free_h2d = 0.0, now
    h2d_end = [0.0] * L
    for i in range(L - 1, -1, -1):
        x = units[i]
        for j in triggers.get(i, ()):  # issued at this unit's backward start: its buffer exists from now
            issue[j] = now
            h2d_end[j] = free_h2d = max(now, d2h_end[j], free_h2d) + h2d[j]
        start = max(now, h2d_end[i]) if acts[i] in SWAPPING else now
        exposed += start - now
        dur = x.backward_ms
        if acts[i] in RECOMPUTING:
            dur += x.remat_ms
            exposed += x.remat_ms
        bs[i], now = start, start + dur
        be[i] = now

    # memory: each piece of saved data is resident over the union of the intervals its holders
    # keep it on the device; a tensor two neighbours both save (shared_bytes) is freed only when
    # neither holds it any more
    def hold(i: int, prefetch: bool = True) -> list[tuple[float, float]]:
        if acts[i] == "keep":
            return [(fe[i], be[i])]
        if acts[i] == "swap":
            return [(fe[i], d2h_end[i])] + ([(issue[i], be[i])] if prefetch else [])
        return [(bs[i], be[i])]  # recompute(_swap): rematerialised for its backward

    def inputs(i: int, prefetch: bool = True) -> list[tuple[float, float]]:
        """When a checkpoint holds unit i's inputs on the device (its forward reads them, so they
        stay at least until its end)."""
        if acts[i] == "recompute":
            return [(fs[i], be[i])]
        if acts[i] == "recompute_swap":
            return [(fs[i], max(fe[i], d2h_end[i]))] + ([(issue[i], be[i])] if prefetch else [])
        return []

    events: list[tuple[float, int]] = []  # (time, +/- bytes); frees sort first at equal times
    at_fwd_end = 0  # resident when the forward pass ends, before any prefetch

    def add(intervals: list[tuple[float, float]], nbytes: int, before: list[tuple[float, float]]) -> None:
        nonlocal at_fwd_end
        if nbytes == 0:
            return
        if any(a <= fwd_end < b for a, b in before):
            at_fwd_end += nbytes
        cur_a = cur_b = None
        for a, b in sorted(intervals):
            if cur_b is not None and a <= cur_b:
                cur_b = max(cur_b, b)
                continue
            if cur_b is not None and cur_b > cur_a:
                events.extend(((cur_a, nbytes), (cur_b, -nbytes)))
            cur_a, cur_b = a, b
        if cur_b is not None and cur_b > cur_a:
            events.extend(((cur_a, nbytes), (cur_b, -nbytes)))

    for i, x in enumerate(units):
        s_in = x.shared_bytes
        s_out = units[i + 1].shared_bytes if i + 1 < L else 0
        add(hold(i), x.saved_bytes - s_in - s_out, hold(i, False))
        add(inputs(i), x.input_bytes - s_in, inputs(i, False))
        if s_in:
            mine = inputs(i) if acts[i] in RECOMPUTING else hold(i)
            mine_fwd = inputs(i, False) if acts[i] in RECOMPUTING else hold(i, False)
            add(hold(i - 1) + mine, s_in, hold(i - 1, False) + mine_fwd)

    events.sort(key=lambda e: (e[0], e[1]))
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    base = table.static_bytes + table.transient_bytes
    fits = None if budget is None else base + peak <= budget
    return SwapPlan(table.batch, table.names, acts, pf, now + table.other_ms, exposed, base + peak, budget, fits,
                    base + at_fwd_end)


_MOVES = {"keep": ("swap", "recompute"), "swap": ("recompute",), "recompute": ("recompute_swap",),
          "recompute_swap": ()}
_RECOMPUTE_ONLY = {"keep": ("recompute",), "swap": (), "recompute": (), "recompute_swap": ()}
_SWAP_INPUTS = {"keep": (), "swap": (), "recompute": ("recompute_swap",), "recompute_swap": ()}


def plan_for_budget(table: CostTable, budget: int, actions: Sequence[str] = ACTIONS) -> SwapPlan:
    """Greedy plan that brings the modelled peak of `table` within `budget` bytes.

    Starting from all "keep", each round makes the one move (keep -> swap, keep -> recompute,
    swap -> recompute, recompute -> recompute_swap) that lowers the modelled peak the most per
    millisecond of added step time (hidden transfers first, the largest of those first; recompute
    where it costs less time than an exposed transfer), until the peak fits; when no move lowers
    the peak, the one that lowers the bytes resident at the end of the forward pass the most per
    millisecond. When that greedy gets stuck above the budget, a recompute-only greedy, "recompute
    every unit", and from there a greedy that swaps recomputed units' inputs are tried. Returns the
    lowest-peak plan, fits=False, when none fits (at once, "recompute every unit", when not even
    swapping every unit over an instant link would fit).

    actions: the actions the backend can apply (a tuple; "keep" and "recompute" required), e.g.
    without "recompute_swap" for `triaccel.backends.jax.offload`.
    """
    if not (isinstance(budget, int) and not isinstance(budget, bool) and budget > 0):
        raise ValueError(f"budget={budget!r} is invalid: allowed an integer > 0 (bytes)")
    allowed = tuple(actions) if isinstance(actions, (tuple, list)) else None
    if allowed is None or not {"keep", "recompute"} <= set(allowed) or not set(allowed) <= set(ACTIONS):
        raise ValueError(f"actions={actions!r} is invalid: allowed a sequence of actions from {ACTIONS} that "
                         "holds 'keep' and 'recompute'")
    return _plan(table, budget, allowed)


@functools.lru_cache(maxsize=512)  # tables are frozen and hashable; batch searches ask twice
def _plan(table: CostTable, budget: int, allowed: tuple[str, ...]) -> SwapPlan:
    def only(moves: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
        return {a: tuple(m for m in ms if m in allowed) for a, ms in moves.items()}

    # no plan beats swapping every unit over an instant link (each unit's saved bytes are on the
    # device only during its own backward; a recompute_swap unit holds its inputs too): when even
    # that breaks the budget, skip the search
    L = len(table.layers)
    instant = CostTable(table.batch, table.layers, 1e30, 1e30, table.static_bytes, table.transient_bytes,
                        table.other_ms)
    if simulate(instant, ["swap"] * L, prefetch_at=list(range(L))).peak_bytes > budget:
        return simulate(table, ["recompute"] * L, budget=budget)
    tried = [_greedy(table, budget, only(_MOVES))]
    # the greedy can trap itself, e.g. a swapped unit prefetched back while a later unit is
    # rematerialised: every single move then raises the peak. Fall back to recompute-only moves,
    # then to recomputing every unit, then to swapping the inputs of recomputed units from there;
    # the first that fits wins, else the lowest peak.
    if not tried[-1].fits:
        tried.append(_greedy(table, budget, only(_RECOMPUTE_ONLY)))
    if not tried[-1].fits:
        tried.append(simulate(table, ["recompute"] * L, budget=budget))
    if not tried[-1].fits and "recompute_swap" in allowed:
        tried.append(_greedy(table, budget, _SWAP_INPUTS, start=["recompute"] * L))
    return _refine(table, budget, tried[-1], allowed) if tried[-1].fits else min(tried, key=lambda p: p.peak_bytes)


def _refine(table: CostTable, budget: int, plan: SwapPlan, allowed: tuple[str, ...]) -> SwapPlan:
    """A fitting plan made faster where single moves allow: recomputed units' inputs to host where
    that costs no time and lowers the peak (room for what follows), then, last unit first, a unit
    kept or swapped instead where the plan still fits and the step is shorter (the last units'
    backward comes first, so their recompute cannot hide); repeated while anything moves. The
    greedy adds moves until the peak fits and never takes one back: on ResNet-152's tables at 4.2x
    B0 this made its modelled plans 2.3-7.6% faster (benchmarks/offload_bound.py, 2026-12-04)."""
    acts, cur = list(plan.actions), plan
    swap_inputs = "recompute_swap" in allowed
    lighter = tuple(a for a in ("keep", "swap") if a in allowed)
    moved = True
    while moved:
        moved = False
        for i in range(len(acts)):
            if swap_inputs and acts[i] == "recompute":
                trial = simulate(table, acts[:i] + ["recompute_swap"] + acts[i + 1:], budget=budget)
                if trial.fits and trial.step_ms <= cur.step_ms and trial.peak_bytes < cur.peak_bytes:
                    acts, cur, moved = list(trial.actions), trial, True
        for i in range(len(acts) - 1, -1, -1):
            for a in lighter:
                if acts[i] == "keep" or a == acts[i]:
                    break
                trial = simulate(table, acts[:i] + [a] + acts[i + 1:], budget=budget)
                if trial.fits and trial.step_ms < cur.step_ms:
                    acts, cur, moved = list(trial.actions), trial, True
                    break
    return cur


def _greedy(table: CostTable, budget: int, moves: dict[str, tuple[str, ...]],
            start: list[str] | None = None) -> SwapPlan:
    acts = ["keep"] * len(table.layers) if start is None else list(start)
    cur = simulate(table, acts, budget=budget)
    while not cur.fits:
        best: tuple[int, float, int, SwapPlan] | None = None
        for i, a in enumerate(acts):
            for move in moves[a]:
                trial = simulate(table, acts[:i] + [move] + acts[i + 1:], budget=budget)
                cost = max(trial.step_ms - cur.step_ms, _EPS_MS)
                freed = cur.peak_bytes - trial.peak_bytes
                eased = cur.backward_start_bytes - trial.backward_start_bytes
                if freed > 0:
                    key = (1, freed / cost, freed)
                elif freed == 0 and eased > 0:
                    # the peak sits where one move cannot lower it (e.g. a prefetch beside a kept
                    # unit): lower the forward's footprint so that a later move can
                    key = (0, eased / cost, eased)
                else:
                    continue
                if best is None or key > best[:3]:
                    best = (*key, trial)
        if best is None:
            return cur
        cur = best[3]
        acts = list(cur.actions)
    return cur


@dataclass(frozen=True)
class ThroughputBound:
    """The most any plan of `simulate`'s model can keep of a table's no-plan throughput under a budget.

    ratio: upper bound on plan samples/s over no-plan samples/s (1.0: the table fits as it is; 0.0: no
    plan fits). step_ms: the no-plan step. over_bytes: resident saved bytes over the room the budget
    leaves them (budget - static - transient). copy_bytes: the most the device->host stream can move
    before the forward pass ends. recompute_bytes: what recomputation must free beyond that.
    recompute_ms: the least recompute time that frees it.
    """

    batch: int
    ratio: float
    step_ms: float
    over_bytes: int
    copy_bytes: int
    recompute_bytes: int
    recompute_ms: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def throughput_bound(table: CostTable, budget: int) -> ThroughputBound:
    """An upper bound on what any plan of `table` under `budget` bytes keeps of its throughput.

    When the forward pass ends the device must hold at most the budget's room for saved tensors;
    by then at most d2h_bytes_per_s x (the forward's time) bytes can have left for host memory,
    and every recomputed unit frees at most its saved_bytes less its input_bytes and adds its
    remat_ms to the step (transfer waits only add more). The least recompute time that frees the
    rest, units taken fractionally in order of ms per freed byte, bounds the plan's step from below:
    ratio = step / (step + that time). A relaxation of `simulate`, so no plan `plan_for_budget`
    returns can beat it; how close a plan comes says what is left to gain by planning."""
    if not (isinstance(budget, int) and not isinstance(budget, bool) and budget > 0):
        raise ValueError(f"budget={budget!r} is invalid: allowed an integer > 0 (bytes)")
    units = table.layers
    step = sum(x.forward_ms + x.backward_ms for x in units) + table.other_ms
    room = budget - table.static_bytes - table.transient_bytes
    over = table.resident_bytes - room
    copy = int(table.d2h_bytes_per_s * sum(x.forward_ms for x in units) / 1e3)
    need = max(0, over - copy)
    left, ms = float(need), 0.0
    for x in sorted(units, key=lambda x: x.remat_ms / max(1, x.saved_bytes - x.input_bytes)):
        if left <= 0:
            break
        free = max(0, x.saved_bytes - x.input_bytes)
        take = min(free, left)
        ms += x.remat_ms * take / free if free else 0.0
        left -= take
    ratio = 0.0 if left > 0 else (step / (step + ms) if step > 0 else 1.0)
    return ThroughputBound(table.batch, ratio, step, over, copy, need, ms)


def largest_fitting(batches: Sequence[int], fits: Callable[[int], bool]) -> int | None:
    """Index of the largest of the sorted `batches` for which `fits(batch)` holds, by bisection
    (feasibility falls as the batch grows); None when none does."""
    lo, hi, top = 0, len(batches) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(batches[mid]):
            top, lo = mid, mid + 1
        else:
            hi = mid - 1
    return top


@dataclass(frozen=True)
class BatchChoice:
    """The joint choice of batch and plan under a budget.

    batch: samples per step; plan: its SwapPlan (all "keep" when no plan is needed); lr_scale: the
    config's lr_rule multiplier for `batch` (relative to batch_init); goodput: modelled samples/s,
    times the statistical efficiency 1/(1 + B/B_noise) when b_noise is known. baseline: the largest
    batch that fits without a plan (None when none does); candidates: every (batch, goodput, active)
    evaluated.
    """

    batch: int
    plan: SwapPlan
    lr_scale: float
    goodput: float
    baseline: SwapPlan | None
    candidates: tuple[tuple[int, float, bool], ...] = field(default=())

    def to_dict(self) -> dict:
        return {"batch": self.batch, "lr_scale": self.lr_scale, "goodput": self.goodput, "plan": self.plan.to_dict(),
                "baseline": None if self.baseline is None else self.baseline.to_dict(),
                "candidates": [list(c) for c in self.candidates]}


def _lr_scale(cfg: TriAccelConfig, batch: int) -> float:
    """The controller's lr_rule multiplier at `batch` (BatchLaw's rule, not a second copy of it)."""
    law = BatchLaw(cfg.replace(lr_ramp_steps=0))
    law.batch = batch
    return law.lr_scale(0)


def choose_batch(model: CostModel, budget: int, cfg: TriAccelConfig, b_noise: float | None = None,
                 batches: Sequence[int] | None = None, max_planned: int = 4) -> BatchChoice:
    """Compare (the largest batch that fits `budget` bytes without a plan) with (larger batches +
    a swap/recompute plan) by modelled goodput and return the better.

    batches: candidate sizes (default: cfg.batch_buckets, or batch_min..batch_max on the
    batch_multiple grid; under lr_rule="accumulate" only micro-batches up to batch_init). With
    cfg.offload == "off" only plan-free batches are considered.
    b_noise: gradient noise scale (samples) for statistical efficiency; None: throughput alone.
    max_planned: how many planned batches above the baseline to evaluate (evenly spaced up to the
    largest that fits with a plan). Raises ValueError when not even the smallest candidate fits.
    """
    if not (isinstance(budget, int) and not isinstance(budget, bool) and budget > 0):
        raise ValueError(f"budget={budget!r} is invalid: allowed an integer > 0 (bytes)")
    if b_noise is not None and not (math.isfinite(b_noise) and b_noise > 0):
        raise ValueError(f"b_noise={b_noise!r} is invalid: allowed a finite real number > 0 (samples) or None")
    if not (isinstance(max_planned, int) and max_planned >= 1):
        raise ValueError(f"max_planned={max_planned!r} is invalid: allowed an integer >= 1")
    if batches is None:
        batches = cfg.batch_buckets or range(cfg.batch_min, cfg.batch_max + 1, cfg.batch_multiple)
    grid = sorted(set(batches))
    if not grid or any(not isinstance(b, int) or b < 1 for b in grid):
        raise ValueError(f"batches={batches!r} is invalid: allowed a non-empty sequence of integers >= 1")
    accumulate = cfg.lr_rule == "accumulate"
    if accumulate:  # B is a micro-batch of the fixed logical batch batch_init (as in BatchLaw)
        grid = [b for b in grid if b <= cfg.batch_init]
        if not grid:
            raise ValueError(f"batches={batches!r}: none <= batch_init={cfg.batch_init}, the logical batch "
                             "under lr_rule='accumulate'")

    def goodput(p: SwapPlan) -> float:
        per_update = cfg.batch_init if accumulate else p.batch  # samples per optimizer step
        eff = 1.0 if b_noise is None else 1.0 / (1.0 + per_update / b_noise)
        return p.samples_per_s * eff

    keep = lambda b: simulate(model.at(b), ["keep"] * len(model.tables[0].layers), budget=budget)  # noqa: E731
    plain = [keep(b) for b in grid]
    fitting = [p for p in plain if p.fits]
    baseline = max(fitting, key=goodput) if fitting else None
    cands: list[SwapPlan] = list(fitting)
    if cfg.offload == "auto":
        above = [b for b in grid if baseline is None or b > max(p.batch for p in fitting)]
        top = largest_fitting(above, lambda b: plan_for_budget(model.at(b), budget).fits)
        if top is not None:
            n = min(max_planned, top + 1)
            picks = sorted({above[round(top * (k + 1) / n)] for k in range(n)} | {above[top]})
            for b in picks:
                p = plan_for_budget(model.at(b), budget)
                if p.fits:
                    cands.append(p)
    if not cands:
        raise ValueError(f"budget={budget} bytes is too small: the smallest candidate batch {grid[0]} does not fit "
                         f"(modelled peak {plain[0].peak_bytes} bytes)"
                         f"{'' if cfg.offload == 'auto' else ' without offload'}")
    best = max(cands, key=lambda p: (goodput(p), -p.batch))
    return BatchChoice(best.batch, best, _lr_scale(cfg, best.batch), goodput(best), baseline,
                       tuple((p.batch, goodput(p), p.active) for p in cands))


def scale_plan(plan: SwapPlan, table: CostTable, budget: int | None = None) -> SwapPlan:
    """`plan`'s actions re-modelled on another `table` (e.g. re-measured timings)."""
    return simulate(table, plan.actions, budget=budget)



class OffloadPlanner:
    """Keeps the joint (batch, plan) decision current under a budget.

    `decide` plans for `budget - margin`; `observe_peak` raises the margin to the largest excess
    of a measured peak over its plan's modelled peak once a measured peak breaks the budget (the
    model then plans that much lower: replan); `observe_tables` swaps in freshly measured costs;
    `timings_moved` says when measured step times left the model by more than `tolerance` (re-measure).
    cfg.offload == "off" gives plan-free decisions. An OOM is the controller's business: it shrinks
    the batch at once, whatever the plan.
    """

    def __init__(self, cfg: TriAccelConfig, model: CostModel, budget: int, batches: Sequence[int] | None = None,
                 tolerance: float = 0.25) -> None:
        if not (isinstance(budget, int) and not isinstance(budget, bool) and budget > 0):
            raise ValueError(f"budget={budget!r} is invalid: allowed an integer > 0 (bytes)")
        if not (isinstance(tolerance, (int, float)) and 0 < tolerance < 1):
            raise ValueError(f"tolerance={tolerance!r} is invalid: allowed a real number in (0, 1)")
        self.cfg, self.model, self.budget, self.batches, self.tolerance = cfg, model, budget, batches, tolerance
        self.margin = 0
        # (batch, measured, modelled) bytes of the step that last broke the budget (error messages)
        self.last_breach: tuple[int, int, int] | None = None
        self.choice: BatchChoice | None = None
        self._moved = False
        self._refs: dict[tuple[int, tuple[str, ...]], float] = {}  # first ms/step per (batch, actions)

    @property
    def target(self) -> int:
        """Bytes the plans are made for: the budget less the model's largest observed under-estimate.
        At or below 0 once the model under-estimated a peak by the whole budget: `plan` and `decide`
        then raise (see `check_target`)."""
        return self.budget - self.margin

    def check_target(self) -> None:
        """ValueError naming the measured and modelled peaks when `target` <= 0 (the model
        under-estimates peaks by at least the budget: no plan made from it can be trusted)."""
        if self.target > 0:
            return
        seen = ""
        if self.last_breach is not None:
            b, measured, modelled = self.last_breach
            seen = (f": a step at batch {b} under a plan modelled at {modelled} bytes peaked at {measured} "
                    f"bytes ({measured - modelled} bytes over the model)")
        raise ValueError(
            f"budget={self.budget} bytes: the cost model under-estimates peaks by {self.margin} bytes, at least "
            f"the whole budget{seen}; planning target {self.target} bytes <= 0. The plan did not take effect "
            "or the tables miss device memory: check the plan's mechanics and re-measure the cost tables")

    def decide(self, b_noise: float | None = None) -> BatchChoice:
        """Choose batch and plan for `target` bytes (choose_batch); ValueError when target <= 0."""
        self.check_target()
        self.choice = choose_batch(self.model, self.target, self.cfg, b_noise=b_noise, batches=self.batches)
        return self.choice

    def plan(self, batch: int) -> SwapPlan:
        """The plan for `batch` at `target` bytes (fits=False when none fits); ValueError when
        target <= 0."""
        self.check_target()
        return plan_for_budget(self.model.at(batch), self.target)

    def observe_peak(self, plan: SwapPlan, measured_bytes: int) -> bool:
        """Record the measured peak of a step run under `plan`; True when it broke the budget (the
        margin grew: decide/plan again, which raise if the target fell to 0 or below)."""
        if not (isinstance(measured_bytes, int) and measured_bytes >= 0):
            raise ValueError(f"measured_bytes={measured_bytes!r} is invalid: allowed an integer >= 0")
        if measured_bytes <= self.budget:
            return False
        self.last_breach = (plan.batch, int(measured_bytes), plan.peak_bytes)
        err = measured_bytes - plan.peak_bytes
        # a plan made for target bytes breaks the budget only when err > margin; a plan made for
        # more than the target lowers the target by its excess instead
        self.margin = err if err > self.margin else self.margin + (measured_bytes - self.budget)
        return True

    def observe_step(self, plan: SwapPlan, measured_ms: float) -> bool:
        """Record a measured step time under `plan`; True when it is off the model by more than the
        tolerance (timings moved: measure new tables and `observe_tables`)."""
        if not (math.isfinite(measured_ms) and measured_ms > 0):
            raise ValueError(f"measured_ms={measured_ms!r} is invalid: allowed a finite real number > 0")
        self._moved = abs(measured_ms / plan.step_ms - 1.0) > self.tolerance
        return self._moved

    def observe_step_time(self, plan: SwapPlan, measured_ms: float) -> bool:
        """Record a measured wall time per step (ms) under `plan`, against the first one measured
        under the same batch and actions since the last `observe_tables` (a wall time also holds
        what the model leaves out: data, optimizer, host work; their share is then held fixed).
        True when it moved by more than the tolerance (measure new tables and `observe_tables`)."""
        if not (isinstance(measured_ms, (int, float)) and math.isfinite(measured_ms) and measured_ms > 0):
            raise ValueError(f"measured_ms={measured_ms!r} is invalid: allowed a finite real number > 0")
        key = (plan.batch, tuple(plan.actions))
        ref = self._refs.setdefault(key, float(measured_ms))
        self._moved = abs(measured_ms / ref - 1.0) > self.tolerance
        return self._moved

    @property
    def timings_moved(self) -> bool:
        return self._moved

    def observe_tables(self, tables: Sequence[CostTable]) -> None:
        """Replace the cost model with freshly measured tables (one or two batches)."""
        self.model = CostModel(tuple(tables))
        self._moved = False
        self._refs = {}

    def state_dict(self) -> dict:
        """JSON-safe: tables, budget, margin (reference step times are not kept: re-taken)."""
        return {"tables": [t.to_dict() for t in self.model.tables], "budget": self.budget, "margin": self.margin}

    def load_state_dict(self, sd: dict) -> None:
        self.model = CostModel(tuple(CostTable.from_dict(t) for t in sd["tables"]))
        self.budget, self.margin = int(sd["budget"]), int(sd["margin"])
        self._moved, self._refs, self.choice, self.last_breach = False, {}, None, None
