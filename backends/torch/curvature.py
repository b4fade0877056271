"""Per-layer curvature for torch models: top-k eigenvalues of each layer's Fisher or Hessian block.

Both modes run the model in eval mode through `torch.func.functional_call` with parameters and
buffers passed explicitly (detached copies of the parameters, the model's own buffers, which eval
mode only reads), so BatchNorm running statistics and the parameters' `.grad` are left untouched and
BatchNorm/Dropout behave deterministically. The module's train/eval flags are restored afterwards.

- "fisher": exact top-k of each layer's empirical Fisher F_l = (1/b) sum_i g_il g_il^T from ONE
  `vmap(grad)` pass over the b samples (per-sample gradients g_i), then the b x b Gram matrix per
  layer (one matmul per parameter tensor on the device, one host transfer of the (L, b, b) stack),
  then the core's `fisher_topk_from_gram` (an eigh of a b x b matrix per layer).
- "hessian": top-k (algebraically largest) of each layer's Hessian block H_ll by block-Krylov
  subspace iteration on Hessian-vector products. One forward and one create_graph backward per
  event; each iteration then costs one second backward per layer with the k vectors batched
  (`is_grads_batched`, i.e. vmap over the backward). Iterations are warm-started from the previous
  event's top-k Ritz vectors, so after the first (cold) event a couple of iterations per event
  suffice. Rayleigh-Ritz over the Krylov basis through the core's `ritz`.
  Blocks smaller than k (n_l <= k) are solved exactly (the basis then spans the whole block).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from triaccel.curvature import fisher_topk_from_gram, ritz

from .layers import TorchLayer

__all__ = ["CurvatureEstimator", "split_batch"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
CURVATURE_MODES = ("fisher", "hessian")


def split_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) from a batch given as a 2-sequence or a dict with 'x'/'y' or 'input'/'target'."""
    if isinstance(batch, dict):
        for kx, ky in (("x", "y"), ("input", "target"), ("inputs", "targets")):
            if kx in batch and ky in batch:
                return batch[kx], batch[ky]
        raise ValueError(f"curvature batch: dict keys {sorted(batch)}; expected 'x'/'y' or 'input'/'target'")
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return batch[0], batch[1]
    raise ValueError(f"curvature batch: expected (inputs, targets), got {type(batch).__name__}")


