"""A GPT-style decoder in plain torch: pre-LayerNorm blocks, causal attention, tied embeddings.

The lm head reuses the token embedding's weight through ``F.linear`` in the
top-level forward: a parameter read outside its owner's forward, which the
stage-3 partitioner must handle (DeepSpeed needs ``register_external_parameter``).
Initialisation follows GPT-2 (normal 0.02, residual projections scaled by
1/sqrt(2 * n_layer)) and is deterministic for a given torch seed.
``gradient_checkpointing_enable()`` (transformers' name) recomputes each
block in backward instead of keeping its activations: the same numbers, a
fraction of the activation memory.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # byte-level: the built-in corpus needs no tokenizer
    seq_len: int = 256
    n_layer: int = 12
    n_head: int = 16
    d_model: int = 1024
    bias: bool = True  # biases in the Linear layers (GPT-2 has them; LLaMA-style models do not)

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} must be a multiple of n_head={self.n_head}")

    @property
    def num_params(self) -> int:
        """Parameter count (tied head counted once)."""
        d, L = self.d_model, self.n_layer
        b = 1 if self.bias else 0
        per_block = (
            2 * 2 * d
            + (d * 3 * d + b * 3 * d)
            + (d * d + b * d)
            + (d * 4 * d + b * 4 * d)
            + (4 * d * d + b * d)
        )
        return self.vocab_size * d + self.seq_len * d + L * per_block + 2 * d

    @classmethod
    def for_params(cls, n_params: float, *, seq_len: int = 256, vocab_size: int = 256) -> GPTConfig:
        """The shape closest to ``n_params`` with GPT-like proportions (d_model / n_layer near 85)."""
        best: GPTConfig | None = None
        best_err = math.inf
        for n_layer in range(2, 97):
            d = max(64, int(round(math.sqrt(n_params / (12 * n_layer)) / 64)) * 64)
            cfg = cls(
                vocab_size=vocab_size,
                seq_len=seq_len,
                n_layer=n_layer,
                n_head=max(1, d // 64),
                d_model=d,
            )
            err = abs(cfg.num_params - n_params) / n_params + 0.1 * abs(math.log(d / n_layer / 85))
            if err < best_err:
                best, best_err = cfg, err
        assert best is not None
        return best


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        blocks = [Block(cfg) for _ in range(cfg.n_layer)]
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.gradient_checkpointing = False
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        for block in blocks:  # typed as Block (iterating the ModuleList gives Module)
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=residual_std)

    def gradient_checkpointing_enable(self) -> None:
        """Keep only each block's input for backward and recompute the block there (torch's non-reentrant
        checkpoint, which stage 3's hooks see as a second forward of the block's units)."""
        self.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.gradient_checkpointing = False

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, or the mean cross-entropy when ``targets`` are given."""
        T = idx.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than seq_len={self.cfg.seq_len}")
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        x = self.ln_f(x)
        logits = F.linear(x, self.wte.weight)  # tied head, read outside wte's forward
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
