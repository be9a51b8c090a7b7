"""A torchrun worker for tests/multinode/test_training.py: ZeRO-3 training with parameters and
optimizer state on this node's NVMe (the harness's first node path), one report per model.

Each model is trained ``STEPS`` steps of ``GAS`` micro-batches on rank-specific batches
(tests.engine.models.batch(step, micro, rank), as tests/engine/reference.py's single-process oracle
takes them); the report holds the losses, the final weights (rank 0), the regular files this
process had open after the first step, the swap folders this node's nvme_path holds, and the
host-memory budget this rank planned within.
"""

import os
import sys

import torch
import torch.distributed as dist

from tests.engine.models import batch
from tests.engine.reference import engine_config, eval_loss
from tests.multinode.harness import node_paths, open_files, report
from tests.multinode.models import MODELS

STEPS, GAS = 3, 2


def train(name: str) -> None:
    import infinity
    from infinity.estimate.budget import resolve_budget
    from infinity.estimate.context import run_context
    from infinity.estimate.machine import machine_view
    from infinity.zero.gathered import GatheredParameters

    nvme = node_paths()[0]
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MODELS[name]()
    config = engine_config(3, "nvme", "nvme", nvme, gas=GAS)
    cfg = infinity.config.load_config(config)
    ctx = run_context(model, cfg, device="cpu", world_size=dist.get_world_size())
    budget, budget_source = resolve_budget(cfg, machine_view(), ctx.ranks_per_node)
    engine = infinity.initialize(model, config)
    losses, files = {}, None
    try:
        for step in range(STEPS):
            for micro in range(GAS):
                x, y = batch(step, micro, rank)
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                losses[f"{step},{micro},{rank}"] = loss.item()
            if files is None:
                files = open_files()  # the swap files are open now, mid-run
            engine.eval()
            losses[f"{step},eval"] = eval_loss(engine, name, step)
            engine.train()
        with GatheredParameters(engine):
            weights = {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}
    finally:
        engine.close()
    report(
        model=name,
        losses=losses,
        weights=weights if rank == 0 else None,
        open_files=files,
        swap_dirs=sorted(os.listdir(nvme)),
        ranks_per_node=ctx.ranks_per_node,
        budget=budget,
        budget_source=budget_source,
    )


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        for name in sys.argv[1:]:
            train(name)
    finally:
        dist.destroy_process_group()
