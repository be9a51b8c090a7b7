"""A Lightning Fabric training loop on infinity: ZeRO stage 3, parameters and optimizer state on NVMe.

Fabric's loop as DeepSpeed users write it: the model built under ``fabric.init_module()`` (that is
``infinity.zero.Init``), ``fabric.setup(model, optimizer, scheduler=...)``, ``fabric.backward(loss)``
and ``optimizer.step()`` on every micro-batch (the engine accumulates over the config's
``gradient_accumulation_steps`` and clips by its ``gradient_clipping``), ``fabric.save`` /
``fabric.load`` of the whole training state.

    python examples/fabric_loop.py                      # 3.3M-parameter GPT, 30 steps, saves ./fabric_loop
    python examples/fabric_loop.py --resume --steps 40  # loads ./fabric_loop, 10 more steps
    python examples/fabric_loop.py --quick              # a few seconds (what the tests run)

Self-contained (infinity.models.GPT and its built-in corpus). Prints one JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from lightning.fabric import Fabric

from infinity.integrations.fabric import InfinityFabricStrategy
from infinity.models import GPT, GPTConfig, TextCorpus

ACCUMULATE = 2


def config(nvme_path: str, largest_layer: int, micro_batch: int) -> dict:
    """A DeepSpeed config: what Fabric's DeepSpeed users pass as ``config=``."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": ACCUMULATE,
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {
                "device": "nvme",
                "nvme_path": nvme_path,
                "buffer_count": 4,
                "buffer_size": largest_layer,
                "max_in_cpu": 0,
            },
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path},
            "sub_group_size": largest_layer,
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--nvme-path",
        default="./infinity_nvme",
        help="swap folder (default ./infinity_nvme, created)",
    )
    p.add_argument("--out", default="fabric_loop", help="checkpoint folder (default ./fabric_loop)")
    p.add_argument("--steps", type=int, help="optimizer steps in all (default 30; 6 with --quick)")
    p.add_argument("--devices", type=int, default=1, help="processes (CPU: gloo; default 1)")
    p.add_argument("--resume", action="store_true", help="load <out> first and continue")
    p.add_argument("--quick", action="store_true", help="a tiny model, 6 steps")
    args = p.parse_args(argv)

    if args.quick:
        gpt, steps, micro_batch = (
            GPTConfig(seq_len=32, n_layer=2, n_head=2, d_model=64),
            args.steps or 6,
            2,
        )
    else:
        gpt, steps, micro_batch = (
            GPTConfig(seq_len=64, n_layer=4, n_head=4, d_model=256),
            args.steps or 30,
            4,
        )
    largest_layer = 4 * gpt.d_model * gpt.d_model + 4 * gpt.d_model
    os.makedirs(args.nvme_path, exist_ok=True)

    strategy = InfinityFabricStrategy(config=config(args.nvme_path, largest_layer, micro_batch))
    fabric = Fabric(
        accelerator="cpu" if not torch.cuda.is_available() else "auto",
        devices=args.devices,
        strategy=strategy,
    )
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module():  # partitioned as it is built
        model = GPT(gpt)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps, eta_min=1e-4)
    model, optimizer, scheduler = fabric.setup(
        model, optimizer, scheduler=scheduler
    )  # the engine steps it

    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.resume:
        fabric.load(args.out, state)
    corpus = TextCorpus()
    losses = []
    while state["step"] < steps:
        for micro in range(ACCUMULATE):
            x, y = corpus.batch(
                state["step"] * ACCUMULATE + micro,
                micro_batch,
                gpt.seq_len,
                rank=fabric.global_rank,
                world_size=fabric.world_size,
            )
            loss = model(x, y)
            fabric.backward(loss)
            optimizer.step()  # the engine's step: it updates once the window's last micro-batch is in
            losses.append(loss.item())
        state["step"] += 1
    fabric.save(args.out, state)
    if fabric.global_rank == 0:
        io = model._forward_module.engine.io_stats()
        print(
            json.dumps(
                {
                    "params": gpt.num_params,
                    "steps": state["step"],
                    "world_size": fabric.world_size,
                    "first_loss": losses[0] if losses else None,
                    "last_loss": losses[-1] if losses else None,
                    "lr": optimizer.param_groups[0]["lr"],
                    "nvme_read_nbytes": io["read_nbytes"],
                    "nvme_write_nbytes": io["write_nbytes"],
                    "checkpoint": args.out,
                }
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
