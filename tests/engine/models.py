"""Small models for the equivalence tests, each exercising one thing the partitioner must handle."""

import torch
import torch.nn.functional as F
from torch import nn

from infinity.models import GPT, GPTConfig

VOCAB = 64


def tiny_gpt() -> nn.Module:
    """Tied embedding read outside its owner's forward (F.linear(x, wte.weight)).

    Without Linear biases: the attention key bias has an exactly-zero true
    gradient, so Adam turns its rounding noise into updates that differ from
    run to run at any last-bit change, which would hide real differences."""
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=16, n_layer=2, n_head=2, d_model=32, bias=False))


class TwiceCalled(nn.Module):
    """One Linear applied twice in one forward."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 24)
        self.shared = nn.Linear(24, 24)
        self.head = nn.Linear(24, VOCAB)

    def forward(self, x, y):
        h = self.emb(x)
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), y.reshape(-1))


class Alternating(nn.Module):
    """A branch taken on even steps only: its parameters get no grad on odd steps (torch skips them)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 24)
        self.even = nn.Linear(24, 24)
        self.odd = nn.Linear(24, 24)
        self.head = nn.Linear(24, VOCAB)
        self.step = 0

    def forward(self, x, y):
        h = self.emb(x)
        h = torch.relu(self.even(h) if self.step % 2 == 0 else self.odd(h))
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), y.reshape(-1))


MODELS = {
    "gpt": tiny_gpt,
    "twice": TwiceCalled,
    "alternating": Alternating,
}


def gpt_loss(model, x, y):
    return model(x, y)


def batch(step: int, micro: int, rank: int, *, batch_size: int = 2, seq: int = 16):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randint(0, VOCAB, (batch_size, seq), generator=g)
    y = torch.randint(0, VOCAB, (batch_size, seq), generator=g)
    return x, y
