"""Weights at rest: the safetensors format (header, dtypes, reading without mmap, files held in memory),
the Hugging Face file layout (names, shards, the index), and shard quantisation formats.

Imports only infinity.memory and infinity.aio (and torch, transformers). The transformers import
is lazy: it runs only for a model whose class comes from transformers.
"""

from infinity.weights.header import (
    Entry,
    Header,
    HeaderError,
    build_header,
    parse_header,
    read_header,
)
from infinity.weights.hf_layout import HfNames, checkpoint_files, checkpoint_tensors
from infinity.weights.reader import FileTensor, TensorFiles

__all__ = [
    "Entry",
    "FileTensor",
    "Header",
    "HeaderError",
    "HfNames",
    "TensorFiles",
    "build_header",
    "checkpoint_files",
    "checkpoint_tensors",
    "parse_header",
    "read_header",
]
