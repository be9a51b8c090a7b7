"""``infinity export CHECKPOINT OUT.safetensors``: a checkpoint's full weights as one safetensors file.

DeepSpeed's ``zero_to_fp32.py``, streaming: the fp32 masters are read from the
checkpoint's partitions a chunk at a time, converted to ``--dtype`` and
appended to the output, so a model larger than host memory exports. The
result loads with ``safetensors.torch.load_file`` into the plain PyTorch model.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from infinity.engine.checkpoint import CheckpointError, export_checkpoint
from infinity.engine.checkpoint.format import DTYPE_NAMES

NAME = "export"
HELP = "export: write a checkpoint's full weights to one .safetensors file (streaming, any model size)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path,
                        help="a checkpoint directory, or the directory holding 'latest' (then --tag or latest)")
    parser.add_argument("out", type=Path, help="the .safetensors file to write (replaced atomically)")
    parser.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="fp32",
                        help="dtype of the weights written (default fp32, from the fp32 masters)")
    parser.add_argument("--tag", default=None, help="which checkpoint under CHECKPOINT (default: what 'latest' names)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    try:
        out = export_checkpoint(args.checkpoint, args.out, tag=args.tag, dtype=DTYPE_NAMES[args.dtype],
                                progress=False if args.no_progress else None)
    except (CheckpointError, OSError, ValueError) as e:
        print(f"infinity export: {e}", file=sys.stderr)
        return 1
    dt = time.perf_counter() - t0
    size = out.stat().st_size
    print(f"wrote {out} ({size / 1e9:.3f} GB, {args.dtype}) in {dt:.1f} s ({size / 1e9 / max(dt, 1e-9):.2f} GB/s)")
    return 0
