"""Reference models (pure torch, no infinity imports): the demo's GPT and its built-in corpus.

Imports only torch.
"""

from infinity.models.corpus import TextCorpus
from infinity.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "TextCorpus"]
