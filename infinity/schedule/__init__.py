"""The prefetch scheduler: learns the order units are fetched in and reads ahead of it, within byte budgets.

Imports only infinity.store, infinity.memory, infinity.aio and infinity.timeline (and torch).
See docs/ARCHITECTURE.md, [Note: budgets] and [Note: pool room] in
scheduler.py, [Note: divergence] in cursor.py and [Note: prefetch and reuse
distance] in lookahead.py.
"""

from infinity.schedule.budget import ScheduleBudget
from infinity.schedule.cursor import StepKind, StepMode, TraceCursor
from infinity.schedule.errors import ScheduleConfigError, ScheduleError
from infinity.schedule.record import HoldState
from infinity.schedule.scheduler import PrefetchScheduler
from infinity.schedule.stats import SchedulerStats, StepStats
from infinity.schedule.trace import Trace

__all__ = [
    "HoldState",
    "PrefetchScheduler",
    "ScheduleBudget",
    "ScheduleConfigError",
    "ScheduleError",
    "SchedulerStats",
    "StepKind",
    "StepMode",
    "StepStats",
    "Trace",
    "TraceCursor",
]
