"""Cast FP32 master weights to each segment's chosen precision in one launch.

One ``@triton.jit`` kernel serves torch and JAX (``jax_triton.triton_call``). FP16 and BF16 outputs
share one 16-bit buffer (int16 storage, viewed per segment as float16 or bfloat16); FP32 segments are
passed through untouched (the input tensor/array itself, no copy). Rounding is round-to-nearest-even
on the GPU (the Triton CPU interpreter truncates FP32->BF16, i.e. may be 1 ulp off).

The kernel walks a chunk table with rows ``(base, start, stop, dst, code)``: ``base`` is the element
offset of the segment in a flat FP32 buffer (MODE 0, JAX and flat torch) or the raw address of a
torch tensor (MODE 1: a list of tensors read in place), ``dst`` the element offset of the segment in
the 16-bit output, ``code`` 0 for FP16 and 1 for BF16 (the values of ``triaccel.Precision``).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from . import _dispatch as D

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

# measured on an H200 with this configuration (benchmarks/results/kernels-h200.json)
BLOCK = 1024
ITERS = 4
NUM_WARPS = 4


if triton is not None:

    @triton.jit
    def _cast_chunk(p, q, start, stop, OUT_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
                    ITERS: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        for it in tl.static_range(ITERS):
            idx = start + it * BLOCK + offs
            m = idx < stop
            x = tl.load(p + idx, mask=m, other=0.0)
            y = x.to(OUT_DTYPE, fp_downcast_rounding="rtne").to(tl.int16, bitcast=True)
            tl.store(q + idx, y, mask=m)

    @triton.jit
    def _cast_kernel(x_ptr, table_ptr, out_ptr, MODE: tl.constexpr, BLOCK: tl.constexpr,
                     ITERS: tl.constexpr):
        """One program per chunk row ``(base, start, stop, dst, code)``; out_ptr: int16 buffer."""
        pid = tl.program_id(0).to(tl.int64)
        row = table_ptr + pid * 5
        base = tl.load(row).to(tl.int64)
        start = tl.load(row + 1).to(tl.int64)
        stop = tl.load(row + 2).to(tl.int64)
        dst = tl.load(row + 3).to(tl.int64)
        code = tl.load(row + 4)
        if MODE == 0:
            src = x_ptr + base
        else:
            src = base.to(tl.pointer_type(tl.float32))
        q = out_ptr + dst
        if code == 1:
            _cast_chunk(src, q, start, stop, tl.bfloat16, BLOCK, ITERS)
        else:
            _cast_chunk(src, q, start, stop, tl.float16, BLOCK, ITERS)


def cast_reference_torch(tensors: Sequence[Any], codes: Sequence[int]) -> list:
    """torch reference: per-tensor ``.to(dtype)`` (RNE); FP32 tensors returned as they are."""
    import torch

    dts = {D.PREC_FP16: torch.float16, D.PREC_BF16: torch.bfloat16}
    return [t if c == D.PREC_FP32 else t.to(dts[c]) for t, c in zip(tensors, codes)]


def cast_reference_jnp(arrays: Sequence[Any], codes: Sequence[int]) -> list:
    """jnp reference: per-array ``astype`` (RNE); FP32 arrays returned as they are."""
    import jax.numpy as jnp

    dts = {D.PREC_FP16: jnp.float16, D.PREC_BF16: jnp.bfloat16}
    return [a if c == D.PREC_FP32 else a.astype(dts[c]) for a, c in zip(arrays, codes)]


def _codes(dtypes: Any, n: int) -> list[int]:
    if isinstance(dtypes, str) or not isinstance(dtypes, Sequence):
        raise TypeError(f"dtypes: need a sequence of {n} precisions, got {type(dtypes).__name__}")
    if len(dtypes) != n:
        raise ValueError(f"dtypes: got {len(dtypes)} precisions for {n} tensors; lengths must match")
    return [D.parse_precision(p, f"dtypes[{i}]") for i, p in enumerate(dtypes)]


def _layout(sizes: np.ndarray, codes: np.ndarray, src_base: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(table (nchunks, 5) int64, dst offset per segment (-1 for FP32), 16-bit buffer size)."""
    half = codes != D.PREC_FP32
    dst = np.full(sizes.size, -1, dtype=np.int64)
    hs = np.where(half, sizes, 0)
    dst[half] = (np.cumsum(hs) - hs)[half]
    total = int(hs.sum())
    seg, start, stop = D.chunk_rows(hs, chunk)  # FP32 segments get no chunk
    table = np.stack([src_base[seg], start, stop, dst[seg], codes[seg]], axis=1)
    return np.ascontiguousarray(table), dst, total


