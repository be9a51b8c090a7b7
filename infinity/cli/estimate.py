"""``infinity estimate``: per-rank memory and NVMe for every stage × offload setting, and what fits here.

    infinity estimate --params 13e9 | --model-config config.json [--nodes 1] [--gpus-per-node 1]
                      [--config ds_config.json] [--micro-batch 1 --seq 2048] [--json]
    infinity estimate --inference --params 7e9 [--batch 8 --prompt 128 --gen 16] [--config ...] [--json]
    infinity estimate --model-config config.json --lora 16 [--lora-targets q_proj,v_proj] [--config ...]
    infinity estimate --largest-base [--lora 16] [--host-memory 4GiB] [--nvme-space 100GiB] [--config ...]

Prints the table (or, with --json, the whole estimate as JSON) from
infinity.estimate.estimate_memory; with --inference, the plan of generation
with the weights streamed from NVMe (estimate_inference: weights, KV cache,
working memory) and the largest batch that fits; with --lora, the model wrapped in
PEFT's LoRA adapters (infinity.estimate.lora: the base frozen as the run freezes
it) and what the plan holds for the frozen base and the adapters; with
--largest-base, a family of real Llama shapes each estimated the same way and the
largest that fits the budget (infinity.estimate.largest). Exit status 0, or 2 for
bad arguments.
Registered in infinity.cli.main.COMMANDS (NAME, HELP, add_arguments, run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from infinity.config import ConfigError
from infinity.estimate import EstimateOptions, estimate_memory
from infinity.estimate.largest import LLAMA_FAMILY, Budget, largest_base
from infinity.estimate.lora import lora_footprint, with_lora
from infinity.inference import estimate_inference
from infinity.measure.sizes import names_arg, size_arg
from infinity.models import GPTConfig

_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """'13e9', '13B', '150M', '1.5e9' -> a parameter count."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", text)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"not a parameter count: {text!r} (examples: 13e9, 13B, 150M)"
        )
    n = float(m.group(1)) * _SUFFIX.get(m.group(2).lower(), 1)
    if n < 1:
        raise argparse.ArgumentTypeError(f"a parameter count must be at least 1; got {text!r}")
    return n


