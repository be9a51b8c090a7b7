"""LoRA with PEFT, unchanged, under stage 3 with parameters and optimizer state on NVMe: plain PEFT's
losses, and a frozen parameter costs nothing but its bytes at rest (issue 24's footprint).

Oracles: plain PEFT on the same tiny Llama trained by torch's AdamW over the trainable parameters (the
losses and adapter weights); the engine's own counters for the footprint: the parameter store's
per-key NVMe traffic (``TieredStore.key_traffic``: no byte written for a frozen unit while training),
the optimizer store's keys and swap reserve (state for the adapters only), the gradient sink's
``open`` calls (no gradient buffer opened for a frozen unit), the optimizer's sub-groups (its pool
holds trainable units only).
"""

from __future__ import annotations

import pytest

import infinity
from infinity.zero.gathered import GatheredParameters
from tests.hf.lora import lora, plain_peft
from tests.hf.models import batch, build, build_under_init, ds_config

STEPS = 3


@pytest.mark.parametrize("under_init", [True, False])
def test_lora_trains_as_plain_peft_and_a_frozen_parameter_costs_only_its_bytes_at_rest(
    under_init, nvme_dir
):
    cfg = ds_config(nvme_dir)
    base = build_under_init("llama", cfg, seed=0) if under_init else build("llama", seed=0)
    engine = infinity.initialize(lora(base), cfg)
    rt = engine.runtime
    try:
        frozen = [u for u in rt.unit_map.units if not u.trainable]
        trained = [u for u in rt.unit_map.units if u.trainable]
        assert frozen and trained
        assert all("lora_" in n for u in trained for n in u.names)
        assert all("lora_" not in n for u in frozen for n in u.names)
        frozen_keys = {u.key for u in frozen}
        frozen_index = {u.index for u in frozen}

        # No fp32 master, moments or gradient partition for a frozen unit, and no pool or swap room:
        # the optimizer store holds the trainable units' arrays (fp32: the shard is its own master).
        assert {i for i, _ in rt.state_store.keys()} == {u.index for u in trained}
        assert not {i for g in rt.plan.optimizer.sub_groups for i in g} & frozen_index
        trained_numel = sum(u.layout.shard_numel for u in trained)
        assert rt.plan.state_store.reserve_nbytes == 12 * trained_numel

        opened: list[int] = []
        open_shard = rt.optimizer.open

        def recording_open(index, *, first):
            opened.append(index)
            return open_shard(index, first=first)

        rt.reducer.sink.open = recording_open
        homes = {rt.param_store.spec(u.key).home for u in frozen if not u.persistent}
        before = rt.param_store.key_traffic()
        losses = []
        for step in range(STEPS):
            loss = engine(**batch("llama", step)).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.runtime.overlap.synchronize()
        moved = rt.param_store.key_traffic().since(before)
        with GatheredParameters(engine):
            weights = {
                n: p.detach().clone()
                for n, p in engine.module.named_parameters()
                if p.requires_grad
            }
    finally:
        engine.close()

    assert opened and not set(opened) & frozen_index, "a gradient buffer opened for a frozen unit"
    assert not {k: n for k, n in moved.written.items() if k in frozen_keys}, "a frozen unit written"
    assert homes == {"nvme"}, "max_in_cpu 0: every frozen shard rests on NVMe"
    assert moved.written, "the adapters' shards are written home (the counter counts)"

    ref_losses, ref_weights = plain_peft(steps=STEPS)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert weights.keys() == ref_weights.keys()
    for n, ref in ref_weights.items():
        err = (weights[n] - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)
        assert err < 1e-5, f"{n}: relative difference {err:.2e}"
