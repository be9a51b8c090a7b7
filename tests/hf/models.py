"""Tiny Hugging Face models built from their configs (random weights, nothing downloaded), their
batches, and the DeepSpeed config the tests train them under.

Each architecture is transformers' own code, "no one here wrote" it: hidden size 32, 2 layers, a
vocabulary of 128. ``config()`` builds a fresh config every time: transformers changes the config
it is given (``resize_token_embeddings`` writes ``vocab_size``), so two models never share one.
"""

from __future__ import annotations

import torch
import transformers as tf

VOCAB = 128
SEQ = 12
_TOKENS = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=2, pad_token_id=1)

ARCHS = {
    "gpt2": (
        tf.GPT2LMHeadModel,
        tf.GPT2Config,
        dict(n_embd=32, n_layer=2, n_head=2, n_positions=64),
    ),
    "llama": (
        tf.LlamaForCausalLM,
        tf.LlamaConfig,
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
        ),
    ),
    "opt": (
        tf.OPTForCausalLM,
        tf.OPTConfig,
        dict(
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
        ),
    ),
    "gpt_neox": (
        tf.GPTNeoXForCausalLM,
        tf.GPTNeoXConfig,
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=64,
        ),
    ),
    "bert": (
        tf.BertForSequenceClassification,
        tf.BertConfig,
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=64,
            num_labels=3,
        ),
    ),
    "t5": (
        tf.T5ForConditionalGeneration,
        tf.T5Config,
        dict(d_model=32, d_ff=64, d_kv=16, num_layers=2, num_heads=2, decoder_start_token_id=0),
    ),
}
CAUSAL = ("gpt2", "llama", "opt", "gpt_neox")


def config(arch: str) -> tf.PretrainedConfig:
    _, cfg_cls, kw = ARCHS[arch]
    return cfg_cls(**_TOKENS, **kw)


def build(arch: str, seed: int = 0) -> torch.nn.Module:
    """The model from its config with random weights, after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return ARCHS[arch][0](config(arch))


def batch(arch: str, step: int) -> dict[str, torch.Tensor]:
    """Keyword inputs with ``labels=``, as ``engine(**batch)`` takes them (padding masked for BERT)."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=g)
    if arch == "bert":
        mask = torch.ones_like(ids)
        mask[1, -3:] = 0
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": torch.randint(0, 3, (2,), generator=g),
        }
    if arch == "t5":
        return {"input_ids": ids, "labels": torch.randint(3, VOCAB, (2, SEQ // 2), generator=g)}
    return {"input_ids": ids, "labels": ids}


def ds_config(nvme_path, *, precision: str = "fp32", lr: float | None = None) -> dict:
    """Stage 3, parameters and optimizer state on NVMe, nothing kept in host memory (max_in_cpu 0) and a
    persistence threshold below every unit (LayerNorms too), so nearly every unit streams from the disk."""
    from tests.engine.reference import BETAS, CLIP, EPS, LR, WD

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr or LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD},
        },
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 3000,
            "stage3_param_persistence_threshold": 16,
            "offload_param": {
                "device": "nvme",
                "nvme_path": str(nvme_path),
                "buffer_count": 4,
                "buffer_size": 1 << 16,
                "max_in_cpu": 0,
            },
            "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme_path)},
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 8},
    }
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


def build_under_init(
    arch: str, ds: dict, seed: int = 0, *, dtype: torch.dtype | None = None
) -> torch.nn.Module:
    """``build`` inside ``infinity.zero.Init(ds, dtype=dtype)``: the same seed, parameters partitioned
    as they are made (in the config's 16-bit dtype, or ``dtype``)."""
    import infinity

    torch.manual_seed(seed)
    with infinity.zero.Init(ds, dtype=dtype):
        return ARCHS[arch][0](config(arch))
