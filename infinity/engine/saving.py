"""The model's own save calls on an engine's model: ``state_dict()``, ``save_pretrained`` (transformers
and PEFT), and the engine's ``gathered_state_dict`` / ``save_pretrained`` behind them.

[Note: saving a partitioned model]
Under stage 3 the model's parameters are ``(0,)``-shaped placeholders between
uses; their values are shards in the parameter store (host memory or NVMe).
Users save the model the way their framework does, on the model object they
hold, and would get those placeholders silently. So ``initialize`` makes every
save call a user makes on the model give the real weights, through one source
of full values: a unit gathered from the store (every rank's shard,
``export.gather_unit``, after the optimizer step still in flight), one unit at
a time, each unit once.

- ``model.state_dict()`` (and so ``torch.save(model.state_dict())``,
  Accelerate's ``get_state_dict``, Lightning's checkpoint, PEFT's
  ``get_peft_model_state_dict``): a state_dict post-hook on each module that
  owns partitioned parameters replaces its placeholders with full copies.
  The dict holds the whole model (or the part asked for) in host memory: that
  is what a state dict is. ``keep_vars=True`` returns the live parameters
  themselves, as torch documents (placeholders under stage 3).
- ``engine.gathered_state_dict(keys)``: the same values for the keys asked
  only, so a caller that needs part of the model (the adapters) gathers only
  that part.
- ``PreTrainedModel.save_pretrained(dir)`` on the engine's model streams: it
  is ``save_16bit_model``'s Hugging Face layout (a unit at a time through a
  few aligned buffers, never the whole model in memory; shards of
  ``max_shard_size``, the index, ``config.json``, ``generation_config.json``,
  stale shards removed, the folder created). What it cannot honour
  (``push_to_hub``, ``variant``, ``distributed_checkpoint``,
  ``save_original_format=False``) is refused naming the call that works.
- ``PeftModel.save_pretrained(dir)`` runs PEFT's own code on a state dict in
  which only the tensors PEFT keeps are gathered (found by running PEFT's
  selection over shape-only meta tensors first): ``adapter_config.json`` and
  ``adapter_model.safetensors`` exactly as plain PEFT writes them, without the
  frozen base ever being gathered.

Both ``save_pretrained`` replacements are instance attributes of the model,
removed by ``engine.close()``. After the close (or once the engine is
collected) the state_dict hook refuses a placeholder with an error instead
of returning it. Every rank must make the same save calls in the same order
(the gathers are collectives); rank 0 writes files.

Threading: the training thread, outside forward and backward.
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from infinity.engine.checkpoint.export import gather_unit

if TYPE_CHECKING:
    from infinity.engine.build import Runtime
    from infinity.zero.collectives import DataParallelGroup
    from infinity.zero.unit import ParamUnit


class EngineToSave(Protocol):
    """What saving needs of an engine (engine.py's ``Engine``, which imports this module, so it is
    named here by what it offers rather than imported)."""

    @property
    def module(self) -> nn.Module: ...

    @property
    def group(self) -> DataParallelGroup: ...

    @property
    def runtime(self) -> Runtime: ...

    def save_16bit_model(
        self,
        save_dir: Any,
        save_filename: str = ...,
        *,
        layout: str | None = None,
        max_shard_size: int | str | None = None,
        progress: bool | None = None,
    ) -> Any: ...

    def synchronize(self) -> None: ...

    @property
    def closed(self) -> bool: ...


log = logging.getLogger("infinity.engine")

WORKING_CALLS = (
    "engine.save_pretrained(dir) or model.save_pretrained(dir) (streamed), engine.save_16bit_model(dir), "
    "engine.gathered_state_dict(), or model.state_dict() while the engine is open"
)


def gathered_state_dict(
    engine: EngineToSave, keys: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """``keys`` of ``engine.module.state_dict()`` (default: all), each a full tensor on CPU (a copy
    for a partitioned parameter), gathered unit by unit; in the state dict's order."""
    module = engine.module
    live = module.state_dict(keep_vars=True)  # the names, with the live parameters and buffers
    if keys is None:
        wanted = list(live)
    else:
        wanted = list(dict.fromkeys(keys))
        unknown = [k for k in wanted if k not in live]
        if unknown:
            raise KeyError(
                f"{unknown[0]!r} is not a state_dict key of this {type(module).__name__} "
                f"({len(unknown)} unknown of {len(wanted)} asked); its keys are e.g. "
                f"{list(live)[:3]}"
            )
    values = {k: live[k] for k in wanted}
    out = {k: v.detach() for k, v in values.items()}
    full_values(engine, out, {k: v for k, v in values.items() if isinstance(v, nn.Parameter)})
    return out


