"""Activation memory of a GPT-style transformer (infinity.models.GPT), with and without checkpointing.

[Note: activation coefficients]
Per block, autograd saves 16 · B·T·d elements of the compute dtype (counted
exactly with saved-tensor hooks on infinity.models.GPT, torch 2.13: the
block's input, both LayerNorm inputs and outputs, q/k/v, the attention output
and its contiguous copy, the MLP's two 4·d-wide tensors), plus fp32 LayerNorm
statistics (4 per token per LayerNorm) and the attention's log-sum-exp (4 per
token per head). The top adds the final LayerNorm (2 · B·T·d) and the fp32
log-softmax output (4 · B·T·V bytes); indices are int64.

The process holds more than autograd saves: measured peak RSS on the CPU
(glibc heap reuse of freed intermediates) is ~2 · B·T·d fp32 values more per
block, and backward needs a working set of at most 10 · B·T·d fp32 values
plus 2.1 × the fp32 logits (the gradients of the log-softmax and of the
logits). Both are counted in fp32 also for bf16/fp16 models: their CPU
kernels upcast (a bf16 run measured 15% above its bf16-only count). These
measured coefficients held for every shape tried (L 2-8, d 64-768, V
256-8192, B·T 64-4096, fp32 and bf16), never below, at most 30% above the
activation bytes. The GPU's caching allocator is not measured here; the same
figures are used.

Checkpointing every block keeps only each block's input (1 · B·T·d) and
recomputes one block in backward, which then also holds that block's
gradients: two blocks' worth.

Trained by engine.train_batch, a block of k micro-batches keeps k of each
figure at once (their backwards walk together: k working sets too), and
each micro-batch beyond that THREAD_LOGITS × its fp32 logits (``thread``):
the backward walks the k heads before any unit's grads are reduced, so the
log-softmax outputs it frees there (into the forward threads' heaps, which
the engine trims only as units finish) sit beside the k logits' gradients
([Note: layer-major blocks] in blocks.py has the measurements).
"""

from __future__ import annotations

import dataclasses

from infinity.models import GPTConfig

BLOCK_FIT_MARGIN = 1.06
"""A layer-major block's bytes per micro-batch were fitted within 6% ([Note: layer-major blocks] in
blocks.py); counted 6% high, so that the estimate stays at or above a measured peak."""
THREAD_LOGITS = 3
"""Per micro-batch of a layer-major block beyond its peak: this many times its fp32 logits (measured:
2.6 at vocabulary 8192, where the logits dominate; the module docstring says why)."""
SAVED_PER_BLOCK = 16  # B·T·d elements autograd saves per block
HEAP_PER_BLOCK = 2  # measured extra per block (allocator), B·T·d fp32 values
FINAL_LN = 2  # B·T·d elements: the final LayerNorm's input and output
LOGSOFTMAX_NBYTES = 4  # per B·T·V: the fp32 log-softmax output saved by cross_entropy
WORK_BTD = 10  # backward working set, B·T·d fp32 values
WORK_LOGITS_TENTHS = 21  # backward working set, tenths of the fp32 logits (2.1 ×)
INDEX_NBYTES = 3 * 8  # int64 tokens, targets, positions per token
FP32_LINEAR_TEMPS = 5
"""16-bit training on a CPU whose Linear layers multiply in fp32 ([Note: 16-bit Linear on the CPU]
in infinity/zero/cpu_linear.py): this many times the widest Linear's fp32 input and output
(B·T · (in + out) · 4 bytes) more. Measured: bf16 stage-2 training of infinity.models.GPT (B·T
1024; d 256, 512, 768; 8, 4, 2 layers) peaked 3.8-5.8 times that above the same runs with torch's
16-bit kernels; at 5 the estimates came out 5-12% above the peaks (the other terms' margins cover
the rest), where 6 put one at the 15% the estimate is held to. The extra is the path's fp32
copies and what the heap keeps of them."""


@dataclasses.dataclass(frozen=True)
class Activations:
    """Bytes for one micro-batch on one rank."""

    micro_batch: int
    seq: int
    saved: int
    """Kept from forward to backward without checkpointing."""
    saved_checkpointed: int
    """The same with every block checkpointed (block inputs + one recomputed block)."""
    working: int
    """Transient working memory of backward (at its start: the logits' gradients)."""
    thread: int = 0
    """Engine.train_batch: what each micro-batch of a block keeps beyond its peak (THREAD_LOGITS ×
    its fp32 logits; [Note: layer-major blocks] in blocks.py)."""
    source: str = "infinity.models.GPT's measured coefficients"
    """How the figures were made (the GPT coefficients here, or traced.py's count of one forward)."""

    def peak(self, *, checkpointing: bool) -> int:
        return (self.saved_checkpointed if checkpointing else self.saved) + self.working

    def block(self, k: int, *, checkpointing: bool) -> int:
        """What a layer-major block of ``k`` micro-batches keeps at once (engine.train_batch;
        [Note: layer-major blocks] in blocks.py), counted at the top of the fit's range
        (BLOCK_FIT_MARGIN)."""
        per = self.peak(checkpointing=checkpointing) + self.thread
        return int(k * per * BLOCK_FIT_MARGIN)


def gpt_activations(
    cfg: GPTConfig, *, micro_batch: int, seq: int, itemsize: int, fp32_linears: bool = False
) -> Activations:
    """Activations of infinity.models.GPT (see [Note: activation coefficients]); ``fp32_linears``:
    its 16-bit Linear layers multiply in fp32 on this CPU (``FP32_LINEAR_TEMPS``)."""
    if micro_batch < 1 or seq < 1:
        raise ValueError(f"micro_batch and seq must be >= 1; got {micro_batch} and {seq}")
    bt = micro_batch * seq
    btd = bt * cfg.d_model * itemsize
    btd32 = bt * cfg.d_model * 4
    stats = (2 * 2 * 4 + 4 * cfg.n_head) * bt
    block = SAVED_PER_BLOCK * btd + HEAP_PER_BLOCK * btd32 + stats
    top = FINAL_LN * btd + LOGSOFTMAX_NBYTES * bt * cfg.vocab_size + INDEX_NBYTES * bt
    working = WORK_BTD * btd32 + WORK_LOGITS_TENTHS * 4 * bt * cfg.vocab_size // 10
    if fp32_linears:  # the widest Linear: the MLP's fc, d in and 4·d out
        working += FP32_LINEAR_TEMPS * 5 * btd32
    return Activations(
        micro_batch=micro_batch,
        seq=seq,
        saved=cfg.n_layer * block + top,
        saved_checkpointed=cfg.n_layer * btd + 2 * block + top,
        working=working,
        thread=THREAD_LOGITS * LOGSOFTMAX_NBYTES * bt * cfg.vocab_size,
    )
