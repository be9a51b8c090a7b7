"""How many ranks share a machine: read once (LOCAL_WORLD_SIZE, as torchrun sets it), refused when
it is not a number of ranks, and the divisor of the machine's memory in the planner's budget."""

import pytest

from infinity.estimate import MachineView, ranks_on_this_node
from infinity.estimate.budget import default_budget

GiB = 1 << 30


def _machine(available: int) -> MachineView:
    return MachineView(
        mem_total_nbytes=2 * available,
        mem_available_nbytes=available,
        hugetlb_free_nbytes=0,
        cpu_count=2,
        gpus=(),
        disks=(),
        self_rss_nbytes=0,
    )


def test_ranks_on_this_node_is_torchruns_local_world_size(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert ranks_on_this_node() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ranks_on_this_node() == 4


@pytest.mark.parametrize("bad", ["x", "0", "-2", ""])
def test_a_bad_local_world_size_is_refused_by_name(monkeypatch, bad):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE=.* is not a number of ranks"):
        ranks_on_this_node()


@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
def test_the_default_budget_shares_the_machine_among_its_ranks(ranks):
    available = 64 * GiB
    budget, how = default_budget(_machine(available), ranks)
    share = available // ranks
    # The share of each rank, less the margin (10 %, at least 512 MiB): the ranks never
    # plan more than the machine has.
    assert budget == share - max(share // 10, 512 << 20)
    assert budget * ranks <= available
    assert (f"per rank ({ranks} on this node)" in how) == (ranks > 1)