_TABLES = D.LRU(128)
_JTABLES = D.LRU(128)


class _CastPlan:
    """One layout's launch plan: device table, launcher, output layout, cached 16-bit views."""

    __slots__ = ("n", "device", "triton", "table", "rows", "dst", "total", "codes", "half", "f32",
                 "shapes", "strides", "launcher", "views")


def _torch_plan(tensors: Sequence[Any], codes: list[int], impl: str, block: int, iters: int,
                num_warps: int, flat: Any, offsets: np.ndarray | None) -> _CastPlan:
    import torch

    dev = tensors[0].device
    for i, t in enumerate(tensors):
        if t.dtype != torch.float32:
            raise TypeError(f"tensors[{i}]: dtype {t.dtype}; cast_to takes float32 master weights")
        if t.device != dev:
            raise ValueError(f"tensors[{i}]: on {t.device}, but tensors[0] is on {dev}; all must share a device")
        if not D.is_dense(t):
            raise ValueError(f"tensors[{i}]: not dense (strides {t.stride()} for shape {tuple(t.shape)})")
    p = _CastPlan()
    p.n, p.device, p.codes = len(tensors), dev, list(codes)
    p.triton = D.use_triton_torch(triton is not None, dev, impl)
    sizes = np.array([t.numel() for t in tensors], dtype=np.int64)
    code_arr = np.array(codes, dtype=np.int64)
    src = offsets[:-1] if flat is not None else np.array([t.data_ptr() for t in tensors], dtype=np.int64)
    table, dst, total = _layout(sizes, code_arr, src, block * iters)
    p.dst, p.total, p.rows = dst, total, table.shape[0]
    p.table = torch.empty(table.shape, dtype=torch.int64, device=dev)
    D.upload(p.table, table)   # no stream sync for a new layout
    p.half = [i for i, c in enumerate(codes) if c != D.PREC_FP32]
    p.f32 = [i for i, c in enumerate(codes) if c == D.PREC_FP32]
    p.shapes = [tuple(t.shape) for t in tensors]
    p.strides = [t.stride() for t in tensors]
    p.launcher = D.Launcher(_cast_kernel, p.rows, dict(MODE=0 if flat is not None else 1, BLOCK=block,
                                                       ITERS=iters, num_warps=num_warps))
    p.views = D.LRU(2)
    return p


def _half_views(p: _CastPlan, out: Any) -> list:
    """Per-tensor views of the 16-bit buffer ``out`` (None at FP32 positions)."""
    import torch

    dts = {D.PREC_FP16: torch.float16, D.PREC_BF16: torch.bfloat16}
    typed = {c: out.view(dt) for c, dt in dts.items()}
    base = out.storage_offset()
    res: list = [None] * p.n
    for i in p.half:
        res[i] = torch.as_strided(typed[p.codes[i]], p.shapes[i], p.strides[i], base + int(p.dst[i]))
    return res


def _torch_cast(tensors: Sequence[Any], dtypes: Any, out: Any, impl: str,
                block: int, iters: int, num_warps: int, flat: Any = None,
                offsets: np.ndarray | None = None) -> tuple[Any, list, _CastPlan]:
    """(16-bit buffer, per-tensor results, the plan used)."""
    dkey = tuple(dtypes) if isinstance(dtypes, (list, tuple)) else None
    if flat is not None:
        key = ("flat", block, iters, num_warps, impl, flat.device, offsets.tobytes(), dkey)
    else:
        # as for grad_moments: address, shape, strides and dtype of every tensor
        key = (block, iters, num_warps, impl, dkey, D.torch_layout_key(tensors))
    p = _TABLES.get(key) if dkey is not None else None
    if p is None:
        codes = _codes(dtypes, len(tensors))
        p = _torch_plan(tensors, codes, impl, block, iters, num_warps, flat, offsets)
        _TABLES.put(key, p)
    return (*_cast_run(p, tensors, out, flat), p)


