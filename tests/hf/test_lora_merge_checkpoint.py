"""``infinity export --merge-adapters``: a LoRA run's checkpoint merged into its base without the
training script's engine ([Note: merging from a checkpoint] in
infinity/engine/checkpoint/merged_checkpoint.py).

Oracles: PEFT's own ``merge_and_unload()`` on a plain model holding the same adapters (over the base
dequantised by bitsandbytes where it rests in NF4), transformers' ``from_pretrained`` for what the
export wrote, and the live engine's ``save_merged`` at the step the checkpoint was saved (equal bytes).
"""

from __future__ import annotations

import json

import peft
import pytest
import safetensors.torch
import torch
import transformers

import infinity
from infinity.cli import main as cli_main
from infinity.engine.checkpoint import CheckpointMismatchError, export_merged
from tests.hf.lora import assert_loads_as, lora
from tests.hf.models import build, build_under_init, ds_config
from tests.hf.test_lora_quantised import dequantised
from tests.hf.test_lora_quantised_checkpoint import SEED, make_engine, train


def peft_merged(base: torch.nn.Module, adapters: dict, kind: str | None) -> torch.nn.Module:
    """PEFT's merge_and_unload of ``adapters`` over ``base`` (dequantised as ``kind`` says)."""
    model = lora(base)
    with torch.no_grad():
        for p in model.parameters():
            if kind is not None and not p.requires_grad and p.dim() >= 2:
                p.copy_(dequantised(p, kind))
    missing, unexpected = model.load_state_dict(adapters, strict=False)
    assert not unexpected and not {n for n in missing if ".lora_" in n}
    return model.merge_and_unload()


def trained_checkpoint(nvme_dir, tmp_path, kind, source):
    """A LoRA run trained 2 steps and checkpointed; its live save_merged and adapters beside it."""
    pretrained = None
    if source == "files":
        pretrained = tmp_path / "base"
        build("llama", seed=SEED["files"]).save_pretrained(pretrained)
    engine = make_engine(nvme_dir, kind, pretrained)
    try:
        train(engine, 0, 2)  # B is zero at the start: trained, the merge changes the weights
        ckpt = engine.save_checkpoint(tmp_path / "ckpt")
        live = engine.save_merged(tmp_path / "live")
        adapters = {n: t for n, t in engine.gathered_state_dict().items() if ".lora_" in n}
    finally:
        engine.close()
    return ckpt, live, adapters


@pytest.mark.parametrize("kind,source", [(None, "saved"), ("nf4", "files"), ("nf4", "saved")])
def test_a_checkpoint_merges_from_the_command_line_as_peft_and_the_live_engine_do(
    kind, source, nvme_dir, tmp_path
):
    _, live, adapters = trained_checkpoint(nvme_dir, tmp_path, kind, source)
    assert any(t.abs().max() > 0 for n, t in adapters.items() if ".lora_B." in n)
    out = tmp_path / "merged"
    args = ["export", "--merge-adapters", str(tmp_path / "ckpt"), str(out), "--no-progress"]
    assert cli_main.main(args) == 0

    written = safetensors.torch.load_file(out / "model.safetensors")
    assert not any("lora_" in n or "base_layer" in n for n in written)
    same = safetensors.torch.load_file(live / "model.safetensors")
    assert written.keys() == same.keys()
    for n, w in same.items():
        assert torch.equal(written[n], w), n
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (live / "config.json").read_text()
    )

    want = peft_merged(build("llama", seed=SEED[source]), adapters, kind)
    assert_loads_as(out, want)


def test_a_16bit_export_of_an_fp32_run_is_the_fp32_merge_rounded_once(nvme_dir, tmp_path):
    """--dtype bf16 of an fp32 run: PEFT's merge on the model as it trained, then converted."""
    ckpt, _, adapters = trained_checkpoint(nvme_dir, tmp_path, None, "saved")
    out = export_merged(ckpt, tmp_path / "bf16", dtype=torch.bfloat16, progress=False)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    want = peft_merged(build("llama", seed=SEED["saved"]), adapters, None).to(torch.bfloat16)
    ref, got = want.state_dict(), loaded.state_dict()
    assert got.keys() == ref.keys()
    for n, w in ref.items():
        assert got[n].dtype == torch.bfloat16, n
        assert torch.equal(got[n], w), n


def test_a_checkpoint_without_adapters_has_nothing_to_merge(nvme_dir, tmp_path, capsys):
    cfg = ds_config(nvme_dir)
    engine = infinity.initialize(build_under_init("llama", cfg, seed=0), cfg)
    try:
        engine.save_checkpoint(tmp_path / "ckpt")
    finally:
        engine.close()
    args = ["export", "--merge-adapters", str(tmp_path / "ckpt"), str(tmp_path / "o")]
    assert cli_main.main(args) == 1
    err = capsys.readouterr().err
    assert "holds no PEFT adapters: nothing to merge" in err
    assert "infinity export (without --merge-adapters)" in err
    assert not (tmp_path / "o").exists()


def test_an_output_file_is_refused_for_a_directory(tmp_path):
    with pytest.raises(ValueError, match="a Hugging Face directory.*give a directory"):
        export_merged(tmp_path / "ckpt", tmp_path / "merged.safetensors")


@pytest.mark.parametrize(
    "edit,error,match",
    [
        ({"use_dora": True}, ValueError, r"'.*q_proj' \(adapter 'default'\) has DoRA"),
        (
            {"target_modules": {"k_proj"}},
            CheckpointMismatchError,
            r"do not rebuild its model: tensor",
        ),
    ],
)
def test_an_adapter_config_that_cannot_merge_is_refused_before_anything_is_written(
    edit, error, match, nvme_dir, tmp_path, monkeypatch
):
    """The checkpoint's LoraConfig read as if it said DoRA (PEFT cannot wrap a partitioned model in
    DoRA, so no run here saves one), or as if it wrapped other layers than the checkpoint holds."""
    engine = make_engine(nvme_dir, None)
    try:
        ckpt = engine.save_checkpoint(tmp_path / "ckpt")
    finally:
        engine.close()
    real = peft.LoraConfig.from_pretrained

    def edited(*a, **k):
        cfg = real(*a, **k)
        for key, value in edit.items():
            setattr(cfg, key, value)
        return cfg

    monkeypatch.setattr(peft.LoraConfig, "from_pretrained", edited)
    with pytest.raises(error, match=match):
        export_merged(ckpt, tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists()


def test_gathering_from_the_nodes_outside_a_process_group_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"gather_nodes=True\) is a collective of a process group"):
        export_merged(tmp_path / "ckpt", tmp_path / "merged", gather_nodes=True)
    assert not (tmp_path / "merged").exists()
