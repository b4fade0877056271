"""Device memory probe for the batch lever: allocator peak since the last read, and the usable limit.

On CUDA: `used_bytes` = `torch.cuda.max_memory_allocated` since the previous read (the peak is reset
at each read, so each control window sees its own peak); `limit_bytes` = device total minus what
other processes hold (NVML via `pynvml`, imported lazily), i.e. what this process could grow into.
Without NVML the limit is the device total from `torch.cuda.mem_get_info` (other processes' use then
shows up only through the free-memory figure, which is reported in `free_bytes`).

Without a GPU there is nothing to measure: the probe warns ONCE and `read()` returns None, and the
wrapper then skips memory observations (the batch size stays where the controller put it).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MemoryReading", "MemoryProbe"]


@dataclass(frozen=True)
class MemoryReading:
    """One probe read, in bytes. `others_bytes` is None when NVML is unavailable."""

    used_bytes: int          # this process's allocator peak since the previous read
    limit_bytes: int         # device total minus other processes' use (NVML) or device total
    total_bytes: int         # device total
    free_bytes: int          # free on the device right now (cudaMemGetInfo)
    reserved_bytes: int      # this process's allocator reservation right now
    others_bytes: int | None  # other processes' use (NVML), None without NVML

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class MemoryProbe:
    """Reads device memory for one torch device. Never raises for a missing GPU or NVML."""

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        dev = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu"))
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self._warned = False
        self._nvml: Any = None
        self._nvml_handle: Any = None
        self._nvml_tried = False
        self.available = dev.type == "cuda" and torch.cuda.is_available()
        self.peak_bytes = 0  # largest `used_bytes` ever read (reads reset torch's own peak counter)
        self._carried = 0  # the window's peak before an `excluded()` block reset torch's counter
        if not self.available:
            self._warn(f"MemoryProbe: device {dev} is not a CUDA device; memory is not measured and "
                       "the batch size is not adapted to memory (it stays at the controller's value).")

    def _warn(self, msg: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def _nvml_init(self) -> None:
        self._nvml_tried = True
        try:
            import pynvml  # nvidia-ml-py; optional

            pynvml.nvmlInit()
            # NVML enumerates physical devices; map through CUDA_VISIBLE_DEVICES when it is set.
            idx: Any = self.device.index
            vis = os.environ.get("CUDA_VISIBLE_DEVICES")
            if vis:
                entries = [v.strip() for v in vis.split(",") if v.strip()]
                if idx < len(entries):
                    idx = entries[idx]
            if isinstance(idx, str) and not idx.isdigit():
                handle = pynvml.nvmlDeviceGetHandleByUUID(idx)
            else:
                handle = pynvml.nvmlDeviceGetHandleByIndex(int(idx))
            self._nvml, self._nvml_handle = pynvml, handle
        except Exception as exc:  # ImportError, NVMLError, driver mismatch: degrade, never crash
            self._warn(f"MemoryProbe: NVML unavailable ({type(exc).__name__}: {exc}); the limit is the "
                       "device total and other processes' use is not subtracted.")

    def _others_bytes(self) -> int | None:
        if not self._nvml_tried:
            self._nvml_init()
        if self._nvml is None:
            return None
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._nvml_handle)
        except Exception as exc:
            self._nvml = None
            self._warn(f"MemoryProbe: NVML process query failed ({exc}); not subtracting other processes.")
            return None
        me = os.getpid()
        return int(sum((p.usedGpuMemory or 0) for p in procs if p.pid != me))

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Work inside (an evaluation at its own batch size, say) does not count in the next read's
        `used_bytes`: the batch lever cannot move that memory, and counted as the training step's it
        shrinks the batch (or, under offload="auto", raises the plan margin) at every evaluation."""
        if not self.available:
            yield
            return
        before = int(torch.cuda.max_memory_allocated(self.device))
        try:
            yield
        finally:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._carried = max(self._carried, before)

    def read(self) -> MemoryReading | None:
        """Peak allocated since the last read (then resets the peak), and the usable limit.

        Returns None when the device is not a GPU (see the module docstring).
        """
        if not self.available:
            return None
        dev = self.device
        used = max(int(torch.cuda.max_memory_allocated(dev)), self._carried)
        self._carried = 0
        torch.cuda.reset_peak_memory_stats(dev)
        self.peak_bytes = max(self.peak_bytes, used)
        free, total = torch.cuda.mem_get_info(dev)
        others = self._others_bytes()
        limit = int(total) - (others or 0)
        return MemoryReading(used_bytes=used, limit_bytes=limit, total_bytes=int(total),
                             free_bytes=int(free), reserved_bytes=int(torch.cuda.memory_reserved(dev)),
                             others_bytes=others)
