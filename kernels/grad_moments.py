"""Per-segment gradient moments (sum, sum of squares, non-finite count) in one launch.

One ``@triton.jit`` kernel serves torch (direct launch) and JAX (``jax_triton.triton_call``).
It walks a *row table*, one row per program: ``(seg, start, len, code, nrows)``. A segment (one
layer's gradient) is split into rows of about ``chunk`` elements, ``chunk`` chosen from the total
size and the GPU's SM count (a few long programs per SM for huge inputs, many short ones for small
inputs); a row reads its first elements up to a 16-element boundary with a masked load, then
unmasked 128-bit vector loads in an unrolled loop, then a masked tail.

Fast path: without write-back, a row first sums ``x`` and ``x*x`` with no finiteness test (two
FP32 operations per element); a non-finite value anywhere in the row makes that sum non-finite,
and only then is the row read again with the exact test below (same result in every case, the
extra read only on rows holding Inf/NaN or sums beyond FP32 range).

Finishing a segment of several rows (torch): each program adds its partial results into a
per-layout accumulator with atomics and counts itself in a per-segment counter; the segment's
last program moves the totals into ``out`` and resets accumulator and counter to zero. So ``out``
needs no zeroing launch, and single-row segments write ``out`` directly with no atomic. The
accumulator belongs to the cached launch plan: one layout must not be reduced by two launches
that run at the same time on different streams. JAX zeroes ``out`` (jax-triton ``zeroed_outputs``)
and accumulates into it. The order of the float additions across rows is not fixed, so results
may differ in the last bits from run to run.

Two addressing modes share the kernel; both address memory as *typed pointer + element offset*
(an ``int -> pointer`` cast would hide the alignment from the compiler and forbid vector loads):

- ``MODE=0`` (flat): ``start`` is the element offset in one flat buffer ``x`` (the JAX path, and
  torch when the gradients already live in one flat buffer);
- ``MODE=1`` (torch list): ``start`` is the element offset from a reference tensor of the same
  dtype (``code`` 0 fp32, 1 fp16, 2 bf16; one reference pointer argument per dtype; offsets may be
  negative), so a list of separate tensors, even of mixed dtypes, is read in place with no copy.
  A list of one dtype compiles with that dtype fixed (no branch on ``code``).

Launch plans (torch): the row table, accumulator and a prebuilt launcher are cached per layout,
keyed by every tensor's shape, strides and dtype (a hit re-validates nothing else). The addresses
are the per-call part (gradients re-allocated each step come back elsewhere): when they moved,
each segment's offset from its dtype's reference goes to a small device array (``BASED``) through
a pinned, non-blocking copy. A call costs the key, the addresses, at most that copy and one launch,
and never a host sync.

Semantics (shared by the kernel and both references):

- ``x`` is converted to FP32 and, with ``inv_scale``, multiplied by it in FP32 (the unscaled gradient);
- a value is non-finite when the unscaled FP32 value is NaN or ±Inf. Non-finite values are *counted*
  and *excluded* from ``sum``/``sumsq``, so the statistics never turn into NaN (which an on-device EMA
  would keep forever). As with ``GradScaler``, a step with any non-finite value is skipped, and its
  statistics should be discarded by the caller (``nonfinite > 0``);
- ``sumsq`` is accumulated in FP32 and overflows to +Inf for finite values beyond ~1.8e19 (while
  ``nonfinite`` stays 0);
- torch only, with ``found_inf``: the same launch stores 1.0 into that 1-element flag when any
  segment counts a non-finite value, and never clears it (the caller zeroes it);
- with ``inv_scale`` the unscaled values are written back in the input dtype (torch: in place, as
  ``GradScaler.unscale_`` does; JAX: returned as new arrays);
- inside the kernel the non-finite count is accumulated as FP32 (exact up to 2**24 per segment);
  the public API returns it as int32;
- FP64 inputs never reach the kernel: their segments are reduced with the framework's own ops
  (the references below) in FP64 — unscaled, tested for finiteness and accumulated in FP64 — and
  the three results rounded to FP32 (a finite FP64 sum beyond FP32's range becomes ±Inf there).
  Mixed lists launch the kernel for the other segments and fill the FP64 rows after it.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from . import _dispatch as D

try:  # triton is optional: without it only the reference implementations are available
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

# impls for JAX arrays only: XLA's own reductions inside the jitted step (no kernel, no write-back)
JAX_ONLY_IMPLS = ("xla",)

# Default launch configuration: BLOCK elements per load, ITERS loads per unrolled step, rows of
# at least BLOCK*ITERS elements, about PER_SM rows per SM (benchmarks/kernels.py --sweep).
BLOCK = 1024
ITERS = 4
NUM_WARPS = 4
PER_SM = 8
# no-write-back rows sum without a finiteness test first (see the module docstring)
FAST = True

FP32_MAX = 3.4028234663852886e38


class Moments(NamedTuple):
    """Per-segment statistics, each of shape (n,): sum and sumsq float32, nonfinite int32."""

    sum: Any
    sumsq: Any
    nonfinite: Any


if triton is not None:

    @triton.jit
    def _accumulate(xp, yp, idx, m, s, acc_s, acc_q, acc_n, MASKED: tl.constexpr, SCALE: tl.constexpr,
                    WRITE: tl.constexpr, EXACT: tl.constexpr):
        # One vector of elements xp[idx] (lanes off `m` read as 0.0 when MASKED): unscale, write
        # back (WRITE), and add to the accumulators; EXACT counts and excludes non-finite values.
        if MASKED:
            x = tl.load(xp + idx, mask=m, other=0.0).to(tl.float32)
        else:
            x = tl.load(xp + idx).to(tl.float32)
        if SCALE != 0:
            x = x * s
        if WRITE:
            if MASKED:
                tl.store(yp + idx, x.to(yp.dtype.element_ty), mask=m)
            else:
                tl.store(yp + idx, x.to(yp.dtype.element_ty))
        if EXACT:
            fin = tl.abs(x) <= 3.4028234663852886e38  # False for NaN and ±Inf
            x = tl.where(fin, x, 0.0)
            acc_n += (~fin).to(tl.int32)  # masked lanes hold 0.0: finite
        return acc_s + x, acc_q + x * x, acc_n

    @triton.jit
    def _row_pass(xp, yp, a0, n, s, SCALE: tl.constexpr, WRITE: tl.constexpr, EXACT: tl.constexpr,
                  BLOCK: tl.constexpr, ITERS: tl.constexpr):
        # Elements xp[a0 : a0+n] (typed pointer + element offset; xp is 16-byte aligned): a masked
        # head up to the first multiple of 16, unmasked vector loads in steps of BLOCK*ITERS, a
        # masked tail. EXACT: test each value for finiteness (count and exclude); else plain sums.
        offs = tl.arange(0, BLOCK)
        acc_s = tl.zeros([BLOCK], dtype=tl.float32)
        acc_q = tl.zeros([BLOCK], dtype=tl.float32)
        acc_n = tl.zeros([BLOCK], dtype=tl.int32)
        head = tl.minimum((-a0) & 15, n)
        if head > 0:
            acc_s, acc_q, acc_n = _accumulate(xp, yp, a0 + offs, offs < head, s, acc_s, acc_q, acc_n,
                                              True, SCALE, WRITE, EXACT)
        g = tl.multiple_of(a0 + head, 16)
        body = n - head
        nmain = body // (BLOCK * ITERS)
        for i in range(nmain):
            for u in tl.static_range(ITERS):
                idx = g + i * (BLOCK * ITERS) + u * BLOCK + offs
                acc_s, acc_q, acc_n = _accumulate(xp, yp, idx, offs < BLOCK, s, acc_s, acc_q, acc_n,
                                                  False, SCALE, WRITE, EXACT)
        t0 = nmain * (BLOCK * ITERS)
        for t in range(t0, body, BLOCK):
            acc_s, acc_q, acc_n = _accumulate(xp, yp, g + t + offs, t + offs < body, s, acc_s, acc_q, acc_n,
                                              True, SCALE, WRITE, EXACT)
        return tl.sum(acc_s, axis=0), tl.sum(acc_q, axis=0), tl.sum(acc_n, axis=0)

    @triton.jit
    def _row_moments(xp, yp, a0, n, s, SCALE: tl.constexpr, WRITE: tl.constexpr, FAST: tl.constexpr,
                     BLOCK: tl.constexpr, ITERS: tl.constexpr):
        if FAST and not WRITE:
            cs, cq, cn = _row_pass(xp, yp, a0, n, s, SCALE, False, False, BLOCK, ITERS)
            # any Inf/NaN in the row made cs non-finite: read the row again, testing each value
            if (cs != cs) | (tl.abs(cs) > 3.4028234663852886e38):
                cs, cq, cn = _row_pass(xp, yp, a0, n, s, SCALE, False, True, BLOCK, ITERS)
        else:
            cs, cq, cn = _row_pass(xp, yp, a0, n, s, SCALE, WRITE, True, BLOCK, ITERS)
        return cs, cq, cn

    @triton.jit
    def _moments_kernel(x_ptr, h_ptr, b_ptr, table_ptr, base_ptr, scale, acc_ptr, cnt_ptr, found_ptr, out_ptr,
                        y_ptr, MODE: tl.constexpr, DT: tl.constexpr, SCALE: tl.constexpr, WRITE: tl.constexpr,
                        FAST: tl.constexpr, FINISH: tl.constexpr, BASED: tl.constexpr, FOUND: tl.constexpr,
                        BLOCK: tl.constexpr, ITERS: tl.constexpr):
        """One program per row ``(seg, start, len, code, nrows)`` of ``table_ptr``.

        MODE 0: ``start`` = element offset in the flat input ``x_ptr``; unscaled values go to
        ``y_ptr`` (WRITE). MODE 1: ``start`` = element offset from the reference pointer of the
        row's dtype (``code`` 0: ``x_ptr`` fp32, 1: ``h_ptr`` fp16, 2: ``b_ptr`` bf16), written back
        in place. BASED: ``start`` is relative to the segment and ``base_ptr[seg]`` (int64) adds the
        segment's own offset (the per-call part of a torch list's addresses); else unused.
        DT: the dtype code when all rows share it, 3 for mixed (branch on ``code``).
        scale: pointer to one FP32 value (SCALE 1), an FP32 value (SCALE 2) or unused (SCALE 0).
        out_ptr: (n, 3) FP32. FINISH 0: ``out`` zeroed by the caller, accumulated with atomics.
        FINISH 1: single-row segments store into ``out``; others add into ``acc_ptr`` (n, 3) and
        count in ``cnt_ptr`` (n,) int32, both zero at entry; a segment's last program moves the
        totals to ``out`` and zeroes both again. FOUND (FINISH 1 only): a segment whose non-finite
        count is > 0 stores 1.0 into ``found_ptr[0]`` (FP32; never cleared here).
        """
        pid = tl.program_id(0).to(tl.int64)
        row = table_ptr + pid * 5
        seg = tl.load(row).to(tl.int64)
        a0 = tl.load(row + 1).to(tl.int64)
        if BASED:
            a0 += tl.load(base_ptr + seg)
        n = tl.load(row + 2).to(tl.int64)
        nrows = tl.load(row + 4).to(tl.int32)
        if SCALE == 1:
            s = tl.load(scale).to(tl.float32)
        elif SCALE == 2:
            s = scale  # an fp32 kernel argument
        else:
            s = 1.0
        if MODE == 0:
            cs, cq, cn = _row_moments(x_ptr, y_ptr, a0, n, s, SCALE, WRITE, FAST, BLOCK, ITERS)
        elif DT == 0:
            cs, cq, cn = _row_moments(x_ptr, x_ptr, a0, n, s, SCALE, WRITE, FAST, BLOCK, ITERS)
        elif DT == 1:
            cs, cq, cn = _row_moments(h_ptr, h_ptr, a0, n, s, SCALE, WRITE, FAST, BLOCK, ITERS)
        elif DT == 2:
            cs, cq, cn = _row_moments(b_ptr, b_ptr, a0, n, s, SCALE, WRITE, FAST, BLOCK, ITERS)
        else:
            code = tl.load(row + 3)
            if code == 0:
                cs, cq, cn = _row_moments(x_ptr, x_ptr, a0, n, s, SCALE, WRITE, FAST, BLOCK, ITERS)
            elif code == 1:
                cs, cq, cn = _row_moments(h_ptr, h_ptr, a0, n, s, SCALE, WRITE, FAST, BLOCK, ITERS)
            else:
                cs, cq, cn = _row_moments(b_ptr, b_ptr, a0, n, s, SCALE, WRITE, FAST, BLOCK, ITERS)
        cnf = cn.to(tl.float32)
        o = out_ptr + seg * 3
        if FINISH == 0:
            tl.atomic_add(o, cs)
            tl.atomic_add(o + 1, cq)
            tl.atomic_add(o + 2, cnf)
        elif nrows == 1:
            tl.store(o, cs)
            tl.store(o + 1, cq)
            tl.store(o + 2, cnf)
            if FOUND:
                if cnf > 0:
                    tl.store(found_ptr, 1.0)   # every writer writes the same value: no atomic needed
        else:
            # scalar atomics run on one thread of the program, in program order: the counter's
            # release orders the three adds before it; the last program's acquire sees them all
            a = acc_ptr + seg * 3
            tl.atomic_add(a, cs, sem="relaxed")
            tl.atomic_add(a + 1, cq, sem="relaxed")
            tl.atomic_add(a + 2, cnf, sem="relaxed")
            done = tl.atomic_add(cnt_ptr + seg, 1, sem="acq_rel")
            if done == nrows - 1:
                # read through atomics (L2, after the acquire); nothing else touches these
                # addresses in this launch, so plain stores reset them for the next one
                ts = tl.atomic_add(a, 0.0, sem="relaxed")
                tq = tl.atomic_add(a + 1, 0.0, sem="relaxed")
                tn = tl.atomic_add(a + 2, 0.0, sem="relaxed")
                tl.store(o, ts)
                tl.store(o + 1, tq)
                tl.store(o + 2, tn)
                if FOUND:
                    if tn > 0:
                        tl.store(found_ptr, 1.0)
                tl.store(a, 0.0)
                tl.store(a + 1, 0.0)
                tl.store(a + 2, 0.0)
                tl.store(cnt_ptr + seg, 0)


# ----------------------------------------------------------------------------------------------
# References (plain framework ops); used on CPU and as ground truth in tests and the benchmark.
# ----------------------------------------------------------------------------------------------


def moments_reference_torch(tensors: Sequence[Any], inv_scale: Any = None) -> Any:
    """torch reference: (n, 3) float32 [sum, sumsq, nonfinite]; unscales ``tensors`` in place.
    Computes in FP32 (FP64 for float64 tensors)."""
    import torch

    rows = []
    for t in tensors:
        acc = torch.float64 if t.dtype == torch.float64 else torch.float32
        x = t.to(acc)
        if inv_scale is not None:
            x = x * (inv_scale.to(acc) if isinstance(inv_scale, torch.Tensor) else float(inv_scale))
        fin = torch.isfinite(x)
        xf = torch.where(fin, x, torch.zeros((), dtype=acc, device=x.device))
        rows.append(torch.stack([xf.sum(), (xf * xf).sum(), (~fin).sum().to(acc)]).float())
        if inv_scale is not None:
            t.copy_(x)
    return torch.stack(rows).reshape(len(rows), 3)


def moments_reference_jnp(flat: Any, offsets: Sequence[int], inv_scale: Any = None) -> tuple[Any, Any]:
    """jnp reference over a flat buffer: ((n, 3) float32 [sum, sumsq, nonfinite], unscaled flat or None).
    Computes in FP32 (FP64 for a float64 buffer)."""
    import jax
    import jax.numpy as jnp

    off = D.parse_offsets(offsets)
    sizes = np.diff(off)
    n = sizes.size
    acc = jnp.float64 if flat.dtype == jnp.float64 else jnp.float32
    x = flat.astype(acc)
    if inv_scale is not None:
        x = x * jnp.asarray(inv_scale, dtype=acc).reshape(())
    fin = jnp.isfinite(x)
    xf = jnp.where(fin, x, 0.0)
    ids = jnp.asarray(np.repeat(np.arange(n, dtype=np.int32), sizes))
    s = jax.ops.segment_sum(xf, ids, num_segments=n)
    q = jax.ops.segment_sum(xf * xf, ids, num_segments=n)
    c = jax.ops.segment_sum((~fin).astype(jnp.float32), ids, num_segments=n)
    out = jnp.stack([s, q, c], axis=1).astype(jnp.float32)
    return out, (x.astype(flat.dtype) if inv_scale is not None else None)


# Arrays of at most this many elements are reduced together, by size bucket (see below).
SMALL_MAX = 1 << 16
# Larger arrays: 0 = each in one whole reduction (XLA splits it in two stages itself); > 0 = in rows of
# this many elements, every large array's row sums then in one reduction together (see below). XLA made
# 4 kernels of each of ResNet-18's 13 large gradients (an optimized H200 dump of the step, 2026-12-04);
# rows should make 1 each and 1 for all. 0 until that is dumped and timed on a GPU.
ROW = 0


class StackLayout(NamedTuple):
    """How `moments_reference_jnp_tree` groups a list of arrays: groups[j] = (length, leaf indices),
    the arrays of at most ``small_max`` elements (and of one accumulation dtype) zero-padded to
    ``length`` elements and stacked, one row each; whole: the other leaves, reduced alone; slot: leaf
    index -> (group, row) for the grouped ones. Static: from shapes and dtypes only."""

    groups: tuple[tuple[int, tuple[int, ...]], ...]
    whole: tuple[int, ...]
    slot: dict[int, tuple[int, int]]


def _acc_dtype(a: Any) -> Any:
    import jax.numpy as jnp

    return jnp.float64 if a.dtype == jnp.float64 else jnp.float32


def stack_layout(leaves: Sequence[Any], small_max: int = SMALL_MAX) -> StackLayout:
    """The grouping of `leaves` (arrays or anything with ``size`` and ``dtype``) that
    `moments_reference_jnp_tree` reduces with: an array of 1 to ``small_max`` elements goes to the
    group of its length rounded up to a power of two (at least 16) and its accumulation dtype."""
    groups: dict[tuple[int, Any], list[int]] = {}
    whole: list[int] = []
    for i, a in enumerate(leaves):
        if 0 < a.size <= small_max:
            groups.setdefault((max(16, 1 << (a.size - 1).bit_length()), _acc_dtype(a)), []).append(i)
        else:
            whole.append(i)
    slot = {i: (g, r) for g, idx in enumerate(groups.values()) for r, i in enumerate(idx)}
    return StackLayout(tuple((length, tuple(idx)) for (length, _), idx in groups.items()), tuple(whole), slot)


def _in_leaf_order(blocks: Sequence[tuple[Sequence[int], Any]], n: int, tail: tuple[int, ...]) -> Any:
    """Per-leaf results gathered from blocks of (leaf indices, array with one row per index) into one
    (n, *tail) float32 array in leaf order: one concatenation and one static permutation, not a slice
    per leaf and a stack of them (a few hundred small operations for EfficientNet-B0's 213 arrays, each
    compiled)."""
    import jax.numpy as jnp

    if not blocks:
        return jnp.zeros((n, *tail), jnp.float32)
    order = np.argsort(np.concatenate([np.asarray(idx, np.int64) for idx, _ in blocks]), kind="stable")
    cat = jnp.concatenate([jnp.asarray(a, jnp.float32).reshape(len(idx), *tail) for idx, a in blocks])
    return cat if np.array_equal(order, np.arange(n)) else cat[order]


def _stacked(xs: Sequence[Any], length: int) -> Any:
    """(len(xs), length): each array flattened and zero-padded to `length` elements, one row each."""
    import jax.numpy as jnp

    return jnp.stack([jnp.pad(x.reshape(-1), (0, length - x.size)) for x in xs])


def stacked_zeros(leaves: Sequence[Any], small_max: int = SMALL_MAX) -> tuple[np.ndarray, ...]:
    """Host float32 zeros in `stack_layout`'s stacked form of `leaves`: one (rows, length) array per
    group, then each whole leaf's shape (`stacked_dot`'s companion)."""
    layout = stack_layout(leaves, small_max)
    return (tuple(np.zeros((len(idx), length), np.float32) for length, idx in layout.groups)
            + tuple(np.zeros(np.shape(leaves[i]), np.float32) for i in layout.whole))


def _unscaled(a: Any, inv_scale: Any) -> Any:
    """`a` in its accumulation dtype, times `inv_scale` when given (the moments' unscaling)."""
    import jax.numpy as jnp

    acc = _acc_dtype(a)
    x = a.astype(acc)
    return x if inv_scale is None else x * jnp.asarray(inv_scale, dtype=acc).reshape(())


def stacked_dot(leaves: Sequence[Any], companion: Sequence[Any], inv_scale: Any = None,
                small_max: int = SMALL_MAX) -> tuple[Any, list[Any]]:
    """Per leaf the dot product of the leaf (unscaled by `inv_scale` as `moments_reference_jnp_tree`
    unscales it) with its part of `companion` (float32 arrays in the stacked form `stacked_zeros`
    makes), summed in the leaf's accumulation dtype and returned as float32 (n,), and the unscaled
    leaves themselves in that stacked form (in their accumulation dtype). Given the same leaves and
    scale as `moments_reference_jnp_tree` inside one jitted program, the unscaling and the stacking
    are the same operations, which XLA's common-subexpression pass merges (EfficientNet-B0's update
    on the CPU: no pad or concatenate fusion more than the moments' alone)."""
    import jax.numpy as jnp

    layout = stack_layout(leaves, small_max)
    if len(companion) != len(layout.groups) + len(layout.whole):
        raise ValueError(f"companion: {len(companion)} arrays; the stacked form of these leaves has "
                         f"{len(layout.groups) + len(layout.whole)} (stacked_zeros)")
    xs = [_unscaled(a, inv_scale) for a in leaves]
    blocks: list[tuple[Sequence[int], Any]] = []
    stacks: list[Any] = []
    for (length, idx), c in zip(layout.groups, companion):
        s = _stacked([xs[i] for i in idx], length)
        stacks.append(s)
        blocks.append((idx, jnp.sum(c * s, axis=1)))
    for i, c in zip(layout.whole, companion[len(layout.groups):]):
        stacks.append(xs[i])
        blocks.append(((i,), jnp.sum(c * xs[i])))
    return _in_leaf_order(blocks, len(leaves), ()), stacks


def unstacked(companion: Sequence[Any], leaves: Sequence[Any], small_max: int = SMALL_MAX) -> list[Any]:
    """`companion`'s parts (stacked form, `stacked_zeros`) back in the shapes of `leaves`."""
    layout = stack_layout(leaves, small_max)
    whole = {i: len(layout.groups) + k for k, i in enumerate(layout.whole)}
    out = []
    for i, a in enumerate(leaves):
        if i in layout.slot:
            g, r = layout.slot[i]
            out.append(companion[g][r, :a.size].reshape(a.shape))
        else:
            out.append(companion[whole[i]].reshape(a.shape))
    return out


def moments_reference_jnp_tree(leaves: Sequence[Any], inv_scale: Any = None, small_max: int = SMALL_MAX,
                               row: int = ROW) -> tuple[Any, list[Any] | None]:
    """jnp reference over separate arrays: ((n, 3) float32 [sum, sumsq, nonfinite], the unscaled arrays
    (each in its own dtype) or None). Sums in FP32 (FP64 for a float64 array), the three in one pass
    XLA fuses with the unscaling; no concatenation of the whole set and no scatter
    (`moments_reference_jnp`'s segment sums are atomics on a GPU), so inside a jitted step the
    unscaled arrays fuse into their consumers and nothing is written back.

    An array of at most ``small_max`` elements is zero-padded to the next power of two (at least 16)
    and stacked with the others of its length, one row reduction per length: a ResNet's BatchNorm
    vectors and small convolutions cost a handful of kernels instead of one or two each (a bs-96 JAX
    step is launch-bound). With ``row > 0`` a larger one is zero-padded to a multiple of ``row`` elements
    and reduced per row, and every large array's row sums go through one more reduction together: XLA would split
    each large array's whole reduction in two stages itself, the second stage three small kernels per
    array (ResNet-18's step on an H200: 4 kernels per large array). ``row=0`` (the default, `ROW`):
    each large array in one whole reduction, XLA's split. Zero padding changes no sum and no count."""
    import jax.numpy as jnp

    if small_max < 0:
        raise ValueError(f"small_max={small_max}: must be >= 0 (elements; 0 reduces every array alone)")
    if row < 0:
        raise ValueError(f"row={row}: must be >= 0 (elements per row of a large array; 0: one whole reduction)")
    blocks: list[tuple[Sequence[int], Any]] = []   # (leaf indices, their (k, 3) rows)
    parts: list[Any] = []
    xs: list[Any] = []   # each leaf in its accumulation dtype, unscaled
    large: dict[Any, list[tuple[int, Any]]] = {}   # accumulation dtype -> [(leaf, (3, R) row sums)]

    def sums(x: Any, axis: Any, out: int = -1) -> Any:  # [sum, sumsq, nonfinite] along `axis`, stacked at `out`
        fin = jnp.isfinite(x)
        xf = jnp.where(fin, x, 0.0)
        return jnp.stack([jnp.sum(xf, axis), jnp.sum(xf * xf, axis), jnp.sum(~fin, axis, dtype=x.dtype)], axis=out)

    layout = stack_layout(leaves, small_max)
    for i, a in enumerate(leaves):
        acc = _acc_dtype(a)
        x = _unscaled(a, inv_scale)
        if inv_scale is not None:
            parts.append(x.astype(a.dtype))
        xs.append(x)
        if i in layout.slot:
            continue
        if row and a.size > row:
            n_rows = -(-a.size // row)
            per_row = sums(jnp.pad(x.reshape(-1), (0, n_rows * row - a.size)).reshape(n_rows, row), 1, out=0)
            large.setdefault(acc, []).append((i, per_row))
        else:
            blocks.append(((i,), sums(x, None)))
    for length, idx in layout.groups:
        blocks.append((idx, sums(_stacked([xs[i] for i in idx], length), 1)))
    for items in large.values():   # (3, n, R_max) row sums, zero-padded: one row reduction
        r_max = max(p.shape[1] for _, p in items)
        stacked = jnp.stack([jnp.pad(p, ((0, 0), (0, r_max - p.shape[1]))) for _, p in items], axis=1)
        blocks.append(([i for i, _ in items], jnp.sum(stacked, axis=2).T))
    return _in_leaf_order(blocks, len(leaves), (3,)), (parts if inv_scale is not None else None)


# ----------------------------------------------------------------------------------------------
# torch launchers
# ----------------------------------------------------------------------------------------------

_PLANS = D.LRU(128)
ADDRESS_SETS = 4   # address sets (and device base buffers) remembered per list plan


def _check_config(block: int, iters: int, num_warps: int, chunk: int | None) -> None:
    if block < D.ALIGN or block & (block - 1):
        raise ValueError(f"block={block}: must be a power of two >= {D.ALIGN}")
    if iters < 1:
        raise ValueError(f"iters={iters}: must be >= 1")
    if num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps={num_warps}: must be a power of two >= 1")
    if chunk is not None and (not isinstance(chunk, int) or chunk < D.ALIGN or chunk % D.ALIGN):
        raise ValueError(f"chunk={chunk!r}: must be None (automatic) or a multiple of {D.ALIGN} >= {D.ALIGN}")


def _rows_table(sizes: np.ndarray, starts: np.ndarray, codes: np.ndarray, total: int, sms: int,
                cfg: tuple) -> np.ndarray:
    """Row table (rows, 5) int64 ``(seg, start, len, code, nrows)`` for segments of ``sizes``
    elements at element offsets ``starts`` (segments with code -1 get no row)."""
    block, iters, _, chunk, per_sm = cfg[:5]
    unit = block * iters
    if chunk is None:
        chunk = D.auto_chunk(total, sms, per_sm, unit)
    keep = np.flatnonzero(codes >= 0)
    seg, start, length, nrows = D.segment_rows(sizes[keep], starts[keep], chunk, unit if chunk >= unit else D.ALIGN)
    seg = keep[seg]
    return np.ascontiguousarray(np.stack([seg, start, length, codes[seg], nrows], axis=1).astype(np.int64))


def _torch_scale(inv_scale: Any, device: Any) -> tuple[int, Any]:
    """(SCALE mode, kernel argument) for ``inv_scale`` given as None, a float or a 1-element tensor."""
    if inv_scale is None:
        return 0, 1.0
    if isinstance(inv_scale, _T):
        if inv_scale.numel() != 1 or inv_scale.dtype != _F32 or inv_scale.device != device:
            raise ValueError(
                f"inv_scale: need a 1-element float32 tensor on {device}, got shape "
                f"{tuple(inv_scale.shape)} {inv_scale.dtype} on {inv_scale.device}")
        return 1, inv_scale
    return 2, _float_scale(inv_scale)


def _float_scale(inv_scale: Any) -> float:
    try:
        v = float(inv_scale)
    except (TypeError, ValueError):
        raise TypeError(f"inv_scale: need a float or a 1-element float32 array, got {type(inv_scale)}") from None
    if not (np.isfinite(v) and v > 0):
        raise ValueError(f"inv_scale={inv_scale!r}: must be finite and > 0")
    return v


def _found(found_inf: Any, device: Any) -> Any:
    """``found_inf`` checked: None, or a 1-element float32 tensor on ``device``."""
    if found_inf is None:
        return None
    if not isinstance(found_inf, _T) or found_inf.numel() != 1 or found_inf.dtype != _F32 \
            or found_inf.device != device:
        desc = (tuple(found_inf.shape), found_inf.dtype, found_inf.device) if isinstance(found_inf, _T) \
            else type(found_inf)
        raise ValueError(f"found_inf: need a 1-element float32 tensor on {device}, got {desc}")
    return found_inf


def _flag_found(found: Any, counts: Any) -> None:
    """Reference paths: found <- 1.0 where any of ``counts`` (non-finite counts) is > 0, on the
    device; nothing when ``found`` is None."""
    import torch

    if found is not None:
        torch.maximum(found, (counts > 0).any().to(found.dtype).reshape(found.shape), out=found)


def _out(out: Any, n: int, device: Any) -> Any:
    import torch

    if out is None:
        return torch.empty((n, 3), dtype=_F32, device=device)
    if not isinstance(out, _T) or out.shape != (n, 3) or out.dtype != _F32 \
            or not out.is_contiguous() or out.device != device:
        desc = (tuple(out.shape), out.dtype, out.device) if isinstance(out, _T) else type(out)
        raise ValueError(f"out: need a contiguous float32 tensor of shape ({n}, 3) on {device}, got {desc}")
    return out


_T = None  # torch.Tensor, bound on first torch use (this module imports no framework at import)
_F32 = None
_DEVICE = None  # attrgetter("device")


def _bind_torch() -> None:
    global _T, _F32, _DEVICE
    import operator

    import torch

    _T, _F32, _DEVICE = torch.Tensor, torch.float32, operator.attrgetter("device")


class _TorchPlan:
    """What one layout needs at launch: device tables, accumulator, launchers (per scale mode).

    A list plan is keyed by shapes, strides and dtypes, not addresses: gradients freed by
    ``zero_grad(set_to_none=True)`` come back at new addresses every step, so the addresses are
    the per-call part: ``base`` (n,) int64 holds each segment's element offset from its dtype's
    reference tensor (minus its residue mod ``ALIGN``, which the row table was built for), uploaded
    from pinned memory without a stream sync when the addresses change. ``bases`` keeps the last
    ``ADDRESS_SETS`` address sets with their device ``base`` and reference pointers: a training
    loop's gradients cycle through a few address sets (measured on an H100: the addresses moved on
    261 of 262 steps of a ResNet-18 epoch), so a set seen before costs no upload."""

    __slots__ = ("n", "device", "triton", "table", "rows", "acc", "cnt", "ref_idx", "wide", "wide_idx",
                 "mode", "dt", "cfg", "launchers", "ptrs", "based", "base", "addrs", "groups", "res", "bases")

    def launcher(self, smode: int, write: bool, found: bool) -> D.Launcher:
        lk = (smode, write, found)
        la = self.launchers.get(lk)
        if la is None:
            block, iters, num_warps, _, _, fast = self.cfg
            la = D.Launcher(_moments_kernel, self.rows, dict(
                MODE=self.mode, DT=self.dt, SCALE=smode, WRITE=write, FAST=fast, FINISH=1,
                BASED=self.based, FOUND=found, BLOCK=block, ITERS=iters, num_warps=num_warps))
            self.launchers[lk] = la
        return la


def _new_plan(n: int, device: Any, use_triton: bool, cfg: tuple) -> _TorchPlan:
    p = _TorchPlan()
    p.n, p.device, p.triton, p.cfg, p.launchers = n, device, use_triton, cfg, {}
    p.wide, p.wide_idx, p.ref_idx = [], None, [-1, -1, -1]
    p.based, p.addrs, p.groups, p.bases = False, None, [], {}
    return p


def _check_torch_impl(impl: str) -> None:
    if impl in JAX_ONLY_IMPLS:
        raise ValueError(f"impl={impl!r}: JAX arrays only (XLA's own reductions in the jitted step); for "
                         f"torch tensors use one of {D.IMPLS}")
    if impl not in D.IMPLS:
        raise ValueError(f"impl={impl!r}: allowed values for torch tensors are {D.IMPLS}")


def _check_jax_impl(impl: str) -> None:
    if impl not in D.IMPLS + JAX_ONLY_IMPLS:
        raise ValueError(f"impl={impl!r}: allowed values for JAX arrays are {D.IMPLS + JAX_ONLY_IMPLS}")


def _device_tables(p: _TorchPlan, tab: np.ndarray) -> None:
    import torch

    p.rows = tab.shape[0]
    p.table = torch.empty(tab.shape, dtype=torch.int64, device=p.device)
    D.upload(p.table, tab)
    p.acc = torch.zeros((p.n, 3), dtype=torch.float32, device=p.device)
    p.cnt = torch.zeros(p.n, dtype=torch.int32, device=p.device)
    # (ref fp32, ref fp16, ref bf16, table, acc, cnt, base) addresses; the refs are set per call
    t = p.table.data_ptr()
    p.ptrs = [t, t, t, t, p.acc.data_ptr(), p.cnt.data_ptr(), t]


def _relative(p: _TorchPlan, addrs: tuple) -> tuple[np.ndarray, np.ndarray]:
    """(addresses, element offsets from each dtype's reference tensor) of a list plan's tensors;
    ValueError when a tensor does not sit a whole number of elements away from its reference."""
    a = np.array(addrs, dtype=np.int64)
    rel = np.zeros(p.n, dtype=np.int64)
    for idx, esize in p.groups:
        d = a[idx] - a[idx[0]]
        bad = idx[d % esize != 0]
        if bad.size:
            raise ValueError(f"tensors[{int(bad[0])}]: address not a multiple of its element size "
                             f"away from tensors[{int(idx[0])}] of the same dtype")
        rel[idx] = d // esize
    return a, rel


def _set_base(p: _TorchPlan, addrs: tuple, a: np.ndarray, rel: np.ndarray) -> None:
    """Point ``p`` at a new address set: upload its offsets (into the oldest remembered set's
    buffer once ``ADDRESS_SETS`` are kept; stream order makes the overwrite safe) and remember it."""
    import torch

    if len(p.bases) >= ADDRESS_SETS:
        base = p.bases.pop(next(iter(p.bases)))[0]
    else:
        base = torch.empty(p.n, dtype=torch.int64, device=p.device)
    D.upload(base, rel - p.res)
    p.bases[addrs] = (base, tuple(int(a[i]) if i >= 0 else -1 for i in p.ref_idx))
    _use_base(p, addrs)


def _use_base(p: _TorchPlan, addrs: tuple) -> None:
    """Point ``p`` at a remembered address set (its base offsets and reference pointers)."""
    base, refs = p.bases[addrs]
    p.base, p.ptrs[6], p.addrs = base, base.data_ptr(), addrs
    for c, ptr in enumerate(refs):
        if ptr >= 0:
            p.ptrs[c] = ptr


def _list_plan(tensors: Sequence[Any], impl: str, cfg: tuple) -> _TorchPlan:
    """Validate a list of tensors once and build its launch plan (based at their addresses)."""
    import torch

    dev = tensors[0].device
    codes = np.empty(len(tensors), dtype=np.int64)
    for i, t in enumerate(tensors):
        codes[i] = D.dtype_code(str(t.dtype), f"tensors[{i}]")
        if t.device != dev:
            raise ValueError(f"tensors[{i}]: on {t.device}, but tensors[0] is on {dev}; all must share a device")
    p = _new_plan(len(tensors), dev, D.use_triton_torch(triton is not None, dev, impl), cfg)
    if not p.triton:
        return p
    for i, t in enumerate(tensors):
        if not D.is_dense(t):
            raise ValueError(f"tensors[{i}]: not dense (strides {t.stride()} for shape {tuple(t.shape)}); "
                             "the kernel reads numel consecutive elements")
    sizes = np.array([t.numel() for t in tensors], dtype=np.int64)
    esize = np.array([t.element_size() for t in tensors], dtype=np.int64)
    for c in range(3):
        idx = np.flatnonzero((codes == c) & (sizes > 0))
        if idx.size:
            p.ref_idx[c] = int(idx[0])
            p.groups.append((idx, esize[idx]))
    wide = codes == D.CODE_FP64  # no kernel rows: torch ops after the launch
    p.wide = np.flatnonzero(wide).tolist()
    p.wide_idx = torch.from_numpy(np.flatnonzero(wide)).to(dev)
    kcodes = np.where(wide, -1, codes)
    # an empty tensor reads nothing: give it a dtype that has a reference pointer, so that a list
    # of one dtype plus empty tensors of another still compiles with its dtype fixed
    live = kcodes[(kcodes >= 0) & (sizes > 0)]
    kcodes = np.where((sizes == 0) & (kcodes >= 0), int(live.min()) if live.size else 0, kcodes)
    present = set(kcodes[kcodes >= 0].tolist())
    p.mode, p.dt, p.based = 1, (present.pop() if len(present) == 1 else 3), True
    addrs = D.torch_addresses(tensors)
    a, rel = _relative(p, addrs)
    # rows are laid out for each segment's alignment (its residue mod ALIGN); base adds the rest
    p.res = rel % D.ALIGN
    _device_tables(p, _rows_table(sizes, p.res, kcodes, int(sizes[~wide].sum()), D.torch_sm_count(dev), cfg))
    _set_base(p, addrs, a, rel)
    return p


def _launch(p: _TorchPlan, refs: Any, y: Any, inv_scale: Any, out: Any, found: Any) -> None:
    """refs: () -> the three reference tensors (called only on a launcher's first use); y: the
    write-back pointer (MODE 0) as a tensor or None for MODE 1; found: a checked found_inf tensor or None."""
    smode, sarg = _torch_scale(inv_scale, p.device)
    if p.rows == 0:
        return
    la = p.launcher(smode, inv_scale is not None, found is not None)
    op = out.data_ptr()
    yp = y.data_ptr() if y is not None else p.ptrs[3]
    fp = found.data_ptr() if found is not None else p.ptrs[3]
    spec = (op & 15, sarg.data_ptr() & 15 if smode == 1 else 0, yp & 15, fp & 15)
    run = la.runners.get(spec)
    if run is not None:  # plain addresses: the compiled launcher takes ints for pointers
        r = p.ptrs
        run(r[0] if y is None else yp, r[1] if y is None else yp, r[2] if y is None else yp, r[3], r[6], sarg,
            r[4], r[5], fp, op, yp, *la.tail)
        return
    r0, r1, r2 = refs()
    la(spec, r0, r1, r2, p.table, p.base if p.based else p.table, sarg, p.acc, p.cnt,
       found if found is not None else p.table, out, y if y is not None else p.table)


def _torch_list(tensors: Sequence[Any], inv_scale: Any, out: Any, found: Any, impl: str,
                cfg: tuple) -> tuple[Any, _TorchPlan]:
    """(out filled, the plan used)."""
    if _T is None:
        _bind_torch()
    # A hit means these shapes/strides/dtypes were validated when the plan was built; the per-call
    # host cost is this key, the addresses (re-based only when they moved) and one launch.
    key = (cfg, impl, D.torch_shape_key(tensors))
    p = _PLANS.get(key)
    if p is None:
        p = _list_plan(tensors, impl, cfg)
        _PLANS.put(key, p)  # no tensors held: the cache must not keep gradients alive
    out = _out(out, p.n, p.device)
    found = _found(found, p.device)
    if not p.triton:
        _torch_scale(inv_scale, p.device)
        out.copy_(moments_reference_torch(tensors, inv_scale))
        _flag_found(found, out[:, 2])
        return out, p
    addrs = D.torch_addresses(tensors)
    if addrs != p.addrs:
        p = _rebase(p, key, tensors, addrs, impl, cfg)
    _launch(p, _refs(p, tensors), None, inv_scale, out, found)
    if p.wide:
        wide = moments_reference_torch([tensors[i] for i in p.wide], inv_scale)
        out.index_copy_(0, p.wide_idx, wide)
        _flag_found(found, wide[:, 2])
    return out, p


def _refs(p: _TorchPlan, tensors: Sequence[Any]) -> Any:
    """() -> the three dtype reference tensors of a list plan (absent dtypes: a placeholder never
    dereferenced); called only on a launcher's first use."""
    return lambda: tuple(tensors[i] if i >= 0 else p.table for i in p.ref_idx)


def _rebase(p: _TorchPlan, key: tuple, tensors: Sequence[Any], addrs: tuple, impl: str, cfg: tuple) -> _TorchPlan:
    """The plan ``p`` pointed at the tensors' new addresses (a new plan if a segment's alignment
    changed, which the caching allocator's 512-byte blocks make rare)."""
    if addrs in p.bases:
        # validated when first seen (devices, alignment, element offsets): the same addresses are
        # the same device memory (one virtual address space); skipping the per-tensor device
        # check saves ~13 us per call for 62 tensors (CPU-measured), on nearly every training step
        _use_base(p, addrs)
        return p
    devs = set(map(_DEVICE, tensors))
    if devs != {p.device}:
        raise ValueError(f"tensors: on {sorted(map(str, devs))}; all must share one device")
    a, rel = _relative(p, addrs)
    if not np.array_equal(rel % D.ALIGN, p.res):
        p = _list_plan(tensors, impl, cfg)
        _PLANS.put(key, p)
        return p
    _set_base(p, addrs, a, rel)
    return p


def _torch_flat(flat: Any, off: np.ndarray, inv_scale: Any, out: Any, found: Any, impl: str, cfg: tuple) -> Any:
    if _T is None:
        _bind_torch()
    dev = flat.device
    key = ("flat", cfg, impl, dev, flat.dtype, off.tobytes())
    p = _PLANS.get(key)
    if p is None:
        if flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError(f"flat: need a contiguous 1-D tensor, got shape {tuple(flat.shape)}")
        code = D.dtype_code(str(flat.dtype), "flat")
        p = _new_plan(off.size - 1, dev, code != D.CODE_FP64 and D.use_triton_torch(triton is not None, dev, impl), cfg)
        if p.triton:
            p.mode, p.dt = 0, code
            sizes = np.diff(off)
            codes = np.full(sizes.size, code, dtype=np.int64)
            _device_tables(p, _rows_table(sizes, off[:-1], codes, int(off[-1]), D.torch_sm_count(dev), cfg))
        _PLANS.put(key, p)
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"flat: need a contiguous 1-D tensor, got shape {tuple(flat.shape)}")
    if int(off[-1]) != flat.numel():
        raise ValueError(f"offsets: last offset {int(off[-1])} != flat.numel() {flat.numel()}")
    out = _out(out, p.n, dev)
    found = _found(found, dev)
    if not p.triton:
        _torch_scale(inv_scale, dev)
        views = [flat[int(a):int(b)] for a, b in zip(off[:-1], off[1:])]
        out.copy_(moments_reference_torch(views, inv_scale))
        _flag_found(found, out[:, 2])
        return out
    _launch(p, lambda: (flat, flat, flat), flat, inv_scale, out, found)
    return out


def _torch_moments(out: Any) -> Moments:
    import torch

    return Moments(out[:, 0], out[:, 1], out[:, 2].to(torch.int32))


# ----------------------------------------------------------------------------------------------
# JAX launchers
# ----------------------------------------------------------------------------------------------

_JTABLES = D.LRU(128)


def _jax_scale(inv_scale: Any) -> Any:
    """`inv_scale` checked: None, a positive float, or a 1-element float32 JAX array."""
    import jax.numpy as jnp

    if isinstance(inv_scale, (int, float, np.floating)):
        return _float_scale(inv_scale)
    if inv_scale is not None:
        if type(inv_scale).__module__.split(".", 1)[0] not in ("jax", "jaxlib"):
            raise TypeError(f"inv_scale: need a float or a JAX array, got {type(inv_scale)}")
        if inv_scale.size != 1 or inv_scale.dtype != jnp.float32:
            raise ValueError(f"inv_scale: need a 1-element float32 array, got shape "
                             f"{inv_scale.shape} {inv_scale.dtype}")
    return inv_scale


def _jax_triton(impl: str, arrays: Sequence[Any], fp64: bool) -> bool:
    """Whether JAX arrays go to the jax-triton kernel (else to a jnp reference): impl "auto" on a GPU,
    or "triton" (which insists on one); never for FP64."""
    D.check_impl(impl)
    gpu = D.jax_on_gpu(arrays)
    if impl == "triton" and not gpu:
        raise RuntimeError("impl='triton': jax-triton needs a GPU; JAX arrays here are not on one")
    return impl != "reference" and gpu and triton is not None and not fp64


def _jax_flat(flat: Any, off: np.ndarray, inv_scale: Any, impl: str, cfg: tuple) -> tuple[Any, Any]:
    """((n, 3) float32, unscaled flat or None) for a flat JAX buffer."""
    import jax
    import jax.numpy as jnp

    if flat.ndim != 1:
        raise ValueError(f"flat: need a 1-D array, got shape {flat.shape}")
    if int(off[-1]) != flat.size:
        raise ValueError(f"offsets: last offset {int(off[-1])} != flat.size {flat.size}")
    code = D.dtype_code(str(flat.dtype), "flat")
    inv_scale = _jax_scale(inv_scale)
    if not _jax_triton(impl, [flat], code == D.CODE_FP64):
        return moments_reference_jnp(flat, off, inv_scale)
    jt = D.import_jax_triton()

    n = off.size - 1
    if off[-1] >= 2**31:
        raise ValueError(f"flat: {int(off[-1])} elements; the JAX path indexes with int32 (< 2**31)")
    sms = D.jax_sm_count(flat)
    key = (cfg, sms, off.tobytes())

    def build() -> tuple[np.ndarray]:   # on a cache miss only: eager calls stay cheap on the host
        sizes = np.diff(off)
        t = _rows_table(sizes, off[:-1], np.zeros(sizes.size, dtype=np.int64), int(off[-1]), sms, cfg)
        return (t.astype(np.int32),)   # int32: int64 arrays need jax_enable_x64
    (tab,) = D.jax_table(_JTABLES, key, build, flat)
    nrows = tab.shape[0]
    write = inv_scale is not None
    if inv_scale is None:
        smode, sarg = 0, np.float32(1.0)
    elif isinstance(inv_scale, float):
        smode, sarg = 2, np.float32(inv_scale)
    else:
        smode, sarg = 1, inv_scale.reshape(1)
    if nrows == 0:
        return jnp.zeros((n, 3), jnp.float32), (flat if write else None)
    block, iters, num_warps, _, _, fast = cfg
    out_shape = [jax.ShapeDtypeStruct((n, 3), jnp.float32),
                 jax.ShapeDtypeStruct(flat.shape if write else (1,), flat.dtype)]
    # FINISH 0 (atomics into a zeroed out): a functional call has no persistent accumulator; the
    # outputs (out, y) are the last pointer parameters, as jax-triton appends them
    out, y = jt.triton_call(flat, flat, flat, tab, tab, sarg, tab, tab, tab, kernel=_moments_kernel,
                            out_shape=out_shape, grid=(nrows,), num_warps=num_warps, zeroed_outputs=(0,),
                            MODE=0, DT=code, SCALE=smode, WRITE=write, FAST=fast, FINISH=0, BASED=False,
                            FOUND=False, BLOCK=block, ITERS=iters)
    return out, (y if write else None)


def _jax_moments(out: Any) -> Moments:
    import jax.numpy as jnp

    return Moments(out[:, 0], out[:, 1], out[:, 2].astype(jnp.int32))


# ----------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------


def _cfg(block: int, iters: int, num_warps: int, chunk: int | None) -> tuple:
    _check_config(block, iters, num_warps, chunk)
    return (block, iters, num_warps, chunk, PER_SM, FAST)


def grad_moments(tensors: Any, *, inv_scale: Any = None, out: Any = None, found_inf: Any = None,
                 impl: str = "auto", block: int = BLOCK, iters: int = ITERS, num_warps: int = NUM_WARPS,
                 chunk: int | None = None) -> Any:
    """Per-tensor (sum, sumsq, nonfinite) of gradients, in one kernel launch.

    tensors: list of torch tensors (any shapes, dense, FP32/FP16/BF16/FP64, one device; read in place
        through a pointer table: no copy) or a list/pytree of JAX arrays (concatenated into one flat
        buffer, except with impl="xla"; use :func:`grad_moments_flat` to avoid that copy).
    inv_scale: None, a positive float, or a 1-element float32 tensor/array (e.g. 1/loss_scale):
        statistics are of ``x * inv_scale``; torch tensors are unscaled in place.
    out: torch only: a contiguous (n, 3) float32 device buffer (e.g. ``buf[r]`` of a (T, n, 3)
        buffer) filled with [sum, sumsq, nonfinite-as-float] and returned as is, with no extra launch
        and no host sync.
    found_inf: torch only: a 1-element float32 device tensor set to 1.0 in the same launch when any
        value is non-finite and left as it was otherwise (zero it beforehand): the ``found_inf`` a
        fused torch optimizer or ``GradScaler.update`` reads, with no extra launch.
    impl: "auto" (Triton on CUDA / interpreter / jax-triton on GPU, else reference), "triton" or
        "reference"; JAX arrays also "xla": :func:`moments_reference_jnp_tree`, one reduction per
        large array and one per length class of small ones, no written-back copy (inside a jitted step XLA fuses the
        unscaling into its consumers) and no jax-triton lowering.
    block, iters, num_warps: launch configuration (elements per load, loads per unrolled step,
        warps per program); chunk: elements per program (a multiple of 16; None: from the total
        size and the GPU's SM count).

    Returns :class:`Moments` of (n,) arrays of the input's framework (float32, float32, int32),
    ``out`` when given, and for JAX with ``inv_scale`` the pair ``(Moments, unscaled)`` where
    ``unscaled`` has the structure of ``tensors``. See the module docstring for non-finite handling.
    """
    cfg = _cfg(block, iters, num_warps, chunk)
    leaves, fw = D.leaves_and_framework(tensors, "tensors")
    if fw == "torch":
        _check_torch_impl(impl)
        res = _torch_list(leaves, inv_scale, out, found_inf, impl, cfg)[0]
        return res if out is not None else _torch_moments(res)
    _torch_only(out, found_inf)
    _check_jax_impl(impl)
    import jax
    import jax.numpy as jnp

    for i, a in enumerate(leaves):
        D.dtype_code(str(a.dtype), f"tensors[{i}]")
    treedef = jax.tree_util.tree_structure(tensors)
    if impl in JAX_ONLY_IMPLS:
        res, parts = moments_reference_jnp_tree(leaves, _jax_scale(inv_scale))
        moments = _jax_moments(res)
        return moments if inv_scale is None else (moments, jax.tree_util.tree_unflatten(treedef, parts))
    dtypes = {a.dtype for a in leaves}
    # mixed: exact upcast to FP32 (FP64 when any leaf is FP64)
    flat_dtype = dtypes.pop() if len(dtypes) == 1 else jnp.float64 if np.dtype("float64") in dtypes else jnp.float32
    flat = jnp.concatenate([a.reshape(-1).astype(flat_dtype) for a in leaves])
    off = np.concatenate([[0], np.cumsum([a.size for a in leaves])]).astype(np.int64)
    res, y = _jax_flat(flat, off, inv_scale, impl, cfg)
    moments = _jax_moments(res)
    if inv_scale is None:
        return moments
    parts = [y[int(a):int(b)].reshape(l.shape).astype(l.dtype) for a, b, l in zip(off[:-1], off[1:], leaves)]
    return moments, jax.tree_util.tree_unflatten(treedef, parts)


def _torch_only(out: Any, found_inf: Any) -> None:
    for name, v in (("out", out), ("found_inf", found_inf)):
        if v is not None:
            raise TypeError(f"{name}: only supported for torch tensors (JAX is functional)")


def grad_moments_flat(flat: Any, offsets: Sequence[int], *, inv_scale: Any = None, out: Any = None,
                      found_inf: Any = None, impl: str = "auto", block: int = BLOCK, iters: int = ITERS,
                      num_warps: int = NUM_WARPS, chunk: int | None = None) -> Any:
    """Segment-level entry: moments of ``flat[offsets[i]:offsets[i+1]]`` for each segment i.

    flat: 1-D contiguous torch tensor or JAX array (FP32/FP16/BF16/FP64). offsets: host (n+1,) integers,
    starting at 0, non-decreasing, ending at ``flat`` size (cached per layout). Other arguments and
    the result as in :func:`grad_moments`; for JAX with ``inv_scale`` returns ``(Moments, unscaled_flat)``.
    """
    cfg = _cfg(block, iters, num_warps, chunk)
    off = D.parse_offsets(offsets)
    fw = D.framework_of(flat)
    if fw == "torch":
        _check_torch_impl(impl)
        res = _torch_flat(flat, off, inv_scale, out, found_inf, impl, cfg)
        return res if out is not None else _torch_moments(res)
    _torch_only(out, found_inf)
    _check_jax_impl(impl)
    res, y = _jax_flat(flat, off, inv_scale, impl, cfg)
    return _jax_moments(res) if inv_scale is None else (_jax_moments(res), y)


class FixedMoments:
    """:func:`grad_moments` for torch lists whose layout never changes, at the least host cost per call.

    For the gradients of one fixed parameter list, step after step: ``p.grad`` always has its
    parameter's shape, dtype and device (torch enforces it), so once a list of these shapes and
    strides has been validated at a set of addresses, a later call at one of the last
    ``ADDRESS_SETS`` address sets reads only the addresses (one C-level ``map``) and launches:
    no layout key, no framework detection. A call at new addresses, or with another number of
    tensors, goes through :func:`grad_moments` in full (every check) and re-binds.

    Contract: tensor ``i`` has the same shape, strides and dtype at every call; a list that breaks
    it at addresses seen before is not detected (its statistics would be of the old layout). Use
    :func:`grad_moments` for lists that change.

    impl, block, iters, num_warps, chunk: as in :func:`grad_moments`, fixed for the object's life.
    """

    __slots__ = ("_impl", "_cfg", "_plan")

    def __init__(self, *, impl: str = "auto", block: int = BLOCK, iters: int = ITERS,
                 num_warps: int = NUM_WARPS, chunk: int | None = None) -> None:
        _check_torch_impl(impl)
        self._impl, self._cfg, self._plan = impl, _cfg(block, iters, num_warps, chunk), None

    def __call__(self, tensors: Sequence[Any], *, inv_scale: Any = None, out: Any = None,
                 found_inf: Any = None) -> Any:
        """tensors: list of torch tensors; inv_scale, out, found_inf and the result as in
        :func:`grad_moments`."""
        p = self._plan
        if p is not None and len(tensors) == p.n:
            addrs = D.torch_addresses_or_none(tensors)
            if addrs == p.addrs or (addrs is not None and addrs in p.bases):
                if addrs != p.addrs:
                    _use_base(p, addrs)
                res = _out(out, p.n, p.device)
                _launch(p, _refs(p, tensors), None, inv_scale, res, _found(found_inf, p.device))
                return res if out is not None else _torch_moments(res)
        leaves, fw = D.leaves_and_framework(tensors, "tensors")
        if fw != "torch":
            raise TypeError("tensors: FixedMoments takes torch tensors (JAX: jit grad_moments_flat)")
        res, p = _torch_list(leaves, inv_scale, out, found_inf, self._impl, self._cfg)
        # only a plain Triton plan takes the short path (the reference and FP64 rows need the list)
        self._plan = p if p.triton and not p.wide else None
        return res if out is not None else _torch_moments(res)
