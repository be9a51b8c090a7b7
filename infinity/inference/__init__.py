"""Streamed inference: a model's weights read from NVMe layer by layer, ahead of compute.

The same store and prefetch scheduler as training, with no gradient or
optimizer state (DeepSpeed's ZeRO-Inference). Sits above infinity.engine and
below infinity.integrations; see docs/ARCHITECTURE.md.
"""
