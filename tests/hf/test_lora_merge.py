"""LoRA adapters in and out the way PEFT users expect: the merged export ([Note: merged export] in
infinity/engine/checkpoint/merged.py) and an adapter PEFT wrote, trained on here.

Oracles: PEFT's own ``merge_and_unload()`` on a plain model holding the same adapters (over the
dequantised base where it rests in NF4: bitsandbytes' values), transformers' ``from_pretrained`` for
what the export wrote; plain PEFT trained by torch's AdamW from the same adapter directory.
"""

from __future__ import annotations

import warnings

import pytest
import safetensors.torch
import torch

import infinity
from tests.engine.reference import CLIP, trainable_adamw
from tests.hf.lora import assert_loads_as, lora
from tests.hf.models import batch, build, build_under_init, ds_config
from tests.hf.test_lora_quantised import dequantised
from tests.hf.test_lora_quantised_checkpoint import make_engine, train


def plain_merged(adapters: dict[str, torch.Tensor], kind: str | None) -> torch.nn.Module:
    """PEFT's merge_and_unload of ``adapters`` over the plain base (dequantised as ``kind`` says)."""
    model = lora(build("llama", seed=0))
    with torch.no_grad():
        for p in model.parameters():
            if kind is not None and not p.requires_grad and p.dim() >= 2:
                p.copy_(dequantised(p, kind))
    missing, unexpected = model.load_state_dict(adapters, strict=False)
    assert not unexpected and not {n for n in missing if ".lora_" in n}
    return model.merge_and_unload()


@pytest.mark.parametrize("kind", [None, "nf4"])
def test_the_merged_export_loads_with_from_pretrained_and_is_peft_merge_and_unload(
    kind, nvme_dir, tmp_path
):
    engine = make_engine(nvme_dir, kind)
    try:
        train(engine, 0, 2)  # B is zero at the start: trained, the merge changes the weights
        out = engine.save_merged(tmp_path / "merged")
        adapters = {n: t for n, t in engine.gathered_state_dict().items() if ".lora_" in n}
    finally:
        engine.close()
    assert any(t.abs().max() > 0 for n, t in adapters.items() if ".lora_B." in n)
    want = plain_merged(adapters, kind)
    written = safetensors.torch.load_file(out / "model.safetensors")
    assert not any("lora_" in n or "base_layer" in n for n in written)
    assert_loads_as(out, want)


def test_save_merged_needs_a_peft_model(nvme_dir, tmp_path):
    cfg = ds_config(nvme_dir)
    engine = infinity.initialize(build_under_init("llama", cfg, seed=0), cfg)
    try:
        with pytest.raises(
            ValueError, match="merges a PEFT model's LoRA adapters.*save_16bit_model"
        ):
            engine.save_merged(tmp_path / "merged")
    finally:
        engine.close()


def from_adapter(model, adapter_dir):
    import peft

    with warnings.catch_warnings():  # peft 0.21 reads transformers 5's deprecated attribute
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        return peft.PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)


def test_an_adapter_peft_wrote_continues_training_here_with_plain_peft_losses(nvme_dir, tmp_path):
    adapter_dir = tmp_path / "adapter"
    model = lora(build("llama", seed=0))
    opt = trainable_adamw(model)
    for step in range(2):  # an adapter with B != 0, as a finished PEFT run leaves it
        model(**batch("llama", step)).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.save_pretrained(adapter_dir)

    cfg = ds_config(nvme_dir)
    engine = infinity.initialize(
        from_adapter(build_under_init("llama", cfg, seed=0), adapter_dir), cfg
    )
    try:
        losses = train(engine, 2, 5)
    finally:
        engine.close()

    plain = from_adapter(build("llama", seed=0), adapter_dir)
    opt = trainable_adamw(plain)
    ref = []
    for step in range(2, 5):
        loss = plain(**batch("llama", step)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref.append(loss.item())
    assert losses == pytest.approx(ref, rel=1e-5)
