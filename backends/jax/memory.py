"""Device-memory probe for JAX: what the controller's batch lever observes. No decisions here.

Source of truth is the XLA allocator (`device.memory_stats()`): ``bytes_in_use`` and
``peak_bytes_in_use`` count live buffers whether or not JAX preallocated its pool, and
``bytes_limit`` is the pool JAX may use (75% of the GPU by default with preallocation, see
XLA_PYTHON_CLIENT_MEM_FRACTION). NVML is read lazily and only reports the device total and the
process' reserved bytes (with preallocation that is the whole pool, useless as "used"), so it is
a fallback for the limit only. On CPU there are no allocator statistics: the probe returns None
after one warning and the batch lever stays where the config puts it.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

import jax

__all__ = ["MemorySample", "MemoryProbe", "fit_batch", "limit_device_memory", "nvml_total_bytes", "pool_capped"]


@dataclass(frozen=True)
class MemorySample:
    """One reading, in bytes. used: peak in use since the previous reading (see MemoryProbe);
    in_use: live now; limit: what this process may allocate; source: "compiled" or "memory_stats"
    (see MemoryProbe)."""

    used: int
    in_use: int
    limit: int
    source: str


def nvml_total_bytes(device: Any) -> int | None:
    """Total memory of `device` from NVML (lazy import); None when NVML or the device is absent."""
    return _nvml_total_at(int(getattr(device, "local_hardware_id", None) or getattr(device, "id", 0)))


class MemoryProbe:
    """Reads device memory for `Controller.observe_memory`.

    XLA keeps one process-wide peak and offers no reset, and between steps the bytes in use miss
    the step's activations (an H200 run grew its batch to a 9.8 GB peak under a 4 GiB budget on
    that signal). Two ways to see a step's peak, best first:

    1. `footprint` (bytes): what the step needs beyond its arguments, from XLA's compiled memory
       analysis (`CountingJit.footprint`, `TriAccel.footprint`); then used = in_use + footprint,
       the peak XLA planned for that step. Source "compiled".
    2. Otherwise the allocator's peak when it set a new record since the previous reading, and
       between records the last record's step-dependent part scaled by `batch`:
       `in_use + (record - in_use_then) * batch / batch_then` — conservative (the record may
       include compilation scratch), never below the bytes in use now. Source "memory_stats".
    """

    def __init__(self, device: Any = None) -> None:
        self.device = device if device is not None else jax.local_devices()[0]
        self._last_peak = 0
        self._record: tuple[int, int, int] | None = None  # (peak, in_use then, batch then)
        self._warned = False
        self._limit_fallback: int | None = None

    def stats(self) -> dict[str, int] | None:
        """The raw allocator statistics, or None where the platform has none (CPU)."""
        try:
            s = self.device.memory_stats()
        except Exception:  # some platforms raise instead of returning None
            s = None
        return dict(s) if s else None

    def read(self, batch: int | None = None, footprint: int | None = None) -> MemorySample | None:
        """One MemorySample, or None (with one warning per probe) when the device reports nothing.

        batch: the micro-batch size in force since the last reading; footprint: the step's bytes
        beyond its arguments at that batch, when known (see the class docstring)."""
        if footprint is not None and footprint < 0:
            raise ValueError(f"footprint={footprint}: must be >= 0 bytes")
        s = self.stats()
        if not s or "bytes_in_use" not in s:
            if not self._warned:
                warnings.warn(f"triaccel: device {self.device} ({self.device.platform}) reports no memory "
                              "statistics; the memory-elastic batch lever gets no observations and keeps "
                              "its batch size", RuntimeWarning, stacklevel=2)
                self._warned = True
            return None
        in_use = int(s["bytes_in_use"])
        peak = int(s.get("peak_bytes_in_use", in_use))
        source = "memory_stats"
        if footprint is not None:
            used, source = in_use + footprint, "compiled"
        elif peak > self._last_peak:
            used = peak
        elif batch is not None and self._record is not None:
            rec_peak, rec_in_use, rec_batch = self._record
            used = max(in_use, int(in_use + max(rec_peak - rec_in_use, 0) * batch / rec_batch))
        else:
            used = in_use
        if peak > self._last_peak and batch is not None:
            self._record = (peak, in_use, batch)
        self._last_peak = max(self._last_peak, peak)
        limit = s.get("bytes_limit") or s.get("bytes_reservable_limit")
        if limit and _POOL_CAPPED:
            # the pool was cut to the budget by limit_device_memory, a hair under it (XLA keeps a
            # few MiB back): the limit is the device's, the budget bounds the batch in the controller
            if self._limit_fallback is None:
                self._limit_fallback = nvml_total_bytes(self.device) or 0
            limit = max(int(limit), self._limit_fallback)
        if not limit:
            if self._limit_fallback is None:
                self._limit_fallback = nvml_total_bytes(self.device) or 0
            limit = self._limit_fallback
        if not limit:
            if not self._warned:
                warnings.warn(f"triaccel: device {self.device} reports no memory limit (memory_stats and NVML); "
                              "the batch lever gets no observations", RuntimeWarning, stacklevel=2)
                self._warned = True
            return None
        return MemorySample(used=used, in_use=in_use, limit=int(limit), source=source)


def _visible_gpu_index() -> int:
    """NVML index of the first GPU this process sees (NVML ignores CUDA_VISIBLE_DEVICES)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def _nvml_total_at(index: int) -> int | None:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).total)
    except Exception:  # NVML present but no NVIDIA device/driver
        return None


