"""PyTorch backend of triaccel: `wrap` a torch optimizer with the Tri-Accel control loop.

Exports: `wrap`, `TriAccelOptimizer`, `LossScaler` (optimizer.py); `discover_layers`, `TorchLayer`
(layers.py); `CurvatureEstimator` (curvature.py); `MemoryProbe`, `MemoryReading` (memory.py);
`PrecisionPlan`, `torch_dtype` (precision.py). Models and the elastic loader live in `.models` /
`.data` and are imported from there.
"""

from .curvature import CurvatureEstimator
from .layers import TorchLayer, discover_layers
from .memory import MemoryProbe, MemoryReading
from .optimizer import LossScaler, TriAccelOptimizer, wrap
from .precision import PrecisionPlan, torch_dtype

__all__ = [
    "CurvatureEstimator", "LossScaler", "MemoryProbe", "MemoryReading", "PrecisionPlan", "TorchLayer",
    "TriAccelOptimizer", "discover_layers", "torch_dtype", "wrap",
]
