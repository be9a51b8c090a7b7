"""The training engine: initialize(), Engine, loss scaling."""

from infinity.engine.engine import Engine
from infinity.engine.initialize import initialize

__all__ = ["Engine", "initialize"]
