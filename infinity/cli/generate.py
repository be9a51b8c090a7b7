"""``infinity generate``: a Hugging Face checkpoint's continuation of a prompt, its weights streamed from NVMe.

    infinity generate --model-dir DIR --prompt "..." [--batch B] [--max-new-tokens N] [--nvme-path P]
                      [--config ds_config.json] [--bits 8|4] [--dtype auto|fp32|bf16|fp16]

Loads DIR (a ``save_pretrained`` directory: config.json, safetensors, a
tokenizer) with infinity.inference.from_pretrained (zero.Init + zero.load_pretrained) into the NVMe store
(zero.Init, one module at a time), builds the inference engine
(infinity.initialize with no optimizer) and runs greedy generation on
``--batch`` copies of the prompt. A progress line on stderr shows tokens/s,
GB/s read from NVMe and peak RSS; the continuation goes to stdout (once per
distinct row). Exit status 0, or 2 for bad arguments or a directory it
cannot read. Registered in infinity.cli.main.COMMANDS.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from infinity.config import ConfigError
from infinity.host import peak_resident_host_nbytes

NAME = "generate"
HELP = "generate from a Hugging Face checkpoint directory with its weights streamed from NVMe"

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", required=True, metavar="DIR",
                   help="a save_pretrained directory: config.json, model.safetensors (or shards), a tokenizer")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--batch", type=int, default=1, help="copies of the prompt generated at once (default 1)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per sequence (default 32)")
    p.add_argument("--nvme-path", default="infinity_nvme", metavar="PATH",
                   help="where the weights' swap files go when --config names none (default ./infinity_nvme)")
    p.add_argument("--config", metavar="JSON", help="DeepSpeed-style config (stage 3, no optimizer); "
                   "default: the weights on NVMe at --nvme-path, none kept in host memory")
    p.add_argument("--bits", type=int, choices=(8, 4),
                   help="store the weights group-quantised (weight_quantization, groups of 64)")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                   help="the weights' dtype (default: config.json's, else fp32)")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def engine_config(args: argparse.Namespace) -> dict[str, Any]:
    if args.config:
        try:
            cfg = json.loads(Path(args.config).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read --config {args.config!r}: {e}") from None
    else:
        cfg = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": args.nvme_path,
                                                                   "max_in_cpu": 0}}}
    if args.bits:
        cfg["weight_quantization"] = {"quantized_initialization": {"num_bits": args.bits, "group_size": 64}}
    if not args.config:
        Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    return cfg


class Progress:
    """A transformers streamer: after each new token, one line on stderr with the rate and what was read."""

    def __init__(self, engine: Any, total: int, *, batch: int, enabled: bool, stream: Any = None):
        self.engine, self.total, self.batch, self.enabled = engine, total, batch, enabled
        self.stream = stream or sys.stderr
        self.steps = -1  # the first put() is the prompt
        self.t0 = time.perf_counter()
        self.read0 = engine.io_stats()["read_nbytes"]

    def put(self, value: torch.Tensor) -> None:
        self.steps += 1
        if self.enabled and self.steps > 0:
            self.stream.write("\r" + self.line())
            self.stream.flush()

    def end(self) -> None:
        if self.enabled:  # the last put() drew the final line
            self.stream.write(("\r" + self.line() if self.steps <= 0 else "") + "\n")
            self.stream.flush()

    def line(self) -> str:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        read = self.engine.io_stats()["read_nbytes"] - self.read0
        done = min(self.steps, self.total)
        bar = "#" * (20 * done // max(1, self.total))
        return (f"[{bar:<20}] {done}/{self.total} tokens, {done * self.batch / dt:.1f} tok/s, "
                f"{read / dt / 1e9:.2f} GB/s read, peak RSS {peak_resident_host_nbytes() / 2**30:.2f} GiB")


def run(args: argparse.Namespace) -> int:
    import infinity
    from infinity.inference.pretrained import from_pretrained

    if args.batch < 1 or args.max_new_tokens < 1:
        print("infinity generate: --batch and --max-new-tokens must be at least 1", file=sys.stderr)
        return 2
    # AutoTokenizer makes an empty tokenizer from a config alone: ask for its files first
    if not any((Path(args.model_dir) / f).is_file() for f in TOKENIZER_FILES):
        print(f"infinity generate: cannot read a tokenizer from {args.model_dir}: it has none of "
              f"{', '.join(TOKENIZER_FILES)} (save the tokenizer with save_pretrained beside the model)",
              file=sys.stderr)
        return 2
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        print(f"infinity generate: cannot read a tokenizer from {args.model_dir}: {e}", file=sys.stderr)
        return 2
    enc = tokenizer([args.prompt] * args.batch, return_tensors="pt")
    if enc["input_ids"].shape[1] == 0:
        print("infinity generate: the prompt encodes to no tokens", file=sys.stderr)
        return 2
    try:
        cfg = engine_config(args)
        model = from_pretrained(args.model_dir, cfg, dtype=DTYPES.get(args.dtype))
        engine = infinity.initialize(model, cfg)
    except (ConfigError, ValueError, KeyError, OSError) as e:
        print(f"infinity generate: {e}", file=sys.stderr)
        return 2
    try:
        if not isinstance(engine, infinity.InferenceEngine):
            print("infinity generate: the config makes an optimizer (a training engine); drop its optimizer "
                  "section", file=sys.stderr)
            return 2
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        progress = Progress(engine, args.max_new_tokens, batch=args.batch, enabled=not args.no_progress)
        out = engine.generate(enc["input_ids"], attention_mask=enc["attention_mask"], do_sample=False,
                              max_new_tokens=args.max_new_tokens, pad_token_id=pad, streamer=progress)
        stats = engine.last_generation
    finally:
        engine.close()
    prompt_len = enc["input_ids"].shape[1]
    texts = tokenizer.batch_decode(out[:, prompt_len:], skip_special_tokens=True)
    for text in dict.fromkeys(texts):  # greedy: the copies agree; each distinct one once
        print(text)
    print(f"{stats.summary()}; peak RSS {peak_resident_host_nbytes() / 2**30:.2f} GiB", file=sys.stderr)
    return 0
