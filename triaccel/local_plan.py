"""Adaptive local learning (NeuroFlux-style) planning: blocks, auxiliary heads, per-block batch sizes,
activation-cache placement and exit selection, all from a measured per-layer memory table.

A network is a sequence of units (`LayerMemory`: e.g. ResNet-18's stem and its 8 BasicBlocks). Local
learning trains contiguous *blocks* of units one after another, each against its own auxiliary
classifier head, with no gradient crossing a block boundary; a trained block is frozen and its outputs
over the training set are cached, so it never runs forward again while later blocks train. The plan
decides, deterministically and from numbers only (no framework):

- the partition: the largest batch bucket ("target batch", at most `target_batch`) at which the
  fewest contiguous blocks that each fit the budget number at most `max_blocks` (a greedy sweep
  gives the fewest blocks for a target; blocks grow while they fit);
- each block's head width: the widest of `head_widths` with which the block still fits at the target
  batch (the last block's head is `last_head_width`, by default the model's own pool + linear);
- each block's batch: the largest bucket whose modelled peak fits with that head (>= the target);
- where each block's input cache lives: on the device when it fits beside the block's training peak
  and beside the previous block's cache-building pass, else on the host.

Memory model (bytes; every figure per sample is multiplied by the batch):

    training peak = resident + state_bytes_per_param * (block params + head params)
                    + frozen_bytes_per_param * (the other units' params) + device cache
                    + B * (input + sum of the units' saved bytes + head saved bytes
                           + 2 * largest activation in the block)
    inference     = resident + frozen_bytes_per_param * all units' params + device caches
                    + B * (input + 3 * largest activation)

(Every unit's weights stay on the device throughout, trained or not.)

`saved_bytes` is what autograd keeps for backward (the torch backend measures it with saved-tensor
hooks); the "2 * largest activation" term stands for the gradient buffers alive during backward.
The model is meant to be conservative; the backends replay a step at a smaller micro-batch after an
out-of-memory error (the elastic machinery), so an under-estimate costs time, never samples.
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from .config import parse_bytes
from .curvature import lr_scales_from_eigs
from .precision import Precision

__all__ = ["BLOCK_INPUTS", "check_views", "LayerMemory", "LocalPlanConfig", "HeadCost", "BlockPlan", "LocalPlan",
           "head_cost", "plan_local", "select_exit", "head_init", "micro_batches", "BlockRun", "block_runs",
           "BlockRecord", "halving_on_oom", "NonFinitePolicy", "NonFiniteTraining", "BlockOutOfMemory",
           "parse_reserve", "BlockCurvature"]


def parse_reserve(value: int | str, name: str = "graph_reserve_bytes") -> int:
    """A byte reserve that may be zero: 0 or "0" -> 0, else `parse_bytes` (a positive size such as
    "64MiB"); ValueError naming `name` otherwise."""
    if (isinstance(value, int) and not isinstance(value, bool) and value == 0) or \
            (isinstance(value, str) and value.strip() == "0"):
        return 0
    return parse_bytes(value, name)


def _pos_int(name: str, v: Any, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name}={v!r}: must be an integer >= {lo} (allowed [{lo}, inf))")
    return int(v)


@dataclass(frozen=True)
class LayerMemory:
    """One unit of the sequential model, measured in training mode at the run's precision.

    name: the unit's name. saved_bytes: bytes autograd keeps for its backward, per sample.
    out_shape: (C, H, W) of its output. params: its parameter count.
    """

    name: str
    saved_bytes: int
    out_shape: tuple[int, int, int]
    params: int

    def __post_init__(self) -> None:
        _pos_int(f"{self.name}.saved_bytes", self.saved_bytes, 0)
        _pos_int(f"{self.name}.params", self.params, 0)
        if len(self.out_shape) != 3:
            raise ValueError(f"{self.name}.out_shape={self.out_shape!r}: must be (C, H, W), 3 positive ints")
        for v in self.out_shape:
            _pos_int(f"{self.name}.out_shape", v)
        object.__setattr__(self, "out_shape", tuple(int(v) for v in self.out_shape))

    @property
    def out_elements(self) -> int:
        """Output elements per sample."""
        return math.prod(self.out_shape)


@dataclass(frozen=True)
class LocalPlanConfig:
    """Knobs of `plan_local`. Units: bytes, samples.

    memory_budget: device bytes the run may use (int or e.g. "512MiB"); headroom: the fraction of it
      the modelled peak may fill, (0, 1] (the rest absorbs allocator fragmentation and workspaces).
    batch_buckets: candidate batch sizes, strictly increasing. max_blocks: at most this many blocks.
    target_batch: the partition aims at the largest bucket <= target_batch (None: the largest bucket)
      whose fewest-blocks partition has at most max_blocks blocks; a smaller target gives fewer
      blocks (local learning loses accuracy with every extra block), a larger one larger batches.
    head_widths: candidate conv widths of an auxiliary head (0 = global pool + linear only), strictly
      increasing. last_head_width: the last block's head width (0: the model's own classifier);
      None: chosen like the others. head_pool: the spatial size a head pools to before its conv.
    act_bytes: bytes per activation element in training (2 under bf16 autocast, 4 in fp32).
    cache_bytes: bytes per cached element. cache_views: augmented copies of the training set cached
      per block (epoch e of a block reads view e mod cache_views), or "auto": the most views, up to
      max_cache_views, whose host memory (`LocalPlan.host_peak_bytes`) fits host_cache_bytes. One
      view makes every later block see the same augmentation each epoch, and it overfits (H100,
      ResNet-18, 10 epochs: the second exit 83.82% with one view, 85.93% with ten).
    max_cache_views: the most views "auto" takes (more than the epochs of a block are never read).
    host_cache_bytes: host bytes the caches on the host and the raw views may hold (int or e.g.
      "16GiB"); required with cache_views="auto", else None (not checked).
    view_bytes: host bytes per sample of one raw view (CIFAR uint8: 3*32*32).
    block_inputs: "cache" (above) or "fresh": every block after the first runs the frozen prefix
      on freshly augmented images each step (no cache, no views; its batch must also fit the
      prefix's forward). With one view per epoch a cache saves no forward pass: it only adds the
      copies to the host (H100, ResNet-18, ten views: 45.8 s) and their host memory.
    input_bytes: bytes per sample of the model's input batch (CIFAR float32: 3*32*32*4).
    state_bytes_per_param: bytes per trained parameter (fp32 weight + grad + momentum + a 16-bit copy).
    frozen_bytes_per_param: bytes per parameter of the units not in training (their fp32 weights).
    resident_bytes: bytes held on the device throughout (e.g. the training images, and workspaces the
      framework keeps that the table does not show).
    graph_reserve_bytes: bytes every training step keeps free beside its modelled peak for a CUDA graph
      (int or e.g. "64MiB"; 0: none; graphs are captured either way). A captured step's working set sits in the graph's
      private pool, which no other allocation may use, so the eager work beside it (fetching the next
      batch, the allocator's segment rounding) needs segments of its own. The partition may then take
      smaller batches or more blocks. H100, issue 18's 520 MiB budget, ResNet-18 (2026-11-23): with
      no reserve the last block's warm-up (batch 256) ran out of memory, with 32 MiB all three blocks
      were captured (seed 0); measured block peaks exceeded the modelled ones less the reserve by
      52-104 MiB, which the reserve and `headroom` absorb.
    """

    memory_budget: int | str
    batch_buckets: tuple[int, ...] = (32, 64, 128, 256, 512)
    max_blocks: int = 4
    target_batch: int | None = None
    head_widths: tuple[int, ...] = (0, 32, 64, 128, 256)
    last_head_width: int | None = 0
    head_pool: int = 4
    act_bytes: int = 2
    cache_bytes: int = 2
    cache_views: int | str = 1
    max_cache_views: int = 10
    host_cache_bytes: int | str | None = None
    view_bytes: int = 3 * 32 * 32
    block_inputs: str = "cache"
    input_bytes: int = 3 * 32 * 32 * 4
    state_bytes_per_param: int = 14
    frozen_bytes_per_param: int = 4
    resident_bytes: int = 0
    graph_reserve_bytes: int | str = 0
    headroom: float = 0.9

    def __post_init__(self) -> None:
        object.__setattr__(self, "memory_budget", parse_bytes(self.memory_budget, "memory_budget"))
        for name in ("batch_buckets", "head_widths"):
            v = tuple(getattr(self, name))
            lo = 1 if name == "batch_buckets" else 0
            if not v or any(isinstance(x, bool) or not isinstance(x, int) or x < lo for x in v) or list(v) != sorted(set(v)):
                raise ValueError(f"{name}={getattr(self, name)!r}: must be a non-empty strictly increasing tuple "
                                 f"of integers >= {lo}")
            object.__setattr__(self, name, v)
        _pos_int("max_blocks", self.max_blocks)
        if self.target_batch is not None:
            _pos_int("target_batch", self.target_batch)
            if self.target_batch < self.batch_buckets[0]:
                raise ValueError(f"target_batch={self.target_batch}: allowed [{self.batch_buckets[0]}, inf) "
                                 f"(the smallest of batch_buckets) or None")
        _pos_int("head_pool", self.head_pool)
        if self.last_head_width is not None:
            _pos_int("last_head_width", self.last_head_width, 0)
        for name in ("act_bytes", "cache_bytes", "max_cache_views", "view_bytes", "input_bytes",
                     "state_bytes_per_param", "frozen_bytes_per_param"):
            _pos_int(name, getattr(self, name))
        if self.cache_views != "auto":
            _pos_int("cache_views", self.cache_views)
        if self.block_inputs not in ("cache", "fresh"):
            raise ValueError(f"block_inputs={self.block_inputs!r}: allowed cache, fresh")
        if self.host_cache_bytes is not None:
            object.__setattr__(self, "host_cache_bytes", parse_bytes(self.host_cache_bytes, "host_cache_bytes"))
        elif self.cache_views == "auto":
            raise ValueError("host_cache_bytes=None: cache_views='auto' needs the host bytes the caches may "
                             "hold, e.g. host_cache_bytes='16GiB'")
        _pos_int("resident_bytes", self.resident_bytes, 0)
        object.__setattr__(self, "graph_reserve_bytes", parse_reserve(self.graph_reserve_bytes))
        if isinstance(self.headroom, bool) or not isinstance(self.headroom, (int, float)) or not 0 < self.headroom <= 1:
            raise ValueError(f"headroom={self.headroom!r}: allowed (0, 1]")

    @property
    def usable_bytes(self) -> int:
        """memory_budget * headroom: what a modelled peak may reach."""
        return int(self.memory_budget * self.headroom)


@dataclass(frozen=True)
class HeadCost:
    """An auxiliary head's parameter count and saved bytes per sample."""

    params: int
    saved_bytes: int


def head_cost(in_shape: Sequence[int], width: int, num_classes: int, act_bytes: int, pool: int = 4) -> HeadCost:
    """Cost of the auxiliary head on a (C, H, W) feature map.

    width 0: global average pool -> linear(C, num_classes). width w > 0: adaptive average pool to
    (min(H, pool), min(W, pool)) -> conv3x3(C -> w, no bias) -> BatchNorm -> ReLU -> global average
    pool -> linear(w, num_classes); autograd keeps the conv input, the BN input, the ReLU output and
    the pooled vector. Pooling first keeps the head's activations small on early, large maps (as
    DGL's auxiliary nets do).
    """
    c, h, w_ = (int(v) for v in in_shape)
    width = _pos_int("width", width, 0)
    k = _pos_int("num_classes", num_classes)
    pool = _pos_int("pool", pool)
    if width == 0:
        return HeadCost(params=c * k + k, saved_bytes=c * act_bytes)
    params = 9 * c * width + 2 * width + width * k + k
    saved = (min(h, pool) * min(w_, pool) * (c + 2 * width) + width) * act_bytes
    return HeadCost(params=params, saved_bytes=saved)


@dataclass(frozen=True)
class BlockPlan:
    """One block: units [start, stop), its head width, batch, modelled peaks and input cache.

    input_cache: "data" (block 0 reads the data set), "device" or "host" (where its input cache
    lives), or "fresh" (no cache: the frozen prefix runs on fresh images). cache_bytes: its input
    cache's size (0 for block 0 and fresh blocks). peak_bytes: modelled training peak at `batch`,
    device cache included.
    """

    index: int
    start: int
    stop: int
    names: tuple[str, ...]
    head_width: int
    batch: int
    params: int
    head_params: int
    peak_bytes: int
    input_cache: str
    cache_bytes: int

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["names"] = list(self.names)
        return d


@dataclass(frozen=True)
class LocalPlan:
    """The plan: blocks in order, the target batch that shaped the partition, the largest batch at
    which the whole model fits end to end under the same model (None: not even the smallest bucket),
    the inference batch (cache building, evaluation) and the budget used; the cached views and the
    host bytes they take at the most (the raw views plus the two host caches alive while a block's
    cache is built from the previous one)."""

    blocks: tuple[BlockPlan, ...]
    target_batch: int
    e2e_batch: int | None
    infer_batch: int
    usable_bytes: int
    memory_budget: int
    layers: tuple[LayerMemory, ...] = field(repr=False)
    cache_views: int = 1
    host_peak_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"blocks": [b.to_dict() for b in self.blocks], "target_batch": self.target_batch,
                "e2e_batch": self.e2e_batch, "infer_batch": self.infer_batch,
                "usable_bytes": self.usable_bytes, "memory_budget": self.memory_budget,
                "cache_views": self.cache_views, "host_peak_bytes": self.host_peak_bytes,
                "layers": [asdict(l) for l in self.layers]}


class _Model:
    """The memory model of the module docstring over one layer table."""

    def __init__(self, layers: Sequence[LayerMemory], cfg: LocalPlanConfig, num_classes: int, num_samples: int) -> None:
        self.layers, self.cfg, self.k, self.n = list(layers), cfg, num_classes, num_samples

    def in_bytes(self, i: int) -> int:
        """Input bytes per sample of unit i as a training batch."""
        return self.cfg.input_bytes if i == 0 else self.layers[i - 1].out_elements * self.cfg.cache_bytes

    def cache_size(self, i: int) -> int:
        """Bytes of the cache of unit i's input over the training set (all views)."""
        return 0 if i == 0 else self.cfg.cache_views * self.n * self.layers[i - 1].out_elements * self.cfg.cache_bytes

    def head(self, j: int, width: int) -> HeadCost:
        return head_cost(self.layers[j - 1].out_shape, width, self.k, self.cfg.act_bytes, self.cfg.head_pool)

    def train_peak(self, i: int, j: int, width: int, batch: int, device_cache: bool = False) -> int:
        c, units = self.cfg, self.layers[i:j]
        hc = self.head(j, width)
        largest = max(u.out_elements for u in units)
        if i > 0:
            largest = max(largest, self.layers[i - 1].out_elements)
        own = sum(u.params for u in units)
        frozen = sum(u.params for u in self.layers) - own
        fixed = (c.resident_bytes + c.graph_reserve_bytes + c.state_bytes_per_param * (own + hc.params)
                 + c.frozen_bytes_per_param * frozen)
        per = self.in_bytes(i) + sum(u.saved_bytes for u in units) + hc.saved_bytes + 2 * largest * c.act_bytes
        return fixed + batch * per + (self.cache_size(i) if device_cache else 0)

    def infer_peak(self, j: int, batch: int, caches: int) -> int:
        """Running units [0, j) forward with `caches` bytes of caches on the device."""
        c, units = self.cfg, self.layers[:j]
        largest = max(u.out_elements for u in units)
        return (c.resident_bytes + c.frozen_bytes_per_param * sum(u.params for u in self.layers) + caches
                + batch * (c.input_bytes + 3 * largest * c.act_bytes))

    def fits(self, peak: int) -> bool:
        return peak <= self.cfg.usable_bytes

    def last_width(self) -> int | None:
        return self.cfg.last_head_width

    def min_width(self, j: int) -> int:
        lw = self.last_width()
        return lw if (j == len(self.layers) and lw is not None) else self.cfg.head_widths[0]

    def greedy(self, target: int) -> list[tuple[int, int]] | None:
        """Fewest contiguous blocks that each fit at `target` with their narrowest head; None when a
        single unit does not."""
        blocks, i, n = [], 0, len(self.layers)
        while i < n:
            if not self.fits(self.train_peak(i, i + 1, self.min_width(i + 1), target)):
                return None
            j = i + 1
            while j < n and self.fits(self.train_peak(i, j + 1, self.min_width(j + 1), target)):
                j += 1
            blocks.append((i, j))
            i = j
        return blocks


def plan_local(layers: Sequence[LayerMemory], config: LocalPlanConfig, *, num_samples: int,
               num_classes: int) -> LocalPlan:
    """Partition `layers` into blocks under `config.memory_budget` (see the module docstring).

    num_samples: training-set size (cache sizes); num_classes: the heads' outputs.
    Raises ValueError naming memory_budget when a single unit does not fit at the smallest bucket
    with the narrowest head, max_blocks when even the smallest bucket needs more blocks, or
    host_cache_bytes when cache_views="auto" and not even one view fits it.
    """
    if config.block_inputs == "fresh":
        return _plan_views(layers, replace(config, cache_views=1), num_samples=num_samples, num_classes=num_classes)
    if config.cache_views != "auto":
        return _plan_views(layers, config, num_samples=num_samples, num_classes=num_classes)
    plan = None
    for views in range(config.max_cache_views, 0, -1):
        plan = _plan_views(layers, replace(config, cache_views=views), num_samples=num_samples,
                           num_classes=num_classes)
        if plan.host_peak_bytes <= config.host_cache_bytes:
            return plan
    assert plan is not None
    raise ValueError(f"host_cache_bytes={config.host_cache_bytes}: one cached view needs {plan.host_peak_bytes} "
                     f"host bytes; allowed [{plan.host_peak_bytes}, inf), or a fixed cache_views")


def _plan_views(layers: Sequence[LayerMemory], config: LocalPlanConfig, *, num_samples: int,
                num_classes: int) -> LocalPlan:
    """`plan_local` at a fixed number of cached views."""
    if not layers:
        raise ValueError("layers: empty; a plan needs at least one unit")
    if not all(isinstance(l, LayerMemory) for l in layers):
        raise ValueError("layers: expected a sequence of LayerMemory")
    n = _pos_int("num_samples", num_samples)
    k = _pos_int("num_classes", num_classes)
    cfg = config
    m = _Model(layers, cfg, k, n)
    buckets = cfg.batch_buckets
    chosen: tuple[int, list[tuple[int, int]]] | None = None
    fewest: list[tuple[int, int]] | None = None
    cap = cfg.target_batch if cfg.target_batch is not None else buckets[-1]
    for target in reversed([bb for bb in buckets if bb <= cap]):
        part = m.greedy(target)
        if part is None:
            continue
        fewest = part
        if len(part) <= cfg.max_blocks:
            chosen = (target, part)
            break
    if chosen is None:
        if fewest is None:
            need = min(m.train_peak(i, i + 1, m.min_width(i + 1), buckets[0]) for i in range(len(layers))
                       if not m.fits(m.train_peak(i, i + 1, m.min_width(i + 1), buckets[0])))
            worst = max(m.train_peak(i, i + 1, m.min_width(i + 1), buckets[0]) for i in range(len(layers)))
            raise ValueError(
                f"memory_budget={cfg.memory_budget}: a single unit needs up to {worst} bytes at the smallest "
                f"batch {buckets[0]} (at least {need} for one that does not fit) against "
                f"{cfg.usable_bytes} usable (headroom {cfg.headroom}); allowed: a budget of at least "
                f"{math.ceil(worst / cfg.headroom)} bytes, or a smaller bucket")
        raise ValueError(f"max_blocks={cfg.max_blocks}: even at the smallest batch {buckets[0]} the budget needs "
                         f"{len(fewest)} blocks; allowed [{len(fewest)}, inf) for this budget")
    target, part = chosen
    blocks: list[BlockPlan] = []
    prev_cache_device = 0
    for b, (i, j) in enumerate(part):
        if j == len(layers) and cfg.last_head_width is not None:
            width = cfg.last_head_width
        else:
            width = max(w for w in cfg.head_widths if m.fits(m.train_peak(i, j, w, target)) or w == m.min_width(j))
        fresh = i > 0 and cfg.block_inputs == "fresh"
        batch = max(bb for bb in buckets if (m.fits(m.train_peak(i, j, width, bb))
                                             and (not fresh or m.fits(m.infer_peak(i, bb, 0)))) or bb == target)
        size = 0 if fresh else m.cache_size(i)
        where = "fresh" if fresh else "data"
        if i > 0 and not fresh:
            # Cache on the device only if the block trains beside it at its batch, and the previous
            # block's cache-building pass (its own input cache + this one) fits at the smallest bucket.
            train_ok = m.fits(m.train_peak(i, j, width, batch, device_cache=True))
            build_ok = m.fits(m.infer_peak(i, buckets[0], prev_cache_device + size))
            where = "device" if train_ok and build_ok else "host"
        peak = m.train_peak(i, j, width, batch, device_cache=where == "device")
        prev_cache_device = size if where == "device" else 0
        blocks.append(BlockPlan(
            index=b, start=i, stop=j, names=tuple(l.name for l in layers[i:j]), head_width=width, batch=batch,
            params=sum(l.params for l in layers[i:j]), head_params=m.head(j, width).params, peak_bytes=peak,
            input_cache=where, cache_bytes=size))
    full = len(layers)
    e2e_width = cfg.last_head_width if cfg.last_head_width is not None else cfg.head_widths[0]
    e2e = [bb for bb in buckets if m.fits(m.train_peak(0, full, e2e_width, bb))]
    # Inference (cache building, evaluation): the largest bucket at which the whole model runs forward
    # beside the largest device cache of the plan.
    on_dev = max([blk.cache_bytes for blk in blocks if blk.input_cache == "device"], default=0)
    infer = [bb for bb in buckets if m.fits(m.infer_peak(full, bb, on_dev))]
    # Host bytes: the raw views throughout, plus block b's and block b+1's input caches while the
    # latter is built from the former (a block's cache is dropped once the next one is built).
    on_host = [blk.cache_bytes if blk.input_cache == "host" else 0 for blk in blocks] + [0]
    views = 0 if cfg.block_inputs == "fresh" else cfg.cache_views * n * cfg.view_bytes
    host = views + max(a + b for a, b in zip(on_host, on_host[1:]))
    return LocalPlan(blocks=tuple(blocks), target_batch=target, e2e_batch=e2e[-1] if e2e else None,
                     infer_batch=infer[-1] if infer else buckets[0], usable_bytes=cfg.usable_bytes,
                     memory_budget=int(cfg.memory_budget), layers=tuple(layers),
                     cache_views=0 if cfg.block_inputs == "fresh" else cfg.cache_views,
                     host_peak_bytes=host)


def select_exit(accuracies: Sequence[float], tolerance: float) -> int:
    """Index of the smallest prefix whose exit accuracy is within `tolerance` of the best.

    accuracies: per exit, in depth order, fractions in [0, 1]. tolerance: in the same units (0.01 =
    one point), [0, 1]. Returns the first i with accuracies[i] >= max(accuracies) - tolerance
    (a 1e-12 slack absorbs the float error of the subtraction).
    """
    accs = [float(a) for a in accuracies]
    if not accs:
        raise ValueError("accuracies: empty; at least one exit is needed")
    if any(not (0.0 <= a <= 1.0) for a in accs):
        raise ValueError(f"accuracies={accs!r}: each must be a fraction in [0, 1]")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0.0 <= tolerance <= 1.0:
        raise ValueError(f"tolerance={tolerance!r}: allowed [0, 1] (fraction of accuracy, 0.01 = one point)")
    floor = max(accs) - tolerance - 1e-12
    return next(i for i, a in enumerate(accs) if a >= floor)


# -- What the backends' trainers share: head initialisation, the block schedule, OOM halving -------

def head_init(in_channels: int, width: int, num_classes: int, *, seed: int, index: int) -> dict[str, Any]:
    """Initial weights of block `index`'s auxiliary head (the `head_cost` layout) in the canonical
    layout (torch ``state_dict`` names and shapes), from NumPy's PCG64 seeded with (seed, index), so
    that both backends start from the same heads (as `triaccel.layout.init_canonical` does for the
    models, with its distributions: conv He-normal with fan_out, linear U(+-1/sqrt(in)), biases 0,
    BatchNorm 1/0/0/1).

    width 0: ``fc.weight`` (num_classes, in_channels), ``fc.bias``. width w > 0 also ``body.0.weight``
    (w, in_channels, 3, 3) and ``body.1.{weight, bias, running_mean, running_var, num_batches_tracked}``.
    Float arrays are float32, num_batches_tracked int64 (0-d).
    """
    c, w, k = _pos_int("in_channels", in_channels), _pos_int("width", width, 0), _pos_int("num_classes", num_classes)
    rng = np.random.default_rng([_pos_int("seed", seed, 0), _pos_int("index", index, 0)])
    out: dict[str, Any] = {}
    if w > 0:
        out["body.0.weight"] = rng.normal(0.0, math.sqrt(2.0 / (w * 9)), size=(w, c, 3, 3)).astype(np.float32)
        out["body.1.weight"] = np.ones(w, np.float32)
        out["body.1.bias"] = np.zeros(w, np.float32)
        out["body.1.running_mean"] = np.zeros(w, np.float32)
        out["body.1.running_var"] = np.ones(w, np.float32)
        out["body.1.num_batches_tracked"] = np.zeros((), np.int64)
    fan_in = w if w > 0 else c
    bound = 1.0 / math.sqrt(fan_in)
    out["fc.weight"] = rng.uniform(-bound, bound, size=(k, fan_in)).astype(np.float32)
    out["fc.bias"] = np.zeros(k, np.float32)
    return out


def micro_batches(batch: int) -> tuple[int, ...]:
    """batch, batch/2, ... while whole, ascending: the micro-batches an OOM can fall back to."""
    out = [_pos_int("batch", batch)]
    while out[-1] % 2 == 0 and out[-1] > 1:
        out.append(out[-1] // 2)
    return tuple(sorted(out))


@dataclass(frozen=True)
class BlockRun:
    """How block `index` trains, the same in both backends.

    epochs: its epochs. batch: samples per optimizer step (the plan's). lr: the base lr scaled
    linearly from lr_batch to batch. seed: its loader's data-order seed. micro_batches: the sizes an
    out-of-memory error falls back to (gradients accumulated over the logical batch). source: where
    its input comes from: "data" (block 0: freshly augmented images), "cache" (the previous block's
    cached outputs), "recompute" (the frozen prefix run on the fixed views every step, the
    reference the cache must match) or "fresh" (the frozen prefix run on freshly augmented images).
    cache_after: where the cache built after it lives ("device", "host"), None when none is built
    (the last block, no caching, or a fresh next block). Epoch e of a block reads
    fixed view ``view(e, n_views)``.
    """

    index: int
    epochs: int
    batch: int
    lr: float
    seed: int
    micro_batches: tuple[int, ...]
    source: str
    cache_after: str | None

    @staticmethod
    def view(epoch: int, n_views: int) -> int:
        """The fixed augmentation epoch `epoch` reads: epoch mod n_views."""
        return _pos_int("epoch", epoch, 0) % _pos_int("n_views", n_views)

    def controller_config(self, memory_budget: int) -> Any:
        """The block's `TriAccelConfig`: a fixed logical batch, every lever off, micro-batches
        accumulated after an OOM (the elastic machinery's replay), an epoch's short last step as a
        plain loop's (short_step_lr="batch": the block's CUDA graph runs it so, `GraphedStep.run_eager`)."""
        from .config import TriAccelConfig

        return TriAccelConfig(batch_init=self.batch, batch_min=self.micro_batches[0], batch_max=self.batch,
                              batch_buckets=self.micro_batches, lr_rule="accumulate", elastic_batch=False,
                              adaptive_precision=False, curvature="off", batch_multiple=1, memory_budget=memory_budget,
                              short_step_lr="batch")


def check_views(num_samples: int, view_rows: Sequence[int], label_rows: int,
                runs: Sequence["BlockRun"] | None = None) -> None:
    """The trainers' training-set views: each with `num_samples` rows, as many labels; at least one
    unless `runs` (the blocks' `BlockRun`s) show that none reads them (a "fresh" plan)."""
    needed = runs is None or any(r.source in ("cache", "recompute") for r in runs)
    if needed and not view_rows:
        raise ValueError("views: at least one fixed augmentation of the training set is needed")
    if any(int(r) != num_samples for r in view_rows) or int(label_rows) != num_samples:
        raise ValueError(f"views / train_y: each must have {num_samples} rows, like train_x")


BLOCK_INPUTS = ("cache", "recompute")


def block_runs(plan: LocalPlan, epochs: int | Sequence[int], *, lr: float, lr_batch: int, seed: int,
               inputs: str = "cache") -> tuple[BlockRun, ...]:
    """One `BlockRun` per block of `plan`. epochs: an int for every block, or one per block (>= 1).
    lr: the base lr at lr_batch samples, (0, inf). seed: block b's loader seed is seed + 1000 * b.
    inputs: what a block b > 0 of a caching plan reads: "cache" (block outputs cached over the
    fixed views) or "recompute" (the frozen prefix run every step on the same fixed views: the
    cache's reference). A block the plan marks "fresh" (`LocalPlanConfig.block_inputs`) reads the
    frozen prefix on freshly augmented images either way."""
    if inputs not in BLOCK_INPUTS:
        raise ValueError(f"inputs={inputs!r}: allowed {', '.join(BLOCK_INPUTS)}")
    nb = len(plan.blocks)
    ep = [epochs] * nb if isinstance(epochs, numbers.Integral) else list(epochs)
    if len(ep) != nb or any(isinstance(e, bool) or not isinstance(e, numbers.Integral) or e < 1 for e in ep):
        raise ValueError(f"epochs={epochs!r}: one integer >= 1, or {nb} of them (one per block)")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0 or not math.isfinite(lr):
        raise ValueError(f"lr={lr!r}: allowed (0, inf)")
    lr_batch = _pos_int("lr_batch", lr_batch)
    seed = _pos_int("seed", seed, 0)
    out = []
    for b, blk in enumerate(plan.blocks):
        source = "data" if b == 0 else "fresh" if blk.input_cache == "fresh" else inputs
        nxt = plan.blocks[b + 1].input_cache if b + 1 < nb else None
        after = nxt if inputs == "cache" and nxt in ("device", "host") else None
        out.append(BlockRun(index=b, epochs=int(ep[b]), batch=blk.batch, lr=float(lr) * blk.batch / lr_batch,
                            seed=seed + 1000 * b, micro_batches=micro_batches(blk.batch), source=source,
                            cache_after=after))
    return tuple(out)


@dataclass
class BlockRecord:
    """What training one block did: per epoch train loss (mean over the samples of steps that were
    not skipped) and seconds; steps (skipped ones included); steps skipped for non-finite gradients;
    OOMs survived; peak device bytes while it trained (None where the device reports none); seconds
    to build the next block's cache and the peak bytes then. graph_steps: steps replayed from a
    captured CUDA graph (the rest ran eagerly); graph_pool_bytes: what the allocator reserved for the
    capture (None: no capture); graph_note: why a block that could have been
    captured was not (empty otherwise); graph_recaptures: epochs whose short last batch ran out of
    memory beside the graph's pool, so the graph was released for it and captured again from the
    next epoch's full batches; graph_retries: failed captures or OOMs beside the graph after which
    the block warmed up and captured again (the last failure, if it gave up, in graph_note);
    graph_micro_batch: the micro-batch its graphed step ran its batch in, gradients accumulated (the
    batch unless a failed capture halved it; None without graphs; torch only);
    peak_reserved_bytes: the allocator's peak reservation (a
    graph's private pool is reserved for its life but counts as allocated only while captured
    tensors are alive). precision: the block's compute precision at its end ("fp16" | "bf16" |
    "fp32"); promoted_at: the step whose read promoted it (`NonFinitePolicy.promote`), None if none.
    lr_scales: the curvature lever's LR scale after each measurement (`BlockCurvature`; empty without)."""

    index: int
    batch: int
    epoch_losses: list[float] = field(default_factory=list)
    epoch_seconds: list[float] = field(default_factory=list)
    steps: int = 0
    skipped_steps: int = 0
    ooms: int = 0
    peak_bytes: int | None = None
    cache_seconds: float = 0.0
    cache_peak_bytes: int | None = None
    graph_steps: int = 0
    graph_pool_bytes: int | None = None
    graph_note: str = ""
    graph_recaptures: int = 0
    graph_retries: int = 0
    graph_micro_batch: int | None = None
    peak_reserved_bytes: int | None = None
    precision: str = ""
    promoted_at: int | None = None
    lr_scales: list[float] = field(default_factory=list)

    def promote(self, new: Precision) -> str:
        """Record the block's move to `new` compute precision at its current step (both trainers,
        after `NonFinitePolicy.precision_after`); returns the warning's text."""
        note = (f"block {self.index}: non-finite gradients skipped by step {self.steps}: compute precision "
                f"{self.precision} -> {new.short} for the rest of the block")
        self.precision, self.promoted_at = new.short, self.steps
        return note

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def halving_on_oom(fn: Any, batch: int, *, is_oom: Any, free_memory: Any) -> int:
    """fn(batch) over a whole pass; after an out-of-memory error (``is_oom(exc)``) the pass restarts
    at half the batch, after ``free_memory()`` (called outside the except block: its frames held the
    failed pass's buffers). For inference passes only: they leave nothing behind but their outputs,
    which a rerun overwrites. Returns the batch that completed; re-raises other errors, and an OOM at
    batch 1."""
    batch = _pos_int("batch", batch)
    while True:
        failed = False
        try:
            fn(batch)
        except Exception as exc:  # noqa: BLE001 - re-raised unless it is an OOM
            if not is_oom(exc) or batch <= 1:
                raise
            failed = True
        if not failed:
            return batch
        free_memory()
        batch //= 2


# -- Non-finite steps: skipped on the device, checked on the host now and then ---------------------

class BlockCurvature:
    """The curvature lever per block, one object per training run (both backends, same numbers).

    At the end of every `every`-th epoch of a block the backend measures the top eigenvalue of the
    empirical Fisher of each of the block's layers (its units and head, eval mode, FP32) on `samples`
    training samples (the same rows each time: the first `samples` of a permutation seeded with the
    block's loader seed, un-augmented, or the block's cached / fixed view) and passes them to
    `observe`; the block's LR is multiplied by 1 / (1 + alpha * lambda_max)
    (`triaccel.curvature.lr_scales_from_eigs`, lambda_max the largest of its layers') from then on.
    alpha None: calibrated at the run's first measurement with a positive lambda_max to
    1 / lambda_max (scale 1/2 there), as the end-to-end law calibrates on its sharpest layer; a block
    starts at scale 1. A measurement with NaN/Inf (a non-finite sample among the rows) keeps the
    block's scale, with a warning.

    Memory: the empirical Fisher's exact top eigenvalue comes from the b x b Gram matrix of b
    per-sample gradients, which a measurement holds at once: about samples x the block's parameters
    x 4 bytes (16 x ResNet-18's layer4, 8.4 M parameters: 0.54 GB). A measurement that runs out of
    memory is repeated on the first half of its rows (`measure`, `halving_on_oom`), down to one (and
    skipped, the scale kept, if one row does not fit); `samples_used` records what each one read.

    every: epochs between measurements, >= 1. samples: rows per measurement, >= 2. alpha: > 0, or None.
    """

    def __init__(self, every: int = 1, samples: int = 16, alpha: float | None = None) -> None:
        self.every = _pos_int("every", every)
        self.samples = _pos_int("samples", samples, 2)
        if alpha is not None and not (isinstance(alpha, numbers.Real) and math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"alpha={alpha!r}: allowed (0, inf) or None (calibrated)")
        self.alpha = None if alpha is None else float(alpha)
        self.lam_max: dict[int, list[float]] = {}   # block -> lambda_max per measurement
        self.samples_used: dict[int, list[int]] = {}   # block -> rows each measurement read
        self.scales: dict[int, float] = {}   # block -> the LR scale in force

    @staticmethod
    def checked(curvature: Any) -> BlockCurvature | None:
        """A trainer's `curvature` argument: a BlockCurvature or None, else ValueError naming it."""
        if curvature is not None and not isinstance(curvature, BlockCurvature):
            raise ValueError(f"curvature: expected a triaccel.local_plan.BlockCurvature or None, "
                             f"got {type(curvature).__name__}")
        return curvature

    def due(self, epoch: int) -> bool:
        """Whether a block measures at the end of its epoch `epoch` (0-based)."""
        return (_pos_int("epoch", epoch, 0) + 1) % self.every == 0

    def rows(self, num_samples: int, seed: int) -> np.ndarray:
        """The training rows (int64, (min(samples, num_samples),)) every measurement of a block reads."""
        n = _pos_int("num_samples", num_samples)
        return np.random.default_rng(seed).permutation(n)[:min(self.samples, n)].astype(np.int64)

    def measure(self, block: int, eigvals_of: Any, rows: int, *, is_oom: Any, free_memory: Any) -> float:
        """Run a backend's measurement and `observe` it: eigvals_of(k) -> block `block`'s per-layer
        eigenvalues on the first k of its `rows` rows, repeated on half the rows after an
        out-of-memory error (``is_oom(exc)``, then ``free_memory()``); one that runs out of memory at
        one row keeps the block's scale, with a warning. Returns the block's LR scale."""
        out: list[Any] = []

        def run(k: int) -> None:
            out[:] = [eigvals_of(k)]

        used = 0
        try:
            used = halving_on_oom(run, rows, is_oom=is_oom, free_memory=free_memory)
        except Exception as exc:  # noqa: BLE001 - re-raised unless it is an OOM
            if not is_oom(exc):
                raise
        if not used:
            free_memory()   # outside the except block: its frames held the failed pass's buffers
            warnings.warn(f"block {block}: curvature measurement out of memory at one row: the block's LR "
                          "scale is kept", RuntimeWarning, stacklevel=2)
            return self.scales.get(block, 1.0)
        return self.observe(block, out[0], samples=used)

    def observe(self, block: int, eigvals: Any, samples: int | None = None) -> float:
        """Block `block`'s per-layer top eigenvalues ((L,) or (L, k), finite), measured on `samples`
        rows (default: `self.samples`) -> its LR scale in (0, 1]."""
        used = self.samples if samples is None else _pos_int("samples", samples)
        block = _pos_int("block", block, 0)
        lam = np.asarray(eigvals, dtype=np.float64)
        if lam.size == 0:
            raise ValueError("eigvals: need at least one value")
        if not np.isfinite(lam).all():
            warnings.warn(f"block {block}: curvature measurement on {used} rows gave non-finite eigenvalues "
                          "(a non-finite sample among them?): the block's LR scale is kept", RuntimeWarning,
                          stacklevel=2)
            self.lam_max.setdefault(block, []).append(float("nan"))
            self.samples_used.setdefault(block, []).append(used)
            return self.scales.get(block, 1.0)
        lam_max = float(lam.max())
        if self.alpha is None and lam_max > 0:
            self.alpha = 1.0 / lam_max
        self.lam_max.setdefault(block, []).append(lam_max)
        self.samples_used.setdefault(block, []).append(used)
        scale = 1.0 if self.alpha is None else float(lr_scales_from_eigs(np.array([lam_max]), self.alpha)[0])
        self.scales[block] = scale
        return scale


class NonFiniteTraining(RuntimeError):
    """A block kept producing non-finite gradients: it diverged (see `NonFinitePolicy`)."""


class BlockOutOfMemory(RuntimeError):
    """A block ran out of memory at its smallest micro-batch (the message names the block, its plan
    and what the device held)."""

    @staticmethod
    def message(plan: LocalPlan, block: int, step: int, error: str, device_state: str) -> str:
        """The error's text: block `block` of `plan` failed at its optimizer step `step` with `error`
        (the elastic machinery's); device_state: what the backend saw on the device then."""
        blk = plan.blocks[block]
        return (f"block {block} ({blk.names[0]}..{blk.names[-1]}, planned batch {blk.batch}, modelled peak "
                f"{blk.peak_bytes} bytes of {plan.usable_bytes} usable, budget {plan.memory_budget} bytes) at its "
                f"step {step}: {error}; device: {device_state}")


@dataclass(frozen=True)
class NonFinitePolicy:
    """How the local trainers treat optimizer steps whose gradients hold NaN/Inf, in both backends.

    Such a step is skipped on the device, with no host sync (weights and optimizer state untouched:
    the TriAccel wrapper's guard in torch, ``optax.apply_if_finite`` in JAX); the device keeps
    (skipped, consecutive) counters. Every `check_every` optimizer steps and at each epoch's end the
    host reads them (one transfer): new skips restore the block's non-parameter state (BatchNorm
    statistics, which a skipped step's forward pass moved) from the last check that found none,
    and `consecutive` >= `patience` raises `NonFiniteTraining` naming the block and the steps.
    A skipped step's samples count as seen (the schedule moves on) but not in the epoch's loss.
    The precision lever, per block: with `promote`, the first read that finds new skips promotes
    the block to FP32 compute for the rest of its training and as a frozen prefix after it
    (`precision_after`; a reduced-precision forward or backward that overflowed gets FP32's range, the
    way the end-to-end control law promotes a layer); the trainers record it in
    `BlockRecord.precision` and `promoted_at`. Off by default: under bf16 (the trainers' default) a
    non-finite gradient rarely comes from the format's range, one bad batch would slow the block for
    good, and FP32 activations need about twice the memory the plan gave the block at bf16 (its steps
    then survive on the elastic path's smaller micro-batches); it is for FP16 compute.

    patience: consecutive skipped steps that end training, >= 1. check_every: optimizer steps between
    host reads, >= 1. promote: whether new skips promote the block to FP32.
    """

    patience: int = 10
    check_every: int = 20
    promote: bool = False

    def __post_init__(self) -> None:
        _pos_int("patience", self.patience)
        _pos_int("check_every", self.check_every)
        if not isinstance(self.promote, bool):
            raise ValueError(f"promote={self.promote!r}: allowed True or False")

    def precision_after(self, fresh_skips: bool, current: Any) -> Precision:
        """A block's compute precision after a host read: FP32 when the read found new skips
        (`fresh_skips`, what `check` returns) and `promote` is on, else `current` (a Precision, or
        anything `Precision.parse` reads: "bf16", a framework dtype)."""
        cur = Precision.parse(current, "current")
        return Precision.FP32 if (self.promote and fresh_skips) else cur

    def due(self, steps: int) -> bool:
        """Whether the host reads the counters after `steps` optimizer steps of a block."""
        return _pos_int("steps", steps, 0) % self.check_every == 0

    def until_due(self, steps: int) -> int:
        """Optimizer steps from `steps` to the next read (1..check_every): a backend that runs several
        steps per call ends the call there, so its reads fall where a step-by-step loop's would."""
        return self.check_every - _pos_int("steps", steps, 0) % self.check_every

    def check(self, block: int, steps: int, skipped: int, consecutive: int, skipped_before: int) -> bool:
        """Judge one host read after `steps` optimizer steps of block `block`: `skipped` in all,
        the last `consecutive` of them in a row, `skipped_before` at the previous read. Returns
        whether steps were skipped since then (the backend then restores the saved statistics);
        raises NonFiniteTraining when `consecutive` >= patience."""
        steps, skipped, consecutive = (_pos_int(n, v, 0) for n, v in
                                       (("steps", steps), ("skipped", skipped), ("consecutive", consecutive)))
        if consecutive > skipped or skipped > steps:
            raise ValueError(f"consecutive={consecutive}, skipped={skipped}, steps={steps}: "
                             "need consecutive <= skipped <= steps")
        if consecutive >= self.patience:
            raise NonFiniteTraining(
                f"block {block}: the last {consecutive} optimizer steps (steps {steps - consecutive}..{steps - 1} "
                f"of the block, counted from 0) had non-finite gradients and were skipped ({skipped} skipped in "
                f"all, patience {self.patience}): the block diverged; lower its learning rate (lr, or a smaller "
                "block batch under the linear rule) or check its inputs")
        return skipped > _pos_int("skipped_before", skipped_before, 0)
