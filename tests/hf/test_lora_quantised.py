"""LoRA over a quantised frozen base ([Note: a quantised frozen base] in infinity/engine/initialize.py):
PEFT on a tiny Llama, stage 3 with parameters and optimizer on NVMe, the base at rest in NF4 (its scales
quantised again, too: double quantisation) or int8.

Oracles: plain PEFT in plain PyTorch whose frozen matrices hold the dequantised values — for NF4 as
bitsandbytes' own ``quantize_4bit`` / ``dequantize_4bit`` make them (``compress_statistics=True`` for
double quantisation; no one here wrote it), for int8 as
the format's definition (tests/weights/test_quant.py) — trained by torch's AdamW: the same losses and
adapter weights (fp32, 1e-5 relative). The frozen units rest at their packed size and are never
written back (the store's per-key counters). Bad input is refused before anything is allocated.
"""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

import infinity
from infinity.config import ConfigError
from infinity.weights.quant import QuantSpec, dequantize_into, quantize_into, shard_format
from infinity.zero.gathered import GatheredParameters
from tests.hf.lora import lora, plain_peft
from tests.hf.models import batch, build, build_under_init, ds_config

STEPS = 3
GROUP = 32  # the tiny Llama's rows are 32 or 64 elements long
QUANT = {
    "nf4": {"num_bits": 4, "group_size": GROUP, "quant_type": "nf4"},
    "nf4-dq": {"num_bits": 4, "group_size": GROUP, "quant_type": "nf4", "double_quant": True},
    "int8": {"num_bits": 8, "group_size": GROUP},
}


def config(nvme_dir, kind: str | None, *, nontrainable: bool = True) -> dict:
    cfg = ds_config(nvme_dir)
    cfg["zero_optimization"]["zero_quantized_nontrainable_weights"] = nontrainable
    if kind is not None:
        cfg["weight_quantization"] = {"quantized_initialization": dict(QUANT[kind])}
    return cfg


def dequantised(w: torch.Tensor, kind: str) -> torch.Tensor:
    if kind.startswith("nf4"):
        bnb = pytest.importorskip("bitsandbytes.functional")
        packed, state = bnb.quantize_4bit(
            w.reshape(-1), blocksize=GROUP, quant_type="nf4", compress_statistics=kind == "nf4-dq"
        )
        return bnb.dequantize_4bit(packed, state).reshape(w.shape)
    spec = QuantSpec(8, GROUP, False)
    fmt = shard_format([(0, w.numel(), tuple(w.shape))], w.numel(), w.dtype, spec)
    packed = torch.zeros(fmt.nbytes, dtype=torch.uint8)
    quantize_into(fmt, w.reshape(-1), packed)
    out = torch.empty(w.numel(), dtype=w.dtype)
    dequantize_into(fmt, packed, out)
    return out.view_as(w)


def plain_peft_on_dequantised_base(kind: str):
    def dequantise_base(model: torch.nn.Module) -> None:
        with torch.no_grad():
            for p in model.parameters():
                if not p.requires_grad and p.dim() >= 2:
                    p.copy_(dequantised(p, kind))

    return plain_peft(steps=STEPS, prepare=dequantise_base)


