"""ZeRO-3 with CPU offload as DeepSpeed's user guides set it up, with ``import deepspeed`` changed to
the line below: the model built under ``deepspeed.zero.Init(config_dict_or_path=...)``, its weights
set under ``deepspeed.zero.GatheredParameters(..., modifier_rank=0)``, the parameters counted
through ``ds_numel`` (as transformers and PEFT count them), trained with ``initialize(model=...,
model_parameters=..., training_data=..., config=...)`` and the dataloader it returns.

The accelerate guide writes ``with deepspeed.zero.Init(accelerator.deepspeed_plugin.config):`` with
the config as the first argument; ``build_positional`` does that.
"""

import torch

import infinity.compat.deepspeed as deepspeed


def build(model_cls, ds_config, init_state):
    """The model built under zero.Init, then given ``init_state``'s weights by rank 0."""
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = model_cls()
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters(param, modifier_rank=0):
            if torch.distributed.get_rank() == 0:
                param.data.copy_(init_state[name])
    return model


def build_positional(model_cls, ds_config):
    with deepspeed.zero.Init(ds_config):
        model = model_cls()
    return model


def count_parameters(model):
    """How transformers' and PEFT's counters read a ZeRO-3 model."""
    return sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())


def train(model, ds_config, training_data, epochs=1):
    model_engine, optimizer, trainloader, lr_scheduler = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        training_data=training_data,
        config=ds_config,
    )
    losses = []
    for _ in range(epochs):
        for batch in trainloader:
            loss = model_engine(batch)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
    return model_engine, losses
