"""save_merged: a LoRA model's base with its adapters merged in, streamed unit by unit into the Hugging
Face layout ``from_pretrained`` reads — what PEFT's ``merge_and_unload()`` then ``save_pretrained`` give.

[Note: merged export]
PEFT's merge of a LoRA layer (``peft.tuners.lora.Linear.merge``) adds to the base layer's weight
W (as the base model names it, without PEFT's ``base_layer``) the delta of each active adapter,
    W += transpose(B @ A, fan_in_fan_out) * scaling[adapter],
computed in fp32 when W is 16-bit and rounded once to W's dtype, then drops the adapter's
tensors. Here the adapters (megabytes) are gathered first and held; the base is then gathered one
unit at a time (dequantised where it rests quantised: [Note: a quantised base in a checkpoint] in
quantised.py), each LoRA layer's weight gets its delta by PEFT's formula, and the unit is written under
the base model's names and dropped: host memory holds the adapters and one unit. Only what PEFT
merges this way is merged: a LoRA layer over a Linear (or GPT-2's Conv1D, ``fan_in_fan_out``) without
DoRA or a LoRA bias; any other adapter is refused naming the layer, before anything is written.
Every rank must call it (the gathers are collective); rank 0 writes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from infinity.engine.checkpoint.collective_write import Planned, rank0_weight_files
from infinity.engine.checkpoint.export import (
    DEFAULT_MAX_SHARD_SIZE,
    gather_unit,
    hf_name,
    write_module_config_files,
)
from infinity.engine.checkpoint.model import describe_units
from infinity.engine.checkpoint.progress import Progress
from infinity.engine.checkpoint.target import CheckpointTarget
from infinity.engine.checkpoint.threads import torch_threads
from infinity.engine.checkpoint.weights_out import Segment
from infinity.weights.hf_layout import WEIGHTS_NAME, HfNames, hf_config, parse_size

log = logging.getLogger("infinity.checkpoint")


def lora_layers(module: nn.Module, caller: str) -> dict[str, Any]:
    """The PEFT model's LoRA layers by their base model name (PEFT's ``base_model.model.`` prefix off),
    each checked mergeable as [Note: merged export] says (``caller`` names the refusing call)."""
    from peft.tuners.lora import LoraLayer

    layers = {}
    for name, m in module.named_modules():
        if not isinstance(m, LoraLayer):
            continue
        base = m.get_base_layer()
        conv1d = type(base).__name__ == "Conv1D"
        for a in m.active_adapters:
            if a not in m.lora_A:
                continue
            what = None
            if not isinstance(base, nn.Linear) and not conv1d:
                what = f"LoRA over a {type(base).__name__}"
            elif m.use_dora.get(a, False):
                what = "DoRA"
            elif getattr(m, "lora_bias", {}).get(a, False):
                what = "a LoRA bias"
            if what is not None:
                raise ValueError(
                    f"{caller} merges LoRA over Linear layers; {name!r} (adapter {a!r}) has {what}; "
                    "save the adapters with engine.save_pretrained() and merge them with PEFT's "
                    "merge_and_unload() on a model that fits in memory"
                )
        layers[base_name(name)] = m
    return layers


def base_name(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


class MergeTarget(CheckpointTarget, Protocol):
    """What a merged export needs of an engine: the checkpoint's view, and the adapters gathered."""

    def gathered_state_dict(self, keys: Any = None) -> dict[str, torch.Tensor]: ...


def _peft_base(module: nn.Module) -> nn.Module:
    try:
        from peft import PeftModel
    except ImportError:
        pass
    else:
        if isinstance(module, PeftModel):
            return module.get_base_model()
    raise ValueError(
        f"save_merged merges a PEFT model's LoRA adapters into its base; this engine trains a "
        f"{type(module).__name__}: use engine.save_16bit_model() to write its weights"
    )


