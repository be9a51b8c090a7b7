"""A LoRA model's frozen base in backward ([Note: frozen units in backward] in
infinity/zero/partitioner.py): PEFT on the tiny Llama, stage 3 with parameters and optimizer on NVMe,
activation checkpointing (its recomputation hands every unit of a layer to backward) and without, the
base at rest in NF4 or unquantised.

Oracles: plain PEFT in plain PyTorch (on the dequantised weights for NF4, as bitsandbytes makes them:
tests/hf/test_lora_quantised.py), trained by torch's AdamW: the same losses and adapter weights (fp32,
1e-5 relative). Memory: no frozen unit is still held when backward ends (none has grads whose
reduction would release it), and the TensorCache makes no more buffers for frozen units than the
sizing model counts (runtime_plan.frozen_buffers_nbytes), which is less than the base.
"""

from __future__ import annotations

import pytest
import torch

import infinity
from infinity.estimate.runtime_plan import frozen_buffers_nbytes
from infinity.zero.gathered import GatheredParameters
from tests.hf.lora import lora, plain_peft
from tests.hf.models import batch, build_under_init
from tests.hf.test_lora_quantised import STEPS, config, plain_peft_on_dequantised_base


def _count_new_buffers(cache) -> list[int]:
    """Wraps ``cache.get``: the bytes of each buffer it makes (none of its free ones was handed out)."""
    made: list[int] = []
    get = cache.get

    def counting_get(numel, dtype, **kw):
        free = {id(t) for bucket in cache._free.values() for t in bucket}
        t = get(numel, dtype, **kw)
        if id(t) not in free:
            made.append(t.numel() * t.element_size())
        return t

    cache.get = counting_get
    return made


def _frozen_held_at_end_of_backward(partitioner) -> list[list[str]]:
    """Wraps the partitioner's end-of-backward callback: the frozen units each backward still held."""
    seen: list[list[str]] = []
    end = partitioner._end_of_backward

    def spying_end():
        seen.append([u.module_name for u in partitioner._backward_units if not u.trainable])
        end()

    partitioner._end_of_backward = spying_end
    return seen


@pytest.mark.parametrize("kind", ["nf4", None])
@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointed", "plain"])
def test_frozen_units_leave_backward_as_their_nodes_finish_and_the_math_is_plain_peft(
    kind, checkpointing, nvme_dir
):
    cfg = config(nvme_dir, kind, nontrainable=kind is not None)
    model = build_under_init("llama", cfg, seed=0)
    if checkpointing:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    engine = infinity.initialize(lora(model), cfg)
    rt = engine.runtime
    try:
        made = _count_new_buffers(rt.cache)
        held = _frozen_held_at_end_of_backward(rt.partitioner)
        losses = []
        for step in range(STEPS):
            torch.manual_seed(step)
            loss = engine(**batch("llama", step)).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        rt.overlap.synchronize()
        with GatheredParameters(engine):
            weights = {
                n: p.detach().clone()
                for n, p in engine.module.named_parameters()
                if p.requires_grad
            }
        quantised = {u.index for u in rt.unit_map.units if rt.plan.format_of(u) is not None}
        counted = frozen_buffers_nbytes(
            engine.module, rt.unit_map, forward=lambda u: u.index in quantised
        )
        frozen = [u for u in rt.unit_map.units if not u.trainable and not u.persistent]
    finally:
        engine.close()
    assert held == [[]] * STEPS
    assert made, "no frozen unit was gathered into a buffer of its own"
    assert sum(made) <= counted < sum(u.layout.shard_nbytes for u in frozen)
    ref_losses, ref_weights = (
        plain_peft_on_dequantised_base(kind) if kind else plain_peft(steps=STEPS)
    )
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert weights.keys() == ref_weights.keys()
    for n, ref in ref_weights.items():
        err = (weights[n] - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)
        assert err < 1e-5, f"{n}: relative difference {err:.2e}"
