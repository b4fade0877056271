"""triaccel: one control loop over per-layer precision, sparse curvature and elastic batching.

This package is the framework-free core (Python + NumPy). Framework adapters live in
`triaccel.backends.torch` and `triaccel.backends.jax`; Triton kernels in `triaccel.kernels`.
"""

from .batching import OOMAtMinimumBatch, resolve_memory_limit
from .config import TriAccelConfig, parse_bytes
from .controller import Controller, Decision
from .layers import LayerSpec, order_layers
from .precision import Precision

__all__ = [
    "Controller", "Decision", "LayerSpec", "OOMAtMinimumBatch", "Precision", "TriAccelConfig",
    "order_layers", "parse_bytes", "resolve_memory_limit",
]
__version__ = "0.1.0"
