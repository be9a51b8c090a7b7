"""The demo's built-in text: English-like sentences from a small grammar, byte-tokenised.

Generated (deterministically, from a seed) rather than shipped, so it has no
licence and no download; it has enough structure (spelling, agreement, word
order) that a byte-level GPT's loss falls visibly within a few dozen steps.
"""

from __future__ import annotations

import random

import torch

_SUBJECTS = [
    "the engine",
    "a tensor",
    "the optimizer",
    "each layer",
    "the scheduler",
    "a worker thread",
    "the disk",
    "the host",
    "every rank",
    "the model",
    "a buffer",
    "the kernel",
    "the store",
]
_VERBS = [
    "reads",
    "writes",
    "streams",
    "fetches",
    "releases",
    "gathers",
    "updates",
    "prefetches",
    "checks",
    "waits for",
    "copies",
    "partitions",
    "swaps out",
    "swaps in",
]
_OBJECTS = [
    "the next layer",
    "its shard",
    "the moments",
    "a pinned buffer",
    "the gradients",
    "the master weights",
    "one extent",
    "the swap file",
    "the trace",
    "the parameters",
    "a large block",
    "the queue",
    "the checkpoint",
]
_TAILS = [
    "before the compute needs it",
    "while the previous step finishes",
    "in one large read",
    "without touching the page cache",
    "as soon as the hook fires",
    "from the fastest tier",
    "and releases it after use",
    "within the memory budget",
    "at the disk's full speed",
    "so that nothing stalls",
    "in the order the trace recorded",
]


def _sentence(rng: random.Random) -> str:
    s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    if rng.random() < 0.7:
        s += " " + rng.choice(_TAILS)
    return s[0].upper() + s[1:] + "."


def build_text(nbytes: int, *, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < nbytes:
        para = " ".join(_sentence(rng) for _ in range(rng.randint(3, 7))) + "\n"
        parts.append(para)
        size += len(para)
    return "".join(parts).encode()[:nbytes]


class TextCorpus:
    """Byte tokens of the built-in text; ``batch`` cuts deterministic (input, target) windows."""

    def __init__(self, nbytes: int = 1 << 20, *, seed: int = 0):
        self.tokens = torch.frombuffer(
            bytearray(build_text(nbytes, seed=seed)), dtype=torch.uint8
        ).long()

    def batch(
        self, step: int, batch_size: int, seq_len: int, *, rank: int = 0, world_size: int = 1
    ):
        """Windows for (step, rank): the same on every run, disjoint across ranks."""
        g = torch.Generator().manual_seed(step * 1_000_003 + 17)
        starts = torch.randint(
            0, len(self.tokens) - seq_len - 1, (batch_size * world_size,), generator=g
        )
        starts = starts[rank * batch_size : (rank + 1) * batch_size]
        x = torch.stack([self.tokens[s : s + seq_len] for s in starts.tolist()])
        y = torch.stack([self.tokens[s + 1 : s + seq_len + 1] for s in starts.tolist()])
        return x, y
