"""Per-segment gradient moments (sum, sum of squares, non-finite count) in one launch.

One ``@triton.jit`` kernel serves torch (direct launch) and JAX (``jax_triton.triton_call``).
It walks a *chunk table*: one row per program, ``(seg, base, start, stop, code, full)`` int64/int32.
A segment (one layer's gradient) is split into a masked head up to the first 16-element-aligned
element, *full* chunks of ``block * iters`` aligned elements read with unmasked 128-bit vector loads,
and a masked tail, so that a few huge segments and many tiny ones load-balance over the GPU. Each
program reduces its chunk in FP32 and adds its three partial results into ``out[seg, :]`` with
atomics (so ``out`` is zeroed first; the order of those float additions is not fixed, so results
may differ in the last bits from run to run).

Two addressing modes share the kernel; both address memory as *typed pointer + element offset*
(an ``int -> pointer`` cast would hide the alignment from the compiler and forbid vector loads):

- ``MODE=0`` (flat): ``base`` is the element offset of the segment in one flat buffer ``x`` (the JAX
  path, and torch when the gradients already live in one flat buffer);
- ``MODE=1`` (torch list): ``base`` is the element offset of each tensor from a reference tensor of
  the same dtype (``code`` 0 fp32, 1 fp16, 2 bf16; one reference pointer argument per dtype, offsets
  may be negative), so a list of separate tensors, even of mixed dtypes, is read in place with no
  ``torch.cat`` copy.

Semantics (shared by the kernel and both references):

- ``x`` is converted to FP32 and, with ``inv_scale``, multiplied by it in FP32 (the unscaled gradient);
- a value is non-finite when the unscaled FP32 value is NaN or ±Inf. Non-finite values are *counted*
  and *excluded* from ``sum``/``sumsq``, so the statistics never turn into NaN (which an on-device EMA
  would keep forever). As with ``GradScaler``, a step with any non-finite value is skipped, and its
  statistics should be discarded by the caller (``nonfinite > 0``);
- ``sumsq`` is accumulated in FP32 and overflows to +Inf for finite values beyond ~1.8e19 (while
  ``nonfinite`` stays 0);
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

# Default launch configuration (chunk = BLOCK * ITERS elements per program): the fastest of the 7
# configurations swept by benchmarks/kernels.py --sweep on an H200 (2026-11-21), for both the
# ResNet-18 gradient set and 2**30 values, flat and pointer-table modes alike.
BLOCK = 1024
ITERS = 4
NUM_WARPS = 4

FP32_MAX = 3.4028234663852886e38


class Moments(NamedTuple):
    """Per-segment statistics, each of shape (n,): sum and sumsq float32, nonfinite int32."""

    sum: Any
    sumsq: Any
    nonfinite: Any


if triton is not None:

    @triton.jit
    def _chunk_moments(p, q, start, stop, s, FULL: tl.constexpr, SCALE: tl.constexpr,
                       WRITE: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        # FULL: p/q point at a 16-element-aligned chunk of exactly BLOCK*ITERS elements, read with
        # unmasked (vectorisable) loads. Else: p/q point at the segment's first element and the
        # elements [start, stop) are read with masks.
        offs = tl.arange(0, BLOCK)
        acc_s = tl.zeros([BLOCK], dtype=tl.float32)
        acc_q = tl.zeros([BLOCK], dtype=tl.float32)
        acc_n = tl.zeros([BLOCK], dtype=tl.int32)
        for it in tl.static_range(ITERS):
            if FULL:
                idx = it * BLOCK + offs
                x = tl.load(p + idx).to(tl.float32)
            else:
                idx = start + it * BLOCK + offs
                m = idx < stop
                x = tl.load(p + idx, mask=m, other=0.0).to(tl.float32)
            if SCALE != 0:
                x = x * s
            if WRITE:
                if FULL:
                    tl.store(q + idx, x.to(q.dtype.element_ty))
                else:
                    tl.store(q + idx, x.to(q.dtype.element_ty), mask=m)
            fin = tl.abs(x) <= 3.4028234663852886e38  # False for NaN and ±Inf
            xf = tl.where(fin, x, 0.0)
            acc_s += xf
            acc_q += xf * xf
            if FULL:
                acc_n += (~fin).to(tl.int32)
            else:
                acc_n += (m & (~fin)).to(tl.int32)
        return tl.sum(acc_s, axis=0), tl.sum(acc_q, axis=0), tl.sum(acc_n, axis=0)

    @triton.jit
    def _moments_kernel(x_ptr, h_ptr, b_ptr, table_ptr, scale, out_ptr, y_ptr,
                        MODE: tl.constexpr, SCALE: tl.constexpr, WRITE: tl.constexpr,
                        BLOCK: tl.constexpr, ITERS: tl.constexpr):
        """One program per chunk row ``(seg, base, start, stop, code, full)`` of ``table_ptr``.

        MODE 0: ``base`` = element offset of the segment in the flat input ``x_ptr``; unscaled
        values go to ``y_ptr`` (WRITE). MODE 1: ``base`` = element offset of the tensor from the
        reference pointer of its dtype (``code`` 0: ``x_ptr`` fp32, 1: ``h_ptr`` fp16, 2: ``b_ptr``
        bf16; offsets may be negative), written back in place. ``full`` rows: ``base + start`` is
        a multiple of 16 and the chunk is whole (unmasked vector loads). scale: pointer to one
        FP32 value (SCALE 1), an FP32 value (SCALE 2) or unused (SCALE 0). out_ptr: (n, 3) FP32,
        zeroed, accumulated with atomics.
        """
        pid = tl.program_id(0).to(tl.int64)
        row = table_ptr + pid * 6
        seg = tl.load(row).to(tl.int64)
        base = tl.load(row + 1).to(tl.int64)
        start = tl.load(row + 2).to(tl.int64)
        stop = tl.load(row + 3).to(tl.int64)
        full = tl.load(row + 5)
        if SCALE == 1:
            s = tl.load(scale).to(tl.float32)
        elif SCALE == 2:
            s = scale  # an fp32 kernel argument
        else:
            s = 1.0
        # Addresses are typed pointer + element offset (never int -> pointer casts), so that the
        # compiler sees the pointer's 16-byte alignment and the hint below, and vectorises.
        g = tl.multiple_of(base + start, 16)  # only used on full rows, where the host ensured it
        if MODE == 0:
            if full != 0:
                cs, cq, cn = _chunk_moments(x_ptr + g, y_ptr + g, start, stop, s, True,
                                            SCALE, WRITE, BLOCK, ITERS)
            else:
                cs, cq, cn = _chunk_moments(x_ptr + base, y_ptr + base, start, stop, s, False,
                                            SCALE, WRITE, BLOCK, ITERS)
        else:
            code = tl.load(row + 4)
            if code == 0:
                if full != 0:
                    cs, cq, cn = _chunk_moments(x_ptr + g, x_ptr + g, start, stop, s, True,
                                                SCALE, WRITE, BLOCK, ITERS)
                else:
                    cs, cq, cn = _chunk_moments(x_ptr + base, x_ptr + base, start, stop, s, False,
                                                SCALE, WRITE, BLOCK, ITERS)
            elif code == 1:
                if full != 0:
                    cs, cq, cn = _chunk_moments(h_ptr + g, h_ptr + g, start, stop, s, True,
                                                SCALE, WRITE, BLOCK, ITERS)
                else:
                    cs, cq, cn = _chunk_moments(h_ptr + base, h_ptr + base, start, stop, s, False,
                                                SCALE, WRITE, BLOCK, ITERS)
            else:
                if full != 0:
                    cs, cq, cn = _chunk_moments(b_ptr + g, b_ptr + g, start, stop, s, True,
                                                SCALE, WRITE, BLOCK, ITERS)
                else:
                    cs, cq, cn = _chunk_moments(b_ptr + base, b_ptr + base, start, stop, s, False,
                                                SCALE, WRITE, BLOCK, ITERS)
        o = out_ptr + seg * 3
        tl.atomic_add(o, cs)
        tl.atomic_add(o + 1, cq)
        tl.atomic_add(o + 2, cn.to(tl.float32))


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


# ----------------------------------------------------------------------------------------------
# torch launchers
# ----------------------------------------------------------------------------------------------

_TABLES = D.LRU(128)


def _flat_table(off: np.ndarray, chunk: int) -> np.ndarray:
    """Chunk table (rows, 6) int64 for a flat buffer with segment offsets ``off`` (elements)."""
    base = off[:-1]
    seg, start, stop, full = D.aligned_chunk_rows(np.diff(off), (-base) % D.ALIGN, chunk)
    return np.ascontiguousarray(np.stack([seg, base[seg], start, stop, np.zeros_like(seg), full], axis=1))


def _check_config(block: int, iters: int, num_warps: int) -> None:
    if block < D.ALIGN or block & (block - 1):
        raise ValueError(f"block={block}: must be a power of two >= {D.ALIGN}")
    if iters < 1:
        raise ValueError(f"iters={iters}: must be >= 1")
    if num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps={num_warps}: must be a power of two >= 1")


def _torch_scale(inv_scale: Any, device: Any) -> tuple[int, Any]:
    """(SCALE mode, kernel argument) for ``inv_scale`` given as None, a float or a 1-element tensor."""
    import torch

    if inv_scale is None:
        return 0, 1.0
    if isinstance(inv_scale, torch.Tensor):
        if inv_scale.numel() != 1 or inv_scale.dtype != torch.float32 or inv_scale.device != device:
            raise ValueError(
                f"inv_scale: need a 1-element float32 tensor on {device}, got shape "
                f"{tuple(inv_scale.shape)} {inv_scale.dtype} on {inv_scale.device}")
        return 1, inv_scale
    v = _float_scale(inv_scale)
    return 2, v


def _float_scale(inv_scale: Any) -> float:
    try:
        v = float(inv_scale)
    except (TypeError, ValueError):
        raise TypeError(f"inv_scale: need a float or a 1-element float32 array, got {type(inv_scale)}") from None
    if not (np.isfinite(v) and v > 0):
        raise ValueError(f"inv_scale={inv_scale!r}: must be finite and > 0")
    return v


def _check_out(out: Any, n: int, device: Any) -> None:
    import torch

    if not isinstance(out, torch.Tensor) or out.shape != (n, 3) or out.dtype != torch.float32 \
            or not out.is_contiguous() or out.device != device:
        desc = (tuple(out.shape), out.dtype, out.device) if isinstance(out, torch.Tensor) else type(out)
        raise ValueError(f"out: need a contiguous float32 tensor of shape ({n}, 3) on {device}, got {desc}")


def _torch_check(tensors: Sequence[Any]) -> None:
    dev = tensors[0].device
    for i, t in enumerate(tensors):
        D.dtype_code(str(t.dtype), f"tensors[{i}]")
        if t.device != dev:
            raise ValueError(f"tensors[{i}]: on {t.device}, but tensors[0] is on {dev}; all must share a device")


def _launch_torch(refs: list, table: Any, nchunks: int, scale: tuple[int, Any], out: Any, y: Any,
                  mode: int, write: bool, block: int, iters: int, num_warps: int) -> None:
    out.zero_()
    if nchunks == 0:
        return
    smode, sarg = scale
    _moments_kernel[(nchunks,)](refs[0], refs[1], refs[2], table, sarg, out, y, MODE=mode,
                                SCALE=smode, WRITE=write,
                                BLOCK=block, ITERS=iters, num_warps=num_warps)


def _torch_list(tensors: Sequence[Any], inv_scale: Any, out: Any, impl: str,
                block: int, iters: int, num_warps: int) -> Any:
    import torch

    dev = tensors[0].device
    n = len(tensors)
    if not D.use_triton_torch(triton is not None, dev, impl):
        _torch_check(tensors)
        if out is None:
            out = torch.empty((n, 3), dtype=torch.float32, device=dev)
        else:
            _check_out(out, n, dev)
        _torch_scale(inv_scale, dev)
        out.copy_(moments_reference_torch(tensors, inv_scale))
        return out
    chunk = block * iters
    T = torch.Tensor
    # Layout key: address, shape, dtype and strides of every tensor (under CUDA's unified addressing
    # an address also fixes the device). A hit means these tensors were validated when the table
    # was built, so the per-call host cost is this key alone.
    key = (chunk, tuple(map(T.data_ptr, tensors)), tuple(t.shape for t in tensors),
           tuple(t.dtype for t in tensors), tuple(map(T.stride, tensors)))
    hit = _TABLES.get(key)
    if hit is None:
        _torch_check(tensors)
        for i, t in enumerate(tensors):
            if not D.is_dense(t):
                raise ValueError(f"tensors[{i}]: not dense (strides {t.stride()} for shape {tuple(t.shape)}); "
                                 "the kernel reads numel consecutive elements")
        sizes = np.array([t.numel() for t in tensors], dtype=np.int64)
        addrs = np.array([t.data_ptr() for t in tensors], dtype=np.int64)
        codes = np.array([D.dtype_code(str(t.dtype), "tensors") for t in tensors], dtype=np.int64)
        esize = np.array([t.element_size() for t in tensors], dtype=np.int64)
        ref_idx = [-1, -1, -1]  # per kernel dtype code: index of its reference tensor (-1: none)
        rel = np.zeros_like(addrs)
        for c in range(3):
            idx = np.flatnonzero((codes == c) & (sizes > 0))
            if idx.size == 0:
                continue
            ref_idx[c] = int(idx[0])
            d = addrs[idx] - addrs[idx[0]]
            bad = idx[d % esize[idx] != 0]
            if bad.size:
                raise ValueError(f"tensors[{int(bad[0])}]: address not a multiple of its element size "
                                 f"away from tensors[{int(idx[0])}] of the same dtype")
            rel[idx] = d // esize[idx]
        wide = np.flatnonzero(codes == D.CODE_FP64)  # no kernel rows: torch ops after the launch
        seg, start, stop, full = D.aligned_chunk_rows(np.where(codes == D.CODE_FP64, 0, sizes),
                                                      (-rel) % D.ALIGN, chunk)
        tab = np.stack([seg, rel[seg], start, stop, codes[seg], full], axis=1)
        # indices, not tensors: the cache must not keep gradients alive
        hit = (torch.from_numpy(np.ascontiguousarray(tab)).to(dev), tab.shape[0], ref_idx,
               wide.tolist(), torch.from_numpy(wide).to(dev))
        _TABLES.put(key, hit)
    if out is None:
        out = torch.empty((n, 3), dtype=torch.float32, device=dev)
    else:
        _check_out(out, n, dev)
    scale = _torch_scale(inv_scale, dev)
    table, nch, ref_idx, wide, wide_idx = hit
    refs = [tensors[i] if i >= 0 else out for i in ref_idx]  # placeholders are never dereferenced
    _launch_torch(refs, table, nch, scale, out, out, 1, inv_scale is not None, block, iters, num_warps)
    if wide:
        out.index_copy_(0, wide_idx, moments_reference_torch([tensors[i] for i in wide], inv_scale))
    return out


def _torch_flat(flat: Any, off: np.ndarray, inv_scale: Any, out: Any, impl: str,
                block: int, iters: int, num_warps: int) -> Any:
    import torch

    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"flat: need a contiguous 1-D tensor, got shape {tuple(flat.shape)}")
    if int(off[-1]) != flat.numel():
        raise ValueError(f"offsets: last offset {int(off[-1])} != flat.numel() {flat.numel()}")
    D.dtype_code(str(flat.dtype), "flat")
    dev = flat.device
    n = off.size - 1
    if out is None:
        out = torch.empty((n, 3), dtype=torch.float32, device=dev)
    else:
        _check_out(out, n, dev)
    scale = _torch_scale(inv_scale, dev)
    if flat.dtype == torch.float64 or not D.use_triton_torch(triton is not None, dev, impl):
        views = [flat[int(a):int(b)] for a, b in zip(off[:-1], off[1:])]
        out.copy_(moments_reference_torch(views, inv_scale))
        return out
    chunk = block * iters
    key = ("flat", dev, chunk, off.tobytes())
    hit = _TABLES.get(key)
    if hit is None:
        tab = _flat_table(off, chunk)
        hit = (torch.from_numpy(np.ascontiguousarray(tab)).to(dev), tab.shape[0])
        _TABLES.put(key, hit)
    table, nch = hit
    _launch_torch([flat] * 3, table, nch, scale, out, flat, 0, inv_scale is not None, block, iters, num_warps)
    return out


def _torch_moments(out: Any) -> Moments:
    import torch

    return Moments(out[:, 0], out[:, 1], out[:, 2].to(torch.int32))


# ----------------------------------------------------------------------------------------------
# JAX launchers
# ----------------------------------------------------------------------------------------------

_JTABLES = D.LRU(128)


def _jax_flat(flat: Any, off: np.ndarray, inv_scale: Any, impl: str,
              block: int, iters: int, num_warps: int) -> tuple[Any, Any]:
    """((n, 3) float32, unscaled flat or None) for a flat JAX buffer."""
    import jax
    import jax.numpy as jnp

    D.check_impl(impl)
    if flat.ndim != 1:
        raise ValueError(f"flat: need a 1-D array, got shape {flat.shape}")
    if int(off[-1]) != flat.size:
        raise ValueError(f"offsets: last offset {int(off[-1])} != flat.size {flat.size}")
    D.dtype_code(str(flat.dtype), "flat")
    if isinstance(inv_scale, (int, float, np.floating)):
        inv_scale = _float_scale(inv_scale)
    elif inv_scale is not None:
        if type(inv_scale).__module__.split(".", 1)[0] not in ("jax", "jaxlib"):
            raise TypeError(f"inv_scale: need a float or a JAX array, got {type(inv_scale)}")
        if inv_scale.size != 1 or inv_scale.dtype != jnp.float32:
            raise ValueError(f"inv_scale: need a 1-element float32 array, got shape "
                             f"{inv_scale.shape} {inv_scale.dtype}")
    gpu = D.jax_on_gpu([flat])
    if impl == "triton" and not gpu:
        raise RuntimeError("impl='triton': jax-triton needs a GPU; JAX arrays here are not on one")
    if impl == "reference" or not gpu or triton is None or flat.dtype == jnp.float64:
        return moments_reference_jnp(flat, off, inv_scale)
    import jax_triton as jt  # lazy: cannot be imported without a GPU

    n = off.size - 1
    if off[-1] >= 2**31:
        raise ValueError(f"flat: {int(off[-1])} elements; the JAX path indexes with int32 (< 2**31)")
    chunk = block * iters
    key = (chunk, off.tobytes())
    tab = _JTABLES.get(key)
    if tab is None:
        tab = _flat_table(off, chunk).astype(np.int32)
        _JTABLES.put(key, tab)
    nch = tab.shape[0]
    write = inv_scale is not None
    if inv_scale is None:
        smode, sarg = 0, np.float32(1.0)
    elif isinstance(inv_scale, float):
        smode, sarg = 2, np.float32(inv_scale)
    else:
        smode, sarg = 1, inv_scale.reshape(1)
    if nch == 0:
        return jnp.zeros((n, 3), jnp.float32), (flat if write else None)
    out_shape = [jax.ShapeDtypeStruct((n, 3), jnp.float32),
                 jax.ShapeDtypeStruct(flat.shape if write else (1,), flat.dtype)]
    out, y = jt.triton_call(flat, flat, flat, jnp.asarray(tab), sarg, kernel=_moments_kernel, out_shape=out_shape,
                            grid=(nch,), num_warps=num_warps, zeroed_outputs=(0,),
                            MODE=0, SCALE=smode, WRITE=write, BLOCK=block, ITERS=iters)
    return out, (y if write else None)


def _jax_moments(out: Any) -> Moments:
    import jax.numpy as jnp

    return Moments(out[:, 0], out[:, 1], out[:, 2].astype(jnp.int32))


# ----------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------


def grad_moments(tensors: Any, *, inv_scale: Any = None, out: Any = None, impl: str = "auto",
                 block: int = BLOCK, iters: int = ITERS, num_warps: int = NUM_WARPS) -> Any:
    """Per-tensor (sum, sumsq, nonfinite) of gradients, in one kernel launch.

    tensors: list of torch tensors (any shapes, dense, FP32/FP16/BF16/FP64, one device; read in place
        through a pointer table: no copy) or a list/pytree of JAX arrays (concatenated into one flat
        buffer; use :func:`grad_moments_flat` to avoid that copy).
    inv_scale: None, a positive float, or a 1-element float32 tensor/array (e.g. 1/loss_scale):
        statistics are of ``x * inv_scale``; torch tensors are unscaled in place.
    out: torch only: a contiguous (n, 3) float32 device buffer (e.g. ``buf[r]`` of a (T, n, 3)
        buffer) filled with [sum, sumsq, nonfinite-as-float] and returned as is, with no extra launch
        and no host sync.
    impl: "auto" (Triton on CUDA / interpreter / jax-triton on GPU, else reference), "triton" or
        "reference".

    Returns :class:`Moments` of (n,) arrays of the input's framework (float32, float32, int32),
    ``out`` when given, and for JAX with ``inv_scale`` the pair ``(Moments, unscaled)`` where
    ``unscaled`` has the structure of ``tensors``. See the module docstring for non-finite handling.
    """
    _check_config(block, iters, num_warps)
    leaves, fw = D.leaves_and_framework(tensors, "tensors")
    if fw == "torch":
        res = _torch_list(leaves, inv_scale, out, impl, block, iters, num_warps)
        return res if out is not None else _torch_moments(res)
    if out is not None:
        raise TypeError("out: only supported for torch tensors (JAX is functional)")
    import jax
    import jax.numpy as jnp

    for i, a in enumerate(leaves):
        D.dtype_code(str(a.dtype), f"tensors[{i}]")
    dtypes = {a.dtype for a in leaves}
    # mixed: exact upcast to FP32 (FP64 when any leaf is FP64)
    flat_dtype = dtypes.pop() if len(dtypes) == 1 else jnp.float64 if np.dtype("float64") in dtypes else jnp.float32
    flat = jnp.concatenate([a.reshape(-1).astype(flat_dtype) for a in leaves])
    off = np.concatenate([[0], np.cumsum([a.size for a in leaves])]).astype(np.int64)
    res, y = _jax_flat(flat, off, inv_scale, impl, block, iters, num_warps)
    moments = _jax_moments(res)
    if inv_scale is None:
        return moments
    parts = [y[int(a):int(b)].reshape(l.shape).astype(l.dtype) for a, b, l in zip(off[:-1], off[1:], leaves)]
    treedef = jax.tree_util.tree_structure(tensors)
    return moments, jax.tree_util.tree_unflatten(treedef, parts)


def grad_moments_flat(flat: Any, offsets: Sequence[int], *, inv_scale: Any = None, out: Any = None,
                      impl: str = "auto", block: int = BLOCK, iters: int = ITERS,
                      num_warps: int = NUM_WARPS) -> Any:
    """Segment-level entry: moments of ``flat[offsets[i]:offsets[i+1]]`` for each segment i.

    flat: 1-D contiguous torch tensor or JAX array (FP32/FP16/BF16/FP64). offsets: host (n+1,) integers,
    starting at 0, non-decreasing, ending at ``flat`` size (cached per layout). Other arguments and
    the result as in :func:`grad_moments`; for JAX with ``inv_scale`` returns ``(Moments, unscaled_flat)``.
    """
    _check_config(block, iters, num_warps)
    off = D.parse_offsets(offsets)
    fw = D.framework_of(flat)
    if fw == "torch":
        res = _torch_flat(flat, off, inv_scale, out, impl, block, iters, num_warps)
        return res if out is not None else _torch_moments(res)
    if out is not None:
        raise TypeError("out: only supported for torch tensors (JAX is functional)")
    res, y = _jax_flat(flat, off, inv_scale, impl, block, iters, num_warps)
    return _jax_moments(res) if inv_scale is None else (_jax_moments(res), y)