def _cast_run(p: _CastPlan, tensors: Sequence[Any], out: Any, flat: Any) -> tuple[Any, list]:
    """Launch plan ``p`` over ``tensors`` (or ``flat``) into ``out`` (allocated when None)."""
    import torch

    T = torch.Tensor
    if out is None:
        out = torch.empty(p.total, dtype=torch.int16, device=p.device)
        views = _half_views(p, out)
    else:
        if not (isinstance(out, T) and out.dtype == torch.int16 and out.dim() == 1
                and out.numel() == p.total and out.is_contiguous() and out.device == p.device):
            raise ValueError(f"out: need a contiguous 1-D int16 tensor of {p.total} elements on {p.device}")
        # cached views pin out's memory, so an address seen again is this very buffer
        vkey = out.data_ptr()
        views = p.views.get(vkey)
        if views is None:
            views = _half_views(p, out)
            p.views.put(vkey, views)
        views = list(views)
    for i in p.f32:
        views[i] = tensors[i]
    if p.triton:
        if p.rows:
            x = flat if flat is not None else out
            p.launcher((out.data_ptr() & 15, x.data_ptr() & 15), x, p.table, out)
    else:
        for v, t, c in zip(views, tensors, p.codes):
            if c != D.PREC_FP32:
                v.copy_(t)  # copy_ rounds to nearest even, like .to()
    return out, views


def _jax_cast(flat: Any, off: np.ndarray, codes: list[int], impl: str,
              block: int, iters: int, num_warps: int) -> tuple[Any, list]:
    """(int16 buffer of the 16-bit segments or None, list of 1-D per-segment arrays)."""
    import jax
    import jax.numpy as jnp

    D.check_impl(impl)
    if flat.dtype != jnp.float32 or flat.ndim != 1:
        raise TypeError(f"flat: need a 1-D float32 array, got {flat.dtype} of shape {flat.shape}")
    if int(off[-1]) != flat.size:
        raise ValueError(f"offsets: last offset {int(off[-1])} != flat.size {flat.size}")
    sizes = np.diff(off)
    code_arr = np.array(codes, dtype=np.int64)
    segs = [flat[int(a):int(b)] for a, b in zip(off[:-1], off[1:])]
    gpu = D.jax_on_gpu([flat])
    if impl == "triton" and not gpu:
        raise RuntimeError("impl='triton': jax-triton needs a GPU; JAX arrays here are not on one")
    if impl == "reference" or not gpu or triton is None:
        return None, cast_reference_jnp(segs, codes)
    jt = D.import_jax_triton()

    if off[-1] >= 2**31:
        raise ValueError(f"flat: {int(off[-1])} elements; the JAX path indexes with int32 (< 2**31)")
    key = (block, iters, off.tobytes(), code_arr.tobytes())

    def build() -> tuple[Any, ...]:
        table, dst, total = _layout(sizes, code_arr, off[:-1], block * iters)
        return table.astype(np.int32), dst, total   # int32: int64 needs jax_enable_x64
    table, dst, total = D.jax_table(_JTABLES, key, build, flat)
    if table.shape[0] == 0:
        return None, segs
    out = jt.triton_call(flat, table, kernel=_cast_kernel,
                         out_shape=jax.ShapeDtypeStruct((total,), jnp.int16), grid=(table.shape[0],),
                         num_warps=num_warps, MODE=0, BLOCK=block, ITERS=iters)
    dts = {D.PREC_FP16: jnp.float16, D.PREC_BF16: jnp.bfloat16}
    parts = [s if c == D.PREC_FP32 else
             jax.lax.bitcast_convert_type(out[int(d):int(d) + int(n)], dts[c])
             for s, c, d, n in zip(segs, codes, dst, sizes)]
    return out, parts


def cast_to(tensors: Any, dtypes: Sequence[Any], *, out: Any = None, impl: str = "auto",
            block: int = BLOCK, iters: int = ITERS, num_warps: int = NUM_WARPS) -> list:
    """Cast each FP32 tensor/array to its precision, all in one launch; returns a list.

    tensors: list of float32 torch tensors (dense, one device; read in place) or JAX arrays.
    dtypes: one precision per tensor: a ``triaccel.Precision``, "fp16"/"bf16"/"fp32", "float16"/...,
        or a framework dtype (torch.bfloat16, jnp.float16, np.float32; see ``Precision.parse``).
    out: torch only: a reusable contiguous int16 buffer holding all 16-bit outputs (size = number
        of elements of the FP16/BF16 tensors); allocated when None.
    Returns, per input, a tensor/array of the input's shape (torch: and strides): for FP16/BF16 a
    view into the shared 16-bit buffer, for FP32 the input itself.
    """
    leaves, fw = D.leaves_and_framework(tensors, "tensors")
    if fw == "torch":
        return _torch_cast(leaves, dtypes, out, impl, block, iters, num_warps)[1]
    codes = _codes(dtypes, len(leaves))
    if out is not None:
        raise TypeError("out: only supported for torch tensors (JAX is functional)")
    import jax.numpy as jnp

    for i, a in enumerate(leaves):
        if a.dtype != jnp.float32:
            raise TypeError(f"tensors[{i}]: dtype {a.dtype}; cast_to takes float32 master weights")
    half = [i for i, c in enumerate(codes) if c != D.PREC_FP32]
    res = list(leaves)
    if not half:
        return res
    # only the 16-bit segments travel through the flat buffer; FP32 ones are passed through
    flat = jnp.concatenate([leaves[i].reshape(-1) for i in half])
    off = np.concatenate([[0], np.cumsum([leaves[i].size for i in half])]).astype(np.int64)
    _, parts = _jax_cast(flat, off, [codes[i] for i in half], impl, block, iters, num_warps)
    for i, p in zip(half, parts):
        res[i] = p.reshape(leaves[i].shape)
    return res


