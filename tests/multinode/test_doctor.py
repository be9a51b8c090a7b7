"""``infinity doctor`` under torchrun: one report per node, gathered to rank 0, each with the path
as that node sees it, its ranks and the host-memory budget each of them gets by default."""

import json
import re

import pytest

from infinity.cli.doctor import format_node
from tests.multinode.harness import run_nodes, skip_unless_namespaces

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _namespaces():
    skip_unless_namespaces()


def test_doctor_reports_each_node(nvme_dir):
    # Only node 1 has a folder "drive" under its nvme_path: each node checks its own storage.
    (nvme_dir / "nodes" / "node1" / "0" / "drive").mkdir(parents=True)
    path = nvme_dir / "node" / "nvme" / "drive"
    run = run_nodes(
        "infinity.cli.main",
        2,
        2,
        workdir=nvme_dir,
        module=True,
        args=["doctor", "--json", "--path", str(path)],
        timeout=240,
    ).check()
    # Rank 0 prints, on whichever harness node the rendezvous made node 0; the others print nothing.
    printed = [m for k in range(2) if (m := re.search(r"^\[$.*^\]$", run.text(k), re.M | re.S))]
    assert len(printed) == 1
    nodes = json.loads(printed[0].group(0))
    assert [n["node"] for n in nodes] == [0, 1]
    assert [n["ranks"] for n in nodes] == [[0, 1], [2, 3]]
    assert all(n["ranks_per_node"] == 2 for n in nodes)
    assert all("per rank (2 on this node)" in n["budget_per_rank"] for n in nodes)
    # The same path, two answers: node 1's storage has the folder, node 0's has not.
    usable = sorted(n["report"]["path"]["usable"] for n in nodes)
    assert usable == [False, True]
    seen = {n["report"]["path"]["usable"]: n for n in nodes}
    assert "does not exist" in seen[False]["report"]["path"]["refused"]
    text = format_node(seen[True])
    k = seen[True]["node"]
    assert text.startswith(f"== node {k} (") and "; 2 rank(s) share its memory" in text
    assert f"ranks {2 * k}, {2 * k + 1};" in text and f"ok  path: {path}" in text
