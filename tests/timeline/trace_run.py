"""A tiny stage-3 run with everything on NVMe, recorded on the timeline: shared by the trace tests."""

from __future__ import annotations

import torch

import infinity
from infinity.models import GPT, GPTConfig, TextCorpus

GPT_SIZE = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=64, bias=False)
MICRO_BATCH = 2


def config(nvme: str, trace: dict | None, **extra) -> dict:
    """Parameters and optimizer state on NVMe, a parameter pool of 3 buffers (fewer than the units,
    so the forward and backward read them; 2 buffers once left the
    forward and the optimizer's read thread both waiting 300 s for pool room), every unit fetched."""
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_live_parameters": 40000,
            "stage3_prefetch_bucket_size": 20000,
            "offload_param": {
                "device": "nvme",
                "nvme_path": nvme,
                "buffer_count": 3,
                "buffer_size": 16384,
                "max_in_cpu": 0,
            },
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
            "sub_group_size": 20000,
        },
        **extra,
    }
    if trace is not None:
        cfg["trace"] = trace
    return cfg


def train(cfg: dict, steps: int, *, keep_open: bool = False):
    """Trains ``steps`` steps; returns (engine, losses). The engine is closed unless ``keep_open``."""
    torch.manual_seed(0)
    with infinity.zero.Init(cfg):
        model = GPT(GPT_SIZE)
    engine = infinity.initialize(model, cfg)
    corpus = TextCorpus()
    losses = []
    for i in range(steps):
        x, y = corpus.batch(i, MICRO_BATCH, GPT_SIZE.seq_len)
        x, y = x % GPT_SIZE.vocab_size, y % GPT_SIZE.vocab_size
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if not keep_open:
        engine.close()
    return engine, losses
