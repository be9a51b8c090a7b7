"""The tiny model the DeepSpeed snippets train, its data, and plain PyTorch's run of the same
training: the oracle (fp32; the same data order as DeepSpeed's sampler gives one rank)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler


class Regressor(nn.Module):
    """Returns the loss of a batch ``(x, y)``, as the getting-started model does."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 1))

    def forward(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)


def dataset(n: int = 48, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = torch.randn(n, 1, generator=g)
    return list(zip(x, y, strict=True))


def reference_losses(
    model: nn.Module,
    data,
    *,
    micro: int,
    accumulation: int,
    lr: float,
    weight_decay: float = 0.0,
    clip: float = 0.0,
    adamw: bool = True,
    epochs: int = 1,
) -> list[float]:
    """Plain PyTorch: each micro-batch's loss, the gradient accumulated over ``accumulation``
    micro-batches (each loss divided by it), clipped to ``clip`` (0: not), then torch's Adam(W)."""
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls(model.parameters(), lr=lr, weight_decay=weight_decay)
    sampler = DistributedSampler(data, num_replicas=1, rank=0)
    losses = []
    i = 0
    for _ in range(epochs):
        for batch in DataLoader(data, batch_size=micro, sampler=sampler):
            loss = model(batch)
            (loss / accumulation).backward()
            losses.append(loss.item())
            i += 1
            if i % accumulation == 0:
                if clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                opt.zero_grad()
    return losses