@pytest.mark.parametrize("kind", ["nf4", "nf4-dq", "int8"])
def test_lora_over_a_quantised_base_equals_plain_peft_on_the_dequantised_weights(
    kind, nvme_dir, tmp_path
):
    cfg = config(nvme_dir, kind)
    engine = infinity.initialize(lora(build_under_init("llama", cfg, seed=0)), cfg)
    rt = engine.runtime
    try:
        frozen = [u for u in rt.unit_map.units if not u.trainable]
        quantised = [u for u in frozen if any(len(s.shape) >= 2 for s in u.layout.slots)]
        assert quantised
        for u in rt.unit_map.units:
            fmt = rt.plan.format_of(u)
            assert (fmt is None) == u.trainable, u.names
            spec = rt.param_store.spec(u.key)
            if fmt is not None:  # at rest: the packed bytes, fewer than the shard's
                assert spec.nbytes == fmt.nbytes and spec.dtype == torch.uint8
                assert fmt.spec.quant_type == ("int" if kind == "int8" else "nf4")
                assert fmt.spec.double_quant == (kind == "nf4-dq")
        # (each shard is padded to 4 KiB at rest either way: tiny units save less than the ratio)
        assert sum(rt.plan.format_of(u).nbytes for u in quantised) < sum(
            u.layout.shard_nbytes for u in quantised
        )
        before = rt.param_store.key_traffic()
        losses = []
        for step in range(STEPS):
            loss = engine(**batch("llama", step)).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        rt.overlap.synchronize()
        moved = rt.param_store.key_traffic().since(before)
        with GatheredParameters(engine):
            weights = {
                n: p.detach().clone()
                for n, p in engine.module.named_parameters()
                if p.requires_grad
            }
        # the adapters out as PEFT writes them (checkpoints: test_lora_quantised_checkpoint.py)
        adapter = safetensors.torch.load_file(
            engine.save_pretrained(tmp_path / "adapter") / "adapter_model.safetensors"
        )
    finally:
        engine.close()
    assert not {u.key for u in frozen} & set(moved.written), "a frozen unit was written back"
    assert {n.replace(".default", "") for n in weights} == set(adapter)
    for n, w in weights.items():
        assert torch.equal(adapter[n.replace(".default", "")], w), n
    ref_losses, ref_weights = plain_peft_on_dequantised_base(kind)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert weights.keys() == ref_weights.keys()
    for n, ref in ref_weights.items():
        err = (weights[n] - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)
        assert err < 1e-5, f"{n}: relative difference {err:.2e}"


def swap_dirs(nvme_dir) -> list:
    return sorted(nvme_dir.rglob("infinity-*"))


def test_a_group_size_that_does_not_divide_the_rows_is_refused_naming_the_parameter(nvme_dir):
    cfg = config(nvme_dir, "nf4")
    cfg["weight_quantization"]["quantized_initialization"]["group_size"] = 64
    model = lora(build("llama", seed=0))
    with pytest.raises(
        ConfigError,
        match=r"frozen parameter 'base_model\.model\.model\.embed_tokens\.weight' \(128, 32\) has rows "
        r"of 32 elements, which do not divide into groups of 64; set weight_quantization\."
        r"quantized_initialization\.group_size to 32",
    ):
        infinity.initialize(model, cfg)
    assert swap_dirs(nvme_dir) == []


def test_quantising_a_parameter_that_trains_is_refused_naming_it(nvme_dir):
    """quantized_initialization alone asks for every matrix quantised; the adapters train."""
    cfg = config(nvme_dir, "nf4", nontrainable=False)
    with pytest.raises(
        ConfigError,
        match=r"'base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A\.default\.weight' "
        r"trains.*Freeze it.*zero_quantized_nontrainable_weights to true",
    ):
        infinity.initialize(lora(build("llama", seed=0)), cfg)
    assert swap_dirs(nvme_dir) == []


def test_a_quantised_base_needs_stage_3(nvme_dir):
    cfg = config(nvme_dir, None)
    cfg["zero_optimization"]["stage"] = 2
    del cfg["zero_optimization"]["offload_param"]
    with pytest.raises(ConfigError, match="zero_optimization.stage is 2; set the stage to 3"):
        infinity.initialize(lora(build("llama", seed=0)), cfg)


def test_nf4_needs_num_bits_4(nvme_dir):
    cfg = config(nvme_dir, "nf4")
    cfg["weight_quantization"]["quantized_initialization"]["num_bits"] = 8
    with pytest.raises(ConfigError, match='quant_type "nf4" stores 4 bits.*set num_bits to 4'):
        infinity.initialize(lora(build("llama", seed=0)), cfg)


def test_double_quant_needs_nf4(nvme_dir):
    cfg = config(nvme_dir, "int8")
    cfg["weight_quantization"]["quantized_initialization"]["double_quant"] = True
    with pytest.raises(
        ConfigError, match='double_quant quantises NF4 scales.*set quant_type to "nf4"'
    ):
        infinity.initialize(lora(build("llama", seed=0)), cfg)


def test_a_lora_config_naming_modules_the_model_lacks_is_refused_by_peft_naming_them(nvme_dir):
    """peft refuses it in get_peft_model, before initialize (nothing of the engine exists yet); under
    zero.Init too, where the model's parameters are already partitioned."""
    import peft

    model = build_under_init("llama", ds_config(nvme_dir), seed=0)
    config = peft.LoraConfig(r=4, target_modules=["qkv_proj"])
    with pytest.raises(
        ValueError, match=r"Target modules \{'qkv_proj'\} not found in the base model"
    ):
        peft.get_peft_model(model, config)
