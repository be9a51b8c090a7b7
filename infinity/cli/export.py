"""``infinity export CHECKPOINT OUT``: a checkpoint's full weights, streamed, for plain PyTorch or Hugging Face.

DeepSpeed's ``zero_to_fp32.py``, streaming: the fp32 masters are read from the
checkpoint's partitions a chunk at a time, converted to ``--dtype`` and
appended to the output, so a model larger than host memory exports. ``OUT``
ending in ``.safetensors`` is one file that ``safetensors.torch.load_file``
puts into the plain PyTorch model; a directory gets the Hugging Face layout
that ``from_pretrained`` reads (shards of ``--max-shard-size`` with their
index, ``config.json`` as the checkpoint saved it, or ``--config`` checked
against the weights' shapes); a PEFT checkpoint's directory is the adapter
folder ``PeftModel.from_pretrained`` reads. Under ``torchrun`` (node-local
checkpoints: each node holds its own ranks' files), every rank runs it: rank 0
writes ``OUT`` on its node, fetching the weights other nodes hold from their
ranks; the others serve them. ``--merge-adapters``: a PEFT LoRA run's checkpoint becomes the base
model with its adapters merged in (PEFT's ``merge_and_unload()``), a directory ``from_pretrained``
reads, in the dtype it trained in unless ``--dtype`` says otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from infinity.engine.checkpoint import CheckpointError, export_checkpoint, export_merged
from infinity.engine.checkpoint.format import DTYPE_NAMES

NAME = "export"
HELP = (
    "export: write a checkpoint's full weights to one .safetensors file or a Hugging Face directory "
    "(streaming, any model size)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint",
        type=Path,
        help="a checkpoint directory, or the directory holding 'latest' (then --tag or latest)",
    )
    parser.add_argument(
        "out",
        type=Path,
        help="a .safetensors file (replaced atomically), or a directory (a path without a suffix) "
        "for the Hugging Face layout: model.safetensors or its shards, index, config.json",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPE_NAMES),
        default=None,
        help="dtype of the weights written (default fp32, from the fp32 masters; with "
        "--merge-adapters, the dtype the model trained in)",
    )
    parser.add_argument(
        "--tag",
        default=None,
        help="which checkpoint under CHECKPOINT (default: what 'latest' names)",
    )
    parser.add_argument(
        "--max-shard-size",
        default=None,
        metavar="SIZE",
        help="Hugging Face layout: shards of at most SIZE of tensor data, as save_pretrained's "
        "max_shard_size ('5GB', '500MB', bytes; default 50GB)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="PATH",
        help="Hugging Face layout: the model's config.json (or its directory), refused where its "
        "shapes differ from the weights'; default: the one saved in the checkpoint (else "
        "beside it, then in CHECKPOINT)",
    )
    parser.add_argument(
        "--merge-adapters",
        action="store_true",
        help="a PEFT LoRA run's checkpoint: write the base model with the adapters merged in "
        "(as PEFT's merge_and_unload) to the directory OUT, for from_pretrained",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    started = False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")  # torchrun's environment: gather from every node
        started = True
    try:
        return _run(args, t0)
    finally:
        if started:
            dist.destroy_process_group()


def _run(args: argparse.Namespace, t0: float) -> int:
    try:
        if args.merge_adapters:
            if args.config is not None:
                raise ValueError(
                    "--merge-adapters rebuilds the model from the config.json saved in the "
                    "checkpoint; drop --config"
                )
            out = export_merged(
                args.checkpoint,
                args.out,
                tag=args.tag,
                dtype=DTYPE_NAMES[args.dtype] if args.dtype else None,
                progress=False if args.no_progress else None,
                max_shard_size=args.max_shard_size,
                gather_nodes=dist.is_initialized(),
            )
        else:
            out = export_checkpoint(
                args.checkpoint,
                args.out,
                tag=args.tag,
                dtype=DTYPE_NAMES[args.dtype or "fp32"],
                progress=False if args.no_progress else None,
                max_shard_size=args.max_shard_size,
                config=args.config,
                gather_nodes=dist.is_initialized(),  # under torchrun: every node serves its part
            )
    except (CheckpointError, OSError, ValueError, ImportError) as e:
        print(f"infinity export: {e}", file=sys.stderr)
        return 1
    if dist.is_initialized() and dist.get_rank() != 0:
        print(f"rank {dist.get_rank()}: served this node's part of the checkpoint to rank 0")
        return 0
    dt = time.perf_counter() - t0
    shown = args.dtype or ("the dtype it trained in" if args.merge_adapters else "fp32")
    files = sorted(out.glob("*.safetensors")) if out.is_dir() else [out]
    size = sum(f.stat().st_size for f in files)
    what = f"{len(files)} file(s) in {out}" if out.is_dir() else str(out)
    print(
        f"wrote {what} ({size / 1e9:.3f} GB, {shown}) in {dt:.1f} s ({size / 1e9 / max(dt, 1e-9):.2f} GB/s)"
    )
    return 0
