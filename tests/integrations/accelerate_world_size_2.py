"""One rank of a two-process Accelerate run, started by torchrun (``torchrun --nproc_per_node 2
accelerate_world_size_2.py MODE OUT NVME``; Accelerator(cpu=True) joins gloo). Writes
OUT/MODE.rank<r>.json: the rank's per-micro-batch losses.

MODE: infinity (prepare(), stage 3, parameters and optimizer state on NVMe), plain (Accelerate's DDP,
torch AdamW).
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from tests.integrations.accelerate_runs import auto_config, infinity_run, plain_run
from tests.integrations.subprocesses import leave_process_group

WORLD_SIZE = 2


def main(mode: str, out: str, nvme: str) -> None:
    if mode == "infinity":
        losses = infinity_run(auto_config(nvme), world_size=WORLD_SIZE)[0]
    else:
        losses = plain_run(world_size=WORLD_SIZE)[0]
    assert dist.is_initialized() and dist.get_world_size() == WORLD_SIZE
    Path(out, f"{mode}.rank{dist.get_rank()}.json").write_text(json.dumps({"losses": losses}))
    leave_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