class _EvalMode:
    """Context manager: model in eval mode, per-module training flags restored on exit."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.flags: list[tuple[nn.Module, bool]] = []

    def __enter__(self) -> None:
        self.flags = [(m, m.training) for m in self.model.modules()]
        self.model.eval()

    def __exit__(self, *exc: Any) -> None:
        for m, f in self.flags:
            m.training = f


class CurvatureEstimator:
    """Top-k eigenvalues per layer, (L, k) float64, for the controller's `observe_curvature`.

    model: the user's module; layers: the discovered layers (fixed order); loss_fn(outputs, targets)
    -> scalar mean loss; mode: "fisher" | "hessian"; top_k: k >= 1.
    hessian_iters: subspace iterations per event once warm (>= 1); hessian_iters_cold: iterations of
    the first event (no previous subspace). fisher_chunk: vmap chunk size over samples (None = all
    b at once; smaller values lower peak memory of the per-sample pass).
    """

    def __init__(self, model: nn.Module, layers: Sequence[TorchLayer], loss_fn: LossFn, mode: str,
                 top_k: int, *, hessian_iters: int = 2, hessian_iters_cold: int = 8,
                 fisher_chunk: int | None = None, seed: int = 0) -> None:
        if mode not in CURVATURE_MODES:
            raise ValueError(f"mode={mode!r}: allowed {CURVATURE_MODES}")
        if top_k < 1:
            raise ValueError(f"top_k={top_k}: must be >= 1")
        if hessian_iters < 1 or hessian_iters_cold < 1:
            raise ValueError(f"hessian_iters={hessian_iters}, hessian_iters_cold={hessian_iters_cold}: "
                             "must be >= 1")
        if fisher_chunk is not None and fisher_chunk < 1:
            raise ValueError(f"fisher_chunk={fisher_chunk}: must be None or >= 1")
        self.model, self.layers, self.loss_fn = model, list(layers), loss_fn
        self.mode, self.top_k = mode, top_k
        self.hessian_iters, self.hessian_iters_cold = hessian_iters, hessian_iters_cold
        self.fisher_chunk, self.seed = fisher_chunk, seed
        # Warm start for "hessian": per layer, (k_l, n_l) rows spanning the last subspace.
        self._basis: list[torch.Tensor | None] = [None] * len(self.layers)
        self._batched_ok = True
        self.events = 0

    # -- helpers -------------------------------------------------------------------------------
    def _named(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        owned = {id(p) for layer in self.layers for _, p in layer.params}
        params = {n: p.detach() for layer in self.layers for n, p in layer.params}
        frozen = {n: p.detach() for n, p in self.model.named_parameters() if id(p) not in owned}
        buffers = dict(self.model.named_buffers())
        return params, frozen, buffers

    def __call__(self, batch: Any) -> np.ndarray:
        """Eigenvalues (L, k), descending per row, on `batch` = (inputs (b, ...), targets (b, ...))."""
        x, y = split_batch(batch)
        if x.shape[0] != y.shape[0] or x.shape[0] < 1:
            raise ValueError(f"curvature batch: inputs {tuple(x.shape)} and targets {tuple(y.shape)} "
                             "need the same non-zero leading batch size")
        with _EvalMode(self.model):
            out = self._fisher(x, y) if self.mode == "fisher" else self._hessian(x, y)
        self.events += 1
        return out

    # -- fisher --------------------------------------------------------------------------------
    def _fisher(self, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
        params, frozen, buffers = self._named()
        model, loss_fn = self.model, self.loss_fn

        def loss_one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            out = functional_call(model, (p, frozen, buffers), (xi.unsqueeze(0),))
            return loss_fn(out, yi.unsqueeze(0))

        with torch.enable_grad():
            g = vmap(grad(loss_one), in_dims=(None, 0, 0), chunk_size=self.fisher_chunk)(params, x, y)
        b = x.shape[0]
        grams = []
        for layer in self.layers:
            acc = None
            for n, _ in layer.params:
                flat = g[n].reshape(b, -1).float()
                gg = flat @ flat.T
                acc = gg if acc is None else acc + gg
            grams.append(acc)
        stack = torch.stack(grams).double().cpu().numpy()  # one host transfer: (L, b, b)
        return np.stack([fisher_topk_from_gram(stack[i], self.top_k) for i in range(len(self.layers))])

    # -- hessian -------------------------------------------------------------------------------
    def _hvp_batched(self, grads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                     vecs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """H_ll applied to k vectors at once; vecs[j]: (k, *inputs[j].shape)."""
        if self._batched_ok:
            try:
                return torch.autograd.grad(grads, inputs, grad_outputs=vecs, retain_graph=True,
                                           is_grads_batched=True, allow_unused=True)
            except RuntimeError as exc:  # some ops have no batching rule for double backward
                self._batched_ok = False
                warnings.warn(f"CurvatureEstimator: batched HVPs failed ({exc}); looping over the k "
                              "vectors instead (slower).", RuntimeWarning, stacklevel=3)
        k = vecs[0].shape[0]
        rows = [torch.autograd.grad(grads, inputs, grad_outputs=[v[i] for v in vecs], retain_graph=True,
                                    allow_unused=True) for i in range(k)]
        return tuple(torch.stack([r[j] if r[j] is not None else torch.zeros_like(inputs[j]) for r in rows])
                     for j in range(len(inputs)))

    def _hessian(self, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
        params, frozen, buffers = self._named()
        leaves = {n: p.clone().requires_grad_(True) for n, p in params.items()}
        out_eigs = np.zeros((len(self.layers), self.top_k))
        with torch.enable_grad():
            loss = self.loss_fn(functional_call(self.model, (leaves, frozen, buffers), (x,)), y)
            names = [n for layer in self.layers for n, _ in layer.params]
            first = torch.autograd.grad(loss, [leaves[n] for n in names], create_graph=True, allow_unused=True)
            grads = dict(zip(names, first))
            for li, layer in enumerate(self.layers):
                lnames = [n for n, _ in layer.params]
                inputs = [leaves[n] for n in lnames]
                lgrads = [grads[n] for n in lnames]
                shapes = [t.shape for t in inputs]
                sizes = [t.numel() for t in inputs]
                n_l = sum(sizes)
                k_l = min(self.top_k, n_l)
                if any(gr is None or not gr.requires_grad for gr in lgrads):
                    # The loss is linear in (or does not depend on) this layer: its block is zero.
                    continue
                basis = self._basis[li]
                if basis is None or basis.shape != (k_l, n_l):
                    gen = torch.Generator(device="cpu").manual_seed(self.seed + li)
                    basis = torch.randn(k_l, n_l, generator=gen, dtype=torch.float32).to(inputs[0].device)
                    iters = self.hessian_iters_cold
                else:
                    iters = self.hessian_iters
                vals, basis = self._block_krylov(lgrads, inputs, basis, iters)
                out_eigs[li, :k_l] = vals[:k_l]
                if k_l < self.top_k:  # the block has only n_l eigenvalues: pad with its smallest
                    out_eigs[li, k_l:] = vals[k_l - 1]
                if not torch.isfinite(basis).all():
                    basis = None  # do not warm-start from garbage
                self._basis[li] = basis.detach() if basis is not None else None
        return out_eigs

    def _block_krylov(self, lgrads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                      start: torch.Tensor, iters: int) -> tuple[np.ndarray, torch.Tensor]:
        """Block Krylov subspace iteration on one Hessian block from `start` (k, n) rows.

        Each iteration applies H to k vectors (one batched second backward) and extends the basis
        [Q_0, Q_1, ...] (fully re-orthogonalised); Rayleigh-Ritz over the whole basis then gives the
        algebraically largest eigenvalues (a plain power/subspace iteration converges to the largest
        MAGNITUDES, i.e. can lock onto negative curvature, and stalls on clustered spectra).
        Returns (Ritz values (m,) descending, top-k Ritz vectors (k, n) to warm-start the next event).
        """
        k, n = start.shape
        shapes = [t.shape for t in inputs]
        sizes = [t.numel() for t in inputs]
        qs: list[torch.Tensor] = []
        ws: list[torch.Tensor] = []
        block = start.to(torch.float32)
        for it in range(iters):
            if qs:  # orthogonalise against the basis so far (twice: classical Gram-Schmidt is leaky)
                basis = torch.cat(qs)
                for _ in range(2):
                    block = block - (block @ basis.T) @ basis
            room = n - sum(q.shape[0] for q in qs)
            if room <= 0:
                break  # the Krylov space already spans the whole block
            block = block[: min(block.shape[0], room)]
            q, _ = torch.linalg.qr(block.T)                     # (n, r) orthonormal columns
            qt = q.T.contiguous()                               # (r, n)
            r = qt.shape[0]
            vecs = [c.reshape((r,) + tuple(s)).to(inp.dtype)
                    for c, s, inp in zip(qt.split(sizes, dim=1), shapes, inputs)]
            hv = self._hvp_batched(lgrads, inputs, vecs)
            w = torch.cat([h.reshape(r, -1).float() for h in hv], dim=1)  # (r, n) = (H Q)^T
            qs.append(qt)
            ws.append(w)
            block = w
        basis, hbasis = torch.cat(qs), torch.cat(ws)
        proj = (basis @ hbasis.T).double().cpu().numpy()       # B^T H B, (m, m)
        vals, rot = ritz(proj)
        ritz_vecs = torch.as_tensor(rot[:, :k].T, dtype=basis.dtype, device=basis.device) @ basis
        return vals, ritz_vecs

    def reset(self) -> None:
        """Forget the warm-start subspaces (e.g. after loading a checkpoint into the model)."""
        self._basis = [None] * len(self.layers)
