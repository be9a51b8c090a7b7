"""UnitRecord's state machine: moves are asserted like the store's (infinity.store.TrackedRecord)."""

import pytest

from infinity.schedule import ScheduleError, UnitState
from infinity.schedule.record import UnitRecord


def test_illegal_scheduler_transitions_name_the_key_and_both_states():
    rec = UnitRecord(("blk", 3), 4096)
    with pytest.raises(
        ScheduleError, match=r"key \('blk', 3\): illegal scheduler transition idle → kept"
    ):
        rec.to_kept()
    rec.to_prefetched()
    with pytest.raises(ScheduleError, match="illegal scheduler transition prefetched → prefetched"):
        rec.to_prefetched()
    rec.to_in_use()
    rec.to_in_use()  # a second caller: still in use
    assert rec.state is UnitState.IN_USE and rec.users == 2
    rec.to_idle()
    with pytest.raises(ScheduleError, match="illegal scheduler transition idle → idle"):
        rec.to_idle()
    for state in UnitState:
        assert state.__doc__  # every state says what it means