def cast_flat(flat: Any, offsets: Sequence[int], dtypes: Sequence[Any], *, out: Any = None,
              impl: str = "auto", block: int = BLOCK, iters: int = ITERS,
              num_warps: int = NUM_WARPS) -> tuple[Any, list]:
    """Segment-level cast of a flat FP32 buffer (1-D torch tensor or JAX array).

    offsets: host (n+1,) segment offsets into ``flat``; dtypes: one precision per segment (as in
    :func:`cast_to`).
    Returns ``(buf16, parts)``: the int16 buffer holding the FP16/BF16 segments back to back in
    segment order (None for JAX on the reference path or when no segment is 16-bit) and the 1-D
    per-segment results (FP32 segments are slices of ``flat``).
    """
    off = D.parse_offsets(offsets)
    if D.framework_of(flat) == "torch":
        if flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError(f"flat: need a contiguous 1-D tensor, got shape {tuple(flat.shape)}")
        if int(off[-1]) != flat.numel():
            raise ValueError(f"offsets: last offset {int(off[-1])} != flat.numel() {flat.numel()}")
        segs = [flat[int(a):int(b)] for a, b in zip(off[:-1], off[1:])]
        if not segs:
            raise ValueError("offsets: need at least one segment")
        return _torch_cast(segs, dtypes, out, impl, block, iters, num_warps, flat=flat, offsets=off)[:2]
    codes = _codes(dtypes, off.size - 1)
    if out is not None:
        raise TypeError("out: only supported for torch tensors (JAX is functional)")
    return _jax_cast(flat, off, codes, impl, block, iters, num_warps)


class FixedCast:
    """:func:`cast_to` for one fixed list of torch tensors (master weights, step after step), at the
    least host cost per call.

    The launch plan of a torch list holds the tensors' addresses; once a list has been validated,
    a later call with tensors at the same addresses and the same precisions reads only the
    addresses (one C-level ``map``) and launches. Other addresses or precisions go through
    :func:`cast_to` in full (every check) and re-bind.

    Contract: tensor ``i`` has the same shape, strides and dtype at every call (true of a model's
    parameters unless they are re-allocated, which moves them); a list that breaks it at the same
    addresses is not detected. Use :func:`cast_to` for lists that change.

    impl, block, iters, num_warps: as in :func:`cast_to`, fixed for the object's life.
    """

    __slots__ = ("_impl", "_block", "_iters", "_num_warps", "_plan", "_addrs", "_dkey")

    def __init__(self, *, impl: str = "auto", block: int = BLOCK, iters: int = ITERS,
                 num_warps: int = NUM_WARPS) -> None:
        D.check_impl(impl)
        self._impl, self._block, self._iters, self._num_warps = impl, block, iters, num_warps
        self._plan = self._addrs = self._dkey = None

    def __call__(self, tensors: Sequence[Any], dtypes: Sequence[Any], *, out: Any = None) -> list:
        """tensors, dtypes, out and the result as in :func:`cast_to` (torch tensors only)."""
        p = self._plan
        if p is not None and len(tensors) == p.n and isinstance(dtypes, (list, tuple)):
            if D.torch_addresses_or_none(tensors) == self._addrs and tuple(dtypes) == self._dkey:
                return _cast_run(p, tensors, out, None)[1]
        leaves, fw = D.leaves_and_framework(tensors, "tensors")
        if fw != "torch":
            raise TypeError("tensors: FixedCast takes torch tensors (JAX: jit cast_flat)")
        _, res, p = _torch_cast(leaves, dtypes, out, self._impl, self._block, self._iters, self._num_warps)
        self._plan, self._addrs = p, D.torch_addresses(leaves)
        self._dkey = tuple(dtypes) if isinstance(dtypes, (list, tuple)) else None
        return res
