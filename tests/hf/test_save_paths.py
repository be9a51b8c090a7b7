"""The model a user holds after ``infinity.initialize`` (stage 3, parameters on NVMe) saves the way its
framework saves it: ``model.state_dict()``, ``torch.save(model.state_dict())``,
``model.save_pretrained(dir)`` (transformers) and ``PeftModel.save_pretrained(dir)``
([Note: saving a partitioned model] in infinity/engine/saving.py).

Three oracles, none of them infinity's save code: the weights the engine holds, read through
``GatheredParameters`` (what is saved must equal them bit for bit); the same model trained in plain
PyTorch (torch AdamW, foreach=False), which the engine's weights equal within the noise torch's own
fused-vs-foreach AdamW shows on the same run; and the libraries' readers (``from_pretrained``,
``PeftModel.from_pretrained``, ``torch.load``) plus a header read by hand (tests/hf/saved_files.py)
for the files' sizes.
"""

from __future__ import annotations

import json
import warnings

import peft
import pytest
import torch
from safetensors.torch import load_file

import infinity
from infinity.engine import saving
from infinity.zero.gathered import GatheredParameters
from tests.hf.lora import lora, peft_quietly
from tests.hf.models import ARCHS, batch, build, ds_config
from tests.hf.reference import plain_train
from tests.hf.saved_files import claimed_nbytes, folder_nbytes

STEPS = 3
# torch's fused and foreach AdamW, on the same run, differ by up to this fraction of a tensor's
# largest value (on elements whose gradient is near zero, where eps dominates the update).
ADAMW_NOISE = 5e-4
saving_gather_unit = saving.gather_unit


def train(model: torch.nn.Module, arch: str, nvme_dir):
    """``model`` under a stage-3 engine (parameters and Adam state on NVMe), trained as plain_trained
    trains; returns the engine."""
    engine = infinity.initialize(model, ds_config(nvme_dir))
    for step in range(STEPS):
        torch.manual_seed(step)
        loss = engine(**batch(arch, step)).loss
        engine.backward(loss)
        engine.step()
    return engine


def held(engine) -> dict[str, torch.Tensor]:
    """Every state_dict entry of the engine's model as the engine holds it, gathered by GatheredParameters."""
    with GatheredParameters(engine):
        return {k: v.detach().clone() for k, v in engine.module.state_dict(keep_vars=True).items()}


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def assert_within_adamw_noise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert (got[k] - v).abs().max() <= ADAMW_NOISE * v.abs().max(), k


