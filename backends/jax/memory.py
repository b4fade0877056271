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

import warnings
from dataclasses import dataclass
from typing import Any

import jax

__all__ = ["MemorySample", "MemoryProbe", "nvml_total_bytes"]


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
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        idx = int(getattr(device, "local_hardware_id", None) or getattr(device, "id", 0))
        handle = pynvml.nvmlDeviceGetHandleByIndex(idx)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
    except Exception:  # NVML present but no NVIDIA device/driver: not an error for the caller
        return None


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
