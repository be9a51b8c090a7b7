"""One rank of a two-process run, launched as Lightning launches it (``python world_size_2.py
MODES OUT NVME``: this process is rank 0 and Lightning starts rank 1 by running the same command).
MODES is a comma-separated list run one after the other in the same two processes; the first one's
strategy launches rank 1, the later ones find the ranks in place (as under torchrun) and join the
same gloo group. For each mode, writes OUT/MODE.rank<r>.json: the rank's per-micro-batch losses
and evaluation losses.

MODE: lightning-infinity (InfinityStrategy, stage 3, NVMe), lightning-ddp (plain Lightning DDP),
fabric-infinity (InfinityFabricStrategy, stage 3, NVMe), fabric-ddp (plain Fabric DDP); all on gloo.
Each run builds its model from the same seed and reads the same unshuffled batches, so a mode's
result does not depend on what ran before it in the process.
"""

import json
import sys
from pathlib import Path

from torch.utils.data import DataLoader

from infinity.integrations.fabric import InfinityFabricStrategy
from tests.integrations.lightning_runs import (
    GPTModule,
    dataset,
    engine_config,
    fabric_run,
    infinity_strategy,
    loader,
    trainer,
)
from tests.integrations.subprocesses import leave_process_group

WORLD_SIZE = 2
EPOCHS = 2


class RankedGPTModule(GPTModule):
    """The tiny GPT with its loaders made per rank once the Trainer knows the rank."""

    def train_dataloader(self) -> DataLoader:
        return loader(
            dataset(EPOCHS, world_size=WORLD_SIZE), rank=self.global_rank, world_size=WORLD_SIZE
        )

    def val_dataloader(self) -> DataLoader:
        return loader(dataset(1)[:2], rank=self.global_rank, world_size=WORLD_SIZE)


def main(mode: str, out: str, nvme: str) -> None:
    if mode.startswith("lightning"):
        strategy = infinity_strategy(nvme) if mode == "lightning-infinity" else "ddp"
        module = RankedGPTModule()
        t = trainer(strategy, epochs=EPOCHS, devices=WORLD_SIZE)
        t.fit(module)
        rank, losses, val_losses = t.global_rank, module.losses, module.val_losses
    else:
        import torch.distributed as dist

        strategy = (
            InfinityFabricStrategy(config=engine_config(nvme))
            if mode == "fabric-infinity"
            else "ddp"
        )
        losses, val_losses, _, _ = fabric_run(strategy, epochs=EPOCHS, devices=WORLD_SIZE)
        rank = dist.get_rank()
    Path(out, f"{mode}.rank{rank}.json").write_text(
        json.dumps({"losses": losses, "val_losses": val_losses})
    )


if __name__ == "__main__":
    modes, out, nvme = sys.argv[1:4]
    for mode in modes.split(","):
        main(mode, out, nvme)
    leave_process_group()
