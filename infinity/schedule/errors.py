"""Exceptions raised by the prefetch scheduler; each names the key or setting at fault and what to do."""

from __future__ import annotations


class ScheduleError(RuntimeError):
    """A call the scheduler's state does not allow (releasing a key that was not acquired, a closed scheduler)."""


class ScheduleConfigError(ValueError):
    """Budgets that are invalid, or that the engine-facing constructor refuses (they could deadlock or be exceeded)."""
