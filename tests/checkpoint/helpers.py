"""Shared pieces of the checkpoint tests: configs, a model with tied weights, buffers and dropout,
training loops, and snapshots of everything an engine's state consists of."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import infinity
from infinity.engine.checkpoint.save import unit_state_refs
from infinity.zero.gathered import GatheredParameters
from tests.engine.models import VOCAB, batch, tiny_gpt
from tests.engine.reference import LR, engine_config

N_STEPS, M_STEPS, GAS = 3, 3, 2


class TiedNet(nn.Module):
    """A head tied to the embedding (one parameter, two state_dict names), BatchNorm (float and int64
    buffers that training changes) and dropout (the RNG state matters)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.hidden = nn.Linear(32, 32)
        self.norm = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(32, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x, y=None):
        h = self.emb(x).reshape(-1, 32)
        h = self.drop(torch.tanh(self.norm(self.hidden(h))))
        logits = self.head(h)
        return logits if y is None else F.cross_entropy(logits, y.reshape(-1))


MODELS = {"gpt": tiny_gpt, "tied": TiedNet}


def config(
    stage: int, param: str, optim: str, nvme, *, dtype: str = "fp32", gas: int = GAS
) -> dict:
    cfg = engine_config(stage, param, optim, nvme, gas=gas)
    # One optimizer sub-group: with several, PartitionedAdam's prefetch of the next sub-group can wait
    # forever on a fragmented pool (an engine issue, seen without checkpoints); not what is tested here.
    cfg["zero_optimization"]["sub_group_size"] = 10**9
    cfg["scheduler"] = {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": LR, "warmup_num_steps": 4},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def make_engine(model_name: str, cfg: dict, *, seed: int):
    torch.manual_seed(seed)
    model = MODELS[model_name]()
    return infinity.initialize(model, cfg), model


def train(engine, start: int, steps: int, *, rank: int = 0, gas: int = GAS) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        for micro in range(gas):
            x, y = batch(step, micro, rank)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def eval_logits(forward) -> torch.Tensor:
    x, _ = batch(999, 0, 0)
    with torch.no_grad():
        return forward(x).float().clone()


def weights(engine) -> dict[str, torch.Tensor]:
    with GatheredParameters(engine):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def snapshot(engine) -> dict:
    """Everything a load could change: weights, buffers, optimizer shards, step counts, counters,
    hyperparameters, scheduler and loss scale, RNG (after the optimizer step still running behind, if any)."""
    engine.synchronize()
    parts = engine.checkpoint_parts()
    shards = {}
    for unit in parts.units:
        for role, ref in unit_state_refs(parts, unit):
            t = ref.store.fetch(ref.key).result()
            shards[(unit.index, role)] = t.clone()
            ref.store.release(ref.key)
    return {
        "weights": weights(engine),
        "buffers": {n: b.clone() for n, b in engine.module.named_buffers()},
        "shards": shards,
        "param_steps": list(parts.optimizer.param_steps),
        "counters": (engine.global_steps, engine.micro_steps, engine.skipped_steps),
        "lr": engine.get_lr(),
        "scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "loss_scale": engine.loss_scaler.state_dict(),
        "rng": torch.get_rng_state().clone(),
    }


def assert_same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def flip_byte(path, offset: int) -> None:
    """Inverts one byte of a file in place (a bit flip the checksums must catch)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
