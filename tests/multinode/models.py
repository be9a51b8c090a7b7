"""The models the multi-node training tests train: infinity's tiny GPT and a Hugging Face Llama
built from a config, both as ``model(x, y) -> loss`` (tests.engine.models' convention)."""

import torch.nn.functional as F
from torch import nn

from tests.engine.models import VOCAB, tiny_gpt


class TinyLlama(nn.Module):
    """transformers' LlamaForCausalLM from a small config, its logits scored against ``y``."""

    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.lm = LlamaForCausalLM(
            LlamaConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                vocab_size=VOCAB,
                max_position_embeddings=16,
                attn_implementation="eager",
            )
        )

    def forward(self, x, y):
        logits = self.lm(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


MODELS = {"gpt": tiny_gpt, "llama": TinyLlama}
