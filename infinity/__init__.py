"""infinity: train PyTorch models whose state is larger than GPU and host memory.

Parameters, gradients and optimizer state live on NVMe and are streamed through
pinned host buffers to the compute device just in time (ZeRO-Infinity).
"""

__version__ = "0.1.0"

from infinity import models, zero
from infinity.engine import Engine, initialize

__all__ = ["Engine", "__version__", "initialize", "models", "zero"]
