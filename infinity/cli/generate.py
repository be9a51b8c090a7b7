"""``infinity generate``: a Hugging Face checkpoint's continuation of a prompt, its weights streamed from NVMe.

    infinity generate --model-dir DIR --prompt "..." [--batch B] [--max-new-tokens N] [--nvme-path P]
                      [--config ds_config.json] [--bits 8|4] [--dtype auto|fp32|bf16|fp16]
                      [--do-sample [--temperature T] [--top-k K] [--top-p P]] [--seed S]

Loads DIR (a ``save_pretrained`` directory: config.json, safetensors, a
tokenizer) with infinity.inference.from_pretrained (zero.Init + zero.load_pretrained) into the NVMe store
(zero.Init, one module at a time), builds the inference engine
(infinity.initialize with no optimizer) and runs the model's own ``generate``
on ``--batch`` copies of the prompt: greedy, or with ``--do-sample`` sampled
as transformers samples (``temperature``, ``top_k``, ``top_p`` with its
defaults 1.0, 50, 1.0; ``--seed`` seeds torch's generator first, so a seed
gives transformers' tokens for that seed). The continuation streams to stdout
as tokens are produced (the first row; when sampled rows differ, each other
distinct row is printed after it), and a progress line on stderr shows
tokens/s, GB/s read from NVMe and peak RSS (redrawn per token unless stdout
and stderr are one terminal, where it would cut through the text). Exit
status 0, or 2 for bad arguments or a directory it cannot read. Registered
in infinity.cli.main.COMMANDS.
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
    p.add_argument(
        "--model-dir",
        required=True,
        metavar="DIR",
        help="a save_pretrained directory: config.json, model.safetensors (or shards), a tokenizer",
    )
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument(
        "--batch", type=int, default=1, help="copies of the prompt generated at once (default 1)"
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=32, help="new tokens per sequence (default 32)"
    )
    p.add_argument(
        "--nvme-path",
        default="infinity_nvme",
        metavar="PATH",
        help="where the weights' swap files go when --config names none (default ./infinity_nvme)",
    )
    p.add_argument(
        "--config",
        metavar="JSON",
        help="DeepSpeed-style config (stage 3, no optimizer); "
        "default: the weights on NVMe at --nvme-path, none kept in host memory",
    )
    p.add_argument(
        "--bits",
        type=int,
        choices=(8, 4),
        help="store the weights group-quantised (weight_quantization, groups of 64)",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", *DTYPES),
        default="auto",
        help="the weights' dtype (default: config.json's, else fp32)",
    )
    p.add_argument(
        "--do-sample",
        action="store_true",
        help="sample the next token (transformers' do_sample=True) instead of greedy decoding",
    )
    p.add_argument(
        "--temperature",
        type=float,
        metavar="T",
        help="with --do-sample: divides the logits (default 1.0)",
    )
    p.add_argument(
        "--top-k",
        type=int,
        metavar="K",
        help="with --do-sample: keep the K likeliest tokens (default 50)",
    )
    p.add_argument(
        "--top-p",
        type=float,
        metavar="P",
        help="with --do-sample: keep the smallest set of tokens whose probability reaches P (default 1.0)",
    )
    p.add_argument(
        "--seed", type=int, help="seed torch's generator before generating (reproducible sampling)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


SAMPLING = ("temperature", "top_k", "top_p")


def sampling_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """What ``generate`` gets for decoding: do_sample and the sampling values given. ValueError for a
    sampling value without --do-sample (transformers would ignore it with a warning) or out of range."""
    given = {k: getattr(args, k) for k in SAMPLING if getattr(args, k) is not None}
    if not args.do_sample:
        if given:
            flag = "--" + next(iter(given)).replace("_", "-")
            raise ValueError(
                f"{flag} applies only with --do-sample (without it decoding is greedy); add "
                "--do-sample or drop it"
            )
        return {"do_sample": False}
    if given.get("temperature", 1.0) <= 0:
        raise ValueError("--temperature must be above 0 (for greedy decoding, drop --do-sample)")
    if given.get("top_k", 1) < 1:
        raise ValueError("--top-k must be at least 1")
    if not 0 < given.get("top_p", 1.0) <= 1:
        raise ValueError("--top-p must be in (0, 1]")
    return {"do_sample": True, **given}


def engine_config(args: argparse.Namespace) -> dict[str, Any]:
    if args.config:
        try:
            cfg = json.loads(Path(args.config).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read --config {args.config!r}: {e}") from None
    else:
        cfg = {
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "nvme", "nvme_path": args.nvme_path, "max_in_cpu": 0},
            }
        }
    if args.bits:
        cfg["weight_quantization"] = {
            "quantized_initialization": {"num_bits": args.bits, "group_size": 64}
        }
    if not args.config:
        Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    return cfg


class Stream:
    """A transformers streamer: the first row's text on stdout as its tokens come, and a progress line on
    stderr with the rate and what was read.

    The text is written up to the last whitespace of what the tokens so far decode to (as transformers'
    TextStreamer does: a word may still change as tokens join it), the rest at the end."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        total: int,
        *,
        batch: int,
        progress: bool,
        out: Any = None,
        err: Any = None,
    ):
        self.engine, self.tokenizer, self.total, self.batch = engine, tokenizer, total, batch
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.progress = progress
        # one terminal for both: a redrawn progress line would cut through the text
        self.live = progress and not (_isatty(self.out) and _isatty(self.err))
        self.steps = -1  # the first put() is the prompt
        self.tokens: list[int] = []
        self.written = 0
        self.t0 = time.perf_counter()
        self.read0 = engine.io_stats()["read_nbytes"]

    def put(self, value: torch.Tensor) -> None:
        self.steps += 1
        if self.steps == 0:
            return  # the prompt
        self.tokens.append(int(value.reshape(self.batch, -1)[0, -1]))
        text = self.text()
        cut = max(text.rfind(" "), text.rfind("\n")) + 1
        self._write(text[self.written : cut])
        if self.live:
            self.err.write("\r" + self.line())
            self.err.flush()

    def end(self) -> None:
        self._write(self.text()[self.written :] + "\n")
        if self.progress:
            self.err.write(("\r" + self.line() if not self.live or self.steps <= 0 else "") + "\n")
            self.err.flush()

    def text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def _write(self, part: str) -> None:
        if part:
            self.out.write(part)
            self.out.flush()
            self.written += len(part.rstrip("\n")) if part.endswith("\n") else len(part)

    def line(self) -> str:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        read = self.engine.io_stats()["read_nbytes"] - self.read0
        done = min(max(self.steps, 0), self.total)
        bar = "#" * (20 * done // max(1, self.total))
        return (
            f"[{bar:<20}] {done}/{self.total} tokens, {done * self.batch / dt:.1f} tok/s, "
            f"{read / dt / 1e9:.2f} GB/s read, peak RSS {peak_resident_host_nbytes() / 2**30:.2f} GiB"
        )


def _isatty(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def run(args: argparse.Namespace) -> int:
    import infinity
    from infinity.inference.pretrained import from_pretrained

    if args.batch < 1 or args.max_new_tokens < 1:
        print("infinity generate: --batch and --max-new-tokens must be at least 1", file=sys.stderr)
        return 2
    try:
        decoding = sampling_arguments(args)
    except ValueError as e:
        print(f"infinity generate: {e}", file=sys.stderr)
        return 2
    model_dir = Path(args.model_dir)
    if not model_dir.is_dir():
        what = "is not a directory" if model_dir.exists() else "does not exist"
        print(f"infinity generate: --model-dir {args.model_dir} {what}", file=sys.stderr)
        return 2
    # AutoTokenizer makes an empty tokenizer from a config alone: ask for its files first
    if not any((Path(args.model_dir) / f).is_file() for f in TOKENIZER_FILES):
        print(
            f"infinity generate: cannot read a tokenizer from {args.model_dir}: it has none of "
            f"{', '.join(TOKENIZER_FILES)} (save the tokenizer with save_pretrained beside the model)",
            file=sys.stderr,
        )
        return 2
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        print(
            f"infinity generate: cannot read a tokenizer from {args.model_dir}: {e}",
            file=sys.stderr,
        )
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
            print(
                "infinity generate: the config makes an optimizer (a training engine); drop its optimizer "
                "section",
                file=sys.stderr,
            )
            return 2
        pad = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        stream = Stream(
            engine, tokenizer, args.max_new_tokens, batch=args.batch, progress=not args.no_progress
        )
        if args.seed is not None:
            torch.manual_seed(args.seed)  # generate samples from torch's default generator
        out = engine.generate(
            enc["input_ids"],
            attention_mask=enc["attention_mask"],
            **decoding,
            max_new_tokens=args.max_new_tokens,
            pad_token_id=pad,
            streamer=stream,
        )
        stats = engine.last_generation
    finally:
        engine.close()
    prompt_len = enc["input_ids"].shape[1]
    texts = tokenizer.batch_decode(out[:, prompt_len:], skip_special_tokens=True)
    for text in list(dict.fromkeys(texts))[
        1:
    ]:  # the first streamed; greedy copies agree, sampled may not
        print(text)
    print(
        f"{stats.summary()}; peak RSS {peak_resident_host_nbytes() / 2**30:.2f} GiB",
        file=sys.stderr,
    )
    return 0
