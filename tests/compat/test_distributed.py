"""Two ranks (gloo): initialize's training dataloader gives each rank its DistributedSampler share,
and ZeRO-3 training over the pair gives plain PyTorch's losses for the global batch (the mean of
both ranks' micro-batch gradients); a checkpoint saved by both loads on both."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from tests.compat import models
from tests.distributed import run_distributed

pytestmark = pytest.mark.distributed

CONFIG = {
    "train_micro_batch_size_per_gpu": 3,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "cpu"},
        "offload_optimizer": {"device": "cpu"},
        "stage3_param_persistence_threshold": 0,
    },
}


def _train(rank: int, ckpt: str) -> dict:
    import infinity.compat.deepspeed as deepspeed

    torch.manual_seed(0)
    model = models.Regressor()
    engine, _, loader, _ = deepspeed.initialize(
        model=model, training_data=models.dataset(24), config=CONFIG
    )
    losses = []
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.save_checkpoint(ckpt, client_state={"rank_saw": len(losses)})
    engine.destroy()
    torch.manual_seed(0)
    fresh, *_ = deepspeed.initialize(model=models.Regressor(), config=CONFIG)
    path, client = fresh.load_checkpoint(ckpt)
    steps = fresh.global_steps
    fresh.destroy()
    return {
        "world": engine.world_size,
        "losses": losses,
        "client": client,
        "path": path,
        "steps": steps,
    }


def test_two_ranks_train_their_shares_and_match_the_global_batch(tmp_path):
    results = run_distributed(_train, str(tmp_path / "ckpt"), world_size=2)
    torch.manual_seed(0)
    ref = models.Regressor()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    data = models.dataset(24)
    loaders = [
        DataLoader(data, batch_size=3, sampler=DistributedSampler(data, 2, r)) for r in range(2)
    ]
    expected = [[], []]
    for b0, b1 in zip(*loaders, strict=True):
        l0, l1 = ref(b0), ref(b1)
        ((l0 + l1) / 2).backward()
        opt.step()
        opt.zero_grad()
        expected[0].append(l0.item())
        expected[1].append(l1.item())
    for rank, result in enumerate(results):
        assert result["world"] == 2
        torch.testing.assert_close(
            torch.tensor(result["losses"]), torch.tensor(expected[rank]), rtol=1e-5, atol=1e-7
        )
        assert result["client"] == {"rank_saw": 4}
        assert result["path"] == str(tmp_path / "ckpt" / "global_step4") and result["steps"] == 4