def param_nbytes(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """Bytes of the model's parameters, tied ones once."""
    return sum(
        p.numel() * p.element_size()
        for p in model.parameters()
        if p.requires_grad or not trainable_only
    )


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_state_dict_and_torch_save_hold_the_trained_weights(arch, nvme_dir, tmp_path):
    model = build(arch)
    engine = train(model, arch, nvme_dir)
    try:
        want = held(engine)
        state = model.state_dict()
        torch.save(model.state_dict(), tmp_path / "sd.pt")
        sub = (
            model.model.layers[0].mlp.state_dict()
            if arch == "llama"
            else model.transformer.h[0].mlp.state_dict()
        )
    finally:
        engine.close()
    assert all(v.numel() > 0 for v in state.values())
    assert_equal(state, want)
    loaded = torch.load(tmp_path / "sd.pt", weights_only=True)
    assert_equal(loaded, want)
    assert (tmp_path / "sd.pt").stat().st_size >= param_nbytes(build(arch))
    prefix = "model.layers.0.mlp." if arch == "llama" else "transformer.h.0.mlp."
    assert_equal(sub, {k.removeprefix(prefix): v for k, v in want.items() if k.startswith(prefix)})
    plain = build(arch)
    plain.load_state_dict(loaded, strict=True)  # plain torch takes it as it is
    plain_train(plain := build(arch), arch, steps=STEPS)
    assert_within_adamw_noise(want, plain.state_dict())


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_save_pretrained_writes_what_from_pretrained_loads(arch, nvme_dir, tmp_path):
    model = build(arch)
    engine = train(model, arch, nvme_dir)
    out = tmp_path / "a" / "b"  # folders created as save_pretrained creates them
    try:
        want = held(engine)
        model.save_pretrained(out, max_shard_size="30KB")
        engine.save_pretrained(tmp_path / "one")  # the engine's call: under "50GB", one file
    finally:
        engine.close()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and {f.name for f in out.glob("*.safetensors")} == shards
    assert (out / "config.json").is_file() and (out / "generation_config.json").is_file()
    plain_dir = tmp_path / "plain"
    build(arch).save_pretrained(plain_dir, max_shard_size="30KB")
    assert set(index["weight_map"]) == set(
        json.loads((plain_dir / "model.safetensors.index.json").read_text())["weight_map"]
    )
    # the files hold every byte they claim, and what they claim is the model's parameters
    assert folder_nbytes(out) == folder_nbytes(tmp_path / "one") == param_nbytes(build(arch))
    assert index["metadata"]["total_size"] == param_nbytes(build(arch))
    cls = ARCHS[arch][0]
    for folder in (out, tmp_path / "one"):
        reloaded = cls.from_pretrained(folder)
        assert_equal(reloaded.state_dict(), want)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_peft_save_pretrained_writes_plain_peft_adapters(arch, nvme_dir, tmp_path, monkeypatch):
    model = lora(build(arch), arch, seed=5)
    engine = train(model, arch, nvme_dir)
    gathered = []

    def gather_unit(group, store, unit, fmt=None):
        gathered.append(unit)
        return saving_gather_unit(group, store, unit, fmt)

    monkeypatch.setattr(saving, "gather_unit", gather_unit)
    try:
        want_all = held(engine)
        model.save_pretrained(tmp_path / "adapter")
        trainable = [u for u in engine.checkpoint_parts().units if u.trainable and not u.persistent]
    finally:
        engine.close()
    want = peft.get_peft_model_state_dict(model, state_dict=want_all)
    # only the adapters were gathered, each once: the frozen base (most of the model) was never read
    assert sorted(u.index for u in gathered) == sorted(u.index for u in trainable) and trainable
    plain = lora(build(arch), arch, seed=5)
    plain_train(plain, arch, steps=STEPS)
    plain.save_pretrained(tmp_path / "plain")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == sorted(
        p.name for p in (tmp_path / "plain").iterdir()
    )
    ours, theirs = (
        json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("adapter", "plain")
    )
    assert ours == theirs
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert_equal(saved, want)
    assert claimed_nbytes(tmp_path / "adapter" / "adapter_model.safetensors") == param_nbytes(
        plain, True
    )
    assert_within_adamw_noise(saved, load_file(tmp_path / "plain" / "adapter_model.safetensors"))
    with peft_quietly():
        reloaded = peft.PeftModel.from_pretrained(build(arch), tmp_path / "adapter")
    assert_equal(peft.get_peft_model_state_dict(reloaded), want)
    base = build(arch).state_dict()  # the frozen base is the one the run started from
    assert_equal(
        {k: v for k, v in reloaded.base_model.model.state_dict().items() if "lora_" not in k},
        _base_names(reloaded, base),
    )


def _base_names(model: peft.PeftModel, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain model's state dict under the names PEFT's wrapped layers give it (``base_layer``)."""
    names = [k for k in model.base_model.model.state_dict() if "lora_" not in k]
    return {n: base[n.replace("base_layer.", "")] for n in names}


def test_calls_that_cannot_be_honoured_are_refused(nvme_dir, tmp_path):
    model = build("llama")
    engine = train(model, "llama", nvme_dir)
    try:
        with pytest.raises(ValueError, match=r"push_to_hub.*model.save_pretrained\(dir\)"):
            model.save_pretrained(tmp_path / "hub", push_to_hub=True)
        with pytest.raises(ValueError, match="variant"):
            model.save_pretrained(tmp_path / "v", variant="fp16")
        with pytest.raises(KeyError, match="no.such"):
            engine.gathered_state_dict(["no.such"])
        assert not (tmp_path / "hub").exists() and not (tmp_path / "v").exists()
    finally:
        engine.close()
    # after close the values are gone: refused, never (0,)-shaped tensors
    with pytest.raises(RuntimeError, match=r"closed.*engine.save_pretrained"):
        model.state_dict()
    with pytest.raises(RuntimeError, match="closed"):
        model.save_pretrained(tmp_path / "late")
    assert not list(tmp_path.glob("late/*.safetensors"))


def test_bf16_state_dict_is_the_training_dtype(nvme_dir, tmp_path):
    cfg = ds_config(nvme_dir, precision="bf16")
    model = build("llama")
    engine = infinity.initialize(model, cfg)
    loss = engine(**batch("llama", 0)).loss
    engine.backward(loss)
    engine.step()
    try:
        want = held(engine)
        state = model.state_dict()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            engine.save_pretrained(tmp_path / "hf")
    finally:
        engine.close()
    assert_equal(state, want)
    assert all(v.dtype == torch.bfloat16 for k, v in state.items() if "weight" in k)
    assert_equal(ARCHS["llama"][0].from_pretrained(tmp_path / "hf").state_dict(), want)
