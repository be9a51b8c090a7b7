"""What an export needs beside the weights, saved in the checkpoint as the model is at the save.

- ``config.json``: a transformers model's config as ``save_pretrained`` writes it (its class in
  ``architectures``), taken from the live model, so a ``resize_token_embeddings`` before the save is in
  it; the config of the base model of a PEFT model.
- ``adapter_config.json``: a PEFT model's active adapter's config as ``PeftModel.save_pretrained``
  writes it (``inference_mode`` true).
``infinity export`` reads them from the checkpoint (format.py lists them in the manifest, with their
CRC32C): a folder ``from_pretrained`` (or ``PeftModel.from_pretrained``) loads needs no flag.

Never imports transformers or peft: a model is one of theirs only if they are already imported.
"""

from __future__ import annotations

import copy
import sys
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from infinity.weights.hf_layout import CONFIG_NAME, hf_config

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"


def peft_model(module: nn.Module) -> Any:
    """``module`` if it is a peft PeftModel, else None."""
    peft = sys.modules.get("peft")
    base = getattr(peft, "PeftModel", None) if peft is not None else None
    return module if base is not None and isinstance(module, base) else None


def model_files(module: nn.Module) -> tuple[dict[str, bytes], dict[str, Any] | None]:
    """(file name -> bytes to keep in the checkpoint, the PEFT adapter's description for the manifest)."""
    files: dict[str, bytes] = {}
    peft = peft_model(module)
    hf = peft.get_base_model() if peft is not None else module
    cfg = hf_config(hf)
    if cfg is not None:
        cfg = copy.deepcopy(cfg)
        cfg.architectures = [type(hf).__name__]
        files[CONFIG_NAME] = cfg.to_json_string(use_diff=True).encode()
    adapter = None
    if peft is not None:
        name = peft.active_adapter
        acfg = copy.deepcopy(peft.peft_config[name])
        acfg.inference_mode = True  # as PeftModel.save_pretrained writes it
        with tempfile.TemporaryDirectory() as d:
            acfg.save_pretrained(d)
            files[ADAPTER_CONFIG_NAME] = (Path(d) / ADAPTER_CONFIG_NAME).read_bytes()
        adapter = {"name": name, "peft_type": str(getattr(acfg.peft_type, "value", acfg.peft_type))}
    return files, adapter


def adapter_file_name(state_dict_name: str, adapter: str) -> str:
    """The name PEFT's ``get_peft_model_state_dict`` gives a parameter in ``adapter_model.safetensors``:
    the adapter's name taken out (``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``)."""
    return state_dict_name.replace(f".{adapter}", "")
