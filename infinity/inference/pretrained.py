"""from_pretrained: a Hugging Face ``save_pretrained`` directory as a causal LM whose weights never sit whole in memory.

The model is made from the directory's config.json under ``infinity.zero.Init``
(its parameters rest in the init store from the start), then
``infinity.zero.load_pretrained`` streams the safetensors checkpoint into the
init store's shards, tensor by tensor. ``infinity.initialize`` then takes the
parameters from the init store as it would any zero.Init model (and quantises
them there when the config asks: [Note: quantised shards] in
infinity/weights/quant.py).

Threading: the caller's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from infinity.zero import Init, load_pretrained


def from_pretrained(
    model_dir: str | Path, config: Any, *, dtype: torch.dtype | None = None
) -> nn.Module:
    """The causal LM in ``model_dir`` (config.json and safetensors), built under ``infinity.zero.Init(config)``
    with the checkpoint's weights written in; ready for ``infinity.initialize(model, config)``.
    ``dtype``: the parameters' dtype (default: the config.json's ``dtype``, else fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    if dtype is None:
        dtype = getattr(hf_config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    with Init(config):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    load_pretrained(model, model_dir)
    return model.eval()
