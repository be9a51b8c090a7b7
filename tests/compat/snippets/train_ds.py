"""A DeepSpeed-style training script, as DeepSpeed's tutorials write them (the ZeRO-Offload
tutorial launches one with ``--deepspeed_config ds_zero_offload.config``), with ``import deepspeed``
changed to the line below. Run: ``python train_ds.py --deepspeed --deepspeed_config CONFIG
--steps N --out LOSSES.json``; the model starts from ``torch.manual_seed(0)``.
"""

import argparse
import json

import torch
from torch import nn

import infinity.compat.deepspeed as deepspeed


def add_argument():
    parser = argparse.ArgumentParser(description="tiny regression")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=str, required=True)
    # Include DeepSpeed configuration arguments
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main():
    args = add_argument()
    assert args.deepspeed
    deepspeed.init_distributed()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, generator=g), torch.randn(1, generator=g)) for _ in range(64)]
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=parameters,
        training_data=data,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01),
    )
    losses = []
    for step, (x, y) in enumerate(trainloader):
        if step == args.steps:
            break
        loss = nn.functional.mse_loss(model_engine(x), y)
        model_engine.backward(loss)
        model_engine.step()
        losses.append(loss.item())
    with open(args.out, "w") as f:
        json.dump(
            {
                "losses": losses,
                "train_batch_size": model_engine.train_batch_size(),
                "stage": model_engine.zero_optimization_stage(),
                "global_steps": model_engine.global_steps,
            },
            f,
        )


if __name__ == "__main__":
    main()
