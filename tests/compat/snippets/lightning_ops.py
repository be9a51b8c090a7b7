"""The Lightning DeepSpeed guide's DeepSpeed calls, with ``import deepspeed`` changed to the line
below: ``DeepSpeedCPUAdam(self.parameters())`` / ``FusedAdam(self.parameters())`` as the
optimizer, and ``deepspeed.checkpointing.checkpoint(self.block, x)`` in forward over
``self.block = nn.Sequential(nn.Linear(32, 32), nn.ReLU())``, trained at ZeRO-3 with offload.
"""

import torch
from torch import nn

import infinity.compat.deepspeed as deepspeed
from infinity.compat.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam


class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 32)  # the guide's "...": the block's input must require grad
        self.block = nn.Sequential(nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 1)

    def forward(self, batch):
        x, y = batch
        x = self.inp(x)
        # Use the DeepSpeed checkpointing function instead of calling the module directly
        output = deepspeed.checkpointing.checkpoint(self.block, x)
        return nn.functional.mse_loss(self.head(output), y)

    def configure_optimizers(self, fused=False):
        # DeepSpeedCPUAdam provides 5x to 7x speedup over torch.optim.adam(w)
        return FusedAdam(self.parameters()) if fused else DeepSpeedCPUAdam(self.parameters())


def train(model, ds_config, batches, fused=False):
    model_engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=model.configure_optimizers(fused), config=ds_config
    )
    losses = []
    for batch in batches:
        loss = model_engine(batch)
        model_engine.backward(loss)
        model_engine.step()
        losses.append(loss.item())
    model_engine.destroy()
    return losses


def batches(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 32, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]
