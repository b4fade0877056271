"""Per-tensor gradient moments from torch's own multi-tensor kernels: no Triton launch in the process.

The same contract as :func:`triaccel.kernels.grad_moments` on a torch list (an ``(n, 3)`` float32
row of [sum, sumsq, nonfinite], optional unscaling in place, optional ``found_inf``), computed with
about 15 stock launches whatever the number of tensors (and one temporary copy, allocated per tensor):

- ``inv_scale``: ``torch._amp_foreach_non_finite_check_and_unscale_`` (``GradScaler``'s own kernel)
  unscales in place and sets ``found_inf``;
- ``sumsq`` from ``torch._foreach_norm(ord=2)``; ``sum`` from two L1 norms, of the tensors and of
  their positive parts (``sum = 2 * sum(max(x, 0)) - sum(|x|)``; one temporary copy of the tensors
  for the positive parts, freed at once): exact to about 1e-5 of ``sum(|x|)`` (``sumsq`` to about
  1e-5 relative), where the Triton kernel adds the values themselves;
- all in FP32 accumulators (FP64 tensors in FP64, rounded to FP32 as the kernel's module says).

What differs from the kernel, both on tensors the caller discards anyway (a step with a non-finite
value is skipped and its statistics are not observed): ``nonfinite`` is 1.0 for a tensor holding any
NaN/Inf (the kernel counts them), and that tensor's ``sum`` and ``sumsq`` are 0 (the kernel sums its
finite values); a tensor of finite values whose L1 norm overflows FP32 (values of ~1e32 and beyond)
also reads as non-finite.

Why: a process that launches a Triton kernel pays Triton's start-up once (its cache key, its driver,
the kernel's compilation when not cached: 0.82 + 0.58 + 1.05 s of host time one after the other on
an H200 host, 2026-11-28, docs/results.md), which a 10-epoch CIFAR run sees in its set-up; importing
Triton is not that cost (the package imports it either way). Per step this costs more GPU time than
the kernel (several passes over the gradients instead of one); ``benchmarks/kernels.py`` prints both.
"""

from __future__ import annotations

import importlib
from typing import Any, Sequence

# the module, not the function of the same name that the package exports
GM = importlib.import_module(".grad_moments", __package__)


class StockMoments:
    """:class:`~triaccel.kernels.FixedMoments`'s twin on stock torch ops, for one fixed list layout.

    The first call (and any call with another number of tensors) checks the list (torch tensors on
    one device, floating point) and groups it by accumulation dtype; later calls trust tensor ``i``
    to keep its dtype and device, as ``p.grad`` does for a fixed parameter list.
    """

    __slots__ = ("_n", "_device", "_groups", "_scale", "_flag")

    def __init__(self) -> None:
        self._n = -1
        self._device = None
        self._groups: list[tuple[list[int], Any]] = []   # (tensor indices, _foreach_norm dtype)
        self._scale: dict[float, Any] = {}                # python inv_scale -> (1,) device tensor
        self._flag = None                                 # scratch found_inf for unscaling

    def _bind(self, tensors: Sequence[Any]) -> None:
        import torch

        if len(tensors) == 0:
            raise ValueError("tensors: got an empty sequence; need at least one tensor")
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                desc = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
                raise TypeError(f"tensors[{i}]: need a floating-point torch tensor, got {desc}")
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            raise ValueError(f"tensors: on {sorted(map(str, devices))}; all must share one device")
        wide = [i for i, t in enumerate(tensors) if t.dtype == torch.float64]
        narrow = [i for i, t in enumerate(tensors) if t.dtype != torch.float64]
        self._groups = [(g, d) for g, d in ((narrow, torch.float32), (wide, None)) if g]
        self._n, self._device = len(tensors), devices.pop()
        self._scale, self._flag = {}, None

    def _inv_scale(self, inv_scale: Any) -> Any:
        """`inv_scale` checked as the kernel checks it, as the (1,) device tensor the unscaling takes."""
        import torch

        mode, v = GM._torch_scale(inv_scale, self._device)
        if mode == 1:
            return v.reshape(1)
        t = self._scale.get(v)
        if t is None:
            t = self._scale[v] = torch.full((1,), v, dtype=torch.float32, device=self._device)
        return t

    def __call__(self, tensors: Sequence[Any], *, inv_scale: Any = None, out: Any = None,
                 found_inf: Any = None) -> Any:
        """tensors: list of torch tensors; inv_scale, out, found_inf and the result as in
        :func:`triaccel.kernels.grad_moments` (see the module docstring for what differs)."""
        import torch

        if GM._T is None:
            GM._bind_torch()
        if len(tensors) != self._n:
            self._bind(tensors)
        dev, n = self._device, self._n
        res = GM._out(out, n, dev)   # the kernel's checks of out and found_inf, and its messages
        found_inf = GM._found(found_inf, dev)
        ts = list(tensors)
        if inv_scale is not None:
            flag = found_inf
            if flag is None:
                if self._flag is None:
                    self._flag = torch.zeros(1, dtype=torch.float32, device=dev)
                flag = self._flag
            # unscales in place (any mix of FP16/BF16/FP32/FP64) and flags NaN/Inf, in one launch
            torch._amp_foreach_non_finite_check_and_unscale_(ts, flag.view(1), self._inv_scale(inv_scale))
        l1: list[Any] = [None] * n
        l2: list[Any] = [None] * n
        p1: list[Any] = [None] * n
        for idx, acc in self._groups:
            group = ts if len(idx) == n else [ts[i] for i in idx]
            a, q = torch._foreach_norm(group, 1, dtype=acc), torch._foreach_norm(group, 2, dtype=acc)
            pos = torch._foreach_norm(torch._foreach_clamp_min(group, 0.0), 1, dtype=acc)
            for j, i in enumerate(idx):
                l1[i], l2[i], p1[i] = a[j], q[j], pos[j]
        # few launches per call: a step is host-bound at small batches
        a, q, pos = torch.stack([*l1, *l2, *p1]).float().view(3, n).unbind(0)
        bad = torch.isfinite(a).logical_not_()
        # lerp(a, pos, 2) = 2 * pos - a: the sum
        torch.stack([torch.lerp(a, pos, 2.0), q.square(), bad.float()], dim=1, out=res)
        res[:, :2].masked_fill_(bad.unsqueeze(1), 0.0)
        # (also after the unscaling launch: an L1 overflow reads non-finite too)
        GM._flag_found(found_inf, res[:, 2])
        return res if out is not None else GM._torch_moments(res)


def grad_moments_stock(tensors: Sequence[Any], *, inv_scale: Any = None, out: Any = None,
                       found_inf: Any = None) -> Any:
    """:class:`StockMoments` for one call (the list checked every time): per-tensor (sum, sumsq,
    nonfinite) of a list of torch tensors with stock torch ops, as :func:`grad_moments` returns them."""
    return StockMoments()(tensors, inv_scale=inv_scale, out=out, found_inf=found_inf)
