"""Weights out in the Hugging Face layout: ``engine.save_16bit_model(dir)`` and ``infinity export CKPT DIR``
write what ``from_pretrained`` loads in plain PyTorch.

The oracle is transformers: the directory loaded with ``from_pretrained`` gives the engine's logits,
and its tensor names are those transformers' own ``save_pretrained`` writes for the same model.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import infinity
from infinity.cli import main as cli_main
from tests.hf.models import ARCHS, batch, build, build_under_init, ds_config
from tests.hf.test_load_pretrained import _from_pretrained, _logits


def _trained(arch: str, cfg: dict):
    engine = infinity.initialize(build_under_init(arch, cfg), cfg)
    engine.train()
    loss = engine(**batch(arch, 0)).loss
    engine.backward(loss)
    engine.step()
    engine.eval()
    return engine


def _saved_names(path) -> set[str]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    return set(load_file(str(path / "model.safetensors")))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_save_16bit_model_is_what_from_pretrained_loads(arch, nvme_dir, tmp_path):
    engine = _trained(arch, ds_config(nvme_dir))
    try:
        want = _logits(engine, arch)
        out = engine.save_16bit_model(tmp_path / "hf", max_shard_size="30KB")
    finally:
        engine.close()
    assert out == tmp_path / "hf" and (out / "config.json").exists()
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in shards}
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for f in shards for t in load_file(str(f)).values()
    )
    build(arch).save_pretrained(tmp_path / "plain")  # transformers' own names for this model
    assert _saved_names(out) == _saved_names(tmp_path / "plain")
    assert torch.equal(_logits(_from_pretrained(arch, out), arch), want)


def test_bf16_weights_and_config_dtype(nvme_dir, tmp_path):
    engine = _trained("llama", ds_config(nvme_dir, precision="bf16"))
    try:
        want = _logits(engine, "llama")
        out = engine.save_16bit_model(tmp_path / "hf")  # under "50GB": one file
    finally:
        engine.close()
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert all(
        t.dtype == torch.bfloat16 for t in load_file(str(out / "model.safetensors")).values()
    )
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = _from_pretrained("llama", out)
    assert (
        next(model.parameters()).dtype == torch.bfloat16
    )  # from_pretrained's "auto" dtype reads config.json
    assert torch.equal(_logits(model, "llama"), want)


def test_a_second_save_replaces_the_first_whatever_its_shards(nvme_dir, tmp_path):
    engine = _trained("gpt2", ds_config(nvme_dir))
    out = tmp_path / "hf"
    try:
        engine.save_16bit_model(out, max_shard_size="20KB")
        many = sorted(p.name for p in out.glob("model-*.safetensors"))
        engine.save_16bit_model(out, max_shard_size=40_000)
        fewer = sorted(p.name for p in out.glob("model-*.safetensors"))
        assert 1 < len(fewer) < len(many) and all(f"-of-{len(fewer):05d}" in n for n in fewer)
        engine.save_16bit_model(out)
        assert not list(out.glob("model-*")) and not (out / "model.safetensors.index.json").exists()
        want = _logits(engine, "gpt2")
        (out / "README.md").write_text("kept")  # not a weight file: left alone
        engine.save_16bit_model(out, max_shard_size="20KB")
        assert (
            not (out / "model.safetensors").exists() and (out / "README.md").read_text() == "kept"
        )
        assert not list(out.glob(".*")), "temporary files left behind"
    finally:
        engine.close()
    assert torch.equal(_logits(_from_pretrained("gpt2", out), "gpt2"), want)


def test_the_state_dict_layout_stays_available(nvme_dir, tmp_path):
    engine = _trained("gpt2", ds_config(nvme_dir))
    try:
        path = engine.save_16bit_model(tmp_path, "all.safetensors", layout="state_dict")
        with pytest.raises(ValueError, match="max_shard_size shards the Hugging Face layout"):
            engine.save_16bit_model(
                tmp_path, "x.safetensors", layout="state_dict", max_shard_size="1GB"
            )
        with pytest.raises(ValueError, match=r"'5 parsecs' is not a size.*'5GB'"):
            engine.save_16bit_model(tmp_path / "hf", max_shard_size="5 parsecs")
    finally:
        engine.close()
    model = build("gpt2")
    state = load_file(str(path))
    assert "lm_head.weight" in state and "transformer.wte.weight" in state  # every state_dict name
    model.load_state_dict(state, strict=True)


def test_cli_export_of_a_checkpoint_to_the_hf_layout(nvme_dir, tmp_path, capsys):
    engine = _trained("gpt_neox", ds_config(nvme_dir))
    try:
        want = _logits(engine, "gpt_neox")
        engine.save_checkpoint(tmp_path / "ckpt")
        engine.module.config.save_pretrained(tmp_path / "ckpt")  # where the HF Trainer puts it too
    finally:
        engine.close()
    out = tmp_path / "exported"
    assert (
        cli_main.main(
            [
                "export",
                str(tmp_path / "ckpt"),
                str(out),
                "--max-shard-size",
                "25KB",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "file(s) in" in capsys.readouterr().out
    assert len(list(out.glob("model-*.safetensors"))) > 1
    build("gpt_neox").save_pretrained(tmp_path / "plain")
    assert _saved_names(out) == _saved_names(
        tmp_path / "plain"
    )  # embed_out, as transformers writes it
    assert torch.equal(_logits(_from_pretrained("gpt_neox", out), "gpt_neox"), want)

    assert (
        cli_main.main(
            [
                "export",
                str(tmp_path / "ckpt"),
                str(tmp_path / "bf16"),
                "--dtype",
                "bf16",
                "--config",
                str(tmp_path / "ckpt" / "config.json"),
                "--no-progress",
            ]
        )
        == 0
    )
    model = _from_pretrained("gpt_neox", tmp_path / "bf16")
    assert next(model.parameters()).dtype == torch.bfloat16
    for n, p in _from_pretrained("gpt_neox", out).named_parameters():
        assert torch.equal(model.get_parameter(n), p.to(torch.bfloat16)), n

    # The checkpoint keeps the model's own config.json: with the copy beside it gone, the export
    # still writes a folder from_pretrained loads, with no flag.
    (tmp_path / "ckpt" / "config.json").unlink()
    assert (
        cli_main.main(
            ["export", str(tmp_path / "ckpt"), str(tmp_path / "noconfig"), "--no-progress"]
        )
        == 0
    )
    assert (tmp_path / "noconfig" / "config.json").exists()
    assert torch.equal(
        _logits(_from_pretrained("gpt_neox", tmp_path / "noconfig"), "gpt_neox"), want
    )
    assert (
        cli_main.main(
            [
                "export",
                str(tmp_path / "ckpt"),
                str(tmp_path / "x"),
                "--config",
                str(tmp_path / "nowhere"),
                "--no-progress",
            ]
        )
        == 1
    )
    assert "no config.json at" in capsys.readouterr().err