def read_model_config(path: str) -> nn.Module | GPTConfig:
    """--model-config: a Hugging Face config.json (it names its ``model_type``) is built as the real
    model on the meta device (nothing allocated) for any architecture transformers knows; a JSON of
    GPTConfig's fields is infinity's GPT of exactly that shape."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise ValueError(f"cannot read --model-config {path!r}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--model-config {path!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--model-config {path!r} must hold a JSON object")
    if "model_type" in data:
        return _transformers_model(path)
    fields = set(GPTConfig.__dataclass_fields__)
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(
            f'--model-config {path!r} is neither a Hugging Face config.json (it has no "model_type") nor '
            f"infinity GPT's shape: unknown keys {', '.join(unknown)} (GPTConfig fields: {', '.join(sorted(fields))})"
        )
    missing = {"n_layer", "d_model", "n_head"} - set(data)
    if missing:
        raise ValueError(
            f"--model-config {path!r} lacks {', '.join(sorted(missing))} (GPTConfig fields: {', '.join(sorted(fields))})"
        )
    try:
        return GPTConfig(**data)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--model-config {path!r}: {e}") from None


def _transformers_model(path: str) -> nn.Module:
    """The model a Hugging Face config.json describes, built by transformers' from_config on the meta
    device: the class its ``architectures`` names when transformers maps the config to it, else a
    causal LM, a sequence-to-sequence LM (T5, BART), or the bare model, the first that takes it."""
    try:
        import transformers
        from transformers.models.auto import modeling_auto as auto
    except ImportError:
        raise ValueError(
            f"--model-config {path!r} is a Hugging Face config.json: building it needs transformers "
            "(pip install transformers)"
        ) from None
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"--model-config {path!r}: transformers cannot read it: {e}") from None
    kinds = (
        (transformers.AutoModelForCausalLM, auto.MODEL_FOR_CAUSAL_LM_MAPPING),
        (transformers.AutoModelForSeq2SeqLM, auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING),
        (transformers.AutoModel, auto.MODEL_MAPPING),
    )
    fitting = [
        (auto_class, mapping[type(config)])
        for auto_class, mapping in kinds
        if type(config) in mapping
    ]
    if not fitting:
        raise ValueError(
            f"--model-config {path!r}: transformers has no model for {type(config).__name__}"
        )
    named = [
        auto_class for auto_class, cls in fitting if cls.__name__ in (config.architectures or ())
    ]
    auto_class = (named or [auto_class for auto_class, _ in fitting])[0]
    with torch.device("meta"):
        return auto_class.from_config(config)


NAME = "estimate"
HELP = "memory and NVMe each ZeRO stage × offload setting needs, and the fastest that fits this machine"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--params", type=parse_count, help="parameter count (13e9, 13B, 150M): a GPT-shaped model"
    )
    p.add_argument(
        "--model-config",
        metavar="JSON",
        help="a Hugging Face config.json (any architecture transformers knows: the real model, built on "
        "the meta device) or GPTConfig's fields",
    )
    p.add_argument("--nodes", type=int, default=1, help="machines (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=1, help="ranks per machine (default 1)")
    p.add_argument(
        "--config", metavar="JSON", help="DeepSpeed-style config: its sizes and precision are kept"
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        help="samples per rank per step (activations; default: the config's)",
    )
    p.add_argument("--seq", type=int, help="sequence length (activations)")
    p.add_argument(
        "--precision", choices=("fp32", "bf16", "fp16"), help="default: the config's, else bf16"
    )
    p.add_argument(
        "--nvme-path",
        nargs="+",
        metavar="PATH",
        help="where NVMe settings swap when the config names no nvme_path (default ./infinity_nvme); "
        "several folders, one per drive, are striped over",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="compute device the plan is for (default: cuda when available)",
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="count activations as with every transformer block checkpointed",
    )
    p.add_argument(
        "--layer-major",
        action="store_true",
        help="training by engine.train_batch in layer-major blocks of micro-batches (the config's "
        'zero_optimization.layer_major.block; "auto": the block with the least NVMe traffic that '
        "fits, shown): a block's activations at once, each array on NVMe moved once per block",
    )
    p.add_argument("--json", action="store_true", help="print the whole estimate as JSON")
    g = p.add_argument_group("LoRA (--lora) and the largest base that fits (--largest-base)")
    g.add_argument(
        "--lora",
        type=int,
        metavar="R",
        help="train LoRA adapters of rank R (lora_alpha 2R) over the frozen model, wrapped by "
        "peft.get_peft_model as a run wraps it; with --config's zero_quantized_nontrainable_weights "
        "and weight_quantization the frozen base is counted packed",
    )
    g.add_argument(
        "--lora-targets",
        type=names_arg,
        metavar="NAMES",
        help="comma-separated module names the adapters go on (default: PEFT's for the "
        "architecture; Llama: q_proj,v_proj)",
    )
    g.add_argument(
        "--largest-base",
        action="store_true",
        help="estimate each of a family of real Llama shapes (1.1B to 70B) and name the largest "
        "that fits the budget (with --lora: its LoRA run, else full fine-tuning)",
    )
    g.add_argument(
        "--host-memory",
        type=size_arg,
        metavar="SIZE",
        help="--largest-base: host memory the run may use (4G, 4GiB; default: what is available "
        "here)",
    )
    g.add_argument(
        "--nvme-space",
        type=size_arg,
        metavar="SIZE",
        help="--largest-base: NVMe space the run may use (default: what is free at the nvme_path)",
    )
    g = p.add_argument_group("inference (--inference)")
    g.add_argument(
        "--inference",
        action="store_true",
        help="estimate generation with the weights streamed from NVMe (stage 3, no optimizer) and "
        "the largest batch that fits, instead of training",
    )
    g.add_argument("--batch", type=int, default=1, help="sequences generated at once (default 1)")
    g.add_argument(
        "--prompt", type=int, default=128, help="prompt tokens per sequence (default 128)"
    )
    g.add_argument("--gen", type=int, default=16, help="new tokens per sequence (default 16)")


def run(args: argparse.Namespace) -> int:
    if args.largest_base:
        return _largest_base(args)
    if args.host_memory is not None or args.nvme_space is not None:
        print(
            "infinity estimate: --host-memory and --nvme-space are --largest-base's",
            file=sys.stderr,
        )
        return 2
    if args.params is None and args.model_config is None:
        print("infinity estimate: give --params (e.g. 13e9) or --model-config", file=sys.stderr)
        return 2
    notes = []
    try:
        model = read_model_config(args.model_config) if args.model_config else None
        if args.lora is not None or args.lora_targets:
            model = _with_lora(args, model)
        # A GPTConfig shapes a count (--params) or is the model; a transformers model is the model.
        model_config = model if isinstance(model, GPTConfig) else None
        subject = model if args.params is None or isinstance(model, nn.Module) else args.params
        if args.nodes < 1 or args.gpus_per_node < 1:
            raise ValueError("--nodes and --gpus-per-node must be at least 1")
        if args.inference:
            if args.lora is not None:
                raise ValueError("--lora estimates training; --inference has no adapters to train")
            if args.nodes * args.gpus_per_node != 1:
                raise ValueError("--inference estimates one rank (--nodes 1 --gpus-per-node 1)")
            if (
                args.micro_batch is not None
                or args.seq is not None
                or args.activation_checkpointing
                or args.layer_major
            ):
                raise ValueError(
                    "--micro-batch, --seq, --activation-checkpointing and --layer-major are training's; "
                    "--inference takes --batch, --prompt and --gen"
                )
            est = estimate_inference(
                subject,
                model_config=model_config,
                config=args.config,
                batch=args.batch,
                prompt=args.prompt,
                gen=args.gen,
                precision=args.precision,
                nvme_path=args.nvme_path,
                device=args.device,
            )
            return _print(est, args, notes, model)
        est = estimate_memory(
            subject,
            model_config=model_config,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            **_run_keywords(args),
        )
    except (ConfigError, ValueError) as e:
        print(f"infinity estimate: {e}", file=sys.stderr)
        return 2
    return _print(est, args, notes, model)


def _run_keywords(args: argparse.Namespace) -> dict[str, Any]:
    """The run the estimate is for (config, batch, precision, disks, device, activations), as both
    estimate_memory and --largest-base's EstimateOptions take it."""
    return dict(
        config=args.config,
        micro_batch=args.micro_batch,
        seq=args.seq,
        precision=args.precision,
        nvme_path=args.nvme_path,
        device=args.device,
        activation_checkpointing=args.activation_checkpointing,
        layer_major=args.layer_major,
    )


