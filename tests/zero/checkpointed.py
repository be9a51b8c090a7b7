"""Models with activation checkpointing, and plain PyTorch training with the same checkpointing (the oracle).

Three models, each checkpointed the way its users do it:
- ``gpt2`` and ``llama``: transformers models built from a config (random
  weights, nothing downloaded) with ``gradient_checkpointing_enable`` —
  transformers checkpoints each decoder layer's ``forward`` (its own hooks
  stay outside the checkpoint, its children's run again in the recomputation).
  GPT-2 keeps its dropout: the recomputation must replay the same masks.
- ``gpt``: infinity.models.GPT whose blocks are called through a checkpoint
  function (``checkpoint(block, x)``: the block's ``__call__``, hooks and all,
  runs again), torch's in either mode or infinity.checkpointing's; or, with
  mode ``builtin``, its own ``gradient_checkpointing_enable()``.

The oracle is plain PyTorch on the same model with the same checkpointing:
torch AdamW (foreach off) and clip_grad_norm_ in fp32; in bf16 the
hand-written mixed-precision loop of tests/engine/reference.py (fp32 masters,
a bf16 model, the machine-independent sqrt and clip).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
import torch.utils.checkpoint
from torch import nn

from infinity.models import GPT, GPTConfig
from tests.engine.reference import BETAS, CLIP, EPS, LR, WD, CorrectlyRoundedSqrt, clip_in_float64

VOCAB = 64
SEQ = 16
MICRO_BATCH = 2
MODES = ("reentrant", "non_reentrant")


def _hf_checkpointing(model: nn.Module, mode: str) -> nn.Module:
    with warnings.catch_warnings():
        # transformers 5 renamed it activation_checkpointing_enable; users call both
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"}
        )
    return model


def gpt2(mode: str | None) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(cfg)
    return _hf_checkpointing(model, mode) if mode else model


def llama(mode: str | None) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg)
    return _hf_checkpointing(model, mode) if mode else model


class Checkpointed(nn.Module):
    """Calls ``block`` through ``checkpoint_fn`` (as ``deepspeed.checkpointing.checkpoint(self.block, x)``)."""

    def __init__(self, block: nn.Module, checkpoint_fn: Callable):
        super().__init__()
        self.block = block
        self.checkpoint_fn = checkpoint_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.checkpoint_fn(self.block, x)


def checkpoint_fn(mode: str) -> Callable:
    if mode == "deepspeed":
        import infinity

        return infinity.checkpointing.checkpoint
    if mode == "deepspeed_non_reentrant":
        import infinity

        return infinity.checkpointing.non_reentrant_checkpoint
    return functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=mode == "reentrant")


def gpt(mode: str | None) -> nn.Module:
    model = GPT(
        GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=2, d_model=32, bias=False)
    )
    if mode == "builtin":
        model.gradient_checkpointing_enable()
    elif mode:
        model.blocks = nn.ModuleList(Checkpointed(b, checkpoint_fn(mode)) for b in model.blocks)
    return model


MODELS: dict[str, Callable[[str | None], nn.Module]] = {"gpt2": gpt2, "llama": llama, "gpt": gpt}


def build(name: str, mode: str | None, *, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name](mode)


def loss_of(model: Callable, x: torch.Tensor) -> torch.Tensor:
    """The model's mean next-token loss on ``x`` (an engine or a module)."""
    module = getattr(model, "module", model)
    if isinstance(module, GPT):
        return model(x[:, :-1], x[:, 1:])
    return model(input_ids=x, labels=x).loss


def batch(step: int, rank: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + 10 * step + rank)
    return torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)


def train_step(model: Callable, step: int, rank: int = 0) -> torch.Tensor:
    """One forward with the step's batch and dropout seed (the same in the engine and the oracle)."""
    x = batch(step, rank)
    torch.manual_seed(10 * step + rank)
    return loss_of(model, x)


def oracle_run(
    name: str,
    mode: str | None,
    *,
    steps: int,
    dtype: torch.dtype = torch.float32,
    world_size: int = 1,
):
    """Plain PyTorch with the same checkpointing: losses by (step, rank) and the final (fp32 master)
    weights; with ``world_size`` ranks, each step averages the grads of every rank's batch."""
    model = build(name, mode)
    model.train()
    if dtype == torch.float32:
        opt = torch.optim.AdamW(
            model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False
        )
        losses = {}
        for step in range(steps):
            for rank in range(world_size):
                loss = train_step(model, step, rank)
                (loss / world_size).backward()
                losses[(step, rank)] = loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
    if world_size != 1:
        raise ValueError("the 16-bit oracle is for one rank")
    masters = [p.detach().clone().float().requires_grad_(True) for p in model.parameters()]
    for p in (
        model.parameters()
    ):  # the parameters only: the engine leaves buffers (rotary tables) as built
        p.data = p.data.to(dtype)
    opt = torch.optim.AdamW(masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    losses = {}
    for step in range(steps):
        loss = train_step(model, step)
        loss.backward()
        for m, p in zip(masters, model.parameters(), strict=True):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        clip_in_float64(masters, CLIP)
        with CorrectlyRoundedSqrt():
            opt.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters, strict=True):
                p.copy_(m)
        losses[(step, 0)] = loss.item()
    names = [n for n, _ in model.named_parameters()]
    return losses, {n: m.detach().clone() for n, m in zip(names, masters, strict=True)}


def stage3_nvme_config(nvme_path, *, dtype: str = "fp32", buffer_size: int = 1 << 16) -> dict:
    """Stage 3 with parameters and optimizer state on NVMe; the oracle's AdamW and clipping."""
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_clipping": CLIP,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD},
        },
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 3000,
            "stage3_param_persistence_threshold": 100,
            "offload_param": {
                "device": "nvme",
                "nvme_path": str(nvme_path),
                "buffer_count": 4,
                "buffer_size": buffer_size,
                "max_in_cpu": 0,
            },
            "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme_path)},
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 8},
    }
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
    return cfg


def engine_run(name: str, mode: str | None, config: dict, *, steps: int, rank: int = 0):
    """The same training through infinity.initialize (as rank ``rank``): losses by (step, rank), the
    final full weights, the prefetch stats."""
    import infinity
    from infinity.zero.gathered import GatheredParameters

    model = build(name, mode)
    engine = infinity.initialize(model, config)
    losses = {}
    try:
        for step in range(steps):
            loss = train_step(engine, step, rank)
            engine.backward(loss)
            engine.step()
            losses[(step, rank)] = loss.item()
        stats = engine.prefetch_stats()
        weights = {}
        for (
            n,
            p,
        ) in model.named_parameters():  # one at a time: the pool may hold less than the model
            with GatheredParameters(p):
                weights[n] = p.detach().clone()
    finally:
        engine.close()
    return losses, weights, stats
