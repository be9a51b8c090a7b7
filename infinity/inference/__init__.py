"""Streamed inference: a model's weights read from NVMe layer by layer, ahead of compute.

The same store and prefetch scheduler as training, with no gradient or
optimizer state (DeepSpeed's ZeRO-Inference): ``infinity.initialize`` builds
an InferenceEngine when nothing makes an optimizer at stage 3 (initialize.py);
``engine(...)`` and ``engine.generate(...)`` replay one forward's trace for
every later one (engine.py). ``estimate_inference`` (estimate.py) sizes a run
before it starts: weights, KV cache, working memory (asked with an ``InferenceOptions``, or its
keywords). Sits above infinity.engine and below
infinity.integrations; see docs/ARCHITECTURE.md.
"""

from infinity.inference.engine import InferenceEngine
from infinity.inference.estimate import (
    GenerationSize,
    InferenceEstimate,
    InferenceOptions,
    estimate_inference,
)
from infinity.inference.initialize import initialize
from infinity.inference.pretrained import from_pretrained
from infinity.inference.stats import InferenceStats

__all__ = [
    "GenerationSize",
    "InferenceEngine",
    "InferenceEstimate",
    "InferenceOptions",
    "InferenceStats",
    "estimate_inference",
    "from_pretrained",
    "initialize",
]