def save_merged(
    engine: MergeTarget,
    save_dir: str | os.PathLike,
    *,
    max_shard_size: int | str | None = None,
    progress: bool | None = None,
) -> Path:
    """Writes the base model with the active LoRA adapters merged in ([Note: merged export]) to
    ``save_dir`` as ``from_pretrained`` reads it (``config.json``, ``model.safetensors`` or shards of at
    most ``max_shard_size`` with their index), in the dtype the model trains in. Every rank must call
    it; returns the directory."""
    module = engine.module
    out = Path(save_dir)
    layers: dict[str, Any] = {}

    def plan() -> tuple[Planned, tuple[nn.Module, Any, list, list, list]]:
        base = _peft_base(module)
        layers.update(lora_layers(module, "save_merged"))
        engine.synchronize()
        parts = engine.checkpoint_parts()
        if parts.passthrough is not None or not parts.units:
            raise ValueError(
                "save_merged streams a partitioned model (the partitioned Adam); this engine steps "
                "whole parameters with a torch optimizer: merge with PEFT's merge_and_unload() instead"
            )
        names = HfNames.of(base)
        infos = describe_units(module, list(parts.units))
        adapter_keys = [s.name for info in infos for s in info.slots if is_adapter(s.name, layers)]
        segments: list[Segment] = []
        kept: list[tuple[int, int, str]] = []  # (unit index, slot, base model name) in output order
        for info in infos:
            for k, s in enumerate(info.slots):
                if s.name in adapter_keys:
                    continue
                aliases = [base_name(a) for a in s.aliases]
                segments.append(Segment(hf_name(names, aliases), engine.dtype, s.shape))
                kept.append((info.index, k, aliases[0]))
        buffers = _buffers(base)
        segments += [Segment(hf_name(names, [n]), b.dtype, tuple(b.shape)) for n, b in buffers]
        max_nbytes = parse_size(max_shard_size or DEFAULT_MAX_SHARD_SIZE)
        files = Planned(out, segments, WEIGHTS_NAME, max_nbytes, replace_stale=True)
        return files, (base, parts, kept, adapter_keys, buffers)

    with rank0_weight_files(engine.group, engine.config.aio, f"'{out}'", plan) as (
        (base, parts, kept, adapter_keys, buffers),
        output,
    ):
        adapters = engine.gathered_state_dict(
            adapter_keys
        )  # every rank: the gathers are collective
        bar = Progress(output.total_nbytes if output else 0, f"merge {out.name}", progress or False)
        with bar, torch_threads(1):
            for t in _merged_values(engine, parts, kept, layers, adapters):
                if output is not None:
                    output.append(t)
                bar.update(t.numel() * t.element_size())
            if output is not None:
                for _, b in buffers:
                    output.append(b.detach().cpu().contiguous())
                output.commit()
                cfg = hf_config(base)
                if cfg is not None:
                    write_module_config_files(out, base, cfg, engine.dtype, nonce=output.nonce)
    if engine.group.rank == 0:
        log.info("wrote the merged model to '%s' (%d LoRA layers merged)", out, len(layers))
    return out


def is_adapter(name: str, layers: dict[str, Any]) -> bool:
    return ".lora_" in name and base_name(name).split(".lora_")[0] in layers


def _buffers(base: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The base model's persistent buffers (its state_dict's), by name."""
    persistent = base.state_dict(keep_vars=True)
    return [(n, b) for n, b in base.named_buffers() if n in persistent]


def _merged_values(
    engine: CheckpointTarget,
    parts: Any,
    kept: list[tuple[int, int, str]],
    layers: dict[str, Any],
    adapters: dict[str, torch.Tensor],
) -> Iterator[torch.Tensor]:
    """Each kept parameter's values in output order, a LoRA layer's weight with its delta added; a unit
    is gathered once for its run of consecutive slots."""
    full, held = torch.empty(0), None
    for ui, k, name in kept:
        unit = parts.units[ui]
        if held != ui:
            full = gather_unit(engine.group, parts.param_store, unit, parts.formats.get(unit.index))
            held = ui
        s = unit.layout.slots[k]
        values = full[s.offset : s.offset + s.numel].view(s.shape)
        layer = layers.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
        if layer is not None:
            values = merge(layer, name.removesuffix(".weight"), values, adapters)
        yield values.reshape(-1)


def merge(
    layer: Any, prefix: str, weight: torch.Tensor, adapters: dict[str, torch.Tensor]
) -> torch.Tensor:
    """PEFT's merge of every active adapter into ``weight`` (see [Note: merged export])."""
    out = weight.clone()
    for a in layer.active_adapters:
        if a not in layer.lora_A:
            continue
        key = f"base_model.model.{prefix}.lora_{{}}.{a}.weight"
        wa, wb = adapters[key.format("A")], adapters[key.format("B")]
        delta = wb.float() @ wa.float()  # PEFT casts 16-bit adapters to fp32 for the product
        if layer.fan_in_fan_out:
            delta = delta.T
        out += (delta * layer.scaling[a]).to(out.dtype)
    return out
