"""``with infinity.zero.Init(cfg): AutoModel*.from_pretrained(dir)`` (what transformers runs under DeepSpeed
ZeRO-3) streams the checkpoint into the shards ([Note: from_pretrained under zero.Init]): the parameters
gathered, and the buffers, equal plain transformers' ``from_pretrained`` of the same directory bit for
bit, for several architectures, single-file and sharded safetensors, fp32, bf16 and fp16."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

import infinity
from infinity.zero.gathered import GatheredParameters
from infinity.zero.init import init_store_of
from tests.hf import models as hf

ARCHS = {
    "llama": (tf.AutoModelForCausalLM, lambda: hf.config("llama")),
    "gpt2": (tf.AutoModelForCausalLM, lambda: hf.config("gpt2")),  # lm_head tied to wte
    "opt": (tf.AutoModelForCausalLM, lambda: hf.config("opt")),
    "qwen2": (
        tf.AutoModelForCausalLM,
        lambda: tf.Qwen2Config(
            vocab_size=hf.VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
        ),
    ),
    "t5": (tf.AutoModelForSeq2SeqLM, lambda: hf.config("t5")),
}
FORMATS = {  # dtype, max_shard_size (None: one file)
    "fp32-single": (torch.float32, None),
    "bf16-sharded": (torch.bfloat16, "20KB"),
    "fp16-single": (torch.float16, None),
}


def _save(arch: str, fmt: str, directory) -> None:
    auto, config = ARCHS[arch]
    dtype, shard = FORMATS[fmt]
    torch.manual_seed(0)
    model = auto.from_config(config()).to(dtype)
    model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))


def _cfg(nvme_dir) -> dict:
    return {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(nvme_dir)},
        }
    }


def _assert_same_as_plain(model, plain) -> None:
    params = list(model.parameters())
    assert all(p.numel() == 0 for p in params)  # partitioned: nothing whole in memory
    ref_params, ref_buffers = dict(plain.named_parameters()), dict(plain.named_buffers())
    with GatheredParameters(params):
        got = dict(model.named_parameters())
        assert got.keys() == ref_params.keys()
        for n, p in got.items():
            assert p.dtype == ref_params[n].dtype and torch.equal(p, ref_params[n]), n
    got_buffers = dict(model.named_buffers())
    assert got_buffers.keys() == ref_buffers.keys()
    for n, b in got_buffers.items():
        assert b.device.type == "cpu" and torch.equal(b, ref_buffers[n]), n


# fp16 once (Llama): the dtype path is the same for every architecture.
CASES = [(a, f) for a in ARCHS for f in FORMATS if f != "fp16-single" or a == "llama"]


@pytest.mark.parametrize(("arch", "fmt"), CASES)
def test_from_pretrained_under_init_equals_plain_from_pretrained(arch, fmt, tmp_path, nvme_dir):
    _save(arch, fmt, tmp_path / "m")
    if FORMATS[fmt][1]:
        assert len(list((tmp_path / "m").glob("*.safetensors"))) > 1
    auto, _ = ARCHS[arch]
    plain = auto.from_pretrained(tmp_path / "m")
    with infinity.zero.Init(_cfg(nvme_dir)):
        model = auto.from_pretrained(tmp_path / "m")
    assert type(model) is type(plain)
    if arch == "gpt2":
        assert (
            model.lm_head.weight is model.transformer.wte.weight
        )  # tied as transformers ties them
    store = init_store_of(model.parameters())
    assert store is not None and all(store.source(p) is not None for p in model.parameters())
    _assert_same_as_plain(model, plain)


def test_missing_weights_are_initialised_as_plain_from_pretrained_does(tmp_path, nvme_dir):
    """A tensor the files lack is reported missing and initialised by transformers (the same RNG draws)."""
    _save("llama", "fp32-single", tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    state = load_file(str(path))
    del state["lm_head.weight"]
    save_file(state, str(path), metadata={"format": "pt"})
    torch.manual_seed(5)
    plain, info = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "m", output_loading_info=True)
    torch.manual_seed(5)
    with infinity.zero.Init(_cfg(nvme_dir)):
        model, got = tf.AutoModelForCausalLM.from_pretrained(
            tmp_path / "m", output_loading_info=True
        )
    assert got["missing_keys"] == info["missing_keys"] == {"lm_head.weight"}
    _assert_same_as_plain(model, plain)


def test_the_model_trains_after_it(tmp_path, nvme_dir):
    """initialize takes the model as any model built under zero.Init."""
    _save("llama", "fp32-single", tmp_path / "m")
    cfg = {
        **_cfg(nvme_dir),
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    with infinity.zero.Init(cfg):
        model = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    engine = infinity.initialize(model, cfg)
    try:
        b = hf.batch("llama", 0)
        assert engine(**b).loss.item() == plain(**b).loss.item()
    finally:
        engine.close()


def test_a_state_dict_is_refused_naming_what_to_do(tmp_path, nvme_dir):
    _save("llama", "fp32-single", tmp_path / "m")
    state = load_file(str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match="save_pretrained"), infinity.zero.Init(_cfg(nvme_dir)):
        tf.LlamaForCausalLM.from_pretrained(None, config=hf.config("llama"), state_dict=state)


def test_nested_contexts_patch_transformers_once_and_the_outer_restores_it(tmp_path):
    cls = tf.PreTrainedModel
    original = cls.__dict__["_load_pretrained_model"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with infinity.zero.Init(_cfg(tmp_path / "a")):
        patched = cls.__dict__["_load_pretrained_model"]
        assert patched is not original
        with infinity.zero.Init(_cfg(tmp_path / "b")):
            assert cls.__dict__["_load_pretrained_model"] is patched
        assert cls.__dict__["_load_pretrained_model"] is patched  # the outer context's, still open
    assert cls.__dict__["_load_pretrained_model"] is original
