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
  event; each iteration then costs one batched second backward (`is_grads_batched`, i.e. vmap over
  the backward) per PACK of `hessian_pack` layers: each layer's k vectors occupy their own probe
  rows, zero outside that layer's parameters, so the product read in layer l's slice is exactly
  H_ll q (no cross-layer term H_lm q_m). Rayleigh-Ritz per layer over its Krylov basis (core
  `ritz`). Warm start: each event stores, per layer, (H_ll - sigma I) applied to its top-k Ritz
  vectors (sigma = min(0, lowest Ritz value)) and starts the next event from it, so one iteration
  per event (the default) still performs a power step per event on top of the Rayleigh-Ritz; the
  first (cold) event runs `hessian_iters_cold` iterations. `hessian_layers_per_event` = n refreshes
  only n layers per event, round-robin (plus any layer without an estimate yet); the others report
  their last estimate, at most ceil(L/n) events old. Blocks with n_l <= k are solved exactly.
  Rejected design: all layers in the same probe rows (one k-wide HVP for the whole model) adds
  sum_m H_lm q_m to layer l's product; on the test MLP this put a top-1 at 0.415 for a true 0.157.
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
# Defaults that fit the cost budget (see the module docstring and docs/benchmarks.md, "Curvature cost").
DEFAULT_HESSIAN_ITERS = 1
DEFAULT_LAYERS_PER_EVENT: int | None = 6
DEFAULT_PACK = 1


