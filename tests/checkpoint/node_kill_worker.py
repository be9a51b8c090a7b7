"""A torchrun worker for tests/checkpoint/test_node_kills.py: train, saving node-local every step.

``python node_kill_worker.py STEPS``: resumes from the newest checkpoint complete over the nodes (if
any), then trains to STEPS optimizer steps, printing ``saving <k>`` just before the save after step
k (the kill trials' marker) and reporting each step's loss and where it resumed.
"""

import sys

import torch.distributed as dist

from infinity.engine.checkpoint import CheckpointNotFoundError
from tests.checkpoint.helpers import config, make_engine, train
from tests.multinode.harness import node_paths, report


def main(steps: int) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    nvme, ckpt = node_paths()
    swap = nvme / f"rank{rank}"
    swap.mkdir(exist_ok=True)
    cfg = config(3, "nvme", "nvme", swap, gas=1)
    cfg["checkpoint"] = {"use_node_local_storage": True}
    engine, _ = make_engine("gpt", cfg, seed=0)
    with engine:
        try:
            engine.load_checkpoint(ckpt)
        except CheckpointNotFoundError:
            pass  # the first launch: nothing saved on any node yet
        report(resumed=engine.global_steps)
        for step in range(engine.global_steps, steps):
            (loss,) = train(engine, step, 1, rank=rank, gas=1)
            report(step=step, loss=loss)
            print(f"saving {step + 1}", flush=True)
            engine.save_checkpoint(ckpt)
        report(done=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]))
