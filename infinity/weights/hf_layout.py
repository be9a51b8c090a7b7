"""The Hugging Face weights layout: what ``from_pretrained`` reads and ``save_pretrained`` writes.

- Files: ``model.safetensors``, or shards ``model-00001-of-0000N.safetensors``
  listed by ``model.safetensors.index.json`` (``{"metadata": {"total_size":
  ...}, "weight_map": {tensor name: file}}``); ``config.json`` beside them.
  Never pickle (``pytorch_model.bin`` is refused, naming the conversion).
  ``checkpoint_tensors`` reads every file's header and checks the index
  against them: each tensor in one file, the one the index names.
- Shard sizes: ``max_shard_size`` in bytes or as huggingface_hub writes it
  (``"5GB"``: KB/MB/GB/TB decimal; KiB/MiB/GiB/TiB binary accepted too),
  split as ``split_torch_state_dict_into_shards`` does: tensors in order, a
  new shard when the next would pass the limit, a larger tensor alone.
- Tensor names (``HfNames``): a model's ``state_dict`` names, with what
  transformers does on top for its own models. Saving writes one name per
  tied parameter (not the one ``all_tied_weights_keys`` names as a tie
  target), leaves out ``_keys_to_ignore_on_save`` and reverts HF's renamings
  (GPT-NeoX's ``lm_head`` is written ``embed_out``). Loading applies the
  renamings, then the base-model prefix rule of
  ``transformers.core_model_loading.rename_source_key`` (a checkpoint of
  ``LlamaModel`` loads into ``LlamaForCausalLM`` and back), and does not
  report keys matching ``_keys_to_ignore_on_load_missing`` /
  ``_keys_to_ignore_on_load_unexpected``. Conversions that merge or split
  tensors (``WeightConverter``: fused MoE experts) cannot be streamed a tensor
  at a time and are refused, naming the key.

transformers is imported only for a model whose class comes from it (it is
then already imported); other models get plain ``state_dict`` names.

Threading: none (pure functions and immutable records).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from infinity.weights.reader import FileTensor, file_tensors

WEIGHTS_NAME = "model.safetensors"
INDEX_SUFFIX = ".index.json"
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
_SHARD = re.compile(r"(?P<stem>.*)-\d{5}-of-\d{5}\.safetensors\Z")

_SIZE_UNITS = {
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}


def parse_size(value: int | str, *, what: str = "max_shard_size") -> int:
    """Bytes from an int or a string like "5GB" / "500MB" / "1.5GiB" (huggingface_hub's units, decimal)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(
            f"{what} must be a number of bytes or a string like '5GB', got {type(value).__name__}"
        )
    if isinstance(value, int):
        nbytes = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B)\s*", value, flags=re.IGNORECASE)
        if m is None:
            raise ValueError(
                f"{what}={value!r} is not a size: write bytes as an int or a number with a unit, "
                "like '5GB' or '500MB' (KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB of 1024)"
            )
        nbytes = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])
    if nbytes <= 0:
        raise ValueError(f"{what}={value!r} must be positive")
    return nbytes


def split_shards(sizes: Sequence[tuple[str, int]], max_nbytes: int) -> list[list[str]]:
    """Names grouped into shards in order, as huggingface_hub's split_torch_state_dict_into_shards does."""
    shards: list[list[str]] = []
    current: list[str] = []
    fill = 0
    for name, nbytes in sizes:
        if nbytes > max_nbytes:
            shards.append([name])
            continue
        if current and fill + nbytes > max_nbytes:
            shards.append(current)
            current, fill = [], 0
        current.append(name)
        fill += nbytes
    if current:
        shards.append(current)
    return shards