def full_values(
    engine: EngineToSave, entries: dict[str, torch.Tensor], params: dict[str, nn.Parameter]
) -> None:
    """Replaces each ``entries[key]`` whose parameter (``params[key]``) is partitioned with a full copy,
    gathering each unit it needs once, in unit order (the same on every rank)."""
    rt = engine.runtime
    store = rt.param_store
    if store is None:
        return  # stages 0-2: the module holds every parameter whole
    engine.synchronize()  # the values after an optimizer step still in flight
    by_unit: dict[int, tuple[ParamUnit, list[tuple[str, int]]]] = {}
    for key, p in params.items():
        found = rt.unit_map.unit_of.get(p)
        if found is None:
            continue
        unit, slot = found
        if entries[key].shape == unit.layout.slots[slot].shape:
            continue  # resident (a persistent unit, or gathered now): the live tensor is whole
        by_unit.setdefault(unit.index, (unit, []))[1].append((key, slot))
    for index in sorted(by_unit):
        unit, wanted = by_unit[index]
        fmt = rt.plan.format_of(unit) if rt.plan is not None and not unit.trainable else None
        full = gather_unit(engine.group, store, unit, fmt)  # a quantised base: dequantised
        for key, slot in wanted:
            s = unit.layout.slots[slot]
            entries[key] = full[s.offset : s.offset + s.numel].view(s.shape).clone()
        del full


class _StateDictHook:
    """A module's state_dict post-hook: its own partitioned parameters' placeholders become full copies."""

    def __init__(self, engine: EngineToSave, own: list[tuple[str, nn.Parameter, torch.Size]]):
        self.engine = weakref.ref(engine)
        self.own = own  # (local name, parameter, true shape)

    def __call__(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
    ) -> None:
        entries: dict[str, torch.Tensor] = {}
        params: dict[str, nn.Parameter] = {}
        for name, p, shape in self.own:
            value = state_dict.get(prefix + name)
            # keep_vars=True asks for the parameters themselves; a full entry needs nothing
            if (
                isinstance(value, torch.Tensor)
                and not isinstance(value, nn.Parameter)
                and value.shape != shape
            ):
                entries[prefix + name] = value
                params[prefix + name] = p
        if not entries:
            return
        engine = self.engine()
        if engine is None or engine.closed:
            raise RuntimeError(
                f"{type(module).__name__}.state_dict(): {next(iter(entries))!r} is a placeholder: this model's "
                "parameters were partitioned by an infinity engine that is closed, so their values are gone. "
                f"Save before engine.close(): {WORKING_CALLS}"
            )
        full_values(engine, entries, params)
        state_dict.update(entries)


def _is_peft_model(module: nn.Module) -> bool:
    peft = sys.modules.get("peft")  # imported by whoever built a PEFT model
    return peft is not None and isinstance(module, peft.PeftModel)


def _is_transformers_model(module: nn.Module) -> bool:
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(module, tf.PreTrainedModel)


