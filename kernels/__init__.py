"""triaccel.kernels: one set of Triton kernels (gradient moments, per-segment cast) for torch and JAX.

Dispatch: torch on CUDA -> Triton; torch on CPU -> Triton interpreter when ``TRITON_INTERPRET=1``,
else the torch reference; JAX on GPU -> the same kernels through ``jax_triton`` (imported lazily);
JAX on CPU -> the ``jnp`` reference; JAX with ``impl="xla"`` -> one XLA reduction per array (no
concatenation, no kernel). Neither torch nor jax is imported by this package itself.
"""

from .cast import FixedCast, cast_flat, cast_reference_jnp, cast_reference_torch, cast_to
from .grad_moments import (
    FixedMoments,
    Moments,
    grad_moments,
    grad_moments_flat,
    moments_reference_jnp,
    moments_reference_jnp_tree,
    moments_reference_torch,
    stacked_dot,
    stacked_zeros,
    unstacked,
)

__all__ = [
    "Moments",
    "FixedMoments",
    "grad_moments",
    "grad_moments_flat",
    "moments_reference_torch",
    "moments_reference_jnp",
    "moments_reference_jnp_tree",
    "stacked_dot",
    "stacked_zeros",
    "unstacked",
    "cast_to",
    "FixedCast",
    "cast_flat",
    "cast_reference_torch",
    "cast_reference_jnp",
]
