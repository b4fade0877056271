"""Curvature lever: per-layer LR multipliers and precision promotions from top-k eigenvalues,
plus the small-matrix maths both backends share (Gram top-k, Rayleigh-Ritz).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["CurvatureLaw", "fisher_topk_from_gram", "lr_scales_from_eigs", "ritz"]


def lr_scales_from_eigs(lam_max: np.ndarray, alpha: float) -> np.ndarray:
    """eta_l/eta_0 = 1 / (1 + alpha * max(lambda_max_l, 0)); shape (L,), values in (0, 1].

    Negative curvature (possible for Hessian blocks) does not raise the LR above the user's. The
    product alpha*lambda is capped below float overflow, so a scale is never 0 (nor NaN from inf*0).
    """
    lam = np.maximum(np.asarray(lam_max, dtype=np.float64), 0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        prod = np.nan_to_num(alpha * lam, nan=0.0, posinf=_PROD_CAP)
    return 1.0 / (1.0 + np.minimum(prod, _PROD_CAP))


_PROD_CAP = np.finfo(np.float64).max / 4   # 1/(1 + cap) > 0 in float64


def fisher_topk_from_gram(gram: np.ndarray, k: int) -> np.ndarray:
    """Top-k eigenvalues (descending, shape (k,)) of the empirical Fisher F = (1/b) sum_i g_i g_i^T.

    `gram` is the (b, b) Gram matrix G_ij = <g_i, g_j> of b per-sample gradients of one layer; F and
    G/b share their non-zero eigenvalues, so this costs an eigh of a b x b matrix instead of an
    n x n one. Missing eigenvalues (k > b) are 0, the Fisher's rank being at most b. A Gram matrix
    with NaN/Inf (per-sample gradients that overflowed) gives NaN eigenvalues, which the backends
    do not observe.
    """
    g = np.asarray(gram, dtype=np.float64)
    if g.ndim != 2 or g.shape[0] != g.shape[1] or g.shape[0] == 0:
        raise ValueError(f"gram: expected a non-empty square (b, b) matrix, got shape {g.shape}")
    if k < 1:
        raise ValueError(f"k={k}: must be >= 1")
    b = g.shape[0]
    if not np.isfinite(g).all():
        return np.full(k, np.nan)
    vals = np.linalg.eigvalsh(0.5 * (g + g.T) / b)[::-1]
    out = np.zeros(k)
    n = min(k, b)
    out[:n] = np.maximum(vals[:n], 0.0)  # a Gram matrix is PSD; negatives are round-off
    return out


def ritz(projected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rayleigh-Ritz step of subspace iteration.

    `projected` = V^T H V (k, k) for an orthonormal basis V (n, k). Returns (eigenvalues (k,) in
    descending order, rotation (k, k)) such that V @ rotation are the Ritz vectors in that order.
    """
    t = np.asarray(projected, dtype=np.float64)
    if t.ndim != 2 or t.shape[0] != t.shape[1]:
        raise ValueError(f"projected: expected a square (k, k) matrix, got shape {t.shape}")
    vals, vecs = np.linalg.eigh(0.5 * (t + t.T))
    order = np.argsort(vals)[::-1]
    return vals[order], vecs[:, order]


class CurvatureLaw:
    """Holds the last top-k eigenvalues per layer and turns them into LR scales and promotions.

    alpha / tau_curv left as None are calibrated at the first observation: alpha so that the
    layer with the largest positive lambda_max gets LR scale 1/2, tau_curv as the 90th percentile
    of lambda_max over layers.
    """

    def __init__(self, num_layers: int, top_k: int, *, alpha: float | None, tau_curv: float | None) -> None:
        self.num_layers = num_layers
        self.top_k = top_k
        self.alpha = alpha
        self.tau_curv = tau_curv
        self.eigvals = np.full((num_layers, top_k), np.nan)
        self.scales = np.ones(num_layers)

    def observe(self, eigvals: np.ndarray) -> np.ndarray:
        """Store (L, k) eigenvalues; return the bool (L,) mask of layers to promote."""
        lam = np.asarray(eigvals, dtype=np.float64)
        if lam.shape != (self.num_layers, self.top_k):
            raise ValueError(f"eigvals: expected shape ({self.num_layers}, {self.top_k}) = (layers, top_k), "
                             f"got {lam.shape}")
        if not np.isfinite(lam).all():
            raise ValueError("eigvals: must be finite (drop a curvature pass that produced NaN/Inf)")
        self.eigvals = lam
        lam_max = lam.max(axis=1)
        if self.alpha is None and lam_max.max() > 0:
            with np.errstate(over="ignore", divide="ignore"):
                inv = float(1.0 / lam_max.max())
            if np.isfinite(inv):  # a subnormal lambda_max gives no usable calibration: wait for the next
                self.alpha = inv
        if self.tau_curv is None:
            self.tau_curv = float(np.quantile(lam_max, 0.9))
        if self.alpha is not None:
            self.scales = lr_scales_from_eigs(lam_max, self.alpha)
        return lam_max > self.tau_curv

    @property
    def lam_max(self) -> np.ndarray:
        """(L,) largest observed eigenvalue per layer (NaN before the first observation)."""
        return self.eigvals.max(axis=1)

    def state_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "tau_curv": self.tau_curv,
                "eigvals": [[None if np.isnan(x) else float(x) for x in row] for row in self.eigvals],
                "scales": self.scales.tolist()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.alpha, self.tau_curv = sd["alpha"], sd["tau_curv"]
        self.eigvals = np.array([[np.nan if x is None else x for x in row] for row in sd["eigvals"]],
                                dtype=np.float64).reshape(self.num_layers, self.top_k)
        self.scales = np.array(sd["scales"], dtype=np.float64)
