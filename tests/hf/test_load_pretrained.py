"""infinity.zero.load_pretrained: what transformers' save_pretrained wrote, streamed into a partitioned model.

The oracle is transformers itself: the same directory loaded with ``from_pretrained`` into the plain
model gives the same logits, and the same missing / unexpected keys. The files are sharded
(``max_shard_size`` small) with ``model.safetensors.index.json``, as large models are saved.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

import infinity
from infinity.engine.checkpoint import export_checkpoint
from infinity.zero import load_pretrained
from infinity.zero.gathered import GatheredParameters
from tests.distributed import run_distributed
from tests.hf.models import ARCHS, batch, build, build_under_init, config, ds_config

SHARD = "20KB"  # each model in 6-11 shards


def _save(arch: str, path, *, dtype=torch.float32, seed: int = 7, **kw):
    """A model with other weights than build()'s (seed 7), saved as save_pretrained saves it."""
    model = build(arch, seed=seed).to(dtype)
    model.save_pretrained(path, safe_serialization=True, max_shard_size=SHARD, **kw)
    return path


def _logits(forward, arch: str) -> torch.Tensor:
    b = {k: v for k, v in batch(arch, 0).items() if k != "labels"}
    if arch == "t5":
        b["decoder_input_ids"] = batch(arch, 0)["labels"]
    with torch.no_grad():
        return forward(**b).logits


def _from_pretrained(arch: str, path, **kw):
    return ARCHS[arch][0].from_pretrained(path, **kw).eval()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_sharded_checkpoint_before_initialize_gives_from_pretrained_logits(
    arch, nvme_dir, tmp_path
):
    path = _save(arch, tmp_path / "ckpt")
    assert (path / "model.safetensors.index.json").exists() and len(
        list(path.glob("model-*.safetensors"))
    ) > 3
    cfg = ds_config(nvme_dir)
    model = build_under_init(arch, cfg)
    result = load_pretrained(model, path)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert isinstance(result, type(torch.nn.Linear(1, 1).load_state_dict({}, strict=False)))
    assert all(p.numel() == 0 for p in model.parameters()), "load_pretrained made parameters whole"
    engine = infinity.initialize(model, cfg)
    try:
        engine.eval()
        assert torch.equal(_logits(engine, arch), _logits(_from_pretrained(arch, path), arch))
    finally:
        engine.close()


@pytest.mark.parametrize(
    "arch", ["llama", "gpt_neox"]
)  # untied; GPT-NeoX writes lm_head as embed_out
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_checkpoint_into_a_running_engine(arch, precision, nvme_dir, tmp_path):
    """After initialize: a module at a time under GatheredParameters(modifier_rank=0), into the
    parameters and the optimizer's fp32 masters alike — every element, also one whose bf16 value the
    load leaves as it was (in bf16 the masters hold the bf16 values, upcast: load before initialize to
    keep the file's fp32 values there)."""
    path = _save(arch, tmp_path / "ckpt")
    cfg = ds_config(nvme_dir, precision=precision)
    engine = infinity.initialize(build_under_init(arch, cfg), cfg)
    try:
        engine.train()
        loss = engine(
            **batch(arch, 0)
        ).loss  # a step on the random weights first: moments, a live trace
        engine.backward(loss)
        engine.step()
        assert load_pretrained(engine, path) == ([], [])
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        ref = _from_pretrained(arch, path, dtype=dtype)
        engine.eval()
        assert torch.equal(_logits(engine, arch), _logits(ref, arch))
        ckpt = engine.save_checkpoint(tmp_path / "train")
    finally:
        engine.close()
    masters = load_file(
        str(export_checkpoint(ckpt, tmp_path / "masters.safetensors", progress=False))
    )
    for n, p in ref.named_parameters():
        assert torch.equal(masters[n], p.detach().float()), (
            n
        )  # what the next optimizer step starts from


@pytest.mark.parametrize("file_dtype", [torch.bfloat16, torch.float16])
def test_16bit_files_are_converted_to_the_models_dtype(file_dtype, nvme_dir, tmp_path):
    path = _save("gpt2", tmp_path / "ckpt", dtype=file_dtype)
    cfg = ds_config(nvme_dir)
    model = build_under_init("gpt2", cfg)
    load_pretrained(model, path)
    engine = infinity.initialize(model, cfg)
    try:
        with GatheredParameters(engine):
            ref = _from_pretrained("gpt2", path, dtype=torch.float32)
            for n, p in model.named_parameters():
                assert p.dtype == torch.float32 and torch.equal(p, ref.get_parameter(n)), n
    finally:
        engine.close()


