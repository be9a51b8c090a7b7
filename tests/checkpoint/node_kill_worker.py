"""A torchrun worker for tests/checkpoint/test_node_kills.py: train, saving node-local every step.

``python node_kill_worker.py STEPS KILL_STEP KILL_RANK DELAY``: resumes from the newest checkpoint
complete over the nodes (if any), then trains to STEPS optimizer steps, saving after each. In the
job's first run, rank KILL_RANK sends itself SIGKILL DELAY seconds into the save after step
KILL_STEP (from a timer started as the save starts; a save that is over by then is killed as it
returns), so the kill lands at a chosen point of a save, which a line printed by the rank and read
by the harness could not time; torchrun (--max-restarts) then restarts every node's workers.
KILL_STEP 0: no kill. Each step's loss and where each run resumed are reported.
"""

import os
import signal
import sys
import threading

import torch.distributed as dist

from infinity.engine.checkpoint import CheckpointNotFoundError
from tests.checkpoint.helpers import config, make_engine, train
from tests.multinode.harness import node_paths, report


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main(steps: int, kill_step: int, kill_rank: int, delay: float) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    first_run = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
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
            pass  # the first run: nothing saved on any node yet
        report(resumed=engine.global_steps)
        for step in range(engine.global_steps, steps):
            (loss,) = train(engine, step, 1, rank=rank, gas=1)
            report(step=step, loss=loss)
            dying = first_run and rank == kill_rank and step + 1 == kill_step
            timer = threading.Timer(delay, _die) if dying else None
            if timer is not None:
                timer.start()
            engine.save_checkpoint(ckpt)
            if timer is not None:
                _die()
        report(done=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
