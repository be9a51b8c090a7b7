"""The training engine: initialize(), Engine, loss scaling, each step's record."""

from infinity.engine.engine import Engine
from infinity.engine.initialize import initialize
from infinity.engine.step_record import StepRecord

__all__ = ["Engine", "StepRecord", "initialize"]
