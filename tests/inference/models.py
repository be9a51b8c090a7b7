"""Small Hugging Face decoders built from config with random weights (no downloads), and the engine config
that streams their weights from NVMe through a pool smaller than the model."""

from __future__ import annotations

import copy

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
)

VOCAB = 128
PAD = 0


def gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=4,
        n_embd=64,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=PAD,
    )
    return GPT2LMHeadModel(cfg).eval()


def llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        num_hidden_layers=4,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=PAD,
    )
    return LlamaForCausalLM(cfg).eval()


def opt(seed: int = 0) -> OPTForCausalLM:
    torch.manual_seed(seed)
    cfg = OPTConfig(
        num_hidden_layers=4,
        hidden_size=64,
        ffn_dim=128,
        num_attention_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        word_embed_proj_dim=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=PAD,
    )
    return OPTForCausalLM(cfg).eval()


MODELS = {"gpt2": gpt2, "llama": llama, "opt": opt}


def pair(name: str, dtype: torch.dtype = torch.float32):
    """The model for the engine (in ``dtype``) and an identical copy that stays plain PyTorch."""
    model = MODELS[name]().to(dtype)
    return model, copy.deepcopy(model)


def inference_config(nvme_path, **extra) -> dict:
    """Stage 3, weights on NVMe, no optimizer: infinity.initialize builds the inference engine. The pool
    (4 × 16384 elements of the weights' dtype) holds a layer but not the model (fp32 or bf16), so
    every forward reads from NVMe."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {
                "device": "nvme",
                "nvme_path": str(nvme_path),
                "buffer_count": 4,
                "buffer_size": 1 << 14,
                "max_in_cpu": 0,
            },
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 8},
        **extra,
    }


def prompts(batch: int, *, padded: bool, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` prompts of 7 tokens, left-padded (generate's padding for decoders) to different lengths
    when ``padded``; the ids and the attention mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, 7), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        for b in range(1, batch):
            n = min(2 * b, 5)
            ids[b, :n] = PAD
            mask[b, :n] = 0
    return ids, mask
