"""UnitRecord's state machine: moves are asserted like the store's (infinity.store.TrackedRecord)."""

import pytest

from infinity.schedule import HoldState, ScheduleError
from infinity.schedule.record import UnitRecord


@pytest.mark.parametrize(
    "before, move, refused",
    [
        ((), "to_kept", "idle → kept"),
        (("to_prefetched",), "to_prefetched", "prefetched → prefetched"),
        (("to_in_use", "to_idle"), "to_idle", "idle → idle"),
    ],
)
def test_illegal_scheduler_transitions_name_the_key_and_both_states(before, move, refused):
    rec = UnitRecord(("blk", 3), 4096)
    for legal in before:
        getattr(rec, legal)()
    state = rec.state
    with pytest.raises(
        ScheduleError, match=rf"key \('blk', 3\): illegal scheduler transition {refused}"
    ):
        getattr(rec, move)()
    assert rec.state is state  # a refused move changes nothing


def test_every_unit_state_says_what_it_means():
    docs = [state.__doc__ for state in HoldState]
    # an Enum member without its own doc would show the class's
    assert HoldState.__doc__ not in docs and len(set(docs)) == len(docs)
