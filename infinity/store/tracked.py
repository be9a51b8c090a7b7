"""Tracked records: one record per tracked object, a state Enum whose members say what they mean, asserted moves.

The house pattern (after FSDP2's ``ShardedState``) that the store's
KeyRecord ([Note: residency] in record.py) and the scheduler's UnitRecord
([Note: hold states] in infinity/schedule/record.py) both follow:
- the states are a StateEnum whose members are declared ``NAME = (value, doc)``,
  so every state carries its own ``__doc__``;
- a record's ``to_*`` methods change its state through ``TrackedRecord._move``,
  which checks the state being left against the states that transition may
  leave from, and raises the record's own error type, naming the key and both
  states, otherwise.

It lives in the store, the lower of the two layers, so the scheduler can use it
without importing upward.

Threading: none here; each record is touched only under its owner's lock.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from typing import ClassVar


class StateEnum(enum.Enum):
    """An Enum whose members are ``NAME = (value, doc)``: ``value`` is the name shown in messages,
    ``doc`` becomes the member's ``__doc__``."""

    def __new__(cls, value: str, doc: str) -> StateEnum:
        obj = object.__new__(cls)
        obj._value_ = value
        obj.__doc__ = doc
        return obj


class TrackedRecord:
    """The record of one tracked object: its ``key`` and its ``state``, changed only by ``_move``.

    Subclasses set ``transition_error`` (the exception an illegal move raises)
    and may set ``transition_name`` (how messages call a move, to tell whose
    state machine refused it).
    """

    __slots__ = ("key", "state")

    transition_error: ClassVar[type[Exception]]
    transition_name: ClassVar[str] = "transition"

    def __init__(self, key: Hashable, state: StateEnum):
        self.key = key
        self.state = state

    def _move(self, to: StateEnum, allowed: tuple[StateEnum, ...]) -> None:
        if self.state not in allowed:
            raise self.transition_error(
                f"key {self.key!r}: illegal {self.transition_name} {self.state.value} → {to.value} "
                f"(allowed only from {', '.join(s.value for s in allowed)})"
            )
        self.state = to