def test_base_model_prefix_is_added_and_removed_as_transformers_does(nvme_dir, tmp_path):
    """A LlamaModel checkpoint (no "model." prefix) into LlamaForCausalLM, and back."""
    torch.manual_seed(3)
    base = tf.LlamaModel(config("llama"))
    base.save_pretrained(tmp_path / "base", max_shard_size=SHARD)
    _save("llama", tmp_path / "lm")
    cfg = ds_config(nvme_dir)

    model = build_under_init("llama", cfg)
    got = load_pretrained(model, tmp_path / "base", strict=False)
    _, info = tf.LlamaForCausalLM.from_pretrained(tmp_path / "base", output_loading_info=True)
    assert set(got.missing_keys) == set(info["missing_keys"]) == {"lm_head.weight"}
    assert got.unexpected_keys == []
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "lm_head.weight"'):
        load_pretrained(model, tmp_path / "base")
    with GatheredParameters(model):
        assert torch.equal(model.model.embed_tokens.weight, base.embed_tokens.weight)

    torch.manual_seed(0)
    with infinity.zero.Init(cfg):
        bare = tf.LlamaModel(config("llama"))
    got = load_pretrained(bare, tmp_path / "lm", strict=False)
    _, info = tf.LlamaModel.from_pretrained(tmp_path / "lm", output_loading_info=True)
    assert got.missing_keys == [] and got.unexpected_keys == ["lm_head.weight"]
    assert set(info["unexpected_keys"]) == {"lm_head.weight"}


def test_strict_refuses_before_writing_and_non_strict_reports_as_load_state_dict(
    nvme_dir, tmp_path
):
    plain = build("opt")
    state = {
        k: v for k, v in plain.state_dict().items() if k != "lm_head.weight"
    }  # tied: saved once
    state.pop("model.decoder.layers.1.fc2.bias")
    state["model.decoder.extra.weight"] = torch.ones(3)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = ds_config(nvme_dir)
    model = build_under_init("opt", cfg, seed=5)
    with GatheredParameters(model):
        before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError) as e:
        load_pretrained(model, tmp_path)
    msg = str(e.value)
    assert (
        '"model.decoder.layers.1.fc2.bias"' in msg
        and '"model.decoder.extra.weight"' in msg
        and "strict=False" in msg
    )
    with GatheredParameters(model):
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), f"{k} changed by a refused load"
    want = copy.deepcopy(plain).load_state_dict(state, strict=False)
    got = load_pretrained(
        model, tmp_path / "model.safetensors", strict=False
    )  # a file path works too
    assert got.unexpected_keys == want.unexpected_keys
    assert got.missing_keys == [
        k for k in want.missing_keys if k != "lm_head.weight"
    ]  # loaded through its tie
    with GatheredParameters(model):
        assert torch.equal(model.lm_head.weight, plain.model.decoder.embed_tokens.weight)
        assert torch.equal(
            model.model.decoder.layers[1].fc2.bias, before["model.decoder.layers.1.fc2.bias"]
        )


def test_a_checkpoint_of_another_shape_is_refused_before_anything_is_written(nvme_dir, tmp_path):
    cfg_big = config("gpt2")
    cfg_big.n_embd = 48
    torch.manual_seed(0)
    ARCHS["gpt2"][0](cfg_big).save_pretrained(tmp_path)
    model = build_under_init("gpt2", ds_config(nvme_dir))
    with GatheredParameters(model):
        before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        RuntimeError,
        match=r"size mismatch for transformer\.wte\.weight: .*\[128, 48\].*\[128, 32\]",
    ):
        load_pretrained(model, tmp_path, strict=False)
    with GatheredParameters(model):
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_what_is_not_a_safetensors_checkpoint_is_named(tmp_path):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(
        FileNotFoundError, match="neither model.safetensors nor model.safetensors.index.json"
    ):
        load_pretrained(model, tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(
        FileNotFoundError, match=r"pytorch_model\.bin, a pickle checkpoint.*safe_serialization=True"
    ):
        load_pretrained(model, tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ValueError, match="header claims 16 bytes"):
        load_pretrained(model, tmp_path)
    _save("gpt2", tmp_path / "sharded")
    (tmp_path / "sharded" / "model-00002-of-00008.safetensors").unlink()
    with pytest.raises(
        FileNotFoundError,
        match=r"names the shard 'model-00002-of-00008\.safetensors', which is missing",
    ):
        load_pretrained(build("gpt2"), tmp_path / "sharded")


def _load_at_rank(rank: int, path: str, nvme: str) -> dict:
    cfg = ds_config(nvme)  # each rank swaps under nvme/rank<N>
    model = build_under_init("llama", cfg)
    load_pretrained(model, path)  # each rank reads its own slice of each tensor
    engine = infinity.initialize(model, cfg)
    try:
        with GatheredParameters(engine):
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        engine.close()


@pytest.mark.distributed
def test_world_size_2_each_rank_loads_its_slice(nvme_dir, tmp_path):
    path = _save("llama", tmp_path / "ckpt")
    ref = _from_pretrained("llama", path)
    for weights in run_distributed(_load_at_rank, str(path), str(nvme_dir), world_size=2):
        for n, p in ref.named_parameters():
            assert (weights[n] == p.detach().numpy()).all(), n