_POOL_CAPPED = False  # set by limit_device_memory: the XLA pool is the budget, not the device
_MEM_FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def _mem_fraction_var() -> str:
    """The pool-fraction variable this jaxlib reads (the new name where its GPU options know it)."""
    try:
        import inspect

        from jaxlib import xla_client

        if "'XLA_CLIENT_MEM_FRACTION'" in inspect.getsource(xla_client.generate_pjrt_gpu_plugin_options):
            return "XLA_CLIENT_MEM_FRACTION"
    except (ImportError, AttributeError, OSError, TypeError):
        pass
    return "XLA_PYTHON_CLIENT_MEM_FRACTION"


def pool_capped() -> bool:
    """True once `limit_device_memory` has capped this process's XLA pool at the budget."""
    return _POOL_CAPPED


def limit_device_memory(budget: int | str, device_total: int | None = None) -> float | None:
    """Cap the XLA allocator's pool at `budget` for this process, so that its peak allocation
    cannot exceed the budget: compile-time autotuning scratch and curvature passes come from the
    same pool (on an H200 the first call of each new step variant set the process peak, 2-6 GB above
    the step's own footprint), and autotuning skips the algorithms whose scratch does not fit.

    budget: bytes or a string like "4GiB". device_total: the GPU's memory in bytes (default: NVML,
    first visible GPU). Sets ``XLA_CLIENT_MEM_FRACTION`` (``XLA_PYTHON_CLIENT_MEM_FRACTION`` on a
    jaxlib that reads only that one; never both: jaxlib refuses that) to budget / device_total and ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless set (grow on demand
    up to the cap). Must run before JAX starts its GPU backend (the first device query or
    computation): RuntimeError after. A user-set fraction that is already smaller is kept.
    Returns the fraction in force, or None where no GPU total is known (no NVIDIA GPU: nothing set).
    """
    from triaccel.config import parse_bytes

    b = parse_bytes(budget, "budget")
    total = device_total if device_total is not None else _nvml_total_at(_visible_gpu_index())
    if total is None:
        return None
    if total <= 0:
        raise ValueError(f"device_total={total!r}: must be a positive number of bytes")
    if b > total:
        raise ValueError(f"budget={budget!r} ({b} bytes) exceeds the device's {total} bytes: allowed (0, {total}]")
    try:
        from jax._src import xla_bridge

        started = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # a jax without that query: trust the caller
        started = False
    if started:
        raise RuntimeError("limit_device_memory: JAX's backend is already running (a device was queried or a "
                           "computation ran); call it first thing, before any JAX device use")
    fraction = b / total
    # jaxlib reads XLA_CLIENT_MEM_FRACTION and, deprecated, XLA_PYTHON_CLIENT_MEM_FRACTION, and refuses
    # to start its GPU backend when both are set: one variable only, the user's if they set one.
    names = [n for n in _MEM_FRACTION_VARS if os.environ.get(n)]
    if len(names) > 1:
        raise ValueError(f"{' and '.join(names)} are both set: jaxlib accepts one; unset {names[1]}")
    name = names[0] if names else _mem_fraction_var()
    user = os.environ.get(name)
    if user:
        try:
            if float(user) <= fraction:
                return float(user)
        except ValueError:
            raise ValueError(f"{name}={user!r}: not a number") from None
        warnings.warn(f"triaccel: {name}={user} replaced by {fraction:.4f} "
                      f"(budget {b} bytes of {total})", RuntimeWarning, stacklevel=2)
    os.environ[name] = f"{fraction:.6f}"
    global _POOL_CAPPED
    _POOL_CAPPED = True
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return fraction


def fit_batch(size: int, footprint_at: Any, in_use: int, budget: int) -> int:
    """The largest of size, size/2, size/4, ... (>= 1) whose modelled peak ``in_use +
    footprint_at(n)`` stays within `budget` bytes; 1 when none does (the caller reports it).
    footprint_at(n): bytes a pass over n samples needs beyond its arguments (e.g. XLA's compiled
    memory analysis), or None when unknown (then n is taken)."""
    if size < 1:
        raise ValueError(f"size={size}: must be >= 1 sample")
    n = size
    while n > 1:
        fp = footprint_at(n)
        if fp is None or in_use + fp <= budget:
            return n
        n //= 2
    return 1
