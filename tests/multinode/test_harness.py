"""The multi-node harness itself: private storage per node, the rank to node mapping, a killed node
reported, a killed node rebooted and the job restarted by torchrun's --max-restarts."""

from pathlib import Path

import pytest

from tests.multinode.harness import Kill, run_nodes, skip_unless_namespaces

WORKER = Path(__file__).with_name("harness_worker.py")


@pytest.fixture(autouse=True)
def _namespaces():
    skip_unless_namespaces()


def test_each_node_sees_only_its_own_storage_and_ranks_map_to_nodes(nvme_dir):
    run = run_nodes(WORKER, 2, 2, workdir=nvme_dir, args=["probe"], timeout=240).check()
    final = run.final()
    assert sorted(final) == [0, 1, 2, 3]
    node_of = {r: rep["node"] for r, rep in final.items()}
    for r, rep in final.items():
        assert (rep["world_size"], rep["local_world_size"]) == (4, 2)
        # torchrun's numbering: a node's ranks are consecutive, local rank within it.
        assert r == rep["group_rank"] * 2 + rep["local_rank"]
        # The process group spans the nodes: every rank's node as each node says it.
        assert rep["nodes_by_rank"] == [node_of[q] for q in range(4)]
        # A file at the shared path is visible on its own node only.
        mates = sorted(q for q in range(4) if node_of[q] == rep["node"])
        assert rep["listing"] == [f"rank{q}" for q in mates]
        for q, text in rep["readable"].items():
            assert text == (str(rep["node"]) if int(q) in mates else None), (r, q)
        # Every node's backing folder is hidden inside each node.
        assert rep["hidden_listing"] == []
    assert sorted(node_of.values()) == [0, 0, 1, 1]
    for k in range(2):
        on_k = sorted(q for q in range(4) if node_of[q] == k)
        held = sorted(p.name for p in run.node_dir(k, run.node_paths[0]).iterdir())
        assert held == [f"rank{q}" for q in on_k]


def test_a_killed_node_is_reported(nvme_dir):
    run = run_nodes(
        WORKER,
        2,
        1,
        workdir=nvme_dir,
        args=["steps", "40"],
        kill=Kill(node=1, marker="step 2"),
        timeout=240,
    )
    assert not run.ok
    assert run.nodes[1].kills == 1 and run.nodes[1].returncodes == [-9]
    assert run.nodes[0].returncodes[-1] not in (0, None)  # its peer died: the step fails
    assert not any(r.get("total") for r in run.reports)  # nobody finished
    with pytest.raises(AssertionError, match=r"node 1: exit statuses by launch \[-9\]"):
        run.check()


def test_a_rebooted_node_rejoins_and_torchrun_restarts_the_job(nvme_dir):
    run = run_nodes(
        WORKER,
        2,
        1,
        workdir=nvme_dir,
        args=["steps", "5"],
        max_restarts=2,
        kill=Kill(node=1, marker="step 2", reboot=True),
        timeout=240,
    ).check()
    assert run.nodes[1].kills == 1 and run.nodes[1].returncodes == [-9, 0]
    assert run.nodes[0].launches == 1  # the survivor's agent lived on and restarted its worker
    final = run.final()
    assert [rep["total"] for rep in final.values()] == [10.0, 10.0]  # 5 steps of 2 ranks
    assert run.restarts()[0] >= 1  # the survivor's workers were restarted by torchrun
    assert next(rep for rep in final.values() if rep["node"] == 1)["launch"] == 1
