"""A torchrun worker for tests/multinode/test_harness.py: what the harness itself promises.

``probe``: writes a file named after its rank at the first node path, all-reduces over gloo
across the nodes, tries to read every other rank's file at the same path, and reports.
``steps N``: N all-reduce steps, printing ``step <i>`` before each (the kill tests' marker);
a restarted worker runs them again from the start.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

from tests.multinode.harness import node_index, node_paths, open_files, report


def probe() -> None:
    rank = dist.get_rank()
    here = node_paths()[0]
    (here / f"rank{rank}").write_text(str(node_index()))
    dist.barrier()
    readable = {}
    for r in range(dist.get_world_size()):
        try:
            readable[r] = (here / f"rank{r}").read_text()
        except FileNotFoundError:
            readable[r] = None
    node = torch.tensor([float(node_index())])
    nodes = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(nodes, node)
    hidden = os.path.dirname(os.environ["INFINITY_TEST_RESULTS"]) + "/nodes"
    report(
        readable=readable,
        nodes_by_rank=[int(t.item()) for t in nodes],
        hidden_listing=os.listdir(hidden),
        listing=sorted(os.listdir(here)),
        open_files=open_files(),
    )


def steps(n: int) -> None:
    total = torch.zeros(1)
    for i in range(n):
        print(f"step {i} rank {dist.get_rank()}", flush=True)
        t = torch.ones(1)
        dist.all_reduce(t)
        total += t
        time.sleep(0.3)
    report(total=total.item())


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        if sys.argv[1] == "probe":
            probe()
        else:
            steps(int(sys.argv[2]))
    finally:
        dist.destroy_process_group()
