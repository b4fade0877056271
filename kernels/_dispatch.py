"""Framework detection, dtype codes and segment tables shared by the kernels.

Imports neither torch nor jax at module import: the framework of an input is read from
``type(x).__module__`` (einops-style), and torch/jax are imported only once an input of that
framework has been seen.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from triaccel.precision import Precision

# Input dtype codes used inside the kernels (column "code" of a segment table).
CODE_FP32 = 0
CODE_FP16 = 1
CODE_BF16 = 2
CODE_FP64 = 3  # never reaches a kernel: float64 values are reduced with the framework's own ops

# Target precision codes for the cast kernel; equal to ``triaccel.Precision`` values.
PREC_FP16 = 0
PREC_BF16 = 1
PREC_FP32 = 2

IMPLS = ("auto", "triton", "reference")


def framework_of(x: Any) -> str:
    """Return ``"torch"`` or ``"jax"`` for one array, without importing either framework."""
    mod = type(x).__module__ or ""
    root = mod.split(".", 1)[0]
    if root == "torch":
        return "torch"
    if root in ("jax", "jaxlib"):
        return "jax"
    raise TypeError(
        f"expected a torch.Tensor or a jax.Array, got {type(x).__module__}.{type(x).__qualname__}"
    )


def common_framework(arrays: Sequence[Any], param: str) -> str:
    """Framework shared by all ``arrays``; TypeError naming ``param`` if they are mixed or empty."""
    if len(arrays) == 0:
        raise ValueError(f"{param}: got an empty sequence; need at least one tensor/array")
    fws = set()
    for i, a in enumerate(arrays):
        try:
            fws.add(framework_of(a))
        except TypeError as exc:
            raise TypeError(f"{param}[{i}]: {exc}") from None
    if len(fws) != 1:
        raise TypeError(f"{param}: mixed frameworks {sorted(fws)}; pass only torch tensors or only JAX arrays")
    return fws.pop()


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: allowed values are {IMPLS}")


def use_triton_torch(have_triton: bool, device: Any, impl: str) -> bool:
    """Whether a torch launch on `device` runs the Triton kernel (else the torch reference).

    impl "auto": Triton on CUDA, or on CPU under TRITON_INTERPRET=1; "triton" insists (RuntimeError
    where it cannot run); "reference" never.
    """
    check_impl(impl)
    if impl == "reference":
        return False
    ok = have_triton and (device.type == "cuda" or (device.type == "cpu" and interpreter_enabled()))
    if impl == "triton" and not ok:
        raise RuntimeError(f"impl='triton': Triton cannot run on {device} here "
                           "(needs CUDA, or TRITON_INTERPRET=1 for CPU tensors)")
    return ok


def prepare_triton_runtime() -> bool:
    """Triton's once-per-process start-up, ahead of a first launch: its cache key (a hash of Triton's own
    files) and its active driver (which loads, and on a new machine first builds, its CUDA helper
    module). On an H200 under cProfile these took 0.64 s and 0.42 s of the first statistics launch
    (2026-11-28, docs/results.md). Makes no CUDA call (the driver asks torch whether CUDA is available),
    so it may run on a thread beside the caller's CUDA work. Returns whether a driver is active; False
    without Triton or a GPU (the first launch then reports what is missing)."""
    try:
        import triton
        from triton.runtime.cache import triton_key
    except ImportError:
        return False
    triton_key()
    try:
        triton.runtime.driver.active
    except RuntimeError:   # "0 active drivers": no GPU here
        return False
    return True


def interpreter_enabled() -> bool:
    """True when Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dtype_code(dtype_name: str, param: str) -> int:
    """Kernel code of a float dtype given by its short name (torch or numpy/jax spelling)."""
    name = dtype_name.rsplit(".", 1)[-1]
    if name == "float32":
        return CODE_FP32
    if name == "float16":
        return CODE_FP16
    if name == "bfloat16":
        return CODE_BF16
    if name == "float64":
        return CODE_FP64
    raise TypeError(f"{param}: dtype {dtype_name} is not supported; allowed: float32, float16, bfloat16, float64")


def parse_precision(p: Any, param: str) -> int:
    """Precision code (fp16=0, bf16=1, fp32=2) of anything ``triaccel.Precision.parse`` takes: a
    Precision, "bf16", "bfloat16", torch.bfloat16, jnp.bfloat16, ... (ValueError naming ``param`` else)."""
    return int(Precision.parse(p, param))