class _Block:
    """One layer's Hessian block during an event: its leaves, their first-order grads (with graph)."""

    def __init__(self, index: int, inputs: list[torch.Tensor], grads: list[torch.Tensor], k: int) -> None:
        self.index, self.inputs, self.grads, self.k = index, inputs, grads, k
        self.sizes = [t.numel() for t in inputs]
        self.n = sum(self.sizes)
        self.vals = np.zeros(0)


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
    hessian_iters: subspace iterations per event once warm (>= 1; default 1, each event also carries
    a power step); hessian_iters_cold: iterations of a layer's first event (no stored subspace).
    hessian_layers_per_event: layers refreshed per event, round-robin (default 6; None = all
    layers every event, i.e. no staleness; estimates are then up to ceil(L/n) events old);
    hessian_pack: layers whose probes share one batched second backward (exact either way; 1 was
    fastest on the H200 with ResNet-18 when refreshing 8 layers per event). fisher_chunk: vmap chunk size over samples (None = all
    b at once; smaller values lower peak memory of the per-sample pass).
    """

    def __init__(self, model: nn.Module, layers: Sequence[TorchLayer], loss_fn: LossFn, mode: str,
                 top_k: int, *, hessian_iters: int = DEFAULT_HESSIAN_ITERS, hessian_iters_cold: int = 8,
                 hessian_layers_per_event: int | None = DEFAULT_LAYERS_PER_EVENT,
                 hessian_pack: int = DEFAULT_PACK, fisher_chunk: int | None = None, seed: int = 0) -> None:
        if mode not in CURVATURE_MODES:
            raise ValueError(f"mode={mode!r}: allowed {CURVATURE_MODES}")
        if top_k < 1:
            raise ValueError(f"top_k={top_k}: must be >= 1")
        if hessian_iters < 1 or hessian_iters_cold < 1:
            raise ValueError(f"hessian_iters={hessian_iters}, hessian_iters_cold={hessian_iters_cold}: "
                             "must be >= 1")
        if hessian_layers_per_event is not None and hessian_layers_per_event < 1:
            raise ValueError(f"hessian_layers_per_event={hessian_layers_per_event}: must be None (all "
                             "layers every event) or >= 1")
        if hessian_pack < 1:
            raise ValueError(f"hessian_pack={hessian_pack}: must be >= 1")
        if fisher_chunk is not None and fisher_chunk < 1:
            raise ValueError(f"fisher_chunk={fisher_chunk}: must be None or >= 1")
        self.model, self.layers, self.loss_fn = model, list(layers), loss_fn
        self.mode, self.top_k = mode, top_k
        self.hessian_iters, self.hessian_iters_cold = hessian_iters, hessian_iters_cold
        self.hessian_layers_per_event, self.hessian_pack = hessian_layers_per_event, hessian_pack
        self.fisher_chunk, self.seed = fisher_chunk, seed
        # Warm start for "hessian": per layer, (k_l, n_l) rows spanning the next start subspace.
        self._basis: list[torch.Tensor | None] = [None] * len(self.layers)
        # Last (k,) estimate per layer ("hessian"), returned for layers not refreshed this event.
        self._eigs: list[np.ndarray | None] = [None] * len(self.layers)
        self._cursor = 0  # next layer of the round-robin cycle
        self.refreshed: tuple[int, ...] = ()  # layers recomputed by the last "hessian" event
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
        """H[inputs, inputs] applied to r vectors at once; vecs[j]: (r, *inputs[j].shape).

        Differentiates sum_j <grads[j], vecs[j]> w.r.t. `inputs`: with grads/inputs of one layer this
        is H_ll v; with all layers it is the full Hessian (restricted to those layers) applied to v.
        """
        res: Sequence[torch.Tensor | None] | None = None
        if self._batched_ok:
            try:
                res = torch.autograd.grad(grads, inputs, grad_outputs=vecs, retain_graph=True,
                                          is_grads_batched=True, allow_unused=True)
            except RuntimeError as exc:  # some ops have no batching rule for double backward
                self._batched_ok = False
                warnings.warn(f"CurvatureEstimator: batched HVPs failed ({exc}); looping over the "
                              "vectors instead (slower).", RuntimeWarning, stacklevel=3)
        if res is None:
            r = vecs[0].shape[0]
            rows = [torch.autograd.grad(grads, inputs, grad_outputs=[v[i] for v in vecs], retain_graph=True,
                                        allow_unused=True) for i in range(r)]
            return tuple(torch.stack([row[j] if row[j] is not None else torch.zeros_like(inputs[j])
                                      for row in rows]) for j in range(len(inputs)))
        return tuple(h if h is not None else torch.zeros_like(v) for h, v in zip(res, vecs))

    def _hessian(self, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
        params, frozen, buffers = self._named()
        leaves = {n: p.clone().requires_grad_(True) for n, p in params.items()}
        selected = self._select_layers()
        with torch.enable_grad():
            loss = self.loss_fn(functional_call(self.model, (leaves, frozen, buffers), (x,)), y)
            names = [n for layer in self.layers for n, _ in layer.params]
            first = torch.autograd.grad(loss, [leaves[n] for n in names], create_graph=True, allow_unused=True)
            grads = dict(zip(names, first))
            blocks: list[_Block] = []
            for li in selected:
                layer = self.layers[li]
                lnames = [n for n, _ in layer.params]
                lgrads = [grads[n] for n in lnames]
                if any(gr is None or not gr.requires_grad for gr in lgrads):
                    # The loss is linear in (or does not depend on) this layer: its block is zero.
                    self._eigs[li] = np.zeros(self.top_k)
                    continue
                blocks.append(_Block(li, [leaves[n] for n in lnames], lgrads, min(self.top_k, layer.numel)))
            # Cold blocks (no stored subspace) and warm ones run different iteration counts: pack apart.
            for cold in (True, False):
                todo = [b for b in blocks if self._is_cold(b) == cold]
                for i in range(0, len(todo), self.hessian_pack):
                    self._krylov_group(todo[i: i + self.hessian_pack],
                                       self.hessian_iters_cold if cold else self.hessian_iters)
        for b in blocks:
            row = np.empty(self.top_k)
            row[: b.k] = b.vals[: b.k]
            row[b.k:] = b.vals[b.k - 1]  # a block with n_l < k has only n_l eigenvalues: pad with its smallest
            self._eigs[b.index] = row
        self.refreshed = tuple(selected)
        return np.stack([np.asarray(e, dtype=np.float64) for e in self._eigs])  # all rows set by now

    def _select_layers(self) -> list[int]:
        """Layers whose block this event recomputes: every layer without an estimate yet, plus the
        next `hessian_layers_per_event` layers of the round-robin cycle (all layers when None)."""
        L = len(self.layers)
        missing = [i for i in range(L) if self._eigs[i] is None]
        per = self.hessian_layers_per_event
        if per is None or per >= L:
            return list(range(L))
        if len(missing) == L:  # first event: all layers; the cycle starts at layer 0 next time
            return missing
        chosen = {(self._cursor + j) % L for j in range(per)}
        self._cursor = (self._cursor + per) % L
        return sorted(chosen.union(missing))

    def _is_cold(self, b: "_Block") -> bool:
        prev = self._basis[b.index]
        return prev is None or tuple(prev.shape) != (b.k, b.n)

    def _krylov_group(self, group: list["_Block"], iters: int) -> None:
        """Block Krylov subspace iteration on the diagonal Hessian blocks of the layers in `group`.

        Each iteration orthonormalises, per layer, its current block of k_l vectors against that
        layer's basis so far and packs all layers' vectors as disjoint probe rows (layer l's rows are
        zero outside layer l's parameters), so ONE batched second backward applies each diagonal
        block H_ll to its own vectors exactly: a probe that touches only layer l has no cross-layer
        term in layer l's slice. Rayleigh-Ritz over each layer's whole basis then gives the
        algebraically largest eigenvalues (plain power iteration converges to the largest
        MAGNITUDES and stalls on clustered spectra). Sets `vals` (Ritz values, descending) per block
        and stores, as the next event's start (k_l, n_l), (H_ll - sigma I) applied to the top-k Ritz
        vectors: one free power step (sigma = min(0, lowest Ritz value), so that negative curvature
        is not amplified), so that even one iteration per event keeps refining the subspace.
        """
        device = group[0].inputs[0].device
        qs: list[list[torch.Tensor]] = [[] for _ in group]
        ws: list[list[torch.Tensor]] = [[] for _ in group]
        cur: list[torch.Tensor | None] = []
        for b in group:
            prev = self._basis[b.index]
            if prev is None or tuple(prev.shape) != (b.k, b.n):
                gen = torch.Generator(device="cpu").manual_seed(self.seed + b.index)
                prev = torch.randn(b.k, b.n, generator=gen, dtype=torch.float32)
            cur.append(prev.to(device=device, dtype=torch.float32))
        for _ in range(iters):
            probes: list[tuple[int, torch.Tensor]] = []  # (position in group, (r_l, n_l) orthonormal rows)
            for gi, b in enumerate(group):
                blk = cur[gi]
                if blk is None:
                    continue
                if qs[gi]:  # orthogonalise against the basis so far (twice: classical Gram-Schmidt leaks)
                    basis = torch.cat(qs[gi])
                    for _ in range(2):
                        blk = blk - (blk @ basis.T) @ basis
                room = b.n - sum(q.shape[0] for q in qs[gi])
                if room <= 0:
                    cur[gi] = None  # the basis already spans the whole block
                    continue
                q, _ = torch.linalg.qr(blk[: min(blk.shape[0], room)].T)  # (n_l, r_l) orthonormal columns
                probes.append((gi, q.T.contiguous()))
            if not probes:
                break
            rows = sum(qt.shape[0] for _, qt in probes)
            grads_in: list[torch.Tensor] = []
            inputs: list[torch.Tensor] = []
            vecs: list[torch.Tensor] = []
            off = 0
            for gi, qt in probes:
                b = group[gi]
                r = qt.shape[0]
                for c, inp in zip(qt.split(b.sizes, dim=1), b.inputs):
                    v = inp.new_zeros((rows,) + tuple(inp.shape))
                    v[off: off + r] = c.reshape((r,) + tuple(inp.shape))
                    vecs.append(v)
                grads_in += b.grads
                inputs += b.inputs
                off += r
            hv = self._hvp_batched(grads_in, inputs, vecs)
            pos, off = 0, 0
            for gi, qt in probes:
                b = group[gi]
                r = qt.shape[0]
                parts = hv[pos: pos + len(b.inputs)]
                pos += len(b.inputs)
                w = torch.cat([h[off: off + r].reshape(r, -1).float() for h in parts], dim=1)  # (H_ll Q)^T
                off += r
                qs[gi].append(qt)
                ws[gi].append(w)
                cur[gi] = w
        # Rayleigh-Ritz per layer; the small projected matrices travel to the host in one transfer.
        bases = [torch.cat(q) for q in qs]
        hbases = [torch.cat(w) for w in ws]
        projs = [bb @ hb.T for bb, hb in zip(bases, hbases)]  # Q H_ll Q^T, (m_l, m_l)
        flat = torch.cat([p.reshape(-1) for p in projs]).double().cpu().numpy()
        off = 0
        for gi, b in enumerate(group):
            m = projs[gi].shape[0]
            vals, rot = ritz(flat[off: off + m * m].reshape(m, m))
            off += m * m
            b.vals = vals
            rot_k = torch.as_tensor(rot[:, : b.k].T.copy(), dtype=torch.float32, device=device)
            ritz_vecs = rot_k @ bases[gi]
            sigma = min(0.0, float(vals[-1]))
            nxt = rot_k @ hbases[gi] - sigma * ritz_vecs  # (H_ll - sigma I) y, (k_l, n_l)
            # A fully spanned block has H y = theta y: keep y (same span, no zero rows).
            if m >= b.n or not bool(torch.isfinite(nxt).all()) or bool((nxt.norm(dim=1) == 0).any()):
                nxt = ritz_vecs
            self._basis[b.index] = nxt.detach() if bool(torch.isfinite(nxt).all()) else None

    def state_dict(self) -> dict[str, Any]:
        """Warm-start subspaces, last estimates and the round-robin position (CPU tensors/lists)."""
        return {"basis": [None if b is None else b.detach().cpu().clone() for b in self._basis],
                "eigs": [None if e is None else np.asarray(e).tolist() for e in self._eigs],
                "cursor": self._cursor, "events": self.events}

    def load_state_dict(self, sd: dict[str, Any], device: torch.device | None = None) -> None:
        if len(sd["basis"]) != len(self.layers) or len(sd["eigs"]) != len(self.layers):
            raise ValueError(f"state_dict: curvature state for {len(sd['basis'])} layers, expected "
                             f"{len(self.layers)}")
        self._basis = [None if b is None else b.to(device) for b in sd["basis"]]
        self._eigs = [None if e is None else np.asarray(e, dtype=np.float64) for e in sd["eigs"]]
        self._cursor, self.events = int(sd["cursor"]), int(sd["events"])

    def reset(self) -> None:
        """Forget the warm-start subspaces and last estimates (e.g. after loading a checkpoint)."""
        self._basis = [None] * len(self.layers)
        self._eigs = [None] * len(self.layers)
        self._cursor = 0