def _with_lora(args: argparse.Namespace, model: nn.Module | GPTConfig | None) -> nn.Module:
    """--model-config's model wrapped in LoRA adapters; --params and GPT shapes refused."""
    if args.lora is None:
        raise ValueError("--lora-targets names where --lora R's adapters go: give --lora R too")
    if args.params is not None or not isinstance(model, nn.Module):
        raise ValueError(
            "--lora needs --model-config with a Hugging Face config.json: the adapters target "
            "modules by name, which a parameter count (--params) or a GPT shape does not give"
        )
    return with_lora(model, args.lora, args.lora_targets)


def _largest_base(args: argparse.Namespace) -> int:
    try:
        if args.params is not None or args.model_config is not None or args.inference:
            raise ValueError(
                "--largest-base estimates its own family of Llama shapes: leave out --params, "
                "--model-config and --inference"
            )
        if args.nodes * args.gpus_per_node != 1:
            raise ValueError("--largest-base estimates one rank (--nodes 1 --gpus-per-node 1)")
        if args.lora_targets and args.lora is None:
            raise ValueError("--lora-targets names where --lora R's adapters go: give --lora R too")
        options = EstimateOptions.from_keywords(**_run_keywords(args))
        answer = largest_base(
            LLAMA_FAMILY,
            Budget(args.host_memory, args.nvme_space),
            lora_rank=args.lora,
            lora_targets=args.lora_targets,
            options=options,
        )
    except (ConfigError, ValueError) as e:
        print(f"infinity estimate: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(answer.to_dict(), indent=2, default=str))
    else:
        print(answer.table())
        if args.seq is None and args.micro_batch is None:
            print("note: activations not counted; give --seq (and --micro-batch) to count them")
    return 0


def _print(
    est: Any, args: argparse.Namespace, notes: list[str], model: nn.Module | GPTConfig | None
) -> int:
    if args.params is not None and model is not None:
        rel = abs(est.num_params - args.params) / args.params
        if rel > 0.05:
            notes.append(
                f"--model-config has {est.num_params:,} parameters, {rel:.0%} off --params; it was used"
            )
    lora = None
    if args.lora is not None and est.focus is not None:
        lora = lora_footprint(est.focus.breakdown)
    if args.json:
        out = est.to_dict()
        out["notes"] = notes
        if lora is not None:
            out["lora"] = dataclasses.asdict(lora)
        print(json.dumps(out, indent=2, default=str))
    else:
        print(est.table())
        if lora is not None:
            focus = est.focus
            assert focus is not None
            print(f"\nLoRA r={args.lora}, {focus.setting.label()}:")
            print("\n".join("  " + line for line in lora.lines()))
        for n in notes:
            print(f"note: {n}")
    return 0
