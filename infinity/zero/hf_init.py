"""from_pretrained under zero.Init: the checkpoint streamed straight into the shards, as load_pretrained does.

[Note: from_pretrained under zero.Init]
``with infinity.zero.Init(cfg): AutoModelForCausalLM.from_pretrained(dir)``
is what transformers runs under DeepSpeed ZeRO-3. transformers (5.x) takes
its DeepSpeed path only when ``deepspeed`` itself is configured; otherwise it
builds the model on the meta device and loads the state dict into it whole.
Under zero.Init that second path is taken, and:
1. each meta parameter, as its module is registered, is replaced by a
   partitioned stand-in (zeros at rest; init.py's ``_replace_meta``);
2. ``PreTrainedModel._load_pretrained_model`` (private, static) is replaced
   while a zero.Init context is open: for a model whose parameters are in a
   zero.Init store and safetensors files, the parameters still being built
   are partitioned, and ``load_pretrained`` streams the files into the shards
   (each rank its own slice; persistent buffers read in place); loaded tensors
   get transformers' ``_is_hf_initialized`` flag, and the result is returned
   as transformers' ``LoadStateDictInfo``, so that ``_finalize_model_loading``
   initialises the missing weights (through zero.Init's torch function mode,
   as during construction), ties weights and reports as it always does;
3. ``PreTrainedModel._move_missing_keys_from_meta_to_device`` (private) is
   given only the missing keys that are not partitioned stand-ins (it would
   replace them with new, empty parameters).
Anything else (a state_dict given, ``.bin`` files, a quantised model) goes to
transformers' own code unchanged or is refused naming what to do. The patch
is on the class while a zero.Init context is open, and is a passthrough for
any model not built under it.

The private transformers API relied on (5.23): ``PreTrainedModel.
_load_pretrained_model(model, state_dict, checkpoint_files, load_config,
expected_keys=None) -> (LoadStateDictInfo, disk_offload_index)``,
``PreTrainedModel._move_missing_keys_from_meta_to_device(missing_keys,
device_map, device_mesh, hf_quantizer)``, ``transformers.utils.
loading_report.LoadStateDictInfo``'s fields, ``load_config.is_quantized``,
and the ``_is_hf_initialized`` flag.

Threading: the thread that builds the model (as zero.Init).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from infinity.zero.gathered import PARAM_OWNERS
from infinity.zero.init import InitStore


class TransformersLoadPatch:
    """transformers' two loading functions replaced while a zero.Init context is open (``with``).

    The patch is on the class, so it is process-wide while it lasts; the context that applied it
    owns it and restores the originals (a nested context finds it applied and leaves it alone:
    contexts close innermost first). Without transformers imported it does nothing.
    """

    _PATCHED = "_infinity_zero_init_patch"  # marks the replacement functions

    def __init__(self) -> None:
        self._restore: tuple[Any, dict[str, Any]] | None = None  # (the class, its originals)

    def __enter__(self) -> TransformersLoadPatch:
        tf = sys.modules.get("transformers")
        if tf is None:
            return self
        cls = tf.PreTrainedModel
        if getattr(cls.__dict__["_load_pretrained_model"], self._PATCHED, False):
            return self  # an outer context's patch
        originals = {
            name: cls.__dict__[name]
            for name in ("_load_pretrained_model", "_move_missing_keys_from_meta_to_device")
        }
        load = originals["_load_pretrained_model"].__func__
        move = originals["_move_missing_keys_from_meta_to_device"]

        def _load_pretrained_model(
            model, state_dict, checkpoint_files, load_config, expected_keys=None
        ):
            store = _store_of(model)
            if store is None or getattr(load_config, "is_quantized", False):
                return load(model, state_dict, checkpoint_files, load_config, expected_keys)
            return _load_into_shards(model, store, state_dict, checkpoint_files)

        def _move_missing_keys_from_meta_to_device(self, missing_keys, *args, **kwargs):
            store = _store_of(self)
            if store is not None:
                missing_keys = {k for k in missing_keys if not _partitioned(self, k, store)}
            return move(self, missing_keys, *args, **kwargs)

        load_patch = staticmethod(_load_pretrained_model)
        setattr(load_patch, self._PATCHED, True)
        cls._load_pretrained_model = load_patch
        cls._move_missing_keys_from_meta_to_device = _move_missing_keys_from_meta_to_device
        self._restore = (cls, originals)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._restore is not None:
            cls, originals = self._restore
            self._restore = None
            for name, value in originals.items():
                setattr(cls, name, value)


def _store_of(model: nn.Module) -> InitStore | None:
    for p in model.parameters():
        owner = PARAM_OWNERS.owner_of(p)
        if isinstance(owner, InitStore) and owner.building:
            return owner
    return None


def _partitioned(model: Any, key: str, store: InitStore) -> bool:
    # model: a transformers PreTrainedModel (get_parameter_or_buffer is its method)
    try:
        t = model.get_parameter_or_buffer(key)
    except AttributeError:
        return False
    return isinstance(t, nn.Parameter) and t in store


def _load_into_shards(
    model: nn.Module, store: InitStore, state_dict: Any, checkpoint_files: Any
) -> Any:
    from transformers.utils.loading_report import LoadStateDictInfo

    from infinity.zero.pretrained import load_pretrained

    name = type(model).__name__
    if state_dict is not None:
        raise ValueError(
            f"{name}.from_pretrained(state_dict=...) under infinity.zero.Init: a state dict is "
            "already whole in memory; save it with save_pretrained and load the directory, or "
            "build the model under zero.Init and load it after initialize"
        )
    files = [Path(f) for f in checkpoint_files or []]
    if not files or any(f.suffix != ".safetensors" for f in files):
        raise ValueError(
            f"{name}.from_pretrained under infinity.zero.Init reads safetensors checkpoints; "
            f"{', '.join(map(str, files)) or 'no file'} is not one: convert it (save_pretrained "
            "writes safetensors)"
        )
    store.settle()
    _materialize_meta_buffers(model)
    path: str | os.PathLike = files[0] if len(files) == 1 else files[0].parent
    with store.loading():
        result = load_pretrained(model, path, strict=False)
    missing = set(result.missing_keys)
    for key, t in model.state_dict(keep_vars=True).items():
        if key not in missing:
            t._is_hf_initialized = True
    return LoadStateDictInfo(
        missing_keys=missing,
        unexpected_keys=set(result.unexpected_keys),
        mismatched_keys=set(),
        error_msgs=[],
        conversion_errors={},
        skipped_pp_keys=set(),
    ), None


def _materialize_meta_buffers(model: nn.Module) -> None:
    """Persistent buffers still on the meta device get CPU memory for the checkpoint's values (those
    the checkpoint lacks transformers then initialises, as missing keys)."""
    persistent = set(model.state_dict(keep_vars=True))
    for mname, module in model.named_modules():
        for bname, b in list(module._buffers.items()):
            key = f"{mname}.{bname}" if mname else bname
            if b is not None and b.is_meta and key in persistent:
                module._buffers[bname] = torch.empty(b.shape, dtype=b.dtype, device="cpu")