def shard_file_names(weights_name: str, count: int) -> list[str]:
    """``model.safetensors`` alone, or ``model-00001-of-0000N.safetensors`` ... (HF's pattern)."""
    if count == 1:
        return [weights_name]
    stem = weights_name.removesuffix(".safetensors")
    return [f"{stem}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def index_name(weights_name: str) -> str:
    return weights_name + INDEX_SUFFIX


def index_json(
    weight_map: dict[str, str], total_nbytes: int, *, total_parameters: int | None = None
) -> str:
    """The index file's text, as save_pretrained writes it (keys sorted)."""
    metadata: dict[str, int] = {"total_size": total_nbytes}
    if total_parameters is not None:
        metadata["total_parameters"] = total_parameters
    return (
        json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2, sort_keys=True)
        + "\n"
    )


def stale_files(directory: Path, weights_name: str, written: Iterable[str]) -> list[Path]:
    """Weight files of an earlier save in ``directory`` that this one did not write (another shard
    count, a single file where there are now shards, or the index of shards no longer there):
    from_pretrained would read them."""
    keep = set(written)
    stem = weights_name.removesuffix(".safetensors")
    out = []
    for f in sorted(directory.iterdir()):
        if f.name in keep or not f.is_file():
            continue
        m = _SHARD.fullmatch(f.name)
        if f.name in (weights_name, index_name(weights_name)) or (
            m is not None and m.group("stem") == stem
        ):
            out.append(f)
    return out