def parse_offsets(offsets: Any, param: str = "offsets") -> np.ndarray:
    """Host segment offsets (n+1,) int64, non-decreasing, starting at 0.

    Offsets describe a static layout and must live on the host (a list, tuple or NumPy array):
    reading them from the device would force a sync on every call.
    """
    if type(offsets).__module__.split(".", 1)[0] in ("torch", "jax", "jaxlib"):
        raise TypeError(f"{param}: pass host offsets (list/tuple/np.ndarray), not a device array")
    # validated layouts are cached: the same offsets come back every step
    if isinstance(offsets, np.ndarray):
        key = (offsets.dtype.str, offsets.shape, offsets.tobytes())
    elif isinstance(offsets, (list, tuple)):
        key = tuple(offsets)
    else:
        key = None
    hit = _OFFSETS.get(key) if key is not None else None
    if hit is not None:
        return hit
    off = np.asarray(offsets)
    if off.ndim != 1 or off.size < 1 or not np.issubdtype(off.dtype, np.integer):
        raise ValueError(f"{param}: need a 1-D integer sequence of length n+1 >= 1, got {offsets!r}")
    off = off.astype(np.int64)
    if off[0] != 0 or np.any(np.diff(off) < 0):
        raise ValueError(f"{param}: must start at 0 and be non-decreasing, got {off.tolist()[:16]}")
    off.setflags(write=False)  # shared through the cache
    if key is not None:
        _OFFSETS.put(key, off)
    return off


