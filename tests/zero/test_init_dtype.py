"""zero.Init's dtype ([Note: zero.Init's dtype] in infinity/zero/init.py): floating-point parameters are
partitioned in the dtype of ``dtype=``, else of the config's bf16 / fp16 section, as DeepSpeed's
zero.Init casts them; buffers stay as built.

Oracles: the same transformers model built in plain PyTorch (fp32) and cast, what ``from_pretrained``
loads in plain transformers, cast; training against mixed precision written by hand
(tests/hf/reference.py), its masters starting from the values at rest.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import infinity
from infinity.zero.gathered import GatheredParameters
from infinity.zero.init import init_store_of
from tests.hf.models import build, build_under_init, ds_config
from tests.hf.reference import mixed_run
from tests.hf.test_training import STEPS, engine_run


def whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    with GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_rests_as_cast(model: torch.nn.Module, plain: torch.nn.Module, dtype: torch.dtype):
    """Every parameter of ``model`` (built under zero.Init) rests in ``dtype`` and holds the plain
    model's values cast to it; buffers keep the plain model's dtype and values."""
    store = init_store_of(list(model.parameters()))
    assert store is not None
    for n, p in model.named_parameters():
        assert p.dtype == dtype and store.records[p].dtype == dtype, n
    got = whole(model)
    for n, p in plain.named_parameters():
        assert got[n].dtype == dtype and torch.equal(got[n], p.detach().to(dtype)), n
    for (n, b), (_, want) in zip(model.named_buffers(), plain.named_buffers(), strict=True):
        assert b.dtype == want.dtype and torch.equal(b, want), n


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_model_built_in_fp32_under_a_16bit_config_is_partitioned_in_16_bits(
    arch, precision, nvme_dir
):
    """The parent's _init_weights runs on fp32 values and each is rounded once: the plain model, cast."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    model = build_under_init(arch, ds_config(nvme_dir, precision=precision), seed=0)
    assert_rests_as_cast(model, build(arch, seed=0), dtype)


def test_an_fp32_config_keeps_the_dtype_a_model_was_built_in(nvme_dir):
    """A model built in bf16 (the default dtype bf16 while it is made) waits in bf16."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        plain = build("llama", seed=0)
        model = build_under_init("llama", ds_config(nvme_dir), seed=0)
    finally:
        torch.set_default_dtype(before)
    assert_rests_as_cast(model, plain, torch.bfloat16)


def test_dtype_wins_over_the_config_as_in_deepspeed(nvme_dir):
    """infinity.zero.Init(dtype=...) over the config's bf16 (DeepSpeed's face:
    tests/compat/test_init_dtype.py, where the process group it makes is cleaned up)."""
    kept = build_under_init("llama", ds_config(nvme_dir, precision="bf16"), dtype=torch.float32)
    assert_rests_as_cast(kept, build("llama", seed=0), torch.float32)


def test_a_dtype_deepspeed_does_not_partition_in_is_refused(nvme_dir):
    with pytest.raises(ValueError, match=r"zero.Init\(dtype=torch.float64\).*torch.bfloat16"):
        infinity.zero.Init(ds_config(nvme_dir), dtype=torch.float64)


def test_from_pretrained_under_a_bf16_config_loads_into_bf16_shards(nvme_dir, tmp_path):
    """An fp32 checkpoint read into bf16 shards: plain transformers' load, cast."""
    build("llama", seed=3).save_pretrained(tmp_path / "ckpt")
    plain = tf.LlamaForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    with infinity.zero.Init(ds_config(nvme_dir, precision="bf16")):
        model = tf.LlamaForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert_rests_as_cast(model, plain, torch.bfloat16)


def test_dtype_float32_keeps_fp32_starting_masters_under_a_bf16_config(nvme_dir):
    """The explicit dtype: at rest in fp32 until initialize, whose masters start from the fp32 values
    as built (the oracle without rounded_start), the parameters training in bf16."""
    ref, masters = mixed_run("llama", torch.bfloat16, steps=STEPS)
    losses, weights, _, _ = engine_run(
        "llama", ds_config(nvme_dir, precision="bf16"), steps=STEPS, init_dtype=torch.float32
    )
    for k, v in ref.items():
        assert losses[k] == pytest.approx(v, rel=1e-4), k
    for name, master in masters.items():
        assert weights[name].dtype == torch.bfloat16
        torch.testing.assert_close(weights[name], master.to(torch.bfloat16), msg=name)