def checkpoint_files(path: str | os.PathLike) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a checkpoint (a directory in HF's layout, or one .safetensors file),
    and the index's weight map (tensor name -> file name) where there is one."""
    path = Path(path)
    if path.is_file():
        if path.name.endswith(INDEX_SUFFIX):
            return _indexed(path)
        if path.suffix != ".safetensors":
            raise ValueError(
                f"'{path}' is not a .safetensors file; give a directory saved by save_pretrained or "
                "a .safetensors file (pickle checkpoints are not read: convert them with safetensors' "
                "convert script or save_pretrained(..., safe_serialization=True))"
            )
        return [path], None
    if not path.is_dir():
        raise FileNotFoundError(
            f"'{path}' does not exist; give the directory save_pretrained wrote"
        )
    single, index = path / WEIGHTS_NAME, path / index_name(WEIGHTS_NAME)
    if single.is_file():
        return [single], None
    if index.is_file():
        return _indexed(index)
    pickled = [f.name for f in path.glob("pytorch_model*.bin")]
    hint = (
        (
            f" (it holds {pickled[0]}, a pickle checkpoint, which is not read: load it once in plain PyTorch and "
            "save_pretrained it with safe_serialization=True)"
        )
        if pickled
        else ""
    )
    raise FileNotFoundError(f"'{path}' has neither {WEIGHTS_NAME} nor {index.name}{hint}")


def checkpoint_tensors(path: str | os.PathLike) -> dict[str, FileTensor]:
    """Every tensor of a checkpoint (``checkpoint_files``) by name, each file's header checked, each
    tensor in one file only, and the index's weight map (where there is one) checked against the files."""
    files, weight_map = checkpoint_files(path)
    tensors: dict[str, FileTensor] = {}
    for f in files:
        for name, t in file_tensors(f).items():
            if name in tensors:
                raise ValueError(
                    f"tensor {name!r} is in both '{tensors[name].path}' and '{f}': a checkpoint holds "
                    "each tensor once; remove the stale shard"
                )
            tensors[name] = t
    if weight_map is not None:
        for name, file in weight_map.items():
            held = tensors.get(name)
            if held is None or held.path.name != file:
                where = f"'{held.path.name}'" if held is not None else "no shard"
                raise ValueError(
                    f"the index of '{path}' puts tensor {name!r} in '{file}', but {where} holds it: the "
                    "checkpoint is incomplete or mixes two saves; save it again"
                )
    return tensors


def _indexed(index: Path) -> tuple[list[Path], dict[str, str]]:
    try:
        doc = json.loads(index.read_text())
        weight_map = doc["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise TypeError("weight_map is not an object of file names")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"'{index}' is not a safetensors index ({e}); it needs a \"weight_map\" of tensor name "
            "to file name, as save_pretrained writes it"
        ) from None
    files: list[Path] = []
    for name in dict.fromkeys(weight_map.values()):
        f = index.parent / name
        if Path(name).name != name:
            raise ValueError(f"'{index}' names the file {name!r}, which is not in its directory")
        if not f.is_file():
            raise FileNotFoundError(
                f"'{index}' names the shard {name!r}, which is missing from '{index.parent}'"
            )
        files.append(f)
    return files, weight_map


# -- tensor names --------------------------------------------------------------


def _transformers_model(model: nn.Module) -> Any:
    """``model`` if it is a transformers PreTrainedModel, else None (never imports transformers)."""
    tf = sys.modules.get("transformers")
    if tf is None:
        return None
    base = getattr(tf, "PreTrainedModel", None)
    return model if base is not None and isinstance(model, base) else None


def hf_config(model: nn.Module) -> Any:
    """The model's transformers config (what ``config.json`` is written from), or None."""
    hf = _transformers_model(model)
    return hf.config if hf is not None else None


@dataclasses.dataclass(frozen=True)
class HfNames:
    """How a model's ``state_dict`` names map to the names in its HF weight files (module docstring)."""

    model_names: frozenset[str]
    base_model_prefix: str = ""
    tie_targets: frozenset[str] = frozenset()
    ignore_on_save: frozenset[str] = frozenset()
    ignore_missing: tuple[
        str, ...
    ] = ()  # regular expressions, matched with re.search as transformers does
    ignore_unexpected: tuple[str, ...] = ()
    load_renamings: tuple[Any, ...] = ()  # transformers WeightRenaming / WeightConverter objects
    load_converters: tuple[Any, ...] = ()
    save_renamings: tuple[Any, ...] = ()
    save_converters: tuple[Any, ...] = ()

    @classmethod
    def of(cls, model: nn.Module) -> HfNames:
        names = frozenset(model.state_dict(keep_vars=True))
        hf = _transformers_model(model)
        if hf is None:
            return cls(names)
        load, save = _conversions(hf)
        return cls(
            names,
            base_model_prefix=hf.base_model_prefix or "",
            tie_targets=frozenset(getattr(hf, "all_tied_weights_keys", None) or ()),
            ignore_on_save=frozenset(hf._keys_to_ignore_on_save or ()),
            ignore_missing=tuple(hf._keys_to_ignore_on_load_missing or ()),
            ignore_unexpected=tuple(hf._keys_to_ignore_on_load_unexpected or ()),
            load_renamings=load[0],
            load_converters=load[1],
            save_renamings=save[0],
            save_converters=save[1],
        )

    def model_name(self, file_name: str) -> str | None:
        """The state_dict name a file's tensor loads into (None: none; the caller reports it unexpected),
        by transformers' rule: the renamings, then the base-model prefix added or removed where that
        names a key of the model; a key the renamings lead astray but the model has is kept."""
        name = self._with_prefix(
            self._rename(file_name, self.load_renamings, self.load_converters, reverse=False)
        )
        if name not in self.model_names and file_name in self.model_names:
            name = self._with_prefix(file_name)
        return name if name in self.model_names else None

    def _with_prefix(self, name: str) -> str:
        prefix = self.base_model_prefix
        if prefix:
            if name.startswith(prefix + ".") and name[len(prefix) + 1 :] in self.model_names:
                return name[len(prefix) + 1 :]  # a ForXxx checkpoint into the base model
            if f"{prefix}.{name}" in self.model_names:
                return f"{prefix}.{name}"  # a base-model checkpoint into ForXxx
        return name

    def file_name(self, model_name: str) -> str:
        """The name save_pretrained writes for a state_dict name."""
        return self._rename(model_name, self.save_renamings, self.save_converters, reverse=True)

    def saved(self, aliases: Sequence[str]) -> str | None:
        """Which of a tensor's state_dict names (tied parameters have several) is written, or None."""
        kept = [a for a in aliases if a not in self.ignore_on_save]
        if not kept:
            return None
        untied = [a for a in kept if a not in self.tie_targets]
        return (untied or kept)[0]

    def is_ignored_missing(self, name: str) -> bool:
        return any(re.search(pat, name) for pat in self.ignore_missing)

    def is_ignored_unexpected(self, name: str) -> bool:
        return any(re.search(pat, name) for pat in self.ignore_unexpected)

    @staticmethod
    def _rename(
        name: str, renamings: Sequence[Any], converters: Sequence[Any], *, reverse: bool
    ) -> str:
        if not renamings and not converters:
            return name
        from transformers.core_model_loading import rename_source_key

        renamed, converter = rename_source_key(
            name, list(renamings), list(converters), reverse=reverse
        )
        if converter is not None:
            raise ValueError(
                f"tensor {name!r} goes through a transformers weight conversion ({converter!r}) that "
                f"{'splits' if reverse else 'merges'} tensors; infinity streams one tensor at a time and cannot apply "
                "it: load or save this model with transformers' own from_pretrained / save_pretrained in plain "
                "PyTorch, or (saving) pass the state_dict names through with a non-Hugging Face layout"
            )
        return renamed


def _conversions(
    hf: Any,
) -> tuple[tuple[tuple[Any, ...], tuple[Any, ...]], tuple[tuple[Any, ...], tuple[Any, ...]]]:
    """((load renamings, load converters), (save renamings, save converters)) as transformers' loading
    (``get_model_conversion_mapping``) and saving (``revert_weight_conversion``) use them."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming
    except (
        ImportError
    ):  # transformers before v5: no conversion mapping, state_dict names throughout
        return ((), ()), ((), ())

    def split(transforms: Iterable[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        transforms = list(transforms)
        return (
            tuple(t for t in transforms if isinstance(t, WeightRenaming)),
            tuple(t for t in transforms if isinstance(t, WeightConverter)),
        )

    load = get_model_conversion_mapping(hf)
    used = getattr(
        hf, "_weight_conversions", None
    )  # those from_pretrained applied, if it built the model
    if used is None:
        used = [
            t
            for t in get_model_conversion_mapping(hf, add_legacy=False)
            if not isinstance(t, PrefixChange)
        ]
    save = [t.reverse_transform() for t in used[::-1]]
    return split(load), split(save)


def names_from_config(directory: Path, state_names: set[str]) -> tuple[HfNames, Any, str]:
    """(HfNames, config, class name) of the transformers model ``directory/config.json`` describes and
    whose ``state_dict`` names are ``state_names``: the class its ``architectures`` names, else the one of
    transformers' auto classes for its model type that has exactly these names (a config saved by
    ``config.save_pretrained`` records no class). Candidates are built on the meta device: nothing is
    allocated."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory)
    tried = []
    for name in dict.fromkeys(
        [*(getattr(config, "architectures", None) or []), *_auto_classes(config.model_type)]
    ):
        cls = getattr(transformers, name, None)
        if cls is None:
            continue
        try:
            with torch.device("meta"):
                model = cls(copy.deepcopy(config))
        except Exception:  # a head this config cannot build (missing fields): not the model
            continue
        if set(model.state_dict(keep_vars=True)) == state_names:
            return HfNames.of(model), config, name
        tried.append(name)
    raise ValueError(
        f"no transformers model class for '{directory / CONFIG_NAME}' (model type "
        f"{config.model_type!r}) has the checkpoint's tensor names (tried {', '.join(tried) or 'none'}); "
        "give the config.json of the model that was trained (model.save_pretrained records its class)"
    )


def _auto_classes(model_type: str) -> list[str]:
    """The class names transformers' Auto* factories map ``model_type`` to (base model first)."""
    from transformers.models.auto import modeling_auto

    out: list[str] = []
    tables = sorted(
        a for a in dir(modeling_auto) if a.startswith("MODEL_") and a.endswith("_MAPPING_NAMES")
    )
    for attr in ["MODEL_MAPPING_NAMES", *(a for a in tables if a != "MODEL_MAPPING_NAMES")]:
        value = getattr(modeling_auto, attr, {}).get(model_type)
        out += [value] if isinstance(value, str) else list(value or ())
    return out