def chunk_rows(sizes: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split segments of ``sizes`` elements into chunks of at most ``chunk`` elements.

    Returns (seg, start, stop) per chunk, start/stop relative to the segment's first element.
    Empty segments get no chunk (their statistics stay zero).
    """
    if chunk <= 0:
        raise ValueError(f"chunk={chunk}: must be > 0")
    sizes = np.asarray(sizes, dtype=np.int64)
    nch = (sizes + chunk - 1) // chunk
    seg = np.repeat(np.arange(sizes.size, dtype=np.int64), nch)
    first = np.cumsum(nch) - nch
    k = np.arange(seg.size, dtype=np.int64) - np.repeat(first, nch)
    start = k * chunk
    stop = np.minimum(start + chunk, sizes[seg])
    return seg, start, stop


def leaves_and_framework(tensors: Any, param: str) -> tuple[list, str]:
    """(list of arrays, "torch" | "jax") from a list/tuple of tensors or a JAX pytree.

    TypeError naming ``param`` for a single array, non-arrays, or mixed frameworks; ValueError if
    empty. The common case (a list of one array type) costs one ``type`` check per element.
    """
    if isinstance(tensors, (list, tuple)) and tensors:
        t0 = type(tensors[0])
        if all(type(t) is t0 for t in tensors):
            try:
                return list(tensors), framework_of(tensors[0])
            except TypeError:
                pass  # not arrays: maybe a list of pytrees; the general path below decides
    if _is_array(tensors):
        raise TypeError(f"{param}: pass a list of tensors/arrays (or a pytree), not a single array")
    if isinstance(tensors, (list, tuple)) and all(_is_array(t) for t in tensors):
        leaves = list(tensors)
    else:
        try:
            import jax  # only a pytree of JAX arrays is valid here
        except ImportError:
            raise TypeError(f"{param}: expected a list of torch tensors or JAX arrays, got {type(tensors)}") from None
        leaves = jax.tree_util.tree_leaves(tensors)
    return leaves, common_framework(leaves, param)


def _is_array(x: Any) -> bool:
    try:
        framework_of(x)
        return True
    except TypeError:
        return False


def is_dense(t: Any) -> bool:
    """torch: the tensor covers exactly ``numel`` consecutive elements from ``data_ptr()``."""
    if t.is_contiguous():
        return True
    # a permutation of a contiguous layout: sorted by stride, each stride equals the product of the
    # sizes below it (size-1 dims carry no constraint)
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1)
    expect = 1
    for st, sz in dims:
        if st != expect:
            return False
        expect *= sz
    return True


def jax_on_gpu(arrays: Iterable[Any]) -> bool:
    """True when the JAX arrays live on a GPU (tracers: the default backend decides)."""
    import jax

    for a in arrays:
        devs = getattr(a, "devices", None)
        if callable(devs):
            try:
                return any(d.platform == "gpu" for d in devs())
            except Exception:  # tracers have no concrete device
                break
    return jax.default_backend() == "gpu"


class LRU:
    """Tiny dict cache for device tables keyed by layout (bounded so it cannot grow without end)."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self.data: dict = {}

    def get(self, key):
        return self.data.get(key)

    def put(self, key, value) -> None:
        if len(self.data) >= self.size:
            self.data.pop(next(iter(self.data)))
        self.data[key] = value


_OFFSETS = LRU(64)


def jax_table(cache: LRU, key: Any, build: Callable[[], tuple[Any, ...]], x: Any) -> tuple[Any, ...]:
    """A jax-triton launch's layout table and its companions: ``build()`` -> (int32 NumPy table,
    *extra) runs once per `key`. While `x` is traced (inside jit) the table is made an array within
    that trace (a constant of it alone), else the device array cached beside it comes back (eager
    calls upload nothing). A cached device array read by a trace would be closed over by every later
    trace too; jax 0.11 hoists closed-over arrays into a program's arguments, and an executable
    compiled ahead on another thread then expected one argument more than its calls passed
    (H200, 2026-11-27)."""
    import jax
    import jax.numpy as jnp

    hit = cache.get(key)
    if hit is None:
        hit = [None, *build()]   # [device copy (made at the first eager call), host table, *extra]
        cache.put(key, hit)
    if isinstance(x, jax.core.Tracer):
        return (jnp.asarray(hit[1]), *hit[2:])
    if hit[0] is None:
        hit[0] = jnp.asarray(hit[1])
    return (hit[0], *hit[2:])


ALIGN = 16  # elements: rows after a segment's first start at a multiple of this (vector loads)


def segment_rows(sizes: np.ndarray, starts: np.ndarray, chunk: int, step_unit: int) -> tuple[np.ndarray, ...]:
    """Split segments into rows (one program each) of at most about ``chunk`` elements.

    sizes: elements per segment; starts: element offset of each segment's first element from its
    (16-element-aligned) base pointer; chunk: target elements per row; step_unit: rows other than
    a segment's last hold a multiple of this many elements past the head (a multiple of ``ALIGN``).
    A segment's first row also holds the ``(-start) % ALIGN`` head elements before its first
    aligned element, so every later row starts aligned. Rows of one segment are balanced in size.
    An empty segment gets one empty row (its program writes zeros).
    Returns (seg, row_start, row_len, nrows_of_seg) per row; row_start is relative to the base
    pointer (``starts[seg]`` + offset in the segment).
    """
    if chunk <= 0 or step_unit <= 0 or step_unit % ALIGN:
        raise ValueError(f"chunk={chunk}, step_unit={step_unit}: need chunk > 0 and step_unit a positive "
                         f"multiple of {ALIGN}")
    sizes = np.asarray(sizes, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    head = np.minimum((-starts) % ALIGN, sizes)
    body = sizes - head
    nr = np.maximum(1, -(-body // chunk))
    step = -(-body // nr)
    step = np.where(nr > 1, -(-step // step_unit) * step_unit, np.maximum(body, 1))
    nr = np.maximum(1, -(-body // step))  # rounding the step up may leave fewer rows
    seg = np.repeat(np.arange(sizes.size, dtype=np.int64), nr)
    k = np.arange(seg.size, dtype=np.int64) - np.repeat(np.cumsum(nr) - nr, nr)
    lo = np.where(k == 0, 0, head[seg] + k * step[seg])
    hi = np.minimum(sizes[seg], head[seg] + (k + 1) * step[seg])
    return seg, starts[seg] + lo, hi - lo, nr[seg]


def auto_chunk(total: int, sms: int, per_sm: int, unit: int) -> int:
    """Elements per row so that ``total`` elements give about ``sms * per_sm`` rows (>= ``unit``,
    a multiple of it): few, long programs for huge inputs, many short ones for small inputs."""
    target = max(1, sms * per_sm)
    return max(unit, -(-(-(-total // target)) // unit) * unit)


def import_jax_triton() -> Any:
    """``jax_triton``, imported lazily (it cannot be imported without a GPU), with its kernel
    compilations cached on disk (`jax_triton_cache`). Its import sets ``TRITON_CACHE_DIR=""``, after
    which Triton cannot compile kernels launched from torch in the same process ("Could not create
    or locate cache dir"): the variable is put back as it was."""
    import sys

    if "jax_triton" in sys.modules:
        return sys.modules["jax_triton"]
    had = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton

    if had is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = had
    from .jax_triton_cache import install

    install(jax_triton)  # its compilations kept on disk: a new process does not repeat them
    return jax_triton


_KEYFNS: tuple = ()


def _key_fns() -> tuple:
    """(data_ptr, shape, stride, dtype) getters over torch tensors, bound on first use (this module
    imports no framework at import)."""
    global _KEYFNS
    if not _KEYFNS:
        import operator

        import torch

        _KEYFNS = (torch.Tensor.data_ptr, operator.attrgetter("shape"), torch.Tensor.stride,
                   operator.attrgetter("dtype"))
    return _KEYFNS


def torch_layout_key(tensors: Sequence[Any]) -> tuple:
    """Address, shape, strides and dtype of every tensor, as a hashable key (C-level ``map``s, no
    Python loop: the per-call cost of a cached launch plan). Under CUDA's unified addressing an
    address also fixes the device."""
    f0, f1, f2, f3 = _key_fns()
    return (tuple(map(f0, tensors)), tuple(map(f1, tensors)), tuple(map(f2, tensors)),
            tuple(map(f3, tensors)))


def torch_shape_key(tensors: Sequence[Any]) -> tuple:
    """Shape, strides and dtype of every tensor and the first one's device, as a hashable key:
    what a launch plan depends on apart from the addresses."""
    _, f1, f2, f3 = _key_fns()
    return (tuple(map(f1, tensors)), tuple(map(f2, tensors)), tuple(map(f3, tensors)), tensors[0].device)


def torch_addresses(tensors: Sequence[Any]) -> tuple:
    """Every tensor's data address (the per-call part of a launch over a list of tensors)."""
    return tuple(map(_key_fns()[0], tensors))


def torch_addresses_or_none(tensors: Sequence[Any]) -> tuple | None:
    """:func:`torch_addresses`, or None when an element is not a torch tensor (a caller's fast path
    then falls back to its full path, which names the bad element)."""
    try:
        return torch_addresses(tensors)
    except TypeError:
        return None


def upload(dst: Any, host: np.ndarray) -> None:
    """Copy a host array into the torch tensor ``dst`` (same dtype, same number of elements) with no
    stream sync (a pageable copy blocks the host until the GPU has drained its queue): through a
    pinned buffer of torch's caching host allocator, which keeps it alive until the copy has run."""
    import torch

    src = torch.from_numpy(np.ascontiguousarray(host)).view(dst.shape)
    if dst.device.type == "cuda":
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


_SMS: dict = {}


def torch_sm_count(device: Any) -> int:
    """Streaming multiprocessors of a torch CUDA device (cached); 16 stands in for a CPU."""
    key = (device.type, device.index)
    n = _SMS.get(key)
    if n is None:
        if device.type == "cuda":
            import torch

            n = torch.cuda.get_device_properties(device).multi_processor_count
        else:
            n = 16
        _SMS[key] = n
    return n


def jax_sm_count(array: Any) -> int:
    """Streaming multiprocessors of the GPU holding a JAX array (132 when unknown, an H100/H200)."""
    try:
        dev = next(iter(array.devices()))
        return int(getattr(dev, "core_count", 0)) or 132
    except Exception:  # tracers: no concrete device
        return 132


class Launcher:
    """A Triton kernel launched at one grid with fixed meta-parameters, minus Triton's per-call
    argument binding: the first call goes through ``kernel[grid](...)`` (which compiles and
    returns the compiled kernel); later calls with the same ``spec`` (the caller's summary of what
    Triton specialises on: pointer alignment of the arguments that vary) call the compiled
    kernel's launcher directly. Under the Triton interpreter every call takes the ordinary path.
    """

    __slots__ = ("fn", "grid", "meta", "tail", "runners")

    def __init__(self, fn: Any, grid: int, meta: dict) -> None:
        """meta: the constexpr parameters, in signature order after all runtime parameters, plus
        launch options (num_warps, ...)."""
        self.fn = fn
        self.grid = (grid, 1, 1)
        self.meta = meta
        # the compiled launcher takes every parameter in signature order, constexprs included
        self.tail = tuple(v for n, v in meta.items() if n not in _LAUNCH_OPTIONS)
        self.runners: dict = {}

    def __call__(self, spec: Any, *args: Any) -> None:
        run = self.runners.get(spec)
        if run is not None:
            run(*args, *self.tail)
            return
        k = self.fn[self.grid](*args, **self.meta)
        if FAST_LAUNCH and k is not None and hasattr(k, "function") and not interpreter_enabled():
            self.runners[spec] = k[self.grid]


# off: every launch binds its arguments through Triton (for debugging a launcher mismatch)
FAST_LAUNCH = os.environ.get("TRIACCEL_FAST_LAUNCH", "1") != "0"
_LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg"})