class ModelSaving:
    """What ``initialize`` installs on the engine's model ([Note: saving a partitioned model])."""

    def __init__(self, engine: EngineToSave):
        self.module = engine.module
        self._engine = weakref.ref(engine)
        self._handles: list[Any] = []
        self._overrides: list[str] = []
        rt = engine.runtime
        if rt.param_store is None:
            return  # stages 0-2: state_dict and save_pretrained see the whole parameters already
        for mod in self.module.modules():
            own = [
                (name, p, p_unit[0].layout.slots[p_unit[1]].shape)
                for name, p in mod.named_parameters(recurse=False, remove_duplicate=False)
                if (p_unit := rt.unit_map.unit_of.get(p)) is not None
            ]
            if own:
                self._handles.append(mod.register_state_dict_post_hook(_StateDictHook(engine, own)))
        save: Callable[..., Any] | None = None
        if _is_peft_model(self.module):
            save = self._peft_save_pretrained
        elif _is_transformers_model(self.module):
            save = self._transformers_save_pretrained
        if save is not None:
            self.module.__dict__["save_pretrained"] = (
                save  # shadows the class's method on this model only
            )
            self._overrides.append("save_pretrained")

    def close(self) -> None:
        """Removes the save_pretrained replacements; the state_dict hooks stay, refusing placeholders."""
        for name in self._overrides:
            self.module.__dict__.pop(name, None)
        self._overrides = []

    def engine(self) -> EngineToSave:
        engine = self._engine()
        if engine is None or engine.closed:
            raise RuntimeError(
                f"the infinity engine of this model is closed; save before engine.close(): "
                f"{WORKING_CALLS}"
            )
        return engine

    def _transformers_save_pretrained(
        self,
        save_directory: str | os.PathLike,
        is_main_process: bool = True,
        state_dict: dict | None = None,
        push_to_hub: bool = False,
        max_shard_size: int | str = "50GB",
        variant: str | None = None,
        token: Any = None,
        save_peft_format: bool = True,
        save_original_format: bool = True,
        distributed_checkpoint: bool = False,
        **kwargs: Any,
    ) -> None:
        """``PreTrainedModel.save_pretrained``, streamed by ``engine.save_16bit_model`` (Hugging Face layout)."""
        module: Any = self.module  # a PreTrainedModel: transformers' methods, unknown to nn.Module
        cls_save = type(module).save_pretrained
        if state_dict is not None or getattr(module, "_hf_peft_config_loaded", False):
            # The caller's own dict, or transformers' adapters (which save their own part): transformers
            # writes it; model.state_dict() gathers what it reads.
            return cls_save(
                module,
                save_directory,
                is_main_process=is_main_process,
                state_dict=state_dict,
                push_to_hub=push_to_hub,
                max_shard_size=max_shard_size,
                variant=variant,
                token=token,
                save_peft_format=save_peft_format,
                save_original_format=save_original_format,
                distributed_checkpoint=distributed_checkpoint,
                **kwargs,
            )
        refused = {
            "push_to_hub": push_to_hub,
            "variant": variant,
            "distributed_checkpoint": distributed_checkpoint,
            "save_original_format": not save_original_format,
        }
        kwargs.pop("safe_serialization", None)  # transformers 5 writes safetensors whatever it says
        asked = [k for k, v in refused.items() if v] + sorted(kwargs)
        if asked:
            raise ValueError(
                f"save_pretrained({', '.join(asked)}=...) on a model trained by an infinity engine: the weights are "
                "streamed from the engine's shards by engine.save_16bit_model, which writes the default layout "
                "only. Call model.save_pretrained(dir) (max_shard_size= is honoured), then upload the folder "
                "(huggingface_hub.upload_folder) or convert it as needed"
            )
        if os.path.isfile(save_directory):
            raise ValueError(f"Provided path ({save_directory}) should be a directory, not a file")
        self.engine().save_16bit_model(save_directory, layout="hf", max_shard_size=max_shard_size)
        return None

    def _peft_save_pretrained(
        self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any
    ) -> None:
        """``PeftModel.save_pretrained``: PEFT's own code, on a state dict whose kept tensors only are gathered."""
        # A PeftModel: PEFT's methods and attributes, unknown to nn.Module.
        module: Any = self.module
        cls_save = type(module).save_pretrained
        if kwargs.get("state_dict") is not None:
            return cls_save(module, save_directory, *args, **kwargs)
        import inspect

        bound = inspect.signature(cls_save).bind(module, save_directory, *args, **kwargs)
        bound.apply_defaults()
        selected = bound.arguments.get("selected_adapters") or list(module.peft_config)
        embeddings = bound.arguments.get("save_embedding_layers", "auto")
        kwargs["state_dict"] = self.peft_state_dict(selected, embeddings)
        return cls_save(module, save_directory, *args, **kwargs)

    def peft_state_dict(
        self, adapters: list[str], save_embedding_layers: Any
    ) -> dict[str, torch.Tensor]:
        """The model's state dict with the tensors PEFT keeps for ``adapters`` gathered and every other
        parameter a meta tensor of its true shape (what PEFT drops is never gathered)."""
        from peft.utils import get_peft_model_state_dict

        engine = self.engine()
        # A PeftModel: PEFT's methods and attributes, unknown to nn.Module.
        module: Any = self.module
        live = module.state_dict(keep_vars=True)
        shapes = {
            p: unit.layout.slots[slot].shape
            for p, (unit, slot) in engine.runtime.unit_map.unit_of.items()
        }
        probe = {
            k: (
                torch.empty(shapes.get(v, v.shape), dtype=v.dtype, device="meta")
                if isinstance(v, nn.Parameter)
                else v.detach()
            )
            for k, v in live.items()
        }
        kept: set[int] = set()
        for name in adapters:
            if name not in module.peft_config:
                return probe  # PEFT's own call names the bad adapter
            out = get_peft_model_state_dict(
                module,
                state_dict=probe,
                adapter_name=name,
                save_embedding_layers=save_embedding_layers,
            )
            kept |= {id(v) for v in out.values()}
        known = {id(v) for v in probe.values()}
        if not kept <= known:  # PEFT made tensors of its own from the probe: give it every value
            log.warning(
                "PEFT's selection made new tensors from the state dict; save_pretrained gathers the whole "
                "model to give it"
            )
            return gathered_state_dict(engine)
        keys = [k for k, v in probe.items() if id(v) in kept]
        return {**probe, **gathered_state_dict(engine, keys)}


def save_pretrained(engine: EngineToSave, save_directory: str | os.PathLike, **kwargs: Any) -> Path:
    """The engine's model saved as its framework saves it: a PEFT model's adapters (PEFT's files), a
    transformers model's Hugging Face folder (streamed), any other module's ``model.safetensors`` (every
    state_dict name, streamed). Returns the directory."""
    module = engine.module
    if _is_peft_model(module) or _is_transformers_model(module):
        framework_model: Any = module  # its save_pretrained is transformers' or PEFT's
        save = module.__dict__.get("save_pretrained") or framework_model.save_pretrained
        save(save_directory, **kwargs)
        return Path(save_directory)
    if kwargs:
        raise TypeError(
            f"engine.save_pretrained() of a {type(module).__name__} (not a transformers or PEFT model) "
            f"takes only the directory, not {sorted(kwargs)}"
        )
    Path(save_directory).mkdir(parents=True, exist_ok=True)
    engine.save_16bit_model(save_directory, layout="state_dict")
    return Path(save_directory)
